"""A run recorded by an older dittrain still resumes and samples as it did.

tests/fixtures/recorded_run/ was written by the dittrain of commit 9b8ace7, before the modules
moved into rooms (tests/fixtures/make_recorded_run.py): a tiny class-conditioned run with REPA
(its projector in the checkpoint) and token routing, 4 steps, over a 2-shard pixels store with an
int8 feature set. expected.json holds what that same old code gave when it resumed the run to
step 6 and sampled it: today's code must give the same losses and the same pixels.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from cliutil import dittrain, ok
from PIL import Image

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "recorded_run"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())


@pytest.fixture
def recorded(tmp_path) -> tuple[Path, Path]:
    """(run, store): a copy of the fixture (a resume writes into its run)."""
    shutil.copytree(FIXTURE, tmp_path / "rec")
    return tmp_path / "rec" / "run", tmp_path / "rec" / "store"


def _samples(out: Path) -> list:
    return [np.asarray(Image.open(out.with_suffix("") / f"{i:04d}.png").convert("RGB")).tolist() for i in range(2)]


def _sample(run: Path, store: Path, out: Path) -> list:
    ok(dittrain("sample", "--ckpt", run, "--latents", store, "--class", "1", "--n", "2", "--steps", "3",
                "--seed", "2", "--device", "cpu", "--out", out))
    return _samples(out)


def test_a_recorded_run_samples_as_it_did(recorded, tmp_path):
    run, store = recorded
    assert _sample(run, store, tmp_path / "s.png") == EXPECTED["samples_recorded"]


def test_a_recorded_run_resumes_as_it_did(recorded, tmp_path):
    run, store = recorded
    ok(dittrain("run", "--resume", "--out", run, "--latents", store, "--max-steps", "6", "--device", "cpu"),
       "finished at step 6")
    metrics = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert sorted(metrics) == [1, 2, 3, 4, 5, 6]
    for step, want in EXPECTED["resumed_metrics"].items():
        got = metrics[int(step)]
        for name, value in want.items():
            assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, name)
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["repa"]["repa"] == "feats" and config["train"]["routing"]["route"] == "0.5:1:2"
    assert _sample(run, store, tmp_path / "s.png") == EXPECTED["samples_resumed"]
