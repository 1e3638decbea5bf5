"""The benchmarks' scratch directory: --dir DIR (kept, and its inputs reused when complete)
or a temporary directory removed at the end."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def scratch_dir(path: str | None, prefix: str) -> Iterator[Path]:
    root = Path(path) if path else Path(tempfile.mkdtemp(prefix=prefix))
    root.mkdir(parents=True, exist_ok=True)
    try:
        yield root
    finally:
        if path is None:
            shutil.rmtree(root, ignore_errors=True)


def add_store_args(ap, *, n: int, shard_size: int) -> None:
    """The synthetic latent store's size and where it lives (--n, --shard-size, --dir)."""
    ap.add_argument("--n", type=int, default=n, help="latents in the synthetic store")
    ap.add_argument("--shard-size", type=int, default=shard_size, help="latents per store shard")
    ap.add_argument("--dir", default=None,
                    help="scratch directory, kept and reused when complete (default: a temp dir, removed after)")


SHAPE = (4, 32, 32)  # 256 px through an f8 autoencoder with 4 channels
INFO = {"vae": {"name": "bench"}, "image": {"resolution": 256, "crop": "center"},
        "conditioning": {"type": "class", "num_classes": 1000}}


def synthetic_store(store: Path, n: int, shard: int, *, backend: str = "zarr") -> Path:
    """n random 4x32x32 fp16 latents with labels 0..999 in a latent store at `store`, shards
    of `shard` samples written one at a time (memory: one shard); reused when a previous call
    with the same n, shard and backend completed (STORE.complete records them)."""
    import numpy as np

    from ditdata.store import Schema, StoreWriter, TensorSpec

    done, tag = store.with_name(store.name + ".complete"), f"{n} {shard} {backend}"
    if done.is_file() and done.read_text() == tag:
        return store
    shutil.rmtree(store, ignore_errors=True)
    rng = np.random.default_rng(0)
    schema = Schema(tensors={"latent": TensorSpec(SHAPE, "float16")}, columns={"key": "string", "label": "int64"})
    w = StoreWriter(store, schema=schema, info=INFO, backend=backend, chunk_samples=1024)
    for s, start in enumerate(range(0, n, shard)):
        m = min(n, start + shard) - start
        x = rng.standard_normal((m, *SHAPE), dtype=np.float32).astype(np.float16)
        w.write_shard(f"{s:05d}", {"latent": x},
                      {"key": [str(i) for i in range(start, start + m)], "label": rng.integers(0, 1000, m)})
    w.finalize()
    done.write_text(tag)
    return store
