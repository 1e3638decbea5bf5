"""--optimizer adamw8bit (bitsandbytes' 8-bit AdamW, on the CPU here): it trains, keeps uint8
moments, resumes exactly after SIGKILL, and a resume with another optimizer is refused."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from cliutil import dittrain as cli
from cliutil import one_error_line, resume_after_sigkill, run_args

from dittrain.config import TrainConfig
from dittrain.rundir import latest_checkpoint, load_checkpoint
from dittrain.train.optim import build_optimizer

pytestmark = pytest.mark.usefixtures("one_thread")
bnb = pytest.importorskip("bitsandbytes")
QUANT = "__bnb_optimizer_quant_state__"  # where bitsandbytes' state dict keeps a parameter's state


def assert_equal(a, b, where="") -> None:
    """Nested state (dicts, lists, tensors, numbers) equal exactly."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal(x, y, f"{where}/{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


def moments(ckpt: dict) -> list[dict]:
    """Each parameter's optimizer state tensors (state1/state2: the two Adam moments)."""
    return [s[QUANT] for s in ckpt["optimizer"]["state"].values()]


def test_exact_resume_after_sigkill(store, tmp_path):
    steps, half = 40, 20
    common = ["--optimizer", "adamw8bit", "--loader", "resident", "--max-steps", steps, "--save-every", half,
              "--lr", "1e-3", "--ema", "0.9", "--weight-decay", "0.01"]
    err = resume_after_sigkill(store, tmp_path, common, steps=steps, half=half)
    assert "kernels" not in err  # bitsandbytes' note about its optional 4-bit CPU kernel stays quiet
    ca, cb = (load_checkpoint(latest_checkpoint(tmp_path / d)) for d in ("straight", "killed"))
    assert ca["step"] == steps and ca["config"]["train"]["optim"]["optimizer"] == "adamw8bit"
    for part in ("model", "ema", "optimizer"):
        assert_equal(ca[part], cb[part], part)
    # the moments of every tensor of 4096 elements or more are 8-bit (smaller ones stay fp32)
    state = moments(ca)
    big = [s for s in state if s["state1"].numel() >= 4096]
    assert big and all(s["state1"].dtype == s["state2"].dtype == torch.uint8 for s in big)
    assert all(s["state1"].dtype == torch.float32 for s in state if s["state1"].numel() < 4096)


def test_same_hyperparameters_as_adamw():
    cfg = TrainConfig.from_flat(optimizer="adamw8bit", lr=3e-4, weight_decay=0.05)
    params = [torch.nn.Parameter(torch.randn(64, 128))]
    opt8 = build_optimizer(cfg, params, torch.device("cpu"))
    opt32 = build_optimizer(TrainConfig.from_flat(optimizer="adamw", lr=3e-4, weight_decay=0.05), params, torch.device("cpu"))
    assert isinstance(opt8, bnb.optim.AdamW8bit) and isinstance(opt32, torch.optim.AdamW)
    for key in ("lr", "betas", "eps", "weight_decay"):
        assert opt8.param_groups[0][key] == opt32.param_groups[0][key], key
    params[0].grad = torch.randn(64, 128)
    opt8.step()
    state = opt8.state[params[0]]
    assert state["state1"].dtype == state["state2"].dtype == torch.uint8


def test_resume_with_another_optimizer_is_refused(store, tmp_path):
    assert cli(*run_args(store, tmp_path / "r", "--max-steps", 2)).exit_code == 0  # the default: adamw
    assert json.loads((tmp_path / "r" / "config.json").read_text())["train"]["optim"]["optimizer"] == "adamw"
    r = cli(*run_args(store, tmp_path / "r", "--max-steps", 4, "--resume", "--optimizer", "adamw8bit"))
    assert r.exit_code == 1
    line = one_error_line(r.output)
    # the run's record refuses it (dittrain.train.resume: the optimizer state is adamw's)
    assert "--optimizer 'adamw' -> 'adamw8bit' cannot change on a resume" in line
    # without a record (config.json lost), the checkpoint's own config refuses it
    (tmp_path / "r" / "config.json").unlink()
    r = cli(*run_args(store, tmp_path / "r", "--max-steps", 4, "--resume", "--optimizer", "adamw8bit"))
    line = one_error_line(r.output)
    assert r.exit_code == 1 and "made with --optimizer adamw, not adamw8bit" in line, line


def test_missing_bitsandbytes(store, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes -> ImportError
    r = cli(*run_args(store, tmp_path / "r", "--max-steps", 2, "--optimizer", "adamw8bit"))
    assert r.exit_code == 1
    assert "pip install 'ditkit[optim]'" in one_error_line(r.output)
    assert not (tmp_path / "r" / "checkpoints").exists()
