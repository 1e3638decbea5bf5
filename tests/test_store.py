"""The latent store contract: round trips, atomic shards, corruption errors, readers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from cliutil import child_env, kill_when, loaded_after
from cliutil import ditdata as _cli
from storeutil import INFO, schema, shard_data, write_store

from ditdata.store import BACKEND_CLASSES, BFLOAT16, FORMAT_VERSION, Store, StoreError, StoreWriter, open_store
from ditdata.store.manifest import decode_array, encode_array, identity

SIZES = [7, 0, 12]  # an empty shard (every image failed) is still a shard


# every shard format of the store's table: a new backend is tested too
BACKENDS = list(BACKEND_CLASSES)


def _equal(a, b):
    if a.dtype == object:
        return list(a) == list(b)
    if a.dtype.kind == "f" and a.dtype.itemsize == 8:
        return np.array_equal(a, b, equal_nan=True)
    return a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _expected_columns(cols: dict) -> dict:
    out = {k: np.array(v, dtype=object) for k, v in cols.items() if k in ("key", "caption", "url")}
    out["label"] = np.array(cols["label"], dtype=np.int64)
    out["width"] = np.array(cols["width"], dtype=np.int64)
    out["clip_score"] = np.array([np.nan if v is None else v for v in cols["clip_score"]])
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8"])  # int8: latents with their scales
def test_round_trip(tmp_path, backend, dtype):
    sch = schema(dtype)
    write_store(tmp_path / "s", sch, SIZES, backend, chunk_samples=5)
    store = open_store(tmp_path / "s", verify=True)
    assert len(store) == sum(SIZES)
    for i, n in enumerate(SIZES):
        tensors, cols = shard_data(sch, i, n)
        got = store.read(i)
        for f, arr in tensors.items():
            assert got[f].shape == arr.shape and _equal(got[f], arr), f
        for c, arr in _expected_columns(cols).items():
            assert _equal(got[c], arr), c
        # a slice crossing a chunk boundary equals the same slice of the whole
        part = store.read(i, fields=["latent", "key"], start=3, stop=9)
        assert _equal(part["latent"], tensors["latent"][3:9])
        assert list(part["key"]) == cols["key"][3:9]
    # per-sample access by global index (last sample lives in shard 2)
    last = store.sample(len(store) - 1)
    t2, c2 = shard_data(sch, 2, SIZES[2])
    assert last["key"] == c2["key"][-1] and _equal(last["latent"], t2["latent"][-1])
    assert store.verify() == []


def test_exact_manifest(tmp_path):
    sch = schema("bfloat16")
    write_store(tmp_path / "s", sch, SIZES, "zarr")
    m = json.loads((tmp_path / "s" / "manifest.json").read_text())
    shards = m.pop("shards")
    prov = m.pop("provenance")
    stats = m.pop("stats")
    everything = np.concatenate(
        [shard_data(sch, i, n)[0]["latent"].astype(np.float64) for i, n in enumerate(SIZES)]
    )
    assert m == {
        "format_version": FORMAT_VERSION,
        "backend": "zarr",
        "num_samples": 19,
        "latent": {"shape": [4, 8, 8], "dtype": "bfloat16", "stored": "sample", "flip": True},
        "fields": {
            "tensors": {
                "latent": {"shape": [4, 8, 8], "dtype": "bfloat16"},
                "latent_flip": {"shape": [4, 8, 8], "dtype": "bfloat16"},
                "text_pooled": {"shape": [16], "dtype": "bfloat16"},
                "text_tokens": {"shape": [5, 16], "dtype": "bfloat16"},
                "text_mask": {"shape": [5], "dtype": "bool"},
            },
            "columns": {"key": "string", "label": "int64", "caption": "string",
                        "clip_score": "float64", "width": "int64", "url": "string"},
        },
        "vae": INFO["vae"],
        "image": INFO["image"],
        "conditioning": INFO["conditioning"],
        "filter": None,
    }
    assert stats["field"] == "latent" and stats["count"] == 19 * 64
    np.testing.assert_allclose(stats["mean"], everything.mean(axis=(0, 2, 3)), atol=1e-12)
    np.testing.assert_allclose(stats["std"], everything.std(axis=(0, 2, 3)), atol=1e-9)
    assert prov["input_shards"] == 3 and prov["created_at"] == "2026-01-01T00:00:00+00:00"
    assert {"python", "numpy", "zarr"} <= set(prov["tools"])
    assert [s["name"] for s in shards] == ["00000", "00001", "00002"]
    assert [s["num_samples"] for s in shards] == SIZES
    for s in shards:
        assert s["path"] == f"shards/{s['name']}.zarr"
        assert s["source"] == f"images/{s['name']}.tar"
        assert s["checksum"].startswith("sha256:")
        assert s["bytes"] == sum(f["size"] for f in s["files"].values())
        assert all(rel.startswith(s["path"] + "/") for rel in s["files"])
        assert f"{s['path']}/columns.parquet" in s["files"]


def test_mean_std_store_and_manifest_arrays(tmp_path):
    sch = schema("float16", kind="mean_std", flip=False, text=False)
    empty = np.linspace(-1, 1, 16).astype(np.float16)
    info = dict(INFO, conditioning={"type": "text", "text": {"empty": {"text_pooled": encode_array(empty)}}})
    write_store(tmp_path / "s", sch, [4, 3], "wds", info=info)
    store = open_store(tmp_path / "s")
    assert store.manifest["latent"] == {"shape": [4, 8, 8], "dtype": "float16", "stored": "mean_std", "flip": False}
    assert store.manifest["stats"]["field"] == "mean"
    got = store.empty_caption()["text_pooled"]
    assert got.dtype == np.float16 and np.array_equal(got, empty)
    bf = np.arange(6, dtype=np.float32).reshape(2, 3).astype(BFLOAT16)
    back = decode_array(encode_array(bf))
    assert back.dtype == BFLOAT16 and back.shape == (2, 3) and np.array_equal(back, bf)


# -- atomic shards, resume, append ---------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from ditdata.common import files
    from ditdata.store import writer
    from storeutil import schema, write_store

    root, backend, where = sys.argv[1], sys.argv[2], sys.argv[3]
    marker = Path(root).parent / "marker"
    victim = writer.files  # the writer calls these through the module

    def stall(real):
        def inner(path, *a, **k):
            if "00002" in str(path):
                marker.write_text(where)
                time.sleep(60)
            return real(path, *a, **k)
        return inner

    if where == "before_record":   # data being written, nothing recorded yet
        victim.fsync_tree = stall(victim.fsync_tree)
    else:                          # record written, data not yet renamed into place
        victim.publish = stall(victim.publish)
    write_store(root, schema("float16"), [6, 9, 8, 5], backend)
    """
)


def _looks_finished(root: Path) -> list[str]:
    """Shards whose data stands under its final name (what a careless reader would trust)."""
    return sorted(p.name for p in (root / "shards").iterdir() if p.suffix in (".zarr", ".tar"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["before_record", "after_record"])
def test_sigkill_mid_shard_then_rerun(tmp_path, backend, where):
    root = tmp_path / "s"
    env = child_env()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(root), backend, where], env=env)
    kill_when(proc, (tmp_path / "marker").exists, timeout=60,
              too_late="writer exited before reaching shard 00002", poll=0.05)

    suffix = ".zarr" if backend == "zarr" else ".tar"
    assert _looks_finished(root) == [f"00000{suffix}", f"00001{suffix}"]
    assert not (root / "manifest.json").exists()
    with pytest.raises(StoreError, match="manifest.json"):
        open_store(root)
    w = StoreWriter(root, schema=schema("float16"), info=INFO, backend=backend)
    assert [w.done(f"0000{i}") for i in range(4)] == [True, True, False, False]

    write_store(root, schema("float16"), [6, 9, 8, 5], backend)  # the rerun
    write_store(tmp_path / "clean", schema("float16"), [6, 9, 8, 5], backend)
    assert not [p for p in (root / "shards").iterdir() if p.name.startswith(".")], "debris left"
    resumed, clean = open_store(root, verify=True), open_store(tmp_path / "clean", verify=True)
    assert resumed.verify() == []
    assert [s.record["checksum"] for s in resumed.shards] == [s.record["checksum"] for s in clean.shards]
    for i in range(4):
        a, b = resumed.read(i), clean.read(i)
        assert all(_equal(a[k], b[k]) for k in a)


def test_rerun_skips_finished_and_refuses_other_settings(tmp_path):
    root = tmp_path / "s"
    write_store(root, schema("float16"), [3, 4], "zarr")
    before = {p: p.stat().st_mtime_ns for p in (root / "shards").rglob("*")}
    write_store(root, schema("float16"), [3, 4], "zarr")
    assert before == {p: p.stat().st_mtime_ns for p in (root / "shards").rglob("*")}
    with pytest.raises(StoreError, match="different settings.*vae"):
        StoreWriter(root, schema=schema("float16"), backend="zarr",
                    info=dict(INFO, vae=dict(INFO["vae"], scaling_factor=0.18215)))
    with pytest.raises(StoreError, match="different settings.*fields"):
        StoreWriter(root, schema=schema("bfloat16"), info=INFO, backend="zarr")


def test_append_keeps_old_manifest_valid_until_finalize(tmp_path):
    root = tmp_path / "s"
    write_store(root, schema("float16"), [3, 4], "wds")
    old = open_store(root)
    w = write_store(root, schema("float16"), [3, 4, 5], "wds", finalize=False)
    assert len(open_store(root)) == 7  # the old manifest still describes a complete store
    w.finalize()
    new = open_store(root, verify=True)
    assert len(new) == 12 and new.identity != old.identity
    assert len(old.read(1)["key"]) == 4  # an open reader is not disturbed


def test_finalize_refuses_missing_shards(tmp_path):
    w = write_store(tmp_path / "s", schema("float16"), [3], "zarr", finalize=False)
    with pytest.raises(StoreError, match="00001"):
        w.finalize(["00000", "00001"])
    assert not (tmp_path / "s" / "manifest.json").exists()


def test_writer_rejects_bad_shards(tmp_path):
    sch = schema("float16")
    w = StoreWriter(tmp_path / "s", schema=sch, info=INFO)
    t, c = shard_data(sch, 0, 4)
    with pytest.raises(ValueError, match="latent"):
        w.write_shard("a", dict(t, latent=t["latent"].astype(np.float32)), c)
    with pytest.raises(ValueError, match="duplicate keys"):
        w.write_shard("a", t, dict(c, key=["k"] * 4))
    with pytest.raises(ValueError, match="label"):
        w.write_shard("a", t, dict(c, label=[1, 2]))
    assert not w.done("a") and not list((tmp_path / "s" / "shards").iterdir())


# -- corruption: each gives a clear error naming the file -----------------------------------

@pytest.fixture(params=BACKENDS)
def store_dir(tmp_path, request) -> Path:
    write_store(tmp_path / "s", schema("float16"), [5, 6], request.param)
    return tmp_path / "s"


def test_no_manifest(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(StoreError, match=r"manifest\.json: missing; .* is not a latent store"):
        open_store(tmp_path / "d")
    r = _cli("inspect", tmp_path / "d")
    assert r.exit_code == 1 and "not a latent store" in r.output and "Traceback" not in r.output


def test_unknown_format_version(store_dir):
    path = store_dir / "manifest.json"
    m = json.loads(path.read_text())
    m["format_version"] = 99
    path.write_text(json.dumps(m))
    with pytest.raises(StoreError, match=r"manifest\.json: format_version 99 is not supported"):
        open_store(store_dir)


def test_missing_shard(store_dir):
    s = open_store(store_dir)
    data = s.shards[1].path
    import shutil

    shutil.rmtree(data) if data.is_dir() else data.unlink()
    with pytest.raises(StoreError, match=f"{data}: shard '00001' is missing"):
        open_store(store_dir)
    r = _cli("verify", store_dir)
    assert r.exit_code == 1 and str(data) in r.output


def _largest_file(s: Store, shard: int) -> Path:
    rec = s.shards[shard].record["files"]
    return s.root / max(rec, key=lambda k: rec[k]["size"])


def test_truncated_shard(store_dir):
    victim = _largest_file(open_store(store_dir), 0)
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    with pytest.raises(StoreError, match=f"{victim}: truncated"):
        open_store(store_dir)


def test_checksum_mismatch(store_dir):
    victim = _largest_file(open_store(store_dir), 1)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    open_store(store_dir)  # sizes still match: a plain open stays cheap
    with pytest.raises(StoreError, match=f"{victim}: checksum mismatch"):
        open_store(store_dir, verify=True)
    r = _cli("verify", store_dir)
    assert r.exit_code == 1 and f"{victim}: checksum mismatch" in r.output
    assert "1 fault(s)" in r.output


def test_invalid_manifest_json(store_dir):
    (store_dir / "manifest.json").write_text("{not json")
    with pytest.raises(StoreError, match="not valid JSON"):
        open_store(store_dir)


def test_inspect_and_verify_ok(store_dir):
    r = _cli("inspect", store_dir)
    assert r.exit_code == 0, r.output
    for text in ["samples:      11 in 2 shards", "(4, 8, 8) float16", "with flipped variant",
                 "test-vae", "scaling 0.5", "class, 3 classes (cat, dog, eel)", "c3", "size on disk"]:
        assert text in r.output
    r = _cli("verify", store_dir)
    assert r.exit_code == 0 and "OK (11 samples verified)" in r.output


# -- readers -------------------------------------------------------------------------------

READER = textwrap.dedent(
    """
    import sys, numpy as np
    from ditdata.store import open_store
    total = 0
    for _ in range(20):
        s = open_store(sys.argv[1], verify=True)
        for i in range(len(s.shards)):
            total += float(np.abs(s.read(i)["latent"].astype(np.float64)).sum())
    print(repr(total))
    """
)


def _snapshot(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*")}


def test_two_readers_at_once_never_write(store_dir):
    before = _snapshot(store_dir)
    procs = [subprocess.Popen([sys.executable, "-c", READER, str(store_dir)], stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] and float(outs[0]) > 0
    a, b = open_store(store_dir), open_store(store_dir)
    assert _equal(a.read(0)["latent"], b.read(0)["latent"])
    assert a.identity == b.identity == identity(json.loads((store_dir / "manifest.json").read_text()))
    assert _snapshot(store_dir) == before


def test_cli_help_is_lazy():
    code = ("from click.testing import CliRunner; from ditdata.cli import main; "
            "r = CliRunner().invoke(main, ['inspect', '--help']); assert r.exit_code == 0; "
            "r = CliRunner().invoke(main, ['--help']); assert r.exit_code == 0")
    assert loaded_after(code, ("torch", "zarr", "diffusers", "open_clip", "img2dataset", "webdataset", "pyarrow",
                               "numpy")) == []


def test_rerun_keeps_the_manifest_and_identity(tmp_path):
    root = tmp_path / "s"
    write_store(root, schema("float16"), [3, 4], "zarr")
    before = (root / "manifest.json").read_bytes()
    ident = open_store(root).identity
    w = StoreWriter(root, schema=schema("float16"), info=INFO)
    w.finalize(provenance={"input_shards": 2, "note": "a later run"})  # nothing new: kept as is
    assert (root / "manifest.json").read_bytes() == before and open_store(root).identity == ident


def test_zarr_reads_other_layouts_through_zarr(tmp_path):
    """Our chunk files are memory-mapped; a compressed array (another writer) goes through zarr."""
    import zarr

    from ditdata.store.backends import _read_plain_chunks

    a = np.arange(7 * 4, dtype=np.float16).reshape(7, 4)
    plain = zarr.create_array(str(tmp_path / "plain"), data=a, chunks=(3, 4), compressors=None)
    squeezed = zarr.create_array(str(tmp_path / "zstd"), data=a, chunks=(3, 4))
    assert plain is not None and squeezed is not None
    assert np.array_equal(_read_plain_chunks(tmp_path / "plain", 2, 7), a[2:7])
    assert _read_plain_chunks(tmp_path / "zstd", 0, 7) is None
    # a store whose latent array is compressed still reads identically
    write_store(tmp_path / "s", schema("float16"), [7], "zarr", chunk_samples=3)
    store = open_store(tmp_path / "s")
    want = store.read(0, fields=["latent"])["latent"]
    lat = store.shards[0].path / "latent"
    import shutil

    shutil.rmtree(lat)
    zarr.create_array(str(lat), data=want, chunks=(3, 4, 8, 8))  # zstd by default
    assert _read_plain_chunks(lat, 0, 7) is None
    assert np.array_equal(store.read(0, fields=["latent"], start=1, stop=6)["latent"], want[1:6])


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_flags_are_what_the_readers_rely_on(tmp_path, backend):
    """The backend table (backends.py) names defaults.BACKENDS, each entry is a Backend, and
    its random_access flag is what the readers plan by: sample() on a zarr store reads the one
    row it needs; on a wds store (a tar, readable front to back) it reads the shard whole, once,
    and answers the next samples of that shard from it."""
    from ditdata.store import BACKEND_CLASSES, Backend
    from ditdata.store.defaults import BACKENDS

    assert tuple(BACKEND_CLASSES) == BACKENDS
    assert {n: c.random_access for n, c in BACKEND_CLASSES.items()} == {"zarr": True, "wds": False}
    write_store(tmp_path / "s", schema("float16"), [6], backend, chunk_samples=4)
    store = open_store(tmp_path / "s")
    assert isinstance(store.backend, Backend) and store.backend.name == backend
    reads, real = [], store.backend.read
    store.backend.read = lambda path, sch, fields, start, stop: reads.append((start, stop)) or real(
        path, sch, fields, start, stop)
    keys = [store.sample(i)["key"] for i in (4, 1, 5)]
    assert reads == ([(4, 5), (1, 2), (5, 6)] if store.backend.random_access else [(0, 6)])
    assert keys == list(real(store.shards[0].path, store.schema, ["key"], 0, 6)["key"][[4, 1, 5]])
