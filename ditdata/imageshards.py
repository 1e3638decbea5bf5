"""Image shards: the folder `ditdata fetch` writes and `ditdata score` / `ditdata encode` read.

Layout of SHARDS_DIR (img2dataset's webdataset layout, which we also write ourselves):

    00000.tar            WebDataset tar; per sample {key}.jpg|.png|.webp (image bytes),
                         {key}.txt (caption, when there is one), {key}.json (metadata)
    00000_stats.json     per-shard stats: count, successes, failed_to_download,
                         failed_to_resize, duration, start_time, end_time, status_dict
                         (+ "skipped" and "skipped_files" from the folder packer);
                         its presence is what marks the shard as finished
    00000.parquet        img2dataset only: one row per input URL, failures included
    dataset.json         written last, atomically, when the whole fetch is complete

Keys are 9-digit strings, shard * 10**4 + index in shard (img2dataset's scheme, with its
default of 10,000 samples per shard; 10**ceil(log10(samples_per_shard)) in general).
Failed inputs keep their index, so keys depend only on the input order.

Per-sample json, as the reader normalises it (`ImageSample.meta`): key, source (url or
path relative to the input root; img2dataset's `url` is copied to it), caption (str or
None), label (int or None) and class_name (class datasets), width/height (stored image),
original_width/original_height, plus whatever the writer kept (img2dataset: status,
error_message, exif, sha256 and the URL list's extra columns).

    from ditdata.imageshards import read_dataset_info, list_shards, iter_shard, decode_rgb
    info = read_dataset_info(shards_dir)            # DitdataError if absent or unfinished
    for path in list_shards(shards_dir):
        for s in iter_shard(path):                  # ImageSample(key, image, ext, meta)
            img = decode_rgb(s.image)               # RGB PIL image, or BadImageError
"""

from __future__ import annotations

import json
import math
import os
import re
import tarfile
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ditdata.errors import DitdataError
from ditdata.images import (  # noqa: F401  (re-exported: readers need only this module)
    DEFAULT_MAX_PIXELS,
    BadImageError,
    decode_rgb,
)

FORMAT = "ditdata-images"
VERSION = 1
DATASET_INFO = "dataset.json"
SHARD_DIGITS = 5  # img2dataset's oom_shard_count default
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
FIXED_MTIME = 0  # tar member mtime: same input + options -> byte-identical shards
TMP_MARK = ".tmp-"
_SHARD_RE = re.compile(r"^(\d{5,})\.tar$")  # SHARD_DIGITS or more digits
_STATS_RE = re.compile(r"^(\d{5,})_stats\.json$")


@dataclass
class ImageSample:
    key: str
    image: bytes
    ext: str  # "jpg", "png" or "webp" (lower case, no dot)
    meta: dict = field(default_factory=dict)

    @property
    def caption(self) -> str | None:
        return self.meta.get("caption")

    @property
    def label(self) -> int | None:
        return self.meta.get("label")

    @property
    def source(self) -> str | None:
        return self.meta.get("source")

    def decode(self, *, max_pixels: int = DEFAULT_MAX_PIXELS):
        """The image as an upright 8-bit RGB PIL image (BadImageError if it cannot be)."""
        return decode_rgb(self.image, max_pixels=max_pixels)


# ----------------------------------------------------------------------------- names


def shard_name(index: int) -> str:
    return f"{index:0{SHARD_DIGITS}d}"


def shard_path(shards_dir, index: int) -> Path:
    return Path(shards_dir) / f"{shard_name(index)}.tar"


def stats_path(shards_dir, index: int) -> Path:
    return Path(shards_dir) / f"{shard_name(index)}_stats.json"


def shard_index(path) -> int:
    m = _SHARD_RE.match(Path(path).name)
    if not m:
        raise ValueError(f"{path} is not a shard name (NNNNN.tar)")
    return int(m.group(1))


def sample_key(shard: int, index: int, samples_per_shard: int) -> str:
    """img2dataset's key: shard * 10**oom + index, zero-padded to SHARD_DIGITS + oom."""
    oom = math.ceil(math.log10(samples_per_shard))
    return f"{shard * 10**oom + index:0{SHARD_DIGITS + oom}d}"


# ----------------------------------------------------------------------------- reading


def list_shards(shards_dir, *, finished_only: bool = True) -> list[Path]:
    """The shard tars of SHARDS_DIR sorted by index. A shard is finished when its
    NNNNN_stats.json exists (both img2dataset and the folder packer write it after the
    tar is complete); unfinished tars are left out unless finished_only=False."""
    d = Path(shards_dir)
    if not d.is_dir():
        raise DitdataError(f"{d}: no such directory")
    out = []
    for p in d.iterdir():
        m = _SHARD_RE.match(p.name)
        if m and (not finished_only or stats_path(d, int(m.group(1))).is_file()):
            out.append(p)
    return sorted(out, key=shard_index)


def read_dataset_info(shards_dir) -> dict:
    """dataset.json of a finished fetch; DitdataError naming the problem otherwise."""
    d = Path(shards_dir)
    if not d.is_dir():
        raise DitdataError(f"{d}: no such directory")
    p = d / DATASET_INFO
    if not p.is_file():
        hint = (
            "the fetch did not finish; rerun the same `ditdata fetch` command to complete it"
            if any(d.glob("*.tar"))
            else "run `ditdata fetch SOURCE --out DIR` first"
        )
        raise DitdataError(f"{d} is not a finished image-shard folder: {DATASET_INFO} is missing ({hint})")
    try:
        info = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DitdataError(f"{p}: unreadable ({e})") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise DitdataError(f"{p}: not a {FORMAT} dataset description")
    if info.get("version") != VERSION:
        raise DitdataError(f"{p}: version {info.get('version')!r} is not supported (expected {VERSION})")
    for k in ("kind", "num_shards", "num_samples"):
        if k not in info:
            raise DitdataError(f"{p}: missing field {k!r}")
    return info


def iter_shard(path) -> Iterator[ImageSample]:
    """The samples of one shard tar, in stored order. Members are grouped by key as
    WebDataset does (the name up to the first dot of its last path component). Samples
    without an image member are skipped."""
    path = Path(path)
    try:
        tf = tarfile.open(path, "r:*")
    except (OSError, tarfile.TarError) as e:
        raise DitdataError(f"{path}: not a readable tar ({e})") from None
    with tf:
        key, files = None, {}
        try:
            for member in tf:
                if not member.isfile():
                    continue
                k, ext = _split(member.name)
                if k != key:
                    if key is not None:
                        s = _sample(key, files)
                        if s is not None:
                            yield s
                    key, files = k, {}
                f = tf.extractfile(member)
                files[ext] = f.read() if f is not None else b""
        except tarfile.TarError as e:
            raise DitdataError(f"{path}: damaged tar ({e})") from None
        if key is not None:
            s = _sample(key, files)
            if s is not None:
                yield s


def iter_samples(shards_dir) -> Iterator[ImageSample]:
    """All samples of a finished fetch, shard after shard."""
    read_dataset_info(shards_dir)
    for p in list_shards(shards_dir):
        yield from iter_shard(p)


def normalize_meta(key: str, meta: dict, caption_text: str | None = None) -> dict:
    """The same fields whoever wrote the shard (module docstring)."""
    meta = dict(meta)
    meta.setdefault("key", key)
    if meta.get("source") is None:
        meta["source"] = meta.get("url")
    if "caption" not in meta:
        meta["caption"] = caption_text
    cap = meta["caption"]
    if cap is not None and not isinstance(cap, str):
        meta["caption"] = None if (isinstance(cap, float) and math.isnan(cap)) else str(cap)
    label = meta.get("label")
    meta["label"] = int(label) if label is not None else None
    for k in ("width", "height", "original_width", "original_height"):
        meta.setdefault(k, None)
    return meta


def _split(name: str) -> tuple[str, str]:
    head, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), ext.lower()


def _sample(key: str, files: dict[str, bytes]) -> ImageSample | None:
    ext = next((e for e in IMAGE_EXTS if e in files), None)
    if ext is None:
        return None
    meta = {}
    if "json" in files:
        try:
            meta = json.loads(files["json"].decode("utf-8"))
        except ValueError:
            meta = {}
    caption = files["txt"].decode("utf-8", errors="replace") if "txt" in files else None
    if "cls" in files and "label" not in meta:
        try:
            meta["label"] = int(files["cls"].decode().strip())
        except ValueError:
            pass
    return ImageSample(key, files[ext], "jpg" if ext == "jpeg" else ext, normalize_meta(key, meta, caption))


# ----------------------------------------------------------------------------- stats


def read_shard_stats(shards_dir) -> dict[int, dict]:
    """{shard index: parsed NNNNN_stats.json} for every finished shard."""
    out = {}
    for p in Path(shards_dir).iterdir():
        m = _STATS_RE.match(p.name)
        if m:
            try:
                out[int(m.group(1))] = json.loads(p.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise DitdataError(f"{p}: unreadable stats file ({e})") from None
    return dict(sorted(out.items()))


def summarize_stats(stats: list[dict] | dict[int, dict]) -> dict:
    """Aggregate per-shard stats: total, successes, failed, success_rate and failure
    reasons with counts (status_dict minus "success"), most frequent first."""
    items = list(stats.values()) if isinstance(stats, dict) else list(stats)
    reasons: Counter = Counter()
    total = successes = 0
    for s in items:
        total += int(s.get("count", 0))
        successes += int(s.get("successes", 0))
        for k, v in (s.get("status_dict") or {}).items():
            if k != "success":
                reasons[k] += int(v)
    failed = total - successes
    return {
        "total": total,
        "successes": successes,
        "failed": failed,
        "success_rate": successes / total if total else 0.0,
        "failed_to_download": sum(int(s.get("failed_to_download", 0)) for s in items),
        "failed_to_resize": sum(int(s.get("failed_to_resize", 0)) for s in items),
        "reasons": dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
    }


def format_summary(summary: dict) -> str:
    lines = [
        f"total:        {summary['total']}",
        f"successes:    {summary['successes']} ({100 * summary['success_rate']:.1f}%)",
        f"failed:       {summary['failed']}",
    ]
    if summary["reasons"]:
        lines.append("failure reasons:")
        width = max(len(str(v)) for v in summary["reasons"].values())
        lines += [f"  {v:>{width}}  {k}" for k, v in summary["reasons"].items()]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- writing


def tmp_name(final: Path) -> Path:
    """A hidden temporary sibling of `final`, unique per writer; see `is_tmp`."""
    return final.with_name(f".{final.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def is_tmp(path: Path) -> bool:
    return path.name.startswith(".") and TMP_MARK in path.name


def remove_stale_tmp(shards_dir) -> int:
    """Delete temporaries left by a killed writer (call only while no writer runs)."""
    n = 0
    for p in Path(shards_dir).iterdir():
        if is_tmp(p) and p.is_file():
            p.unlink(missing_ok=True)
            n += 1
    return n


def write_json_atomic(path, obj) -> None:
    path = Path(path)
    tmp = tmp_name(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1, ensure_ascii=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_parquet_atomic(path, table, compression: str = "zstd") -> None:
    """A pyarrow table as parquet at path: written under a temporary name, synced, renamed."""
    import pyarrow.parquet as pq

    path = Path(path)
    tmp = tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            pq.write_table(table, f, compression=compression)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_shard_stats(shards_dir, index: int, stats: dict) -> None:
    """Publish NNNNN_stats.json (atomically): from then on the shard counts as finished."""
    write_json_atomic(stats_path(shards_dir, index), stats)


class ShardWriter:
    """Writes one shard tar under a temporary name and renames it to NNNNN.tar on
    close(); an exception inside `with` deletes the temporary instead. Members are
    written in a fixed order (image, json, txt per sample) with a fixed mtime, owner and
    mode, and json with sorted keys, so the same samples give byte-identical tars."""

    def __init__(self, shards_dir, index: int):
        self.final = shard_path(shards_dir, index)
        self.tmp = tmp_name(self.final)
        self._f = open(self.tmp, "wb")
        self._tar = tarfile.open(fileobj=self._f, mode="w", format=tarfile.USTAR_FORMAT)
        self.count = 0

    def write(self, key: str, image: bytes, ext: str, meta: dict, caption: str | None = None):
        if "." in key or "/" in key:
            raise ValueError(f"sample key {key!r} may not contain '.' or '/'")
        self._add(f"{key}.{ext}", image)
        self._add(f"{key}.json", json.dumps(meta, sort_keys=True, ensure_ascii=False).encode("utf-8"))
        if caption is not None:
            self._add(f"{key}.txt", caption.encode("utf-8"))
        self.count += 1

    def _add(self, name: str, data: bytes) -> None:
        import io

        ti = tarfile.TarInfo(name)
        ti.size = len(data)
        ti.mtime = FIXED_MTIME
        ti.mode = 0o444
        ti.uname = ti.gname = "ditdata"
        self._tar.addfile(ti, io.BytesIO(data))

    def close(self) -> Path:
        self._tar.close()
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.final)
        return self.final

    def abort(self) -> None:
        try:
            self._tar.close()
        finally:
            self._f.close()
            self.tmp.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False
