"""`dittrain run --eval-every`: FID of the EMA model logged during training; a failed evaluation
never stops the run; a missing reference or Inception file stops it before the first step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cliutil import dittrain, one_error_line, run_args
from storeutil import make_store
from tiny import random_crops, save_random_inception

pytest.importorskip("torch_fidelity")

EVAL = ("--eval-every", "2", "--eval-n", "6", "--eval-steps", "2", "--max-steps", "4")


@pytest.fixture(scope="module")
def inception_file(tmp_path_factory) -> Path:
    from dittrain.eval import INCEPTION_FILES

    return save_random_inception(tmp_path_factory.mktemp("inception") / INCEPTION_FILES[0])


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ref") / "ref.npz"
    np.savez(path, arr_0=random_crops(8, 8, seed=4))  # the store's images are 8x8 px
    return path


def _records(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def _scalars(out: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def test_fid_of_the_ema_is_logged_to_metrics_and_tensorboard(tmp_path, inception_file, ref):
    from dittrain.checkpoint import load_weights
    from dittrain.eval import TrainingEval
    from dittrain.sample import load_model, open_run_store

    store, out = make_store(tmp_path / "store"), tmp_path / "run"
    r = dittrain(*run_args(store, out, *EVAL, "--eval-ref", ref, "--eval-inception", inception_file))
    assert r.exit_code == 0, r.output
    evals = [rec for rec in _records(out) if "fid" in rec]
    assert [rec["step"] for rec in evals] == [2, 4]
    assert all(np.isfinite(rec["fid"]) and rec["fid"] > 0 and rec["eval_n"] == 6 for rec in evals)
    assert all(rec["eval_steps"] == 2 and rec["eval_cfg"] == 1.5 for rec in evals)
    assert evals[0]["fid"] != evals[1]["fid"]  # the EMA changed between them
    assert len([rec for rec in _records(out) if "loss" in rec]) == 4  # the loss records are all there
    assert [s for s, _ in _scalars(out, "eval/fid")] == [2, 4]
    assert _scalars(out, "eval/fid")[-1][1] == pytest.approx(evals[-1]["fid"], rel=1e-6)
    # The figure is the final EMA's: evaluating the exported EMA weights again gives it.
    weights, config = load_weights(out)
    store_, _ = open_run_store(config)
    again = TrainingEval(ref, n=6, resolution=8, inception=inception_file, steps=2, cfg_scale=1.5, seed=3)
    assert again(load_model(weights, config), config, store_)["fid"] == pytest.approx(evals[-1]["fid"], rel=1e-5)


def test_a_failed_evaluation_does_not_stop_the_run(tmp_path, inception_file, ref, monkeypatch):
    from dittrain import eval as ev

    def broken(self, model, config, store):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(ev.TrainingEval, "__call__", broken)
    store, out = make_store(tmp_path / "store"), tmp_path / "run"
    r = dittrain(*run_args(store, out, *EVAL, "--eval-ref", ref, "--eval-inception", inception_file))
    assert r.exit_code == 0, r.output
    assert "evaluation at step 2 failed (RuntimeError: out of memory (simulated)); training goes on" in r.output
    assert [rec["step"] for rec in _records(out)] == [1, 2, 3, 4]
    assert (out / "ema.safetensors").is_file()


@pytest.mark.parametrize("what", ["no ref", "missing ref", "missing inception"])
def test_eval_settings_are_checked_before_the_first_step(tmp_path, inception_file, ref, what, monkeypatch):
    monkeypatch.delenv("DITKIT_INCEPTION", raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))  # an empty hub cache
    args = {"no ref": ["--eval-inception", inception_file],
            "missing ref": ["--eval-ref", tmp_path / "nope.npz", "--eval-inception", inception_file],
            "missing inception": ["--eval-ref", ref]}[what]
    store, out = make_store(tmp_path / "store"), tmp_path / "run"
    r = dittrain(*run_args(store, out, *EVAL, *args))
    assert r.exit_code == 1
    line = one_error_line(r.output)
    assert {"no ref": "--eval-ref REF", "missing ref": "nope.npz: no such file",
            "missing inception": "weights-inception-2015-12-05-6726825d.pth"}[what] in line, line
    assert not (out / "metrics.jsonl").exists()
