"""The streaming loader on RAE-sized latents, int8 against float16: samples/s and peak memory
against its budget.

    python bench/latent_loader.py [--n 8192] [--shard-size 1024] [--batch-size 256] [--workers 2]
                                  [--budget auto] [--rounds 2] [--flip] [--no-huge-pages] [--dir DIR]

Writes the same N latents twice, 768x16x16 (the rae-dinov2-b latent at 256 px), standard-normal
float32 data stored the way `ditdata encode` stores them (zarr, shards of --shard-size, int64
labels, written with StoreWriter):

    int8      --dtype int8: `latent` int8 (768, 16, 16) and `latent_scale` float32 (16, 16), one
              scale per token (a position's 768 channels), ditdata.store.quantize(x, axis=1):
              197,632 bytes a sample
    float16   the default: `latent` float16 (768, 16, 16), 393,216 bytes a sample

(--flip: the flipped twins too, latent_flip and latent_flip_scale, as `ditdata encode --flip`.)
Then times, each in a child process (one torch thread) whose whole process tree's PSS
(proportional set size: the workers' shared memory counted once) is sampled every 20 ms,
StreamingLoader(store, batch_size, workers, memory=--budget) as `dittrain run --loader-memory`
builds it: the first batch (startup: the workers' start and first windows), then one epoch of
batches, each batch["x"] float32 (B, 768, 16, 16) on the CPU (asserted); the int8 codes travel
as stored through the workers' shared-memory slots and are converted to float32 as the main
process copies them out, then scaled in place (on a GPU run the int8 batch is what crosses PCIe
and the device dequantizes it). The children run with dittrain's process settings (importing
dittrain.cli: torch's large CPU tensors on transparent huge pages, THP_MEM_ALLOC_ENABLE=1;
--no-huge-pages sets it to 0 to see what that setting is worth).
It reports the steady rate over that epoch (median over --rounds, interleaved), the peak PSS,
also less the child's own PSS just before it built the loader (the interpreter, torch and the
opened store: not the loader's), the loader's own estimate of its peak and its budget
(loader.memory_plan), the startup, and whether the peak (of the tree; less that) stayed within
the budget. A budget too small for even 1-shard windows is reported as the loader's refusal.
The goal: >= 2,000 samples/s of 768x16x16 int8 latents on 2 workers on this machine, with the
memory inside --loader-memory. The data is freshly written, so reads come from the page cache
(the loader's cost, not the disk's).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
from loader_peers import budget_cells, child_rounds, parse_or_run_child, timed_epoch, tree_pss  # bench/loader_peers.py
from scratch import parser, row, scratch_dir  # bench/scratch.py

SHAPE = (768, 16, 16)  # rae-dinov2-b at 256 px
KINDS = ("int8", "float16")
INFO = {"vae": {"name": "bench-rae-dinov2-b", "latent_channels": SHAPE[0], "downsample": 16},
        "image": {"resolution": 256}, "conditioning": {"type": "class", "num_classes": 1000}}


def sample_bytes(kind: str) -> int:
    """Bytes of one sample's latent as stored (int8: codes and the per-token scales)."""
    n = int(np.prod(SHAPE))
    return n + 4 * SHAPE[1] * SHAPE[2] if kind == "int8" else 2 * n


def write(root: Path, n: int, shard: int, flip: bool) -> None:
    """root/int8 and root/float16: the same latents in both dtypes (reused when complete)."""
    from ditdata.store import Schema, StoreWriter, TensorSpec, quantize

    done, tag = root / ".complete", f"{n} {shard} {flip}"
    if done.is_file() and done.read_text() == tag:
        return
    variants = ["latent", "latent_flip"] if flip else ["latent"]
    writers = {}
    for kind in KINDS:
        shutil.rmtree(root / kind, ignore_errors=True)
        tensors = {v: TensorSpec(SHAPE, kind) for v in variants}
        if kind == "int8":
            tensors |= {f"{v}_scale": TensorSpec(SHAPE[1:], "float32") for v in variants}
        schema = Schema(tensors=tensors, columns={"key": "string", "label": "int64"})
        writers[kind] = StoreWriter(root / kind, schema=schema, info=INFO, backend="zarr", chunk_samples=1024)
    rng = np.random.default_rng(0)
    for s, start in enumerate(range(0, n, shard)):
        m = min(n, start + shard) - start
        x = rng.standard_normal((m, *SHAPE), dtype=np.float32)
        cols = {"key": [str(i) for i in range(start, start + m)], "label": rng.integers(0, 1000, m)}
        xs = {"latent": x} | ({"latent_flip": np.ascontiguousarray(x[..., ::-1])} if flip else {})
        q = {}
        for v, a in xs.items():
            q[v], q[f"{v}_scale"] = quantize(a, axis=1)
        writers["int8"].write_shard(f"{s:05d}", q, cols)
        del q
        writers["float16"].write_shard(f"{s:05d}", {v: a.astype(np.float16) for v, a in xs.items()}, cols)
        del x, xs
    for w in writers.values():
        w.finalize()
    done.write_text(tag)


def disk_bytes(store: Path) -> int:
    """The store's shards on disk: the sum of their "bytes" in the manifest."""
    return sum(s["bytes"] for s in json.loads((store / "manifest.json").read_text())["shards"])


def child(args) -> None:
    if not args.huge_pages:
        os.environ["THP_MEM_ALLOC_ENABLE"] = "0"
    import importlib

    importlib.import_module("dittrain.cli")  # its process settings, as `dittrain run` has them, before torch
    import torch

    from ditdata.store import open_store
    from dittrain.data import LoaderError, StreamingLoader

    torch.set_num_threads(1)
    store = open_store(args.root / args.child)
    B = args.batch_size
    base = tree_pss(os.getpid())  # the interpreter, torch and the store opened: not the loader's
    t0 = time.perf_counter()
    try:
        loader = StreamingLoader(store, batch_size=B, workers=args.workers, memory=args.budget)
    except LoaderError as e:  # the budget cannot hold even 1-shard windows: as `dittrain run` refuses
        print("RESULT " + json.dumps({"refused": str(e), "base": base}), flush=True)
        return

    def check(b):
        assert b["x"].dtype == torch.float32 and b["x"].shape == (B, *SHAPE), (b["x"].dtype, b["x"].shape)

    timed_epoch(loader, len(store), t0, base, check)


def main() -> None:
    ap = parser(__doc__, n=8192, shard_size=1024)
    ap.add_argument("--flip", action="store_true", help="store the flipped twins too (ditdata encode --flip)")
    ap.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                    help="THP_MEM_ALLOC_ENABLE=0 in the children (dittrain's default is 1: dittrain/cli.py)")
    args = parse_or_run_child(ap, KINDS, child)
    with scratch_dir(args.dir, "ditkit-latent-loader-") as root:
        t = time.perf_counter()
        write(root, args.n, args.shard_size, args.flip)
        v = 2 if args.flip else 1
        sizes = ", ".join(f"{k} {v * sample_bytes(k):,} bytes a sample ({disk_bytes(root / k) / args.n:,.0f} on disk)"
                          for k in KINDS)
        print(f"{args.n:,} latents {'x'.join(map(str, SHAPE))}{' with flips' if args.flip else ''} + labels in "
              f"{-(-args.n // args.shard_size)} zarr shards ({time.perf_counter() - t:.0f} s): {sizes}; "
              f"batch {args.batch_size}, {args.workers} workers, budget {args.budget}, {os.cpu_count()} CPUs, "
              f"huge pages {'on' if args.huge_pages else 'off'}",
              flush=True)
        def words(r: dict) -> str:
            if "refused" in r:
                return f"refused: {r['refused']}"
            return (f"{r['rate']:,.0f} samples/s, peak PSS {r['peak'] / 2**30:.2f} GiB ({(r['peak'] - r['base']) / 2**30:.2f} "
                    f"GiB over the child before its loader), startup {r['startup']:.1f} s; {r['reason']}")

        results = child_rounds(__file__, KINDS, root, args, [] if args.huge_pages else ["--no-huge-pages"], words)
        print("\n| latent | samples/s (median) | peak PSS of the tree (over the child before its loader) | "
              "loader's estimate | budget | startup (s) | peak within budget (tree; over the child) |")
        print("|---|---:|---:|---:|---:|---:|---|")
        for kind, rs in results.items():
            name = f"{kind} {SHAPE[0]}x{SHAPE[1]}x{SHAPE[2]}{' +flip' if args.flip else ''}"
            if any("refused" in r for r in rs):
                print(row(name, "refused", "", "", args.budget, "", rs[-1]["refused"]))
                continue
            c = budget_cells(rs)
            print(row(name, c["rate"], c["peak"], c["estimate"], c["budget"],
                      f"{np.median([r['startup'] for r in rs]):.1f}", c["within"]))


if __name__ == "__main__":
    main()
