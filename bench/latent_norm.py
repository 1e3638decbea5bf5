"""Does --latent-norm channel help on a scale-1 store? The digits demo encoded with TAEF2.

    python bench/latent_norm.py [--taef2 DIR] [--steps 400] [--model DiT-T/2] [--batch-size 32]
                                [--lr 1e-3] [--seed 0] [--threads 2] [--dir DIR] [--out DIR]

Builds once (reused from --dir when complete) what pipelines/demo.sh builds with --taef2: the
1,797 scikit-learn digits as 64 px PNGs -> `ditdata fetch` -> `ditdata encode --vae TAEF2`
(32 x 8 x 8 latents, stored with scale 1, so their channels are far from unit variance; the
store records their per-channel mean/std). Then trains the same rectified-flow DiT twice with
the REAL trainer, `--latent-norm none` and `--latent-norm channel`, same steps, batch, lr and
seed, and samples each (EMA, `dittrain sample`, 4 per digit, CFG 3, 20 Euler steps, seed 0).

Writes to --out (default DIR/results): grid_none.png, grid_channel.png, losses.png and
summary.json, and prints a table:

  loss         final (mean of the last 5 logged) and mean over the run. NOTE: the two losses
               are in different units (velocity of standardised vs raw latents), so they show
               each run's convergence, not which is better.
  1-NN digit   what a 1-nearest-neighbour classifier on the real 8 x 8 digits says of each
               sample (decoded, greyscale, resized to 8 x 8): the fraction that is the digit it
               was conditioned on, and the mean distance to the nearest real digit (0..16 scale).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from scratch import parser, scratch_dir  # bench/scratch.py

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RES = 64


def sh(*args, env=None, log=None) -> None:
    t0 = time.perf_counter()
    r = subprocess.run([str(a) for a in args], env=env, capture_output=True, text=True)
    if log is not None:
        Path(log).write_text(r.stdout + r.stderr)
    if r.returncode:
        sys.exit(f"latent_norm.py: {' '.join(map(str, args[:3]))} failed:\n{r.stderr[-3000:]}")
    print(f"  {Path(str(args[0])).name} {args[1]}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)


def build_store(root: Path, taef2: str, env: dict) -> Path:
    store, done = root / "store", root / ".store-complete"
    if done.is_file() and done.read_text() == taef2:
        return store
    if not (root / "shards" / "dataset.json").is_file():  # else fetched already: encode resumes its shards
        for p in ("digits", "shards", "store"):
            subprocess.run(["rm", "-rf", str(root / p)], check=True)
        sh(sys.executable, ROOT / "pipelines" / "digits.py", root / "digits", RES)  # demo.sh's digits
        sh(BIN / "ditdata", "fetch", root / "digits", "--out", root / "shards", "--kind", "classes",
           "--samples-per-shard", 512, "-q", env=env)
    sh(BIN / "ditdata", "encode", root / "shards", "--vae", taef2, "--resolution", RES, "--out", store,
       "--device", "cpu", "--workers", 1, "--batch-size", 64, env=env)
    done.write_text(taef2)
    return store


def train_and_sample(store: Path, root: Path, out: Path, norm: str, a, env: dict) -> dict:
    run = root / f"run_{norm}"
    subprocess.run(["rm", "-rf", str(run), str(root / f"samples_{norm}")], check=True)
    t0 = time.perf_counter()
    sh(BIN / "dittrain", "run", "--latents", store, "--out", run, "--model", a.model, "--objective", "flow",
       "--batch-size", a.batch_size, "--lr", a.lr, "--ema", 0.99, "--max-steps", a.steps, "--save-every", a.steps,
       "--log-every", 10, "--sample-every", 0, "--device", "cpu", "--seed", a.seed, "--latent-norm", norm,
       env=env, log=root / f"train_{norm}.log")
    train_s = time.perf_counter() - t0
    samples = root / f"samples_{norm}"
    sh(BIN / "dittrain", "sample", "--ckpt", run, "--classes", "all", "--n-per-class", 4, "--cfg", 3.0,
       "--steps", 20, "--seed", 0, "--device", "cpu", "--grid-scale", 2, "--out", samples, env=env)
    (out / f"grid_{norm}.png").write_bytes((samples / "grid.png").read_bytes())
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    return {"norm": norm, "train_s": round(train_s, 1), "losses": losses,
            "final_loss": float(np.mean([v for _, v in losses[-5:]])),
            "mean_loss": float(np.mean([v for _, v in losses])), **digit_scores(samples / "samples")}


def digit_scores(folder: Path) -> dict:
    """1-NN on the real 8 x 8 digits (0..16) of every sample in folder/<class>/NNNN.png."""
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    ref, labels = d.images.reshape(len(d.images), -1), d.target
    hits, dists = [], []
    for cls in sorted(folder.iterdir()):
        for png in sorted(cls.glob("*.png")):
            img = Image.open(png).convert("L").resize((8, 8), Image.Resampling.BOX)
            x = np.asarray(img, dtype=np.float64).reshape(-1) * 16 / 255
            dist = np.sqrt(((ref - x) ** 2).sum(1))
            hits.append(labels[dist.argmin()] == int(cls.name.split("_")[0]))
            dists.append(dist.min())
    return {"nn_accuracy": float(np.mean(hits)), "nn_distance": float(np.mean(dists)), "samples": len(hits)}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in results:
        s, v = zip(*r["losses"], strict=True)
        ax.plot(s, v, label=f"--latent-norm {r['norm']}")
    ax.set_xlabel("step")
    ax.set_ylabel("flow loss (own units)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--taef2", default=os.environ.get("DITKIT_TAEF2") or str(ROOT.parent / "shared/models/taef2"),
                    help="directory with taef2_encoder.pth and taef2_decoder.pth (default $DITKIT_TAEF2)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--model", default="DiT-T/2")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default=None, help="scratch directory, kept and reused (default: a temp dir)")
    ap.add_argument("--out", default=None, help="where the grids, plot and summary go (default DIR/results)")
    a = ap.parse_args()
    if not (Path(a.taef2) / "taef2_decoder.pth").is_file():
        sys.exit(f"latent_norm.py: no TAEF2 weights in {a.taef2} (pass --taef2 DIR or set DITKIT_TAEF2)")
    env = dict(os.environ, HF_HUB_OFFLINE="1", NO_ALBUMENTATIONS_UPDATE="1", OMP_NUM_THREADS=str(a.threads))
    with scratch_dir(a.dir, "latent_norm_") as root:
        out = Path(a.out) if a.out else root / "results"
        out.mkdir(parents=True, exist_ok=True)
        store = build_store(root, str(Path(a.taef2).resolve()), env)
        stats = json.loads((store / "manifest.json").read_text())["stats"]
        std = np.asarray(stats["std"])
        print(f"store: {stats['count']} values per channel; channel std {std.min():.3f}..{std.max():.3f}, "
              f"|mean| up to {np.abs(stats['mean']).max():.3f}", file=sys.stderr)
        results = [train_and_sample(store, root, out, norm, a, env) for norm in ("none", "channel")]
        plot(results, out / "losses.png")
        (out / "summary.json").write_text(json.dumps({"args": vars(a), "stats": stats, "runs": results}, indent=1))
        print(f"\n{a.model}, flow, {a.steps} steps of {a.batch_size}, lr {a.lr}, seed {a.seed}")
        print("| --latent-norm | final loss | mean loss | 1-NN digit accuracy | 1-NN distance | train s |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in results:
            print(f"| {r['norm']} | {r['final_loss']:.4f} | {r['mean_loss']:.4f} | {r['nn_accuracy']:.2f} "
                  f"({r['samples']}) | {r['nn_distance']:.2f} | {r['train_s']} |")
        print(f"grids, plot, summary: {out}")


if __name__ == "__main__":
    main()
