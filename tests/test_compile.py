"""dittrain run --compile on the CPU (inductor): the losses of eager within a stated
tolerance, the exact resume, the flag's forms. The first compile here takes ~20-40 s."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from cliutil import assert_same_state, run_args
from cliutil import dittrain as cli

from dittrain.rundir import latest_checkpoint, load_checkpoint
from dittrain.train.step import compile_target

pytestmark = pytest.mark.usefixtures("one_thread")
# Stated tolerance: inductor fuses the element-wise work (LayerNorm, modulate, GELU) into
# other kernels and reorders its float sums, so a compiled step differs from eager in the
# last bits; over 4 steps of a tiny DiT that stays below 1e-4 relative in the loss.
RTOL = 1e-4


def losses(out: Path) -> list[float]:
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def by_step(out: Path) -> dict[int, float]:
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def train_cfg(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())["train"]["performance"]


COMMON = ["--max-steps", 4, "--save-every", 2, "--lr", "1e-3", "--ema", "0.9", "--loader", "resident"]


def test_compile_target():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compile_target("auto", cpu) == "off" and compile_target("auto", cuda) == "blocks"
    assert compile_target("model", cpu) == "model" and compile_target("off", cuda) == "off"
    with pytest.raises(ValueError, match="choose off, auto, blocks or model"):
        compile_target("yes", cpu)


@pytest.mark.parametrize("how", ["blocks", "model"])
def test_compiled_losses_match_eager(store, tmp_path, how):
    eager = cli(*run_args(store, tmp_path / "eager", *COMMON, "--no-compile"))
    assert eager.exit_code == 0, eager.output
    flag = ["--compile"] if how == "blocks" else ["--compile", "model"]  # the bare flag means blocks
    compiled = cli(*run_args(store, tmp_path / how, *COMMON, *flag))
    assert compiled.exit_code == 0, compiled.output
    assert train_cfg(tmp_path / "eager")["compile"] == "off" and train_cfg(tmp_path / how)["compile"] == how
    assert f"torch.compile ({how}, mode default) included" in compiled.output  # the compile time is said
    a, b = losses(tmp_path / "eager"), losses(tmp_path / how)
    assert len(a) == len(b) == 4
    np.testing.assert_allclose(b, a, rtol=RTOL)
    wa = load_checkpoint(latest_checkpoint(tmp_path / "eager"))["model"]
    wb = load_checkpoint(latest_checkpoint(tmp_path / how))["model"]
    assert wa.keys() == wb.keys()  # regional compilation keeps the state dict's names
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-3, atol=1e-5)


def test_exact_resume_with_compile(store, tmp_path):
    """2 steps + resume + 2 steps equals 4 straight, both compiled, bit for bit; the steps in
    between settle one step late (--log-every 3)."""
    late = ["--compile", "--log-every", 3]
    assert cli(*run_args(store, tmp_path / "straight", *COMMON, *late)).exit_code == 0
    first = cli(*run_args(store, tmp_path / "resumed", *COMMON, *late, "--max-steps", 2))
    assert first.exit_code == 0, first.output
    second = cli(*run_args(store, tmp_path / "resumed", *COMMON, *late, "--resume"))
    assert second.exit_code == 0, second.output
    a, b = by_step(tmp_path / "straight"), by_step(tmp_path / "resumed")
    assert list(a) == [3, 4] and list(b) == [2, 3, 4]  # the first half logged its last step
    assert [a[3], a[4]] == [b[3], b[4]]
    a = load_checkpoint(latest_checkpoint(tmp_path / "straight"))
    b = load_checkpoint(latest_checkpoint(tmp_path / "resumed"))
    assert a["step"] == b["step"] == 4
    assert_same_state(a, b)
