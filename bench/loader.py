"""Throughput of the dittrain loaders against the fast-DiT data pattern, side by side.

    python bench/loader.py [--n 100000] [--shard-size 10000] [--batch-size 256] [--workers 4]
                           [--device cpu|cuda] [--threads T] [--dir DIR]
    python bench/loader.py --peers [--workers 2] [--rounds 2] [--budgets auto,1GiB] ...

--peers: the streaming loader at each memory budget against mosaicml-streaming, litdata and
webdataset (those that import), samples/s and peak PSS: see bench/loader_peers.py.

Writes N latents of 4x32x32 fp16 (with int64 labels) twice:
  a latent store      ditdata.store, zarr backend, shards of --shard-size samples
  fast-DiT layout     features/{i}.npy (1, 4, 32, 32) and labels/{i}.npy (1,), one file each
and times, in samples/s, a consumer that only takes batches:
  fast-DiT baseline   a torch Dataset that np.loads one .npy per sample (and one per label),
                      DataLoader(batch_size, shuffle=True, num_workers, drop_last=True,
                      pin_memory on CUDA); the batch squeezed, moved to the device, as float32
  streaming           dittrain.data.StreamingLoader (workers, shuffle_window 4)
  resident            dittrain.data.ResidentLoader (the store in RAM as fp16)
  resident on GPU     (--device cuda) the store in GPU memory
  ceiling             index_select + float32 on a plain in-memory tensor, no loader: the
                      bare work of a resident batch on this machine's CPU
Every loader yields float32 x and int64 y on --device. Startup (building the loader and
its first batch: the resident load, the first windows, the worker start) is reported apart
from the steady rate, which is measured over whole passes after the first batch. All data
is freshly written, so every reader is served from the page cache (the formats' and
loaders' own costs are compared, not the disk).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from scratch import add_device_args, add_options, open_device, parser, scratch_dir, sync  # bench/scratch.py

from ditdata.store import Schema, StoreWriter, TensorSpec, open_store
from dittrain.data import ResidentLoader, StreamingLoader

SHAPE = (4, 32, 32)
INFO = {"vae": {"name": "bench"}, "image": {"resolution": 256},
        "conditioning": {"type": "class", "num_classes": 1000}}


def write_data(root: Path, n: int, shard: int) -> None:
    done = root / ".complete"
    if done.is_file() and done.read_text() == f"{n} {shard}":
        return
    shutil.rmtree(root / "store", ignore_errors=True)
    shutil.rmtree(root / "features", ignore_errors=True)
    shutil.rmtree(root / "labels", ignore_errors=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, *SHAPE), dtype=np.float32).astype(np.float16)
    y = rng.integers(0, 1000, n)
    schema = Schema(tensors={"latent": TensorSpec(SHAPE, "float16")}, columns={"key": "string", "label": "int64"})
    w = StoreWriter(root / "store", schema=schema, info=INFO, backend="zarr", chunk_samples=1024)
    for s, start in enumerate(range(0, n, shard)):
        sl = slice(start, min(n, start + shard))
        w.write_shard(f"{s:05d}", {"latent": x[sl]},
                      {"key": [str(i) for i in range(sl.start, sl.stop)], "label": y[sl]})
    w.finalize()
    (root / "features").mkdir()
    (root / "labels").mkdir()
    for i in range(n):  # fast-DiT's extract_features.py saves one (1, C, h, w) array per image
        np.save(root / "features" / f"{i}.npy", x[i:i + 1])
        np.save(root / "labels" / f"{i}.npy", y[i:i + 1])
    done.write_text(f"{n} {shard}")


class NpyDataset(torch.utils.data.Dataset):
    """fast-DiT's CustomDataset: one np.load per feature file and per label file."""

    def __init__(self, features_dir: Path, labels_dir: Path):
        self.features_dir, self.labels_dir = features_dir, labels_dir
        self.features_files = sorted(os.listdir(features_dir))
        self.labels_files = sorted(os.listdir(labels_dir))

    def __len__(self):
        return len(self.features_files)

    def __getitem__(self, idx):
        features = np.load(self.features_dir / self.features_files[idx])
        labels = np.load(self.labels_dir / self.labels_files[idx])
        return torch.from_numpy(features), torch.from_numpy(labels)


def run_baseline(root: Path, args, device: torch.device) -> tuple[float, float]:
    t0 = time.perf_counter()
    ds = NpyDataset(root / "features", root / "labels")
    dl = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                                     pin_memory=device.type == "cuda", drop_last=True)
    it = iter(dl)
    x, y = next(it)
    x = x.squeeze(1).to(device, non_blocking=True).float()
    sync(device)
    startup = time.perf_counter() - t0
    t1, count = time.perf_counter(), 0
    for x, y in it:  # the rest of the epoch
        x = x.squeeze(1).to(device, non_blocking=True).float()
        y = y.squeeze(1).to(device, non_blocking=True)
        count += len(x)
    sync(device)
    return count / (time.perf_counter() - t1), startup


def run_loader(make, passes: float, n: int, batch_size: int, device: torch.device):
    t0 = time.perf_counter()
    loader = make()
    b = next(loader)
    sync(device)
    startup = time.perf_counter() - t0
    steps = max(1, int(passes * n) // batch_size)
    t1 = time.perf_counter()
    for _ in range(steps):
        b = next(loader)
    sync(device)
    rate = steps * batch_size / (time.perf_counter() - t1)
    assert b["x"].dtype == torch.float32 and b["x"].device.type == device.type
    loader.close()
    return rate, startup


def run_ceiling(store, passes: float, batch_size: int) -> float:
    """The bare resident work with no loader around it: index_select + float32 on the CPU."""
    x = torch.cat([torch.from_numpy(store.read(s, fields=["latent"])["latent"]) for s in store.shards])
    n = len(x)
    steps = max(1, int(passes * n) // batch_size)
    perm = torch.cat([torch.randperm(n) for _ in range(int(passes) + 2)])
    t = time.perf_counter()
    for k in range(steps):
        x.index_select(0, perm[k * batch_size:(k + 1) * batch_size]).float()
    return steps * batch_size / (time.perf_counter() - t)


def main():
    ap = parser(__doc__, n=100_000, shard_size=10_000)
    add_options(ap, ("--batch-size", 256, "samples per batch"), ("--workers", 4, "streaming loader processes"),
                ("--shuffle-window", 4, "streaming: shards shuffled together"))
    add_device_args(ap)
    ap.add_argument("--passes", type=float, default=2.0, help="passes over the data timed per dittrain loader")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--peers", action="store_true", help="compare with mosaicml-streaming, litdata, webdataset")
    ap.add_argument("--rounds", type=int, default=2, help="--peers: interleaved rounds")
    ap.add_argument("--budgets", default="auto,1GiB", help="--peers: the streaming loader's --loader-memory values")
    args = ap.parse_args()
    if args.peers:
        from loader_peers import compare  # bench/loader_peers.py

        with scratch_dir(args.dir, "ditkit-loader-peers-") as root:
            compare(root, args)
        return
    device = open_device(args)  # --threads: the consumer's
    with scratch_dir(args.dir, "ditkit-loader-bench-") as root:
        t = time.perf_counter()
        write_data(root, args.n, args.shard_size)
        store = open_store(root / "store")
        print(f"{args.n} latents {SHAPE} fp16 in {len(store.shards)} zarr shards and {args.n} .npy pairs "
              f"under {root} ({time.perf_counter() - t:.0f} s); batch {args.batch_size}, device {device}, "
              f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
        B, W = args.batch_size, args.workers
        rows = []
        if not args.skip_baseline:
            rows.append((f"fast-DiT: npy per sample, DataLoader({W} workers)", *run_baseline(root, args, device)))
            print(rows[-1])
        rows.append((f"dittrain streaming ({W} workers, window {args.shuffle_window} shards)",
                     *run_loader(lambda: StreamingLoader(store, batch_size=B, workers=W, device=device,
                                                         shuffle_window=args.shuffle_window),
                                 args.passes, args.n, B, device)))
        print(rows[-1])
        rows.append(("dittrain resident (RAM, fp16)",
                     *run_loader(lambda: ResidentLoader(store, batch_size=B, device=device),
                                 max(args.passes, 5), args.n, B, device)))
        print(rows[-1])
        if device.type == "cuda":
            rows.append(("dittrain resident (GPU memory, fp16)",
                         *run_loader(lambda: ResidentLoader(store, batch_size=B, device=device,
                                                            resident_device=device),
                                     max(args.passes, 50), args.n, B, device)))
            print(rows[-1])
        rows.append(("(bare index_select + float on the CPU, no loader: the ceiling)",
                     run_ceiling(store, max(args.passes, 5), B), 0.0))
        print(rows[-1])
        base = rows[0][1] if not args.skip_baseline else None
        print("\n| loader | samples/s | vs fast-DiT | startup (s) |\n|---|---:|---:|---:|")
        for name, rate, startup in rows:
            rel = f"{rate / base:.1f}x" if base else "-"
            print(f"| {name} | {rate:,.0f} | {rel} | {startup:.2f} |" if startup else
                  f"| {name} | {rate:,.0f} | {rel} | - |")
        if base:
            s = rows[1][1]
            print(f"\nstreaming >= 10x fast-DiT: {'yes' if s >= 10 * base else 'NO'} ({s / base:.1f}x)")
        res = max(r for name, r, _ in rows if name.startswith("dittrain resident"))
        print(f"resident >= 1 M samples/s: {'yes' if res >= 1e6 else 'NO'} ({res:,.0f})")


if __name__ == "__main__":
    main()
