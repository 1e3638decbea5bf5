"""Bucketed stores: one plain store per aspect-ratio bucket under a top manifest.

    STORE/manifest.json        the top manifest (manifest.py), written LAST by finalize_buckets()
    STORE/buckets/WxH/         a complete plain store holding that bucket's samples only; every
                               latent (flip, mean/std) in it is (C, H/f, W/f)

The top manifest is a plain manifest with no shards (`shards` is []), counts and channel
statistics over every bucket, `latent` and `fields` of the square bucket (else the most
populated one), and a "buckets" section listing each bucket with its size, latent shape,
count, path and identity, so manifest.identity() of the top manifest covers every bucket.

Reading goes through the buckets (BucketedStore.buckets[i].store, a plain Store): the top
store reads no samples. A bucket whose identity is not the one the top manifest recorded
(an encode into the store is running, or was killed before its end) is refused on open.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ditdata.common import files

from . import manifest
from .errors import StoreError
from .reader import Store
from .writer import _write_json, provenance_of

BUCKETS = manifest.BUCKETS  # the directory of the sub-stores, and the top manifest's section
NAME = re.compile(r"^([1-9][0-9]*)x([1-9][0-9]*)$")


def bucket_name(size) -> str:
    """The name of the bucket of `size` (W, H) pixels: "WxH", width first."""
    return f"{int(size[0])}x{int(size[1])}"


def parse_bucket_name(name: str) -> tuple[int, int] | None:
    """(W, H) of a bucket name "WxH", or None when it is not one."""
    m = NAME.match(name) if isinstance(name, str) else None
    return (int(m[1]), int(m[2])) if m else None


@dataclass(frozen=True)
class Bucket:
    """One aspect-ratio bucket of a bucketed store; `store` is its plain Store."""

    name: str
    size: tuple[int, int]  # (W, H) pixels
    latent_shape: tuple[int, int, int]  # (C, H/f, W/f)
    num_samples: int
    store: Store


class BucketedStore(Store):
    """The top of a bucketed store: the manifest, counts, conditioning and schema of the
    whole (Store's description), its `buckets`, and no samples of its own."""

    buckets_top = True

    def _load(self, m: dict, verify: bool) -> None:
        super()._load(m, verify)
        self.buckets = tuple(self._open_bucket(e, verify) for e in sorted(m[BUCKETS]["list"], key=lambda e: e["name"]))

    def _open_bucket(self, entry: dict, verify: bool) -> Bucket:
        root = self.root / entry["path"]
        store = Store(root, verify=verify)
        if store.identity != entry["identity"]:
            raise StoreError(
                f"{root}: bucket {entry['name']} is not the one {self.root / manifest.MANIFEST} lists (its identity "
                "changed: an encode into this store is running or was stopped); rerun `ditdata encode` to finish it")
        return Bucket(entry["name"], tuple(entry["size"]), tuple(entry["latent_shape"]), entry["num_samples"], store)

    @property
    def area(self) -> int:
        return self.manifest[BUCKETS]["area"]

    @property
    def step(self) -> int:
        return self.manifest[BUCKETS]["step"]

    @property
    def cropped_beyond_step(self) -> int:
        return self.manifest[BUCKETS]["cropped_beyond_step"]

    def bucket(self, name: str) -> Bucket:
        for b in self.buckets:
            if b.name == name:
                return b
        raise KeyError(f"no bucket {name!r} in {self.root}; it has {', '.join(b.name for b in self.buckets)}")

    def nbytes_on_disk(self) -> int:
        return sum(b.store.nbytes_on_disk() for b in self.buckets)

    def _refuse(self, *_, **__):
        raise StoreError(f"{self.root} is a bucketed store: read its buckets (store.buckets[i].store), "
                         "each a plain store of one latent shape")

    shard = read = locate = sample = _refuse

    def verify(self, progress=None, warnings: list[str] | None = None) -> list[str]:
        """Every bucket's faults (Store.verify), each naming its file; their warnings
        appended to `warnings`."""
        return [fault for b in self.buckets for fault in b.store.verify(progress, warnings)]


def open_local(root, *, verify: bool = False) -> Store:
    """The store at directory `root`: a plain Store, or a BucketedStore when its manifest
    has buckets."""
    m = manifest.load(Path(root))
    return (BucketedStore if BUCKETS in m else Store).from_manifest(root, m, verify=verify)


def finalize_buckets(root, info: dict, *, area: int, step: int, cropped_beyond_step: int = 0,
                     provenance: dict | None = None, created_at: str | None = None,
                     skipped_shards: list[dict] | None = None) -> dict:
    """Write root/manifest.json over every bucket under root/buckets (each a finished plain
    store made with `info`) and return it: written last, atomically, and kept as it is when
    nothing changed (as StoreWriter.finalize)."""
    root = Path(root)
    entries, stores = [], []
    for store in _bucket_stores(root, info):
        w, h = parse_bucket_name(store.root.name)
        entries.append({"name": store.root.name, "size": [w, h], "latent_shape": list(store.latent_shape),
                        "num_samples": len(store), "path": f"{BUCKETS}/{store.root.name}", "identity": store.identity})
        stores.append(store)
    shown = max(stores, key=lambda s: (_is_square(s.root.name), len(s), [-ord(c) for c in s.root.name]))
    backends = {s.manifest["backend"] for s in stores}
    if len(backends) > 1:
        raise StoreError(f"{root / BUCKETS}: buckets written with different backends {sorted(backends)}; "
                         "re-encode into a new --out directory")
    info = json.loads(json.dumps(info))
    m = {
        "format_version": manifest.FORMAT_VERSION,
        "backend": shown.manifest["backend"],
        "num_samples": sum(e["num_samples"] for e in entries),
        "latent": shown.manifest["latent"],
        "fields": shown.manifest["fields"],
        **{k: info[k] for k in manifest.INFO_KEYS},
        "filter": info.get("filter"),
        "stats": pooled_stats([s.manifest["stats"] for s in stores], shown.schema.primary),
        "shards": [],
        "provenance": provenance_of(provenance, created_at),
        BUCKETS: {"area": int(area), "step": int(step), "list": entries,
                  "cropped_beyond_step": int(cropped_beyond_step)},
    }
    if skipped_shards:
        m["skipped_shards"] = list(skipped_shards)
    path = root / manifest.MANIFEST
    manifest.validate(m, path)
    old = files.read_json_or_none(path)
    if isinstance(old, dict) and manifest.identity(old) == manifest.identity(m):
        return old
    _write_json(path, m, "the top manifest")
    return m


def _is_square(name: str) -> bool:
    w, h = parse_bucket_name(name)
    return w == h


def _bucket_stores(root: Path, info: dict) -> list[Store]:
    """The finished bucket stores under root/buckets, sorted by name, each checked against
    `info` and its name (a refusal names the bucket)."""
    top = root / BUCKETS
    dirs = sorted(p for p in top.iterdir() if p.is_dir() and not files.is_tmp(p)) if top.is_dir() else []
    if not dirs:
        raise StoreError(f"{top}: no buckets to list; write each bucket's store (StoreWriter) first")
    want = json.loads(json.dumps({"filter": info.get("filter"), **{k: info[k] for k in manifest.INFO_KEYS}}))
    factor = (info["vae"] or {}).get("downsample")
    stores = []
    for d in dirs:
        size = parse_bucket_name(d.name)
        if size is None:
            raise StoreError(f"{d}: not a bucket name (WxH in pixels, e.g. 256x256); remove it")
        store = Store(d)
        differ = [k for k, v in want.items() if store.manifest.get(k) != v]
        if differ:
            raise StoreError(f"{d}: bucket {d.name} was made with other settings ({', '.join(differ)} differ) "
                             "than the store; re-encode into a new --out directory")
        if factor and tuple(store.latent_shape[-2:]) != (size[1] // factor, size[0] // factor):
            raise StoreError(f"{d}: bucket {d.name} holds latents of shape {list(store.latent_shape)}, not "
                             f"(C, {size[1] // factor}, {size[0] // factor}) as its size needs")
        stores.append(store)
    return stores


def pooled_stats(stats: list[dict], field: str) -> dict:
    """Per-channel mean and std over several stores, from each store's mean, std and count."""
    stats = [s for s in stats if s["count"]]
    if not stats:
        return {"field": field, "count": 0, "mean": [], "std": []}
    counts = np.array([s["count"] for s in stats], dtype=np.float64)[:, None]
    mean = np.array([s["mean"] for s in stats], dtype=np.float64)
    std = np.array([s["std"] for s in stats], dtype=np.float64)
    total = counts.sum()
    mu = (counts * mean).sum(0) / total
    var = np.maximum((counts * (std**2 + mean**2)).sum(0) / total - mu**2, 0.0)
    return {"field": field, "count": int(total), "mean": mu.tolist(), "std": np.sqrt(var).tolist()}
