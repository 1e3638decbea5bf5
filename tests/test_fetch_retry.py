"""`ditdata fetch --retry-failed`: a loopback HTTP server answers each path from a list
(503 twice then the image, 429 once then the image, always 404, ...) and counts the
requests per path, so the tests see which rows each pass refetched, that the rows keep
their keys, that a pass killed and rerun completes, and that `ditdata encode` afterwards
finds every sample once. In process (CliRunner): img2dataset's imports (~5 s here) are
paid once, not per command; its workers are spawned processes all the same."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cliutil import assert_has, ditdata
from test_fetch import real_images, serve
from test_imageshards import encode

from ditdata.fetch import ledger
from ditdata.fetch.retries import retry_failed
from ditdata.fetch.state import RETRY_RECORD, RETRY_SCRATCH
from ditdata.imageshards.folder import iter_samples, list_shards, read_dataset_info
from ditdata.store import open_store

# ============================================================================ the table


@pytest.mark.parametrize(
    ("status", "message", "cls"),
    [
        ("success", None, None),
        ("failed_to_download", "HTTP Error 503: Service Unavailable", "transient"),
        ("failed_to_download", "HTTP Error 500: Internal Server Error", "transient"),
        ("failed_to_download", "HTTP Error 429: Too Many Requests", "transient"),
        ("failed_to_download", "timed out", "transient"),
        ("failed_to_download", "The read operation timed out", "transient"),
        ("failed_to_download", "<urlopen error timed out>", "transient"),
        ("failed_to_download", "<urlopen error [Errno 111] Connection refused>", "transient"),
        ("failed_to_download", "[Errno 104] Connection reset by peer", "transient"),
        ("failed_to_download", "Remote end closed connection without response", "transient"),
        ("failed_to_download", "IncompleteRead(10 bytes read, 90 more expected)", "transient"),
        ("failed_to_download", "<urlopen error [Errno -3] Temporary failure in name resolution>", "transient"),
        ("failed_to_download", "<urlopen error [Errno -2] Name or service not known>", "permanent"),
        ("failed_to_download", "HTTP Error 404: Not Found", "permanent"),
        ("failed_to_download", "HTTP Error 403: Forbidden", "permanent"),
        ("failed_to_download", "HTTP Error 410: Gone", "permanent"),
        ("failed_to_download", "refused URL: file scheme", "permanent"),
        ("failed_to_download", "refused redirect: ftp scheme", "permanent"),
        ("failed_to_download", "hash mismatch", "permanent"),
        ("failed_to_download", "Use of image disallowed by X-Robots-Tag directive", "permanent"),
        ("failed_to_download", "something nobody has seen", "permanent"),  # unknown: never hammered
        ("failed_to_resize", "Image decoding error", "permanent"),
        ("failed_to_resize", "image too small", "permanent"),
    ],
)
def test_failure_classes(status, message, cls):
    assert ledger.failure_class(status, message) == cls


# ============================================================================ the server


@pytest.fixture
def web():
    """serve(): (base URL, {path: answers}, {path: requests so far})."""
    files: dict = {}
    requests: Counter = Counter()
    with serve(files, requests=requests) as base:
        yield base, files, requests


def _url_list(tmp_path: Path, web) -> tuple[Path, list[dict]]:
    """Seven rows, 4 per shard: two images, a 503-503-200, a 404, a 429-200, garbage bytes
    (a decode error) and a file:// URL (refused)."""
    photos = real_images()
    jpeg = {name: encode(photos[name][:128, :128], "JPEG", quality=90) for name in ("astronaut", "chelsea", "coffee", "rocket")}
    base, files, _ = web
    files.update({
        "/astronaut.jpg": [jpeg["astronaut"]],
        "/flaky.jpg": [503, 503, jpeg["chelsea"]],
        "/missing.jpg": [404],
        "/busy.jpg": [429, jpeg["coffee"]],
        "/rocket.jpg": [jpeg["rocket"]],
        "/garbage.jpg": [os.urandom(3000)],
    })
    paths = ["/astronaut.jpg", "/flaky.jpg", "/missing.jpg", "/busy.jpg", "/rocket.jpg", "/garbage.jpg", None]
    rows = [{"url": base + p if p else "file:///etc/passwd", "caption": f"row {i}", "similarity": i / 10}
            for i, p in enumerate(paths)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "urls.parquet")
    return tmp_path / "urls.parquet", rows


def _key(row: int) -> str:
    return f"{row // 4:05d}{row % 4}"  # img2dataset's key, 4 rows per shard


FETCH = ("--image-size", 32, "--samples-per-shard", 4, "--processes", 1, "--threads", 2, "--keep-col", "similarity")


def _fetch(tmp_path: Path, web) -> tuple[Path, list[dict]]:
    src, rows = _url_list(tmp_path, web)
    out = tmp_path / "shards"
    r = ditdata("fetch", src, "--out", out, *FETCH, "-q")
    assert r.exit_code == 0, r.output
    return out, rows


def _retry(out: Path, *extra) -> str:
    """The last line `--retry-failed` prints (img2dataset prints its progress before it)."""
    r = ditdata("fetch", "--retry-failed", "--out", out, *extra)
    assert r.exit_code == 0, r.output
    return r.output.strip().splitlines()[-1]


PERMANENT = "permanent failures 3 (HTTP Error 404: Not Found 1, Image decoding error 1, refused URL: file scheme 1)"


# ============================================================================ end to end


@pytest.mark.slow
def test_retry_failed_refetches_transient_failures_only(tmp_path, web):
    out, rows = _fetch(tmp_path, web)
    requests = web[2]
    assert read_dataset_info(out)["num_samples"] == 2
    assert requests == {"/astronaut.jpg": 1, "/flaky.jpg": 1, "/missing.jpg": 1, "/busy.jpg": 1,
                               "/rocket.jpg": 1, "/garbage.jpg": 1}

    line = _retry(out)  # the 429 recovers, the 503 fails again
    assert line == (f"{out}: retry pass 1: retried 2, recovered 1, still failing transiently 1, "
                                + PERMANENT)
    # pass 2 killed: in its download (only the scratch folder had changed), then while it
    # published (the record written, dataset.json gone, a shard tar without its stats file)
    (out / RETRY_SCRATCH / "out").mkdir(parents=True)
    (out / RETRY_SCRATCH / "out" / "00000.tar").write_bytes(b"half a tar")
    assert (out / RETRY_RECORD).is_file()  # written before a pass publishes anything
    (out / "dataset.json").unlink()
    (out / "00003.tar").write_bytes(b"half a tar")
    (out / "00003.parquet").write_bytes(b"half a parquet")
    assert [p.name for p in list_shards(out)] == ["00000.tar", "00001.tar", "00002.tar"]
    r = ditdata("fetch", "--retry-failed", "--out", out, "--timeout", 5)  # a download option may change
    assert r.exit_code == 0, r.output
    assert_has(r.output, "note: 00003.tar was left by an interrupted --retry-failed pass; deleted",
               "note: 00003.parquet was left")
    line = r.output.strip().splitlines()[-1]  # the rerun completes: the 503 recovers
    assert line == (f"{out}: retry pass 2: retried 1, recovered 1, still failing transiently 0, "
                                + PERMANENT)
    # what decides a shard's contents stays the first fetch's: its own flags may be given again
    r = ditdata("fetch", "--retry-failed", "--out", out, "--image-size", 64)
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
    assert_has(r.output, "--image-size 64 is not the recorded 32; drop it (only --processes, --threads")
    assert _retry(out, *FETCH, "--caption-col", "caption") == f"{out}: nothing to retry: no row's latest status is a transient failure (" \
        "permanent failures 3: HTTP Error 404: Not Found 1, Image decoding error 1, refused URL: file scheme 1)"
    # the 404 and the decode error were fetched once, the 503 three times, the 429 twice
    assert requests == {"/astronaut.jpg": 1, "/flaky.jpg": 3, "/missing.jpg": 1, "/busy.jpg": 2,
                               "/rocket.jpg": 1, "/garbage.jpg": 1}

    # new shards, the first fetch's untouched; every image at the key of its row
    assert [p.name for p in list_shards(out)] == ["00000.tar", "00001.tar", "00002.tar", "00003.tar"]
    samples = sorted(iter_samples(out), key=lambda s: s.key)
    assert [s.key for s in samples] == [_key(i) for i in (0, 1, 3, 4)]
    for s in samples:
        row = rows[int(s.key[:5]) * 4 + int(s.key[5:])]
        assert (s.source, s.caption, s.meta["similarity"]) == (row["url"], row["caption"], row["similarity"])
        assert s.meta["status"] == "success" and "ditdata_key" not in s.meta
        assert s.decode().size == (32, 32)
    # the retry shards' parquet: the rows under their keys, at their latest status
    t = pq.read_table(out / "00002.parquet").to_pylist()
    assert sorted((x["key"], x["status"]) for x in t) == [(_key(1), "failed_to_download"), (_key(3), "success")]
    assert "ditdata_key" not in pq.read_schema(out / "00002.parquet").names

    info = read_dataset_info(out)
    assert (info["num_shards"], info["num_samples"]) == (4, 4)
    s = info["summary"]
    assert (s["total"], s["successes"], s["failed"]) == (7, 4, 3)
    assert s["reasons"] == {"HTTP Error 404: Not Found": 1, "Image decoding error": 1, "refused URL: file scheme": 1}
    assert [(p["number"], p["retried"], p["recovered"], p["shards"]) for p in info["retries"]] == [
        (1, 2, 1, [2]), (2, 1, 1, [3])]
    assert info["options"]["image_size"] == 32 and not (out / RETRY_SCRATCH).exists()
    r = ditdata("fetch", tmp_path / "other.parquet", "--retry-failed", "--out", out)
    assert r.exit_code == 2 and "does not exist" in r.output
    (tmp_path / "other.parquet").write_bytes(b"")
    r = ditdata("fetch", tmp_path / "other.parquet", "--retry-failed", "--out", out)
    assert r.exit_code == 1 and f"was fetched from {tmp_path / 'urls.parquet'}, not " in r.output

    # encode sees each sample once
    store = tmp_path / "store"
    enc = ditdata("encode", out, "--vae", "pixels", "--resolution", 32, "--out", store, "--workers", 0,
                  "--device", "cpu", "-q")
    assert enc.exit_code == 0, enc.output
    st = open_store(store)
    keys = [k for i in range(len(st.shards)) for k in st.read(i, fields=["key"])["key"]]
    assert sorted(keys) == [_key(i) for i in (0, 1, 3, 4)]

    # rerunning the first fetch (finished) keeps the retried counts
    again = ditdata("fetch", tmp_path / "urls.parquet", "--out", out, *FETCH, "-q")
    assert again.exit_code == 0, again.output
    assert read_dataset_info(out)["summary"] == {**s, "duration_s": read_dataset_info(out)["summary"]["duration_s"]}
    assert read_dataset_info(out)["num_shards"] == 4 and len(read_dataset_info(out)["retries"]) == 2


# ============================================================================ refusals


def test_retry_failed_refuses_what_is_not_a_finished_url_fetch(tmp_path):
    (tmp_path / "plain").mkdir()
    for folder, why in [(tmp_path / "plain", "no `ditdata fetch` record in it"),
                        (tmp_path / "nowhere", "no such directory")]:
        r = ditdata("fetch", "--retry-failed", "--out", folder)
        assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
        assert_has(r.output, f"--retry-failed: {folder} is not a finished URL fetch", why)
    # a folder fetch has no downloads; an unfinished URL fetch must be completed first
    for kind, why in (("classes", "holds a classes fetch; only a URL list has downloads to retry"),
                      ("urls", "the fetch did not finish; rerun the first `ditdata fetch`")):
        (tmp_path / kind).mkdir()
        (tmp_path / kind / ".fetch_state").write_text(json.dumps({"kind": kind}))
        r = ditdata("fetch", "--retry-failed", "--out", tmp_path / kind)
        assert r.exit_code == 1 and why in r.output, r.output
    assert not (tmp_path / "nowhere").exists()
    with pytest.raises(TypeError):
        retry_failed(tmp_path / "urls", no_such_option=64)
    r = ditdata("fetch", "--out", tmp_path / "urls")
    assert r.exit_code == 2 and "Missing argument 'SOURCE'" in r.output
