"""Caption sets: other captions of an image shard's samples, beside the shard, row for row.

`ditdata caption` (ditdata.captions) writes them; `ditdata score --captions SET`, `ditdata
filter`, `ditdata inspect` / `verify` and the text encoders of `ditdata encode` read them.

A set has a name (letters, digits, "_" and "-", at most 64 characters). The name "alt" is
reserved: it is the shard's own captions (the alt-text `ditdata fetch` stored with each
sample), read from the tar itself; no file holds it. For any other set NAME and each image
shard NNNNN.tar, NNNNN.captions.NAME.parquet lies beside it, one row per sample in the
shard's stored order:

    key       string  the sample key
    caption   string  the caption, stripped of surrounding whitespace; null when there is
                      none (the image could not be decoded, or the captioner gave only
                      whitespace)
    status    string  "ok"; "empty" (nothing but whitespace), "repeated" (a degenerate
                      loop, ditdata.captions.quality), "truncated" (generation stopped at
                      max_new_tokens before its end-of-sequence token); or why the image
                      could not be decoded (BadImageError.reason, e.g. "truncated image")
    tokens    int32   tokens generated for it (null when nothing was generated)

A flagged caption ("repeated", "truncated") keeps its text: the status says what is wrong
with it and readers choose (read_caption_set(..., only_ok=True) gives None for them).

The parquet's schema metadata holds b"ditdata" = JSON {format: "ditdata-captions",
version, set, shard, shard_bytes, num_samples, captioner {name, kind, source, model_class,
weights_sha256}, prompt, max_new_tokens, num_beams, counts (status -> n)}. It records no
time on purpose: a shard captioned again with the same settings, e.g. by a run resumed after
a kill, gives the same bytes as in a clean run.

Writing is atomic (ditdata.imageshards.folder.write_parquet_atomic); read_caption_meta
trusts only a complete file of this format and version, so a killed writer never leaves a
set that looks finished.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ditdata.errors import DitdataError
from ditdata.imageshards import folder as shards

FORMAT = "ditdata-captions"
VERSION = 1
ALT = "alt"  # the shard's own captions
META_KEY = b"ditdata"
PREFIX = ".captions."
SUFFIX = ".parquet"
COLUMNS = ("key", "caption", "status", "tokens")
OK = "ok"
EMPTY = "empty"
REPEATED = "repeated"
TRUNCATED = "truncated"
FLAGS = (EMPTY, REPEATED, TRUNCATED)  # statuses of a caption that was generated but is suspect
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_FILE_RE = re.compile(r"^(\d{5,})\.captions\.([A-Za-z0-9_-]{1,64})\.parquet$")


def check_set_name(name: str, *, allow_alt: bool = True) -> str:
    """`name` when it is a valid caption-set name, else DitdataError naming the rule. With
    allow_alt=False (a set about to be written) the reserved "alt" is refused too."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise DitdataError(f"caption set name {name!r} is not valid: use 1-64 letters, digits, '_' or '-'")
    if name == ALT and not allow_alt:
        raise DitdataError(f"caption set name {ALT!r} is reserved for the shards' own captions (the alt-text); "
                           "choose another --out-name")
    return name


def caption_set_path(shard_tar, name: str) -> Path:
    """NNNNN.tar -> NNNNN.captions.NAME.parquet beside it (not for "alt", which has no file)."""
    check_set_name(name, allow_alt=False)
    return shards.beside(shard_tar, f"{PREFIX}{name}{SUFFIX}")


def schema():
    import pyarrow as pa

    return pa.schema([("key", pa.string()), ("caption", pa.string()), ("status", pa.string()),
                      ("tokens", pa.int32())])


def read_caption_meta(path) -> dict | None:
    """The metadata of a complete caption-set file, or None when it is missing, unreadable,
    truncated or not ours (a killed or damaged file is never trusted)."""
    return shards.read_parquet_meta(path, META_KEY, FORMAT, VERSION, COLUMNS)


def write_caption_set(path, rows: dict, meta: dict) -> None:
    """Write one caption-set file atomically: `rows` maps COLUMNS to lists of one length."""
    import pyarrow as pa

    n = len(rows["key"])
    if any(len(rows[c]) != n for c in COLUMNS) or meta.get("num_samples") != n:
        raise ValueError("caption set rows and num_samples disagree")
    sch = schema().with_metadata({META_KEY: json.dumps(meta, sort_keys=True).encode()})
    shards.write_parquet_atomic(Path(path), pa.Table.from_pydict({c: rows[c] for c in COLUMNS}, schema=sch))


def _complete(shard_tar, name: str) -> tuple[Path, dict]:
    """The set's file and metadata; DitdataError when it is missing, incomplete or made for
    another version of the shard."""
    tar = Path(shard_tar)
    p = caption_set_path(tar, name)
    meta = read_caption_meta(p)
    if meta is None:
        raise DitdataError(f"{tar}: no complete caption set {name!r} ({p.name}); run `ditdata caption "
                           f"{tar.parent} --captioner NAME --out-name {name}` first")
    if tar.is_file() and meta.get("shard_bytes") != tar.stat().st_size:
        raise DitdataError(f"{p}: made for a different version of the shard {tar.name}; rerun `ditdata caption "
                           f"{tar.parent} --captioner NAME --out-name {name} --overwrite`")
    return p, meta


def read_caption_table(shard_tar, name: str):
    """A set's whole file (COLUMNS, stored order) as a pyarrow Table, and its metadata."""
    import pyarrow.parquet as pq

    p, meta = _complete(shard_tar, name)
    return pq.read_table(p, columns=list(COLUMNS)), meta


def read_caption_set(shard_tar, name: str, *, only_ok: bool = False) -> dict[str, str | None]:
    """{key: caption or None} of one shard in stored order. "alt": the shard's own captions,
    read from the tar (None where a sample has none). Another name: its caption-set file
    (DitdataError when that is missing or incomplete); with only_ok, None also where the
    caption is flagged (status not "ok")."""
    check_set_name(name)
    if name == ALT:
        return {s.key: s.caption for s in shards.iter_shard(shard_tar)}
    t, _ = read_caption_table(shard_tar, name)
    keys, caps, status = (t.column(c).to_pylist() for c in ("key", "caption", "status"))
    if only_ok:
        caps = [c if s == OK else None for c, s in zip(caps, status, strict=True)]
    return dict(zip(keys, caps, strict=True))


def list_caption_sets(shards_dir) -> list[str]:
    """The caption sets of an image-shard folder: "alt" first (unless the folder is a class
    dataset, whose samples have labels instead of captions), then every NAME that has at
    least one complete or partial NNNNN.captions.NAME.parquet, sorted. A set need not cover
    every shard (a caption run may be under way): set_coverage says how far it is."""
    d = Path(shards_dir)
    names = set()
    for p in d.glob(f"*{PREFIX}*{SUFFIX}"):
        m = _FILE_RE.match(p.name)
        if m:
            names.add(m.group(2))
    info = _info(d)
    alt = [] if info.get("kind") == "classes" else [ALT]
    return alt + sorted(names - {ALT})


def _info(d: Path) -> dict:
    try:
        return shards.read_folder(d).info
    except DitdataError:
        return {}


def set_coverage(shards_dir, name: str) -> dict:
    """How far set `name` covers a folder's shards: {shards, complete, stale (made for another
    version of the shard), missing (names), counts (status -> n over the complete files),
    captioners (the distinct captioner records)}."""
    tars = shards.read_folder(shards_dir).shards
    out = {"shards": len(tars), "complete": 0, "stale": [], "missing": [], "counts": {}, "captioners": []}
    for tar in tars:
        meta = read_caption_meta(caption_set_path(tar, name))
        if meta is None:
            out["missing"].append(tar.name)
        elif meta.get("shard_bytes") != tar.stat().st_size:
            out["stale"].append(tar.name)
        else:
            out["complete"] += 1
            for k, v in (meta.get("counts") or {}).items():
                out["counts"][k] = out["counts"].get(k, 0) + int(v)
            if meta.get("captioner") not in out["captioners"]:
                out["captioners"].append(meta.get("captioner"))
    return out


__all__ = ["ALT", "FLAGS", "FORMAT", "VERSION", "caption_set_path", "check_set_name", "list_caption_sets",
           "read_caption_meta", "read_caption_set", "read_caption_table", "set_coverage", "write_caption_set"]
