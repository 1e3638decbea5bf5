"""The bucketed loader's speed against the resident loader on a single-shape store.

    python bench/bucket_loader.py [--n 20000] [--batch-size 256] [--passes 5]
                                  [--device cpu|cuda] [--threads T] [--dir DIR]

Writes N latents twice, fp16 with int64 labels, 4 channels (256 px through an f8 autoencoder):
  single-shape store  all N of 4x32x32 (bench/scratch.py's synthetic store)
  bucketed store      the same N in 5 aspect-ratio buckets of about 256^2 px (40% 256x256,
                      15% each of 320x192, 192x320, 352x176, 176x352: latents 4x32x32,
                      4x24x40, 4x40x24, 4x22x44, 4x44x22), ditdata.store.finalize_buckets' layout;
                      its bytes are within 5% of the single-shape store's (both are printed)
and times, in samples/s (and MB/s of fp16 latents), a consumer that only takes batches:
  resident            dittrain.data.ResidentLoader on the single-shape store
  bucketed            dittrain.data.BucketedLoader on the bucketed store (remainder pad)
Both yield float32 x and int64 y on --device. Startup (building the loader: reading the store
into memory) is reported apart from the steady rate, measured over --passes epochs after the
first batch. The two loaders take their batches in turn (one of each, the first of each pair
alternating) and each batch is timed on its own, so both see the same machine (a shared one's
load comes and goes): the rate is the samples over the summed time, and the median batch's
rate beside it. The goal (issue 28): bucketed within 10% of resident.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from scratch import INFO, parse_on_device, parser, scratch_dir, sync, synthetic_store

from ditdata.store import Schema, StoreWriter, TensorSpec, finalize_buckets
from dittrain.data import BucketedLoader, ResidentLoader

# (W, H) px -> share of the samples
BUCKETS = {(256, 256): 0.40, (320, 192): 0.15, (192, 320): 0.15, (352, 176): 0.15, (176, 352): 0.15}
CHANNELS, FACTOR = 4, 8
BUCKET_INFO = {**INFO, "vae": {"name": "bench", "downsample": FACTOR}}


def bucketed_store(root: Path, n: int) -> Path:
    """n random fp16 latents with labels in BUCKETS' shares (the square bucket takes the rest),
    one shard per bucket; reused when a previous call with the same n completed."""
    done = root.with_name(root.name + ".complete")
    if done.is_file() and done.read_text() == str(n):
        return root
    rng = np.random.default_rng(1)
    counts = {size: int(share * n) for size, share in BUCKETS.items()}
    counts[(256, 256)] += n - sum(counts.values())
    for (w, h), m in counts.items():
        shape = (CHANNELS, h // FACTOR, w // FACTOR)
        schema = Schema(tensors={"latent": TensorSpec(shape, "float16")}, columns={"key": "string", "label": "int64"})
        writer = StoreWriter(root / "buckets" / f"{w}x{h}", schema=schema, info=BUCKET_INFO, chunk_samples=1024)
        x = rng.standard_normal((m, *shape), dtype=np.float32).astype(np.float16)
        writer.write_shard("00000", {"latent": x}, {"key": [f"{w}x{h}/{i}" for i in range(m)],
                                                     "label": rng.integers(0, 1000, m)})
        writer.finalize()
    finalize_buckets(root, BUCKET_INFO, area=256, step=2 * FACTOR)
    done.write_text(str(n))
    return root


def interleaved(makers: dict, passes: int, device: torch.device) -> dict[str, tuple[float, float, float, float]]:
    """{name: (samples/s over the summed batch times, the median batch's samples/s, MB/s of the
    latents as stored, startup s)} of the loaders makers[name]() builds, taking batches in turn."""
    loaders, startup = {}, {}
    for name, make in makers.items():
        t0 = time.perf_counter()
        loaders[name] = make()
        next(loaders[name])
        sync(device)
        startup[name] = time.perf_counter() - t0
    steps = max(1, passes * max(ld.samples_per_epoch // ld.batch_size for ld in loaders.values()))
    times = {name: [] for name in loaders}
    nbytes = dict.fromkeys(loaders, 0)
    names = list(loaders)
    for k in range(steps):
        for name in names if k % 2 == 0 else names[::-1]:
            t = time.perf_counter()
            batch = next(loaders[name])
            sync(device)
            times[name].append(time.perf_counter() - t)
            nbytes[name] += batch["x"].numel() * 2  # fp16 as stored
    out = {}
    for name, ld in loaders.items():
        total = sum(times[name])
        out[name] = (steps * ld.batch_size / total, ld.batch_size / float(np.median(times[name])),
                     nbytes[name] / total / 1e6, startup[name])
        ld.close()
    return out


def main():
    ap = parser(__doc__, ("--n", 20000, "latents in each store"), ("--batch-size", 256, "batch size"),
                ("--passes", 5, "epochs timed"), scratch=True)
    args, device = parse_on_device(ap)
    with scratch_dir(args.dir, "bucket_loader_") as root:
        plain = synthetic_store(root / "plain", args.n, args.n)
        bucketed = bucketed_store(root / "bucketed", args.n)
        rates = interleaved({
            "resident": lambda: ResidentLoader(plain, batch_size=args.batch_size, seed=0, device=device),
            "bucketed": lambda: BucketedLoader(bucketed, batch_size=args.batch_size, seed=0, device=device),
        }, args.passes, device)
        probe = BucketedLoader(bucketed, batch_size=args.batch_size)
        plain_bytes = ResidentLoader(plain, batch_size=args.batch_size).nbytes
        print(f"{args.n} latents; single-shape store {plain_bytes / 2**20:.1f} MiB held, bucketed "
              f"{probe.nbytes / 2**20:.1f} MiB held ({probe.describe_buckets()}); batch {args.batch_size}, "
              f"device {device}, threads {torch.get_num_threads()}, {args.passes} passes")
        print("| loader | samples/s | median batch (samples/s) | MB/s | startup (s) |\n|---|---:|---:|---:|---:|")
        for name, (rate, median, mbs, startup) in rates.items():
            print(f"| {name} | {rate:,.0f} | {median:,.0f} | {mbs:,.0f} | {startup:.2f} |")
        print(f"bucketed / resident: {rates['bucketed'][0] / rates['resident'][0]:.1%} of the samples/s, "
              f"{rates['bucketed'][1] / rates['resident'][1]:.1%} of the median batch's (goal: at least 90%)")


if __name__ == "__main__":
    main()
