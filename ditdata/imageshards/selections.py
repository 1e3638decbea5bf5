"""Selection files: the samples `ditdata filter` and `ditdata dedup` chose, which `ditdata encode
--select` (and the next filter or dedup, --select) reads.

A selection file is a parquet file, or a JSON file when its name ends in .json:

    parquet  columns shard (image shard file name, e.g. 00000.tar), key, clip_score; one
             row per kept sample in shard and stored order; schema metadata b"ditdata" =
             JSON {format: "ditdata-selection", version, rule, created_at}
    json     {"format": "ditdata-selection", "version", "rule", "created_at",
              "shards": {"00000.tar": [kept keys in stored order], ...}}

`rule` records how the selection was made (it goes into a store manifest's "filter"; its
fields: ditdata.scoring.filter and ditdata.scoring.dedup).

    from ditdata.imageshards.selections import load_selection
    sel = load_selection("selection.parquet")      # DitdataError if missing or invalid
    if key in sel: ...                             # sel.keys: set[str], sel.rule: dict
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from ditdata.errors import DitdataError

FORMAT = "ditdata-selection"
VERSION = 1
META_KEY = b"ditdata"


@dataclass
class Selection:
    """The samples chosen by `ditdata filter`: `keys`, the same keys per image shard
    (`shards`: shard file name -> keys in stored order) and the `rule` that chose them
    (JSON-serialisable, module docstring)."""

    keys: set[str]
    rule: dict
    shards: dict[str, list[str]] = field(default_factory=dict)
    path: str | None = None

    def __contains__(self, key) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.keys)


def write_selection(path, by_shard: dict[str, list[str]], rule: dict, scores: list | None = None) -> None:
    """Write a selection atomically: JSON when `path` ends in .json, else parquet."""
    from ditdata.imageshards.folder import write_json_atomic, write_parquet_atomic

    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    created = datetime.now(UTC).isoformat(timespec="seconds")
    if path.suffix.lower() == ".json":
        doc = {"format": FORMAT, "version": VERSION, "rule": rule, "created_at": created, "shards": by_shard}
        write_json_atomic(path, doc)
    else:
        import pyarrow as pa

        shard_col = [s for s, ks in by_shard.items() for _ in ks]
        key_col = [k for ks in by_shard.values() for k in ks]
        meta = {"format": FORMAT, "version": VERSION, "rule": rule, "created_at": created}
        sch = pa.schema([("shard", pa.string()), ("key", pa.string()), ("clip_score", pa.float64())],
                        metadata={META_KEY: json.dumps(meta).encode()})
        table = pa.table({"shard": shard_col, "key": key_col,
                          "clip_score": scores if scores is not None else [None] * len(key_col)}, schema=sch)
        write_parquet_atomic(path, table)


def load_selection(path) -> Selection:
    """Read a selection file written by `ditdata filter` (parquet or JSON, detected from
    its content). DitdataError when it is missing or not a valid selection."""
    from ditdata.jsondocs import check_format, load_json

    p = Path(path)
    if not p.is_file():
        raise DitdataError(f"{p}: selection file not found (make one with `ditdata filter SHARDS ... --out {p}`)")
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise DitdataError(f"{p}: unreadable selection ({e})") from None
    if magic == b"PAR1":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(p)
            meta = json.loads((table.schema.metadata or {}).get(META_KEY, b"null"))
            shard_col = table.column("shard").to_pylist()
            key_col = table.column("key").to_pylist()
        except Exception as e:
            raise DitdataError(f"{p}: not a valid selection file ({type(e).__name__}: {e})") from None
        by_shard: dict[str, list[str]] = {}
        for s, k in zip(shard_col, key_col, strict=True):
            by_shard.setdefault(s, []).append(k)
    else:
        meta = load_json(p, "not a valid selection file")
        by_shard = meta.get("shards") if isinstance(meta, dict) else None
        if not isinstance(by_shard, dict) or not all(
            isinstance(v, list) and all(isinstance(k, str) for k in v) for v in by_shard.values()
        ):
            raise DitdataError(f"{p}: not a valid selection file (no 'shards' mapping of keys)")
    check_format(meta, p, FORMAT, VERSION, "file", "selection version")
    rule = meta.get("rule")
    if not isinstance(rule, dict):
        raise DitdataError(f"{p}: selection has no rule")
    keys = {k for ks in by_shard.values() for k in ks}
    if any(k is None for k in keys):
        raise DitdataError(f"{p}: selection has a null key")
    return Selection(keys=keys, rule=rule, shards=by_shard, path=str(p))
