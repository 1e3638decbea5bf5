"""`ditdata fetch` of a folder: class folders (ImageNet's train tree) and image + caption
folders, packed here into image shards.

A sorted file list (or one shuffled with --shuffle-seed) is cut into shards of
`samples_per_shard` files; each shard is packed by a worker process (decode, EXIF-rotate,
convert to RGB, optionally resize, write the tar under a temporary name, rename, then
write NNNNN_stats.json), and a rerun skips every shard whose stats file exists.

Keys are index based: file i of shard s gets key s * 10**ceil(log10(samples_per_shard)) + i,
so the same folder and settings always give the same keys; `source` holds the relative path.
The worker processes are spawned: they import this module, which does nothing at import.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from ditdata.common.progress import progress_bar
from ditdata.config import FetchConfig
from ditdata.errors import DitdataError
from ditdata.fetch.state import PackOptions, check_state, jsonable, write_dataset_info
from ditdata.images import IMAGE_EXTENSIONS
from ditdata.imageshards import folder as shards

UNREADABLE = "read error"  # the reason of an input file that could not be read


@dataclass(frozen=True)
class Entry:
    path: str  # relative to the source root, posix
    label: int | None = None
    caption: str | None = None  # relative path of the caption file


def scan_folder(root: Path, kind: str, shuffle_seed: int | None = None) -> tuple[list[Entry], list[str], dict]:
    """The ordered input entries of a folder, the class names (classes) and notes on what
    was left out (files that are not images, images outside class folders, ...)."""
    files = walk(root)
    images = [f for f in files if is_image(f)]
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
    others = [f for f in files if not is_image(f) and f not in used_texts]
    if others:
        notes["other files ignored"] = len(others)
    if not entries:
        raise DitdataError(f"{root}: no images to pack for --kind {kind}")
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(entries)
    return entries, class_names, notes


def fetch_folder(src: Path, out: Path, opts: PackOptions, cfg: FetchConfig) -> dict:
    """Pack the folder SRC (cfg.kind classes or captions) into OUT, resuming what a previous
    run finished; returns dataset.json's contents."""
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
        "options": jsonable(asdict(opts)),
    }
    check_state(out, state)

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
    return write_dataset_info(out, kind, src, num_shards, summary, options, extra)


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
    per-sample progress bar (ditdata.common.progress: plain lines when stderr is no terminal).
    Returns [(shard index, error)] for shards that raised."""
    failures: list[tuple[int, str]] = []
    bar = progress_bar(total=total, initial=initial, unit="img", desc="packing", enabled=progress, smoothing=0.1)
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


def walk(root: Path) -> list[str]:
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


def is_image(rel: str) -> bool:
    return os.path.splitext(rel)[1].lower() in IMAGE_EXTENSIONS
