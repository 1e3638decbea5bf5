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
    from dittrain.config import EvalSection
    from dittrain.inference.open_run import load_model, open_run_store
    from dittrain.inference.weights import load_weights
    from dittrain.train.fid import TrainingEval

    store, out = make_store(tmp_path / "store"), tmp_path / "run"
    r = dittrain(*run_args(store, out, *EVAL, "--eval-ref", ref, "--eval-inception", inception_file))
    assert r.exit_code == 0, r.output
    evals = [rec for rec in _records(out) if "fid" in rec]
    assert [rec["step"] for rec in evals] == [2, 4]
    assert all(np.isfinite(rec["fid"]) and rec["fid"] > 0 and rec["eval_n"] == 6 for rec in evals)
    assert all(rec["eval_steps"] == 2 and rec["eval_cfg"] == 1.5 for rec in evals)
    # how it sampled (a ddpm run: no time shift), as text where the loggers take numbers
    assert all((rec["eval_sampler"], rec["eval_cfg_interval"]) == ("ddpm", "0.0,1.0") and "eval_time_shift" not in rec
               for rec in evals)
    assert evals[0]["fid"] != evals[1]["fid"]  # the EMA changed between them
    assert len([rec for rec in _records(out) if "loss" in rec]) == 4  # the loss records are all there
    assert [s for s, _ in _scalars(out, "eval/fid")] == [2, 4]
    assert _scalars(out, "eval/fid")[-1][1] == pytest.approx(evals[-1]["fid"], rel=1e-6)
    # The figure is the final EMA's: evaluating the exported EMA weights again gives it.
    weights, config = load_weights(out)
    store_, _ = open_run_store(config)
    settings = EvalSection(eval_ref=ref, eval_n=6, eval_inception=inception_file, eval_steps=2, eval_cfg=1.5)
    again = TrainingEval(settings, resolution=8, seed=3)
    assert again(load_model(weights, config), config, store_)["fid"] == pytest.approx(evals[-1]["fid"], rel=1e-5)


def test_a_failed_evaluation_does_not_stop_the_run(tmp_path, inception_file, ref, monkeypatch):
    from dittrain.train import fid as ev

    def broken(self, model, config, store, **ranks):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(ev.TrainingEval, "__call__", broken)
    store, out = make_store(tmp_path / "store"), tmp_path / "run"
    r = dittrain(*run_args(store, out, *EVAL, "--eval-ref", ref, "--eval-inception", inception_file))
    assert r.exit_code == 0, r.output
    assert "evaluation at step 2 failed on rank 0 (RuntimeError: out of memory (simulated)); training goes on" in r.output
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


# the rank scripts' imports, and their evaluator of `run` (7 samples in chunks of 2) once run, ref and
# inception are set
EVAL_IMPORTS = """
import sys, numpy as np, torch, torch.distributed as dist
from dittrain.config import EvalSection
from dittrain.train import fid as ev
from dittrain.inference.weights import load_weights
from dittrain.inference.open_run import load_model, open_run_store
"""
EVALUATOR = """
weights, config = load_weights(run)
store, _ = open_run_store(config)
settings = EvalSection(eval_ref=ref, eval_n=7, eval_inception=inception, eval_steps=2, eval_batch_size=2)
evaluator = ev.TrainingEval(settings, resolution=8, seed=3)
"""

SHARDED = EVAL_IMPORTS + """
run, ref, inception, dump = sys.argv[1:5]
rank, world = 0, 1
if len(sys.argv) > 5:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
def keep(feats, ref_stats, **kw):  # the features that reach the metrics, instead of the metrics
    np.savez(dump, **feats)
    return {"fid": 0.0, "sfid": 0.0, "inception_score": 0.0}
ev.compute_metrics = keep
""" + EVALUATOR + """
out = evaluator(load_model(weights, config), config, store, rank=rank, world=world)
assert (out is None) == (rank != 0), out
if world > 1:  # leave as the trainer does (ditdata.common.dist.leave): a live gloo group at exit can abort
    dist.barrier()
    dist.destroy_process_group()
"""


def test_ranks_share_an_evaluation_and_rank0_gets_what_one_process_computes(tmp_path, inception_file, ref):
    """4 chunks of 2 (the last of 1) over 2 ranks: the features rank 0 gathers are, in order, those
    one process computes."""
    import os
    import subprocess
    import sys

    store, out = make_store(tmp_path / "store"), tmp_path / "run"
    assert dittrain(*run_args(store, out, "--max-steps", "1")).exit_code == 0
    script = tmp_path / "sharded.py"
    script.write_text(SHARDED)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    args = [str(out), str(ref), str(inception_file)]
    one = subprocess.run([sys.executable, script, *args, tmp_path / "one.npz"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          script, *args, tmp_path / "two.npz", "ddp"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
    assert sorted(a.files) == sorted(b.files) == ["logits", "pool", "spatial"]
    for k in a.files:
        assert a[k].shape[0] == 7
        np.testing.assert_array_equal(a[k], b[k])


FAILING_RANK = EVAL_IMPORTS + """
run, ref, inception, failing = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
dist.init_process_group("gloo")
rank = dist.get_rank()
""" + EVALUATOR + """
if rank == failing:  # a rank-local failure (an OOM on one card, say)
    def boom(*a, **k):
        raise MemoryError(f"out of memory on rank {rank}")
    evaluator._my_chunks = boom
try:
    out = evaluator(load_model(weights, config), config, store, rank=rank, world=2)
    print(f"rank {rank}: returned {out if out is None else sorted(out)}")
except Exception as e:
    print(f"rank {rank}: {type(e).__name__}: {e}")
"""


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failure_on_one_rank_leaves_no_rank_waiting(tmp_path, inception_file, ref, failing):
    """One rank's sampling fails: it raises, rank 0 raises naming it (rank 1 returns None as it
    always does), and the ranks' next collective still pairs up, so the run's note is printed and
    training goes on."""
    from cliutil import script_on_two_ranks, torchrun_or_skip

    torchrun_or_skip()
    store, out = make_store(tmp_path / "store"), tmp_path / "run"
    assert dittrain(*run_args(store, out, "--max-steps", "1")).exit_code == 0
    stdout = script_on_two_ranks(FAILING_RANK, out, ref, inception_file, failing, tmp=tmp_path)
    assert f"rank {failing}: MemoryError: out of memory on rank {failing}" in stdout, stdout
    if failing == 1:
        assert "rank 0: RuntimeError: it failed on rank 1 (MemoryError: out of memory on rank 1)" in stdout, stdout
    else:
        assert "rank 1: returned None" in stdout, stdout
    assert "rank 0: next [3.0, 3.0, 3.0]" in stdout and "rank 1: next [3.0, 3.0, 3.0]" in stdout, stdout
