"""Publish-by-rename is durable and a failed write leaves the previous state untouched.

Writes are made to fail for real in child processes under RLIMIT_FSIZE (Python ignores
SIGXFSZ, so a write past the limit fails with EFBIG, as on a full disk), and in-process by
an fsync that reports ENOSPC. Directory syncs are observed by wrapping os.fsync.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import re
import resource
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from cliutil import child_env, raises_one_line, run_args
from PIL import Image
from storeutil import INFO, make_store, schema, shard_data, write_store

from ditdata.common import files
from ditdata.errors import DitdataError
from ditdata.imageshards import folder as imageshards
from ditdata.store import BACKEND_CLASSES, MANIFEST, StoreError, StoreWriter
from dittrain.cli import main as dittrain_cli
from dittrain.inference.weights import load_weights
from dittrain.rundir import CheckpointError, export_weights, latest_checkpoint, load_checkpoint, save_checkpoint

# every shard format of the store's table: a new backend is tested too
BACKENDS = list(BACKEND_CLASSES)


def limited(nbytes: int):
    """preexec_fn: the child may not make any file larger than nbytes."""
    def set_limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.RLIM_INFINITY))
    return set_limit


def child(args: list[str], limit: int, **kw) -> subprocess.CompletedProcess:
    env = child_env(PYTHONDONTWRITEBYTECODE="1")  # no .pyc past the limit
    return subprocess.run([sys.executable, *args], preexec_fn=limited(limit), env=env,
                          capture_output=True, text=True, timeout=600, **kw)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def debris(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if files.is_tmp(p))


def error_lines(stderr: str) -> list[str]:
    """The "Error: ..." messages of a CLI's stderr, each to the end of its line (a progress
    bar left unfinished may precede one on the same line)."""
    return re.findall(r"Error: [^\r\n]*", stderr)


# ---------------------------------------------------------------------------- checkpoints


def test_checkpoint_past_the_file_size_limit(tmp_path):
    store = make_store(tmp_path / "store")
    out = tmp_path / "run"
    r = CliRunner().invoke(dittrain_cli, run_args(store, out, "--max-steps", 2, "--save-every", 2))
    assert r.exit_code == 0, r.output
    ckpt, ema = out / "checkpoints" / "step_00000002.pt", out / "ema.safetensors"
    before = {ckpt: sha(ckpt), ema: sha(ema)}

    # Resume under a limit below the checkpoint's size: the step-4 checkpoint cannot be written.
    r = child(["-m", "dittrain.cli", *run_args(store, out, "--max-steps", 4, "--save-every", 2, "--resume")],
              limit=ckpt.stat().st_size // 2)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    lines = error_lines(r.stderr)
    assert len(lines) == 1, r.stderr
    final = out / "checkpoints" / "step_00000004.pt"
    assert str(final) in lines[0] and "File too large" in lines[0] and "step_00000002.pt is intact" in lines[0]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002.pt"]  # no tmp
    assert debris(out) == []
    assert {p: sha(p) for p in before} == before
    assert load_checkpoint(ckpt)["step"] == 2
    assert load_weights(ema)[1]["train"]["optim"]["max_steps"] == 2

    r = CliRunner().invoke(dittrain_cli, run_args(store, out, "--max-steps", 4, "--save-every", 2, "--resume"))
    assert r.exit_code == 0, r.output
    assert latest_checkpoint(out) == final and load_checkpoint(final)["step"] == 4


def test_checkpoint_write_failure_in_process(tmp_path, monkeypatch):
    """Any failure inside torch.save / safetensors: one-line CheckpointError, tmp removed."""
    first = save_checkpoint(tmp_path, 1, {"w": torch.zeros(3)})
    export_weights(tmp_path / "ema.safetensors", {"w": torch.zeros(3)}, {"x": 1})
    kept = {first: sha(first), tmp_path / "ema.safetensors": sha(tmp_path / "ema.safetensors")}
    enospc(monkeypatch)
    msg = raises_one_line(CheckpointError, lambda: save_checkpoint(tmp_path, 2, {"w": torch.ones(3)}))
    assert "step_00000002.pt" in msg and "No space left on device" in msg
    assert "step_00000001.pt is intact" in msg
    with pytest.raises(CheckpointError, match="ema.safetensors: could not write the EMA weights"):
        export_weights(tmp_path / "ema.safetensors", {"w": torch.ones(3)}, {"x": 2})
    assert debris(tmp_path) == [] and list_names(tmp_path / "checkpoints") == ["step_00000001.pt"]
    assert {p: sha(p) for p in kept} == kept


def list_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def enospc(monkeypatch) -> None:
    """Every fsync of a regular file fails as on a full disk (NFS, thin provisioning)."""
    fail_fsync(monkeypatch, errno.ENOSPC)


# ---------------------------------------------------------------------------- the store

STORE_CHILD = textwrap.dedent("""
    import hashlib, sys
    from pathlib import Path
    from storeutil import INFO, schema, shard_data
    from ditdata.store import MANIFEST, StoreError, StoreWriter

    root = Path(sys.argv[1])
    sch = schema()
    w = StoreWriter(root, schema=sch, info=INFO)
    w.write_shard("00000", *shard_data(sch, 0, 3))
    w.finalize()
    print("manifest", hashlib.sha256((root / MANIFEST).read_bytes()).hexdigest(), flush=True)
    try:
        w.write_shard("00001", *shard_data(sch, 1, 2000))  # chunks of 1024 x 512 bytes: past the limit
    except StoreError as e:
        print("StoreError", e)
        sys.exit(3)
""")


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_shard_past_the_file_size_limit(tmp_path, backend):
    root = tmp_path / "store"
    script = STORE_CHILD.replace("info=INFO)", f"info=INFO, backend={backend!r})")
    r = child(["-c", script, str(root)], limit=64 * 1024)
    assert r.returncode == 3, r.stdout + r.stderr
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    suffix = ".zarr" if backend == "zarr" else ".tar"
    assert out["StoreError"].startswith(f"{root / 'shards' / ('00001' + suffix)}: could not write shard 00001")
    assert "File too large" in out["StoreError"] and "\n" not in out["StoreError"].strip()
    assert debris(root) == []
    assert not (root / "shards" / "00001.json").exists() and not (root / "shards" / f"00001{suffix}").exists()
    w = StoreWriter(root, schema=schema(), info=INFO, backend=backend)
    assert w.done("00000") and not w.done("00001")
    assert sha(root / MANIFEST) == out["manifest"]


def fail_fsync(monkeypatch, err: int, when=lambda name: True) -> None:
    """fsync of a regular file whose name passes `when` fails with errno `err`."""
    real = os.fsync

    def fsync(fd):
        if stat.S_ISREG(os.fstat(fd).st_mode) and when(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(err, os.strerror(err))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_store_record_data_manifest_and_config_failures(tmp_path, monkeypatch):
    sch = schema(flip=False, text=False)
    w = write_store(tmp_path, sch, [3])
    manifest_before = sha(tmp_path / MANIFEST)
    config_before = sha(tmp_path / "config.json")
    shards = tmp_path / "shards"
    only_first = ["00000.json", "00000.zarr"]

    with monkeypatch.context() as m:  # the record's write fails
        fail_fsync(m, errno.EFBIG, lambda name: ".00001.json" in name)
        with pytest.raises(StoreError, match=r"shards/00001\.json: could not write the record of shard "
                                             r"00001 \(File too large\)"):
            w.write_shard("00001", *shard_data(sch, 1, 2))
    assert debris(tmp_path) == [] and list_names(shards) == only_first

    with monkeypatch.context() as m:  # the data's sync fails
        fail_fsync(m, errno.ENOSPC, lambda name: ".00001.zarr" in name)
        with pytest.raises(StoreError, match=r"shards/00001\.zarr: could not write shard 00001 \(No space"):
            w.write_shard("00001", *shard_data(sch, 1, 2))
    assert debris(tmp_path) == [] and list_names(shards) == only_first

    with monkeypatch.context() as m:  # the data's rename fails after its record was written
        real_replace = os.replace

        def replace(src, dst, *a, **kw):
            if str(dst).endswith("00001.zarr"):
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real_replace(src, dst, *a, **kw)

        m.setattr(os, "replace", replace)
        with pytest.raises(StoreError, match=r"shards/00001\.zarr: could not write shard 00001 \(Input/output"):
            w.write_shard("00001", *shard_data(sch, 1, 2))
    assert debris(tmp_path) == [] and list_names(shards) == only_first  # the record went too

    w.write_shard("00001", *shard_data(sch, 1, 2))
    with monkeypatch.context() as m:  # the manifest over both shards cannot be written
        fail_fsync(m, errno.ENOSPC)
        with pytest.raises(StoreError, match=r"manifest\.json: could not write the manifest \(No space"):
            w.finalize()
        with pytest.raises(StoreError, match=r"config\.json: could not write the store config"):
            StoreWriter(tmp_path / "fresh", schema=sch, info=INFO)
    assert debris(tmp_path) == [] and not (tmp_path / "fresh" / "config.json").exists()
    assert sha(tmp_path / MANIFEST) == manifest_before and sha(tmp_path / "config.json") == config_before
    assert w.finalize()["num_samples"] == 5  # once there is room again


def test_damaged_store_config_is_named(tmp_path):
    sch = schema(flip=False, text=False)
    write_store(tmp_path, sch, [2])
    (tmp_path / "config.json").write_bytes(b'{"backend": "zarr", "fie')
    with pytest.raises(StoreError, match=r"config\.json: unreadable store config \(JSONDecodeError"):
        StoreWriter(tmp_path, schema=sch, info=INFO)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(StoreError, match=r"config\.json: unreadable store config"):
        StoreWriter(tmp_path, schema=sch, info=INFO)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(StoreError, match=r"config\.json: not a store config"):
        StoreWriter(tmp_path, schema=sch, info=INFO)


def test_damaged_record_means_unfinished(tmp_path):
    sch = schema(flip=False, text=False)
    w = write_store(tmp_path, sch, [2, 2], finalize=False)
    (tmp_path / "shards" / "00001.json").write_bytes(b"\xff\xfe garbage")
    (tmp_path / "shards" / "00000.json").write_text("[]")
    assert not w.done("00000") and not w.done("00001")  # rewritten on the next run, no traceback


# ---------------------------------------------------------------------------- image shards


def noise_jpeg(size: int, seed: int) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def test_image_shard_past_the_file_size_limit(tmp_path):
    """`ditdata fetch` of a class folder: shard 00000 (small images) is finished, shard
    00001 (large ones) does not fit under the limit."""
    src, out = tmp_path / "src", tmp_path / "shards"
    for cls, size in (("a", 16), ("b", 192)):
        (src / cls).mkdir(parents=True)
        for i in range(2):
            (src / cls / f"{i}.jpg").write_bytes(noise_jpeg(size, i))
    limit = 64 * 1024
    assert len(noise_jpeg(192, 0)) < limit < 2 * len(noise_jpeg(192, 0))
    r = child(["-m", "ditdata.cli", "fetch", str(src), "--out", str(out), "--kind", "classes",
               "--samples-per-shard", "2", "--processes", "1", "--quiet"], limit=limit)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and r.stderr.strip() == lines[0], r.stderr
    assert f"{out / '00001.tar'}: could not write the shard (File too large)" in lines[0]
    assert debris(out) == []
    assert not (out / "00001.tar").exists() and not (out / "00001_stats.json").exists()
    assert not (out / imageshards.DATASET_INFO).exists()
    assert [p.name for p in imageshards.list_shards(out)] == ["00000.tar"]
    assert len(list(imageshards.iter_shard(out / "00000.tar"))) == 2


def test_shard_writer_failure_in_process(tmp_path, monkeypatch):
    with imageshards.ShardWriter(tmp_path, 0) as w:
        w.write("000000", b"x", "jpg", {"key": "000000"})
    before = sha(tmp_path / "00000.tar")
    enospc(monkeypatch)
    with pytest.raises(DitdataError, match=r"00000\.tar: could not write the shard \(No space left"):
        with imageshards.ShardWriter(tmp_path, 0) as w:
            w.write("000000", b"y", "jpg", {"key": "000000"})
    with pytest.raises(DitdataError, match=r"00000_stats\.json: could not write"):
        imageshards.write_shard_stats(tmp_path, 0, {"count": 1})
    import pyarrow as pa
    with pytest.raises(DitdataError, match=r"scores\.parquet: could not write"):
        imageshards.write_parquet_atomic(tmp_path / "scores.parquet", pa.table({"a": [1]}))
    assert list_names(tmp_path) == ["00000.tar"] and sha(tmp_path / "00000.tar") == before


# ---------------------------------------------------------------------------- directory syncs


@pytest.fixture
def events(monkeypatch):
    """[("rename", dst) | ("dirsync", (st_dev, st_ino))] in the order they happen."""
    log = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            log.append(("dirsync", (st.st_dev, st.st_ino)))
        return real_fsync(fd)

    def replace(src, dst, *a, **kw):
        real_replace(src, dst, *a, **kw)
        log.append(("rename", Path(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return log


def synced_after_rename(log, path: Path) -> bool:
    """`path` was renamed into place and its directory was fsynced after that rename."""
    renames = [i for i, e in enumerate(log) if e == ("rename", path)]
    assert renames, f"{path} was never renamed into place"
    st = path.parent.stat()
    return ("dirsync", (st.st_dev, st.st_ino)) in log[renames[-1] + 1:]


def test_checkpoint_directories_are_synced(tmp_path, events):
    ckpt = save_checkpoint(tmp_path, 1, {"w": torch.zeros(2)})
    ema = export_weights(tmp_path / "ema.safetensors", {"w": torch.zeros(2)}, {"x": 1})
    assert synced_after_rename(events, ckpt)  # checkpoints/
    assert synced_after_rename(events, ema)   # the run directory


def test_store_directories_are_synced(tmp_path, events):
    write_store(tmp_path, schema(flip=False, text=False), [2, 3])
    shards = tmp_path / "shards"
    for p in (shards / "00000.zarr", shards / "00000.json", shards / "00001.zarr", shards / "00001.json",
              tmp_path / "config.json", tmp_path / MANIFEST):
        assert synced_after_rename(events, p), p
    # and the zarr shard's own sub-directories, before its rename
    st = (shards / "00001.zarr" / "latent").stat()
    assert ("dirsync", (st.st_dev, st.st_ino)) in events


def test_image_shard_folder_is_synced(tmp_path, events):
    with imageshards.ShardWriter(tmp_path, 0) as w:
        w.write("000000", b"x", "jpg", {"key": "000000"})
    imageshards.write_shard_stats(tmp_path, 0, {"count": 1})
    imageshards.write_json_atomic(tmp_path / imageshards.DATASET_INFO, {"done": True})
    import pyarrow as pa
    imageshards.write_parquet_atomic(tmp_path / "sel.parquet", pa.table({"a": [1]}))
    for name in ("00000.tar", "00000_stats.json", imageshards.DATASET_INFO, "sel.parquet"):
        assert synced_after_rename(events, tmp_path / name), name
