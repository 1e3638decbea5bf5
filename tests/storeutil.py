"""Deterministic synthetic stores for tests (and the kill-a-writer child process)."""

from __future__ import annotations

import numpy as np

from ditdata.store import BFLOAT16, Schema, StoreWriter, TensorSpec

INFO = {
    "vae": {
        "name": "test-vae", "id": "test/vae", "revision": None, "weights_sha256": None,
        "scaling_factor": 0.5, "shift_factor": 0.1, "latent_channels": 4, "downsample": 8,
    },
    "image": {"resolution": 64, "crop": "center"},
    "conditioning": {"type": "class", "num_classes": 3, "class_names": ["cat", "dog", "eel"]},
}


def schema(dtype: str = "float16", *, kind: str = "sample", flip: bool = True, text: bool = True,
           shape=(4, 8, 8)) -> Schema:
    names = ["latent"] if kind == "sample" else ["mean", "std"]
    if flip:
        names += [f"{n}_flip" for n in names]
    tensors = {n: TensorSpec(shape, dtype) for n in names}
    if text:
        tensors |= {
            "text_pooled": TensorSpec((16,), dtype),
            "text_tokens": TensorSpec((5, 16), dtype),
            "text_mask": TensorSpec((5,), "bool"),
        }
    columns = {"key": "string", "label": "int64", "caption": "string",
               "clip_score": "float64", "width": "int64", "url": "string"}
    return Schema(tensors=tensors, columns=columns)


def shard_data(sch: Schema, index: int, n: int) -> tuple[dict, dict]:
    """Values that depend only on (shard index, n), in the schema's dtypes."""
    rng = np.random.default_rng(1000 + index)
    tensors = {}
    for name, spec in sch.tensors.items():
        if spec.dtype == "bool":
            tensors[name] = rng.random((n, *spec.shape)) < 0.5
        else:
            dt = BFLOAT16 if spec.dtype == "bfloat16" else np.dtype(spec.dtype)
            tensors[name] = rng.standard_normal((n, *spec.shape)).astype(np.float32).astype(dt)
    columns = {
        "key": [f"src/{index}/img.{i}.jpg" for i in range(n)],  # slashes and dots on purpose
        "label": [int(v) for v in rng.integers(0, 3, n)],
        "caption": [("" if i % 4 == 3 else f"ein Bild №{i} – ünïcode") for i in range(n)],
        "clip_score": [None if i == 0 else float(v) for i, v in enumerate(rng.random(n))],
        "width": [int(v) for v in rng.integers(64, 4096, n)],
        "url": [f"http://127.0.0.1/{index}/{i}.jpg" for i in range(n)],
    }
    return tensors, columns


def write_store(root, sch: Schema, sizes, backend: str = "zarr", *, finalize: bool = True,
                chunk_samples: int = 1024, info=INFO) -> StoreWriter:
    w = StoreWriter(root, schema=sch, info=info, backend=backend, chunk_samples=chunk_samples)
    for i, n in enumerate(sizes):
        name = f"{i:05d}"
        if not w.done(name):
            t, c = shard_data(sch, i, n)
            w.write_shard(name, t, c, source=f"images/{name}.tar")
    if finalize:
        w.finalize([f"{i:05d}" for i in range(len(sizes))], provenance={"input_shards": len(sizes)},
                   created_at="2026-01-01T00:00:00+00:00")
    return w
