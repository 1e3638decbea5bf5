"""`ditdata fetch --distributor pyspark` (and ray) give the shards of the multiprocessing
distributor: the same files, keys, image bytes, per-shard parquet and stats, and the same
dataset.json, except what is a timing or names the distributor (TIMING_FIELDS and
_comparable) and the order of samples inside a shard (download order, see _members). Everything runs on 127.0.0.1: a loopback HTTP server serves real photos,
Spark runs as local[2] bound to 127.0.0.1, Ray as a local instance.

No skips: CI installs the `distributed` extra and a JRE (.ci/run); a missing one fails."""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cliutil import raises_one_line
from test_fetch import real_images, run_cli, serve
from test_imageshards import encode

from ditdata.config import FetchConfig
from ditdata.errors import DitdataError
from ditdata.fetch import distributors, fetch

# img2dataset's per-shard stats record when the shard was downloaded
TIMING_FIELDS = ("start_time", "end_time", "duration")


@pytest.fixture(scope="module")
def url_list(tmp_path_factory):
    """A parquet of 7 real photos x 2 (captions, an extra column), a 404, an undecodable
    body and a file:// URL (refused), served from 127.0.0.1; yields its path."""
    tmp = tmp_path_factory.mktemp("urls")
    files, rows = {}, []
    with serve(files) as base:
        for copy in range(2):
            for i, (name, arr) in enumerate(real_images().items()):
                files[f"/{copy}/{name}.jpg"] = encode(arr, "JPEG", quality=90)
                rows.append({"url": f"{base}/{copy}/{name}.jpg", "caption": f"{name} {copy}", "similarity": i / 10})
        files["/garbage.jpg"] = os.urandom(3000)
        rows.insert(2, {"url": f"{base}/missing.jpg", "caption": "gone", "similarity": 0.0})
        rows.insert(7, {"url": f"{base}/garbage.jpg", "caption": "noise", "similarity": 0.0})
        rows.insert(11, {"url": "file:///etc/passwd", "caption": "local", "similarity": 0.0})
        pq.write_table(pa.Table.from_pylist(rows), tmp / "urls.parquet")
        yield tmp / "urls.parquet"


def _fetch(src: Path, out: Path, distributor: str) -> float:
    t0 = time.perf_counter()
    r = run_cli("fetch", src, "--out", out, "--distributor", distributor, "--processes", 2, "--threads", 2,
                "--samples-per-shard", 5, "--image-size", 64, "--keep-col", "similarity", "-q", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout
    assert "total:        17" in r.stdout and "successes:    14" in r.stdout
    return time.perf_counter() - t0


def _members(tar: Path) -> list[tuple[str, bytes]]:
    """A tar's members with their bytes, by name: the tar headers hold write times, and
    the order of samples in a shard is the order img2dataset's download threads finish
    in, with any distributor (two multiprocessing runs differ the same way)."""
    with tarfile.open(tar) as t:
        return sorted((m.name, t.extractfile(m).read()) for m in t.getmembers())


def _comparable(out: Path) -> dict:
    """Everything a fetch wrote to OUT, minus timings and the distributor's name."""
    got: dict = {}
    for p in sorted(out.iterdir()):
        if p.name.startswith("."):  # .fetch_state (compared below), .ditkit.lock
            continue
        if p.suffix == ".tar":
            got[p.name] = _members(p)
        elif p.suffix == ".parquet":
            got[p.name] = sorted(pq.read_table(p).to_pylist(), key=lambda row: row["key"])  # same order
        elif p.name.endswith("_stats.json"):
            stats = json.loads(p.read_text())
            assert all(k in stats for k in TIMING_FIELDS), p
            got[p.name] = {k: v for k, v in stats.items() if k not in TIMING_FIELDS}
        elif p.name == "dataset.json":
            info = json.loads(p.read_text())
            info.pop("created_at")
            info["summary"].pop("duration_s")
            info["options"].pop("distributor")
            got[p.name] = info
        else:
            got[p.name] = p.read_bytes()
    got[".fetch_state"] = json.loads((out / ".fetch_state").read_text())
    return got


@pytest.fixture(scope="module")
def reference(url_list, tmp_path_factory) -> tuple[Path, float]:
    """The multiprocessing fetch of url_list (made once) and how long it took."""
    out = tmp_path_factory.mktemp("reference") / "multiprocessing"
    return out, _fetch(url_list, out, "multiprocessing")


def _assert_same_as_multiprocessing(url_list, reference, tmp_path, distributor) -> None:
    mp, t_mp = reference
    other = tmp_path / distributor
    t_other = _fetch(url_list, other, distributor)
    a, b = _comparable(mp), _comparable(other)
    assert sorted(a) == sorted(b)
    assert [n for n in a if n.endswith(".tar")] == ["00000.tar", "00001.tar", "00002.tar", "00003.tar"]
    for name in a:
        assert a[name] == b[name], name
    # keys: 5-digit shard + 1-digit row (5 per shard); rows 2, 7 and 11 failed
    keys = [m[0] for n in a if n.endswith(".tar") for m in a[n] if m[0].endswith(".jpg")]
    assert keys == [f"{i // 5:05d}{i % 5}.jpg" for i in range(17) if i not in (2, 7, 11)]
    assert json.loads((other / "dataset.json").read_text())["options"]["distributor"] == distributor
    print(f"\n{distributor} fetch {t_other:.1f} s, multiprocessing {t_mp:.1f} s (17 URLs, 2 processes)")


@pytest.mark.slow
def test_spark_fetch_equals_multiprocessing_fetch(url_list, reference, tmp_path):
    _assert_same_as_multiprocessing(url_list, reference, tmp_path, "pyspark")


@pytest.mark.slow
def test_ray_fetch_equals_multiprocessing_fetch(url_list, reference, tmp_path):
    _assert_same_as_multiprocessing(url_list, reference, tmp_path, "ray")


def test_missing_java_is_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no java on it
    msg = raises_one_line(DitdataError, distributors.java_home)
    assert "apt-get install default-jre-headless" in msg and "JAVA_HOME" in msg
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "nojre"))
    with pytest.raises(DitdataError, match="JAVA_HOME=.*nojre has no bin/java") as e:
        distributors.java_home()
    assert "\n" not in str(e.value)


def test_missing_java_stops_the_fetch_before_spark(tmp_path, monkeypatch):
    """The CLI says it in one line, exit status 1, without starting a JVM."""
    pq.write_table(pa.table({"url": ["http://127.0.0.1:9/a.jpg"]}), tmp_path / "u.parquet")
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # run_cli starts sys.executable itself
    r = run_cli("fetch", tmp_path / "u.parquet", "--out", tmp_path / "o", "--distributor", "pyspark", "-q")
    assert r.returncode == 1, r.stderr + r.stdout
    err = r.stderr.strip()
    assert "\n" not in err and "needs Java" in err and "Traceback" not in err


def test_distributor_options_are_checked(tmp_path, monkeypatch):
    pq.write_table(pa.table({"url": ["http://127.0.0.1:9/a.jpg"]}), tmp_path / "u.parquet")
    with pytest.raises(DitdataError, match="--spark-master spark://h:7077: applies to --distributor pyspark only"):
        fetch(tmp_path / "u.parquet", tmp_path / "o1", spark_master="spark://h:7077")
    with pytest.raises(DitdataError, match="--ray-address auto: applies to --distributor ray only"):
        fetch(tmp_path / "u.parquet", tmp_path / "o2", distributor="pyspark", ray_address="auto")
    # not installed: the extra to install
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(DitdataError, match=r"pip install 'ditkit\[distributed\]'"):
        with distributors.runtime(FetchConfig(distributor="ray")):
            pass


def test_tar_members_ignore_write_times(tmp_path):
    """_members compares contents: two tars that differ only in mtimes compare equal."""
    for i, name in enumerate(("a.tar", "b.tar")):
        with tarfile.open(tmp_path / name, "w") as t:
            info = tarfile.TarInfo("000000000.jpg")
            info.size, info.mtime = 3, 1000 + i
            t.addfile(info, io.BytesIO(b"abc"))
    assert (tmp_path / "a.tar").read_bytes() != (tmp_path / "b.tar").read_bytes()
    assert _members(tmp_path / "a.tar") == _members(tmp_path / "b.tar")
