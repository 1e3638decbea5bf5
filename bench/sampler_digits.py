"""Few-step samplers on the digits: dpm++ and unipc (diffusers' multistep schedulers) at 20 steps
against DiT's 250 ancestral DDPM steps (a ddpm run) and 50 Euler steps (a flow run).

    python bench/sampler_digits.py [--train-steps 500] [--n 200] [--cfg 1.5] [--threads 2] [--dir DIR]

1. The demo's data (bench/digits_runs.py build_store): scikit-learn's 1,797 digits as 16 px PNGs,
   `ditdata encode --vae pixels` (3 x 16 x 16, no flips).
2. The demo's model and training (pipelines/configs/demo/train.toml: DiT-T/4, batch 32, lr 1e-3,
   EMA 0.99) for --train-steps, twice: `--objective ddpm` (epsilon, learned variance, DiT's linear
   betas) and flow (the demo's own objective). Kept in DIR between runs when --dir is given.
3. Each run's checkpoint sampled with `dittrain sample --npz` (EMA weights, --n images, the
   classes balanced, CFG --cfg, seed 0, the same noise for every sampler of a run) by each
   sampler and step count of SETTINGS.
4. Each set of images judged on the real digits: every sample turned grey and box-filtered to
   8 x 8, 0..16 (bench/latent_norm.py's digit_scores does the same), then
   - FD: the Frechet distance (dittrain.eval.metrics, ADM's formula) between the 64-d pixel
     vectors of the samples and of all 1,797 real digits: a digits FID without Inception;
   - FD to the reference: the same distance to the images of the run's reference sampler (ddpm 250
     steps, Euler 50 steps), the sampler's own error whatever the model's;
   - the share of samples whose nearest real digit (1-NN) is the class asked for.
   The floor row is --n real digits drawn at random against all of them (FD) and against another
   --n of them (FD to the reference): what sampling noise alone gives at this n.

Prints one table (markdown) and writes DIR/results.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from digits_runs import BIN, DEMO, build_store  # bench/digits_runs.py
from latent_norm import sh  # bench/latent_norm.py
from scratch import parser, scratch_dir  # bench/scratch.py

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# objective -> (sampler, steps), the reference first; dpm++ 100: where the ODE solvers converge to
SETTINGS = {
    "ddpm": [("ddpm", 250), ("dpm++", 20), ("unipc", 20), ("ddpm", 20), ("ddim", 20), ("dpm++", 10), ("dpm++", 100)],
    "flow": [("euler", 50), ("dpm++", 20), ("unipc", 20), ("euler", 20), ("dpm++", 10)],
}


def real_digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images.reshape(len(d.images), -1).astype(np.float64), d.target


def as_digits(images: np.ndarray) -> np.ndarray:
    """(N, 16, 16, 3) uint8 -> (N, 64) in 0..16: grey, 8 x 8 box filter (digit_scores' preprocessing)."""
    from PIL import Image

    out = [np.asarray(Image.fromarray(im).convert("L").resize((8, 8), Image.Resampling.BOX), dtype=np.float64)
           for im in images]
    return np.stack(out).reshape(len(images), -1) * 16 / 255


def judge(feats: np.ndarray, labels: np.ndarray | None, real: np.ndarray, real_labels: np.ndarray,
          ref: np.ndarray) -> dict:
    from dittrain.eval.metrics import feature_stats, fid

    row = {"fd": fid(*feature_stats(feats), *feature_stats(real)), "fd_ref": fid(*feature_stats(feats),
                                                                                  *feature_stats(ref))}
    if labels is not None:
        nearest = ((feats[:, None, :] - real[None, :, :]) ** 2).sum(-1).argmin(1)
        row["nn_accuracy"] = float((real_labels[nearest] == labels).mean())
    return row


def train(store: Path, root: Path, objective: str, steps: int, env: dict) -> Path:
    out = root / f"run_{objective}"
    ckpt = out / "checkpoints" / f"step_{steps:08d}.pt"
    if ckpt.is_file():
        return ckpt
    t0 = time.perf_counter()
    sh(BIN / "dittrain", "run", "--config", DEMO / "train.toml", "--latents", store, "--out", out,
       "--objective", objective, "--max-steps", steps, "--save-every", steps, "--seed", 0, "-q", env=env,
       log=root / f"train_{objective}.log")
    print(f"trained {objective} for {steps} steps in {time.perf_counter() - t0:.0f} s", flush=True)
    return ckpt


def main() -> None:
    ap = parser(__doc__, ("--train-steps", 500, "training steps of each run"),
                ("--n", 200, "images per sampler (classes balanced)"),
                ("--cfg", 1.5, "guidance scale of every sampler (DiT's FID protocol: 1.5)"),
                ("--threads", 2, "CPU threads of each command (OMP_NUM_THREADS)"), scratch=True)
    args = ap.parse_args()
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(args.threads), DITKIT_PROGRESS_INTERVAL="600")
    real, real_labels = real_digits()
    rows = []
    with scratch_dir(args.dir, "sampler_digits_") as root:
        store = build_store(root, env)
        pick = np.random.default_rng(0).permutation(len(real))
        floor = judge(real[pick[:args.n]], None, real, real_labels, real[pick[args.n:2 * args.n]])
        rows.append({"objective": "-", "sampler": f"{args.n} real digits", "steps": 0, "seconds": 0.0, **floor})
        for objective, settings in SETTINGS.items():
            ckpt = train(store, root, objective, args.train_steps, env)
            ref = None  # the reference sampler's images: the first of settings
            for sampler, steps in settings:
                npz = root / f"{objective}_{sampler}_{steps}.npz"
                timed = root / f"{npz.name}.seconds"  # the wall time of the command, kept for a rerun
                if not npz.is_file():
                    t0 = time.perf_counter()
                    sh(BIN / "dittrain", "sample", "--ckpt", ckpt, "--npz", npz, "--n", args.n, "--chunk-size",
                       args.n, "--batch-size", args.n, "--cfg", args.cfg, "--sampler", sampler, "--steps", steps,
                       "--seed", 0, "--device", "cpu", env=env, log=root / "sample.log")
                    timed.write_text(f"{time.perf_counter() - t0:.1f}")
                seconds = float(timed.read_text()) if timed.is_file() else float("nan")
                with np.load(npz) as z:
                    feats = as_digits(z["arr_0"])
                    ref = feats if ref is None else ref
                    row = judge(feats, z["arr_1"], real, real_labels, ref)
                rows.append({"objective": objective, "sampler": sampler, "steps": steps, "seconds": seconds, **row})
                print(json.dumps(rows[-1]), flush=True)
        (root / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print("\n| run | sampler | steps (model evaluations) | FD to the real digits | FD to the reference sampler "
          "| 1-NN digit accuracy | sampling s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        acc = f"{r['nn_accuracy']:.3f}" if "nn_accuracy" in r else "-"
        secs = f"{r['seconds']:.1f}" if r["steps"] else "-"
        print(f"| {r['objective']} | {r['sampler']} | {r['steps'] or '-'} | {r['fd']:.2f} | {r['fd_ref']:.2f} | "
              f"{acc} | {secs} |")


if __name__ == "__main__":
    main()
