"""The README's main job: pipelines/demo.sh, reduced (--quick), end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from PIL import Image

from ditdata.store import open_store
from dittrain.inference.weights import load_weights
from dittrain.rundir import latest_checkpoint

REPO = Path(__file__).resolve().parents[1]


def test_demo_quick(tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               OMP_NUM_THREADS="1")
    out = tmp_path / "demo"
    r = subprocess.run(["bash", str(REPO / "pipelines" / "demo.sh"), "--quick", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    for stage in ("digits", "fetch", "encode", "train", "sample"):
        assert f"\n{stage} " in r.stderr  # the timing summary names every stage
    assert f"{out}/samples/grid.png" in r.stderr
    for stage in ("fetch", "encode", "train", "sample"):  # each command reads the demo's settings file
        assert f"--config {REPO}/pipelines/configs/demo/{stage}.toml" in r.stderr

    # digits: the real scikit-learn digits, one folder per class
    assert sorted(p.name for p in (out / "digits").iterdir()) == [str(d) for d in range(10)]
    assert sum(1 for _ in (out / "digits").rglob("*.png")) == 1797
    # fetch: a finished shard folder
    info = json.loads((out / "shards" / "dataset.json").read_text())
    assert info["num_samples"] == 1797 and info["num_classes"] == 10
    # encode: a store that verifies, class-conditioned, pixels at 16 px
    store = open_store(out / "store", verify=True)
    assert len(store) == 1797 and store.latent_shape == (3, 16, 16)
    assert store.manifest["conditioning"]["class_names"] == [str(d) for d in range(10)]
    assert store.verify() == []
    # train: checkpoint and EMA export of the run
    assert latest_checkpoint(out / "run").name == "step_00000004.pt"
    weights, config = load_weights(out / "run")
    assert config["model"]["num_classes"] == 10 and weights
    # sample: a grid with one row per class (x4 enlarged) and every sample under samples/<class>/
    grid = Image.open(out / "samples" / "grid.png")
    assert grid.size == (4 * (2 * 18 + 2), 4 * (10 * 18 + 2))
    for d in range(10):
        singles = sorted((out / "samples" / "samples" / str(d)).glob("*.png"))
        assert len(singles) == 2 and Image.open(singles[0]).size == (16, 16)
