"""The samplers and guidance of the published FIDs (dittrain/diffusion.py, and how every consumer gets them):
SiT's and REPA's Euler-Maruyama sampler (`--sampler sde`), the guidance interval (`--cfg-interval`), the
sampling grid's time shift (`--time-shift`), `dittrain sample --print-config` / `--config`.

Each is checked against the reference's own loop written out here in the reference's convention (REPA
samplers.py euler_maruyama_sampler / euler_sampler, sihyun-yu/REPA@67f714503e3892f993844aab088ffc5791c92613;
SiT transport Sampler.sample_sde with sample.py's SDE defaults, willisma/SiT@947f95bd3a510e9af441d38c1e9f72e0eee873c5;
LightningDiT inference.py + transport/integrators.py ode + models/lightningdit.py forward_with_cfg,
hustvl/LightningDiT@2725fed42a14898744433809949834e26957bcdd), then through sample, --npz, serve, the ONNX
engine and the trainer's evaluation, on tiny runs (test_sample.make_run)."""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from cliutil import dittrain, ok, one_error_line, run_args
from storeutil import tiny_store
from test_sample import make_run, read_png

from dittrain.diffusion import SDE_LAST_STEP, Diffusion, shift_t

pytestmark = pytest.mark.usefixtures("one_thread")
NULL = 3  # the null class of the affine stand-in model's 3 classes


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def velocity(x, t, y):
    """An affine stand-in for the network: v(x, t, y) on the model's 0..1000 time scale, so each
    term of a step can be written out by hand; the null class (3) differs from the others."""
    return 0.5 * x + t.view(-1, 1, 1, 1) / 1000 + 0.25 * y.to(x.dtype).view(-1, 1, 1, 1)


def flow() -> Diffusion:
    return Diffusion(objective="flow", learn_sigma=False)


# -----------------------------------------------------------------------------
# one SDE step, by hand


def test_two_sde_steps_by_hand():
    """steps=2: the grid is 1, 0.04, 0. One Euler-Maruyama step from t=1 (score -x: drift v + x; noise
    sqrt(w) sqrt(|dt|) z with w = 2t), then the last step from 0.04 to 0: the mean alone, no noise."""
    x0 = torch.randn(3, 2, 2, 2, generator=seeded(0))
    y = torch.tensor([0, 1, 2])
    g = seeded(7)
    ours = flow().sample(velocity, x0.shape, steps=2, sampler="sde", noise=x0, model_kwargs={"y": y}, generator=g)
    assert ours.dtype == torch.float32

    x = x0.double()
    yy = 0.25 * y.double().view(-1, 1, 1, 1)
    z = torch.randn(x.shape, generator=seeded(7), dtype=torch.float64)  # the one noise draw
    v1 = 0.5 * x + 1.0 + yy  # v at t = 1
    drift1 = v1 - 0.5 * (2 * 1.0) * (-((1 - 1.0) * v1 + x) / 1.0)  # v - (w/2) s, s = -((1-t) v + x) / t
    assert torch.allclose(drift1, v1 + x)
    x1 = x + drift1 * (0.04 - 1.0) + math.sqrt(2 * 1.0) * math.sqrt(0.96) * z
    v2 = 0.5 * x1 + 0.04 + yy  # v at t = 0.04
    drift2 = v2 - 0.5 * (2 * 0.04) * (-((1 - 0.04) * v2 + x1) / 0.04)
    assert torch.allclose(drift2, 1.96 * v2 + x1)
    x2 = x1 + drift2 * (0.0 - 0.04)  # the last step: no noise
    torch.testing.assert_close(ours, x2.float())
    # exactly one noise draw was taken from the generator: none on the last step
    ref = seeded(7)
    torch.randn(x.shape, generator=ref, dtype=torch.float64)
    assert torch.equal(g.get_state(), ref.get_state())


def repa_euler_maruyama(x, y, num_steps, cfg_scale, guidance_low, guidance_high, noise):
    """REPA's euler_maruyama_sampler (path_type linear), line by line in its own convention (its t is
    ours; its model takes t in [0, 1], the stand-in 1000 t), float64 state; `noise` gives eps_i."""
    t_steps = torch.cat([torch.linspace(1.0, 0.04, num_steps, dtype=torch.float64),
                         torch.tensor([0.0], dtype=torch.float64)])
    x_next = x.to(torch.float64)
    y_null = torch.full_like(y, NULL)

    def drift(x_cur, t_cur):
        guide = cfg_scale > 1.0 and guidance_low <= t_cur <= guidance_high
        model_input = torch.cat([x_cur] * 2) if guide else x_cur
        y_cur = torch.cat([y, y_null]) if guide else y
        time_input = torch.ones(model_input.size(0), dtype=torch.float64) * t_cur
        v_cur = velocity(model_input.float(), 1000 * time_input.float(), y_cur).double()
        t = time_input.view(-1, 1, 1, 1)
        alpha_t, d_alpha_t, sigma_t, d_sigma_t = 1 - t, -1.0, t, 1.0  # get_score_from_velocity, linear
        reverse_alpha_ratio = alpha_t / d_alpha_t
        var = sigma_t**2 - reverse_alpha_ratio * d_sigma_t * sigma_t
        s_cur = (reverse_alpha_ratio * v_cur - model_input) / var
        d_cur = v_cur - 0.5 * (2 * t_cur) * s_cur  # compute_diffusion(t) = 2 t
        if guide:
            cond, uncond = d_cur.chunk(2)
            d_cur = uncond + cfg_scale * (cond - uncond)
        return d_cur

    for t_cur, t_next in zip(t_steps[:-2], t_steps[1:-1], strict=True):
        dt = t_next - t_cur
        x_cur = x_next
        deps = next(noise) * torch.sqrt(torch.abs(dt))
        x_next = x_cur + drift(x_cur, float(t_cur)) * dt + torch.sqrt(2 * t_cur) * deps
    t_cur, t_next = t_steps[-2], t_steps[-1]
    return x_next + (t_next - t_cur) * drift(x_next, float(t_cur))


def draws(seed: int, shape):
    g = seeded(seed)
    while True:
        yield torch.randn(shape, generator=g, dtype=torch.float64)


def test_sde_is_repas_euler_maruyama_sampler_with_its_guidance_interval():
    x0 = torch.randn(4, 2, 3, 3, generator=seeded(1))
    y = torch.tensor([0, 1, 2, 1])
    for steps, cfg, interval in ((6, 1.8, (0.0, 0.7)), (9, 4.0, (0.2, 0.6)), (5, 1.0, (0.0, 1.0))):
        ours = flow().sample(velocity, x0.shape, steps=steps, sampler="sde", noise=x0, model_kwargs={"y": y},
                             uncond_kwargs={"y": torch.full_like(y, NULL)}, cfg_scale=cfg, cfg_interval=interval,
                             generator=seeded(3))
        theirs = repa_euler_maruyama(x0, y, steps, cfg, *interval, draws(3, x0.shape))
        torch.testing.assert_close(ours, theirs.float(), rtol=1e-5, atol=1e-5)


def test_sde_is_sits_sde_sampler_in_its_reversed_time():
    """SiT's sample_sde (Euler, diffusion_form sigma, norm 1, last_step Mean, last_step_size 0.04) with
    forward_with_cfg (the first 3 of 4 channels guided): t_SiT = 1 - t, its velocity is -ours."""
    x0 = torch.randn(2, 4, 2, 2, generator=seeded(2))
    y = torch.tensor([2, 0])
    cfg, num_steps, last = 4.0, 7, 0.04

    def v_sit(x, t_sit):  # forward_with_cfg on [x; x] with [y; null], as SiT's sample.py calls it
        out = velocity(torch.cat([x, x]).float(), 1000 * (1 - t_sit.repeat(2)).float(),
                       torch.cat([y, torch.full_like(y, NULL)])).double()
        out = -out  # v_SiT = d x / d t_SiT = -d x / d t
        cond, uncond = out[:2], out[2:]
        return torch.cat([uncond[:, :3] + cfg * (cond[:, :3] - uncond[:, :3]), cond[:, 3:]], dim=1)

    def sde_drift(x, t):  # drift + diffusion * score (ICPlan: alpha = t, sigma = 1 - t)
        v = v_sit(x, t)
        t4 = t.view(-1, 1, 1, 1)
        alpha_t, d_alpha_t, sigma_t, d_sigma_t = t4, 1.0, 1 - t4, -1.0
        reverse_alpha_ratio = alpha_t / d_alpha_t
        var = sigma_t**2 - reverse_alpha_ratio * d_sigma_t * sigma_t
        score = (reverse_alpha_ratio * v - x) / var
        return v + (1 - t4) * score  # diffusion_form "sigma": norm * sigma_t

    ts = torch.linspace(0.0, 1 - last, num_steps, dtype=torch.float64)  # t0 = 0, t1 = 1 - last_step_size
    dt = ts[1] - ts[0]
    x, noise = x0.double(), draws(5, x0.shape)
    for ti in ts[:-1]:  # __Euler_Maruyama_step
        t = torch.ones(x.size(0), dtype=torch.float64) * ti
        dw = next(noise) * torch.sqrt(dt)
        x = x + sde_drift(x, t) * dt + torch.sqrt(2 * (1 - t.view(-1, 1, 1, 1))) * dw
    x = x + sde_drift(x, torch.ones(x.size(0), dtype=torch.float64) * ts[-1]) * last  # last_step "Mean"

    ours = flow().sample(velocity, x0.shape, steps=num_steps, sampler="sde", noise=x0, model_kwargs={"y": y},
                         uncond_kwargs={"y": torch.full_like(y, NULL)}, cfg_scale=cfg, cfg_channels=3,
                         generator=seeded(5))
    torch.testing.assert_close(ours, x.float(), rtol=1e-5, atol=1e-5)


def test_sde_grid_and_the_shift_of_it():
    d = flow()
    assert d.flow_time_grid(5, "sde") == pytest.approx([1.0, 0.76, 0.52, 0.28, 0.04, 0.0])
    assert SDE_LAST_STEP == 0.04
    assert d.flow_time_grid(1, "sde") == [1.0, 0.0]  # one evaluation: the mean step from 1 to 0
    shifted = d.flow_time_grid(5, "sde", shift=3.0)
    assert shifted == pytest.approx([3 * u / (1 + 2 * u) for u in (1.0, 0.76, 0.52, 0.28, 0.04)] + [0.0])
    assert shifted[-1] == 0.0  # still ends exactly at 0: the last step stays the mean step


# -----------------------------------------------------------------------------
# the guidance interval


def recording(calls: list):
    """The stand-in model, recording (t in [0, 1], guided?) of each call: a guided call is the
    doubled batch [cond; uncond]."""

    def model(x, t, y):
        calls.append((float(t[0]) / 1000, bool((y == NULL).any())))
        return velocity(x, t, y)

    return model


def test_the_interval_follows_repas_condition_on_its_grid():
    """REPA's euler_sampler guides step i iff guidance_low <= t_cur <= guidance_high on linspace(1, 0,
    N+1): the same steps are guided here, including at the float64 grid's own rounding of 0.7 and 0.3."""
    y = torch.tensor([1, 2])
    x0 = torch.randn(2, 1, 2, 2, generator=seeded(0))
    for steps, lo, hi in ((10, 0.3, 0.7), (20, 0.0, 0.7), (7, 0.5, 1.0), (10, 0.35, 0.35)):
        grid = torch.linspace(1, 0, steps + 1, dtype=torch.float64)[:-1]
        repa = [bool(lo <= t <= hi) for t in grid]
        calls: list = []
        ours = flow().sample(recording(calls), x0.shape, steps=steps, sampler="euler", noise=x0,
                             model_kwargs={"y": y}, uncond_kwargs={"y": torch.full_like(y, NULL)}, cfg_scale=2.0,
                             cfg_interval=(lo, hi))
        assert [g for _, g in calls] == repa, (steps, lo, hi)
        # the samples: REPA's Euler loop, guided at those steps, the conditional pass alone elsewhere
        x = x0.double()
        for t_cur, t_next, guide in zip(grid, [*grid[1:], 0.0], repa, strict=True):
            tt = torch.full((2,), 1000 * float(t_cur))
            d = velocity(x.float(), tt, y).double()
            if guide:
                u = velocity(x.float(), tt, torch.full_like(y, NULL)).double()
                d = u + 2.0 * (d - u)
            x = x + (float(t_next) - float(t_cur)) * d
        torch.testing.assert_close(ours, x.float())


def test_the_interval_boundaries_are_inclusive_and_guidance_is_skipped_outside():
    d = flow()
    grid = d.flow_time_grid(10)
    y = torch.tensor([0])
    calls: list = []
    d.sample(recording(calls), (1, 1, 2, 2), steps=10, sampler="euler", model_kwargs={"y": y},
             uncond_kwargs={"y": torch.full_like(y, NULL)}, cfg_scale=3.0, cfg_interval=(grid[7], grid[3]),
             generator=seeded(0))
    assert [g for _, g in calls] == [False] * 3 + [True] * 5 + [False] * 2  # grid[3] .. grid[7], both ends
    # default: guided at every step; cfg 1: never (one pass each)
    for kw, want in (({"cfg_scale": 3.0}, [True] * 10), ({"cfg_scale": 1.0, "cfg_interval": (0.0, 1.0)}, [False] * 10)):
        calls.clear()
        d.sample(recording(calls), (1, 1, 2, 2), steps=10, sampler="euler", model_kwargs={"y": y},
                 uncond_kwargs={"y": torch.full_like(y, NULL)}, generator=seeded(0), **kw)
        assert [g for _, g in calls] == want
    # heun: a step is guided or not as a whole, by the t it starts from (REPA's heun)
    calls.clear()
    d.sample(recording(calls), (1, 1, 2, 2), steps=4, sampler="heun", model_kwargs={"y": y},
             uncond_kwargs={"y": torch.full_like(y, NULL)}, cfg_scale=3.0, cfg_interval=(0.0, 0.5),
             generator=seeded(0))
    assert [(round(t, 4), g) for t, g in calls] == [(1.0, False), (0.75, False), (0.75, False), (0.5, False),
                                                    (0.5, True), (0.25, True), (0.25, True), (0.0, True)]


def test_the_interval_on_a_ddpm_run_is_in_timestep_over_1000():
    d = Diffusion(objective="ddpm", learn_sigma=False)
    y = torch.tensor([1])
    seen: list = []

    def model(x, t, y):
        seen.append((int(t[0]), bool((y == NULL).any())))
        return torch.zeros_like(x)

    d.sample(model, (1, 1, 2, 2), steps=5, sampler="ddim", model_kwargs={"y": y},
             uncond_kwargs={"y": torch.full_like(y, NULL)}, cfg_scale=2.0, cfg_interval=(0.25, 0.5),
             generator=seeded(0))
    assert [t for t, _ in seen] == [999, 749, 500, 250, 0]
    assert [g for _, g in seen] == [0.25 <= t / 1000 <= 0.5 for t, _ in seen] == [False, False, True, True, False]


def test_lightningdits_interval_and_shift_are_ours_mapped():
    """LightningDiT's inference: ode euler on linspace(0, 1, N) (its t: 0 the noise), each time through
    compute_tm(t, s) = s t / (1 + (s - 1) t), and forward_with_cfg leaving a step unguided when its t <
    cfg_interval_start. In our time (t = 1 - t_SiT) that is --steps N-1 --time-shift 1/s
    --cfg-interval 0,1-c."""
    s, c, n = 0.3, 0.125, 26

    def compute_tm(t_n, timestep_shift):  # LightningDiT's transport/integrators.py, on its time
        return timestep_shift * t_n / (1 + (timestep_shift - 1) * t_n)

    for t in (0.0, 0.1, 0.5, 0.875, 1.0):  # the same map in our time: shift_t with S = 1 / s
        assert 1 - compute_tm(1 - t, s) == pytest.approx(shift_t(t, 1 / s), abs=1e-12)
    theirs = [compute_tm(u, s) for u in torch.linspace(0, 1, n).tolist()]  # float32 linspace, as theirs
    d = flow()
    ours = d.flow_time_grid(n - 1, "euler", shift=1 / s)
    assert ours == pytest.approx([1 - u for u in theirs], abs=1e-6)
    assert all(abs(t - (1 - c)) > 1e-6 for t in ours)  # no step sits on the boundary (float32 linspace there)
    y = torch.tensor([2])
    calls: list = []
    d.sample(recording(calls), (1, 1, 2, 2), steps=n - 1, sampler="euler", model_kwargs={"y": y},
             uncond_kwargs={"y": torch.full_like(y, NULL)}, cfg_scale=6.7, cfg_interval=(0.0, 1 - c),
             time_shift=1 / s, generator=seeded(0))
    assert [g for _, g in calls] == [not u < c for u in theirs[:-1]]
    assert [t for t, _ in calls] == pytest.approx(ours[:-1], abs=1e-4)  # the model sees the shifted times


# -----------------------------------------------------------------------------
# the time shift


def test_the_time_shift_of_sampling_defaults_to_the_runs_and_can_be_given():
    for s in (0.5, 3.0):
        assert flow().flow_time_grid(4, shift=s) == pytest.approx([s * u / (1 + (s - 1) * u)
                                                                    for u in (1.0, 0.75, 0.5, 0.25, 0.0)])
    trained = Diffusion(objective="flow", learn_sigma=False, t_shift=3.0)
    for time_shift, want in ((None, 3.0), (1.0, 1.0), (2.0, 2.0)):
        seen: list = []
        trained.sample(lambda x, t, seen=seen: seen.append(float(t[0]) / 1000) or torch.zeros_like(x), (1, 1, 2, 2),
                       steps=4, sampler="euler", time_shift=time_shift, generator=seeded(0))
        assert seen == pytest.approx([want * u / (1 + (want - 1) * u) for u in (1.0, 0.75, 0.5, 0.25)], abs=1e-6)
    with pytest.raises(ValueError, match="time_shift"):
        Diffusion(objective="ddpm").sample(lambda x, t: torch.zeros_like(x), (1, 1, 2, 2), steps=2, time_shift=2.0)
    with pytest.raises(ValueError, match="cfg_interval"):
        flow().sample(lambda x, t: torch.zeros_like(x), (1, 1, 2, 2), steps=2, cfg_interval=(0.8, 0.2))


# -----------------------------------------------------------------------------
# the command line: sample, --npz, serve, the ONNX engine, the trainer's evaluation


@pytest.fixture(scope="module")
def flow_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("flow")
    return make_run(root / "run", tiny_store(root / "store"), objective="flow")  # 16 px, 3 classes


SDE = ["--sampler", "sde", "--steps", 4, "--cfg", 3.0, "--cfg-interval", "0,0.5", "--time-shift", 2.0,
       "--class", "0,1,2", "--n", 3, "--device", "cpu", "--seed", 5]


def singles(out) -> list[np.ndarray]:
    return [read_png(p).astype(int) for p in sorted((Path(out) / "samples").glob("*.png"))]


def test_sample_with_the_sde_interval_and_shift_records_them(flow_run, tmp_path):
    r = ok(dittrain("sample", "--ckpt", flow_run, "--out", tmp_path / "a", *SDE),
           "sde, 4 steps, time shift 2, cfg 3 for t in [0, 0.5]")
    index = json.loads((tmp_path / "a" / "samples" / "samples.json").read_text())
    assert (index["sampler"], index["steps"], index["cfg_interval"], index["time_shift"]) == ("sde", 4, [0.0, 0.5], 2.0)
    a = singles(tmp_path / "a")
    # seeded and reproducible; every option changes the images
    ok(dittrain("sample", "--ckpt", flow_run, "--out", tmp_path / "b", *SDE))
    assert all(np.array_equal(x, y) for x, y in zip(a, singles(tmp_path / "b"), strict=True))
    for i, (flag, other) in enumerate((("--cfg-interval", "0,1"), ("--time-shift", 1.0), ("--seed", 6),
                                       ("--sampler", "euler"))):
        args = list(SDE)
        args[args.index(flag) + 1] = other
        ok(dittrain("sample", "--ckpt", flow_run, "--out", tmp_path / f"o{i}", *args))
        assert any(not np.array_equal(x, y) for x, y in zip(a, singles(tmp_path / f"o{i}"), strict=True)), flag
    assert "time shift" not in r.output.split("sde")[0]
    # defaults: guided everywhere, the run's shift (1), recorded as such
    ok(dittrain("sample", "--ckpt", flow_run, "--out", tmp_path / "d", "--n", 1, "--steps", 2, "--device", "cpu"))
    index = json.loads((tmp_path / "d" / "samples" / "samples.json").read_text())
    assert (index["sampler"], index["cfg_interval"], index["time_shift"]) == ("euler", [0.0, 1.0], 1.0)


def test_bad_sampling_options_are_one_line(pixel_run, flow_run, tmp_path):
    ddpm_run, _ = pixel_run
    base = ["--n", 1, "--steps", 2, "--device", "cpu", "--out", tmp_path / "x.png"]
    for bad, needle in (("0.8,0.2", "0 <= LO <= HI <= 1"), ("0,1.5", "0 <= LO <= HI <= 1"), ("0.7", "LO,HI"),
                        ("a,b", "LO,HI"), ("nan,1", "0 <= LO")):
        err = one_error_line(dittrain("sample", "--ckpt", flow_run, *base, "--cfg-interval", bad).output)
        assert "--cfg-interval" in err and needle in err, err
    err = one_error_line(dittrain("sample", "--ckpt", ddpm_run, *base, "--sampler", "sde").output)
    assert "'sde' does not fit the 'ddpm' objective" in err and "ddpm, ddim" in err
    err = one_error_line(dittrain("sample", "--ckpt", ddpm_run, *base, "--time-shift", 2).output)
    assert "--time-shift 2" in err and "flow" in err
    for bad in ("0", "-1", "inf"):
        assert "--time-shift" in one_error_line(dittrain("sample", "--ckpt", flow_run, *base, "--time-shift",
                                                         bad).output)
    assert not (tmp_path / "x.png").exists()


def test_print_config_resolves_and_reads_back(flow_run, tmp_path):
    recipe = tmp_path / "repa.toml"
    recipe.write_text('sampler = "sde"\nsteps = 250\ncfg = 1.8\ncfg-interval = "0,0.7"\nclass = ["0", "2"]\n')
    r = ok(dittrain("sample", "--config", recipe, "--steps", 3, "--print-config"))  # the flag wins over the file
    import tomllib

    printed = tomllib.loads(r.output)
    assert (printed["sampler"], printed["steps"], printed["cfg"], printed["cfg-interval"], printed["class"]) == (
        "sde", 3, 1.8, "0.0,0.7", ["0", "2"])
    assert printed["n"] == 16 and printed["cfg-channels"] == 0 and "time-shift" not in printed
    assert "left to the run: time-shift" in r.output
    # --npz resolves the FID protocol's defaults; what the run decides is named
    npz = tomllib.loads(ok(dittrain("sample", "--npz", tmp_path / "s.npz", "--print-config")).output)
    assert (npz["n"], npz["cfg"], npz["chunk-size"]) == (50_000, 1.5, 256) and "steps" not in npz
    # what it prints, --config reads back to the same settings
    (tmp_path / "printed.toml").write_text(r.output)
    assert ok(dittrain("sample", "--config", tmp_path / "printed.toml", "--print-config")).output == r.output
    # and sampling with the recipe uses it (flags still win)
    ok(dittrain("sample", "--config", recipe, "--ckpt", flow_run, "--steps", 3, "--n", 2, "--device", "cpu",
                "--out", tmp_path / "r"), "sde, 3 steps, cfg 1.8 for t in [0, 0.7]")
    index = json.loads((tmp_path / "r" / "samples" / "samples.json").read_text())
    assert [s["class"] for s in index["samples"]] == [0, 2] and index["cfg_interval"] == [0.0, 0.7]
    (tmp_path / "bad.toml").write_text('cfg-interval = [0, 0.7]\n')  # a list, not the text LO,HI
    assert "cfg-interval" in one_error_line(dittrain("sample", "--config", tmp_path / "bad.toml").output)


def test_npz_records_the_sampling_and_resumes_only_the_same(flow_run, tmp_path):
    job = ["--n", 4, "--chunk-size", 2, "--batch-size", 2, "--device", "cpu", "--seed", 1, "--sampler", "sde",
           "--steps", 3, "--cfg", 2.0]
    a = tmp_path / "a.npz"
    ok(dittrain("sample", "--ckpt", flow_run, "--npz", a, *job, "--cfg-interval", "0,0.5", "--time-shift", 2.0),
       "sde, 3 steps, time shift 2, cfg 2 for t in [0, 0.5]", "a.npz.json")
    record = json.loads((tmp_path / "a.npz.json").read_text())
    assert (record["sampler"], record["steps"], record["cfg_interval"], record["time_shift"]) == (
        "sde", 3, [0.0, 0.5], 2.0)
    ok(dittrain("sample", "--ckpt", flow_run, "--npz", tmp_path / "e.npz", *job))  # guided everywhere, shift 1
    assert json.loads((tmp_path / "e.npz.json").read_text())["time_shift"] == 1.0
    with np.load(a) as za, np.load(tmp_path / "e.npz") as ze:
        assert not np.array_equal(za["arr_0"], ze["arr_0"]) and np.array_equal(za["arr_1"], ze["arr_1"])
    # a job's parts hold its record: another interval or shift is refused naming the option ...
    parts = tmp_path / "b.npz.parts"
    parts.mkdir()
    (parts / "job.json").write_text(json.dumps(record))
    for extra, key, option in ((["--cfg-interval", "0,0.6", "--time-shift", 2.0], "cfg_interval", "--cfg-interval"),
                               (["--cfg-interval", "0,0.5"], "time_shift", "--time-shift")):
        err = one_error_line(dittrain("sample", "--ckpt", flow_run, "--npz", tmp_path / "b.npz", *job, *extra).output)
        assert f"{key} " in err and option in err, err
    # ... and the same settings continue it, to the same file
    ok(dittrain("sample", "--ckpt", flow_run, "--npz", tmp_path / "b.npz", *job, "--cfg-interval", "0,0.5",
                "--time-shift", 2.0), "0 of 2 chunks done")
    assert (tmp_path / "b.npz").read_bytes() == a.read_bytes()
    # a job recorded before these options existed drew with their defaults: it resumes with them
    old = json.loads((tmp_path / "e.npz.json").read_text())
    del old["cfg_interval"], old["time_shift"]
    (tmp_path / "c.npz.parts").mkdir()
    (tmp_path / "c.npz.parts" / "job.json").write_text(json.dumps(old))
    ok(dittrain("sample", "--ckpt", flow_run, "--npz", tmp_path / "c.npz", *job), "0 of 2 chunks done")


def test_serve_offers_the_sde_and_shows_the_command_of_its_images(flow_run, tmp_path):
    from test_serve import run_shown_command

    from dittrain.config import ServeConfig
    from dittrain.inference.serve import Request, Server

    server = Server(flow_run, ServeConfig(device="cpu", batch_size=2), log=lambda line: None)
    assert "sde" in server.samplers
    out = server.generate(Request(choice="1", n=3, steps=3, cfg_scale=3.0, sampler="sde", seed=4,
                                  cfg_interval="0,0.5", time_shift=2.0))
    assert out.ok, out.message
    args = shlex.split(out.command)
    for flag, value in (("--sampler", "sde"), ("--cfg-interval", "0.0,0.5"), ("--time-shift", "2.0"),
                        ("--batch-size", "2")):
        assert args[args.index(flag) + 1] == value, out.command
    assert all(np.array_equal(a, b) for a, b in zip(out.images, run_shown_command(out.command, tmp_path), strict=True))
    plain = server.generate(Request(choice="1", n=1, steps=2, seed=4))  # the defaults: no extra flags
    assert "--cfg-interval" not in plain.command and "--time-shift" not in plain.command
    for request, needle in ((Request(choice="1", cfg_interval="0.9,0.1"), "the CFG interval"),
                            (Request(choice="1", time_shift=-1.0), "the time shift must be")):
        bad = server.generate(request)
        assert not bad.ok and needle in bad.message and "\n" not in bad.message, bad.message


def test_serve_refuses_a_time_shift_on_a_ddpm_run(pixel_run):
    from dittrain.config import ServeConfig
    from dittrain.inference.serve import Request, Server

    server = Server(pixel_run[0], ServeConfig(device="cpu"), log=lambda line: None)
    out = server.generate(Request(choice="1", steps=2, time_shift=2.0))
    assert not out.ok and "flow runs" in out.message
    out = server.generate(Request(choice="1", steps=2, cfg_interval="0,0.5"))
    assert out.ok and "--cfg-interval 0.0,0.5" in out.command


def onnx_like_torch(run: Path, tmp_path: Path, args: list) -> dict:
    """`dittrain sample ARGS` with torch and with the run's ONNX export: the same pixels (within one
    level); the ONNX samples' index."""
    pytest.importorskip("onnxruntime")
    f = tmp_path / "dit.onnx"
    ok(dittrain("export", "--ckpt", run, "--format", "onnx", "--out", f))
    ok(dittrain("sample", "--ckpt", run, "--out", tmp_path / "t", *args))
    ok(dittrain("sample", "--engine", "onnx", "--onnx", f, "--out", tmp_path / "o", *args), "engine: onnxruntime")
    t, o = singles(tmp_path / "t"), singles(tmp_path / "o")
    assert max(int(np.abs(a - b).max()) for a, b in zip(t, o, strict=True)) <= 1
    return json.loads((tmp_path / "o" / "samples" / "samples.json").read_text())


def test_the_onnx_engine_samples_the_sde_with_interval_and_shift_like_torch(flow_run, tmp_path):
    index = onnx_like_torch(flow_run, tmp_path, SDE)
    assert (index["engine"], index["sampler"], index["cfg_interval"], index["time_shift"]) == (
        "onnx", "sde", [0.0, 0.5], 2.0)


def test_the_trainers_evaluation_samples_with_its_sampler_interval_and_shift(flow_run, tmp_path, monkeypatch):
    pytest.importorskip("torch_fidelity")
    from tiny import random_crops, save_random_inception

    from dittrain.config import EvalSection
    from dittrain.eval import INCEPTION_FILES
    from dittrain.inference import sample
    from dittrain.inference.open_run import load_model, open_run_store
    from dittrain.inference.weights import load_weights
    from dittrain.train.fid import TrainingEval

    inception = save_random_inception(tmp_path / INCEPTION_FILES[0])
    ref = tmp_path / "ref.npz"
    np.savez(ref, arr_0=random_crops(6, 16, seed=1))
    weights, config = load_weights(flow_run)
    store, _ = open_run_store(config)
    seen, real = [], sample.sample_images
    monkeypatch.setattr(sample, "sample_images", lambda *a, **k: seen.append(a[3]) or real(*a, **k))
    settings = EvalSection(eval_ref=str(ref), eval_n=4, eval_inception=str(inception), eval_steps=3,
                           eval_cfg=2.0, eval_batch_size=2, eval_sampler="sde", eval_cfg_interval="0.0,0.5",
                           eval_time_shift=2.0)
    rec = TrainingEval(settings, resolution=16, seed=3, objective="flow")(load_model(weights, config), config, store)
    assert (rec["eval_sampler"], rec["eval_cfg_interval"], rec["eval_time_shift"]) == ("sde", "0.0,0.5", 2.0)
    assert {(s.sampler, s.steps, s.cfg_scale, tuple(s.cfg_interval), s.time_shift) for s in seen} == {
        ("sde", 3, 2.0, (0.0, 0.5), 2.0)}
    default = TrainingEval(replace(settings, eval_sampler=None, eval_cfg_interval="0,1", eval_time_shift=None),
                           resolution=16, seed=3)(load_model(weights, config), config, store)
    assert (default["eval_sampler"], default["eval_cfg_interval"], default["eval_time_shift"]) == (
        "euler", "0.0,1.0", 1.0)


def test_run_refuses_an_eval_sampler_that_does_not_fit_before_the_first_step(tmp_path):
    from storeutil import make_store

    store = make_store(tmp_path / "store")
    eval_ = ["--eval-every", 2, "--eval-ref", tmp_path / "ref.npz", "--max-steps", 2]
    err = one_error_line(dittrain(*run_args(store, tmp_path / "a", *eval_, "--eval-sampler", "sde")).output)
    assert "--eval-sampler" in err and "'sde' does not fit the 'ddpm' objective" in err, err
    err = one_error_line(dittrain(*run_args(store, tmp_path / "b", *eval_, "--eval-time-shift", 2)).output)
    assert "--eval-time-shift 2" in err and "flow" in err, err
    err = one_error_line(dittrain(*run_args(store, tmp_path / "c", *eval_, "--eval-cfg-interval", "0.5,0.1")).output)
    assert "--eval-cfg-interval" in err, err
    assert not (tmp_path / "a" / "checkpoints").exists()


# -----------------------------------------------------------------------------
# dpm++ and unipc: diffusers' multistep schedulers, for both objectives

SCHEDULERS = {"dpm++": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++", "solver_type": "midpoint"}),
              "unipc": ("UniPCMultistepScheduler", {"solver_type": "bh2", "predict_x0": True})}


def diffusers_loop(name: str, objective: str, model, x, y, y_null, *, steps: int, cfg: float, shift: float = 1.0):
    """diffusers' own loop, as DiTPipeline writes it: the scheduler configured as dittrain/diffusion.py's
    docstring says, set_timesteps(steps), one guided pass of the doubled batch per timestep, the eps (or
    velocity) half handed to scheduler.step. Flow: the model sees 1000 x the scheduler's sigma_i."""
    diffusers = pytest.importorskip("diffusers")
    cls, extra = SCHEDULERS[name]
    common = dict(num_train_timesteps=1000, solver_order=2, lower_order_final=True, final_sigmas_type="zero",
                  timestep_spacing="linspace")
    if objective == "flow":
        kind = dict(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=shift)
    else:
        kind = dict(beta_start=1e-4, beta_end=0.02, beta_schedule="linear", prediction_type="epsilon")
    scheduler = getattr(diffusers, cls)(**common, **kind, **extra)
    scheduler.set_timesteps(steps)
    C = x.shape[1]
    for i, t in enumerate(scheduler.timesteps):
        time = float(scheduler.sigmas[i]) * 1000 if objective == "flow" else float(t)
        out = model(torch.cat([x, x]), torch.full((2 * len(x),), time), y=torch.cat([y, y_null]))
        cond, uncond = out[: len(x), :C], out[len(x):, :C]
        x = scheduler.step(uncond + cfg * (cond - uncond), t, x).prev_sample
    return x


@pytest.mark.parametrize("name, objective, t_shift, time_shift", [
    ("dpm++", "ddpm", 1.0, None), ("unipc", "ddpm", 1.0, None),
    ("dpm++", "flow", 3.0, None), ("unipc", "flow", 3.0, None), ("unipc", "flow", 3.0, 0.5)])
def test_dpmpp_and_unipc_give_diffusers_own_loop_exactly(name, objective, t_shift, time_shift):
    """A tiny DiT (ddpm: with a learned variance, whose half is ignored), CFG 2.5: our sample equals
    diffusers' loop bit for bit; flow: the run's t_shift is diffusers' flow_shift unless a time shift is given."""
    from test_diffusion import tiny_dit

    learn_sigma = objective == "ddpm"
    model = tiny_dit(learn_sigma=learn_sigma)
    d = Diffusion(objective=objective, learn_sigma=learn_sigma, t_shift=t_shift)
    y = torch.tensor([1, 5, 2])
    x_T = torch.randn(3, 4, 8, 8, generator=seeded(4))
    ours = d.sample(model, x_T.shape, steps=7, sampler=name, noise=x_T, cfg_scale=2.5, model_kwargs={"y": y},
                    uncond_kwargs=model.unconditional_kwargs({"y": y}), time_shift=time_shift)
    with torch.no_grad():
        theirs = diffusers_loop(name, objective, model, x_T, y, model.unconditional_kwargs({"y": y})["y"], steps=7,
                                cfg=2.5, shift=t_shift if time_shift is None else time_shift)
    assert torch.equal(ours, theirs)
    # seeded: the noise drawn from the generator is all there is
    a = d.sample(model, x_T.shape, steps=3, sampler=name, generator=seeded(0), model_kwargs={"y": y})
    assert torch.equal(a, d.sample(model, x_T.shape, steps=3, sampler=name, generator=seeded(0), model_kwargs={"y": y}))


def test_dpmpp_and_unipc_grids_guidance_interval_and_step_limits():
    y = torch.tensor([1])
    for name in ("dpm++", "unipc"):
        # flow: the model sees the scheduler's sigmas (the run's shift), guided where LO <= sigma <= HI
        d = Diffusion(objective="flow", learn_sigma=False, t_shift=2.0)
        grid = d.flow_time_grid(6, name)
        assert grid[-1] == 0.0 and all(a > b for a, b in zip(grid[:-1], grid[1:], strict=True))
        assert grid[1:-1] == pytest.approx([2 * u / (1 + u) for u in grid_before_shift(name, 6)[1:]], abs=1e-6)
        calls: list = []
        d.sample(recording(calls), (1, 1, 2, 2), steps=6, sampler=name, model_kwargs={"y": y},
                 uncond_kwargs={"y": torch.full_like(y, NULL)}, cfg_scale=3.0, cfg_interval=(0.2, 0.8),
                 generator=seeded(0))
        assert [t for t, _ in calls] == pytest.approx(grid[:-1], abs=1e-6)
        assert [g for _, g in calls] == [0.2 <= t <= 0.8 for t in grid[:-1]]
        # ddpm: diffusers' linspace timesteps, the interval in timestep / 1000; at most T - 1 steps
        d = Diffusion(objective="ddpm", learn_sigma=False)
        seen: list = []

        def model(x, t, y, seen=seen):
            seen.append((int(t[0]), bool((y == NULL).any())))
            return torch.zeros_like(x)

        d.sample(model, (1, 1, 2, 2), steps=5, sampler=name, model_kwargs={"y": y},
                 uncond_kwargs={"y": torch.full_like(y, NULL)}, cfg_scale=2.0, cfg_interval=(0.25, 0.5))
        assert seen == [(999, False), (799, False), (599, False), (400, True), (200, False)]
        with pytest.raises(ValueError, match="at most 999 steps"):
            d.sample(model, (1, 1, 2, 2), steps=1000, sampler=name)


def grid_before_shift(name: str, steps: int) -> list[float]:
    """diffusers' unshifted flow sigmas: dpm++ 1 - linspace(1, 1/1000, steps + 1) reversed, unipc
    linspace(1, 1/1000, steps + 1), each without its last value."""
    u = np.linspace(1, 1 / 1000, steps + 1)
    return list((1 - u)[::-1][:-1] if name == "dpm++" else u[:-1])


DPM = ["--sampler", "dpm++", "--steps", 5, "--cfg", 3.0, "--cfg-interval", "0,0.7", "--time-shift", 2.0,
       "--class", "0,1,2", "--n", 3, "--device", "cpu", "--seed", 5]


def test_sample_and_npz_take_dpmpp_and_unipc_for_both_objectives(pixel_run, flow_run, tmp_path, monkeypatch):
    r = ok(dittrain("sample", "--ckpt", flow_run, "--out", tmp_path / "a", *DPM), "dpm++, 5 steps, time shift 2")
    index = json.loads((tmp_path / "a" / "samples" / "samples.json").read_text())
    assert (index["sampler"], index["steps"], index["time_shift"]) == ("dpm++", 5, 2.0), r.output
    ok(dittrain("sample", "--ckpt", flow_run, "--out", tmp_path / "b", *DPM))
    assert all(np.array_equal(x, y) for x, y in zip(singles(tmp_path / "a"), singles(tmp_path / "b"), strict=True))
    unipc = [a if a != "dpm++" else "unipc" for a in DPM]
    ok(dittrain("sample", "--ckpt", flow_run, "--out", tmp_path / "u", *unipc), "unipc, 5 steps")
    assert any(not np.array_equal(x, y) for x, y in zip(singles(tmp_path / "a"), singles(tmp_path / "u"), strict=True))
    # a ddpm run: --npz with unipc, recorded; --steps 1000 refused in one line
    ddpm_run, _ = pixel_run
    job = ["--n", 2, "--chunk-size", 2, "--device", "cpu", "--seed", 1, "--sampler", "unipc", "--steps", 4]
    ok(dittrain("sample", "--ckpt", ddpm_run, "--npz", tmp_path / "s.npz", *job), "unipc, 4 steps")
    assert json.loads((tmp_path / "s.npz.json").read_text())["sampler"] == "unipc"
    base = ["--n", 1, "--device", "cpu", "--out", tmp_path / "x.png", "--sampler", "dpm++"]
    err = one_error_line(dittrain("sample", "--ckpt", ddpm_run, *base, "--steps", 1000).output)
    assert "at most 999 steps" in err, err
    # without diffusers: one line naming it, before any work
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "diffusers" else real(name, *a))
    err = one_error_line(dittrain("sample", "--ckpt", ddpm_run, *base, "--steps", 4).output)
    assert "DPMSolverMultistepScheduler" in err and "pip install diffusers" in err, err
    assert not (tmp_path / "x.png").exists()


def test_serve_and_the_trainers_evaluation_take_dpmpp_and_unipc(flow_run, pixel_run, tmp_path):
    from test_serve import run_shown_command

    from dittrain.config import ServeConfig
    from dittrain.diffusion import DiffusionConfig
    from dittrain.inference.sample import check_sampler
    from dittrain.inference.serve import Request, Server

    server = Server(flow_run, ServeConfig(device="cpu", batch_size=2), log=lambda line: None)
    assert {"dpm++", "unipc"} <= set(server.samplers)
    out = server.generate(Request(choice="1", n=2, steps=4, cfg_scale=3.0, sampler="unipc", seed=4, time_shift=2.0))
    assert out.ok, out.message
    args = shlex.split(out.command)
    assert args[args.index("--sampler") + 1] == "unipc"
    assert all(np.array_equal(a, b) for a, b in zip(out.images, run_shown_command(out.command, tmp_path), strict=True))
    ddpm = Server(pixel_run[0], ServeConfig(device="cpu"), log=lambda line: None)
    assert ddpm.generate(Request(choice="1", steps=3, sampler="dpm++")).ok
    # --eval-sampler goes through check_sampler (dittrain/train/fid.py), for either objective
    for objective in ("ddpm", "flow"):
        for name in ("dpm++", "unipc"):
            assert check_sampler(DiffusionConfig(objective=objective, learn_sigma=False), name, 20) == name


def test_the_onnx_engine_samples_dpmpp_like_torch(flow_run, tmp_path):
    assert onnx_like_torch(flow_run, tmp_path, DPM)["sampler"] == "dpm++"
