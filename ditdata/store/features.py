"""Feature sets: per-sample representation targets (e.g. DINOv2 patch tokens) kept beside a
store's latents, row for row, so that a REPA run reads them instead of running an encoder.

On disk, inside the store (the same layout and publishing rules as the store, writer.py)::

    STORE/features/SET/config.json        what every feature shard is made with
    STORE/features/SET/shards/NAME.json   a finished feature shard's record
    STORE/features/SET/shards/NAME.zarr|.tar
    STORE/features/SET/manifest.json      the feature set's manifest, written last
    STORE/manifest.json                   gains "features": {SET: {"path", "identity", ...}}

One feature shard per store shard, with the store shard's name and its rows in its order
(FeatureSchema: `feat` (T, D), per-token `feat_scale` when int8, the flipped twins, `key`).
A feature shard's record names the store shard it was made from (its checksum): a store
shard rewritten later makes the feature shard stale, and a rerun makes it again. The store's
identity leaves "features" out, so adding a feature set changes neither which latents a run
trains on nor the store's identity; the feature set has its own identity (its manifest's
digest), which the store's entry records and a run records beside the store's.

The feature-set manifest (format_version 1)::

    format_version, kind "features", name, backend, num_samples, fields
    store      {"identity", "num_samples", "shards": {NAME: checksum}}   what it was made for
    encoder    {"name", "id", "weights_sha256", "resolution", "patch", "grid": [h, w],
                "tokens", "dim", ...}   (the producer's record; dim = the encoder's width)
    storage    {"dtype": "int8" | "float16", "dims": D stored, "cosine_to_fp32": measured,
                "pca": null | {"components": ARRAY (D, dim), "mean": ARRAY (dim,),
                               "explained_variance": fraction, "fit_samples": n}}
    shards     [{"name", "path", "num_samples", "checksum", "bytes", "files", "store_checksum"}]
    provenance {"tools", "created_at", ...}

int8 is symmetric per token (a token: one row's D values), as for int8 latents: schema.py's
quantize() and dequantize() are the definition, shared by the producer, verify and the trainer.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ditdata.common import files

from . import manifest
from .errors import StoreError
from .reader import FeatureSet, Store, StoreView
from .schema import FeatureSchema
from .writer import StoreWriter, provenance_of

FEATURES = "features"  # the folder of a store that holds its feature sets
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
CHUNK_BYTES = 32 * 2**20  # bytes of features per zarr chunk / tar block (about)


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise StoreError(f"feature set name {name!r}: use 1-64 letters, digits, '_', '-' or '.', "
                         "starting with a letter or digit (e.g. dinov2-b)")
    return name


def chunk_samples_for(schema: FeatureSchema) -> int:
    """Samples per chunk/block so that one holds about CHUNK_BYTES of features (a chunk of
    1024 ViT-L samples would be 0.5 GB: a streaming window must hold whole blocks)."""
    per_sample = sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in schema.tensors.values())
    return int(max(1, min(1024, CHUNK_BYTES // max(1, per_sample))))


def _store_checksums(store: Store) -> dict[str, str]:
    return {s.name: s.record["checksum"] for s in store.shards}


# ------------------------------------------------------------------------------ writing
class FeatureWriter(StoreWriter):
    """Write feature set `name` of the LOCAL store `store` shard by shard (one feature shard
    per store shard, same name, same rows in the same order), then finalize(): its manifest,
    and the entry in the store's manifest. The caller holds the store's lock (DirLock on
    the store, as `ditdata encode` does): one writer per store.

    info: the producer's record, {"encoder": {...}, "storage": {...}} (see the module
    docstring); a rerun with another schema or info is refused while finished shards exist.
    """

    def __init__(self, store: Store, name: str, *, schema: FeatureSchema, info: dict):
        if store.url is not None:
            raise StoreError(f"{store.url}: feature sets are added to a local store; run `ditdata features` "
                             "where the store is written, then upload it")
        if not isinstance(schema, FeatureSchema):
            raise TypeError("a feature set needs a FeatureSchema")
        missing = [k for k in ("encoder", "storage") if k not in info]
        if missing:
            raise ValueError(f"feature set info lacks {missing}")
        self.store, self.name = store, check_name(name)
        self.sources = _store_checksums(store)
        super().__init__(store.root / FEATURES / name, schema=schema, backend=store.manifest["backend"],
                         chunk_samples=chunk_samples_for(schema),
                         info={"encoder": info["encoder"], "storage": info["storage"]})

    def _make_config(self, backend: str, info: dict) -> dict:
        return {"kind": manifest.FEATURES_KIND, "name": self.name, "backend": backend, "fields": self.schema.to_json(),
                "encoder": info["encoder"], "storage": info["storage"]}

    def done(self, name: str) -> bool:
        """Finished, and made from the store shard as it is now (not from an older one)."""
        if not super().done(name):
            return False
        return self._read_record(name).get("store_checksum") == self.sources.get(name)

    def write_shard(self, name: str, tensors: dict, columns: dict, *, source: str | None = None,
                    extra: dict | None = None) -> dict:
        """Write the feature shard of store shard `name`; its keys must be the store shard's,
        in order (StoreError otherwise: features would be paired with the wrong latents)."""
        if name not in self.sources:
            raise StoreError(f"{self.store.root}: no store shard named {name!r} to add features to")
        keys = self.store.read(name, ["key"])["key"].tolist()
        got = list(columns["key"])
        if got != keys:
            diff = next((i for i, (a, b) in enumerate(zip(got, keys, strict=False)) if a != b), min(len(got), len(keys)))
            raise StoreError(
                f"feature shard {name}: its rows do not match the store shard's ({len(got)} vs {len(keys)} rows, "
                f"first difference at row {diff}); features must be computed for exactly the store's samples")
        return super().write_shard(name, tensors, columns, source=source, extra=extra)

    def _record(self, name, n, tmp, final, tensors, source, extra):
        # the store shard it was made from: done() tells a stale feature shard by it
        return {**super()._record(name, n, tmp, final, tensors, source, extra), "store_checksum": self.sources[name]}

    def _stats(self, tensors: dict) -> dict:
        return {}  # per-channel latent statistics have no meaning for features

    def finalize(self, names=None, *, provenance: dict | None = None, created_at: str | None = None,
                 skipped_shards=None) -> dict:
        """Write the feature set's manifest (every store shard must have its feature shard)
        and then its entry in the store's manifest. Returns the feature set's manifest."""
        records = self._records_if_finished([s.name for s in self.store.shards], "feature shards")
        m = {
            "format_version": manifest.FORMAT_VERSION, "kind": manifest.FEATURES_KIND, "name": self.name,
            "backend": self.config["backend"], "num_samples": sum(r["num_samples"] for r in records),
            "fields": self.config["fields"],
            "store": {"identity": self.store.identity, "num_samples": len(self.store), "shards": self.sources},
            "encoder": self.config["encoder"], "storage": self.config["storage"],
            "shards": [{k: v for k, v in r.items() if k not in ("stats", "extra")} for r in records],
            "provenance": provenance_of(provenance, created_at),
        }
        path = self.root / manifest.MANIFEST
        old = files.read_json_or_none(path)
        if old is None or identity(old) != identity(m):
            files.write_json_atomic(path, m)
        else:
            m = old
        _add_entry(self.store.root, self.name, m)
        return m


def identity(m: dict) -> str:
    """A feature set's identity: the digest of its manifest without provenance."""
    return manifest.identity(m)


def _add_entry(store_root: Path, name: str, m: dict) -> None:
    """Record feature set `name` in the store's manifest (rewritten atomically; its identity
    does not change: manifest.identity leaves "features" out)."""
    path = store_root / manifest.MANIFEST
    sm = manifest.load(store_root)
    if manifest.identity(sm) != m["store"]["identity"]:
        raise StoreError(f"{path}: the store changed while its features were computed; rerun `ditdata features`")
    entry = {"path": f"{FEATURES}/{name}", "identity": identity(m), "tokens": m["fields"]["tensors"]["feat"]["shape"][0],
             "dims": m["fields"]["tensors"]["feat"]["shape"][1], "dtype": m["fields"]["tensors"]["feat"]["dtype"],
             "encoder": m["encoder"].get("name")}
    if sm.get(FEATURES, {}).get(name) == entry:
        return
    sm[FEATURES] = {**sm.get(FEATURES, {}), name: entry}
    files.write_json_atomic(path, sm)


# ------------------------------------------------------------------------------ reading
def check_matches(store: Store, fs: Store, name: str) -> None:
    """StoreError unless feature set `fs` was made for `store` as it is: same identity
    recorded, same shards with the same counts (so row i of each shard is the same sample)."""
    entry = store.manifest.get(FEATURES, {}).get(name)
    where = f"{store.location}: feature set {name!r}"
    if entry is not None and entry.get("identity") != fs.identity:
        raise StoreError(f"{where} differs from the one the store's manifest records (identity); "
                         f"rerun `ditdata features` on the store")
    made_for = fs.manifest["store"]
    mine = _store_checksums(store)
    if made_for.get("identity") != store.identity and made_for.get("shards") != mine:
        stale = sorted(n for n in mine if made_for.get("shards", {}).get(n) != mine[n])
        raise StoreError(f"{where} was computed for another version of the store ({len(stale)} shard(s) "
                         f"changed, e.g. {stale[:3]}); rerun `ditdata features` to bring it up to date")
    ours = [(s.name, s.num_samples) for s in store.shards]
    theirs = [(s.name, s.num_samples) for s in fs.shards]
    if ours != theirs:
        raise StoreError(f"{where}: its rows do not match the store's ({len(theirs)} shards / {len(fs)} rows "
                         f"vs {len(ours)} / {len(store)}); rerun `ditdata features`")


def feature_sets(store: Store) -> dict[str, dict]:
    """{name: the store manifest's entry} of the feature sets the store records."""
    return dict(store.manifest.get(FEATURES) or {})


def open_features(store: Store, name: str, *, verify: bool = False) -> FeatureSet:
    """Feature set `name` of `store` (local or remote), checked against it (check_matches)."""
    sets = feature_sets(store)
    if name not in sets:
        have = ", ".join(sorted(sets)) or "none"
        raise StoreError(f"{store.location}: no feature set {name!r} (it has: {have}); add one with "
                         f"`ditdata features {store.location} --shards IMAGE_SHARDS --encoder NAME --out-name {name}`")
    if store.url is not None:
        from .remote import RemoteFeatureSet  # (fsspec and the cache, only for URLs)

        fs = RemoteFeatureSet(store, name, identity=sets[name]["identity"], verify=verify)
    else:
        fs = FeatureSet(store.root / sets[name]["path"], verify=verify)
    check_matches(store, fs, name)
    return fs


class FeaturedStore(StoreView):
    """A store read together with one of its feature sets: the same store (its shards, its
    identity), whose schema also holds the feature set's fields; read() takes latent fields
    from the store and `feat*` fields from the feature set, row for row. What the loaders
    and their worker processes open (open_args carries the set's name)."""

    def __init__(self, base: Store, name: str, *, features: FeatureSet | None = None):
        super().__init__(base)
        self.feature_set = features if features is not None else open_features(base, name)
        self.features_name = name
        from .schema import Schema

        self.schema = Schema(tensors={**base.schema.tensors, **self.feature_set.schema.tensors},
                             columns=dict(base.schema.columns), ragged=dict(base.schema.ragged))

    def open_args(self) -> dict:
        return {**self.base.open_args(), "features": self.features_name}

    def read(self, shard, fields=None, start: int = 0, stop: int | None = None) -> dict[str, np.ndarray]:
        s = self.base.shard(shard)
        fields = list(self.schema.tensors) + list(self.schema.columns) if fields is None else list(fields)
        feat = [f for f in fields if f in self.feature_set.schema.tensors]
        rest = [f for f in fields if f not in self.feature_set.schema.tensors]
        out = self.base.read(s, rest, start, stop) if rest else {}
        if feat:
            out |= self.feature_set.read(s.name, feat, start, stop)
        return out

    def verify(self, progress=None, warnings: list[str] | None = None) -> list[str]:
        """The store's faults and then its feature set's (Store.verify; warnings appended)."""
        return super().verify(progress, warnings) + self.feature_set.verify(progress, warnings)


__all__ = ["FEATURES", "FeatureSet", "FeatureWriter", "FeaturedStore", "check_matches",
           "check_name", "chunk_samples_for", "feature_sets", "identity", "open_features"]
