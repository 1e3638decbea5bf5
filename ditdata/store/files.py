"""Filesystem primitives the store relies on: atomic writes and content digests.

A store must never show a half-written file under its final name, so everything that
readers look at (shard data, shard records, the manifest) is written to a temporary
name in the same directory and renamed into place; rename is atomic on POSIX.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

TMP_MARK = ".tmp-"


def tmp_name(final: Path) -> Path:
    """A temporary sibling of `final`: hidden, unique per writer, recognisable as debris."""
    return final.with_name(f".{final.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def is_tmp(path: Path) -> bool:
    return path.name.startswith(".") and TMP_MARK in path.name


def fsync_tree(path: Path) -> None:
    """Flush file contents to disk so a rename never publishes data the kernel still holds."""
    paths = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Move a finished temporary file or directory to its final name."""
    if final.is_dir() and not final.is_symlink():
        shutil.rmtree(final)
    os.replace(tmp, final)


def write_json_atomic(path: Path, obj, indent: int | None = 1) -> None:
    tmp = tmp_name(path)
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=indent, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


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
