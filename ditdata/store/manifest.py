"""manifest.json: the description of a store, written last and validated on open.

Layout (format_version 1)::

    format_version   1
    backend          "zarr" | "wds"
    num_samples      total over shards
    latent           {"shape", "dtype", "stored": "sample"|"mean_std", "flip"}
    fields           {"tensors": {name: {"shape", "dtype"}}, "columns": {name: type}}
    vae              {"name", "id", "revision", "weights_sha256", "scaling_factor",
                      "shift_factor", "latent_channels", "downsample", ...}
    image            {"resolution", "crop", ...}
    conditioning     {"type": "class"|"text"|"none", "num_classes", "class_names",
                      "text": {"encoder", "pretrained", "pooled_dim", "tokens_shape",
                               "empty": {"text_pooled": ARRAY, ...}}}
    filter           null, or the rule that selected the samples
    stats            {"field", "count", "mean": [C], "std": [C]}  per latent channel
    shards           [{"name", "path", "num_samples", "checksum", "bytes", "files", ...}]
    provenance       {"input_shards", "tools", "created_at"}

ARRAY is {"dtype", "shape", "base64"}: exact, compact, and still JSON.
The latents in a store are already scaled, z = (x - shift_factor) * scaling_factor,
and those two numbers live here and nowhere else in a store.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import numpy as np

from .errors import StoreError
from .schema import Schema, disk_dtype, dtype_name, from_disk, to_disk

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
BACKENDS = ("zarr", "wds")
# Supplied by the producer of a store (ditdata encode); the writer adds the rest.
INFO_KEYS = ("vae", "image", "conditioning")
REQUIRED_KEYS = (
    "format_version", "backend", "num_samples", "latent", "fields", *INFO_KEYS,
    "filter", "stats", "shards", "provenance",
)
SHARD_KEYS = ("name", "path", "num_samples", "checksum", "files")


def encode_array(arr: np.ndarray) -> dict:
    arr = np.ascontiguousarray(arr)
    name = dtype_name(arr)
    raw = to_disk(arr, name).tobytes()
    return {"dtype": name, "shape": list(arr.shape), "base64": base64.b64encode(raw).decode()}


def decode_array(d: dict) -> np.ndarray:
    raw = base64.b64decode(d["base64"])
    arr = np.frombuffer(raw, dtype=disk_dtype(d["dtype"])).reshape(d["shape"])
    return from_disk(arr, d["dtype"]).copy()


def latent_description(schema: Schema) -> dict:
    spec = schema.tensors[schema.primary]
    return {
        "shape": list(spec.shape),
        "dtype": spec.dtype,
        "stored": schema.latent_kind(),
        "flip": schema.flip,
    }


def channel_stats(records: list[dict], field: str) -> dict:
    """Per-channel mean and std over all shards, from the sums each shard recorded."""
    sums = np.zeros(0)
    sumsq = np.zeros(0)
    count = 0
    for r in records:
        s = r["stats"]
        if count == 0:
            sums, sumsq = np.zeros(len(s["sum"])), np.zeros(len(s["sum"]))
        sums += np.asarray(s["sum"], dtype=np.float64)
        sumsq += np.asarray(s["sumsq"], dtype=np.float64)
        count += s["count"]
    if count == 0:
        return {"field": field, "count": 0, "mean": [], "std": []}
    mean = sums / count
    var = np.maximum(sumsq / count - mean**2, 0.0)
    return {"field": field, "count": int(count), "mean": mean.tolist(), "std": np.sqrt(var).tolist()}


def identity(manifest: dict) -> str:
    """A store's identity: the digest of what it holds (its manifest without provenance,
    so re-finalizing the same shards, at another time, keeps it). Runs record it to refuse
    other stores."""
    content = {k: v for k, v in manifest.items() if k != "provenance"}
    canon = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canon.encode()).hexdigest()


def load(root: Path) -> dict:
    path = root / MANIFEST
    if not root.is_dir():
        raise StoreError(f"{root}: no such directory; a latent store is a directory written by `ditdata encode`")
    if not path.is_file():
        raise StoreError(
            f"{path}: missing; {root} is not a latent store (or its `ditdata encode` has not "
            "finished: the manifest is written last). Rerun `ditdata encode` to complete it."
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreError(f"{path}: not valid JSON ({e})") from e
    validate(manifest, path)
    return manifest


def validate(m: dict, path: Path) -> None:
    if not isinstance(m, dict):
        raise StoreError(f"{path}: expected a JSON object")
    if "format_version" not in m:
        raise StoreError(f"{path}: no format_version; not a ditdata manifest")
    if m["format_version"] != FORMAT_VERSION:
        raise StoreError(
            f"{path}: format_version {m['format_version']!r} is not supported by this ditdata "
            f"(it reads version {FORMAT_VERSION}); upgrade ditdata or re-encode the store"
        )
    missing = [k for k in REQUIRED_KEYS if k not in m]
    if missing:
        raise StoreError(f"{path}: missing keys {missing}")
    if m["backend"] not in BACKENDS:
        raise StoreError(f"{path}: unknown backend {m['backend']!r}; expected one of {BACKENDS}")
    try:
        Schema.from_json(m["fields"])
    except (KeyError, TypeError, ValueError) as e:
        raise StoreError(f"{path}: invalid fields: {e}") from e
    for i, s in enumerate(m["shards"]):
        lost = [k for k in SHARD_KEYS if k not in s]
        if lost:
            raise StoreError(f"{path}: shard #{i} lacks {lost}")
    total = sum(s["num_samples"] for s in m["shards"])
    if total != m["num_samples"]:
        raise StoreError(f"{path}: num_samples is {m['num_samples']} but the shards hold {total}")
