"""Images to measure, read in uint8 batches: ADM .npz batches, folders of images, image shards.

    .npz     ADM's sample and reference batches: arr_0 uint8 N x H x W x 3, read batch by
             batch from the zip (never the whole array); other arrays (a reference batch's
             precomputed mu / sigma / mu_s / sigma_s) kept for dittrain.eval.reference
    folder   images, sorted, recursive, one size (centre-cropped with the encoder's ADM rule
             when a resolution is given), decoded on a few threads
    shards   a `ditdata fetch` image-shard folder (needs a resolution: the ADM centre crop)

Unusable images (that will not decode) are skipped and counted on the Source. Pixels come
through ditdata.images, the pixel surface ditdata offers dittrain.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from ditdata.common.errors import UserError, one_line
from dittrain.eval.errors import EvalError


class _Bad(Exception):
    """An unusable image: skipped and counted."""


_SHA_MEMO: dict[tuple, str] = {}  # (path, size, mtime) -> an .npz's sha256 (Source.digest)


@dataclass
class Source:
    """Images to measure, read in batches: an ADM .npz, a folder of images or image shards."""

    path: Path
    kind: str  # "npz", "images" or "shards"
    count: int | None  # images it holds (None: unknown up front)
    size: tuple[int, int] | None  # (height, width) of its first image, as stored
    jobs: Callable[[], Iterator[Callable]] | None = None  # folders: one loader per image
    npz: dict = field(default_factory=dict)  # npz: arrays other than arr_0, loaded lazily
    arr: _NpyMember | None = None  # npz: arr_0, read in batches
    skipped: int = 0  # unusable images met by the last read
    skipped_examples: list = field(default_factory=list)
    resolution: int | None = None  # the ADM centre crop applied, if any

    def digest(self) -> str:
        """The reference's identity for the cache: a file's sha256; for a folder, the
        sha256 of the sorted list of its files' relative names, sizes and mtimes."""
        if self.kind == "npz":  # remembered per (path, size, mtime) for repeated evals in one process
            from ditdata.common.files import sha256_file

            st = self.path.stat()
            key = (str(self.path.resolve()), st.st_size, st.st_mtime_ns)
            if key not in _SHA_MEMO:
                _SHA_MEMO[key] = sha256_file(self.path)
            return "sha256:" + _SHA_MEMO[key]
        names = (_image_files(self.path) if self.kind == "images"
                 else sorted(p for p in self.path.iterdir() if p.is_file() and not p.name.startswith(".")))
        h = hashlib.sha256()
        for p in names:
            st = p.stat()
            h.update(f"{p.relative_to(self.path).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return "listing-sha256:" + h.hexdigest()


def _image_files(root: Path) -> list[Path]:
    from ditdata.pixels import IMAGE_EXTENSIONS

    return sorted(p for p in root.rglob("*")
                  if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(root).parts))


def open_source(path, *, resolution: int | None = None, allow_shards: bool = True) -> Source:
    """What `path` is: an .npz (ADM: arr_0 uint8 N x H x W x 3, other arrays kept for the
    reference's precomputed statistics), a `ditdata fetch` image-shard folder (needs a
    resolution: the encoder's ADM centre crop) or a folder of images (sorted, recursive;
    centre-cropped too when a resolution is given, else fed at their own size)."""
    p = Path(path).expanduser()
    if p.is_file():
        return _open_npz(p)
    if not p.is_dir():
        raise EvalError(f"{p}: no such file or directory")
    from ditdata.pixels import is_shard_folder

    if is_shard_folder(p):
        if not allow_shards:
            raise EvalError(f"{p}: an image-shard folder; samples must be an .npz or a folder of images")
        return _open_shards(p, resolution)
    files = _image_files(p)
    if not files:
        raise EvalError(f"{p}: no images in this folder (nor an .npz, nor image shards)")
    from PIL import Image

    size = None  # (height, width) of the first of 16 images whose header opens
    for f in files[:16]:
        try:
            with Image.open(f) as img:
                w, h = img.size
            size = (h, w)
            break
        except Exception:
            continue
    return Source(p, "images", len(files), size, resolution=resolution,
                  jobs=lambda: (partial(_load_file, f, resolution) for f in files))


def _load_file(f: Path, resolution: int | None):
    from ditdata.pixels import BadImageError, decode_rgb

    name = str(f)
    try:
        img = decode_rgb(f.read_bytes())
    except (OSError, BadImageError) as e:
        raise _Bad(f"{name}: {one_line(e, 300)}") from None
    return name, _crop(img, resolution)


def _crop(img, resolution: int | None) -> np.ndarray:
    if resolution is None:
        return np.asarray(img)
    from ditdata.pixels import center_crop

    return center_crop(img, resolution)


def _open_shards(p: Path, resolution: int | None) -> Source:
    from ditdata import pixels

    if resolution is None:
        raise EvalError(f"{p}: an image-shard reference needs a resolution (--resolution N) for its ADM centre crop")
    try:
        folder = pixels.read_shard_folder(p)
    except UserError as e:  # an EvalError for the callers that add context (dittrain run --eval-ref)
        raise EvalError(one_line(e, 300)) from None
    if not folder.shards:
        raise EvalError(f"{p}: no shards in this image-shard folder")
    for tar in folder.shards:
        problem = pixels.check_shard(tar, folder.expected[tar.name])
        if problem:
            raise EvalError(f"{tar}: {problem}; refetch it (rerun the same `ditdata fetch`)")
    known = [folder.expected[t.name] for t in folder.shards]
    count = sum(known) if all(n is not None for n in known) else None

    def jobs():
        for tar in folder.shards:
            for s in pixels.iter_shard(tar):
                yield partial(_load_sample, s, tar, resolution)

    return Source(p, "shards", count, (resolution, resolution), jobs=jobs, resolution=resolution)


def _load_sample(s, tar: Path, resolution: int):
    from ditdata.pixels import BadImageError

    name = f"{tar}:{s.key}"
    try:
        img = s.decode()
    except BadImageError as e:
        raise _Bad(f"{name}: {one_line(e, 300)}") from None
    return name, _crop(img, resolution)


class _NpyMember:
    """arr_0 of an .npz read batch by batch from the zip (never the whole array at once)."""

    def __init__(self, path: Path, zf: zipfile.ZipFile, member: str):
        self.path, self.zf, self.member = path, zf, member
        fmt = np.lib.format
        with zf.open(member) as f:
            try:
                version = fmt.read_magic(f)
                reader = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}.get(version)
                if reader is None:
                    raise ValueError(f"npy version {version}")
                shape, fortran, dtype = reader(f)
                offset = f.tell()
            except (ValueError, OSError, zipfile.BadZipFile) as e:
                raise EvalError(f"{path}: {member} is not a readable array ({one_line(e, 300)})") from None
        if dtype != np.uint8 or len(shape) != 4 or shape[-1] != 3 or fortran:
            raise EvalError(f"{path}: arr_0 must be uint8 images N x H x W x 3 (ADM's format), got {dtype} {shape}"
                            + (" in Fortran order" if fortran else ""))
        self.shape, self.dtype, self.offset = shape, dtype, offset

    def batches(self, batch_size: int) -> Iterator[np.ndarray]:
        n, per = self.shape[0], int(np.prod(self.shape[1:])) * self.dtype.itemsize
        with self.zf.open(self.member) as f:
            f.read(self.offset)
            for i in range(0, n, batch_size):
                k = min(batch_size, n - i)
                data = f.read(k * per)
                if len(data) != k * per:
                    raise EvalError(f"{self.path}: {self.member} is truncated ({i + len(data) // per} of {n} images)")
                yield np.frombuffer(data, self.dtype).reshape(k, *self.shape[1:])


def _open_npz(p: Path) -> Source:
    try:
        zf = zipfile.ZipFile(p)
        names = zf.namelist()
    except (OSError, zipfile.BadZipFile) as e:
        raise EvalError(f"{p}: not an .npz file ({one_line(e, 300)}); give an .npz or a folder of images") from None
    arrays = {n[:-4]: n for n in names if n.endswith(".npy")}
    src = Source(p, "npz", None, None, npz={k: v for k, v in arrays.items() if k != "arr_0"})
    if "arr_0" in arrays:
        src.arr = _NpyMember(p, zf, arrays["arr_0"])
        src.count, src.size = src.arr.shape[0], tuple(src.arr.shape[1:3])
    return src


def npz_array(src: Source, name: str, shape: tuple) -> np.ndarray:
    """Array `name` of an .npz Source as float64, checked to have `shape`."""
    try:
        with np.load(src.path, allow_pickle=False) as z:
            a = np.asarray(z[name], dtype=np.float64)
    except Exception as e:
        raise EvalError(f"{src.path}: {name} is not a readable array ({one_line(e, 300)})") from None
    if a.shape != shape:
        raise EvalError(f"{src.path}: {name} has shape {a.shape}, expected {shape} (ADM's reference statistics)")
    return a


def source_batches(src: Source, batch_size: int, *, workers: int | None = None) -> Iterator[np.ndarray]:
    """The source's images as uint8 (n, H, W, 3) batches. Folder images are decoded on a few
    threads (a bounded number in flight); unusable ones are skipped and counted on `src`.
    All images of one read must have one size (the network would accept any, but one set
    of mixed sizes is a mistake: the message names the odd one)."""
    src.skipped, src.skipped_examples = 0, []
    if src.kind == "npz":
        if src.arr is None:
            raise EvalError(f"{src.path}: no arr_0 (ADM's images array) in this .npz")
        yield from src.arr.batches(batch_size)
        return
    from concurrent.futures import ThreadPoolExecutor

    first: tuple[str, tuple] | None = None
    batch: list[np.ndarray] = []
    workers = workers or max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        inflight: deque = deque()

        def results():
            for job in src.jobs():
                inflight.append(pool.submit(job))
                if len(inflight) >= 2 * batch_size:
                    yield inflight.popleft()
            while inflight:
                yield inflight.popleft()

        for fut in results():
            try:
                name, arr = fut.result()
            except _Bad as e:
                src.skipped += 1
                if len(src.skipped_examples) < 3:
                    src.skipped_examples.append(str(e))
                continue
            if first is None:
                first = (name, arr.shape)
            elif arr.shape != first[1]:
                hint = "" if src.resolution else " (a reference folder can be centre-cropped with --resolution N)"
                raise EvalError(f"{name}: {arr.shape[1]}x{arr.shape[0]} but {first[0]} is "
                                f"{first[1][1]}x{first[1][0]}; all images must have one size{hint}")
            batch.append(arr)
            if len(batch) == batch_size:
                yield np.stack(batch)
                batch = []
        if batch:
            yield np.stack(batch)
