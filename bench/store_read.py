"""Bulk-read throughput of the latent store against the usual layouts.

    python bench/store_read.py [--n 100000] [--shard-size 10000] [--dir /tmp/ditkit-bench]

Writes N latents of 4x32x32 fp16 four ways and reads them all back, timing samples/s:
  zarr store   ditdata.store, zarr backend (uncompressed 1024-sample chunks), shards of 10k,
               read in 1024-sample slices (as the memmap row) and as whole shards
  wds store    ditdata.store, wds backend (tar of 1024-sample .npy blocks), whole shards
  npy/sample   one .npy file per sample, np.load each (the fast-DiT feature layout)
  memmap       one .npy file, np.load(mmap_mode="r"), copied out in slices of 1024
Every method reads from the page cache (the data was just written; RAM holds it), so
the figures compare the formats' own overheads, not the disk. Best of --repeat runs.
A whole-shard read returns a fresh 80 MB array, and first-touch page faults on such a
large allocation cost about as much as the read itself: compare like with like (slices).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from scratch import parser, scratch_dir  # bench/scratch.py

from ditdata.store import Schema, StoreWriter, TensorSpec, open_store

SHAPE = (4, 32, 32)
INFO = {"vae": {"name": "bench"}, "image": {"resolution": 256}, "conditioning": {"type": "class", "num_classes": 1000}}


def make_latents(n: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((n, *SHAPE), dtype=np.float32).astype(np.float16)


def write_store(root: Path, x: np.ndarray, labels: np.ndarray, backend: str, shard: int) -> None:
    schema = Schema(tensors={"latent": TensorSpec(SHAPE, "float16")}, columns={"key": "string", "label": "int64"})
    w = StoreWriter(root, schema=schema, info=INFO, backend=backend)
    for s, start in enumerate(range(0, len(x), shard)):
        sl = slice(start, start + shard)
        w.write_shard(f"{s:05d}", {"latent": x[sl]},
                      {"key": [str(i) for i in range(sl.start, min(sl.stop, len(x)))], "label": labels[sl]})
    w.finalize()


def read_store(root: Path, slice_size: int | None = None) -> int:
    """Every sample with its label, a whole shard per read or slices of slice_size."""
    store = open_store(root)
    n = 0
    for shard in store.shards:
        step = slice_size or shard.num_samples
        for start in range(0, shard.num_samples, step):
            batch = store.read(shard, fields=["latent", "label"], start=start, stop=start + step)
            n += len(batch["latent"])
    return n


def read_npy_per_sample(d: Path, n: int) -> int:
    for i in range(n):
        np.load(d / f"{i}.npy")
    return n


def read_memmap(path: Path, n: int) -> int:
    m = np.load(path, mmap_mode="r")
    for i in range(0, n, 1024):
        np.array(m[i:i + 1024])
    return n


def timed(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        count = fn()
        best = min(best, time.perf_counter() - t)
    return count / best


def main():
    ap = parser(__doc__, n=100_000, shard_size=10_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with scratch_dir(args.dir, "ditkit-bench-") as root:
        x = make_latents(args.n)
        labels = np.random.default_rng(1).integers(0, 1000, args.n)
        print(f"writing {args.n} latents {SHAPE} fp16 ({x.nbytes / 2**20:.0f} MiB) four ways in {root}")
        write_store(root / "zarr", x, labels, "zarr", args.shard_size)
        write_store(root / "wds", x, labels, "wds", args.shard_size)
        (root / "npy").mkdir(exist_ok=True)
        for i in range(args.n):
            np.save(root / "npy" / f"{i}.npy", x[i])
        np.save(root / "all.npy", x)

        rates = {
            "zarr store, 1024-sample slices": timed(lambda: read_store(root / "zarr", 1024), args.repeat),
            "zarr store, whole shards": timed(lambda: read_store(root / "zarr"), args.repeat),
            "wds store, whole shards": timed(lambda: read_store(root / "wds"), args.repeat),
            "npy per sample": timed(lambda: read_npy_per_sample(root / "npy", args.n), args.repeat),
            "memmap": timed(lambda: read_memmap(root / "all.npy", args.n), args.repeat),
        }
        base, mm = rates["npy per sample"], rates["memmap"]
        print("\n| layout | samples/s | vs npy per sample | vs memmap |\n|---|---:|---:|---:|")
        for k, v in rates.items():
            print(f"| {k} | {v:,.0f} | {v / base:.1f}x | {v / mm:.2f}x |")
        z = rates["zarr store, 1024-sample slices"]  # the same read size as the memmap row
        print(f"\nzarr >= 10x npy-per-sample: {'yes' if z >= 10 * base else 'NO'} ({z / base:.1f}x); "
              f"within 3x of memmap: {'yes' if z * 3 >= mm else 'NO'} ({mm / z:.2f}x slower)")


if __name__ == "__main__":
    main()
