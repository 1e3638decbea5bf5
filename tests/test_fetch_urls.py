"""`ditdata fetch` on a URL list downloads http and https URLs only: file://, ftp://,
data:, local paths, empty and malformed URLs and redirects off http(s) are refused and
counted by reason, and no local byte reaches a shard. A loopback HTTP server serves real
photos and redirects; a listening TCP socket stands in for an FTP server and records
whether anything connected to it."""

from __future__ import annotations

import base64
import json
import os
import pickle
import socket
import threading
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from test_fetch import real_images, run_cli, serve
from test_imageshards import encode

from ditdata.errors import DitdataError
from ditdata.fetch import fetch, urls
from ditdata.fetch.state import URL_COPIES
from ditdata.fetch.state import clear_previous as _clear_previous
from ditdata.fetch.urllists import _screened_copies
from ditdata.images import resize_image
from ditdata.imageshards.folder import iter_samples, list_shards, read_dataset_info, read_shard_stats

# ============================================================================ refusal()


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://example.com/a.jpg", None),
        ("https://example.com/a.jpg?w=512&h=512#x", None),
        ("HTTPS://EXAMPLE.COM/A.JPG", None),
        ("http://127.0.0.1:8080/a.jpg", None),
        ("http://[::1]:8080/a.jpg", None),
        ("http://user:pw@example.com/a.jpg", None),
        ("http://例え.jp/画像.jpg", None),  # non-ASCII is urllib's business, as before
        ("  https://example.com/a.jpg \n", None),  # urllib strips surrounding whitespace too
        ("file:///etc/passwd", "file scheme"),
        ("FILE:///etc/passwd", "file scheme"),
        ("file:etc/passwd", "file scheme"),
        ("file://localhost/etc/passwd", "file scheme"),
        ("ftp://127.0.0.1/a.jpg", "ftp scheme"),
        ("FTP://example.com/a.jpg", "ftp scheme"),
        ("data:image/png;base64,iVBORw0KGgo=", "data scheme"),
        ("DATA:,hello", "data scheme"),
        ("ftps://example.com/a.jpg", "other scheme"),
        ("gopher://example.com/", "other scheme"),
        ("javascript:alert(1)", "other scheme"),
        ("s3://bucket/a.jpg", "other scheme"),
        ("localhost:8080/a.jpg", "other scheme"),
        ("ditdata-refused:file", "other scheme"),  # a sentinel in the input is just a URL
        ("/etc/passwd", "local path"),
        ("./x.jpg", "local path"),
        ("../x.jpg", "local path"),
        ("x.jpg", "local path"),
        ("~/x.jpg", "local path"),
        ("C:\\images\\x.jpg", "local path"),
        ("c:/images/x.jpg", "local path"),
        ("example.com/a.jpg", "local path"),
        ("<URL:file:///etc/passwd>", "local path"),  # urllib would unwrap this to file://
        ("", "empty"),
        ("   \t", "empty"),
        (None, "empty"),
        (float("nan"), "empty"),  # pandas' null
        ("http://", "malformed"),
        ("https:///a.jpg", "malformed"),
        ("http:/example.com/a.jpg", "malformed"),
        ("http:example.com", "malformed"),
        ("http://user@/a.jpg", "malformed"),
        ("http://exa mple.com/a.jpg", "malformed"),
        ("http://example.com/a b.jpg", "malformed"),
        ("http://example.com/a.jpg\r\nX-Injected: 1", "malformed"),
        ("http://example.com/\x00.jpg", "malformed"),
        ("http://example.com/\x7f.jpg", "malformed"),
        ("http://example.com:99999/a.jpg", "malformed"),
        ("http://example.com:port/a.jpg", "malformed"),
        ("http://[::1/a.jpg", "malformed"),
        (42, "malformed"),
        (b"http://example.com/a.jpg", "malformed"),
    ],
)
def test_refusal(url, reason):
    assert urls.refusal(url) == (None if reason is None else f"refused URL: {reason}")


def test_reasons_are_a_small_fixed_set():
    hostile = [f"{s}://{uuid.uuid4().hex}/{i}" for i, s in enumerate(["xx", "ftp", "file", "zz"] * 50)]
    hostile += [f"/tmp/{uuid.uuid4().hex}", f"http://h/{uuid.uuid4().hex} x", None, ""]
    assert set(urls.count_refusals(hostile)) <= set(urls.REASONS.values())
    assert urls.count_refusals(hostile) == {"other scheme": 100, "ftp scheme": 50, "file scheme": 50,
                                            "local path": 1, "malformed": 1, "empty": 2}
    assert urls.screened(["https://a/b", "file:///x", None]) == [
        "https://a/b", "ditdata-refused:file", "ditdata-refused:empty"]
    assert urls.describe(urls.count_refusals(["/a", "file:///b", "/c"])) == "local path 2, file scheme 1"


# ============================================================================ fixtures


def _jpeg_with_marker(marker: str) -> bytes:
    """A valid JPEG (so a leak would become a sample) carrying MARKER in a comment."""
    arr = np.zeros((96, 96, 3), np.uint8)
    arr[::8] = (255, 0, 255)
    return encode(arr, "JPEG", quality=95, comment=marker.encode())


@pytest.fixture
def secret(tmp_path) -> tuple[Path, str]:
    """A local file that must never reach a shard: its name and bytes hold a unique marker."""
    marker = f"SECRET-{uuid.uuid4().hex}"
    path = tmp_path / "private" / f"{marker}.jpg"
    path.parent.mkdir()
    path.write_bytes(_jpeg_with_marker(marker))
    return path, marker


@pytest.fixture
def ftp_trap():
    """A listening TCP socket on 127.0.0.1 standing in for an FTP server; yields
    (port, connections) where connections lists every peer that connected."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.settimeout(0.1)
    connections: list = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conn, peer = sock.accept()
            except OSError:
                continue
            connections.append(peer)
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield sock.getsockname()[1], connections
    stop.set()
    thread.join(5)
    sock.close()


def _png_data_url(arr) -> str:
    return "data:image/png;base64," + base64.b64encode(encode(arr, "PNG")).decode()


@pytest.fixture
def web(secret, ftp_trap):
    """An HTTP server on 127.0.0.1 serving `files` {path: bytes} and these redirects:
    /r/file -> file://<secret>, /r/FILE -> FILE://<secret>, /r/ftp -> the ftp trap,
    /r/data -> a data: PNG, /r/ok -> /ok.jpg (an http image: still followed)."""
    files: dict[str, bytes] = {}
    ftp_port = ftp_trap[0]
    redirects = {
        "/r/file": f"file://{secret[0]}",
        "/r/FILE": f"FILE://{secret[0]}",
        "/r/ftp": f"ftp://127.0.0.1:{ftp_port}/a.jpg",
        "/r/data": _png_data_url(np.full((32, 32, 3), 200, np.uint8)),
        "/r/ok": "/ok.jpg",
    }

    with serve(files, redirects=redirects) as base:
        yield base, files


@pytest.fixture
def no_proxy(monkeypatch):
    for k in ("http_proxy", "https_proxy", "ftp_proxy", "all_proxy",
              "HTTP_PROXY", "HTTPS_PROXY", "FTP_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


@pytest.fixture(scope="module")
def photos() -> dict[str, np.ndarray]:
    return real_images()


# ============================================================================ the opener


def test_safe_opener(web, secret, ftp_trap, no_proxy):
    base, files = web
    files["/ok.jpg"] = b"real image bytes"
    opener = urls.safe_opener()
    with opener.open(base + "/ok.jpg", timeout=5) as r:
        assert r.read() == b"real image bytes"
    with opener.open(base + "/r/ok", timeout=5) as r:  # http -> http redirects still work
        assert r.read() == b"real image bytes"

    refused = {
        base + "/r/file": "refused redirect: file scheme",
        base + "/r/FILE": "refused redirect: file scheme",
        base + "/r/ftp": "refused redirect: ftp scheme",
        base + "/r/data": "refused redirect: data scheme",
        secret[0].as_uri(): "refused URL: file scheme",
        f"ftp://127.0.0.1:{ftp_trap[0]}/a.jpg": "refused URL: ftp scheme",
        "data:,hello": "refused URL: data scheme",
        "gopher://127.0.0.1/": "refused URL: other scheme",
        "ditdata-refused:local": "refused URL: local path",
        "ditdata-refused:empty": "refused URL: empty",
        "ditdata-refused:no-such-code": "refused URL: malformed",
    }
    for url, reason in refused.items():
        with pytest.raises(urls.RefusedURL) as e:
            opener.open(url, timeout=5)
        assert str(e.value) == reason, url
    assert ftp_trap[1] == []

    # the trap works: urllib's default opener follows the redirect to ftp:// and connects
    with pytest.raises(OSError):
        urllib.request.build_opener().open(base + "/r/ftp", timeout=5)
    assert len(ftp_trap[1]) == 1


def test_install_replaces_the_default_opener(secret, no_proxy):
    try:
        urls.install()
        first = urllib.request._opener
        urls.install()
        assert urllib.request._opener is first  # idempotent: one opener per process
        with pytest.raises(urls.RefusedURL, match="^refused URL: file scheme$"):
            urllib.request.urlopen(secret[0].as_uri(), timeout=5)
    finally:
        urllib.request.install_opener(None)
    with urllib.request.urlopen(secret[0].as_uri(), timeout=5) as r:  # what img2dataset did before
        assert secret[1].encode() in r.read()


def test_guarded_img2dataset_wraps_and_restores():
    main = pytest.importorskip("img2dataset.main", exc_type=ImportError)
    real = main.Downloader
    fields = dict(sample_writer_class=None, resizer=None, thread_count=1, save_caption=False,
                  extract_exif=False, output_folder="/nowhere", column_list=["url"], timeout=1,
                  number_sample_per_shard=1, oom_shard_count=5, compute_hash=None, verify_hash_type=None,
                  encode_format="jpg", retries=0, user_agent_token=None, disallowed_header_directives=None)
    with pytest.raises(RuntimeError), urls.guarded_img2dataset():
        d = main.Downloader(**fields)
        assert isinstance(d, urls.GuardedDownloader) and isinstance(d.downloader, real)
        # it travels to spawned workers and executors by pickle
        back = pickle.loads(pickle.dumps(d))
        assert isinstance(back.downloader, real) and back.downloader.column_list == ["url"]
        raise RuntimeError("restored even when download() fails")
    assert main.Downloader is real


# ============================================================================ the screened copies


def test_screened_copies_keep_rows_and_columns(tmp_path):
    import gzip

    rows = ["http://h/0.jpg", "file:///etc/passwd", "/etc/passwd", "https://h/3.jpg", "ftp://h/4", "./x.jpg"]
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.csv").write_text("URL,TEXT,similarity\n" + "".join(f"{u},cap {i},0.{i}\n" for i, u in enumerate(rows)))
    (src / "a.tsv").write_text("url\tcaption\n" + "".join(f"{u}\tcap {i}\n" for i, u in enumerate(rows)))
    (src / "a.jsonl").write_text("".join(json.dumps({"url": u, "text": f"cap {i}"}) + "\n" for i, u in enumerate(rows)))
    (src / "a.json").write_text(json.dumps([{"url": u, "text": f"cap {i}"} for i, u in enumerate(rows)]))
    (src / "a.txt").write_text("\n".join(rows) + "\n")
    with gzip.open(src / "b.csv.gz", "wt") as f:
        f.write("url,caption\n" + "".join(f"{u},cap {i}\n" for i, u in enumerate(rows)))
    pq.write_table(pa.table({"link": rows, "TEXT": [f"cap {i}" for i in range(6)], "junk": list(range(6))}),
                   src / "a.parquet")
    cases = {"a.csv": ("csv", ["URL", "TEXT", "similarity"]), "a.tsv": ("tsv", ["url", "caption"]),
             "a.jsonl": ("jsonl", ["url", "text"]), "a.json": ("json", ["url", "text"]),
             "a.txt": ("txt", ["url"]), "b.csv.gz": ("csv.gz", ["url", "caption"]),
             "a.parquet": ("parquet", ["link", "TEXT"])}
    expect = ["http://h/0.jpg", "ditdata-refused:file", "ditdata-refused:local", "https://h/3.jpg",
              "ditdata-refused:ftp", "ditdata-refused:local"]
    for name, (fmt, cols) in cases.items():
        out = tmp_path / f"out_{name}"
        out.mkdir()
        folder = _screened_copies(out, [src / name], fmt, [*cols, None], cols[0])
        assert folder == out / URL_COPIES
        assert sorted(p.name for p in folder.iterdir()) == ["00000.parquet", "inputs.json"]
        t = pq.read_table(folder / "00000.parquet")
        assert t.column_names == cols, name
        assert t.column(cols[0]).to_pylist() == expect, name
        if len(cols) > 1:
            assert t.column(cols[1]).to_pylist() == [f"cap {i}" for i in range(6)], name
    assert pq.read_table(tmp_path / "out_a.csv" / URL_COPIES / "00000.parquet").column("similarity").to_pylist() == (
        pytest.approx([i / 10 for i in range(6)]))

    # a folder of lists: one copy per list, in the order img2dataset reads them
    lists = tmp_path / "lists"
    lists.mkdir()
    for i in (1, 0, 2):
        pq.write_table(pa.table({"url": [f"http://h/{i}", f"/local/{i}"]}), lists / f"part{i}.parquet")
    out = tmp_path / "out_folder"
    out.mkdir()
    files = sorted(lists.iterdir())
    folder = _screened_copies(out, files, "parquet", ["url"], "url")
    got = [pq.read_table(folder / f"{i:05d}.parquet").column("url").to_pylist() for i in range(3)]
    assert got == [[f"http://h/{i}", "ditdata-refused:local"] for i in range(3)]

    # reused while the inputs are unchanged (a resume); written again once one changes
    before = (folder / "00001.parquet").stat().st_ino
    _screened_copies(out, files, "parquet", ["url"], "url")
    assert (folder / "00001.parquet").stat().st_ino == before
    pq.write_table(pa.table({"url": ["file:///x", "https://h/new"]}), lists / "part1.parquet")
    _screened_copies(out, files, "parquet", ["url"], "url")
    assert pq.read_table(folder / "00001.parquet").column("url").to_pylist() == ["ditdata-refused:file", "https://h/new"]


def test_overwrite_removes_the_copies(tmp_path):
    out = tmp_path / "out"
    (out / URL_COPIES).mkdir(parents=True)
    (out / URL_COPIES / "00000.parquet").write_bytes(b"x")
    (out / ".fetch_state").write_text("{}")
    (out / "00000.tar").write_bytes(b"")
    _clear_previous(out)
    assert list(out.iterdir()) == []


def test_a_list_without_http_urls_is_refused_up_front(tmp_path, secret):
    path, _ = secret
    rows = [path.as_uri(), "FILE://" + str(path), str(path), os.path.relpath(path), path.as_uri()]
    pq.write_table(pa.table({"url": rows}), tmp_path / "urls.parquet")
    r = run_cli("fetch", tmp_path / "urls.parquet", "--out", tmp_path / "shards", "-q", timeout=60)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr + r.stdout and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"Error: {tmp_path / 'urls.parquet'}: none of its 5 rows is an http(s) URL (file scheme 3, local path 2); "
        "ditdata fetch downloads only http and https URLs"
    ]
    assert not (tmp_path / "shards").exists()  # nothing written, not even the folder
    with pytest.raises(DitdataError, match="none of its 5 rows"):
        fetch(tmp_path / "urls.parquet", tmp_path / "shards")


# ============================================================================ end to end


def _leaks(out: Path, marker: str) -> list[str]:
    """Every file under OUT whose bytes contain MARKER."""
    return [str(p) for p in out.rglob("*") if p.is_file() and marker.encode() in p.read_bytes()]


def _check_pixels(sample, arr: np.ndarray, size: int) -> None:
    img = sample.decode()
    assert img.size == (size, size)
    ref = np.asarray(resize_image(Image.fromarray(arr), size, "center_crop")).astype(int)
    assert np.abs(np.asarray(img).astype(int) - ref).mean() < 12, sample.source


def _status_totals(out: Path) -> dict:
    totals: dict = {}
    for s in read_shard_stats(out).values():
        for k, v in s["status_dict"].items():
            totals[k] = totals.get(k, 0) + v
    return totals


@pytest.mark.slow
def test_parquet_fetches_only_http(tmp_path, web, secret, ftp_trap, photos):
    """A LAION-style parquet mixing real photos over http with every kind of non-http row
    and redirects off http: only the photos are fetched, at their keys, no local byte
    reaches OUT, nothing touches the ftp trap, and each reason is counted exactly."""
    base, files = web
    path, marker = secret
    ftp_port, ftp_connections = ftp_trap
    names = ["astronaut", "chelsea", "coffee", "rocket", "camera"]
    for name in names:
        files[f"/{name}.jpg"] = encode(photos[name], "JPEG", quality=95)
    files["/ok.jpg"] = files["/rocket.jpg"]
    urls_and_images = [
        (f"{base}/astronaut.jpg", "astronaut"),  # 0
        (path.as_uri(), None),
        (f"{base}/chelsea.jpg", "chelsea"),
        ("FILE://" + str(path), None),
        (f"ftp://127.0.0.1:{ftp_port}/a.jpg", None),
        (_png_data_url(np.ascontiguousarray(photos["coffee"][:64, :64])), None),  # 5
        (f"{base}/coffee.jpg", "coffee"),
        (str(path), None),
        (os.path.relpath(path), None),  # relative to the CLI's working directory
        ("", None),
        (None, None),  # 10
        ("http://", None),
        (f"{base}/a b.jpg", None),
        (f"{base}/\x01.jpg", None),
        (f"{base}/r/file", None),
        (f"{base}/r/ftp", None),  # 15
        (f"{base}/r/data", None),
        (f"{base}/r/ok", "rocket"),  # http -> http: followed
        (f"{base}/camera.jpg", "camera"),
    ]
    rows = [{"URL": u, "TEXT": f"row {i}", "similarity": i / 100} for i, (u, _) in enumerate(urls_and_images)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "urls.parquet")
    out = tmp_path / "shards"
    r = run_cli("fetch", tmp_path / "urls.parquet", "--out", out, "--image-size", 64, "--samples-per-shard", 8,
                "--processes", 1, "--threads", 4, "--keep-col", "similarity", "-q")
    assert r.returncode == 0, r.stderr + r.stdout

    reasons = {
        "refused URL: file scheme": 2, "refused URL: ftp scheme": 1, "refused URL: data scheme": 1,
        "refused URL: local path": 2, "refused URL: empty": 2, "refused URL: malformed": 3,
        "refused redirect: file scheme": 1, "refused redirect: ftp scheme": 1,
        "refused redirect: data scheme": 1,
    }
    notes = [line for line in r.stderr.splitlines() if line.startswith("note:")]
    assert notes == ["note: 11 of 19 rows are not http(s) URLs and are not fetched (malformed 3, empty 2, "
                     "file scheme 2, local path 2, data scheme 1, ftp scheme 1); they are counted as refused "
                     "in the summary"]
    # the photos, at the keys of their rows (shard * 10 + position, 8 rows per shard)
    fetched = {i: name for i, (_, name) in enumerate(urls_and_images) if name}
    samples = sorted(iter_samples(out), key=lambda s: s.key)  # a tar holds them as they finished
    assert [s.key for s in samples] == [f"{i // 8:05d}{i % 8}" for i in sorted(fetched)]
    for s in samples:
        i = int(s.key[:5]) * 8 + int(s.key[5:])
        assert s.source == rows[i]["URL"] and s.caption == f"row {i}"
        assert s.meta["similarity"] == pytest.approx(i / 100)
        _check_pixels(s, photos[fetched[i]], 64)
    # nothing local reached OUT (shards, their parquet metadata, stats, dataset.json)
    assert _leaks(out, marker) == [] and _leaks(out, str(path)) == []
    assert list(list_shards(out)) and not (out / URL_COPIES).exists()
    assert ftp_connections == []
    # the counts: per shard stats, dataset.json, the printed summary
    assert _status_totals(out) == {"success": 5, **reasons}
    info = read_dataset_info(out)
    assert info["summary"]["reasons"] == reasons
    assert (info["summary"]["total"], info["summary"]["successes"], info["num_samples"]) == (19, 5, 5)
    assert "total:        19" in r.stdout and "failed:       14" in r.stdout
    for reason, n in reasons.items():
        assert f"  {n}  {reason}\n" in r.stdout + "\n", reason


@pytest.mark.slow
def test_csv_fetches_only_http_and_resumes(tmp_path, web, secret, ftp_trap, photos):
    """The same through a csv list with a caption column; a rerun of the finished fetch
    reports the same counts without downloading (or rewriting the copies) again."""
    base, files = web
    path, marker = secret
    files["/chelsea.jpg"] = encode(photos["chelsea"], "JPEG", quality=95)
    files["/coffee.jpg"] = encode(photos["coffee"], "JPEG", quality=95)
    lines = [
        f"{base}/chelsea.jpg",
        path.as_uri(),
        "./" + os.path.relpath(path),
        "",
        f"ftp://127.0.0.1:{ftp_trap[0]}/a.jpg",
        f"{base}/r/ftp",
        f"{base}/r/FILE",
        f"{base}/coffee.jpg",
    ]
    (tmp_path / "list.csv").write_text("url,caption\n" + "".join(f"{u},cap {i}\n" for i, u in enumerate(lines)))
    out = tmp_path / "shards"
    args = ["fetch", tmp_path / "list.csv", "--out", out, "--image-size", 48, "--processes", 1, "--threads", 2, "-q"]
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "note: 4 of 8 rows are not http(s) URLs" in r.stderr
    reasons = {"refused URL: file scheme": 1, "refused URL: local path": 1, "refused URL: empty": 1,
               "refused URL: ftp scheme": 1, "refused redirect: ftp scheme": 1,
               "refused redirect: file scheme": 1}
    samples = sorted(iter_samples(out), key=lambda s: s.key)
    assert [(s.key, s.caption) for s in samples] == [("000000000", "cap 0"), ("000000007", "cap 7")]
    _check_pixels(samples[0], photos["chelsea"], 48)
    _check_pixels(samples[1], photos["coffee"], 48)
    assert _status_totals(out) == {"success": 2, **reasons}
    assert read_dataset_info(out)["summary"]["reasons"] == reasons
    assert _leaks(out, marker) == [] and ftp_trap[1] == []

    # finished: a rerun (in process: it does not start img2dataset) just reports again
    again = fetch(tmp_path / "list.csv", out, image_size=48, processes=1, threads=2, progress=False)
    assert again["summary"]["reasons"] == reasons and again["num_samples"] == 2
    assert not (out / URL_COPIES).exists()
