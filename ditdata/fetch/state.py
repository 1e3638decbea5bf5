"""What a fetch records in SHARDS_DIR beside its shards, and the settings that decide them.

    PackOptions         the options that decide a shard's bytes (recorded, resolved)
    check_state         .fetch_state: a rerun resumes the same fetch or is refused
    clear_previous      --overwrite: delete what a fetch wrote, nothing else
    write_dataset_info  dataset.json, written last, when every shard is finished

Shared by both engines (ditdata/fetch/folders.py, ditdata/fetch/urllists.py).
"""

from __future__ import annotations

import math
import re
import shutil
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path

from ditdata.common.extras import installed_version
from ditdata.common.files import read_json
from ditdata.common.lock import LOCK_FILE
from ditdata.config import FetchConfig
from ditdata.errors import DitdataError
from ditdata.images import DEFAULT_MAX_PIXELS
from ditdata.imageshards import folder as shards

STATE = shards.FETCH_STATE
URL_COPIES = ".urls"  # the screened copies of a URL list that img2dataset reads
RETRY_RECORD = ".fetch_retries"  # --retry-failed: the fetch's options and passes (ditdata/fetch/retries.py)
RETRY_SCRATCH = ".retry"  # --retry-failed: img2dataset's output while a pass downloads
_SHARD_FILE = re.compile(r"^\d{5,}(\.tar|_stats\.json|\.parquet)$")  # what a fetch writes per shard


@dataclass(frozen=True)
class PackOptions:
    """The part of a FetchConfig that decides the contents of a shard (recorded in
    .fetch_state), with the defaults resolved: see pack_options."""

    image_size: int | None
    resize_mode: str
    min_image_size: int
    max_aspect_ratio: float
    encode_format: str
    encode_quality: int
    max_pixels: int
    samples_per_shard: int


def pack_options(cfg: FetchConfig, image_size: int | None) -> PackOptions:
    """cfg's PackOptions, with this image_size (a URL list has a default) and the decoder's
    own pixel limit unless cfg sets one."""
    opts = {f.name: getattr(cfg, f.name) for f in fields(PackOptions)}
    return PackOptions(**{**opts, "image_size": image_size,
                          "max_pixels": cfg.max_pixels or DEFAULT_MAX_PIXELS})


def check_state(out: Path, state: dict) -> None:
    """Claim OUT for the fetch that `state` describes: refuse to resume into it if what
    decides the shard contents has changed, or if it holds shards some other command wrote;
    record `state` in a new folder. dataset.json goes until the fetch is complete again."""
    p = out / STATE
    if p.is_file():
        try:
            prev = read_json(p)
        except ValueError:
            prev = None
        if prev != state:
            diffs = sorted(k for k in set(state) | set(prev or {}) if (prev or {}).get(k) != state.get(k))
            if "options" in diffs and prev:
                o1, o2 = prev.get("options", {}), state["options"]
                diffs = [d for d in diffs if d != "options"] + [
                    f"{k} {o1.get(k)!r} -> {o2.get(k)!r}" for k in sorted(set(o1) | set(o2)) if o1.get(k) != o2.get(k)
                ]
            raise DitdataError(
                f"{out} holds a fetch with other inputs or settings ({'; '.join(diffs)}); "
                "pass --overwrite to start over, or choose another --out"
            )
    else:
        ours = [q for q in out.iterdir() if _SHARD_FILE.match(q.name) or q.name == shards.DATASET_INFO]
        if ours:
            raise DitdataError(
                f"{out} already holds shards that this command did not start ({ours[0].name}, ...); "
                "pass --overwrite to replace them, or choose another --out"
            )
        shards.write_json_atomic(p, state)
    (out / shards.DATASET_INFO).unlink(missing_ok=True)


def clear_previous(out: Path) -> None:
    """--overwrite: delete a previous fetch, but only files a fetch writes."""
    known = []
    strangers = []
    for q in out.iterdir():
        if q.name == LOCK_FILE:
            continue
        if (_SHARD_FILE.match(q.name) or q.name in (shards.DATASET_INFO, STATE, RETRY_RECORD) or shards.is_tmp(q)
                or (q.name in ("_tmp", URL_COPIES, RETRY_SCRATCH) and q.is_dir())):
            known.append(q)
        else:
            strangers.append(q.name)
    if strangers:
        raise DitdataError(
            f"--overwrite: refusing to empty {out}, it holds files ditdata fetch did not write "
            f"({', '.join(sorted(strangers)[:5])})"
        )
    for q in known:
        if q.is_dir():
            shutil.rmtree(q)
        else:
            q.unlink(missing_ok=True)


def write_dataset_info(out: Path, kind, src: Path, num_shards, summary, options, extra) -> dict:
    """Write dataset.json, last: from then on OUT is a finished image-shard folder."""
    info = {
        "format": shards.FORMAT,
        "version": shards.VERSION,
        "kind": kind,
        "num_shards": num_shards,
        "num_samples": summary["successes"],
        **extra,
        "source": str(src.resolve()),
        "options": jsonable(options),
        "summary": summary,
        "tools": {p: installed_version(p) for p in ("ditkit", "pillow", "img2dataset")},
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    shards.write_json_atomic(out / shards.DATASET_INFO, info)
    return info


def jsonable(d: dict) -> dict:
    """`d` with infinite floats (the --max-aspect-ratio default) as null: JSON has no inf."""
    return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in d.items()}
