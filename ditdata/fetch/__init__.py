"""`ditdata fetch`: URL lists, class folders (ImageNet) and image+caption folders into
image shards (the layout is described in ditdata/imageshards.py).

Two engines, one output:

- URL lists (LAION metadata parquet, csv, tsv, jsonl, json, txt; a file or a folder of
  them) go through img2dataset's Python API with webdataset output. img2dataset owns the
  downloading, resizing, per-shard stats and incremental resume; we check the columns
  first, record the settings, and write dataset.json once every shard has its stats.
  Only http and https URLs are fetched: img2dataset reads a screened copy of the list
  (SHARDS_DIR/.urls) and downloads through an http(s)-only opener, see ditdata/fetch/urls.py;
  every other row fails with a "refused URL: ..." reason and keeps its key.
- Folders are packed here: a sorted file list is cut into shards of `samples_per_shard`
  files, each shard is packed by a worker process (decode, EXIF-rotate, convert to RGB,
  optionally resize, write the tar under a temporary name, rename, then write
  NNNNN_stats.json), and a rerun skips every shard whose stats file exists.

Resume is safe because a shard is only "finished" once its stats file exists, and keys
depend only on the position in the input (img2dataset's 9-digit scheme; a failed input
keeps its index), so a killed and rerun fetch gives exactly the shards of a clean run.
The settings that decide shard contents are recorded in SHARDS_DIR/.fetch_state; a rerun
with different settings or a changed folder is refused instead of mixing the two, and
SHARDS_DIR/.ditkit.lock (an flock, released by the kernel if the process dies) keeps two
fetches from writing the same folder at once.

Folder keys are index based: the sorted (or --shuffle-seed shuffled) file list is cut into
shards and file i of shard s gets key s * 10**ceil(log10(samples_per_shard)) + i, so the
same folder and settings always give the same keys; `source` holds the relative path.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import math
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, fields, replace
from datetime import UTC, datetime
from pathlib import Path

from ditdata import imageshards as shards
from ditdata.common.lock import LOCK_FILE, DirLock
from ditdata.config import DEFAULT_URL_IMAGE_SIZE, DISTRIBUTORS, ENCODE_FORMATS, KINDS, FetchConfig
from ditdata.errors import DitdataError
from ditdata.fetch import urls
from ditdata.images import DEFAULT_MAX_PIXELS, IMAGE_EXTENSIONS, RESIZE_MODES

URL_LIST_FORMATS = ("parquet", "csv", "tsv", "jsonl", "json", "txt")  # (+ .gz except parquet)
URL_COLUMNS = ("url", "URL", "image_url", "img_url", "link")
CAPTION_COLUMNS = ("caption", "TEXT", "text", "Caption", "alt", "alt_text")
STATE = shards.FETCH_STATE
URL_COPIES = ".urls"  # the screened copies of a URL list that img2dataset reads
# Columns img2dataset writes itself; a URL list column of the same name cannot be kept.
IMG2DATASET_RESERVED = frozenset(
    {"key", "caption", "url", "width", "height", "original_width", "original_height",
     "status", "error_message", "exif", "md5", "sha256", "sha512"}
)
_SHARD_FILE = (r"^\d{5,}(\.tar|_stats\.json|\.parquet)$")
UNREADABLE = "read error"  # the reason of an input file that could not be read


@dataclass(frozen=True)
class PackOptions:
    """The part of a FetchConfig that decides the contents of a shard (recorded in
    .fetch_state), with the defaults resolved: see _pack_options."""

    image_size: int | None
    resize_mode: str
    min_image_size: int
    max_aspect_ratio: float
    encode_format: str
    encode_quality: int
    max_pixels: int
    samples_per_shard: int


def _pack_options(cfg: FetchConfig, image_size: int | None) -> PackOptions:
    """cfg's PackOptions, with this image_size (a URL list has a default) and the decoder's
    own pixel limit unless cfg sets one."""
    opts = {f.name: getattr(cfg, f.name) for f in fields(PackOptions)}
    return PackOptions(**{**opts, "image_size": image_size,
                          "max_pixels": cfg.max_pixels or DEFAULT_MAX_PIXELS})


@dataclass(frozen=True)
class Entry:
    path: str  # relative to the source root, posix
    label: int | None = None
    caption: str | None = None  # relative path of the caption file


# ============================================================================ entry point


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
        return _fetch_locked(src, out, cfg)


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


def _fetch_locked(src: Path, out: Path, cfg: FetchConfig) -> dict:
    if cfg.overwrite:
        _clear_previous(out)
    shards.remove_stale_tmp(out)
    if cfg.kind == "urls":
        if cfg.shuffle_seed is not None:
            raise DitdataError("--shuffle-seed applies to folders only (a URL list keeps its order)")
        return _fetch_urls(src, out, _pack_options(cfg, cfg.image_size or DEFAULT_URL_IMAGE_SIZE), cfg)
    if cfg.distributor != "multiprocessing":
        raise DitdataError(f"--distributor {cfg.distributor} applies to URL lists; folders are packed with local processes")
    if not src.is_dir():
        raise DitdataError(f"--kind {cfg.kind} needs a directory, got the file {src}")
    return _fetch_folder(src, out, _pack_options(cfg, cfg.image_size), cfg)


def detect_kind(src: Path) -> str:
    """urls for a URL-list file (or a folder holding only URL lists); for an image folder,
    captions when any image has a same-stem .txt beside it, classes when every image sits
    in a sub-folder of the root; otherwise ask for --kind."""
    if src.is_file():
        if _url_format(src) is None:
            raise DitdataError(
                f"{src}: not a URL list (expected .parquet, .csv, .tsv, .jsonl, .json or .txt) nor a folder"
            )
        return "urls"
    top = [p for p in src.iterdir() if not p.name.startswith(".")]
    if top and all(p.is_file() and _url_format(p) for p in top):
        return "urls"
    files = _walk(src)
    images = [f for f in files if _is_image(f)]
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


# ============================================================================ folders


def scan_folder(root: Path, kind: str, shuffle_seed: int | None = None) -> tuple[list[Entry], list[str], dict]:
    """The ordered input entries of a folder, the class names (classes) and notes on what
    was left out (files that are not images, images outside class folders, ...)."""
    files = _walk(root)
    images = [f for f in files if _is_image(f)]
    texts = {f.rsplit(".", 1)[0]: f for f in files if f.lower().endswith(".txt")}
    notes: dict = {}
    class_names: list[str] = []
    entries: list[Entry] = []
    if kind == "classes":
        class_names = sorted(
            p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
        )
        label_of = {c: i for i, c in enumerate(class_names)}
        outside = [f for f in images if "/" not in f]
        if outside:
            notes["images outside class folders (not packed)"] = len(outside)
        entries = [Entry(f, label=label_of[f.split("/", 1)[0]]) for f in images if "/" in f]
        entries.sort(key=lambda e: (e.label, e.path))
        per_class = Counter(e.label for e in entries)
        empty = [c for c, i in label_of.items() if per_class[i] == 0]
        if empty:
            notes["class folders without images"] = len(empty)
    else:
        entries = [Entry(f, caption=texts.get(f.rsplit(".", 1)[0])) for f in images]
        missing = sum(e.caption is None for e in entries)
        if missing:
            notes["images without a caption file (caption null)"] = missing
    used_texts = {e.caption for e in entries if e.caption}
    others = [f for f in files if not _is_image(f) and f not in used_texts]
    if others:
        notes["other files ignored"] = len(others)
    if not entries:
        raise DitdataError(f"{root}: no images to pack for --kind {kind}")
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(entries)
    return entries, class_names, notes


def _fetch_folder(src: Path, out: Path, opts: PackOptions, cfg: FetchConfig) -> dict:
    t0 = time.time()
    kind = cfg.kind
    entries, class_names, notes = scan_folder(src, kind, cfg.shuffle_seed)
    fp = hashlib.sha256()
    for e in entries:
        fp.update(f"{e.path}\t{e.label}\t{e.caption}\n".encode())
    state = {
        "kind": kind,
        "source": str(src.resolve()),
        "num_inputs": len(entries),
        "inputs_sha256": fp.hexdigest(),
        "shuffle_seed": cfg.shuffle_seed,
        "options": _jsonable(asdict(opts)),
    }
    _check_state(out, state)
    (out / shards.DATASET_INFO).unlink(missing_ok=True)

    sps = opts.samples_per_shard
    num_shards = math.ceil(len(entries) / sps)
    done = {shards.shard_index(p) for p in shards.list_shards(out)} & set(range(num_shards))
    todo = [i for i in range(num_shards) if i not in done]
    if done:
        print(f"resuming: {len(done)} of {num_shards} shards already finished", file=sys.stderr)
    tasks = [(str(src), str(out), i, entries[i * sps:(i + 1) * sps], opts, kind, class_names) for i in todo]
    already = len(entries) - sum(len(t[3]) for t in tasks)

    failures = _run_pack(tasks, cfg.processes, total=len(entries), initial=already, progress=cfg.progress)
    if failures:
        detail = "; ".join(f"shard {shards.shard_name(i)}: {err}" for i, err in failures[:5])
        raise DitdataError(f"{len(failures)} shard(s) failed ({detail}); rerun the same command to retry them")

    stats = shards.read_shard_stats(out)
    missing = [i for i in range(num_shards) if i not in stats]
    if missing:
        raise DitdataError(f"{len(missing)} shard(s) have no stats file; rerun the same command to finish them")
    summary = shards.summarize_stats(stats)
    summary["notes"] = {**notes, **_folder_notes(stats)}
    summary["duration_s"] = round(time.time() - t0, 3)
    extra = {"num_classes": len(class_names), "class_names": class_names} if kind == "classes" else {}
    options = {**asdict(opts), "kind": kind, "processes": cfg.processes, "shuffle_seed": cfg.shuffle_seed}
    return _finish(out, kind, src, num_shards, summary, options, extra)


def _folder_notes(stats: dict[int, dict]) -> dict:
    converted: Counter = Counter()
    notes: dict = {}
    for s in stats.values():
        converted.update(s.get("converted_modes") or {})
        for k in ("exif_rotated", "caption_errors"):
            notes[k] = notes.get(k, 0) + int(s.get(k, 0))
    if converted:
        notes["converted to RGB"] = ", ".join(f"{m} {n}" for m, n in sorted(converted.items()))
    return {k: v for k, v in notes.items() if v}


def _run_pack(tasks, processes, *, total, initial, progress) -> list[tuple[int, str]]:
    """Pack `tasks` (pack_shard arguments) in-process or over a spawn pool, with a
    per-sample progress bar. Returns [(shard index, error)] for shards that raised."""
    from tqdm import tqdm

    failures: list[tuple[int, str]] = []
    bar = tqdm(total=total, initial=initial, unit="img", desc="packing", disable=not progress,
               file=sys.stderr, dynamic_ncols=True, smoothing=0.1)
    with bar:
        if not tasks:
            return failures
        workers = min(processes, len(tasks))
        if workers == 1:
            for t in tasks:
                try:
                    pack_shard(*t, progress=bar.update)
                except Exception as e:  # a shard-level failure: others may still finish
                    failures.append((t[2], f"{type(e).__name__}: {e}"))
            return failures

        import multiprocessing as mp
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        reported: Counter = Counter()
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(queue,)) as ex:
            pending = {ex.submit(pack_shard, *t): t for t in tasks}
            while pending:
                # Ctrl-C reaches the workers too (same process group): their shard writers
                # delete their temporaries and the pool breaks; a rerun resumes.
                finished, _ = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
                _drain(queue, bar, reported)
                for f in finished:
                    t = pending.pop(f)
                    try:
                        f.result()
                    except Exception as e:
                        failures.append((t[2], f"{type(e).__name__}: {e}"))
                    _drain(queue, bar, reported)
                    bar.update(len(t[3]) - reported.pop(t[2], 0))
                    reported[t[2]] = -(10**12)  # late progress messages of a finished shard are ignored
        return failures


_QUEUE = None


def _init_worker(queue) -> None:
    global _QUEUE
    _QUEUE = queue


def _drain(queue, bar, reported: Counter) -> None:
    import queue as q

    while True:
        try:
            index, n = queue.get_nowait()
        except q.Empty:
            return
        if reported[index] >= 0:
            reported[index] += n
            bar.update(n)


class _Progress:
    """Per-sample progress of one shard, reported in bundles (every 64 samples or half a
    second) to `update` (a progress bar's update, in-process) or through the pool's queue."""

    def __init__(self, index: int, update=None):
        self.index, self.update = index, update
        self.pending, self.last = 0, time.time()

    def tick(self) -> None:
        self.pending += 1
        if self.pending >= 64 or time.time() - self.last > 0.5:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            if self.update is not None:
                self.update(self.pending)
            elif _QUEUE is not None:
                _QUEUE.put((self.index, self.pending))
        self.pending, self.last = 0, time.time()


def pack_shard(root: str, out: str, index: int, entries: list[Entry], opts: PackOptions,
               kind: str, class_names: list[str], progress=None) -> dict:
    """Pack one shard: write NNNNN.tar (atomically) then NNNNN_stats.json, and return the
    stats. Bad inputs are skipped and counted, never raised."""
    from ditdata.images import BadImageError

    start = time.time()
    root_p = Path(root)
    tally = _ShardTally()
    ticker = _Progress(index, progress)
    with shards.ShardWriter(out, index) as writer:
        for i, e in enumerate(entries):
            key = shards.sample_key(index, i, opts.samples_per_shard)
            try:
                data, ext, meta = pack_file(root_p / e.path, opts)
            except BadImageError as err:
                tally.skipped(key, e.path, err)
            else:
                caption = tally.read_caption(root_p, e.caption)
                meta = {"key": key, "source": e.path, "status": "success", **meta}
                if kind == "classes":
                    meta["label"] = e.label
                    meta["class_name"] = class_names[e.label]
                else:
                    meta["caption"] = caption
                writer.write(key, data, ext, meta, caption=caption)
                tally.packed(meta)
            ticker.tick()
    ticker.flush()
    stats = tally.stats(len(entries), start, time.time())
    shards.write_shard_stats(out, index, stats)
    return stats


class _ShardTally:
    """What happened to the inputs of one shard, as its stats file records it."""

    def __init__(self):
        self.status: Counter = Counter()  # "success" or the reason a file was skipped
        self.converted: Counter = Counter()  # original modes converted to RGB
        self.skipped_files: list[dict] = []
        self.rotated = self.caption_errors = 0

    def skipped(self, key: str, source: str, err) -> None:
        self.status[err.reason] += 1
        self.skipped_files.append({"key": key, "source": source, "reason": err.reason, "detail": err.detail})

    def read_caption(self, root: Path, rel: str | None) -> str | None:
        if rel is None:
            return None
        try:
            return (root / rel).read_bytes().decode("utf-8", errors="replace").strip()
        except OSError:
            self.caption_errors += 1
            return None

    def packed(self, meta: dict) -> None:
        self.status["success"] += 1
        if meta["original_mode"] != "RGB":
            self.converted[meta["original_mode"]] += 1
        self.rotated += int(meta.get("exif_orientation", 1) != 1)

    def stats(self, count: int, start: float, end: float) -> dict:
        skipped = {k: v for k, v in self.status.items() if k != "success"}
        return {
            "count": count,
            "successes": self.status["success"],
            # img2dataset's stats keys, so that every shard folder reads alike, except that
            # a folder downloads nothing: its unreadable files are failed_to_read (summed
            # apart by imageshards.summarize_stats), and failed_to_resize holds, as in
            # img2dataset, the images that could not be decoded or were refused (too small,
            # aspect ratio).
            "failed_to_read": self.status[UNREADABLE],
            "failed_to_resize": sum(v for k, v in skipped.items() if k != UNREADABLE),
            "duration": end - start,
            "start_time": start,
            "end_time": end,
            "status_dict": dict(self.status),
            "skipped": skipped,
            "skipped_files": self.skipped_files,
            "converted_modes": dict(self.converted),
            "exif_rotated": self.rotated,
            "caption_errors": self.caption_errors,
        }


def pack_file(path: Path, opts: PackOptions) -> tuple[bytes, str, dict]:
    """One input file -> (stored bytes, extension, metadata) or BadImageError.

    The original bytes are stored unchanged when they already are what we would
    produce: an RGB JPEG, upright (no EXIF rotation), not resized. Anything else is
    decoded, rotated, converted to RGB, resized and re-encoded as opts.encode_format."""
    from ditdata import images

    try:
        data = path.read_bytes()
    except OSError as e:
        raise images.BadImageError(UNREADABLE, str(e)) from None
    img = images.open_image(data, max_pixels=opts.max_pixels)
    fmt, mode = img.format, img.mode
    orient = images.orientation(img)
    w, h = img.size
    if orient in (5, 6, 7, 8):
        w, h = h, w
    if min(w, h) < opts.min_image_size:
        raise images.BadImageError("image too small", f"{w}x{h}")
    if max(w, h) / min(w, h) > opts.max_aspect_ratio:
        raise images.BadImageError("aspect ratio too large", f"{w}x{h}")
    img = images.load(img, draft=images.draft_size(img.size, opts.image_size, opts.resize_mode))
    rgb = images.resize_image(images.to_rgb(img), opts.image_size, opts.resize_mode)
    if fmt == "JPEG" and mode == "RGB" and orient == 1 and rgb.size == (w, h):
        stored, ext = data, "jpg"
    else:
        stored, ext = images.encode_image(rgb, opts.encode_format, opts.encode_quality), opts.encode_format
    meta = {
        "width": rgb.size[0],
        "height": rgb.size[1],
        "original_width": w,
        "original_height": h,
        "original_format": fmt,
        "original_mode": mode,
    }
    if orient != 1:
        meta["exif_orientation"] = orient
    return stored, ext, meta


# ============================================================================ URL lists


def _fetch_urls(src: Path, out: Path, opts: PackOptions, cfg: FetchConfig) -> dict:
    t0 = time.time()
    keep_cols = list(cfg.keep_cols)
    files, fmt = _url_files(src)
    columns = _columns(files[0], fmt)
    url_col, caption_col = _pick_columns(columns, fmt, cfg.url_col, cfg.caption_col, keep_cols, files[0])
    counts = [_count_rows(f, fmt, url_col) for f in files]
    num_shards = sum(math.ceil(n / opts.samples_per_shard) for n in counts)
    if num_shards == 0:
        raise DitdataError(f"{src}: the URL list is empty")
    refused = _refused_rows(files, fmt, url_col)
    if refused.total() == sum(counts):
        raise DitdataError(
            f"{src}: none of its {sum(counts)} rows is an http(s) URL ({urls.describe(refused)}); "
            "ditdata fetch downloads only http and https URLs"
        )
    state = {
        "kind": "urls",
        "source": str(src.resolve()),
        "inputs": [{"path": str(f.resolve()), "rows": n, "size": f.stat().st_size} for f, n in zip(files, counts, strict=True)],
        "columns": {"url": url_col, "caption": caption_col, "keep": keep_cols},
        "options": _jsonable(asdict(opts)),
    }
    _check_state(out, state)
    (out / shards.DATASET_INFO).unlink(missing_ok=True)

    done = set(shards.read_shard_stats(out))
    if len(done & set(range(num_shards))) < num_shards:
        if done:
            print(f"resuming: {len(done)} of {num_shards} shards already finished", file=sys.stderr)
        if refused:
            print(f"note: {refused.total()} of {sum(counts)} rows are not http(s) URLs and are not fetched "
                  f"({urls.describe(refused)}); they are counted as refused in the summary", file=sys.stderr)
        lists = _screened_copies(out, files, fmt, [url_col, caption_col, *keep_cols], url_col)
        _run_img2dataset(lists, out, opts, cfg, url_col=url_col, caption_col=caption_col)
    stats = shards.read_shard_stats(out)
    missing = [i for i in range(num_shards) if i not in stats]
    if missing:
        raise DitdataError(
            f"{len(missing)} of {num_shards} shard(s) did not finish (see img2dataset's messages above); "
            "rerun the same command to retry them"
        )
    _remove_tree(out / URL_COPIES)  # only needed while shards are left to download
    summary = shards.summarize_stats(stats)
    summary["duration_s"] = round(time.time() - t0, 3)
    options = {
        **asdict(opts), "kind": "urls", "processes": cfg.processes, "threads": cfg.threads, "url_col": url_col,
        "caption_col": caption_col, "keep_cols": keep_cols, "distributor": cfg.distributor,
        "timeout": cfg.timeout, "retries": cfg.retries, "input_format": fmt,
    }
    return _finish(out, "urls", src, num_shards, summary, options, {})


def _refused_rows(files: list[Path], fmt: str, url_col: str) -> Counter:
    """{reason label: rows} over the rows of FILES whose URL is not fetched."""
    refused: Counter = Counter()
    for f in files:
        for chunk in _read_list(f, fmt, [url_col]).column(0).chunks:
            refused.update(urls.count_refusals(chunk.to_pylist()))
    return refused


def _screened_copies(out: Path, files: list[Path], fmt: str, columns: list, url_col: str) -> Path:
    """OUT/.urls: one parquet per input list (same order, rows and column names, only the
    columns img2dataset reads) in which every refused URL is its sentinel, so img2dataset
    never sees one; keys depend on row positions only and stay as with the original list.
    Kept while the inputs are unchanged (a resume), written again otherwise."""
    import pyarrow as pa

    columns = list(dict.fromkeys(c for c in columns if c is not None))
    folder = out / URL_COPIES
    manifest = folder / "inputs.json"
    want = {
        "format": fmt,
        "columns": columns,
        "inputs": [{"path": str(f.resolve()), "size": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns}
                   for f in files],
    }
    try:
        if json.loads(manifest.read_text(encoding="utf-8")) == want:
            return folder
    except (OSError, ValueError):
        pass
    _remove_tree(folder)
    folder.mkdir()
    for i, f in enumerate(files):
        table = _read_list(f, fmt, columns)
        screened = pa.chunked_array(
            [pa.array(urls.screened(c.to_pylist()), pa.string()) for c in table.column(url_col).chunks],
            pa.string(),
        )
        table = table.set_column(table.schema.get_field_index(url_col), url_col, screened)
        shards.write_parquet_atomic(folder / f"{i:05d}.parquet", table)
    shards.write_json_atomic(manifest, want)  # last: its presence means the copies are complete
    return folder


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _run_img2dataset(lists: Path, out, opts: PackOptions, cfg: FetchConfig, *, url_col, caption_col) -> None:
    from ditdata.fetch import distributors

    distributors.check(cfg)  # before img2dataset's imports: a missing Java fails at once
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    # img2dataset decodes with OpenCV, whose own limit is 2**30 pixels; the spawned
    # workers read this when cv2 loads, so bombs are refused before they are decoded.
    os.environ.setdefault("OPENCV_IO_MAX_IMAGE_PIXELS", str(opts.max_pixels))
    try:
        from img2dataset import download
    except ImportError as e:
        raise DitdataError(f"URL lists need img2dataset: pip install 'ditkit[data]' ({e})") from None

    previous = signal.getsignal(signal.SIGINT)
    try:
        # the http(s)-only opener in every worker; a Spark session or Ray for those distributors
        with urls.guarded_img2dataset(), distributors.runtime(cfg):
            download(
                url_list=str(lists),
                output_folder=str(out),
                input_format="parquet",
                output_format="webdataset",
                url_col=url_col,
                caption_col=caption_col,
                save_additional_columns=list(cfg.keep_cols) or None,
                image_size=opts.image_size,
                resize_mode=opts.resize_mode,
                min_image_size=opts.min_image_size,
                max_aspect_ratio=opts.max_aspect_ratio,
                max_image_area=float(opts.max_pixels),
                encode_format=opts.encode_format,
                encode_quality=opts.encode_quality if opts.encode_format != "png" else 9,
                number_sample_per_shard=opts.samples_per_shard,
                oom_shard_count=shards.SHARD_DIGITS,
                processes_count=cfg.processes,
                thread_count=cfg.threads,
                distributor=cfg.distributor,
                timeout=cfg.timeout,
                retries=cfg.retries,
                incremental_mode="incremental",
                enable_wandb=False,
            )
    except SystemExit:  # img2dataset's SIGINT handler exits with status 0
        raise DitdataError("interrupted; rerun the same command to resume") from None
    finally:
        signal.signal(signal.SIGINT, previous)


def _url_format(p: Path) -> str | None:
    name = p.name.lower()
    for fmt in URL_LIST_FORMATS:
        if name.endswith("." + fmt):
            return fmt
        if fmt != "parquet" and name.endswith(f".{fmt}.gz"):
            return fmt + ".gz"
    return None


def _url_files(src: Path) -> tuple[list[Path], str]:
    if src.is_file():
        fmt = _url_format(src)
        if fmt is None:
            raise DitdataError(f"{src}: not a URL list (.parquet, .csv, .tsv, .jsonl, .json, .txt)")
        return [src], fmt
    files = sorted(p for p in src.iterdir() if p.is_file() and not p.name.startswith("."))
    fmts = {_url_format(p) for p in files}
    if len(fmts) != 1 or None in fmts:
        raise DitdataError(f"{src}: a folder of URL lists must hold files of one format only, found {sorted(map(str, fmts))}")
    fmt = fmts.pop()
    # img2dataset globs "*.<format>" in the folder
    return files, fmt


def _open_text(p: Path):
    if p.name.lower().endswith(".gz"):
        return gzip.open(p, "rt", encoding="utf-8", newline="")
    return open(p, encoding="utf-8", newline="")


def _columns(p: Path, fmt: str) -> list[str]:
    base = fmt.removesuffix(".gz")
    try:
        if base == "parquet":
            import pyarrow.parquet as pq

            return list(pq.read_schema(p).names)
        if base in ("csv", "tsv"):
            with _open_text(p) as f:
                return next(csv.reader(f, delimiter="\t" if base == "tsv" else ","), [])
        if base == "jsonl":
            with _open_text(p) as f:
                for line in f:
                    if line.strip():
                        return list(json.loads(line))
            return []
        if base == "json":
            import pandas as pd

            return list(pd.read_json(p).columns)
        return ["url"]
    except (OSError, ValueError, StopIteration) as e:
        raise DitdataError(f"{p}: cannot read the URL list ({e})") from None


def _count_rows(p: Path, fmt: str, url_col: str) -> int:
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(p).metadata.num_rows
        except (OSError, ValueError) as e:
            raise DitdataError(f"{p}: cannot read the URL list ({e})") from None
    return _read_list(p, fmt, [url_col]).num_rows


def _read_list(p: Path, fmt: str, columns: list[str]):
    """COLUMNS of a URL list as a pyarrow table, parsed the way img2dataset's Reader parses
    FMT (img2dataset/reader.py), so that rows and values are the ones it would download."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.json as pjson
    import pyarrow.parquet as pq

    base = fmt.removesuffix(".gz")
    try:
        if base == "parquet":
            return pq.read_table(p, columns=columns)
        with (gzip.open if fmt.endswith(".gz") else open)(p, "rb") as f:
            if base == "txt":
                table = pcsv.read_csv(f, read_options=pcsv.ReadOptions(column_names=["url"]))
            elif base in ("csv", "tsv"):
                table = pcsv.read_csv(
                    f, parse_options=pcsv.ParseOptions(delimiter="\t" if base == "tsv" else ","),
                    convert_options=pcsv.ConvertOptions(include_columns=columns),
                )
            elif base == "jsonl":
                table = pjson.read_json(f)
            else:
                import pandas as pd

                table = pa.Table.from_pandas(pd.read_json(f))
        return table.select(columns)
    except (OSError, ValueError, KeyError, pa.ArrowException) as e:
        raise DitdataError(f"{p}: cannot read the URL list ({e})") from None


def _pick_columns(columns, fmt, url_col, caption_col, keep_cols, path) -> tuple[str, str | None]:
    if fmt.startswith("txt"):
        if caption_col or keep_cols:
            raise DitdataError(f"{path}: a .txt URL list has one URL per line and no other columns")
        return "url", None
    have = ", ".join(columns)
    if url_col is None:
        url_col = next((c for c in URL_COLUMNS if c in columns), None)
        if url_col is None:
            raise DitdataError(f"{path}: no URL column found (columns: {have}); pass --url-col")
    elif url_col not in columns:
        raise DitdataError(f"{path}: no column {url_col!r} for --url-col (columns: {have})")
    if caption_col is None:
        caption_col = next((c for c in CAPTION_COLUMNS if c in columns and c != url_col), None)
    elif caption_col == "":
        caption_col = None
    elif caption_col not in columns:
        raise DitdataError(f"{path}: no column {caption_col!r} for --caption-col (columns: {have})")
    for c in keep_cols:
        if c not in columns:
            raise DitdataError(f"{path}: no column {c!r} for --keep-col (columns: {have})")
        if c in (url_col, caption_col):
            raise DitdataError(f"--keep-col {c}: the URL and caption columns are always kept")
        if c in IMG2DATASET_RESERVED:
            raise DitdataError(
                f"--keep-col {c}: img2dataset reserves this name for its own metadata "
                f"(reserved: {', '.join(sorted(IMG2DATASET_RESERVED))}); rename the column in the URL list"
            )
    return url_col, caption_col


# ============================================================================ shared


def _finish(out: Path, kind, src: Path, num_shards, summary, options, extra) -> dict:
    from importlib import metadata

    def version(pkg):
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    info = {
        "format": shards.FORMAT,
        "version": shards.VERSION,
        "kind": kind,
        "num_shards": num_shards,
        "num_samples": summary["successes"],
        **extra,
        "source": str(src.resolve()),
        "options": _jsonable(options),
        "summary": summary,
        "tools": {p: version(p) for p in ("ditkit", "pillow", "img2dataset")},
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    shards.write_json_atomic(out / shards.DATASET_INFO, info)
    return info


def _check_state(out: Path, state: dict) -> None:
    """Refuse to resume into OUT if what decides the shard contents has changed."""
    p = out / STATE
    if p.is_file():
        try:
            prev = json.loads(p.read_text(encoding="utf-8"))
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
        return
    import re

    ours = [q for q in out.iterdir() if re.match(_SHARD_FILE, q.name) or q.name == shards.DATASET_INFO]
    if ours:
        raise DitdataError(
            f"{out} already holds shards that this command did not start ({ours[0].name}, ...); "
            "pass --overwrite to replace them, or choose another --out"
        )
    shards.write_json_atomic(p, state)


def _clear_previous(out: Path) -> None:
    """--overwrite: delete a previous fetch, but only files a fetch writes."""
    import re
    import shutil

    known = []
    strangers = []
    for q in out.iterdir():
        if q.name == LOCK_FILE:
            continue
        if (re.match(_SHARD_FILE, q.name) or q.name in (shards.DATASET_INFO, STATE) or shards.is_tmp(q)
                or (q.name in ("_tmp", URL_COPIES) and q.is_dir())):
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


def _walk(root: Path) -> list[str]:
    """Every non-hidden file under root as a sorted relative posix path."""
    out = []
    seen = set()  # real paths: symlinked folders are followed, symlink loops are not
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if rel == "." else rel + "/"
        out.extend(prefix + f for f in filenames if not f.startswith("."))
    out.sort()
    return out


def _is_image(rel: str) -> bool:
    return os.path.splitext(rel)[1].lower() in IMAGE_EXTENSIONS


def _jsonable(d: dict) -> dict:
    return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in d.items()}
