"""Store: the read side of the contract. Opens, validates, reads in bulk, verifies.

Opening checks the manifest and that every shard file exists with its recorded size
(cheap: one stat per file); `verify()` also recomputes digests and reads every shard.
Reading never writes anything to the store, so any number of readers and training
runs can share it. This module knows local stores only: open.py opens a path or a URL
(remote.py, a Store read through a local cache).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ditdata.common import files

from . import manifest
from .backends import get_backend
from .errors import StoreError
from .schema import FeatureSchema, Schema, is_scale_field, ragged_rows


@dataclass(frozen=True)
class Conditioning:
    """What a store's samples are conditioned on, typed (the manifest's "conditioning").

    kind          "class", "text" or "none"
    num_classes   classes of a class store (0 otherwise)
    class_names   their names, when recorded
    pooled_dim    width of the pooled caption embedding (text stores)
    tokens_shape  (tokens, width) of the per-token caption embeddings, when stored
    empty         the embedding of the empty caption {field: array}, for classifier-free
                  guidance (text stores; empty otherwise)
    text          the text encoder's record (model, pretrained, config, ...), or None
    """

    kind: str = "none"
    num_classes: int = 0
    class_names: tuple[str, ...] | None = None
    pooled_dim: int | None = None
    tokens_shape: tuple[int, int] | None = None
    empty: dict = field(default_factory=dict, compare=False, hash=False)
    text: dict | None = field(default=None, compare=False, hash=False)

    @classmethod
    def from_manifest(cls, cond: dict | None) -> Conditioning:
        cond = cond or {}
        kind = cond.get("type") or "none"
        if kind == "class":
            names = cond.get("class_names")
            return cls("class", int(cond.get("num_classes") or 0), tuple(names) if names else None)
        if kind == "text":
            text = cond.get("text") or {}
            tokens = text.get("tokens_shape")
            return cls("text", pooled_dim=text.get("pooled_dim"),
                       tokens_shape=tuple(tokens) if tokens else None,
                       empty={k: manifest.decode_array(v) for k, v in (text.get("empty") or {}).items()},
                       text=text)
        return cls(kind)


@dataclass(frozen=True)
class Shard:
    index: int
    name: str
    path: Path
    num_samples: int
    offset: int  # global index of its first sample
    record: dict


class Store:
    url: str | None = None  # where a store read from object storage lives (remote.RemoteStore)
    schema_class = Schema  # what its manifest's fields are (a feature set: FeatureSchema)
    buckets_top = False  # whether it reads a bucketed store's top manifest (buckets.BucketedStore)
    buckets: tuple = ()  # a plain store has no aspect-ratio buckets (buckets.BucketedStore has)

    def __init__(self, root, *, verify: bool = False):
        self.root = Path(root)
        self._load(manifest.load(self.root), verify)

    @classmethod
    def from_manifest(cls, root, m: dict, *, verify: bool = False) -> Store:
        """The store at `root` whose (validated) manifest `m` has already been read."""
        store = cls.__new__(cls)
        store.root = Path(root)
        store._load(m, verify)
        return store

    @classmethod
    def being_written(cls, root, config: dict, records: list[dict]) -> Store:
        """A store whose manifest is not written yet, holding the finished shards `records`
        (their records, as the writer wrote them) made with `config` (the writer's config):
        what a feature set written in the same pass as the latents is checked against."""
        return cls.from_manifest(root, {"backend": config["backend"], "fields": config["fields"],
                                        "num_samples": sum(r["num_samples"] for r in records),
                                        "shards": list(records)})

    def _load(self, m: dict, verify: bool) -> None:
        if manifest.BUCKETS in m and not self.buckets_top:
            raise StoreError(f"{self.location}: a bucketed store (aspect-ratio buckets), which this reader cannot "
                             "open; open it with ditdata.store.open_store (a local directory) and read its buckets")
        self.manifest = m
        self.schema = self.schema_class.from_json(self.manifest["fields"])
        self.backend = get_backend(self.manifest["backend"])
        self.shards: list[Shard] = []
        offset = 0
        for i, rec in enumerate(self.manifest["shards"]):
            self.shards.append(Shard(i, rec["name"], self.root / rec["path"], rec["num_samples"], offset, rec))
            offset += rec["num_samples"]
        self._offsets = [s.offset for s in self.shards]
        self._by_name = {s.name: s for s in self.shards}
        for shard in self.shards:
            self._check_files(shard, digests=verify)
        self._cache: tuple[int, dict] | None = None
        self._conditioning: Conditioning | None = None

    # -- description -----------------------------------------------------------------
    def __len__(self) -> int:
        return self.manifest["num_samples"]

    @property
    def num_samples(self) -> int:
        return self.manifest["num_samples"]

    @property
    def identity(self) -> str:
        return manifest.identity(self.manifest)

    @property
    def location(self) -> str:
        """Where the store is, as a run records it: its absolute path (a remote store: its URL)."""
        return str(self.root.resolve())

    def open_args(self) -> dict:
        """open_store(**these) opens this store again (in another process: a loader's worker)."""
        return {"root": str(self.root)}

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return tuple(self.manifest["latent"]["shape"])

    @property
    def tensor_fields(self) -> list[str]:
        return list(self.schema.tensors)

    @property
    def columns(self) -> list[str]:
        return list(self.schema.columns)

    def nbytes_on_disk(self) -> int:
        return sum(s.record.get("bytes", 0) for s in self.shards)

    @property
    def conditioning(self) -> Conditioning:
        """The store's conditioning, typed (decoded once)."""
        if self._conditioning is None:
            self._conditioning = Conditioning.from_manifest(self.manifest["conditioning"])
        return self._conditioning

    def empty_caption(self) -> dict[str, np.ndarray]:
        """The text embedding of "" (for classifier-free guidance), if the store has text."""
        return {k: v.copy() for k, v in self.conditioning.empty.items()}

    # The models that give the numbers meaning (the autoencoder and text encoder the
    # manifest names) are rebuilt by their own modules, so the contract imports neither:
    # ditdata.autoencoders.kinds.store_autoencoder(store) and ditdata.clip.store_text_encoder(store).

    # -- reading ---------------------------------------------------------------------
    def shard(self, ref) -> Shard:
        if isinstance(ref, Shard):
            return ref
        if isinstance(ref, str):
            if ref not in self._by_name:
                raise KeyError(f"no shard named {ref!r} in {self.root}")
            return self._by_name[ref]
        return self.shards[ref]

    def _fields(self, fields) -> list[str]:
        """`fields` as a list (None: all of the schema's), each one the schema knows (KeyError naming them)."""
        known = [*self.schema.tensors, *self.schema.ragged, *self.schema.columns]
        fields = known if fields is None else list(fields)
        unknown = [f for f in fields if f not in known]
        if unknown:
            raise KeyError(f"{self.root}: no fields {unknown}; it has {known}")
        return fields

    def read(self, shard, fields=None, start: int = 0, stop: int | None = None) -> dict[str, np.ndarray]:
        """Bulk read: the given fields (default all) of samples [start, stop) of one shard.

        Tensors come back as (n, *shape) arrays, columns as (n,) arrays (object for strings),
        a ragged field as (tokens of the n samples, *token shape), sample after sample, with its
        (n,) length field beside it (schema.py).
        """
        s = self.shard(shard)
        fields = self._fields(fields)
        stop = s.num_samples if stop is None else min(stop, s.num_samples)
        start = max(0, min(start, stop))
        try:
            return self.backend.read(s.path, self.schema, fields, start, stop)
        except FileNotFoundError as e:
            raise StoreError(f"{s.path}: missing ({e})") from e

    def locate(self, index: int) -> tuple[Shard, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for a store of {len(self)}")
        i = bisect.bisect_right(self._offsets, index) - 1
        return self.shards[i], index - self.shards[i].offset

    def sample(self, index: int) -> dict:
        """One sample by global index, for inspection (not for training: use read())."""
        shard, local = self.locate(index)
        if not self.backend.random_access:
            # A shard readable only front to back (a tar): keep the last one decoded.
            if self._cache is None or self._cache[0] != shard.index:
                self._cache = (shard.index, self.read(shard))
            data = self._cache[1]
            return {k: ragged_rows(v, data[self.schema.ragged[k].length], [local]) if k in self.schema.ragged
                    else v[local] for k, v in data.items()}
        data = self.read(shard, start=local, stop=local + 1)
        return {k: v if k in self.schema.ragged else v[0] for k, v in data.items()}

    # -- integrity -------------------------------------------------------------------
    def _check_files(self, shard: Shard, digests: bool) -> None:
        if not shard.path.exists():
            raise StoreError(f"{shard.path}: shard {shard.name!r} is missing (listed in {self.root / manifest.MANIFEST})")
        for rel, meta in shard.record["files"].items():
            p = self.root / rel
            if not p.is_file():
                raise StoreError(f"{p}: missing file of shard {shard.name!r}")
            size = p.stat().st_size
            if size != meta["size"]:
                raise StoreError(
                    f"{p}: truncated or altered: {size} bytes, the manifest records {meta['size']}"
                )
            if digests and files.sha256_file(p) != meta["sha256"]:
                raise StoreError(f"{p}: checksum mismatch (sha256 differs from the manifest); the file is corrupt")

    def verify(self, progress=None, warnings: list[str] | None = None) -> list[str]:
        """Recompute every digest, read every shard, check shapes, counts and that every
        float field is finite.

        Returns the faults found (empty when the store is sound), each naming its file.
        warnings: a list to append to what is suspect but not a fault, one line each
        naming its file: a shard's tokens (Schema.token_axes) exactly zero in every
        dimension, as an encoder's NaN stored as zeros would be.
        """
        faults = []
        for shard in self.shards if progress is None else progress(self.shards):
            try:
                self._check_files(shard, digests=True)
                extra = sorted(
                    p.relative_to(self.root).as_posix()
                    for p in files.list_files(shard.path)
                    if p.relative_to(self.root).as_posix() not in shard.record["files"]
                )
                if extra:
                    faults.append(f"{shard.path}: unexpected files {extra}")
                data = self.read(shard)
                for f, spec in self.schema.tensors.items():
                    want = (shard.num_samples, *spec.shape)
                    if data[f].shape != want:
                        faults.append(f"{shard.path}: field {f!r} has shape {list(data[f].shape)}, expected {list(want)}")
                for c in self.schema.columns:
                    if len(data[c]) != shard.num_samples:
                        faults.append(f"{shard.path}: column {c!r} has {len(data[c])} values, expected {shard.num_samples}")
                faults += _ragged_faults(shard, data, self.schema)
                faults += _non_finite(shard, data, self.schema)
                if warnings is not None:
                    warnings += _zero_tokens(shard, data, self.schema)
            except StoreError as e:
                faults.append(str(e))
            except Exception as e:  # an unreadable shard is a fault to report, not a crash
                faults.append(f"{shard.path}: unreadable ({type(e).__name__}: {e})")
        return faults


class StoreView(Store):
    """A store read through another, `base` (features.FeaturedStore, captions.CaptionsView): the
    same shards, manifest and caches, taken over as they are rather than opened again; a view
    changes what it reads (its schema, read()) and keeps where the store is and what verify checks."""

    def __init__(self, base: Store):
        self.__dict__.update(base.__dict__)
        self.base = base
        self.url = base.url

    @property
    def location(self) -> str:
        return self.base.location

    def verify(self, progress=None, warnings: list[str] | None = None) -> list[str]:
        return self.base.verify(progress, warnings)


def _ragged_faults(shard: Shard, data: dict, schema: Schema) -> list[str]:
    """Each ragged field's lengths (>= 1: every caption has at least its end token; their sum
    the field's token count), its values finite and, for an int8 field's scales, > 0."""
    faults = []
    for f, spec in schema.ragged.items():
        lengths = np.asarray(data[spec.length], dtype=np.int64)
        x = data[f]
        if len(lengths) and lengths.min() < 1:
            first = int(np.argmin(lengths))
            faults.append(f"{shard.path}: field {spec.length!r} holds a length < 1 at row {first} "
                          f"(key {data['key'][first]!r}); every caption has at least one token")
        if int(lengths.sum()) != len(x) or x.shape[1:] != spec.shape:
            faults.append(f"{shard.path}: ragged field {f!r} is {list(x.shape)}: {spec.length!r} sums to "
                          f"{int(lengths.sum())} tokens of shape {list(spec.shape)}")
            continue
        v = x.astype(np.float32).reshape(len(x), -1)
        if not np.isfinite(v).all():
            faults.append(f"{shard.path}: ragged field {f!r} holds non-finite values (NaN/inf)")
        if is_scale_field(f) and (v <= 0).any():
            faults.append(f"{shard.path}: ragged field {f!r} holds int8 scales that are not > 0")
    return faults


def _non_finite(shard: Shard, data: dict, schema: Schema) -> list[str]:
    """A fault per float field holding NaN or inf (training would diverge on it), and per
    int8 scale field holding a scale that is not positive (quantize() never writes one)."""
    faults = []
    for f, spec in schema.tensors.items():
        if spec.dtype == "bool" or not len(data[f]):
            continue
        x = data[f].astype(np.float32).reshape(len(data[f]), -1)
        checks = [(~np.isfinite(x).all(axis=1), "non-finite values (NaN/inf)")]
        if f.endswith("_scale"):
            checks.append(((x <= 0).any(axis=1), "int8 scales that are not > 0"))
        for bad, what in checks:
            if bad.any():
                first = int(np.argmax(bad))
                key = data["key"][first] if "key" in data else first
                faults.append(f"{shard.path}: field {f!r} holds {what} in "
                              f"{int(bad.sum())} sample(s), the first at row {first} (key {key!r})")
    return faults


def _zero_tokens(shard: Shard, data: dict, schema: Schema) -> list[str]:
    """A warning per token field (Schema.token_axes) with tokens exactly zero in every
    dimension (an int8 token: its codes, whatever its scale), counted over the shard."""
    warnings = []
    for f, axis in schema.token_axes.items():
        x = data[f]
        if not len(x) or x.shape[1:] != schema.tensors[f].shape:
            continue  # nothing to count, or a shape fault already reported
        zero = (x == 0).all(axis=1 + axis)
        count = int(zero.sum())
        if count:
            first = int(np.argmax(zero.reshape(len(x), -1).any(axis=1)))
            key = data["key"][first] if "key" in data else first
            warnings.append(f"{shard.path}: field {f!r}: {count} of {zero.size} tokens are exactly zero in every "
                            f"dimension, the first in row {first} (key {key!r}) (an encoder that gave NaN stored "
                            "as zeros?)")
    return warnings


class FeatureSet(Store):
    """A feature set of a store, read like a store: read(shard, ["feat", ...], start, stop)
    with the store shard's name (or Shard). `info` is its manifest's encoder and storage."""

    schema_class = FeatureSchema

    def __init__(self, root, *, verify: bool = False):
        self.root = Path(root)
        self._load(manifest.load(self.root, kind=manifest.FEATURES_KIND), verify)

    # what its manifest (name, encoder, storage) and schema (tokens, dims, flip) say, as they say it
    name = property(lambda self: self.manifest["name"])
    encoder = property(lambda self: self.manifest["encoder"])
    storage = property(lambda self: self.manifest["storage"])
    tokens = property(lambda self: self.schema.tokens)
    dims = property(lambda self: self.schema.dims)
    flip = property(lambda self: self.schema.flip)

    @property
    def grid(self) -> tuple[int, int]:
        """The token grid (h, w) of the targets."""
        g = self.encoder.get("grid")
        if g:
            return int(g[0]), int(g[1])
        side = int(round(self.tokens ** 0.5))
        return side, self.tokens // max(side, 1)

    def bytes_per_sample(self) -> int:
        return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in self.schema.tensors.values())

    def pca(self) -> dict | None:
        """{"components": (D, dim), "mean": (dim,), ...} as arrays, or None without PCA."""
        p = self.storage.get("pca")
        if not p:
            return None
        return {**p, "components": manifest.decode_array(p["components"]), "mean": manifest.decode_array(p["mean"])}
