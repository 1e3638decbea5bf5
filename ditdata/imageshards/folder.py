"""Image shards: the folder `ditdata fetch` writes and `ditdata score` / `ditdata encode` read.

Layout of SHARDS_DIR (img2dataset's webdataset layout, which we also write ourselves):

    00000.tar            WebDataset tar; per sample {key}.jpg|.png|.webp (image bytes),
                         {key}.txt (caption, when there is one), {key}.json (metadata)
    00000_stats.json     per-shard stats: count, successes, failed_to_download,
                         failed_to_resize, duration, start_time, end_time, status_dict
                         (img2dataset's keys; the folder packer downloads nothing and
                         writes failed_to_read instead of failed_to_download, plus
                         "skipped" and "skipped_files");
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

    from ditdata.imageshards.folder import read_folder, check_shard, iter_shard
    folder = read_folder(shards_dir)                # DitdataError if absent or unfinished
    for path in folder.shards:
        problem = check_shard(path, folder.expected[path.name])  # None when it is whole
        for s in iter_shard(path):                  # ImageSample(key, image, ext, meta)
            img = s.decode()                        # RGB PIL image, or BadImageError

Integrity. A shard is trusted only when its tar reads through to the end and holds as many
samples as its stats file records (`check_shard`): a truncated tar whose cut falls between
two members would otherwise just look shorter. Within a whole tar, a sample that cannot
be used (no image member, unreadable json metadata, a key seen before in the shard) is
still yielded, and its `decode()` raises BadImageError with that reason, so every reader
counts it instead of dropping it.

Folders written by other tools (an img2dataset run made elsewhere: no dataset.json; or
plain WebDataset tars: no stats files either) are read as they are (`read_folder`): every
*.tar is a shard, the kind is "captions", and where a shard has no stats file there is no
count to check it against.
"""

from __future__ import annotations

import json
import math
import re
import tarfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ditdata.common.files import TMP_MARK, is_tmp, read_json, tmp_name  # noqa: F401  (the store's temporaries: one scheme)
from ditdata.common.progress import most_first
from ditdata.config import KINDS
from ditdata.errors import DitdataError
from ditdata.images import DEFAULT_MAX_PIXELS, BadImageError, decode_rgb  # noqa: F401  (re-exported: readers need only this module)
from ditdata.jsondocs import check_format, load_json

FORMAT = "ditdata-images"
VERSION = 1
DATASET_INFO = "dataset.json"
FETCH_STATE = ".fetch_state"  # written first by `ditdata fetch`: the folder is ours
SHARD_DIGITS = 5  # img2dataset's oom_shard_count default
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
FIXED_MTIME = 0  # tar member mtime: same input + options -> byte-identical shards
_SHARD_RE = re.compile(r"^(\d{5,})\.tar$")  # SHARD_DIGITS or more digits
_STATS_RE = re.compile(r"^(\d{5,})_stats\.json$")
# A tar member larger than this is not read into memory (a hostile tar can claim any size;
# the largest real images, 16k x 16k PNGs, are well below it).
MAX_MEMBER_BYTES = 1 << 30


@dataclass
class ImageSample:
    key: str
    image: bytes | None
    ext: str | None  # "jpg", "png" or "webp" (lower case, no dot); None without an image
    meta: dict = field(default_factory=dict)
    problem: str | None = None  # why the sample is unusable (decode() raises it), else None

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
        if self.problem is not None:
            raise BadImageError(self.problem)
        return decode_rgb(self.image, max_pixels=max_pixels)


# ----------------------------------------------------------------------------- names


def shard_name(index: int) -> str:
    return f"{index:0{SHARD_DIGITS}d}"


def shard_path(shards_dir, index: int) -> Path:
    return Path(shards_dir) / f"{shard_name(index)}.tar"


def stats_path(shards_dir, index: int) -> Path:
    return Path(shards_dir) / f"{shard_name(index)}_stats.json"


def beside(shard_tar, suffix: str) -> Path:
    """NNNNN.tar -> NNNNN{suffix} beside it (e.g. "_stats.json", ".clip.parquet")."""
    p = Path(shard_tar)
    return p.with_name(p.name[: -len(".tar")] + suffix)


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
    d = _folder(shards_dir)
    out = []
    for p in d.iterdir():
        m = _SHARD_RE.match(p.name)
        if m and (not finished_only or stats_path(d, int(m.group(1))).is_file()):
            out.append(p)
    return sorted(out, key=shard_index)


def read_dataset_info(shards_dir) -> dict:
    """dataset.json of a finished fetch; DitdataError naming the problem otherwise."""
    d = _folder(shards_dir)
    p = d / DATASET_INFO
    if not p.is_file():
        hint = (
            "the fetch did not finish; rerun the same `ditdata fetch` command to complete it"
            if any(d.glob("*.tar"))
            else "run `ditdata fetch SOURCE --out DIR` first"
        )
        raise DitdataError(f"{d} is not a finished image-shard folder: {DATASET_INFO} is missing ({hint})")
    info = load_json(p, "unreadable")
    check_format(info, p, FORMAT, VERSION, "dataset description")
    for k in ("kind", "num_shards", "num_samples"):
        if k not in info:
            raise DitdataError(f"{p}: missing field {k!r}")
    if info["kind"] not in KINDS:
        raise DitdataError(f"{p}: kind {info['kind']!r} is not one of {', '.join(KINDS)}")
    if info["kind"] == "classes":
        n, names = info.get("num_classes"), info.get("class_names")
        if (not isinstance(n, int) or isinstance(n, bool) or n < 1 or not isinstance(names, list)
                or len(names) != n or not all(isinstance(c, str) for c in names)):
            raise DitdataError(f"{p}: a class dataset needs num_classes (a positive integer) and as many "
                               "class_names; the file is damaged, rerun `ditdata fetch` with --overwrite")
    return info


@dataclass
class ShardFolder:
    """An image-shard folder as its readers see it (`read_folder`)."""

    path: Path
    info: dict  # dataset.json, or a description made up for a folder written elsewhere
    shards: list[Path]  # the shard tars, in order
    expected: dict[str, int | None]  # tar name -> samples its stats file records (None: no stats)
    foreign: bool  # not written by `ditdata fetch`


def read_folder(shards_dir) -> ShardFolder:
    """The shards of a finished `ditdata fetch` (DitdataError if it is unfinished), or of a
    folder of tars written by another tool (module docstring)."""
    d = _folder(shards_dir)
    tars = sorted(p for p in d.glob("*.tar") if not p.name.startswith(".") and p.is_file())
    foreign = not (d / DATASET_INFO).exists() and not (d / FETCH_STATE).exists() and bool(tars)
    if foreign:
        info = {"format": FORMAT, "version": VERSION, "kind": "captions", "num_shards": len(tars),
                "num_samples": None, "source": str(d.resolve()), "foreign": True}
    else:
        info, tars = read_dataset_info(d), list_shards(d)
    return ShardFolder(d, info, tars, {t.name: _recorded_samples(t) for t in tars}, foreign)


def _folder(shards_dir) -> Path:
    d = Path(shards_dir)
    if not d.is_dir():
        raise DitdataError(f"{d}: no such directory")
    return d


def _recorded_samples(tar: Path) -> int | None:
    """The sample count NNNNN_stats.json records for a tar (None without a stats file)."""
    p = beside(tar, "_stats.json")
    if not p.is_file():
        return None
    try:
        n = read_json(p)["successes"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"successes is {n!r}")
        return n
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DitdataError(f"{p}: unreadable stats file ({e}); refetch the shard or delete the file") from None


def iter_shard(path) -> Iterator[ImageSample]:
    """Every sample of one shard tar, in stored order, usable or not (see ImageSample.problem).
    Members are grouped by key as WebDataset does (the name up to the first dot of its last
    path component). A tar that cannot be read to its end raises DitdataError, after the
    samples before the damage."""
    path = Path(path)
    try:
        tf = tarfile.open(path, "r:*")
    except (OSError, tarfile.TarError, EOFError) as e:
        raise DitdataError(f"{path}: not a readable tar ({e})") from None
    seen: set[str] = set()
    with tf:
        key, files = None, {}
        try:
            for member in tf:
                if not member.isfile():
                    continue
                k, ext = _split(member.name)
                if k != key:
                    if key is not None:
                        yield _sample(key, files, seen)
                    key, files = k, {}
                if member.size > MAX_MEMBER_BYTES:
                    files[ext] = None  # never read into memory; the sample says why
                    continue
                f = tf.extractfile(member)
                files[ext] = f.read() if f is not None else b""
        except (OSError, tarfile.TarError, EOFError) as e:
            raise DitdataError(f"{path}: damaged tar ({e})") from None
        if key is not None:
            yield _sample(key, files, seen)


def check_shard(path, expected: int | None) -> str | None:
    """Why shard `path` cannot be trusted, or None: it must read through to its end (member
    headers only, no image is decoded) and, when its stats file records a count
    (`expected`), hold exactly that many samples."""
    path = Path(path)
    found, key = 0, None
    try:
        with tarfile.open(path, "r:*") as tf:
            for member in tf:
                if member.isfile():
                    k, _ = _split(member.name)
                    if k != key:
                        found, key = found + 1, k
    except (OSError, tarfile.TarError, EOFError) as e:
        lost = f"; {expected - found} of its {expected} samples unreadable" if expected else ""
        return f"damaged tar ({e}) after {found} samples{lost}"
    if expected is not None and found != expected:
        return f"holds {found} samples but its stats file records {expected}"
    return None


def left_out(shard: str, reason: str, samples_lost: int | None) -> str:
    """A damaged shard that a run left out, as the end-of-run reports name it:
    "NAME (REASON; N samples lost)" ("?" samples when its stats file recorded no count)."""
    return f"{shard} ({reason}; {'?' if samples_lost is None else samples_lost} samples lost)"


def bad_shard_error(tar, reason: str, others: int = 0, recorded: str = "") -> DitdataError:
    """The error that stops a run at the damaged shard `tar` (`others`: how many more there
    are), with the two ways on: refetch it, or leave such shards out (`recorded`: where)."""
    more = f" (and {others} more)" if others else ""
    return DitdataError(
        f"image shard {tar} {reason}{more}: refetch it (delete {beside(tar, '_stats.json').name} and "
        f"rerun the same `ditdata fetch`), or pass --skip-bad-shards to leave such shards out{recorded}"
    )


def damaged_shards(folder, todo, skip_bad_shards: bool) -> dict[str, str]:
    """{shard name: why} of the shards of `todo` (of `folder`, a read_folder result) that cannot
    be trusted (check_shard), found before a model is loaded: without `skip_bad_shards` the
    first one stops the run (bad_shard_error); with it the caller leaves them out."""
    bad = {t.name: p for t in todo if (p := check_shard(t, folder.expected[t.name]))}
    if bad and not skip_bad_shards:
        name, why = next(iter(bad.items()))
        raise bad_shard_error(folder.path / name, why, len(bad) - 1)
    return bad


def with_meta(folder, meta_of) -> Iterator[tuple[Path, dict]]:
    """(shard, metadata) of each shard of `folder` whose file beside it is complete: `meta_of`
    (shard -> its file's metadata, None for a missing, killed or foreign file) says which."""
    for tar in folder.shards:
        if (meta := meta_of(tar)) is not None:
            yield tar, meta


def undecodable_line(counts: dict, usable, null: str) -> str:
    """The end-of-run report's line of the samples whose image could not be used: every count
    of `counts` (status -> n) whose status is not in `usable`, summed, then each by status;
    `null`: what such a sample gets ("null score")."""
    undecodable = {k: v for k, v in counts.items() if k not in usable}
    return (f"  undecodable image: {sum(undecodable.values())} ({null})"
            + (": " + ", ".join(f"{k} {v}" for k, v in undecodable.items()) if undecodable else ""))


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


def _sample(key: str, files: dict[str, bytes | None], seen: set[str]) -> ImageSample:
    """One sample from its members; anything that makes it unusable goes into `problem`."""
    problem = None
    ext = next((e for e in IMAGE_EXTS if e in files), None)
    if ext is None:
        problem = "no image member"
    elif files[ext] is None:
        problem = "member too large"
    if key in seen:
        problem = "duplicate key"  # a second sample under one key would overwrite the first
    seen.add(key)
    meta: dict = {}
    raw = files.get("json")
    if raw is not None:
        try:
            meta = json.loads(raw.decode("utf-8"))
            if not isinstance(meta, dict):
                raise ValueError("not a JSON object")
        except ValueError:
            meta, problem = {}, problem or "unreadable metadata"
    elif "json" in files:
        problem = problem or "member too large"
    txt = files.get("txt")
    caption = txt.decode("utf-8", errors="replace") if txt is not None else None
    if "cls" in files and "label" not in meta:
        try:
            meta["label"] = int((files["cls"] or b"").decode().strip())
        except ValueError:
            problem = problem or "unreadable label"
    try:
        meta = normalize_meta(key, meta, caption)
    except (TypeError, ValueError):  # e.g. a label that is not a number
        meta, problem = normalize_meta(key, {}, caption), problem or "unreadable metadata"
    image = files[ext] if ext is not None else None
    return ImageSample(key, image, None if ext is None else ("jpg" if ext == "jpeg" else ext), meta, problem)


# ----------------------------------------------------------------------------- stats


def read_shard_stats(shards_dir) -> dict[int, dict]:
    """{shard index: parsed NNNNN_stats.json} for every finished shard."""
    out = {}
    for p in Path(shards_dir).iterdir():
        m = _STATS_RE.match(p.name)
        if m:
            out[int(m.group(1))] = load_json(p, "unreadable stats file")
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
        # img2dataset's keys; failed_to_read: files of a packed folder that could not be read
        **{k: sum(int(s.get(k, 0)) for s in items)
           for k in ("failed_to_download", "failed_to_read", "failed_to_resize")},
        "reasons": most_first(reasons),
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


def remove_stale_tmp(shards_dir) -> int:
    """Delete temporaries left by a killed writer (call only while no writer runs)."""
    n = 0
    for p in Path(shards_dir).iterdir():
        if is_tmp(p) and p.is_file():
            p.unlink(missing_ok=True)
            n += 1
    return n


def _write_error(path, what: str, e: BaseException) -> DitdataError:
    """One line naming the file that could not be written (disk full, file-size limit)."""
    from ditdata.common.files import error_reason

    return DitdataError(f"{path}: could not write {what} ({error_reason(e)}); it was not published "
                        "and what was there before is unchanged")


def write_json_atomic(path, obj) -> None:
    """JSON at path, durably (ditdata.common.files: tmp, fsync, rename, fsync the folder);
    on failure the temporary is removed and a DitdataError names the path."""
    from ditdata.common import files

    try:
        files.write_json_atomic(Path(path), obj, indent=1, ensure_ascii=False)
    except OSError as e:
        raise _write_error(path, "the file", e) from e


def write_parquet_atomic(path, table, compression: str = "zstd") -> None:
    """A pyarrow table as parquet at path, written like write_json_atomic."""
    import pyarrow.parquet as pq

    from ditdata.common import files

    try:
        with files.atomic_file(Path(path), "wb") as f:
            pq.write_table(table, f, compression=compression)
    except OSError as e:  # pyarrow's own I/O errors are OSError subclasses too
        raise _write_error(path, "the file", e) from e


def read_parquet_meta(path, meta_key: bytes, fmt: str, version: int, columns=()) -> dict | None:
    """The JSON metadata (schema metadata `meta_key`) of a complete parquet file of format
    `fmt` and `version` written beside a shard (caption sets, score files), or None when it is
    missing, unreadable, truncated, not of that format and version, holds another number of rows
    than its "num_samples", or lacks one of `columns`: a killed or damaged file is never trusted."""
    import pyarrow.parquet as pq

    p = Path(path)
    if not p.is_file():
        return None
    try:
        pf = pq.ParquetFile(p)
        raw = (pf.schema_arrow.metadata or {}).get(meta_key)
        meta = json.loads(raw) if raw else None
        if not isinstance(meta, dict) or meta.get("format") != fmt or meta.get("version") != version:
            return None
        if pf.metadata.num_rows != meta.get("num_samples"):
            return None
        if not set(columns) <= set(pf.schema_arrow.names):
            return None
        return meta
    except Exception:
        return None


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
        try:
            self._f = open(self.tmp, "wb")
        except OSError as e:
            raise _write_error(self.final, "the shard", e) from e
        self._tar = tarfile.open(fileobj=self._f, mode="w", format=tarfile.USTAR_FORMAT)
        self.count = 0

    def write(self, key: str, image: bytes, ext: str, meta: dict, caption: str | None = None):
        if "." in key or "/" in key:
            raise ValueError(f"sample key {key!r} may not contain '.' or '/'")
        try:
            self._add(f"{key}.{ext}", image)
            self._add(f"{key}.json", json.dumps(meta, sort_keys=True, ensure_ascii=False).encode("utf-8"))
            if caption is not None:
                self._add(f"{key}.txt", caption.encode("utf-8"))
        except OSError as e:  # disk full, file-size limit: the tar is broken, drop it now
            self.abort()
            raise _write_error(self.final, "the shard", e) from e
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
        """Finish the tar and publish it durably (synced, renamed, folder synced)."""
        from ditdata.common import files

        try:
            self._tar.close()
            self._f.close()
            files.fsync_tree(self.tmp)
            files.publish(self.tmp, self.final)
        except OSError as e:
            self.abort()
            raise _write_error(self.final, "the shard", e) from e
        return self.final

    def abort(self) -> None:
        """Drop the temporary. Safe to call twice, and after a failed write: closing a broken
        tar or flushing a file on a full disk fails again, which must neither hide the first
        error nor keep the temporary."""
        try:
            self._tar.close()
        except (OSError, ValueError):
            pass
        try:
            self._f.close()
        except OSError:
            pass
        self.tmp.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False
