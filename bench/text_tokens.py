"""Unpadded T5-XXL text tokens: bytes per caption against the padded layout, and the streaming
loader's samples/s with them.

    python bench/text_tokens.py [--n 8192] [--shard-size 1024] [--batch-size 256] [--workers 2]
                                [--budget auto] [--rounds 2] [--sizes-only] [--dir DIR]

Caption lengths (T5 tokens, </s> included) are DRAWN, not measured on real captions (no T5
tokenizer or caption corpus is on this machine): two assumed distributions, clipped to
[2, max tokens]:

    alt-text   LAION-like alt text: lognormal, median 16 tokens, sigma 0.6 (mean ~19, p95 ~43)
    recaption  dense VLM recaptions (PixArt-Sigma-like): normal, mean 75, sd 25 tokens

Part 1, bytes per caption at T5-XXL width 4096 for max tokens 120 and 300: each layout is
written with StoreWriter (zarr) for 256 samples and measured on disk (the shard bytes over the
samples, less the tiny latent's):

    padded     what an open_clip-style store keeps: text_tokens (L_max, 4096) float16 + text_mask (L_max,)
    fp16       unpadded (ditdata encode --text-encoder t5-v1_1-xxl): the caption's tokens float16 + its
               int32 length
    int8       unpadded, --text-dtype int8: int8 codes + a float32 scale per token + the length

Part 2, the streaming loader (as `dittrain run` builds it, --loader-memory --budget) over N
samples of a 4x32x32 float16 latent with alt-text captions at max 120 tokens, fp16 and int8,
each in a child process whose process tree's PSS is sampled (bench/loader_peers.py): one epoch
of batches, each asserted to be (B, L_batch, 4096) float32 with L_batch the batch's longest
caption; the steady rate (median over --rounds), the mean L_batch, the peak PSS against the
loader's estimate and budget. The -host runs time the same loader without its _finish (the
unpadded batch: every caption's tokens one after the other and the mask), which is what stays on
the host when training on a GPU: there the padding and the float32 conversion run on the device. The data is freshly written, so reads come from the page cache.
Goal: >= 2,000 samples/s on 2 workers here, memory inside the budget.
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

WIDTH = 4096  # T5 v1.1 XXL d_model
LATENT = (4, 32, 32)
KINDS = ("float16", "int8")
# the loader children: each storage as the CPU trainer gets it (the (B, L_batch, 4096) float32 batch padded on
# the host), and its host part alone (the batch before _finish, which a GPU run does on the device)
RUNS = (*KINDS, *(f"{k}-host" for k in KINDS))
INFO = {"vae": {"name": "bench", "latent_channels": 4, "downsample": 8}, "image": {"resolution": 256},
        "conditioning": {"type": "text", "text": {"pooled_dim": None, "tokens_shape": [120, WIDTH]}}}


def lengths(dist: str, n: int, max_tokens: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dist == "alt-text":
        x = np.exp(rng.normal(np.log(16), 0.6, n))
    else:
        x = rng.normal(75, 25, n)
    return np.clip(np.rint(x), 2, max_tokens).astype(np.int32)


def _schema(layout: str, max_tokens: int, latent=LATENT):
    from ditdata.store import Schema, TensorSpec
    from ditdata.store.schema import RaggedSpec

    tensors = {"latent": TensorSpec(latent, "float16")}
    ragged = {}
    if layout == "padded":
        tensors |= {"text_tokens": TensorSpec((max_tokens, WIDTH), "float16"),
                    "text_mask": TensorSpec((max_tokens,), "bool")}
    else:
        tensors["text_length"] = TensorSpec((), "int32")
        ragged["text_tokens"] = RaggedSpec((WIDTH,), layout, "text_length")
        if layout == "int8":
            ragged["text_tokens_scale"] = RaggedSpec((), "float32", "text_length")
    return Schema(tensors=tensors, columns={"key": "string"}, ragged=ragged)


def _tensors(layout: str, L: np.ndarray, max_tokens: int, rng, latent=LATENT) -> dict:
    from ditdata.store import quantize

    n = len(L)
    out = {"latent": rng.standard_normal((n, *latent), dtype=np.float32).astype(np.float16)}
    flat = rng.standard_normal((int(L.sum()), WIDTH), dtype=np.float32)
    if layout == "padded":
        from ditdata.store.schema import pad_ragged

        out["text_tokens"], out["text_mask"] = pad_ragged(flat.astype(np.float16), L, max_tokens)
    elif layout == "int8":
        out["text_tokens"], out["text_tokens_scale"] = quantize(flat, axis=1)
        out["text_length"] = L
    else:
        out["text_tokens"], out["text_length"] = flat.astype(np.float16), L
    return out


def disk_bytes(store: Path) -> int:
    return sum(s["bytes"] for s in json.loads((store / "manifest.json").read_text())["shards"])


def sizes(root: Path) -> None:
    """Part 1: bytes per caption on disk, each layout, distribution and max tokens."""
    from ditdata.store import StoreWriter

    n, latent = 256, (4, 2, 2)
    print("\n| captions | max tokens | mean length | padded fp16 + mask | unpadded fp16 | unpadded int8 | "
          "fp16 vs padded | int8 vs padded |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for dist in ("alt-text", "recaption"):
        for max_tokens in (120, 300):
            L = lengths(dist, n, max_tokens)
            per = {}
            for layout in ("padded", "float16", "int8"):
                path = root / f"size-{dist}-{max_tokens}-{layout}"
                info = dict(INFO, conditioning={"type": "text", "text": {"tokens_shape": [max_tokens, WIDTH]}})
                w = StoreWriter(path, schema=_schema(layout, max_tokens, latent), info=info, backend="zarr")
                w.write_shard("00000", _tensors(layout, L, max_tokens, np.random.default_rng(1), latent),
                              {"key": [str(i) for i in range(n)]})
                w.finalize()
                latent_bytes = n * int(np.prod(latent)) * 2
                per[layout] = (disk_bytes(path) - latent_bytes) / n
                shutil.rmtree(path)
            print(f"| {dist} | {max_tokens} | {L.mean():.1f} | {per['padded'] / 1024:,.0f} KiB | "
                  f"{per['float16'] / 1024:,.0f} KiB | {per['int8'] / 1024:,.0f} KiB | "
                  f"{per['padded'] / per['float16']:.1f}x smaller | {per['padded'] / per['int8']:.1f}x smaller |",
                  flush=True)


def write(root: Path, n: int, shard: int) -> None:
    """root/float16 and root/int8: the same alt-text captions (max 120) and latents."""
    from ditdata.store import StoreWriter

    done, tag = root / ".complete", f"{n} {shard}"
    if done.is_file() and done.read_text() == tag:
        return
    L = lengths("alt-text", n, 120)
    for kind in KINDS:
        shutil.rmtree(root / kind, ignore_errors=True)
        w = StoreWriter(root / kind, schema=_schema(kind, 120), info=INFO, backend="zarr", chunk_samples=1024)
        rng = np.random.default_rng(0)
        for s, start in enumerate(range(0, n, shard)):
            m = min(n, start + shard) - start
            t = _tensors(kind, L[start:start + m], 120, rng)
            w.write_shard(f"{s:05d}", t, {"key": [str(i) for i in range(start, start + m)]})
            del t
        w.finalize()
    done.write_text(tag)


def child(args) -> None:
    import importlib

    importlib.import_module("dittrain.cli")  # its process settings, as `dittrain run` has them, before torch
    import torch

    from ditdata.store import open_store
    from dittrain.data import StreamingLoader

    torch.set_num_threads(1)
    kind, host = args.child.split("-")[0], args.child.endswith("-host")
    store = open_store(args.root / kind)
    B = args.batch_size
    base = tree_pss(os.getpid())
    t0 = time.perf_counter()
    loader = StreamingLoader(store, batch_size=B, workers=args.workers, memory=args.budget)
    if host:  # the raw batch: what a GPU run copies to the device before _finish pads it there
        loader._finish = lambda raw, epoch, offset: raw

    def check(b):
        t, mask = b["text_tokens"], b["text_mask"]
        if host:
            assert t.shape == (int(mask.sum()), WIDTH) and t.dtype == getattr(torch, kind), (t.shape, t.dtype)
            return mask.shape[1]
        assert t.dtype == torch.float32 and t.shape[0] == B and t.shape[2] == WIDTH, t.shape
        assert t.shape[1] == int(mask.sum(1).max()), (t.shape, mask.sum(1).max())
        return t.shape[1]

    timed_epoch(loader, len(store), t0, base, check, keep="L_batch")


def main() -> None:
    ap = parser(__doc__, n=8192, shard_size=1024)
    ap.add_argument("--sizes-only", action="store_true", help="part 1 only")
    args = parse_or_run_child(ap, RUNS, child)
    with scratch_dir(args.dir, "ditkit-text-tokens-") as root:
        sizes(root)
        if args.sizes_only:
            return
        t = time.perf_counter()
        write(root, args.n, args.shard_size)
        L = lengths("alt-text", args.n, 120)
        print(f"\n{args.n:,} samples (latent 4x32x32 fp16 + T5-XXL tokens, alt-text captions, mean {L.mean():.1f} "
              f"tokens, max 120) in {-(-args.n // args.shard_size)} zarr shards ({time.perf_counter() - t:.0f} s): "
              + ", ".join(f"{k} {disk_bytes(root / k) / args.n / 1024:,.0f} KiB a sample on disk" for k in KINDS)
              + f"; batch {args.batch_size}, {args.workers} workers, budget {args.budget}, {os.cpu_count()} CPUs",
              flush=True)

        def words(r: dict) -> str:
            return (f"{r['rate']:,.0f} samples/s, mean L_batch {np.mean(r['L_batch']):.1f}, peak PSS "
                    f"{r['peak'] / 2**30:.2f} GiB ({(r['peak'] - r['base']) / 2**30:.2f} over the child before its "
                    f"loader), startup {r['startup']:.1f} s; {r['reason']}")

        results = child_rounds(__file__, RUNS, root, args, [], words)
        print("\n| text tokens (-host: the batch before the padding, what a GPU run keeps on the host) | samples/s (median) | mean L_batch (max 120) | peak PSS of the tree (over the child "
              "before its loader) | loader's estimate | budget | peak within budget (tree; over the child) |")
        print("|---|---:|---:|---:|---:|---:|---|")
        for kind, rs in results.items():
            c = budget_cells(rs)
            print(row(kind, c["rate"], f"{np.mean(rs[-1]['L_batch']):.1f}", c["peak"], c["estimate"], c["budget"],
                      c["within"]))


if __name__ == "__main__":
    main()
