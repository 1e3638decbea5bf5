"""The writing side of `ditdata encode --buckets`: one plain StoreWriter per bucket, and a
record per finished input shard, so that a bucketed encode resumes like a plain one.

    STORE/buckets/WxH/shards/NAME.*   input shard NAME's images of bucket WxH (at most one
                                      shard per bucket per input shard, named after it)
    STORE/inputs/NAME.json            written once every bucket shard of NAME exists:
                                      {"buckets": {WxH: samples}, "cropped_beyond_step", ...}
    STORE/buckets/WxH/manifest.json   each bucket's manifest, then
    STORE/manifest.json               the top manifest, last (ditdata.store.finalize_buckets)

An input shard is finished when its record exists and every bucket shard it lists is
finished. One that is not (a killed run) has its bucket shards discarded before it is
encoded again, so no sample is ever written twice; and since the top manifest is written
last, nothing half-written looks finished. The object has StoreWriter's `done` and
`finalize`, so encode's plan and finish steps take either.
"""

from __future__ import annotations

from pathlib import Path

from ditdata.common import files
from ditdata.common.errors import first_names
from ditdata.errors import DitdataError
from ditdata.framing import BucketSpec
from ditdata.store import Schema, StoreWriter, bucket_name, finalize_buckets, parse_bucket_name
from ditdata.store.buckets import BUCKETS

INPUTS = "inputs"


class BucketWriter:
    """Per-bucket store writers under `root` for the sizes of `spec`; `schema_of(size)` is a
    bucket's schema, `info` and the writer options those of every bucket."""

    def __init__(self, root, spec: BucketSpec, schema_of, info: dict, **writer_options):
        self.root, self.spec, self.info = Path(root), spec, info
        self.sizes = spec.sizes()
        self.schema_of, self.options = schema_of, writer_options
        self.writers: dict[tuple[int, int], StoreWriter] = {}
        # The buckets already there are checked now, before any work: another --buckets, or
        # other settings (StoreWriter's config check), is refused in one line.
        for d in self._bucket_dirs():
            size = parse_bucket_name(d.name)
            if size not in self.sizes:
                raise DitdataError(f"--out {self.root}: holds bucket {d.name}, which --buckets {spec.text} does not "
                                   "make (it was encoded with other --buckets); use the same --buckets or a new --out")
            self.writer(size)

    def _bucket_dirs(self) -> list[Path]:
        top = self.root / BUCKETS
        return sorted(p for p in top.iterdir() if p.is_dir() and not files.is_tmp(p)) if top.is_dir() else []

    def writer(self, size: tuple[int, int]) -> StoreWriter:
        if size not in self.writers:
            self.writers[size] = StoreWriter(self.root / BUCKETS / bucket_name(size), schema=self.schema_of(size),
                                             info=self.info, **self.options)
        return self.writers[size]

    def record_path(self, name: str) -> Path:
        return self.root / INPUTS / f"{name}.json"

    def record(self, name: str) -> dict | None:
        rec = files.read_json_or_none(self.record_path(name))
        return rec if isinstance(rec, dict) and isinstance(rec.get("buckets"), dict) else None

    def done(self, name: str) -> bool:
        """Input shard `name` is finished: its record, and every bucket shard it lists."""
        rec = self.record(name)
        return rec is not None and all(self.writer(parse_bucket_name(b)).done(name) for b in rec["buckets"])

    def discard(self, name: str) -> None:
        """Remove what a killed run left of input shard `name` (its record first, then its
        bucket shards, each record before its data: StoreWriter's order, reversed)."""
        self.record_path(name).unlink(missing_ok=True)
        for d in self._bucket_dirs():
            w = self.writer(parse_bucket_name(d.name))
            if w.record_path(name).exists() or w.data_path(name).exists():
                w.record_path(name).unlink(missing_ok=True)
                files.remove(w.data_path(name))

    def write(self, name: str, parts: dict, *, source: str, stats: dict, cropped_beyond_step: int) -> dict:
        """Write input shard `name`: parts {size: (tensors, columns, extra)} each as the shard
        `name` of its bucket, then its record (returned)."""
        self.discard(name)
        for size, (tensors, columns, extra) in sorted(parts.items()):
            self.writer(size).write_shard(name, tensors, columns, source=source, extra=extra)
        rec = {"name": name, "source": source,
               "buckets": {bucket_name(s): len(c["key"]) for s, (_, c, _) in sorted(parts.items())},
               "cropped_beyond_step": cropped_beyond_step, "stats": stats}
        path = self.record_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        files.write_json_atomic(path, rec)
        return rec

    def finalize(self, names: list[str], *, provenance: dict | None = None,
                 skipped_shards: list[dict] | None = None) -> dict:
        """Each bucket's manifest over the shards of the finished inputs `names`, then the
        top manifest (returned). A bucket no finished input holds (debris of a killed run)
        is removed."""
        missing = [n for n in names if not self.done(n)]
        if missing:
            raise DitdataError(f"{self.root}: input shards not finished: {first_names(missing)}; "
                               "rerun `ditdata encode` to complete them")
        held: dict[str, list[str]] = {}
        cropped = 0
        for n in names:
            rec = self.record(n)
            cropped += rec["cropped_beyond_step"]
            for b in rec["buckets"]:
                held.setdefault(b, []).append(n)
        for d in self._bucket_dirs():
            if d.name not in held:
                self.writers.pop(parse_bucket_name(d.name), None)
                files.remove(d)
        if not held:
            raise DitdataError(f"{self.root}: no image was encoded, so no bucket holds anything; check the image "
                               "shards (and --select)")
        for b, shard_names in sorted(held.items()):
            self.writer(parse_bucket_name(b)).finalize(sorted(shard_names), provenance=provenance)
        return finalize_buckets(self.root, self.info, area=self.spec.area, step=self.spec.step,
                                cropped_beyond_step=cropped, provenance=provenance, skipped_shards=skipped_shards)


def with_latent_shape(schema: Schema, shape: tuple[int, ...]) -> Schema:
    """`schema` with its latents of `shape` (C, h, w), and the per-token scales of int8 ones (h, w)."""
    from ditdata.store import LATENT_FIELDS, LATENT_SCALES, TensorSpec

    scales = set(LATENT_SCALES.values())
    tensors = {k: TensorSpec(shape, v.dtype) if k in LATENT_FIELDS else TensorSpec(shape[1:], v.dtype) if k in scales
               else v for k, v in schema.tensors.items()}
    return Schema(tensors=tensors, columns=dict(schema.columns), ragged=dict(schema.ragged))
