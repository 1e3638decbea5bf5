"""Does --repa help on the digits? The demo's pixel store, a feature encoder trained here, 3 seeds.

    python bench/repa_digits.py [--steps 150,300,600] [--seeds 0,1,2] [--depth 2] [--weight 0.5]
                                [--threads 2] [--dir DIR]

1. The data of pipelines/demo.sh: scikit-learn's 1,797 digits as 16 px PNGs -> `ditdata fetch`
   -> `ditdata encode --vae pixels` (3 x 16 x 16: the image itself, no flips).
2. A feature encoder of our own (no DINOv2 here): a small CNN classifier trained on the store's
   images to tell the digits apart; its hidden feature map (a 4 x 4 grid of 32-d tokens, before
   the pooling and the class head) is the representation. It is written as a Python module and
   added to the store with `ditdata features --encoder python:digits_encoder:load` (the path a
   user's own encoder takes), int8.
3. For every seed, the demo's DiT (DiT-T/4: a 4 x 4 token grid, 6 blocks; flow, batch 32, lr 1e-3,
   EMA 0.99) trained by `dittrain run` twice, without and with `--repa SET --repa-depth D
   --repa-weight W` (the projector at its default width), with a checkpoint at each step count
   of --steps; each checkpoint sampled (`dittrain sample`, the EMA weights, 10 per digit, CFG 3,
   40 Euler steps, seed 0) and judged by a 1-nearest-neighbour classifier on the real 8 x 8
   digits (bench/latent_norm.py's digit_scores): the fraction of samples that are the digit they
   were conditioned on, and their mean distance to the nearest real digit.

Prints a table per step count (mean and each seed) and writes DIR/results/summary.json.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from digits_runs import (  # bench/digits_runs.py
    BIN,
    build_store,
    parse_args,
    print_comparison,
    train_and_judge,
    write_summary,
)
from latent_norm import sh  # bench/latent_norm.py
from scratch import scratch_dir  # bench/scratch.py

ENCODER = '''"""The digits' feature encoder of bench/repa_digits.py: a small CNN, images -> (N, 16, 32) tokens."""
import torch
import torch.nn as nn

WEIGHTS = {weights!r}


class DigitFeatures(nn.Module):
    resolution = 16  # input px
    grid = (4, 4)  # its token grid

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.SiLU(), nn.Conv2d(32, 32, 3, 2, 1), nn.SiLU(),
                                  nn.Conv2d(32, 32, 3, 2, 1))  # 16 -> 8 -> 4: a 4 x 4 grid of 32 channels
        self.head = nn.Sequential(nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

    def tokens(self, x):  # (N, 3, 16, 16) in [0, 1] -> (N, 16, 32)
        return self.body(x * 2 - 1).flatten(2).transpose(1, 2)

    def forward(self, x):
        return self.tokens(x)


def load():
    m = DigitFeatures()
    m.load_state_dict(torch.load(WEIGHTS, weights_only=True))
    return m.eval()
'''


def train_encoder(store: Path, root: Path) -> float:
    """Trains the CNN on the store's images (the pixels autoencoder's latent is the image in
    [-1, 1]); writes its weights and module; returns its accuracy on a held-out fifth."""
    import torch

    from ditdata.store import open_store

    s = open_store(store)
    data = [s.read(sh_) for sh_ in s.shards]
    x = torch.from_numpy(np.concatenate([d["latent"] for d in data]).astype(np.float32) / 2 + 0.5)
    y = torch.from_numpy(np.concatenate([d["label"] for d in data]))
    (root / "encoder").mkdir(exist_ok=True)
    weights = root / "encoder" / "digits_encoder.pt"
    source = ENCODER.format(weights=str(weights))
    (root / "encoder" / "digits_encoder.py").write_text(source)
    namespace: dict = {}
    exec(compile(source, "digits_encoder.py", "exec"), namespace)
    torch.manual_seed(0)
    model = namespace["DigitFeatures"]()
    perm = torch.randperm(len(x))
    test, train = perm[: len(x) // 5], perm[len(x) // 5:]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(600):
        idx = train[torch.randint(0, len(train), (64,))]
        loss = torch.nn.functional.cross_entropy(model.head(model.body(x[idx] * 2 - 1)), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        acc = (model.head(model.body(x[test] * 2 - 1)).argmax(1) == y[test]).float().mean().item()
    torch.save(model.state_dict(), weights)
    return acc


def main() -> None:
    a, env = parse_args(__doc__, ("--depth", 2, "--repa-depth (DiT-T has 6 blocks)"), ("--weight", 0.5, "--repa-weight"))
    with scratch_dir(a.dir, "repa_digits_") as root:
        store = build_store(root, env)
        acc = train_encoder(store, root)
        print(f"feature encoder: a 4 x 4 x 32 CNN, held-out digit accuracy {acc:.3f}", file=sys.stderr)
        env["PYTHONPATH"] = f"{root / 'encoder'}{os.pathsep}{env.get('PYTHONPATH', '')}"
        subprocess.run(["rm", "-rf", str(store / "features" / "digits")], check=True)
        sh(BIN / "ditdata", "features", store, "--shards", root / "shards", "--encoder", "python:digits_encoder:load",
           "--out-name", "digits", "--device", "cpu", "-q", env=env)
        rows = []
        repa = ["--repa", "digits", "--repa-depth", a.depth, "--repa-weight", a.weight]
        for seed in map(int, a.seeds.split(",")):
            for variant, extra in (("plain", []), ("--repa", repa)):
                rows += train_and_judge(store, root, variant, seed, a.steps, extra, env)
        for r in rows:
            cos = [rec["repa_cos"] for rec in r["log"] if "repa_cos" in rec]
            r["final_repa_cos"] = cos[-1] if cos else None
        write_summary(root, a, rows, encoder_accuracy=acc)
        print(f"\nDiT-T/4 on the 16 px digits (flow, batch 32, lr 1e-3); --repa digits --repa-depth {a.depth} "
              f"--repa-weight {a.weight}; encoder accuracy {acc:.3f}; seeds {a.seeds}; 100 samples per checkpoint\n")
        print_comparison(rows, a.steps, ("plain", "--repa"))


if __name__ == "__main__":
    main()
