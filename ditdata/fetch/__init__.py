"""`ditdata fetch`: URL lists, class folders (ImageNet) and image+caption folders into
image shards (the layout is described in ditdata/imageshards/folder.py).

Two engines, one output, one module each:

    urllists.py      URL lists (LAION metadata parquet, csv, tsv, jsonl, json, txt; a file
                     or a folder of them) through img2dataset's Python API, webdataset
                     output; only http(s) URLs are fetched (urls.py), on img2dataset's
                     multiprocessing, pyspark or ray distributor (distributors.py)
    folders.py       folders packed here by worker processes, one shard each
    state.py         what both record beside the shards: .fetch_state, dataset.json
    ledger.py        a URL fetch's rows at their latest status, transient or permanent failures
    retries.py       --retry-failed: those transient failures refetched into new shards

This module is the entry point: `fetch()` checks the settings, detects the kind of
source, takes the output folder's lock and hands over to one engine.

Resume is safe because a shard is only "finished" once its stats file exists, and keys
depend only on the position in the input (img2dataset's 9-digit scheme; a failed input
keeps its index), so a killed and rerun fetch gives exactly the shards of a clean run.
The settings that decide shard contents are recorded in SHARDS_DIR/.fetch_state; a rerun
with different settings or a changed folder is refused instead of mixing the two, and
SHARDS_DIR/.ditkit.lock (an flock, released by the kernel if the process dies) keeps two
fetches from writing the same folder at once.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from ditdata.common.lock import DirLock
from ditdata.config import DEFAULT_URL_IMAGE_SIZE, DISTRIBUTORS, ENCODE_FORMATS, KINDS, FetchConfig
from ditdata.errors import DitdataError
from ditdata.fetch.folders import fetch_folder, is_image, pack_file, pack_shard, scan_folder, walk
from ditdata.fetch.state import PackOptions, clear_previous, pack_options
from ditdata.fetch.urllists import CAPTION_COLUMNS, URL_COLUMNS, URL_LIST_FORMATS, fetch_urls, url_format
from ditdata.images import IMAGE_EXTENSIONS, RESIZE_MODES
from ditdata.imageshards import folder as shards

__all__ = ["CAPTION_COLUMNS", "URL_COLUMNS", "URL_LIST_FORMATS", "FetchConfig", "PackOptions",
           "detect_kind", "fetch", "pack_file", "pack_shard", "report", "scan_folder"]


def fetch(source, out, config: FetchConfig | None = None, **options) -> dict:
    """Fetch SOURCE into image shards in OUT and return dataset.json's contents (with a
    "summary"). Resumes an interrupted fetch into the same OUT; see the module docstring.
    The settings are a FetchConfig, or its fields as keyword arguments."""
    if config is not None and options:
        raise TypeError("fetch() takes a FetchConfig or keyword options, not both")
    cfg = config if config is not None else FetchConfig(**options)
    src = Path(source)
    if not src.exists():
        raise DitdataError(f"{source}: no such file or directory")
    _check_choices(cfg)
    cfg = replace(cfg, processes=max(1, cfg.processes or os.cpu_count() or 1))
    cfg = replace(cfg, kind=cfg.kind or detect_kind(src))
    if cfg.kind not in KINDS:
        raise DitdataError(f"--kind {cfg.kind!r}: expected one of {', '.join(KINDS)}")

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DitdataError(f"--out {out}: exists and is not a directory")
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise DitdataError(f"--out {out} must not be inside the source {source}")
    # The folder's lock (shared with `ditdata score`: one writer per folder) also removes a
    # folder it created when a refused fetch left nothing else in it.
    with DirLock(out, "ditdata fetch"):
        if cfg.overwrite:
            clear_previous(out)
        shards.remove_stale_tmp(out)
        if cfg.kind == "urls":
            if cfg.shuffle_seed is not None:
                raise DitdataError("--shuffle-seed applies to folders only (a URL list keeps its order)")
            return fetch_urls(src, out, pack_options(cfg, cfg.image_size or DEFAULT_URL_IMAGE_SIZE), cfg)
        if cfg.distributor != "multiprocessing":
            raise DitdataError(f"--distributor {cfg.distributor} applies to URL lists; folders are packed with "
                               "local processes")
        if not src.is_dir():
            raise DitdataError(f"--kind {cfg.kind} needs a directory, got the file {src}")
        return fetch_folder(src, out, pack_options(cfg, cfg.image_size), cfg)


def _check_choices(cfg: FetchConfig) -> None:
    for option, value, choices in (("--resize-mode", cfg.resize_mode, RESIZE_MODES),
                                   ("--encode-format", cfg.encode_format, ENCODE_FORMATS)):
        if value not in choices:
            raise DitdataError(f"{option} {value!r}: expected one of {', '.join(choices)}")
    if cfg.samples_per_shard < 1:
        raise DitdataError("--samples-per-shard must be at least 1")
    if cfg.image_size is not None and cfg.image_size < 1:
        raise DitdataError("--image-size must be positive")
    if cfg.distributor not in DISTRIBUTORS:
        raise DitdataError(f"--distributor {cfg.distributor!r}: expected one of {', '.join(DISTRIBUTORS)}")
    for option, value, needs in (("--spark-master", cfg.spark_master, "pyspark"),
                                 ("--ray-address", cfg.ray_address, "ray")):
        if value is not None and cfg.distributor != needs:
            raise DitdataError(f"{option} {value}: applies to --distributor {needs} only (got --distributor {cfg.distributor})")


def detect_kind(src: Path) -> str:
    """urls for a URL-list file (or a folder holding only URL lists); for an image folder,
    captions when any image has a same-stem .txt beside it, classes when every image sits
    in a sub-folder of the root; otherwise ask for --kind."""
    if src.is_file():
        if url_format(src) is None:
            raise DitdataError(
                f"{src}: not a URL list (expected .parquet, .csv, .tsv, .jsonl, .json or .txt) nor a folder"
            )
        return "urls"
    top = [p for p in src.iterdir() if not p.name.startswith(".")]
    if top and all(p.is_file() and url_format(p) for p in top):
        return "urls"
    files = walk(src)
    images = [f for f in files if is_image(f)]
    if not images:
        raise DitdataError(f"{src}: no images found (extensions: {', '.join(sorted(IMAGE_EXTENSIONS))})")
    stems = {f.rsplit(".", 1)[0] for f in files if f.lower().endswith(".txt")}
    if any(f.rsplit(".", 1)[0] in stems for f in images):
        return "captions"
    if all("/" in f for f in images):
        return "classes"
    raise DitdataError(
        f"{src}: images without captions and not in class folders; pass --kind captions "
        "(captions will be empty) or arrange them one folder per class"
    )


def report(info: dict) -> str:
    """The human-readable end-of-run summary of a fetch (dataset.json + its summary)."""
    s = info["summary"]
    lines = [
        f"{info['kind']} -> {info['num_samples']} samples in {info['num_shards']} shards",
        shards.format_summary(s),
    ]
    if info.get("num_classes") is not None:
        lines.append(f"classes:      {info['num_classes']}")
    extra = s.get("notes") or {}
    for k, v in extra.items():
        if v:
            lines.append(f"note: {k}: {v}")
    return "\n".join(lines)
