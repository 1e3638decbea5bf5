"""Loss and timestep options: ddpm min-SNR-gamma weighting, flow t sampling (uniform or
logit-normal) and SD3's t-shift (training draws and the Euler/Heun grid), recorded in the
run config and kept on resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from cliutil import dittrain as cli
from cliutil import one_error_line, run_args

from dittrain.diffusion import Diffusion, DiffusionConfig, shift_t

T_CHECK = [0, 1, 10, 50, 100, 250, 500, 999]


def closed_form_snr(t: list[int]) -> np.ndarray:
    betas = np.linspace(1e-4, 0.02, 1000, dtype=np.float64)
    abar = np.cumprod(1.0 - betas)[t]
    return abar / (1.0 - abar)


@pytest.mark.parametrize("gamma", [1.0, 5.0])
def test_min_snr_weights_equal_the_closed_form(gamma):
    d = Diffusion(loss_weighting="min-snr", min_snr_gamma=gamma)
    snr = closed_form_snr(T_CHECK)
    got = d.loss_weights(torch.tensor(T_CHECK)).numpy()
    assert np.allclose(got, np.minimum(snr, gamma) / snr, rtol=1e-10)
    assert got[-1] == 1.0 and got[0] < 0.01  # noisy steps unweighted, clean ones down-weighted
    assert Diffusion().loss_weights(torch.tensor(T_CHECK)) is None


def test_weighted_loss_is_the_hand_computation():
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 2, 2, 2, generator=g), torch.randn(3, 2, 2, 2, generator=g)
    out = torch.randn(3, 2, 2, 2, generator=g)
    t = torch.tensor([3, 200, 900])
    w = np.minimum(closed_form_snr([3, 200, 900]), 5.0) / closed_form_snr([3, 200, 900])
    mse = ((out - noise) ** 2).flatten(1).mean(1).double().numpy()
    d = Diffusion(learn_sigma=False, loss_weighting="min-snr")
    loss = d.training_loss(lambda x, s: out, x0, t=t, noise=noise)
    assert np.allclose(loss.double().numpy(), w * mse, rtol=1e-5)
    # learned sigma: the VLB term is added unweighted
    v = torch.rand(3, 2, 2, 2, generator=g) * 2 - 1
    d = Diffusion(learn_sigma=True, loss_weighting="min-snr")
    terms = d.training_loss(lambda x, s: torch.cat([out, v], 1), x0, t=t, noise=noise, return_terms=True)
    assert np.allclose(terms["mse"].double().numpy(), mse, rtol=1e-5)
    assert torch.allclose(terms["loss"], torch.tensor(w, dtype=torch.float32) * terms["mse"] + terms["vb"])


def test_t_shift_closed_form_and_sampling_grid():
    for s in (1.0, 3.0, 0.5):
        for t in (0.0, 0.1, 0.5, 0.9, 1.0):
            assert shift_t(t, s) == pytest.approx(s * t / (1 + (s - 1) * t))
    d = Diffusion(objective="flow", learn_sigma=False, t_shift=3.0)
    grid = d.flow_time_grid(4)
    assert grid == pytest.approx([3 * u / (1 + 2 * u) for u in (1.0, 0.75, 0.5, 0.25, 0.0)])
    heun = [t for a, b in zip(grid, grid[1:], strict=False) for t in (a, b)]  # each step: t, then t_next
    for sampler, calls in (("euler", grid[:-1]), ("heun", heun)):
        seen: list[float] = []

        def model(x, t, seen=seen):
            seen.append(float(t[0]) / 1000)
            return torch.zeros_like(x)

        d.sample(model, (1, 1, 2, 2), steps=4, sampler=sampler, generator=torch.Generator().manual_seed(0))
        assert seen == pytest.approx(calls), sampler


def test_t_sampling_moments():
    n, g = 200_000, torch.Generator().manual_seed(0)
    u = Diffusion(objective="flow", learn_sigma=False, t_sampling="uniform").sample_timesteps(n, g)
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    ln = Diffusion(objective="flow", learn_sigma=False, logit_normal_mean=0.5, logit_normal_std=0.8)
    logit = torch.logit(ln.sample_timesteps(n, g).double())
    assert abs(float(logit.mean()) - 0.5) < 0.02 and abs(float(logit.std()) - 0.8) < 0.02
    default = Diffusion(objective="flow", learn_sigma=False).sample_timesteps(n, g)
    assert abs(float(torch.logit(default.double()).std()) - 1.0) < 0.02  # the defaults: N(0, 1)
    s = 3.0
    shifted = Diffusion(objective="flow", learn_sigma=False, t_sampling="uniform", t_shift=s).sample_timesteps(n, g)
    assert float(shifted.mean()) > 0.6  # pushed towards the noise end
    back = shifted / (s - (s - 1) * shifted)  # the inverse shift recovers U(0, 1)
    assert abs(float(back.mean()) - 0.5) < 0.01 and abs(float(back.var()) - 1 / 12) < 0.005


def test_options_of_the_other_objective_are_refused():
    with pytest.raises(ValueError, match="min-snr"):
        DiffusionConfig(objective="flow", loss_weighting="min-snr")
    with pytest.raises(ValueError, match="flow options"):
        DiffusionConfig(objective="ddpm", t_shift=2.0)
    with pytest.raises(ValueError, match="t_shift"):
        DiffusionConfig(objective="flow", t_shift=0.0)


def test_options_recorded_and_resume_keeps_them(store, tmp_path):
    out = tmp_path / "flow"
    flow = ["--objective", "flow", "--t-sampling", "uniform", "--t-shift", 2.0]
    assert cli(*run_args(store, out, "--max-steps", 2, *flow)).exit_code == 0
    diff = json.loads((out / "config.json").read_text())["diffusion"]
    assert diff["t_sampling"] == "uniform" and diff["t_shift"] == 2.0 and diff["loss_weighting"] == "none"
    r = cli(*run_args(store, out, "--max-steps", 3, "--resume", *flow[:-1], 3.0))
    assert r.exit_code == 1 and "--t-shift 2.0 -> 3.0" in one_error_line(r.output)
    assert cli(*run_args(store, out, "--max-steps", 3, "--resume", *flow)).exit_code == 0

    out = tmp_path / "ddpm"
    assert cli(*run_args(store, out, "--max-steps", 1, "--loss-weighting", "min-snr",
                         "--min-snr-gamma", 2)).exit_code == 0
    diff = json.loads((out / "config.json").read_text())["diffusion"]
    assert diff["loss_weighting"] == "min-snr" and diff["min_snr_gamma"] == 2.0
    # a resume without the flags continues with the recorded ones (dittrain.train.resume) ...
    assert cli(*run_args(store, out, "--max-steps", 2, "--resume")).exit_code == 0
    assert json.loads((out / "config.json").read_text())["diffusion"]["loss_weighting"] == "min-snr"
    # ... and another value is refused with the difference
    r = cli(*run_args(store, out, "--max-steps", 3, "--resume", "--loss-weighting", "none"))
    assert r.exit_code == 1 and "--loss-weighting 'min-snr' -> 'none'" in one_error_line(r.output)

    r = cli(*run_args(store, tmp_path / "bad", "--max-steps", 1, "--objective", "flow", "--loss-weighting", "min-snr"))
    assert r.exit_code == 1 and "min-snr" in one_error_line(r.output)


# ----------------------------------------------------------------------------- --velocity-cosine-weight


def test_velocity_cosine_is_the_hand_formula():
    """LightningDiT's cosine loss (hustvl/LightningDiT transport/transport.py @ 2725fed4:
    mean_flat(1 - cosine_similarity(model_output, ut, dim=1)), then the batch mean, added to the MSE with
    weight 1): written out here per sample n and position (h, w), the cosine over the channels c."""
    from dittrain.config import TrainConfig
    from dittrain.train.losses import LOSS_TERMS, Forward

    g = torch.Generator().manual_seed(0)
    x0, noise, out = (torch.randn(3, 4, 5, 6, generator=g, dtype=torch.float64) for _ in range(3))
    cfg = TrainConfig.from_flat(objective="flow", velocity_cosine_weight=0.7)
    entry = LOSS_TERMS["velocity_cosine"]
    assert entry.on(cfg) and not entry.on(TrainConfig.from_flat(objective="flow"))  # 0: off
    term = entry.build(cfg, None, {}, None, None)
    fwd = Forward(lambda x, t: out.float(), None, {}, x0.float(), torch.zeros(3), noise.float(), {})
    fwd(x0.float(), torch.zeros(3))  # the diffusion loss's call: the term reads its output
    weighted, metrics = term(fwd)

    v = (noise - x0).numpy()  # our velocity; the reference's is x0 - noise, and so is its output's sign
    o = out.numpy()
    total = 0.0
    for n in range(3):
        for h in range(5):
            for w in range(6):
                a, b = o[n, :, h, w], v[n, :, h, w]
                total += 1 - a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
    want = total / (3 * 5 * 6)
    assert metrics["velocity_cosine_loss"].item() == pytest.approx(want, rel=1e-5)
    assert weighted.item() == pytest.approx(0.7 * want, rel=1e-5)
    # the reference's signs (output and target both negated) give the same cosine
    flipped = Forward(lambda x, t: -out.float(), None, {}, noise.float(), torch.zeros(3), x0.float(), {})
    flipped(x0.float(), torch.zeros(3))
    assert term(flipped)[1]["velocity_cosine_loss"].item() == pytest.approx(want, rel=1e-5)


def test_velocity_cosine_trains_logs_and_resumes(store, tmp_path):
    """The term joins the backward (the second step's loss moves) but not the logged loss (the first
    step's, before any update, is a plain run's: the reference logs the MSE alone too); its metric is
    logged; a resume keeps it; ddpm refuses it in one line."""
    flow = ["--objective", "flow", "--lr", "1e-2", "--max-steps", 2]
    assert cli(*run_args(store, tmp_path / "plain", *flow)).exit_code == 0
    r = cli(*run_args(store, tmp_path / "cos", *flow, "--velocity-cosine-weight", 1))
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in (tmp_path / "cos" / "metrics.jsonl").read_text().splitlines()]
    plain = [json.loads(line) for line in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["loss"] == plain[0]["loss"] and rows[1]["loss"] != plain[1]["loss"]
    assert all(0 < row["velocity_cosine_loss"] < 2 for row in rows) and "velocity_cosine_loss" not in plain[0]
    train = json.loads((tmp_path / "cos" / "config.json").read_text())["train"]
    assert train["diffusion"]["velocity_cosine_weight"] == 1.0
    r = cli(*run_args(store, tmp_path / "cos", "--max-steps", 3, "--resume", "--velocity-cosine-weight", 0.5))
    assert r.exit_code == 1 and "--velocity-cosine-weight 1.0 -> 0.5" in one_error_line(r.output)
    assert cli(*run_args(store, tmp_path / "cos", "--max-steps", 3, "--resume")).exit_code == 0
    last = json.loads((tmp_path / "cos" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 3 and "velocity_cosine_loss" in last

    r = cli(*run_args(store, tmp_path / "ddpm", "--max-steps", 1, "--velocity-cosine-weight", 1))
    line = one_error_line(r.output)
    assert r.exit_code == 1 and "--velocity-cosine-weight 1 is a flow option" in line and "--objective flow" in line
    assert not (tmp_path / "ddpm" / "checkpoints").exists()


def test_flow_time_scale_is_recorded_and_ddpm_refuses_it(store, tmp_path):
    """`--flow-time-scale 1` (SiT's t): recorded in the run's diffusion config, which sampling reads; a
    ddpm run refuses it in one line and writes nothing."""
    r = cli(*run_args(store, tmp_path / "r", "--objective", "flow", "--flow-time-scale", 1, "--max-steps", 1))
    assert r.exit_code == 0, r.output
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["diffusion"]["flow_time_scale"] == 1.0 and config["train"]["diffusion"]["flow_time_scale"] == 1.0
    from dittrain.inference.open_run import diffusion_config

    assert diffusion_config(config).flow_time_scale == 1.0
    r = cli(*run_args(store, tmp_path / "d", "--flow-time-scale", 1, "--max-steps", 1))
    assert r.exit_code != 0 and "--flow-time-scale is a flow option" in one_error_line(r.output)
    assert not (tmp_path / "d").exists()
