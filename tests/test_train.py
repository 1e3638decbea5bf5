"""dittrain run: exact resume after SIGKILL, SIGTERM, DDP on the CPU, clear errors, NaN steps."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from cliutil import assert_close_checkpoints, losses, one_and_two_ranks, resume_after_sigkill, run_args, spawn
from cliutil import dittrain as cli
from storeutil import make_store

from dittrain.inference.weights import load_weights
from dittrain.rundir import latest_checkpoint, load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def assert_same_state(a: dict, b: dict) -> None:
    for part in ("model", "ema"):
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), (part, k)
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), ("optimizer", i, k)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return make_store(tmp_path_factory.mktemp("store") / "s")


@pytest.mark.parametrize("loader", ["resident", "streaming"])
def test_exact_resume_after_sigkill(store, tmp_path, loader):
    steps, half = 120, 60
    common = ["--loader", loader, "--workers", "2", "--shuffle-window", "2", "--max-steps", steps,
              "--save-every", half, "--lr", "1e-3", "--ema", "0.9"]
    resume_after_sigkill(store, tmp_path, common, steps=steps, half=half)
    assert_same_state(load_checkpoint(latest_checkpoint(tmp_path / "straight")),
                      load_checkpoint(latest_checkpoint(tmp_path / "killed")))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_saves_and_exits_75_then_resumes_exactly(store, tmp_path, sig):
    """SIGTERM and SIGUSR1 (Slurm's --signal=USR1@120): checkpoint, the resume command, status
    75 (not 0: a requeue script must tell a stop from the end); the printed command continues
    the run exactly (the same losses as a run that was never stopped)."""
    from dittrain.train.loop import STOPPED_STATUS

    common = ["--max-steps", 12, "--save-every", 100000, "--lr", "1e-3"]
    proc = spawn(run_args(store, tmp_path / "r", *common))
    straight = spawn(run_args(store, tmp_path / "straight", *common))
    metrics = tmp_path / "r" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == STOPPED_STATUS == 75, err[-2000:]
    assert "stopped by signal" in err and sig.name in err and "finished at step" not in err
    ckpt = load_checkpoint(latest_checkpoint(tmp_path / "r"))
    assert 3 <= ckpt["step"] < 12 and ckpt["step"] == losses(tmp_path / "r")[-1][0]
    weights, config = load_weights(tmp_path / "r")
    assert config["store"]["identity"] == ckpt["config"]["store"]["identity"] and weights
    command = err.split("resume with: ")[1].splitlines()[0].split()
    assert command == ["dittrain", "run", "--resume", "--out", str(tmp_path / "r")]
    resumed = spawn(command[1:])
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]
    assert straight.communicate(timeout=300) and straight.returncode == 0
    assert losses(tmp_path / "r") == losses(tmp_path / "straight")


def test_run_directory_and_logs(store, tmp_path):
    r = cli(*run_args(store, tmp_path / "r", "--max-steps", 6, "--save-every", 2, "--keep", 2,
                      "--sample-every", 3, "--sample-steps", 4))
    assert r.exit_code == 0, r.output
    out = tmp_path / "r"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model"]["in_channels"] == 3 and cfg["model"]["input_size"] == 8
    assert cfg["model"]["num_classes"] == 3 and cfg["train"]["model"]["model"] == "DiT-T/4"
    assert "buckets" not in cfg["store"]  # a plain store records none
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000004.pt", "step_00000006.pt"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "lr", "grad_norm", "images_per_s", "data_wait_frac"} <= rows[0].keys()
    assert "batch_shape" not in rows[0]  # a bucketed store's runs log it; a plain one's records are as they were
    assert (out / "ema.safetensors").is_file() and any((out / "tensorboard").iterdir())
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["step_00000003.png", "step_00000006.png"]


def test_torchrun_two_ranks_match_single_process(tmp_path):
    """With the same data on every rank (identical samples) the data partition cannot
    matter, so a 2-rank DDP run must compute what one process computes with the same
    global batch: noise, timesteps and dropout are drawn for the global batch and sliced."""
    store = make_store(tmp_path / "same", identical=True, flip=False)
    common = ["--max-steps", 8, "--save-every", 8, "--loader", "resident", "--lr", "1e-3", "--grad-clip", "0"]
    one_and_two_ranks(store, tmp_path, common)
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, 9))
    # stated tolerance: float reduction order (all-reduce of two half-batch means)
    np.testing.assert_allclose([v for _, v in a], [v for _, v in b], rtol=1e-4)
    assert_close_checkpoints(tmp_path / "one", tmp_path / "two", ["model"], rtol=1e-4, atol=1e-5)


def test_store_without_manifest(tmp_path):
    (tmp_path / "empty").mkdir()
    r = cli(*run_args(tmp_path / "empty", tmp_path / "r"))
    assert r.exit_code == 1 and "manifest.json: missing" in r.output and "Traceback" not in r.output


def test_model_that_does_not_fit_the_latents(tmp_path):
    odd = make_store(tmp_path / "odd", shape=(3, 6, 6))  # 6x6 latents do not split into 4x4 patches
    r = cli(*run_args(odd, tmp_path / "r", "--max-steps", 2, model="DiT-T/4"))
    assert r.exit_code == 1 and "DiT-T/4 does not fit latents 3x6x6" in r.output


def test_resume_refuses_another_store(store, tmp_path):
    assert cli(*run_args(store, tmp_path / "r", "--max-steps", 2)).exit_code == 0
    other = make_store(tmp_path / "other", seed=1)
    r = cli(*run_args(other, tmp_path / "r", "--max-steps", 4, "--resume"))
    assert r.exit_code == 1 and "made with another latent store" in r.output
    r = cli(*run_args(store, tmp_path / "r", "--max-steps", 4))
    assert r.exit_code == 1 and "pass --resume" in r.output


def test_truncated_checkpoint(store, tmp_path):
    assert cli(*run_args(store, tmp_path / "r", "--max-steps", 2)).exit_code == 0
    ckpt = latest_checkpoint(tmp_path / "r")
    ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    r = cli(*run_args(store, tmp_path / "r", "--max-steps", 4, "--resume"))
    assert r.exit_code == 1 and f"{ckpt}: unreadable checkpoint" in r.output and "truncated" in r.output


def test_nonfinite_losses_are_skipped_then_stop(tmp_path):
    some = make_store(tmp_path / "some", nan_every=5)  # a few NaN samples: their steps are skipped
    r = cli(*run_args(some, tmp_path / "r1", "--max-steps", 12, "--max-nonfinite", 50))
    assert r.exit_code == 0, r.output
    last = json.loads((tmp_path / "r1" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 12 and last["nonfinite_skipped"] > 0 and np.isfinite(last["loss"])
    weights = load_checkpoint(latest_checkpoint(tmp_path / "r1"))["model"]
    assert all(torch.isfinite(v).all() for v in weights.values())

    every = make_store(tmp_path / "all", nan_every=1)
    r = cli(*run_args(every, tmp_path / "r2", "--max-steps", 12, "--max-nonfinite", 3))
    assert r.exit_code == 1 and "3 consecutive non-finite losses" in r.output


def test_a_run_recorded_before_the_sections_resumes_and_samples(store, tmp_path):
    """Runs written before TrainConfig had sections record a flat "train"; they resume exactly
    (4 steps = 2 + flat-recorded checkpoint + 2) and `dittrain sample` reads them."""
    common = ["--max-steps", 4, "--save-every", 2, "--lr", "1e-3", "--ema", "0.9", "--loader", "resident"]
    r = cli(*run_args(store, tmp_path / "straight", *common))
    assert r.exit_code == 0, r.output
    r = cli(*run_args(store, tmp_path / "old", "--max-steps", 2, *common[2:]))
    assert r.exit_code == 0, r.output
    ckpt_file = latest_checkpoint(tmp_path / "old")
    ckpt = load_checkpoint(ckpt_file)
    sectioned = ckpt["config"]["train"]
    assert set(sectioned) == {"data", "model", "diffusion", "optim", "checkpointing", "logging", "eval",
                              "performance", "repa", "routing", "lora"}
    flat = {k: v for section in sectioned.values() for k, v in section.items()}
    ckpt["config"]["train"] = flat
    torch.save(ckpt, ckpt_file)
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    config["train"] = flat
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    r = cli("sample", "--ckpt", ckpt_file, "--n", 2, "--steps", 2, "--device", "cpu", "--out", tmp_path / "grid.png")
    assert r.exit_code == 0, r.output  # the sampler reads the model and store from the flat record
    assert (tmp_path / "grid.png").is_file()
    r = cli(*run_args(store, tmp_path / "old", *common, "--resume"))
    assert r.exit_code == 0, r.output
    assert_same_state(load_checkpoint(latest_checkpoint(tmp_path / "straight")),
                      load_checkpoint(latest_checkpoint(tmp_path / "old")))
