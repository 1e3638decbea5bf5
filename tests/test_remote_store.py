"""Stores read from object storage (ditdata.store.remote): a store directory served over
HTTP on 127.0.0.1 and uploaded to a local S3-compatible server (moto), trained from and
verified, with corrupted files, dropped connections, missing objects and a small cache."""

from __future__ import annotations

import functools
import http.server
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from cliutil import ditdata, dittrain, http_server, one_error_line, run_args
from safetensors.numpy import load_file
from storeutil import make_store

from ditdata.store import StoreError, open_store, remote

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")
pytestmark = pytest.mark.usefixtures("one_thread")


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Static files; a path in `drops` has its connection closed after `cut` bytes of the
    body on its next `drops[path]` requests (the full Content-Length announced)."""

    drops: dict[str, int] = {}
    cut = 64
    requests: list[str] = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        type(self).requests.append(self.path)
        if self.drops.get(self.path, 0) > 0:
            self.drops[self.path] -= 1
            local = Path(self.translate_path(self.path))
            data = local.read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[:self.cut])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        super().do_GET()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(www directory, base URL): an HTTP server on 127.0.0.1 serving www/."""
    www = tmp_path_factory.mktemp("www")
    with http_server(functools.partial(_Handler, directory=str(www))) as base:
        yield www, base


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("local") / "store")


@pytest.fixture(scope="module")
def reference(local, tmp_path_factory):
    """reference(*extra): the 3-step run on the local store with `extra` flags (the run a
    remote one must equal), made once; on one thread like the tests (module fixtures
    start before the `one_thread` fixture)."""
    import torch

    runs = {}

    def run(*extra):
        if extra not in runs:
            out = tmp_path_factory.mktemp("runs") / "local"
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                r = dittrain(*run_args(local, out, "--max-steps", 3, *extra))
            finally:
                torch.set_num_threads(threads)
            assert r.exit_code == 0, r.output
            runs[extra] = out
        return runs[extra]

    return run


@pytest.fixture(scope="module")
def baseline(reference):
    return reference()


def _serve(server, local, name: str) -> str:
    """A copy of the local store served as `name`; its URL."""
    www, base = server
    shutil.copytree(local, www / name)
    return f"{base}/{name}"


def _losses(out: Path) -> list:
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def assert_same_run(a: Path, b: Path) -> None:
    assert _losses(a) == _losses(b) and len(_losses(a)) == 3
    wa, wb = load_file(a / "ema.safetensors"), load_file(b / "ema.safetensors")
    assert wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)


def _chunk(store: Path, shard: int = 1) -> str:
    """The relative path of one latent chunk file of a shard."""
    rec = json.loads((store / "manifest.json").read_text())["shards"][shard]
    return next(f for f in rec["files"] if "/latent/c/" in f)


def test_http_run_equals_local_and_records_the_url(server, local, baseline, tmp_path):
    url = _serve(server, local, "plain")
    r = dittrain(*run_args(url, tmp_path / "r", "--max-steps", 3, "--cache-dir", tmp_path / "cache"))
    assert r.exit_code == 0, r.output
    assert_same_run(baseline, tmp_path / "r")
    cfg = json.loads((tmp_path / "r" / "config.json").read_text())
    assert cfg["store"]["path"] == url
    # a resume names the same URL and continues
    r = dittrain(*run_args(url, tmp_path / "r", "--max-steps", 4, "--cache-dir", tmp_path / "cache", "--resume"))
    assert r.exit_code == 0, r.output
    assert [s for s, _ in _losses(tmp_path / "r")][-1] == 4
    # sampling the run opens its recorded URL through the run's cache (only the manifest is read)
    r = dittrain("sample", "--ckpt", tmp_path / "r", "--n", 2, "--steps", 2, "--device", "cpu",
                 "--out", tmp_path / "grid.png")
    assert r.exit_code == 0 and (tmp_path / "grid.png").is_file(), r.output
    r = ditdata("verify", url, "--cache-dir", tmp_path / "cache")
    assert r.exit_code == 0 and "OK (48 samples verified)" in r.output, r.output
    r = ditdata("inspect", url, "--cache-dir", tmp_path / "cache")
    assert r.exit_code == 0 and url in r.output and "48 in 3 shards" in r.output, r.output


def test_shard_corrupted_on_the_server_is_named(server, local, tmp_path):
    url = _serve(server, local, "corrupt")
    rel = _chunk(local)
    bad = server[0] / "corrupt" / rel
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    bad.write_bytes(bytes(data))
    r = dittrain(*run_args(url, tmp_path / "r", "--max-steps", 2, "--cache-dir", tmp_path / "cache"))
    line = one_error_line(r.output)
    assert "checksum mismatch" in line and f"{url}/{rel}" in line and "shard '00001'" in line, line
    assert not list((tmp_path / "cache").glob("*/shards/00001.zarr"))  # never published
    r = ditdata("verify", url, "--cache-dir", tmp_path / "cache")
    assert r.exit_code != 0 and f"FAULT {url}/{rel}" in r.output and "checksum mismatch" in r.output, r.output


def test_dropped_connections_are_retried_streaming_workers(server, local, reference, tmp_path, monkeypatch):
    url = _serve(server, local, "flaky")
    monkeypatch.setattr(remote, "BACKOFF_S", 0.05)
    for shard in range(3):  # every shard's chunk file: cut twice part way (the third try succeeds)
        _Handler.drops[f"/flaky/{_chunk(local, shard)}"] = 2
    r = dittrain(*run_args(url, tmp_path / "r", "--max-steps", 3, "--cache-dir", tmp_path / "cache",
                           "--loader", "streaming", "--workers", 2))
    assert r.exit_code == 0, r.output
    assert not any(_Handler.drops.values())  # every cut happened, and was retried:
    assert all(_Handler.requests.count(f"/flaky/{_chunk(local, i)}") == 3 for i in range(3))
    # the same batches as the streaming loader on the local store (its order does not depend
    # on the number of workers: 0 reads in-process)
    assert_same_run(reference("--loader", "streaming", "--workers", 0), tmp_path / "r")


def test_missing_objects_are_named(server, local, tmp_path):
    base = server[1]
    r = dittrain(*run_args(f"{base}/nothing-here", tmp_path / "r", "--cache-dir", tmp_path / "cache"))
    line = one_error_line(r.output)
    assert f"{base}/nothing-here/manifest.json: not found" in line, line
    url = _serve(server, local, "holey")
    rel = _chunk(local, 0)
    (server[0] / "holey" / rel).unlink()
    r = dittrain(*run_args(url, tmp_path / "r2", "--max-steps", 1, "--cache-dir", tmp_path / "cache"))
    line = one_error_line(r.output)
    assert f"{url}/{rel}: not found" in line, line


def test_auth_failure_is_one_line(server, tmp_path, monkeypatch):
    class Denied(_Handler):
        def do_GET(self):
            self.send_error(403)

    with http_server(functools.partial(Denied, directory=str(tmp_path))) as base:
        url = f"{base}/store"
        r = ditdata("inspect", url, "--cache-dir", tmp_path / "cache")
        line = one_error_line(r.output)
        assert f"{url}/manifest.json: access denied" in line and "credentials" in line, line


def test_cache_limit_evicts_and_still_trains(server, local, baseline, tmp_path):
    url = _serve(server, local, "small")
    shard = sum(m["size"] for m in json.loads((local / "manifest.json").read_text())["shards"][0]["files"].values())
    cache = tmp_path / "cache"
    r = dittrain(*run_args(url, tmp_path / "r", "--max-steps", 3, "--cache-dir", cache,
                           "--cache-limit", int(shard * 1.5)))
    assert r.exit_code == 0, r.output
    assert_same_run(baseline, tmp_path / "r")
    assert len(list(cache.glob("*/shards/*.zarr"))) == 1  # the others were evicted
    r = dittrain(*run_args(url, tmp_path / "r2", "--cache-dir", cache, "--cache-limit", shard // 2))
    line = one_error_line(r.output)
    assert "--cache-limit" in line and "smaller than the largest shard" in line, line


def test_a_shard_being_read_is_never_evicted(server, local, tmp_path):
    url = _serve(server, local, "shared")
    shard = sum(m["size"] for m in json.loads((local / "manifest.json").read_text())["shards"][0]["files"].values())
    a = open_store(url, cache_dir=tmp_path / "cache", cache_limit=int(shard * 1.5))
    b = open_store(url, cache_dir=tmp_path / "cache", cache_limit=int(shard * 1.5))
    a.read(0)  # a holds shard 0 while it reads it
    b.read(1)  # over the limit, but shard 0 is in use
    assert (a.root / "shards/00000.zarr").is_dir() and (a.root / "shards/00001.zarr").is_dir()
    a.release()
    b.read(2)  # now it may go
    assert not (a.root / "shards/00000.zarr").exists() and (a.root / "shards/00002.zarr").is_dir()
    with pytest.raises(StoreError, match="--cache-limit 'lots': not a size"):
        open_store(url, cache_dir=tmp_path / "cache", cache_limit="lots")


@pytest.fixture(scope="module")
def s3(local):
    """s3://ditkit/store on moto's S3 server on 127.0.0.1, uploaded by a plain recursive
    copy (shards first, manifest.json last), with the endpoint in AWS_ENDPOINT_URL."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    mp = pytest.MonkeyPatch()
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        mp.setenv(k, v)
    srv = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    mp.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir("ditkit")
    fs.put(str(local / "shards"), "ditkit/store/shards", recursive=True)
    fs.put(str(local / "manifest.json"), "ditkit/store/manifest.json")
    yield "s3://ditkit/store"
    srv.stop()
    mp.undo()


def test_s3_run_equals_local_and_verifies(s3, baseline, tmp_path):
    r = dittrain(*run_args(s3, tmp_path / "r", "--max-steps", 3, "--cache-dir", tmp_path / "cache"))
    assert r.exit_code == 0, r.output
    assert_same_run(baseline, tmp_path / "r")
    r = ditdata("verify", s3, "--cache-dir", tmp_path / "cache")
    assert r.exit_code == 0 and "OK (48 samples verified)" in r.output, r.output
    r = ditdata("inspect", "s3://ditkit/absent", "--cache-dir", tmp_path / "cache")
    assert "s3://ditkit/absent/manifest.json: not found" in one_error_line(r.output)
