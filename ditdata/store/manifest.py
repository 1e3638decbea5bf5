"""manifest.json: the description of a store, written last and validated on open.

Layout (format_version 1)::

    format_version   1
    backend          "zarr" | "wds"
    num_samples      total over shards
    latent           {"shape", "dtype", "stored": "sample"|"mean_std", "flip"}, and for int8
                     latents "int8": {"scale": the field of the per-token scales, ...}
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
    skipped_shards   only when input shards were left out (encode --skip-bad-shards):
                     [{"name", "shard", "reason", "samples_lost"}]
    features         only once feature sets were added (ditdata features; features.py):
                     {SET: {"path", "identity", "tokens", "dims", "dtype", "encoder"}}
    buckets          only in the TOP manifest of a bucketed store (ditdata encode --buckets;
                     buckets.py), whose `shards` is [] and whose buckets/WxH/ directories are
                     plain stores of one latent shape each:
                     {"area": AREA, "step": STEP, "cropped_beyond_step": N,
                      "list": [{"name": "WxH", "size": [W, H], "latent_shape": [C, h, w],
                                "num_samples", "path": "buckets/WxH", "identity"}, ...]}
                     num_samples and stats are over every bucket; latent and fields describe
                     the square bucket (else the most populated one). The bucket identities
                     make identity() of the top manifest cover every bucket.

ARRAY is {"dtype", "shape", "base64"}: exact, compact, and still JSON.
The latents in a store are already scaled, z = (x - shift_factor) * scaling_factor,
and those two numbers live here and nowhere else in a store.
"""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import numpy as np

from ditdata.common import files

from .defaults import BACKENDS
from .errors import StoreError
from .schema import LATENT_SCALES, FeatureSchema, Schema, disk_dtype, dtype_name, from_disk, to_disk

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# Supplied by the producer of a store (ditdata encode); the writer adds the rest.
INFO_KEYS = ("vae", "image", "conditioning")
REQUIRED_KEYS = (
    "format_version", "backend", "num_samples", "latent", "fields", *INFO_KEYS,
    "filter", "stats", "shards", "provenance",
)
SHARD_KEYS = ("name", "path", "num_samples", "checksum", "files")
# A feature set's manifest (features.py has its layout).
FEATURES_KIND = "features"
# The section (and directory) of a bucketed store's buckets (buckets.py).
BUCKETS = "buckets"
BUCKET_KEYS = ("name", "size", "latent_shape", "num_samples", "path", "identity")
FEATURE_KEYS = ("format_version", "kind", "name", "backend", "num_samples", "fields", "store", "encoder",
                "storage", "shards", "provenance")


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
    out = {
        "shape": list(spec.shape),
        "dtype": spec.dtype,
        "stored": schema.latent_kind(),
        "flip": schema.flip,
    }
    if spec.dtype == "int8":  # the values are codes: schema.py's quantize() says what they stand for
        out["int8"] = {"scale": LATENT_SCALES[schema.primary], "token": "the C channels at one position",
                       "values": "code * scale[h, w]"}
    return out


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
    so re-finalizing the same shards, at another time, keeps it, and without the feature
    sets added to it later, which have identities of their own: features.py). Runs record
    it to refuse other stores."""
    return "sha256:" + files.json_digest({k: v for k, v in manifest.items() if k not in ("provenance", "features")})


def enclosing_store(path) -> Path | None:
    """The latent store directory that `path` is or lies inside (None if none): where
    nothing but `ditdata encode` may write (a store is never modified by its readers)."""
    p = Path(path).absolute()
    for d in (p, *p.parents):
        if (d / MANIFEST).is_file() or ((d / "config.json").is_file() and (d / "shards").is_dir()
                                        and any((d / "shards").glob("*.json"))):
            return d
    return None


def refuse_inside_store(path, what: str, error: type[Exception] = StoreError) -> None:
    """`error` (StoreError, or the caller's own) when `path`, an output of `what`, is a
    latent store or inside one."""
    store = enclosing_store(path)
    if store is not None:
        raise error(f"{what} {path}: inside the latent store {store}, which only `ditdata encode` "
                    "writes; choose a directory outside it")


def load(root: Path, kind: str = "store") -> dict:
    """The validated manifest of the store (kind "store") or feature set ("features") at root."""
    path = root / MANIFEST
    if not root.is_dir():
        raise StoreError(f"{root}: no such directory; a latent store is a directory written by `ditdata encode`")
    if not path.is_file():
        raise StoreError(
            f"{path}: missing; {root} is not a latent store (or its `ditdata encode` has not "
            "finished: the manifest is written last). Rerun `ditdata encode` to complete it."
        )
    try:
        manifest = files.read_json(path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreError(f"{path}: not valid JSON ({e})") from e
    validate(manifest, path, kind)
    return manifest


def validate(m: dict, path: Path, kind: str = "store") -> None:
    """Refuse (StoreError naming the manifest and the field) anything a reader would trip
    over later: missing keys, wrong types, shard paths that leave the store."""
    if kind == FEATURES_KIND:
        _validate_features(m, path)
        return
    if isinstance(m, dict) and m.get("kind", "store") != "store":
        raise StoreError(f"{path}: a {m.get('kind')!r} manifest, not a latent store's")
    # the header: a version-1 manifest with every key, a known backend and valid fields
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
        schema = Schema.from_json(m["fields"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise StoreError(f"{path}: invalid fields: {e}") from e
    # the description: latent, vae, image, stats, provenance, filter and conditioning have their types
    lat = m["latent"]
    _need(path, isinstance(lat, dict) and lat.get("shape") == list(schema.tensors[schema.primary].shape)
          and lat.get("dtype") == schema.tensors[schema.primary].dtype,
          "latent must be {shape, dtype, ...} matching its fields")
    for key in ("vae", "image", "stats", "provenance"):
        _need(path, isinstance(m[key], dict), f"{key} must be a JSON object")
    _need(path, all(m["vae"].get(k) is None or _number(m["vae"][k]) for k in ("scaling_factor", "shift_factor")),
          "vae.scaling_factor and vae.shift_factor must be numbers")
    _need(path, m["filter"] is None or isinstance(m["filter"], dict), "filter must be null or an object")
    cond = m["conditioning"]
    _need(path, isinstance(cond, dict) and cond.get("type") in ("class", "text", "none"),
          "conditioning must be an object with type class, text or none")
    if cond["type"] == "class":
        n, names = cond.get("num_classes"), cond.get("class_names")
        _need(path, _count(n) and n >= 1, "conditioning.num_classes must be a positive integer")
        _need(path, names is None or (isinstance(names, list) and len(names) == n),
              "conditioning.class_names must list num_classes names")
    if cond["type"] == "text":
        text = cond.get("text")
        _need(path, isinstance(text, dict) and (text.get("pooled_dim") is None or _count(text["pooled_dim"])),
              "conditioning.text must be an object (pooled_dim an integer)")
    check_shards(m, path)
    sets = m.get("features", {})  # the feature sets added to the store (features.py)
    _need(path, isinstance(sets, dict) and all(
        isinstance(e, dict) and _inside(e.get("path")) and isinstance(e.get("identity"), str) for e in sets.values()),
        "features must map names to {path, identity, ...} inside the store")


def _validate_features(m: dict, path) -> None:
    """Refuse (StoreError naming the file and the field) a damaged feature-set manifest."""
    if not isinstance(m, dict) or m.get("kind") != FEATURES_KIND:
        raise StoreError(f"{path}: not a feature-set manifest (kind {FEATURES_KIND!r} expected)")
    if m.get("format_version") != FORMAT_VERSION:
        raise StoreError(f"{path}: format_version {m.get('format_version')!r} is not supported "
                         f"(this ditdata reads version {FORMAT_VERSION}); upgrade ditdata")
    missing = [k for k in FEATURE_KEYS if k not in m]
    if missing:
        raise StoreError(f"{path}: missing keys {missing}")
    try:
        FeatureSchema.from_json(m["fields"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise StoreError(f"{path}: invalid fields: {e}") from e
    for key in ("store", "encoder", "storage", "provenance"):
        if not isinstance(m[key], dict):
            raise StoreError(f"{path}: {key} must be a JSON object; the manifest is damaged")
    check_shards(m, path)


def _need(path, ok: bool, what: str) -> None:
    if not ok:
        raise StoreError(f"{path}: {what}; the manifest is damaged (re-encode the store or restore it)")


def check_shards(m: dict, path) -> None:
    """Every shard record complete and inside the store; the counts add up."""
    _need(path, isinstance(m["shards"], list), "shards must be a list")
    for i, s in enumerate(m["shards"]):
        _need(path, isinstance(s, dict), f"shard #{i} must be an object")
        lost = [k for k in SHARD_KEYS if k not in s]
        if lost:
            raise StoreError(f"{path}: shard #{i} lacks {lost}")
        _need(path, isinstance(s["name"], str) and _count(s["num_samples"]) and isinstance(s["checksum"], str),
              f"shard #{i}: name, num_samples or checksum has the wrong type")
        _need(path, _inside(s["path"]) and isinstance(s["files"], dict)
              and all(_inside(f) and isinstance(v, dict) and _count(v.get("size"))
                      and isinstance(v.get("sha256"), str) for f, v in s["files"].items()),
              f"shard #{i}: path and files must be relative paths inside the store with sizes and digests")
    skipped = m.get("skipped_shards", [])
    if not isinstance(skipped, list) or not all(isinstance(x, dict) and "name" in x for x in skipped):
        raise StoreError(f"{path}: skipped_shards must be a list of shard records")
    _need(path, _count(m["num_samples"]), "num_samples must be a non-negative integer")
    parts, held = "shards", m["shards"]
    if BUCKETS in m:
        _need(path, not m["shards"], "shards must be [] in a bucketed store (its buckets hold them)")
        parts, held = "buckets", _bucket_entries(m[BUCKETS], path)
    total = sum(s["num_samples"] for s in held)
    if total != m["num_samples"]:
        raise StoreError(f"{path}: num_samples is {m['num_samples']} but the {parts} hold {total}")


def _bucket_entries(b, path) -> list[dict]:
    """The checked list of a top manifest's buckets section: names "WxH" matching sizes,
    each once, positive latent shapes, paths inside the store."""
    _need(path, isinstance(b, dict) and all(_count(b.get(k)) and b[k] > 0 for k in ("area", "step"))
          and _count(b.get("cropped_beyond_step")) and isinstance(b.get("list"), list) and b["list"],
          "buckets must be {area, step (positive integers), cropped_beyond_step, list (not empty)}")
    seen = set()
    for i, e in enumerate(b["list"]):
        ok = (isinstance(e, dict) and all(k in e for k in BUCKET_KEYS) and isinstance(e["name"], str)
              and _sizes(e["size"], 2) and e["name"] == f"{e['size'][0]}x{e['size'][1]}"
              and _sizes(e["latent_shape"], 3) and _count(e["num_samples"]) and _inside(e["path"])
              and isinstance(e["identity"], str) and e["name"] not in seen)
        _need(path, ok, f"buckets.list #{i} must be {{name 'WxH' (once), size [W, H], latent_shape [C, h, w], "
                        "num_samples, path, identity}")
        seen.add(e["name"])
    return b["list"]


def _sizes(v, n: int) -> bool:
    return isinstance(v, list) and len(v) == n and all(_count(x) and x > 0 for x in v)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _inside(rel) -> bool:
    """A relative POSIX path that stays inside the store (no absolute path, no '..')."""
    return isinstance(rel, str) and bool(rel) and not rel.startswith("/") and ".." not in rel.split("/")
