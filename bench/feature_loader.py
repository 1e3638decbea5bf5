"""The streaming loader with REPA targets: samples/s and peak memory against its budget.

    python bench/feature_loader.py [--n 8192] [--shard-size 1024] [--batch-size 256] [--workers 2]
                                   [--dims 768] [--dtype int8] [--budget auto] [--rounds 2] [--dir DIR]

Writes a latent store of N latents 4x32x32 fp16 with labels (zarr, shards of --shard-size) and a
feature set beside it the way `ditdata features` stores ViT-B/14 targets at 224 px: 256 tokens x
--dims, int8 with a per-token float32 scale (197,632 bytes a sample at 768 dims, 48x a latent).
Then times, each in a child process whose whole process tree's PSS (proportional set size: the
workers' shared memory counted once) is sampled every 20 ms:

    latents only       StreamingLoader over the store (the same settings)
    latents + targets  StreamingLoader over open_store(store, features=SET): every batch also
                       carries the targets as stored, batch["feat"] (B, 256, D) int8 and
                       batch["feat_scale"] (B, 256) float32: what is copied to the GPU, where
                       the step dequantizes them (dittrain.data.targets)
    ... + dequantize   the same, and the consumer also makes the float32 targets on the CPU
                       (what a CPU-only run pays; on a GPU that work is the device's)

reporting the steady rate over one epoch after the first batch, the startup, the peak PSS and
the loader's own memory estimate against its budget (the startup line's figures). The goal of
issue 25: >= 2,000 samples/s with ViT-B int8 targets, streaming, 2 workers, on this machine.
The data is freshly written, so reads come from the page cache (the loader's cost, not the disk's).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
from loader_peers import child_rounds, parse_or_run_child  # bench/loader_peers.py
from scratch import parser, scratch_dir, synthetic_store  # bench/scratch.py

SHAPE = (4, 32, 32)  # bench/scratch.py's synthetic store
TOKENS = 256
KINDS = ("latents", "targets", "dequantize")


def write(root: Path, n: int, shard: int, dims: int, dtype: str) -> None:
    """The synthetic store (bench/scratch.py's, at root/store) and its feature set "vitb"."""
    from ditdata.store import FeatureSchema, FeatureWriter, open_store, quantize

    store = open_store(synthetic_store(root / "store", n, shard))
    entry = store.manifest.get("features", {}).get("vitb")
    if entry and (entry["dims"], entry["dtype"]) == (dims, "int8" if dtype == "int8" else "float16"):
        return
    shutil.rmtree(root / "store" / "features", ignore_errors=True)
    rng = np.random.default_rng(1)
    info = {"encoder": {"name": "bench-vitb14", "resolution": 224, "patch": 14, "grid": [16, 16], "tokens": TOKENS,
                        "dim": dims}, "storage": {"dtype": dtype, "dims": dims, "pca": None}}
    fw = FeatureWriter(store, "vitb", schema=FeatureSchema.build(TOKENS, dims, dtype, False), info=info)
    for s in store.shards:
        x = rng.standard_normal((s.num_samples, TOKENS, dims), dtype=np.float32)
        tensors = dict(zip(("feat", "feat_scale"), quantize(x), strict=True)) if dtype == "int8" else \
            {"feat": x.astype(np.float16)}
        fw.write_shard(s.name, tensors, {"key": store.read(s, ["key"])["key"].tolist()})
    fw.finalize()


def child(args) -> None:
    import torch

    from ditdata.store import open_store
    from dittrain.data import StreamingLoader

    torch.set_num_threads(1)
    from dittrain.data import targets

    store = open_store(args.root / "store", features=None if args.child == "latents" else "vitb")
    memory = args.budget  # "auto": as `dittrain run --loader-memory auto`
    t0 = time.perf_counter()
    loader = StreamingLoader(store, batch_size=args.batch_size, workers=args.workers, memory=memory)
    b = next(loader)
    startup = time.perf_counter() - t0
    steps = len(store) // args.batch_size - 1
    t1 = time.perf_counter()
    for _ in range(steps):
        b = next(loader)
        if args.child == "dequantize":
            feat = targets(b)
    rate = steps * args.batch_size / (time.perf_counter() - t1)
    if args.child != "latents":
        assert b["feat"].shape == (args.batch_size, TOKENS, args.dims)
    if args.child == "dequantize":
        assert feat.dtype == torch.float32 and feat.shape == b["feat"].shape
    print("RESULT " + json.dumps({"rate": rate, "startup": startup, "reason": loader.reason,
                                  "estimate": getattr(loader, "memory_estimate", None)}), flush=True)
    loader.close()


def main() -> None:
    ap = parser(__doc__, n=8192, shard_size=1024)
    ap.add_argument("--dims", type=int, default=768, help="target dims (ViT-B/14: 768)")
    ap.add_argument("--dtype", default="int8", choices=["int8", "float16"], help="the targets' storage")
    args = parse_or_run_child(ap, KINDS, child)
    with scratch_dir(args.dir, "ditkit-feature-loader-") as root:
        t = time.perf_counter()
        write(root, args.n, args.shard_size, args.dims, args.dtype)
        per = TOKENS * args.dims * (1 if args.dtype == "int8" else 2) + (TOKENS * 4 if args.dtype == "int8" else 0)
        print(f"{args.n:,} latents {SHAPE} fp16 + {args.dtype} targets {TOKENS}x{args.dims} ({per:,} bytes a sample) "
              f"in {args.n // args.shard_size} shards ({time.perf_counter() - t:.0f} s); batch {args.batch_size}, "
              f"{args.workers} workers, budget {args.budget}, {os.cpu_count()} CPUs", flush=True)
        results = child_rounds(__file__, KINDS, root, args, ["--dims", str(args.dims), "--dtype", args.dtype],
                               lambda r: f"{r['rate']:,.0f} samples/s, peak PSS {r['peak'] / 2**30:.2f} GiB, "
                                         f"startup {r['startup']:.1f} s; {r['reason']}")
        print("\n| stream | samples/s (median) | peak PSS of the tree | startup (s) | the loader's startup line |")
        print("|---|---:|---:|---:|---|")
        for kind, rs in results.items():
            rate = float(np.median([r["rate"] for r in rs]))
            print(f"| {kind} | {rate:,.0f} | {max(r['peak'] for r in rs) / 2**30:.2f} GiB | "
                  f"{np.median([r['startup'] for r in rs]):.1f} | {rs[-1]['reason']} |")


if __name__ == "__main__":
    main()
