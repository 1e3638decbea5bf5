"""Deterministic synthetic latent stores for tests (and the kill-a-writer child process).

One writer, `write_store(root, schema, sizes, ...)`, makes every store; what goes in each
shard comes from a data generator `data(schema, index, n) -> (tensors, columns)`:

- `shard_data` (the default): every field of `schema()`, per-shard seeded, with awkward
  column values (unicode captions, None scores) for the store and loader tests.
- `latent_data(seed, identical=, nan_every=)`: latents ~ N(0, 0.25) with true mirror
  flips and random labels, one RNG across the store (what `make_store` trains on).
- `tiny_data(seed)`: standard-normal fp16 tensors, all-true text masks, labels i % 3 or
  captions (what `tiny_store` samples from).

`make_store` (class-conditioned pixels store for `dittrain run`) and `tiny_store` (one
shard, pixels/TAEF2/any autoencoder, class/text/no conditioning, for `dittrain sample`)
are the two ready-made stores; `bucketed_store` writes a pixels store of aspect-ratio
buckets ({(W, H): n}, class or text conditioning, flips) for the bucketed loader. The pixels autoencoder's latent is the image in [-1, 1],
so its stores decode to PNGs without any weights.

The loader tests' helpers: `new_loader` (a resident or streaming dittrain.data loader over a
store), `take`, `roundtrip` (a state through torch.save), `resumed` (a loader straight through
and stopped-then-resumed), `batch_split` (one process and two split="batch" ranks) and
`each_cuda_loader` (a test over each loader with CUDA batches).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ditdata.store import BFLOAT16, LATENT_SCALES, Schema, StoreWriter, TensorSpec, quantize

CREATED_AT = "2026-01-01T00:00:00+00:00"
SAMPLE_CLASSES = ["astronaut", "chelsea", "coffee"]


def class_conditioning(names) -> dict:
    return {"type": "class", "num_classes": len(names), "class_names": list(names)}


INFO = {
    "vae": {
        "name": "test-vae", "id": "test/vae", "revision": None, "weights_sha256": None,
        "scaling_factor": 0.5, "shift_factor": 0.1, "latent_channels": 4, "downsample": 8,
    },
    "image": {"resolution": 64, "crop": "center"},
    "conditioning": class_conditioning(["cat", "dog", "eel"]),
}


def pixels_info(resolution: int, conditioning: dict | None = None, *, vae: dict | None = None) -> dict:
    """Store info for the pixels autoencoder (or `vae`, an autoencoder's info), class
    conditioning over SAMPLE_CLASSES unless `conditioning` says otherwise."""
    if vae is None:
        from ditdata.autoencoders.kinds import load_autoencoder

        vae = load_autoencoder("pixels").info
    return {"vae": vae, "image": {"resolution": resolution, "crop": "center"},
            "conditioning": conditioning or class_conditioning(SAMPLE_CLASSES)}


# ----------------------------------------------------------------------------- schemas

COLUMNS = {"key": "string", "label": "int64", "caption": "string",
           "clip_score": "float64", "width": "int64", "url": "string"}
LABELLED = {"key": "string", "label": "int64"}
CAPTIONED = {"key": "string", "caption": "string"}


def schema(dtype: str = "float16", *, kind: str = "sample", flip: bool = True, text=True,
           shape=(4, 8, 8), columns: dict = COLUMNS) -> Schema:
    """Tensors latent (or mean/std), their *_flip twins when `flip`, and text fields:
    text=True is a 16-d pooled embedding with 5x16 tokens and mask, a dict
    {"pooled": D, "tokens": (L, W) or None} other sizes, False none. dtype "int8": int8
    latents with their float32 scales (h, w), text fields float16 (as `ditdata encode --dtype int8`)."""
    names = ["latent"] if kind == "sample" else ["mean", "std"]
    if flip:
        names += [f"{n}_flip" for n in names]
    tensors = {n: TensorSpec(shape, dtype) for n in names}
    if dtype == "int8":
        tensors |= {LATENT_SCALES[n]: TensorSpec(shape[1:], "float32") for n in names}
        dtype = "float16"
    if text is True:
        text = {"pooled": 16, "tokens": (5, 16)}
    if text:
        tensors["text_pooled"] = TensorSpec((text["pooled"],), dtype)
        if text.get("tokens"):
            tensors["text_tokens"] = TensorSpec(tuple(text["tokens"]), dtype)
            tensors["text_mask"] = TensorSpec((text["tokens"][0],), "bool")
    return Schema(tensors=tensors, columns=dict(columns))


# ----------------------------------------------------------------------------- shard data

def _cast(x: np.ndarray, dtype: str) -> np.ndarray:
    return x.astype(BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype))


def shard_data(sch: Schema, index: int, n: int) -> tuple[dict, dict]:
    """Values that depend only on (shard index, n), in the schema's dtypes (COLUMNS); int8
    latents quantized per token (their scales beside them)."""
    rng = np.random.default_rng(1000 + index)
    tensors = {}
    for name, spec in sch.tensors.items():
        if spec.dtype == "bool":
            tensors[name] = rng.random((n, *spec.shape)) < 0.5
        elif spec.dtype == "int8":
            x = rng.standard_normal((n, *spec.shape)).astype(np.float32)
            tensors[name], tensors[LATENT_SCALES[name]] = quantize(x, axis=1)
        elif name not in LATENT_SCALES.values():
            tensors[name] = _cast(rng.standard_normal((n, *spec.shape)).astype(np.float32), spec.dtype)
    columns = {
        "key": [f"src/{index}/img.{i}.jpg" for i in range(n)],  # slashes and dots on purpose
        "label": [int(v) for v in rng.integers(0, 3, n)],
        "caption": [("" if i % 4 == 3 else f"ein Bild №{i} – ünïcode") for i in range(n)],
        "clip_score": [None if i == 0 else float(v) for i, v in enumerate(rng.random(n))],
        "width": [int(v) for v in rng.integers(64, 4096, n)],
        "url": [f"http://127.0.0.1/{index}/{i}.jpg" for i in range(n)],
    }
    return tensors, columns


def latent_data(seed: int = 0, *, identical: bool = False, nan_every: int = 0):
    """Generator of training shards (LABELLED columns, latent and optional latent_flip):
    latents ~ N(0, 0.5^2) and labels in 0..2 from one RNG drawn shard after shard, so
    write a fresh store with it. identical: every sample is one template latent with
    label 1; nan_every=k: samples 0, k, 2k, ... of each shard are all NaN."""
    rng = np.random.default_rng(seed)
    template = None

    def data(sch: Schema, index: int, n: int) -> tuple[dict, dict]:
        nonlocal template
        spec = sch.tensors["latent"]
        if template is None:
            template = rng.standard_normal(spec.shape).astype(np.float32) * 0.5
        x = rng.standard_normal((n, *spec.shape)).astype(np.float32) * 0.5
        labels = rng.integers(0, 3, n)
        if identical:
            x[:] = template
            labels[:] = 1
        if nan_every:
            x[::nan_every] = np.nan
        tensors = {"latent": _cast(x, spec.dtype)}
        if "latent_flip" in sch.tensors:
            tensors["latent_flip"] = _cast(x[..., ::-1], spec.dtype)
        return tensors, {"key": [f"{index}-{i}" for i in range(n)], "label": labels.tolist()}

    return data


def _key_columns(sch: Schema, keys: list[str], prefix: str, labels) -> dict:
    """The key column and, for a CAPTIONED schema, captions "PREFIXcaption i", else labels()
    (called only then, so a generator's RNG draws nothing for captions)."""
    if "caption" in sch.columns:
        return {"key": keys, "caption": [f"{prefix}caption {i}" for i in range(len(keys))]}
    return {"key": keys, "label": labels()}


def tiny_data(seed: int = 0):
    """Generator of standard-normal tensors (all-true bool masks) from one RNG, with
    keys k0.. and captions "caption i" (CAPTIONED schemas) or labels i % 3."""
    rng = np.random.default_rng(seed)

    def data(sch: Schema, index: int, n: int) -> tuple[dict, dict]:
        tensors = {}
        for name, spec in sch.tensors.items():
            if spec.dtype == "bool":
                tensors[name] = np.ones((n, *spec.shape), dtype=bool)
            else:
                tensors[name] = _cast(rng.standard_normal((n, *spec.shape)), spec.dtype)
        return tensors, _key_columns(sch, [f"k{i}" for i in range(n)], "", lambda: [i % 3 for i in range(n)])

    return data


# ----------------------------------------------------------------------------- writing

def write_store(root, sch: Schema, sizes, backend: str = "zarr", *, finalize: bool = True,
                chunk_samples: int = 1024, info=INFO, data=None) -> StoreWriter:
    """Shards 00000, 00001, ... of sizes[i] samples from data(sch, i, n) (default
    shard_data, looked up at call time); shards already done are kept (a rerun resumes).
    finalize: write the manifest, with a fixed creation time."""
    data = data or shard_data
    w = StoreWriter(root, schema=sch, info=info, backend=backend, chunk_samples=chunk_samples)
    for i, n in enumerate(sizes):
        name = f"{i:05d}"
        if not w.done(name):
            t, c = data(sch, i, n)
            w.write_shard(name, t, c, source=f"images/{name}.tar")
    if finalize:
        w.finalize([f"{i:05d}" for i in range(len(sizes))], provenance={"input_shards": len(sizes)},
                   created_at=CREATED_AT)
    return w


TRAIN_SHAPE = (3, 8, 8)


def make_store(root: Path, *, n: int = 48, shards: int = 3, identical: bool = False, nan_every: int = 0,
               flip: bool = True, seed: int = 0, shape=TRAIN_SHAPE) -> Path:
    """A class-conditioned (classes a, b, c) pixels store of `shards` shards of
    n // shards latents of `shape` from latent_data, for `dittrain run`."""
    write_store(root, schema(shape=shape, flip=flip, text=False, columns=LABELLED), [n // shards] * shards,
                info=pixels_info(shape[-1], class_conditioning(["a", "b", "c"])),
                data=latent_data(seed, identical=identical, nan_every=nan_every))
    return root


def tiny_store(root: Path, *, shape=(3, 16, 16), vae: dict | None = None, conditioning: dict | None = None,
               text: dict | None = None, n: int = 6, seed: int = 0) -> Path:
    """A one-shard store of n tiny_data latents of `shape`, for `dittrain sample`: the
    pixels autoencoder unless `vae` (an autoencoder's info), class-conditioned over
    SAMPLE_CLASSES unless `conditioning`; text ({"pooled": D, "tokens": (L, W) or None})
    adds text fields and captions instead of labels."""
    sch = schema(shape=shape, flip=False, text=text or False, columns=CAPTIONED if text else LABELLED)
    write_store(root, sch, [n], info=pixels_info(shape[1], conditioning, vae=vae), data=tiny_data(seed))
    return root


# ----------------------------------------------------------------------------- bucketed stores

def text_conditioning(pooled: int = 16, tokens=None) -> dict:
    """A stand-in text encoder's conditioning: the empty caption all zeros."""
    from ditdata.store import encode_array

    empty = {"text_pooled": encode_array(np.zeros(pooled, np.float16))}
    if tokens:
        empty |= {"text_tokens": encode_array(np.zeros(tokens, np.float16)),
                  "text_mask": encode_array(np.ones(tokens[0], bool))}
    return {"type": "text", "text": {"model": "stand-in", "pretrained": None, "encoder": "stand-in",
                                     "pooled_dim": pooled, "tokens_shape": list(tokens) if tokens else None,
                                     "empty": empty}}


def bucket_data(seed: int, name: str):
    """Generator of a bucket's shards: latents ~ N(0, 0.5^2) with true mirror flips, labels in
    0..2 (LABELLED) or captions "NAME caption i" (CAPTIONED), standard-normal text fields and
    all-true masks, keys NAME/SHARD-i (unique across the buckets); one RNG per (seed, bucket)."""
    rng = np.random.default_rng([seed, *map(ord, name)])

    def data(sch: Schema, index: int, n: int) -> tuple[dict, dict]:
        x = rng.standard_normal((n, *sch.tensors["latent"].shape)).astype(np.float32) * 0.5
        tensors = {"latent": x, "latent_flip": x[..., ::-1]}
        for field, spec in sch.tensors.items():
            if spec.dtype == "bool":
                tensors[field] = np.ones((n, *spec.shape), dtype=bool)
            elif field.startswith("text"):
                tensors[field] = rng.standard_normal((n, *spec.shape))
        tensors = {f: _cast(tensors[f], spec.dtype) for f, spec in sch.tensors.items()}
        return tensors, _key_columns(sch, [f"{name}/{index}-{i}" for i in range(n)], f"{name} ",
                                     lambda: rng.integers(0, 3, n).tolist())

    return data


def bucketed_store(root: Path, sizes: dict, *, text: dict | None = None, flip: bool = True, shards: int = 1,
                   area: int | None = None, step: int | None = None, seed: int = 0, backend: str = "zarr") -> Path:
    """A bucketed pixels store (latents (3, H, W)): bucket "WxH" holds n bucket_data samples
    for each (W, H): n of `sizes`, in `shards` shards (as even as can be); class-conditioned
    over a, b, c, or text-conditioned ({"pooled": D, "tokens": (L, W) or None}: text fields,
    captions, text_conditioning). area defaults to the side of the largest bucket's area,
    step to the sides' greatest common divisor."""
    import math

    from ditdata.store import bucket_name, finalize_buckets

    cond = text_conditioning(text["pooled"], text.get("tokens")) if text else class_conditioning(["a", "b", "c"])
    area = area or math.isqrt(max(w * h for w, h in sizes))
    step = step or math.gcd(*(side for size in sizes for side in size))
    info = pixels_info(area, cond)
    info["image"] |= {"crop": "cover", "buckets": {"area": area, "step": step}}  # as encode --buckets records it
    for (w, h), n in sizes.items():
        sch = schema(shape=(3, h, w), flip=flip, text=text or False, columns=CAPTIONED if text else LABELLED)
        counts = [n // shards + (i < n % shards) for i in range(shards)]
        write_store(root / "buckets" / bucket_name((w, h)), sch, counts, backend=backend, info=info,
                    data=bucket_data(seed, bucket_name((w, h))))
    finalize_buckets(root, info, area=area, step=step, created_at=CREATED_AT)
    return root


# ----------------------------------------------------------------------------- feature sets

FEATURE_INFO = {"encoder": {"name": "test-encoder", "id": "test/encoder", "weights_sha256": None,
                            "resolution": 224, "patch": 14, "grid": [4, 4], "tokens": 16, "dim": 8},
                "storage": {"dtype": "int8", "dims": 8, "pca": None}}


def feature_data(store, name: str, tokens: int, dims: int, dtype: str, seed: int = 0) -> tuple[dict, dict]:
    """Features of store shard `name`: a seeded function of each row's key (so every rerun
    and every split of the work gives the same bytes); the flipped twin mirrors the token
    grid left-right when the store has flips."""
    from ditdata.store import quantize

    keys = store.read(name, ["key"])["key"].tolist()
    x = np.stack([np.random.default_rng([seed, *map(ord, k)]).standard_normal((tokens, dims)) for k in keys]) \
        if keys else np.zeros((0, tokens, dims))
    x = x.astype(np.float32)
    side = int(round(tokens ** 0.5))
    variants = {"feat": x}
    if store.schema.flip:
        variants["feat_flip"] = x.reshape(len(keys), side, tokens // side, dims)[:, :, ::-1].reshape(x.shape)
    out = {}
    for field, v in variants.items():
        if dtype == "int8":
            out[field], out[f"{field}_scale"] = quantize(v)
        else:
            out[field] = v.astype(dtype)
    return out, {"key": keys}


def add_features(root: Path, name: str = "feats", *, tokens: int = 16, dims: int = 8, dtype: str = "int8",
                 seed: int = 0, info: dict | None = None) -> Path:
    """Feature set `name` of the local store at root (every shard, feature_data), finalized."""
    from ditdata.store import FeatureSchema, FeatureWriter, open_store

    store = open_store(root)
    info = info or {"encoder": {**FEATURE_INFO["encoder"], "tokens": tokens, "dim": dims,
                                "grid": [int(round(tokens ** 0.5)), tokens // int(round(tokens ** 0.5))]},
                    "storage": {**FEATURE_INFO["storage"], "dtype": dtype, "dims": dims}}
    w = FeatureWriter(store, name, schema=FeatureSchema.build(tokens, dims, dtype, store.schema.flip), info=info)
    for s in store.shards:
        if not w.done(s.name):
            w.write_shard(s.name, *feature_data(store, s.name, tokens, dims, dtype, seed))
    w.finalize(created_at=CREATED_AT)
    return root / "features" / name


# ----------------------------------------------------------------------------- loaders

LOADER_SIZES = [7, 13, 0, 5, 20, 9]  # the loader tests' stores: 54 samples, an empty shard on purpose
LOADER_BATCH = 8  # their batches: 54 = 6 * 8 + 6, the seventh batch straddles epochs 0 and 1
# (kind, workers): the resident loader, the streaming one in-process and with worker processes
LOADERS = [("resident", 0), ("streaming", 0), ("streaming", 2)]


def new_loader(store, kind: str, workers: int = 0, *, seed: int, batch_size: int = LOADER_BATCH,
               with_index: bool = True, shuffle_window: int = 2, **kw):
    """A dittrain.data loader of `kind` ("resident" or "streaming") over `store`, batches with
    their index and flip; the streaming one on `workers` worker processes, shuffling windows of
    `shuffle_window` shards. `kw`: the loader's other keywords."""
    from dittrain.data import ResidentLoader, StreamingLoader

    kw.update(batch_size=batch_size, seed=seed, with_index=with_index)
    if kind == "resident":
        return ResidentLoader(store, **kw)
    return StreamingLoader(store, workers=workers, shuffle_window=shuffle_window, **kw)


def each_cuda_loader(test):
    """`test(..., kind, workers, on_cuda)` for each loader with CUDA batches, the resident one's
    data kept on either side (on_cuda: new_loader()'s keywords for that); skipped without CUDA."""
    import pytest
    import torch

    cases = {"resident-0-cpu": ("resident", 0, {"device": "cuda", "resident_device": "cpu"}),
             "resident-0-cuda": ("resident", 0, {"device": "cuda", "resident_device": "cuda"}),
             "streaming-2": ("streaming", 2, {"device": "cuda"})}
    test = pytest.mark.parametrize("kind,workers,on_cuda", list(cases.values()), ids=list(cases))(test)
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test)


def take(loader, n: int) -> list:
    """The next n batches of `loader`."""
    return [next(loader) for _ in range(n)]


def roundtrip(state):
    """`state` through torch.save and torch.load (weights_only), as a checkpoint carries it."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def resumed(new, total: int, split: int, keep=lambda batch: batch) -> tuple[list, list, dict]:
    """(straight, first + rest, state): `total` batches of one loader new() straight through, and
    the `split` first batches of a second one followed by the rest from a third one that loaded
    the second's state (through roundtrip); each batch as keep(batch), taken while its loader runs."""
    with new() as a:
        straight = [keep(b) for b in take(a, total)]
    with new() as b:
        first = [keep(x) for x in take(b, split)]
        state = roundtrip(b.state_dict())
    with new() as c:
        c.load_state_dict(state)
        rest = [keep(x) for x in take(c, total - split)]
    return straight, first + rest, state


def batch_split(new, n: int, batch_size: int = LOADER_BATCH) -> tuple[list, list[list]]:
    """(whole, [rank 0's, rank 1's]): n batches of new(batch_size=2 * batch_size) in one
    process, and n of each of 2 ranks of new(split="batch") with batches of batch_size."""
    with new(batch_size=2 * batch_size) as one:
        whole = take(one, n)
    halves = []
    for rank in range(2):
        with new(rank=rank, world_size=2, split="batch") as r:
            halves.append(take(r, n))
    return whole, halves
