"""What bench/repa_digits.py and bench/route_digits.py share: the demo's digit store, a
`dittrain run` of the demo's model with extra flags and a checkpoint at each step count, each
checkpoint sampled and judged by 1-NN on the real digits, and the table comparing two variants.

    args, env = parse_args(__doc__, *options)              --steps --seeds --threads --dir, and the bench's own
    store = build_store(root, env)                          pipelines/demo.sh's data: 16 px digits, pixels
    rows = train_and_judge(store, root, name, seed, steps, extra_flags, env)
    print_comparison(rows, steps, ("plain", "--repa"))      rows[i]["variant"] is one of the two
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from latent_norm import digit_scores, sh  # bench/latent_norm.py
from scratch import parser  # bench/scratch.py

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DEMO = ROOT / "pipelines" / "configs" / "demo"


def parse_args(doc: str, *options: tuple):
    """The arguments every digits comparison takes (--steps, --seeds, --threads, --dir) and
    `options` (scratch.add_options rows); and the commands' environment: offline, --threads
    OpenMP threads, no progress lines."""
    ap = parser(doc, ("--steps", "150,300,600", "step counts at which samples are judged"),
                ("--seeds", "0,1,2", "the runs' --seed values"), *options,
                ("--threads", 2, "CPU threads of each command (OMP_NUM_THREADS)"), scratch=True)
    args = ap.parse_args()
    args.steps = [int(s) for s in args.steps.split(",")]
    env = dict(os.environ, HF_HUB_OFFLINE="1", NO_ALBUMENTATIONS_UPDATE="1", OMP_NUM_THREADS=str(args.threads),
               DITKIT_PROGRESS_INTERVAL="600")
    return args, env


def build_store(root: Path, env: dict) -> Path:
    """The demo's data: scikit-learn's 1,797 digits as 16 px PNGs -> `ditdata fetch` ->
    `ditdata encode --vae pixels` (3 x 16 x 16, no flips); kept in root/store between runs."""
    store = root / "store"
    if (store / "manifest.json").is_file():
        return store
    for p in ("digits", "shards", "store"):
        subprocess.run(["rm", "-rf", str(root / p)], check=True)
    sh(sys.executable, ROOT / "pipelines" / "digits.py", root / "digits", 16)
    sh(BIN / "ditdata", "fetch", root / "digits", "--out", root / "shards", "--config", DEMO / "fetch.toml", env=env)
    sh(BIN / "ditdata", "encode", root / "shards", "--out", store, "--config", DEMO / "encode.toml", env=env)
    return store


def train_and_judge(store: Path, root: Path, variant: str, seed: int, steps: list[int], extra: list,
                    env: dict) -> list[dict]:
    """The demo's training (DiT-T/4, flow, batch 32, lr 1e-3, EMA 0.99) with `extra` flags to the
    largest of `steps`, a checkpoint at each; each sampled with the demo's sample settings (EMA,
    CFG 3, 40 Euler steps, seed 0), 10 per digit, and judged (nn_accuracy, nn_distance). The
    rows also carry the training time and the run's metrics.jsonl records."""
    name = f"{variant.strip('-').replace(' ', '_')}_{seed}"
    out = root / f"run_{name}"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    steps = sorted(steps)
    t0 = time.perf_counter()
    sh(BIN / "dittrain", "run", "--config", DEMO / "train.toml", "--latents", store, "--out", out,
       "--max-steps", steps[-1], "--save-every", np.gcd.reduce(steps), "--keep", 1000, "--seed", seed, "-q",
       *extra, env=env, log=root / f"train_{name}.log")
    seconds = time.perf_counter() - t0
    log = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    rows = []
    for k in steps:
        samples = root / f"samples_{name}_{k}"
        sh(BIN / "dittrain", "sample", "--config", DEMO / "sample.toml",
           "--ckpt", out / "checkpoints" / f"step_{k:08d}.pt", "--n-per-class", 10, "--out", samples, env=env)
        rows.append({"seed": seed, "variant": variant, "step": k, "train_s": seconds, "log": log,
                     **digit_scores(samples / "samples")})
    return rows


def print_comparison(rows: list[dict], steps: list[int], variants: tuple[str, str]) -> None:
    """A markdown table: 1-NN accuracy (mean; each seed) and distance per step count, and the
    training times of both variants."""
    a, b = variants
    print(f"| steps | 1-NN accuracy, {a} (mean; per seed) | with {b} | 1-NN distance, {a} | with {b} |")
    print("|---:|---|---|---:|---:|")

    def acc(rs):
        return f"{np.mean([r['nn_accuracy'] for r in rs]):.3f}; " + " ".join(f"{r['nn_accuracy']:.2f}" for r in rs)

    for k in steps:
        p, q = ([r for r in rows if r["step"] == k and r["variant"] == v] for v in variants)
        print(f"| {k} | {acc(p)} | {acc(q)} | {np.mean([r['nn_distance'] for r in p]):.2f} | "
              f"{np.mean([r['nn_distance'] for r in q]):.2f} |")
    t = {v: np.mean([r["train_s"] for r in rows if r["variant"] == v]) for v in variants}
    print(f"\ntrain time to {max(steps)} steps: {a} {t[a]:.0f} s, {b} {t[b]:.0f} s")


def write_summary(root: Path, args, rows: list[dict], **extra) -> None:
    (root / "results").mkdir(exist_ok=True)
    rows = [{k: v for k, v in r.items() if k != "log"} for r in rows]
    (root / "results" / "summary.json").write_text(json.dumps({"args": vars(args), **extra, "rows": rows}, indent=1))
