"""--optimizer adamw8bit (bitsandbytes' 8-bit AdamW, on the CPU here): it trains, keeps uint8
moments, resumes exactly after SIGKILL, and a resume with another optimizer is refused.
--adam-betas B1,B2 (LightningDiT's 0.9,0.95): both optimizers step with them (Adam's update by
hand), the run records them, a resume keeps them, and bad values are one line."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from cliutil import dittrain as cli
from cliutil import one_error_line, resume_after_sigkill, run_args

from dittrain.config import TrainConfig
from dittrain.rundir import latest_checkpoint, load_checkpoint
from dittrain.train.optim import build_optimizer

pytestmark = pytest.mark.usefixtures("one_thread")
try:
    import bitsandbytes as bnb
except ImportError:  # the optim extra: its tests skip, the rest run
    bnb = None
needs_bnb = pytest.mark.skipif(bnb is None, reason="bitsandbytes (pip install 'ditkit[optim]') is not installed")
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


@needs_bnb
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


@needs_bnb
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


# ----------------------------------------------------------------------------- --adam-betas


def hand_adam(p0: torch.Tensor, grads: list, betas, lr: float, eps: float = 1e-8) -> torch.Tensor:
    """Adam's update (no weight decay) written out: m, v the bias-corrected moment averages."""
    b1, b2 = betas
    m = v = torch.zeros_like(p0, dtype=torch.float64)
    p = p0.double()
    for step, g in enumerate(grads, start=1):
        m, v = b1 * m + (1 - b1) * g.double(), b2 * v + (1 - b2) * g.double() ** 2
        p = p - lr * (m / (1 - b1 ** step)) / ((v / (1 - b2 ** step)).sqrt() + eps)
    return p


@pytest.mark.parametrize("optimizer", ["adamw", pytest.param("adamw8bit", marks=needs_bnb)])
def test_adam_betas_are_what_both_optimizers_step_with(optimizer):
    """Three steps on a tensor under bitsandbytes' 4096 elements (its moments stay fp32, so its update is
    Adam's too): the betas given, not the default ones, which move the weights elsewhere."""
    betas, lr = (0.8, 0.95), 1e-2
    cfg = TrainConfig.from_flat(optimizer=optimizer, lr=lr, adam_betas="0.8,0.95")
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(16, 32, generator=g)
    grads = [torch.randn(16, 32, generator=g) for _ in range(3)]
    param = torch.nn.Parameter(p0.clone())
    opt = build_optimizer(cfg, [param], torch.device("cpu"))
    assert tuple(opt.param_groups[0]["betas"]) == betas
    for grad in grads:
        param.grad = grad.clone()
        opt.step()
    want = hand_adam(p0, grads, betas, lr)
    torch.testing.assert_close(param.detach().double(), want, rtol=1e-4, atol=1e-5)
    assert (hand_adam(p0, grads, (0.9, 0.999), lr) - want).abs().max() > 1e-3  # the default: another point
    assert tuple(build_optimizer(TrainConfig.from_flat(optimizer=optimizer), [param], torch.device("cpu"))
                 .param_groups[0]["betas"]) == (0.9, 0.999)  # DiT's, when not given


def test_adam_betas_are_recorded_and_kept_on_resume(store, tmp_path):
    out = tmp_path / "r"
    r = cli(*run_args(store, out, "--max-steps", 1, "--adam-betas", "0.90, 0.950"))
    assert r.exit_code == 0, r.output
    assert json.loads((out / "config.json").read_text())["train"]["optim"]["adam_betas"] == "0.9,0.95"  # one spelling
    ckpt = load_checkpoint(latest_checkpoint(out))
    assert tuple(ckpt["optimizer"]["param_groups"][0]["betas"]) == (0.9, 0.95)
    # a resume continues with them (the same value spelled otherwise is no change) ...
    assert cli(*run_args(store, out, "--max-steps", 2, "--resume", "--adam-betas", "0.9,0.95000")).exit_code == 0
    assert tuple(load_checkpoint(latest_checkpoint(out))["optimizer"]["param_groups"][0]["betas"]) == (0.9, 0.95)
    # ... and other ones are a change of what is learned
    r = cli(*run_args(store, out, "--max-steps", 3, "--resume", "--adam-betas", "0.9,0.999"))
    assert r.exit_code == 1 and "--adam-betas '0.9,0.95' -> '0.9,0.999'" in one_error_line(r.output)
    # --print-config writes them as --config reads them back
    toml = cli(*run_args(store, tmp_path / "p", "--adam-betas", "0.9,0.95", "--print-config")).output
    assert 'adam-betas = "0.9,0.95"' in toml
    (tmp_path / "p.toml").write_text(toml)
    assert 'adam-betas = "0.9,0.95"' in cli("run", "--config", tmp_path / "p.toml", "--print-config").output


@pytest.mark.parametrize("value, needle", [
    ("1,0.9", "B1 = 1 is outside [0, 1)"), ("0.9,1.0", "B2 = 1 is outside [0, 1)"),
    ("0.9,-0.1", "B2 = -0.1 is outside [0, 1)"), ("nan,0.9", "B1 = nan is outside [0, 1)"),
    ("0.9", "is not two numbers B1,B2"), ("0.9,0.95,0.99", "is not two numbers"), ("a,b", "is not two numbers"),
])
def test_bad_adam_betas_are_one_line(store, tmp_path, value, needle):
    r = cli(*run_args(store, tmp_path / "r", "--max-steps", 1, "--adam-betas", value))
    assert r.exit_code != 0
    line = one_error_line(r.output)
    assert "--adam-betas" in line and needle in line, line
    assert not (tmp_path / "r").exists()
    # a config made in Python is refused by the optimizer itself, in one line too
    from dittrain.train.optim import OptimizerError

    with pytest.raises(OptimizerError, match=re.escape(needle)):
        build_optimizer(TrainConfig.from_flat(adam_betas=value), [torch.nn.Parameter(torch.zeros(2))],
                        torch.device("cpu"))
