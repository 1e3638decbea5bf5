"""Which URLs `ditdata fetch` downloads: http and https only.

img2dataset downloads with `urllib.request.urlopen`, whose default opener also serves
file://, ftp:// and data: URLs and follows redirects to ftp://. A URL list row such as
`file:///home/me/.ssh/id_rsa` would put a local file into the shards. Two layers stop it:

1. `screened` replaces every URL that is not a well-formed http(s) URL by a sentinel
   (`ditdata-refused:<code>`) before img2dataset sees the list; no opener can fetch that
   scheme, and the row keeps its position, hence its key.
2. `install` puts `safe_opener` in place of urllib's default opener: only http(s)
   handlers, redirects off http(s) refused, and any other scheme (the sentinel
   included) raises `RefusedURL`. `GuardedDownloader` installs it in img2dataset's worker
   processes (`guarded_img2dataset`).

img2dataset counts failures by `str(error)`, so `RefusedURL` stringifies to a short reason
from the fixed set in REASONS: hostile input cannot create unbounded failure keys.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import re
import urllib.error
import urllib.request
from collections import Counter
from urllib.parse import urljoin, urlsplit

from ditdata.common.progress import most_first

FETCHED_SCHEMES = ("http", "https")
# code (in the sentinel) -> reason label (in the failure counts); a fixed, small set
REASONS = {
    "file": "file scheme",
    "ftp": "ftp scheme",
    "data": "data scheme",
    "other": "other scheme",
    "local": "local path",
    "empty": "empty",
    "malformed": "malformed",
}
REFUSED_URL = "refused URL: "
REFUSED_REDIRECT = "refused redirect: "
SENTINEL = "ditdata-refused:"

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_DRIVE = re.compile(r"[A-Za-z]:[\\/]")  # C:\x.jpg is a Windows path, not scheme "c"
# http.client refuses these anywhere in a URL, with a message that quotes the URL
_BAD_CHARS = re.compile(r"[\x00-\x20\x7f]")


# ----------------------------------------------------------------------------- classifying


def refusal(url) -> str | None:
    """None when URL is an http(s) URL that `ditdata fetch` downloads, else the reason
    it is not fetched, e.g. "refused URL: file scheme" (see REASONS)."""
    code = refusal_code(url)
    return None if code is None else REFUSED_URL + REASONS[code]


def refusal_code(url) -> str | None:
    """The REASONS code of a URL that is not fetched, None for a fetchable one."""
    if url is None or (isinstance(url, float) and math.isnan(url)):  # pandas reads null as NaN
        return "empty"
    if not isinstance(url, str):
        return "malformed"
    url = url.strip()  # urllib strips surrounding whitespace too
    if not url:
        return "empty"
    m = _SCHEME.match(url)
    if m is None or _DRIVE.match(url):
        return "local"  # no scheme: to urllib an unknown type, to fsspec and open() a path
    scheme = m.group(1).lower()
    if scheme not in FETCHED_SCHEMES:
        return scheme if scheme in ("file", "ftp", "data") else "other"
    if _BAD_CHARS.search(url):
        return "malformed"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError:
        return "malformed"
    return None if parts.hostname else "malformed"


def screened(urls) -> list:
    """URLS with every refused one replaced by its sentinel (same length, same order)."""
    out = []
    for url in urls:
        code = refusal_code(url)
        out.append(url if code is None else SENTINEL + code)
    return out


def count_refusals(urls) -> Counter:
    """{reason label: count} over the refused URLS (fetchable ones are not counted)."""
    return Counter(REASONS[c] for c in map(refusal_code, urls) if c is not None)


def describe(counts: Counter) -> str:
    """"file scheme 3, local path 2": most frequent first."""
    return ", ".join(f"{k} {v}" for k, v in most_first(counts).items())


# ----------------------------------------------------------------------------- opening


class RefusedURL(urllib.error.URLError):
    """A URL or redirect target that is not fetched. str() is the bare reason because
    img2dataset records str(error) as the sample's error and counts failures by it."""

    def __str__(self) -> str:
        return str(self.reason)


def _request_reason(url: str) -> str:
    if url.startswith(SENTINEL):
        return REFUSED_URL + REASONS.get(url[len(SENTINEL):], REASONS["malformed"])
    return refusal(url) or REFUSED_URL + REASONS["other"]


class _RefuseOtherSchemes(urllib.request.BaseHandler):
    """The opener has no handler for anything but http(s), so every other scheme (and
    our sentinel) ends here; without it urllib would return None."""

    def unknown_open(self, req):
        raise RefusedURL(_request_reason(req.full_url))


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects between http(s) URLs only. urllib's own handler follows ftp://
    and refuses file:// with an error that quotes the target URL (an unbounded key)."""

    def http_error_302(self, req, fp, code, msg, headers):
        location = headers["location"] if "location" in headers else headers.get("uri")
        if location is not None:
            try:
                target = urljoin(req.full_url, location)
                scheme = urlsplit(target).scheme.lower()
            except ValueError:
                target, scheme = "", ""
            if scheme not in FETCHED_SCHEMES:
                fp.close()
                raise RefusedURL(REFUSED_REDIRECT + REASONS[refusal_code(target) or "malformed"])
        return super().http_error_302(req, fp, code, msg, headers)

    # the base class binds these aliases to its own http_error_302
    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        # newurl is joined and quoted by now; what is left to refuse is e.g. a missing host
        code_ = refusal_code(newurl)
        if code_ is not None:
            fp.close()
            raise RefusedURL(REFUSED_REDIRECT + REASONS[code_])
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def safe_opener() -> urllib.request.OpenerDirector:
    """An opener like urllib's default one minus file, ftp and data handlers, with
    http(s)-only redirects. Only http and https proxies are used: an ftp_proxy would
    let an ftp:// URL through as a proxied http request."""
    proxies = {k: v for k, v in urllib.request.getproxies().items() if k in FETCHED_SCHEMES}
    opener = urllib.request.OpenerDirector()
    for handler in (
        urllib.request.ProxyHandler(proxies),
        urllib.request.HTTPHandler(),
        urllib.request.HTTPSHandler(),
        urllib.request.HTTPDefaultErrorHandler(),
        _HttpOnlyRedirects(),
        urllib.request.HTTPErrorProcessor(),
        _RefuseOtherSchemes(),
    ):
        opener.add_handler(handler)
    return opener


_opener: urllib.request.OpenerDirector | None = None


def install() -> None:
    """Make `urllib.request.urlopen` use `safe_opener` in this process (idempotent: one
    opener per process, installed again in case something replaced it)."""
    global _opener
    if _opener is None:
        _opener = safe_opener()
    urllib.request.install_opener(_opener)


class GuardedDownloader:
    """An img2dataset Downloader that installs the safe opener in whichever process runs
    it: img2dataset pickles the downloader to its workers (spawned processes, pyspark or
    ray executors), and a class defined here unpickles there without side effects."""

    def __init__(self, downloader):
        self.downloader = downloader

    def __call__(self, row):
        install()
        return self.downloader(row)


@contextlib.contextmanager
def guarded_img2dataset():
    """While active, img2dataset's `download()` builds GuardedDownloaders."""
    # import_module: the package attribute img2dataset.main is its main() function
    main = importlib.import_module("img2dataset.main")
    real = main.Downloader
    main.Downloader = lambda *args, **kwargs: GuardedDownloader(real(*args, **kwargs))
    try:
        yield
    finally:
        main.Downloader = real
