"""The two on-disk shard formats behind one interface.

zarr  a directory `NAME.zarr`: a zarr v3 group with one uncompressed array per tensor
      field, chunked along the sample axis in LARGE chunks (latents barely compress and
      per-sample chunks are measured here at ~1 k samples/s), plus `columns.parquet`
      with the scalar columns. Random access to any slice.
wds   a tar file `NAME.tar` in WebDataset layout, one group of members per sample:
      `000000042.latent.npy`, ..., `000000042.json` (the columns). Sequential streaming,
      friendly to object storage. Member names are the sample's index in the shard, so
      any source key (slashes, dots) is safe; the real key is in the json.

Each backend writes a complete shard to a path it is given (the writer handles
temporary names) and reads a field subset over a sample range as stacked arrays.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np

from .schema import Schema, disk_dtype, from_disk, to_disk

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


class ZarrBackend:
    name = "zarr"
    suffix = ".zarr"

    def __init__(self, chunk_samples: int = 1024):
        self.chunk_samples = chunk_samples

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
        table = pa.table(
            {c: pa.array(list(columns[c]), type=_arrow_type(k)) for c, k in schema.columns.items()}
        )
        pq.write_table(table, path / COLUMNS_FILE)

    def read(self, path: Path, schema: Schema, fields, start: int, stop: int) -> dict:
        import pyarrow.parquet as pq
        import zarr

        out = {}
        tensor_fields = [f for f in fields if f in schema.tensors]
        if tensor_fields:
            group = zarr.open_group(str(path), mode="r", zarr_format=3)
            for f in tensor_fields:
                out[f] = from_disk(group[f][start:stop], schema.tensors[f].dtype)
        cols = [f for f in fields if f in schema.columns]
        if cols:
            table = pq.read_table(path / COLUMNS_FILE, columns=cols).slice(start, stop - start)
            for c in cols:
                out[c] = _column_array(table.column(c).to_pylist(), schema.columns[c])
        return out


class WdsBackend:
    name = "wds"
    suffix = ".tar"

    def write(self, path: Path, schema: Schema, tensors: dict, columns: dict, n: int) -> None:
        import webdataset as wds

        with open(path, "wb") as f:
            # mtime=0 keeps a shard's bytes a function of its content (reruns are identical).
            writer = wds.TarWriter(f, encoder=False, mtime=0)
            for i in range(n):
                sample = {"__key__": f"{i:09d}"}
                for name, spec in schema.tensors.items():
                    buf = io.BytesIO()
                    np.save(buf, np.ascontiguousarray(to_disk(tensors[name][i], spec.dtype)))
                    sample[f"{name}.npy"] = buf.getvalue()
                row = {c: _json_value(columns[c][i]) for c in schema.columns}
                sample["json"] = json.dumps(row, ensure_ascii=False).encode()
                writer.write(sample)
            writer.close()

    def read(self, path: Path, schema: Schema, fields, start: int, stop: int) -> dict:
        from webdataset.tariterators import group_by_keys, tar_file_expander

        tensor_fields = [f for f in fields if f in schema.tensors]
        cols = [f for f in fields if f in schema.columns]
        out = {f: [] for f in tensor_fields + cols}
        with open(path, "rb") as f:
            for i, sample in enumerate(
                group_by_keys(tar_file_expander([{"stream": f, "url": str(path)}]))
            ):
                if i < start:
                    continue
                if i >= stop:
                    break
                for name in tensor_fields:
                    out[name].append(np.load(io.BytesIO(sample[f"{name}.npy"])))
                if cols:
                    row = json.loads(sample["json"])
                    for c in cols:
                        out[c].append(row[c])
        result = {}
        for name in tensor_fields:
            spec = schema.tensors[name]
            stacked = (
                np.stack(out[name])
                if out[name]
                else np.zeros((0, *spec.shape), dtype=disk_dtype(spec.dtype))
            )
            result[name] = from_disk(stacked, spec.dtype)
        for c in cols:
            result[c] = _column_array(out[c], schema.columns[c])
        return result


def get_backend(name: str, **options):
    if name == "zarr":
        return ZarrBackend(**options)
    if name == "wds":
        return WdsBackend()
    raise ValueError(f"unknown store backend {name!r}; choose 'zarr' or 'wds'")


def tar_member_count(path: Path) -> int:
    with tarfile.open(path) as t:
        return len(t.getmembers())
