"""The JSON documents ditdata writes and reads again (dataset.json, shard stats, selection
files, CLIP model configs): read with a one-line DitdataError, and checked for their format
and version."""

from __future__ import annotations

from pathlib import Path

from ditdata.common.files import read_json
from ditdata.errors import DitdataError


def load_json(path: Path, problem: str):
    """The JSON document at `path`, or DitdataError "PATH: {problem} (why)"."""
    try:
        return read_json(path)
    except (OSError, ValueError) as e:
        raise DitdataError(f"{path}: {problem} ({e})") from None


def check_format(doc, path: Path, fmt: str, version: int, what: str, version_word: str = "version") -> None:
    """DitdataError unless `doc` (read from `path`) is a dict of format `fmt` at `version`:
    "PATH: not a {fmt} {what}", or "PATH: {version_word} V is not supported (expected ...)"."""
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise DitdataError(f"{path}: not a {fmt} {what}")
    if doc.get("version") != version:
        raise DitdataError(f"{path}: {version_word} {doc.get('version')!r} is not supported (expected {version})")
