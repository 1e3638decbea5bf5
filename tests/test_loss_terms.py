"""dittrain.train.losses: the table of loss terms is the one place a term is added. Toy terms that
exist only here, registered in LOSS_TERMS, train through the real trainer: the step adds their
weighted loss to the backward (by hand, and in the weights a run ends with), their metrics reach
metrics.jsonl and the progress lines, a term's module trains beside the model, is checkpointed
under its key and resumes exactly; unregistered, a run is a plain run again, to the bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cliutil import assert_has, run_args
from cliutil import dittrain as cli
from test_step import batches, no_host_reads
from tiny import step_inputs

from dittrain.config import TrainConfig
from dittrain.diffusion import Diffusion, DiffusionConfig
from dittrain.model.dit import DiT
from dittrain.model.sizes import get_config
from dittrain.rundir import latest_checkpoint, load_checkpoint
from dittrain.train.losses import LOSS_TERMS, LossTerm
from dittrain.train.optim import build_optimizer
from dittrain.train.step import TrainStep

pytestmark = pytest.mark.usefixtures("one_thread")


class Squared(LossTerm):
    """weight x the mean of the model's output squared (a toy: it pulls the output towards 0)."""

    name, shown = "squared", ("squared_loss",)

    def __init__(self, weight: float):
        self.weight = weight

    def __call__(self, fwd):
        loss = fwd.output.float().square().mean()
        return self.weight * loss, {"squared_loss": loss.detach()}


class Scaled(LossTerm):
    """A toy with a module: (s x the output, detached, - 1)^2 with s a learned scalar that trains
    beside the model and is checkpointed under "toy_scale"; the model gets no gradient from it."""

    name, state_key = "scaled", "toy_scale"

    def make_module(self, cfg, model_cfg, resolved, device):
        scale = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.ones_(scale.weight)  # a fixed init: the global RNG (the model's init) untouched
        return scale.to(device)

    def build(self, cfg, model_cfg, resolved, module, train_module):
        return _ScaledStep(module, train_module)


class _ScaledStep:
    """Scaled as the step calls it: its module, and what the forward calls (in DDP or not)."""

    hidden = None

    def __init__(self, module, train_module):
        self.module, self.train_module = module, train_module

    def __call__(self, fwd):
        s = self.train_module(torch.ones(1, 1, device=fwd.x0.device)).squeeze()
        loss = (s * fwd.output.detach().float() - 1).square().mean()
        return loss, {"scaled_loss": loss.detach(), "scaled_s": s.detach()}


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _figures(out: Path) -> list[dict]:
    """The records without their wall-clock figures (which differ between any two runs)."""
    return [{k: v for k, v in r.items() if k not in ("images_per_s", "data_wait_frac")} for r in _rows(out)]


def _train(store: Path, out: Path, *extra) -> str:
    r = cli(*run_args(store, out, "--max-steps", 3, "--lr", "1e-2", "--logger", "jsonl", *extra))
    assert r.exit_code == 0, r.output
    return r.output


def _model(out: Path) -> dict:
    return load_checkpoint(latest_checkpoint(out))["model"]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_step_adds_the_weighted_term_and_carries_its_metric():
    """What the backward takes is the diffusion loss + weight x the term's loss of the same
    forward's output; the metric rides in the step, which reads nothing on the host."""
    torch.manual_seed(0)
    model_cfg = get_config("DiT-T/4", input_size=8, in_channels=4, num_classes=3, learn_sigma=True)
    model, ema = DiT(model_cfg), DiT(model_cfg).requires_grad_(False)
    with torch.no_grad():  # adaLN-Zero starts with a zero output: make it give something
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    ema.load_state_dict(model.state_dict())
    cfg = TrainConfig.from_flat(batch_size=4, lr=1e-2)
    opt = build_optimizer(cfg, [p for p in model.parameters() if p.requires_grad], torch.device("cpu"))
    step = TrainStep(model=model, train_model=model, ema=ema, optimizer=opt,
                     scaler=torch.amp.GradScaler("cpu", enabled=False),
                     diffusion=Diffusion(DiffusionConfig(objective="ddpm", learn_sigma=True)), cfg=cfg,
                     gen=torch.Generator().manual_seed(1), device=torch.device("cpu"), amp_dtype=None,
                     terms=[Squared(0.25)])
    batch = next(batches())
    x0, t, noise, kwargs = step_inputs(step, batch)
    total, loss, metrics = step._losses(batch, x0, kwargs, t, noise)
    out = model(step.diffusion.q_sample(x0, t, noise), step.diffusion.model_timesteps(t), **kwargs)
    assert torch.allclose(loss, step.diffusion.training_loss(model, x0, kwargs, t=t, noise=noise).mean())
    assert out.abs().min() > 0 and torch.allclose(total, loss + 0.25 * out.square().mean())
    assert list(metrics) == ["squared_loss"] and torch.allclose(metrics["squared_loss"], out.square().mean())
    with no_host_reads():
        attempt = step.update(step.backward(batches()))
    assert attempt.settle() == (True, False) and list(attempt.metrics) == ["squared_loss"]


def test_a_registered_term_trains_logs_and_unregistered_is_gone(store, tmp_path, monkeypatch):
    plain = tmp_path / "plain"
    _train(store, plain)
    with monkeypatch.context() as m:
        m.setitem(LOSS_TERMS, "squared", Squared(1.0))
        said = _train(store, tmp_path / "squared")
    _train(store, tmp_path / "again")

    rows, base = _rows(tmp_path / "squared"), _rows(plain)
    # adaLN-Zero: the DiT's output starts at 0, and so does the term's loss (and its gradient)
    assert rows[0]["squared_loss"] == 0.0 < rows[1]["squared_loss"] and "squared_loss" not in base[0]
    assert_has(said, " squared_loss ")  # the progress lines show it (Squared.shown)
    # the same first forward (the term changes no draw), then its gradient moved the weights
    assert rows[0]["loss"] == base[0]["loss"] and rows[-1]["loss"] != base[-1]["loss"]
    assert not _same(_model(tmp_path / "squared"), _model(plain))
    # the table is the one place: without the entry the run is the plain one, to the bit
    assert _figures(tmp_path / "again") == _figures(plain)
    assert _same(_model(tmp_path / "again"), _model(plain))


def test_a_terms_module_trains_beside_the_model_and_resumes(store, tmp_path, monkeypatch):
    """Scaled's module joins the optimizer (after the model's parameters), is saved under its
    state_key, never touches the model (its gradient is its own; no clipping here) and comes back
    on a resume: 2 steps + resume to 4 give the straight run's figures and tensors."""
    monkeypatch.setitem(LOSS_TERMS, "scaled", Scaled())
    flags = ["--grad-clip", 0, "--save-every", 2]
    _train(store, tmp_path / "straight", *flags, "--max-steps", 4)
    _train(store, tmp_path / "killed", *flags, "--max-steps", 2)
    r = cli("run", "--resume", "--out", tmp_path / "killed", "--max-steps", 4)
    assert r.exit_code == 0, r.output
    a, b = (load_checkpoint(latest_checkpoint(tmp_path / n)) for n in ("straight", "killed"))
    assert a["toy_scale"]["weight"].item() != 1.0 and _same(a["toy_scale"], b["toy_scale"])
    assert _same(a["model"], b["model"])
    assert len(a["optimizer"]["state"]) == len(a["model"]) - 1 + 1  # the frozen pos_embed out, the scale in
    ra, rb = _rows(tmp_path / "straight"), _rows(tmp_path / "killed")
    assert [(r["loss"], r["scaled_loss"], r["scaled_s"]) for r in ra] == [
        (r["loss"], r["scaled_loss"], r["scaled_s"]) for r in rb]
    monkeypatch.delitem(LOSS_TERMS, "scaled")
    _train(store, tmp_path / "plain", *flags, "--max-steps", 4)
    assert _same(a["model"], _model(tmp_path / "plain"))  # its loss reached its own parameter only
