"""The two on-disk shard formats behind one interface.

zarr  a directory `NAME.zarr`: a zarr v3 group with one uncompressed array per tensor
      field, chunked along the sample axis in LARGE chunks (latents barely compress and
      per-sample chunks are measured here at ~1 k samples/s), plus `columns.parquet`
      with the scalar columns. Random access to any slice.
wds   a tar file `NAME.tar` in WebDataset layout for sequential streaming (object storage
      friendly). Each WebDataset sample in the tar is a BLOCK of up to chunk_samples
      consecutive store samples: `000003.latent.npy` (n, C, h, w), ...,
      `000003.columns.json` ({column: [n values]}). One tar member per store sample was
      measured here at ~3 k samples/s, slower than one .npy file per sample; blocks read
      like the zarr backend. Block names are indices, so any source key (slashes, dots) is
      safe; the real keys are in the columns.

Ragged fields (schema.py: unpadded text tokens) are one array per shard in zarr, all its
samples' tokens one after the other, chunked along the token axis, beside their (n,) length
field; in wds each block holds its samples' tokens the same way (`000003.text_tokens.npy`
(tokens of the block, W)) beside the block's lengths. Either way, a read of rows [start, stop)
returns the tokens of those rows, sample after sample, and their length field with them.

Each backend writes a complete shard to a path it is given (the writer handles
temporary names) and reads a field subset over a sample range as stacked arrays; what
reading costs is in its capability flags (see Backend), which the readers plan by.

Adding a backend: one class with the Backend attributes and methods, listed in BACKEND_CLASSES
(and its name in defaults.BACKENDS, which command lines show without importing numpy), plus
a test of its flags and round trip (tests/test_store.py).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np

from ditdata.common import files

from .defaults import BACKENDS, CHUNK_SAMPLES
from .schema import Schema, disk_dtype, from_disk, offsets_of, to_disk

RAGGED_CHUNK_TOKENS = 1 << 16  # tokens per zarr chunk of a ragged field (64 Ki tokens: 512 MiB at W 4096 fp16
# would be too large a chunk to hold whole, but readers take row ranges of it, not chunks)


def _with_lengths(schema: Schema, fields) -> list[str]:
    """fields, plus the length field of every ragged field among them (a ragged read needs it)."""
    out = list(fields)
    for f in list(out):
        if f in schema.ragged and schema.ragged[f].length not in out:
            out.append(schema.ragged[f].length)
    return out

COLUMNS_FILE = "columns.parquet"


def _arrow_type(kind: str):
    import pyarrow as pa

    return {"string": pa.string(), "int64": pa.int64(), "float64": pa.float64(), "bool": pa.bool_()}[kind]


def _column_array(values, kind: str) -> np.ndarray:
    if kind == "string":
        return np.array(list(values), dtype=object)
    return np.asarray(values, dtype={"int64": np.int64, "float64": np.float64, "bool": bool}[kind])


def _json_value(v):
    """A column value as plain JSON (numpy scalars are not serialisable)."""
    if v is None or isinstance(v, str | bool | int | float):
        return v
    return v.item()


@runtime_checkable
class Backend(Protocol):
    """A shard format. A backend object may keep caches between reads (of the last shard).

    name            as the manifest's "backend" and --backend spell it
    suffix          of a shard's data on disk (a directory or a file): NAME + suffix
    random_access   True: any row range of a shard is read at the cost of its rows, so a
                    reader may read a shard in pieces, or one sample. False: a row range is
                    found by reading the shard from its start (sequential streaming), so a
                    reader reads such a shard whole, once, and keeps what it needs.
    """

    name: ClassVar[str]
    suffix: ClassVar[str]
    random_access: ClassVar[bool]
    chunk_samples: int

    def write(self, path: Path, schema: Schema, tensors: dict, columns: dict, n: int) -> None:
        """Write a complete shard of n samples at `path`."""

    def read(self, path: Path, schema: Schema, fields, start: int, stop: int) -> dict:
        """{field: stacked array} of samples [start, stop) of the shard at `path`."""


class _Chunked:
    """What both backends keep: samples per zarr chunk, or per wds tar block."""

    def __init__(self, chunk_samples: int = CHUNK_SAMPLES):
        self.chunk_samples = chunk_samples


class ZarrBackend(_Chunked):
    name = "zarr"
    suffix = ".zarr"
    random_access = True

    def __init__(self, chunk_samples: int = CHUNK_SAMPLES):
        super().__init__(chunk_samples)
        # Reads in slices come back to the same shard many times: keep the last shard's
        # columns table and every array's parsed metadata (a published shard never changes
        # in place: a rewrite is a new directory, so the cache keys include its inode).
        self._columns: tuple | None = None
        self._meta: dict = {}

    def write(self, path: Path, schema: Schema, tensors: dict, columns: dict, n: int) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq
        import zarr

        group = zarr.open_group(str(path), mode="w", zarr_format=3)
        for name, spec in schema.tensors.items():
            arr = to_disk(tensors[name], spec.dtype)
            z = group.create_array(
                name,
                shape=arr.shape,
                dtype=arr.dtype,
                chunks=(max(1, min(self.chunk_samples, n)), *spec.shape),
                compressors=None,
                fill_value=0,
                attributes={"dtype": spec.dtype},
            )
            if n:
                z[...] = arr
        for name, spec in schema.ragged.items():  # all the shard's tokens, sample after sample
            arr = to_disk(tensors[name], spec.dtype)
            z = group.create_array(name, shape=arr.shape, dtype=arr.dtype,
                                   chunks=(max(1, min(RAGGED_CHUNK_TOKENS, len(arr))), *spec.shape),
                                   compressors=None, fill_value=0,
                                   attributes={"dtype": spec.dtype, "length": spec.length})
            if len(arr):
                z[...] = arr
        table = pa.table(
            {c: pa.array(list(columns[c]), type=_arrow_type(k)) for c, k in schema.columns.items()}
        )
        pq.write_table(table, path / COLUMNS_FILE)

    def _offsets(self, path: Path, length_field: str, rows) -> np.ndarray:
        """The token offsets (n + 1,) of a shard's ragged fields, from its whole length field
        (read once per shard: 4 bytes a sample)."""
        meta = path / length_field / "zarr.json"
        st = meta.stat()
        key = ("offsets", str(meta), st.st_ino, st.st_mtime_ns)
        if key not in self._meta:
            n = int(files.read_json(meta)["shape"][0])
            self._meta[key] = offsets_of(rows(length_field, 0, n))
        return self._meta[key]

    def read(self, path: Path, schema: Schema, fields, start: int, stop: int) -> dict:
        import pyarrow.parquet as pq
        import zarr

        out = {}
        group = None
        fields = _with_lengths(schema, fields)

        def rows(f, a, b):
            nonlocal group
            arr = _read_plain_chunks(path / f, a, b, self._meta)
            if arr is None:  # not the plain layout we write: let zarr decode it
                group = group or zarr.open_group(str(path), mode="r", zarr_format=3)
                arr = group[f][a:b]
            return arr

        for f in (f for f in fields if f in schema.tensors):
            out[f] = from_disk(rows(f, start, stop), schema.tensors[f].dtype)
        for f in (f for f in fields if f in schema.ragged):
            spec = schema.ragged[f]
            off = self._offsets(path, spec.length, rows)
            out[f] = from_disk(rows(f, int(off[start]), int(off[stop])), spec.dtype)
        cols = [f for f in fields if f in schema.columns]
        if cols:
            file = path / COLUMNS_FILE
            st = file.stat()
            key = (str(file), st.st_ino, st.st_mtime_ns)
            if self._columns is None or self._columns[0] != key:
                self._columns = (key, pq.read_table(file), {})
            table, converted = self._columns[1], self._columns[2]
            for c in cols:
                if c not in converted:  # one Python conversion per column per shard
                    converted[c] = _column_array(table.column(c).to_pylist(), schema.columns[c])
                out[c] = converted[c][start:stop].copy()
        return out


# The layout ZarrBackend writes: uncompressed little-endian chunks along axis 0, default
# "/"-separated chunk keys. Its chunk files are plain C-order arrays, read straight into
# the output rows, several times faster than zarr's codec pipeline (measured here: about
# 0.5 M vs 0.2 M samples/s of 4x32x32 fp16, see bench/store_read.py). Any other layout
# (another writer, compression) goes through zarr.
_PLAIN = {"codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
          "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}}}


_ONE_BYTE = [{"name": "bytes"}]  # what zarr writes for int8, uint8 and bool: no endian setting


def _read_plain_chunks(array_dir: Path, start: int, stop: int, cache: dict | None = None) -> np.ndarray | None:
    try:
        meta_file = array_dir / "zarr.json"
        st = meta_file.stat()
        key = (str(meta_file), st.st_ino, st.st_mtime_ns)
        meta = (cache or {}).get(key)
        if meta is None:
            meta = files.read_json(meta_file)
            if cache is not None:
                cache[key] = meta
    except (OSError, ValueError):
        return None
    shape = tuple(meta.get("shape", ()))
    chunks = tuple(meta.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape", ()))
    if meta.get("codecs") == _ONE_BYTE and isinstance(meta.get("data_type"), str) \
            and meta["data_type"] in ("int8", "uint8", "bool"):
        meta = {**meta, "codecs": _PLAIN["codecs"]}  # one-byte values have no byte order
    if (any(meta.get(k) != v for k, v in _PLAIN.items()) or meta.get("storage_transformers")
            or not shape or len(chunks) != len(shape) or chunks[1:] != shape[1:]
            or not isinstance(meta.get("data_type"), str)):
        return None
    dtype = np.dtype(meta["data_type"]).newbyteorder("<")
    out = np.empty((stop - start, *shape[1:]), dtype=dtype)
    rows, tail = chunks[0], "/0" * (len(shape) - 1)
    for c in range(start // rows, (stop - 1) // rows + 1 if stop > start else 0):
        lo, hi = max(start, c * rows), min(stop, (c + 1) * rows, shape[0])
        chunk = array_dir / f"c/{c}{tail}"
        if not chunk.is_file():  # never written: zarr's fill value
            out[lo - start:hi - start] = meta.get("fill_value") or 0
            continue
        # one copy, page cache -> the output rows (out's rows are contiguous, C order)
        row_bytes = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
        with open(chunk, "rb") as f:
            f.seek((lo - c * rows) * row_bytes)
            view = memoryview(out[lo - start:hi - start]).cast("B")
            if f.readinto(view) != len(view):
                raise OSError(f"{chunk}: shorter than its zarr.json says (truncated chunk)")
    return out


class WdsBackend(_Chunked):
    name = "wds"
    suffix = ".tar"
    random_access = False

    def write(self, path: Path, schema: Schema, tensors: dict, columns: dict, n: int) -> None:
        import webdataset as wds

        with open(path, "wb") as f:
            # mtime=0 keeps a shard's bytes a function of its content (reruns are identical).
            writer = wds.TarWriter(f, encoder=False, mtime=0)
            try:
                for b, start in enumerate(range(0, n, self.chunk_samples)):
                    sl = slice(start, min(n, start + self.chunk_samples))
                    block = {"__key__": f"{b:06d}"}
                    for name, spec in schema.tensors.items():
                        buf = io.BytesIO()
                        np.save(buf, np.ascontiguousarray(to_disk(tensors[name][sl], spec.dtype)))
                        block[f"{name}.npy"] = buf.getvalue()
                    for name, spec in schema.ragged.items():  # the block's samples' tokens
                        off = offsets_of(tensors[spec.length])
                        buf = io.BytesIO()
                        np.save(buf, np.ascontiguousarray(to_disk(tensors[name][off[sl.start]:off[sl.stop]],
                                                                  spec.dtype)))
                        block[f"{name}.npy"] = buf.getvalue()
                    rows = {c: [_json_value(v) for v in list(columns[c])[sl]] for c in schema.columns}
                    block["columns.json"] = json.dumps(rows, ensure_ascii=False).encode()
                    writer.write(block)
            except BaseException:
                # closed here, while the file is open, after a failed write too (else the
                # tar writer's finaliser writes to a closed file and prints noise on stderr)
                try:
                    writer.close()
                except (OSError, ValueError):
                    pass
                raise
            writer.close()

    def read(self, path: Path, schema: Schema, fields, start: int, stop: int) -> dict:
        from webdataset.tariterators import group_by_keys, tar_file_expander

        fields = _with_lengths(schema, fields)
        tensor_fields = [f for f in fields if f in schema.tensors]
        ragged = [f for f in fields if f in schema.ragged]
        cols = [f for f in fields if f in schema.columns]
        parts = {f: [] for f in tensor_fields + ragged + cols}
        first = 0  # index of the current block's first sample
        with open(path, "rb") as f:
            for block in group_by_keys(tar_file_expander([{"stream": f, "url": str(path)}])):
                if first >= stop:
                    break
                rows = json.loads(block["columns.json"])
                size = len(rows["key"])
                lo, hi = max(start - first, 0), min(stop - first, size)
                if lo < hi:
                    loaded = {name: np.load(io.BytesIO(block[f"{name}.npy"])) for name in tensor_fields}
                    for name in tensor_fields:
                        parts[name].append(loaded[name][lo:hi])
                    for name in ragged:
                        off = offsets_of(loaded[schema.ragged[name].length])
                        parts[name].append(np.load(io.BytesIO(block[f"{name}.npy"]))[off[lo]:off[hi]])
                    for c in cols:
                        parts[c].extend(rows[c][lo:hi])
                first += size
        result = {}
        for name in tensor_fields:
            spec = schema.tensors[name]
            stacked = (
                np.concatenate(parts[name])
                if parts[name]
                else np.zeros((0, *spec.shape), dtype=disk_dtype(spec.dtype))
            )
            result[name] = from_disk(stacked, spec.dtype)
        for name in ragged:
            spec = schema.ragged[name]
            stacked = (np.concatenate(parts[name]) if parts[name]
                       else np.zeros((0, *spec.shape), dtype=disk_dtype(spec.dtype)))
            result[name] = from_disk(stacked, spec.dtype)
        for c in cols:
            result[c] = _column_array(parts[c], schema.columns[c])
        return result


# The backends by name: the names of defaults.BACKENDS, in its order.
BACKEND_CLASSES: dict[str, type[Backend]] = {b.name: b for b in (ZarrBackend, WdsBackend)}


def get_backend(name: str, **options) -> Backend:
    if name not in BACKEND_CLASSES:
        raise ValueError(f"unknown store backend {name!r}; choose {' or '.join(map(repr, BACKENDS))}")
    return BACKEND_CLASSES[name](**options)
