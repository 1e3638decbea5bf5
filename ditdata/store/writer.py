"""StoreWriter: one store shard per input shard, each published atomically; manifest last.

On disk, while a store is being written::

    STORE/config.json            what every shard is made with (schema, backend, info)
    STORE/shards/NAME.json       a finished shard's record (count, files, digests, stats)
    STORE/shards/NAME.zarr|.tar  its data, renamed into place after the record exists
    STORE/manifest.json          written by finalize(), last, once every shard exists

So a shard's data under its final name always has a record beside it, a killed writer
leaves only hidden `.NAME.*.tmp-*` debris (removed when that shard is written again),
and readers of a previous manifest keep working while new shards are appended. A write
that fails (disk full, file-size limit) raises a StoreError naming the file, removes its
temporary and leaves the earlier shards, records, config and manifest as they were.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ditdata.common import files
from ditdata.common.errors import first_names
from ditdata.common.extras import installed_version

from . import manifest
from .backends import get_backend
from .defaults import CHUNK_SAMPLES, DEFAULT_BACKEND
from .errors import StoreError
from .schema import Schema, dtype_name, values

CONFIG = "config.json"
SHARDS = "shards"


def tool_versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("ditkit", "numpy", "zarr", "webdataset", "torch", "diffusers", "open_clip_torch"):
        if (version := installed_version(dist)) is not None:
            out[dist] = version
    return out


def provenance_of(provenance: dict | None, created_at: str | None = None) -> dict:
    """A manifest's provenance: the caller's entries, plus the tool versions and the time of
    writing (now, in UTC, unless `created_at` is given) where the caller has none."""
    prov = dict(provenance or {})
    prov.setdefault("tools", tool_versions())
    prov.setdefault("created_at", created_at or dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
    return prov


class StoreWriter:
    """Write a latent store shard by shard; safe to rerun, append to, and run per rank.

    `info` holds the producer's description (at least vae, image, conditioning; filter
    optional). Every shard in a store must be made with the same schema, backend and
    info: a rerun with different settings is refused while finished shards exist.
    """

    def __init__(self, root, *, schema: Schema, info: dict, backend: str = DEFAULT_BACKEND,
                 chunk_samples: int = CHUNK_SAMPLES):
        self.root = Path(root)
        self.schema = schema
        self.backend = get_backend(backend, chunk_samples=chunk_samples)
        # The config round-trips through JSON so comparisons see what the disk will hold.
        self.config = json.loads(json.dumps(self._make_config(backend, info)))
        self.shard_dir = self.root / SHARDS
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        self._check_config()

    def _make_config(self, backend: str, info: dict) -> dict:
        """What every shard is made with (config.json): a feature set has its own."""
        missing = [k for k in manifest.INFO_KEYS if k not in info]
        if missing:
            raise ValueError(f"store info lacks {missing}")
        return {"backend": backend, "fields": self.schema.to_json(),
                **{k: info[k] for k in manifest.INFO_KEYS}, "filter": info.get("filter")}

    # -- compatibility -------------------------------------------------------------
    def _check_config(self) -> None:
        path = self.root / CONFIG
        old = _read_config(path)
        if old is not None:
            if old != self.config:
                if self._finished_records():
                    differ = sorted(k for k in set(old) | set(self.config) if old.get(k) != self.config.get(k))
                    raise StoreError(
                        f"{path}: this store was made with different settings ({', '.join(differ)} "
                        f"differ); its shards cannot be mixed with new ones. Use the same settings, "
                        f"or write to a new --out directory."
                    )
                _write_json(path, self.config, "the store config")
        else:
            _write_json(path, self.config, "the store config")

    # -- shards --------------------------------------------------------------------
    def data_path(self, name: str) -> Path:
        return self.shard_dir / f"{name}{self.backend.suffix}"

    def record_path(self, name: str) -> Path:
        return self.shard_dir / f"{name}.json"

    def done(self, name: str) -> bool:
        """A shard is finished when its record exists and its files have the recorded sizes."""
        rec = self._read_record(name)
        if rec is None:
            return False
        for rel, meta in rec["files"].items():
            p = self.root / rel
            if not p.is_file() or p.stat().st_size != meta["size"]:
                return False
        return True

    def _read_record(self, name: str) -> dict | None:
        """The shard's record, or None when absent or damaged: either way the shard is not
        finished and will be written again (ValueError covers bad JSON and bad UTF-8)."""
        rec = files.read_json_or_none(self.record_path(name))
        if not isinstance(rec, dict) or not isinstance(rec.get("files"), dict):
            return None
        return rec

    def _finished_records(self) -> list[str]:
        return [p.stem for p in self.shard_dir.glob("*.json") if not files.is_tmp(p) and self.done(p.stem)]

    def write_shard(self, name: str, tensors: dict, columns: dict, *, source: str | None = None,
                    extra: dict | None = None) -> dict:
        """Write one shard atomically and return its record.

        tensors: {field: array (N, *shape)} for every tensor field of the schema.
        columns: {column: sequence of N values} for every column of the schema.
        extra:   producer's per-shard facts (e.g. skipped images and reasons).
        """
        if "/" in name or name.startswith("."):
            raise ValueError(f"invalid shard name {name!r}")
        n = self._validate(name, tensors, columns)
        for debris in (*self.shard_dir.glob(f".{name}{self.backend.suffix}{files.TMP_MARK}*"),
                       *self.shard_dir.glob(f".{name}.json{files.TMP_MARK}*")):
            files.remove(debris)

        final, record_path = self.data_path(name), self.record_path(name)
        tmp = files.tmp_name(final)
        try:
            with _writing(final, f"shard {name}"):
                self.backend.write(tmp, self.schema, tensors, columns, n)
                files.fsync_tree(tmp)
            record = self._record(name, n, tmp, final, tensors, source, extra)
            # The record goes first: data under its final name then always has a record.
            _write_json(record_path, record, f"the record of shard {name}")
            with _writing(final, f"shard {name}"):
                files.publish(tmp, final)
        except BaseException:
            files.remove_settled(tmp)
            if not self.done(name):  # a record only stays beside the complete data it describes
                record_path.unlink(missing_ok=True)
            raise
        return record

    def _record(self, name: str, n: int, tmp: Path, final: Path, tensors: dict,
                source: str | None, extra: dict | None) -> dict:
        described = files.describe_files(tmp, self.root)
        # Record paths as they will be after the rename.
        tmp_rel = tmp.relative_to(self.root).as_posix()
        final_rel = final.relative_to(self.root).as_posix()
        file_table = {final_rel + rel[len(tmp_rel):]: meta for rel, meta in described.items()}
        return {
            "name": name,
            "path": final_rel,
            "num_samples": n,
            "checksum": files.combined_checksum(file_table),
            "bytes": sum(m["size"] for m in file_table.values()),
            "files": file_table,
            "source": source,
            "stats": self._stats(tensors) | self._length_counts(tensors),
            "extra": extra or {},
        }

    def _validate(self, name: str, tensors: dict, columns: dict) -> int:
        s = self.schema
        if set(tensors) != set(s.tensors) | set(s.ragged):
            raise ValueError(f"shard {name}: tensors {sorted(tensors)} != schema {sorted([*s.tensors, *s.ragged])}")
        if set(columns) != set(s.columns):
            raise ValueError(f"shard {name}: columns {sorted(columns)} != schema {sorted(s.columns)}")
        n = len(columns["key"])
        for f, spec in s.tensors.items():
            arr = tensors[f]
            if not isinstance(arr, np.ndarray):
                raise TypeError(f"shard {name}: tensor {f!r} must be a numpy array")
            if arr.shape != (n, *spec.shape) or dtype_name(arr) != spec.dtype:
                raise ValueError(
                    f"shard {name}: {f!r} is {dtype_name(arr)}{list(arr.shape)}, "
                    f"expected {spec.dtype}{[n, *spec.shape]}"
                )
        for f, spec in s.ragged.items():  # all the samples' tokens, as many as their lengths say
            arr, lengths = tensors[f], tensors[spec.length]
            total = int(np.asarray(lengths, dtype=np.int64).sum())
            if not isinstance(arr, np.ndarray) or arr.shape != (total, *spec.shape) or dtype_name(arr) != spec.dtype:
                raise ValueError(f"shard {name}: ragged {f!r} is {getattr(arr, 'shape', None)}, expected "
                                 f"{spec.dtype}{[total, *spec.shape]} ({spec.length!r} sums to {total})")
            if n and int(np.min(lengths)) < 0:
                raise ValueError(f"shard {name}: {spec.length!r} holds a negative length")
        for c, kind in s.columns.items():
            if len(columns[c]) != n:
                raise ValueError(f"shard {name}: column {c!r} has {len(columns[c])} values, expected {n}")
            if kind in ("int64", "bool") and any(v is None for v in columns[c]):
                # readers turn these columns into numpy arrays, which have no null
                raise ValueError(f"shard {name}: column {c!r} ({kind}) holds null values")
        keys = list(columns["key"])
        if len(set(keys)) != n:
            raise ValueError(f"shard {name}: duplicate keys")
        return n

    def _length_counts(self, tensors: dict) -> dict:
        """{"lengths": {length field: counts of each length (bincount)}} of the ragged fields, for
        the manifest's length statistics; {} without ragged fields."""
        fields = sorted(set(self.schema.lengths.values()))
        if not fields:
            return {}
        return {"lengths": {f: np.bincount(np.asarray(tensors[f], dtype=np.int64)).tolist() for f in fields}}

    def _stats(self, tensors: dict) -> dict:
        """Per-channel sums (channel = axis 1) of the primary latent field's values (int8
        ones dequantized), in float64, for the manifest's mean/std."""
        x = values(tensors, self.schema.primary)
        if x.ndim < 2 or x.shape[0] == 0:
            c = x.shape[1] if x.ndim >= 2 else 0
            return {"sum": [0.0] * c, "sumsq": [0.0] * c, "count": 0}
        c = x.shape[1]
        v = x.astype(np.float64).swapaxes(0, 1).reshape(c, -1)
        return {"sum": v.sum(1).tolist(), "sumsq": (v * v).sum(1).tolist(), "count": int(v.shape[1])}

    # -- manifest ------------------------------------------------------------------
    def _records_if_finished(self, names: list[str], what: str, then: str = "") -> list[dict]:
        """The records of shards `names`, refusing (StoreError, the first ten named) while any
        is not finished: a manifest never lists a shard that is missing."""
        missing = [n for n in names if not self.done(n)]
        if missing:
            raise StoreError(f"{self.shard_dir}: {what} not finished: {first_names(missing)}; "
                             f"rerun to complete them{then}")
        return [self._read_record(n) for n in names]

    def finalize(self, names: list[str] | None = None, *, provenance: dict | None = None,
                 created_at: str | None = None, skipped_shards: list[dict] | None = None) -> dict:
        """Write manifest.json over the given shards (default: every finished shard).

        Refuses (and writes nothing) if a named shard is not finished, so a manifest
        never lists a shard that is missing. `skipped_shards` records input shards that
        were left out on purpose ({name, reason, samples_lost, ...}); it is part of what
        the store holds, so it enters the manifest (and its identity) when not empty.
        """
        if names is None:
            names = sorted(self._finished_records())
        records = self._records_if_finished(names, "shards", " before the manifest is written")
        total = sum(r["num_samples"] for r in records)
        m = {
            "format_version": manifest.FORMAT_VERSION,
            "backend": self.config["backend"],
            "num_samples": total,
            "latent": manifest.latent_description(self.schema),
            "fields": self.config["fields"],
            "vae": self.config["vae"],
            "image": self.config["image"],
            "conditioning": self.config["conditioning"],
            "filter": self.config["filter"],
            "stats": manifest.channel_stats(records, self.schema.primary),
            "shards": [{k: v for k, v in r.items() if k != "stats"} for r in records],
            "provenance": provenance_of(provenance, created_at),
        }
        if self.schema.ragged:  # each caption set's token counts: mean, min, p50, p95, max
            m["ragged"] = {f: length_summary([r["stats"].get("lengths", {}).get(f, []) for r in records])
                           for f in sorted(set(self.schema.lengths.values()))}
        if skipped_shards:
            m["skipped_shards"] = list(skipped_shards)
        path = self.root / manifest.MANIFEST
        old = files.read_json_or_none(path)
        if old is not None and manifest.identity(old) == manifest.identity(m):
            return old  # nothing changed (e.g. a rerun that found every shard done): keep it
        _write_json(path, m, "the manifest")
        return m


def length_summary(counts: list[list[int]]) -> dict:
    """The token-count statistics of bincounts (one per shard) merged."""
    total = np.zeros(max((len(c) for c in counts), default=0), dtype=np.int64)
    for c in counts:
        total[:len(c)] += np.asarray(c, dtype=np.int64)
    n = int(total.sum())
    if not n:
        return {"count": 0}
    cum = np.cumsum(total)
    lengths = np.arange(len(total))
    return {"count": n, "mean": round(float((lengths * total).sum() / n), 2), "min": int(np.argmax(total > 0)),
            "p50": int(np.searchsorted(cum, 0.5 * n)), "p95": int(np.searchsorted(cum, 0.95 * n)),
            "max": int(len(total) - 1), "tokens": int((lengths * total).sum())}


@contextmanager
def _writing(path: Path, what: str):
    """Turn an OSError while writing `path` (disk full, file-size limit, ...) into one
    line naming the file; the atomic helpers have already removed the temporary."""
    try:
        yield
    except OSError as e:
        raise StoreError(
            f"{path}: could not write {what} ({files.error_reason(e)}); nothing was published "
            "and the earlier files are unchanged"
        ) from e


def _write_json(path: Path, obj, what: str) -> None:
    with _writing(path, what):
        files.write_json_atomic(path, obj)


def _read_config(path: Path) -> dict | None:
    """The config.json of an existing store, None when there is none yet."""
    try:
        old = files.read_json(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        raise StoreError(
            f"{path}: unreadable store config ({files.error_reason(e)}); restore it, "
            "or write to a new --out directory"
        ) from e
    if not isinstance(old, dict):
        raise StoreError(f"{path}: not a store config (a JSON object was expected); restore it, "
                         "or write to a new --out directory")
    return old
