"""dittrain.train.step: the optimizer step queued without host reads, a NaN/inf step skipped on the
device, and the loop's one-step-late settling giving what settling every step gives."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from cliutil import assert_same_state, run_args, stop_once_set_up
from cliutil import dittrain as cli
from storeutil import make_store

from dittrain.config import TrainConfig
from dittrain.diffusion import Diffusion, DiffusionConfig
from dittrain.model.dit import DiT
from dittrain.model.sizes import get_config
from dittrain.rundir import latest_checkpoint, load_checkpoint
from dittrain.train.optim import build_optimizer
from dittrain.train.step import TrainStep

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.usefixtures("one_thread")
B = 4


def batches(poison: set[int] = frozenset()):
    """Class-labelled 4x8x8 batches; those numbered in `poison` hold a NaN."""
    g = torch.Generator().manual_seed(0)
    i = 0
    while True:
        x = torch.randn((B, 4, 8, 8), generator=g)
        if i in poison:
            x[1, 2, 3, 4] = float("nan")
        yield {"x": x, "y": torch.randint(0, 3, (B,), generator=g)}
        i += 1


def tiny_step(**cfg) -> TrainStep:
    torch.manual_seed(0)
    mcfg = get_config("DiT-T/4", input_size=8, in_channels=4, num_classes=3, learn_sigma=True)
    model, ema = DiT(mcfg), DiT(mcfg).requires_grad_(False)
    ema.load_state_dict(model.state_dict())
    tcfg = TrainConfig.from_flat(batch_size=B, ema=0.5, lr=1e-2, **cfg)
    opt = build_optimizer(tcfg, [p for p in model.parameters() if p.requires_grad], torch.device("cpu"))
    return TrainStep(model=model, train_model=model, ema=ema, optimizer=opt,
                     scaler=torch.amp.GradScaler("cpu", enabled=False),
                     diffusion=Diffusion(DiffusionConfig(objective="ddpm", learn_sigma=True)), cfg=tcfg,
                     gen=torch.Generator().manual_seed(1), device=torch.device("cpu"), amp_dtype=None)


@contextlib.contextmanager
def no_host_reads():
    """Every way a device scalar reaches Python raises inside: on a GPU each is a sync."""
    def refuse(self, *a, **k):
        raise AssertionError("host read of a tensor inside the step")

    names = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")
    saved = {n: getattr(torch.Tensor, n) for n in names}
    try:
        for n in names:
            setattr(torch.Tensor, n, refuse)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def snapshot(step: TrainStep) -> dict:
    opt = step.optimizer.state_dict()["state"]
    return {"model": [p.detach().clone() for p in step.model_params],
            "ema": [p.detach().clone() for p in step.ema_params],
            "opt": {i: {k: v.clone() for k, v in s.items()} for i, s in opt.items()}}


def assert_equal(a: dict, b: dict) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a["model"], b["model"], strict=True))
    assert all(torch.equal(x, y) for x, y in zip(a["ema"], b["ema"], strict=True))
    assert a["opt"].keys() == b["opt"].keys()
    assert all(torch.equal(a["opt"][i][k], b["opt"][i][k]) for i in a["opt"] for k in a["opt"][i])


def test_the_step_reads_nothing_back_to_the_host():
    step, data = tiny_step(), batches(poison={1})
    attempts = []
    with no_host_reads():  # the fused optimizer skips the poisoned step on the device
        for _ in range(3):
            attempts.append(step.update(step.backward(data)))
    assert [a.settle() for a in attempts] == [(True, False), (False, False), (True, False)]
    assert np.isfinite(attempts[0].loss.item()) and not np.isfinite(attempts[1].loss.item())


def test_a_poisoned_step_changes_nothing():
    step, data = tiny_step(), batches(poison={1})
    assert step.update(step.backward(data)).settle() == (True, False)
    step.ema_update()
    before = snapshot(step)
    assert step.update(step.backward(data)).settle() == (False, False)
    assert_equal(snapshot(step), before)  # weights, EMA, moments and AdamW's step count
    assert step.update(step.backward(data)).settle() == (True, False)
    after = snapshot(step)
    assert not torch.equal(after["model"][-1], before["model"][-1])  # the next step does train
    assert int(after["opt"][0]["step"]) == 2


def test_a_stop_request_travels_with_the_step():
    step, data = tiny_step(), batches()
    assert step.update(step.backward(data, stop=True)).settle() == (True, True)


def test_an_optimizer_without_device_skipping_is_skipped_by_the_host():
    step, data = tiny_step(), batches(poison={0})
    step.device_skip = False  # as for bitsandbytes' AdamW8bit
    before = snapshot(step)
    assert step.update(step.backward(data)).settle() == (False, False)
    assert_equal(snapshot(step), before)


def state_of(out: Path) -> dict:
    return load_checkpoint(latest_checkpoint(out))


def test_settling_one_step_late_equals_settling_every_step(tmp_path):
    """--log-every 1 settles every step at once; --log-every 100 settles each step while the
    next one is queued (EMA one step late): the same weights, EMA, optimizer state and
    counters, NaN steps included."""
    store = make_store(tmp_path / "s", nan_every=7)
    common = ["--max-steps", 9, "--save-every", 100, "--ema", "0.7", "--lr", "1e-3", "--loader", "resident",
              "--max-nonfinite", 50]
    for out, every in (("each", 1), ("late", 100)):
        r = cli(*run_args(store, tmp_path / out, *common, "--log-every", every))
        assert r.exit_code == 0, r.output
    a, b = state_of(tmp_path / "each"), state_of(tmp_path / "late")
    assert a["step"] == b["step"] == 9 and a["nonfinite_total"] == b["nonfinite_total"] > 0
    assert a["ranks"][0]["loader"]["batches"] == b["ranks"][0]["loader"]["batches"] == 9 + a["nonfinite_total"]
    assert a["lr_schedule"] == b["lr_schedule"]
    assert_same_state(a, b)


def _rank_pid(parent: int, rank: int, timeout: float = 60) -> int:
    """The pid of torchrun's worker with RANK=rank."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                env = (d / "environ").read_bytes().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue
            if ppid == parent and f"RANK={rank}".encode() in env:
                return int(d.name)
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} under {parent}")


def test_a_stop_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """SIGTERM to rank 1 only: rank 0 learns of it from the step's all-reduce; both stop at
    the same step, one checkpoint, both exit 75."""
    store = make_store(tmp_path / "s", identical=True, flip=False)
    out = tmp_path / "r"
    args = run_args(store, out, "--max-steps", 100000, "--save-every", 100000, "--log-every", 1000,
                    "--loader", "resident")
    proc = subprocess.Popen([BIN / "torchrun", "--standalone", "--nproc_per_node", "2", "-m", "dittrain.cli",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    # some steps (3 s after setup), then SIGTERM to rank 1
    err = stop_once_set_up(proc, out, lambda: os.kill(_rank_pid(proc.pid, 1), signal.SIGTERM), settle=3.0,
                           timeout=180, wait=120)
    # each rank exits 75 (stopped, resumable); torchrun reports any non-zero rank as its own failure (1)
    # (the rank that exits second may be stopped by torchrun's own SIGTERM to the survivors first)
    assert proc.returncode == 1 and "exitcode  : 75" in err, err[-3000:]
    assert "stopped by signal at step" in err
    ckpt = state_of(out)
    assert ckpt["step"] > 0 and len(ckpt["ranks"]) == 2
    assert ckpt["ranks"][0]["loader"]["batches"] == ckpt["ranks"][1]["loader"]["batches"] == ckpt["step"]


def test_the_grad_scaler_path_skips_and_backs_off():
    """fp16 training's GradScaler: unscale_ before clipping, the step skipped on the device
    for inf/NaN gradients, and the scale halved for the next step."""
    step, data = tiny_step(), batches(poison={1})
    step.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    assert step.update(step.backward(data)).settle() == (True, False)
    before = snapshot(step)
    assert step.update(step.backward(data)).settle() == (False, False)
    assert_equal(snapshot(step), before)
    assert step.scaler.get_scale() == 2.0**9
