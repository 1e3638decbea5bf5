"""`ditdata dedup`'s search at scale: N random unit embeddings (float16 as `ditdata score
--save-embeddings` stores them, searched in float32) with planted near-duplicate pairs
(cosine 0.955..0.995 to their original), through ditdata.scoring.dedup.neighbour_pairs as the command
runs it. Each configuration runs in a fresh child process so its peak resident memory
(ru_maxrss: the embeddings, the index and the results) is its own.

Prints one line per configuration: search kind, index build and search seconds, peak RSS,
pairs found, how many planted pairs were found (recall), and pairs that were not planted
(random 768-d vectors are far below any sensible threshold, so any is a false pair).

    PYTHONPATH=$PWD python bench/dedup.py                       # 1M approximate, 100k exact
    PYTHONPATH=$PWD python bench/dedup.py --n 200000 --exact-n 0 --threads 2
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np


def embeddings(n: int, dim: int, planted: int, seed: int = 0):
    """(n, dim) float16 unit rows, and `planted` (original, copy) row pairs whose copy is
    the original plus noise, at cosine 0.955..0.995."""
    rng = np.random.default_rng(seed)
    emb = np.empty((n, dim), np.float16)
    for s in range(0, n, 65536):
        x = rng.standard_normal((min(65536, n - s), dim), dtype=np.float32)
        emb[s:s + len(x)] = x / np.linalg.norm(x, axis=1, keepdims=True)
    rows = rng.choice(n, 2 * planted, replace=False)
    orig, copy = rows[:planted], rows[planted:]
    cos = rng.uniform(0.955, 0.995, planted).astype(np.float32)
    x = emb[orig].astype(np.float32)
    noise = rng.standard_normal(x.shape, dtype=np.float32)
    noise -= (noise * x).sum(1, keepdims=True) * x  # orthogonal to x
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    y = cos[:, None] * x + np.sqrt(1 - cos[:, None] ** 2) * noise
    emb[copy] = y
    return emb, np.stack([np.minimum(orig, copy), np.maximum(orig, copy)], 1)


def one(args) -> dict:
    from ditdata.scoring.dedup import neighbour_pairs

    t0 = time.perf_counter()
    emb, planted = embeddings(args.n, args.dim, args.planted)
    made = time.perf_counter() - t0
    rss_data = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    exact = {"exact": True, "approximate": False, "auto": None}[args.kind]
    a, b, cos, plan = neighbour_pairs(emb, args.threshold, exact=exact, threads=args.threads)
    found = {(int(i), int(j)) for i, j in zip(a, b, strict=True)}
    want = {(int(i), int(j)) for i, j in planted}
    return {
        "n": args.n, "dim": args.dim, "threshold": args.threshold, "threads": args.threads, "plan": plan,
        "make_seconds": round(made, 1), "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "rss_after_data_gib": round(rss_data, 2), "pairs": len(found), "planted": len(want),
        "planted_found": len(found & want), "not_planted": len(found - want),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1_000_000, help="embeddings of the large (default: automatic) run")
    p.add_argument("--exact-n", type=int, default=100_000, help="embeddings of the exact run (0: none)")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--planted", type=int, default=1000, help="near-duplicate pairs planted")
    p.add_argument("--threshold", type=float, default=0.95)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--one", choices=("auto", "exact", "approximate"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        args.kind = args.one
        print(json.dumps(one(args)))
        return
    runs = [(args.n, "auto")] + ([(args.exact_n, "exact")] if args.exact_n else [])
    for n, kind in runs:
        cmd = [sys.executable, __file__, "--one", kind, "--n", str(n), "--dim", str(args.dim), "--planted",
               str(min(args.planted, n // 4)), "--threshold", str(args.threshold), "--threads", str(args.threads)]
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        plan = r["plan"]
        idx = plan["index"] + (f" cells={plan['cells']} per image={plan['cells_per_image']}" if plan["kind"] == "ivf" else "")
        print(f"n={r['n']:>9} d={r['dim']} {plan['kind']:>5} {idx}: build {plan['build_seconds']:.1f} s, "
              f"search {plan['search_seconds']:.1f} s, peak RSS {r['peak_rss_gib']:.2f} GiB "
              f"(embeddings alone {r['rss_after_data_gib']:.2f}), pairs {r['pairs']}, planted found "
              f"{r['planted_found']}/{r['planted']}, not planted {r['not_planted']}", flush=True)


if __name__ == "__main__":
    main()
