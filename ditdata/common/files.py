"""Filesystem primitives the store relies on: atomic writes and content digests.

A store must never show a half-written file under its final name, so everything that
readers look at (shard data, shard records, the manifest) is written to a temporary
name in the same directory and renamed into place; rename is atomic on POSIX. The data
is synced before the rename and the directory after it, so a power cut leaves either the
old file or the complete new one. This module is the one home of these helpers: the image
shards, checkpoints and selection/score files use them too.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO

TMP_MARK = ".tmp-"


def tmp_name(final: Path) -> Path:
    """A temporary sibling of `final`: hidden, unique per writer, recognisable as debris."""
    return final.with_name(f".{final.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def is_tmp(path: Path) -> bool:
    return path.name.startswith(".") and TMP_MARK in path.name


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries: a rename is only durable once its directory is synced,
    so without this a power cut can lose a file that was already reported written."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        # Some filesystems (a few network and FUSE ones) cannot sync a directory at all;
        # there is nothing better to do there, and the data itself is already synced.
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush file contents (and, for a directory, its entries) to disk so a rename never
    publishes data the kernel still holds."""
    if path.is_file():
        regular, dirs = [path], []
    else:
        entries = list(path.rglob("*"))
        regular = sorted(p for p in entries if p.is_file())
        # Deepest first: a directory's entries are synced before the directory holding it.
        dirs = sorted((p for p in entries if p.is_dir()), key=lambda p: -len(p.parts)) + [path]
    for p in regular:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for d in dirs:
        fsync_dir(d)


def publish(tmp: Path, final: Path) -> None:
    """Move a finished (synced) temporary file or directory to its final name, durably."""
    if final.is_dir() and not final.is_symlink():
        shutil.rmtree(final)
    _rename(tmp, final)


def _rename(tmp: Path, final: Path) -> None:
    os.replace(tmp, final)
    fsync_dir(final.parent)


@contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `final` for a library to write (a file or a directory);
    when the block succeeds it is synced and published under `final`. On any failure (disk
    full, file-size limit, an exception in the block) the temporary is removed and `final`
    is left as it was, so nothing half-written ever carries the final name."""
    final = Path(final)
    tmp = tmp_name(final)
    try:
        yield tmp
        fsync_tree(tmp)
        publish(tmp, final)
    except BaseException:
        remove(tmp)
        raise


@contextmanager
def atomic_file(final: Path, mode: str = "wb", encoding: str | None = None) -> Iterator[IO]:
    """An open file that appears under `final` only once the block finished without error
    (written like atomic_path, synced through its own descriptor)."""
    final = Path(final)
    tmp = tmp_name(final)
    try:
        with open(tmp, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        _rename(tmp, final)
    except BaseException:
        remove(tmp)
        raise


def write_bytes_atomic(path: Path, data: bytes) -> None:
    with atomic_file(path, "wb") as f:
        f.write(data)


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_file(path, "w", encoding="utf-8") as f:
        f.write(text)


def write_json_atomic(path: Path, obj, indent: int | None = 1, *, ensure_ascii: bool = True) -> None:
    with atomic_file(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=indent, sort_keys=False, ensure_ascii=ensure_ascii)
        f.write("\n")


def error_reason(e: BaseException) -> str:
    """A short, one-line reason for a failed write. Libraries that write through their own
    code (torch's zip writer, safetensors) hide the OSError behind their own exception;
    the errno text ("No space left on device", "File too large") is what a user can act on."""
    seen = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno:
            return os.strerror(cur.errno)
        cur = cur.__cause__ or cur.__context__
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def remove_settled(path: Path, *, quiet_s: float = 0.2, timeout_s: float = 5.0) -> None:
    """Remove what a failed writer left at `path`, and again if it reappears: a library that
    writes from its own threads (zarr writes chunks concurrently on its event loop) may still
    finish writes that were in flight when the first one failed. Returns once `path` has
    stayed absent for `quiet_s` (or after `timeout_s`)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        remove(path)
        quiet_until = time.monotonic() + quiet_s
        while time.monotonic() < quiet_until and not (path.exists() or path.is_symlink()):
            time.sleep(0.02)
        if not (path.exists() or path.is_symlink()) or time.monotonic() > deadline:
            return


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def list_files(path: Path) -> list[Path]:
    """The regular files that make up a shard: the file itself, or a directory's files."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file())


def describe_files(data: Path, root: Path) -> dict[str, dict]:
    """{path relative to the store root: {"size", "sha256"}} for every file of a shard."""
    return {
        p.relative_to(root).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in list_files(data)
    }


def combined_checksum(files: dict[str, dict]) -> str:
    """One digest for a shard, over its sorted file list and each file's digest."""
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(f"{rel}\0{files[rel]['size']}\0{files[rel]['sha256']}\n".encode())
    return "sha256:" + h.hexdigest()


def read_json(path: Path, encoding: str = "utf-8"):
    """A JSON file's content (OSError or json.JSONDecodeError for the caller to word)."""
    return json.loads(Path(path).read_text(encoding=encoding))


def read_json_or_none(path: Path):
    """A JSON file's content, None when it is absent or damaged (ValueError: bad JSON or
    UTF-8): for files that are rewritten when they cannot be used, such as a manifest or a
    shard's record. Other OSErrors (permissions, I/O) still raise."""
    with suppress(FileNotFoundError, ValueError):
        return read_json(path)
    return None


def state_dict_sha256(state: dict) -> str:
    """sha256 over a state dict's names, dtypes, shapes and bytes, in name order (the same for an
    EMA export and the checkpoint it came from, on any device). A tensor subclass that wraps
    others (torchao's int8 weight-only tensors of an int8 export) is digested through its inner
    tensors (int8 data, scales), its class and its flatten context: such tensors have no bytes of
    their own. torch is imported only here, by callers that hold tensors already."""
    h = hashlib.sha256()
    for name in sorted(state):
        _digest_tensor(h, name, state[name])
    return h.hexdigest()


def _digest_tensor(h, name: str, t) -> None:
    import re

    import torch
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    t = t.detach()
    if is_traceable_wrapper_subclass(t):
        inner, ctx = t.__tensor_flatten__()
        kind = f"{type(t).__module__}.{type(t).__qualname__}"
        context = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(ctx))  # no object addresses: the same in every process
        h.update(f"{name}\0{kind}\0{t.dtype}\0{tuple(t.shape)}\0{context}\0".encode())
        for attr in inner:
            _digest_tensor(h, f"{name}.{attr}", getattr(t, attr))
        return
    t = t.cpu().contiguous()
    h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().data)  # bits: bf16 has no numpy dtype


def json_digest(obj) -> str:
    """sha256 (hex) of a JSON value in canonical form (sorted keys, no spaces; anything JSON
    cannot hold as its str()): equal content, equal digest, on every machine."""
    canon = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canon.encode()).hexdigest()
