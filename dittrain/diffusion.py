"""Diffusion objectives, noising, samplers and classifier-free guidance.

The model is an opaque callable `model(x_t, t, **model_kwargs) -> out` where t (N,) is a
float timestep on the 0..1000 scale (so the same timestep embedder serves both
objectives) and out has C channels, or 2C for ddpm with a learned variance.

Two objectives:

ddpm  (DDPM / improved DDPM, the DiT setting) linear betas 1e-4..0.02 over 1000 steps,
      x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps, the model predicts eps. With
      learn_sigma the model also outputs v in [-1, 1] that interpolates the log variance
      between the posterior variance and beta_t, trained by the hybrid loss
      L = MSE(eps) + vlb_weight * L_vlb(t), where L_vlb sees the mean with a stop-gradient
      (so only the variance learns from it). L_vlb(t) is the single-step KL in bits per
      dimension; with vlb_weight = 1 this is DiT's loss and equals improved DDPM's
      lambda = 0.001 on the T-step sum. loss_weighting "min-snr" (Hang et al. 2023,
      min-SNR-gamma for epsilon prediction) weights the MSE term by
      w(t) = min(SNR(t), gamma) / SNR(t), SNR(t) = abar_t / (1 - abar_t); the VLB term
      stays unweighted: L = w(t) MSE(eps) + vlb_weight * L_vlb(t).
flow  rectified flow: x_t = (1 - t) x0 + t eps, t in [0, 1], the model predicts the
      velocity eps - x0; t ~ logit-normal(mean, std) in training (SD3; t_sampling
      "uniform": t ~ U(0, 1)); the model sees 1000 t (flow_time_scale: 1 for SiT's t). t_shift S (SD3's resolution shift)
      maps every t, drawn in training and on the samplers' time grids alike (unless sampling
      is given its own time_shift), through shift_t(t) = S t / (1 + (S - 1) t) (S > 1: more
      time near the noise end; 1: none).

Samplers: "ddpm" (ancestral) and "ddim" (eta) for ddpm, "euler", "heun" and "sde" for flow,
"dpm++" and "unipc" for both, one entry each of SAMPLER_TABLE (name -> the objectives it serves,
the chain it walks, its time grid, its step); SAMPLERS is objective -> the names that fit it.
Everything random takes a torch.Generator, so a seed fixes samples and losses.

"dpm++" and "unipc" are diffusers' multistep solvers, run as they are (their own state, grid and
updates; nothing reimplemented): DPMSolverMultistepScheduler with algorithm_type "dpmsolver++"
(Lu et al. 2022, DPM-Solver++(2M): solver_order 2, "midpoint", a first-order last step to sigma 0)
and UniPCMultistepScheduler (Zhao et al. 2023, UniPC: its predictor and corrector, B(h) "bh2",
order 2, data prediction). Order 2 and bh2 are what both papers and diffusers recommend for guided
sampling. `steps` is the number of model evaluations (the corrector reuses the next evaluation).
  ddpm: epsilon prediction on our linear betas (beta_start..beta_end over num_timesteps), the
        variance half of a learn_sigma model dropped (an ODE solver has no use for it; diffusers'
        DiTPipeline drops it the same way); timestep_spacing "linspace": `steps` integer timesteps
        from T-1 down, rounded from linspace(0, T-1, steps + 1) without its 0, the spacing of
        diffusers' DiT-lineage configs (PixArt-alpha/Sigma, SANA) and, on a 1000-step discrete
        schedule, DPM-Solver's "time uniform" grid (the DPM-Solver++ paper's choice for guided
        sampling). The model sees the integer timestep, as in training. At most T - 1 steps (T
        would repeat a rounded timestep).
  flow: use_flow_sigmas with prediction_type "flow_prediction": diffusers' flow sigma is our t and
        its flow_prediction (x0 = x_t - sigma v) is our velocity eps - x0 exactly; flow_shift is the
        sampling time shift S (the run's t_shift unless time_shift is given), diffusers' map
        S s / (1 + (S - 1) s) being our shift_t. The grids are diffusers' own: dpm++ from
        shift_t(1 - 1/1000), unipc from shift_t(1) less 1e-6 (both avoid log(alpha = 0)), down to 0.
        The model sees flow_time_scale x sigma_i (float32), the time the solver assumes; diffusers'
        pipelines hand the model `timesteps` (1000 sigma_i cast to int64), up to 1/1000 off in t.
The guidance interval's t is timestep / T (ddpm) or sigma_i (flow), as for the other chains.

"sde" is the Euler-Maruyama sampler of SiT and REPA (REPA's samplers.py euler_maruyama_sampler,
sihyun-yu/REPA@67f7145; SiT's transport Sampler.sample_sde with its defaults, willisma/SiT@947f95b).
The conventions map onto ours as follows. REPA's linear path is ours exactly: x_t = (1 - t) x0 +
t eps, t = 1 the noise, the model predicts the velocity eps - x0 (its model sees t in [0, 1],
ours 1000 t: only the embedder's scale). SiT's (and LightningDiT's) time runs the other way:
x_t = t x0 + (1 - t) eps, t_SiT = 0 the noise, so t_SiT = 1 - t and v_SiT = -v. With the score
of the linear path s(x, t) = -((1 - t) v + x) / t and the diffusion coefficient w(t) = 2 t
(REPA's compute_diffusion = g^2; SiT's diffusion_form "sigma", norm 1: w = sigma_t = t, noise
sqrt(2 w)), each step from t to t_next < t is
    x <- x + (v - (w / 2) s) (t_next - t) + sqrt(w) sqrt(t - t_next) z,    z ~ N(0, I)
on the grid linspace(1, 0.04, steps) (`steps` model evaluations), and the last step, from 0.04
to 0, is the mean alone: x + (v - (w / 2) s) (0 - 0.04), no noise (REPA's "last step"; SiT's
last_step "Mean", last_step_size 0.04). The state is kept in float64 and the model sees it in
the noise's dtype, as REPA does. Guidance is applied to v before the drift is formed: REPA
guides the drift, which is the same since the drift is affine in v with the same x for both.

Guidance interval (cfg_interval (LO, HI), guidance_interval): classifier-free guidance only at
evaluations whose t lies in LO <= t <= HI, t in [0, 1] with 1 the noise end (flow: its t, the
exact grid value; ddpm: timestep / T), the conditional pass alone elsewhere (one forward of
the batch, not of the doubled one). REPA's guidance_low, guidance_high are (LO, HI) as they
are (its t is ours, both ends inclusive); LightningDiT's cfg_interval_start c (guidance where
t_SiT >= c) is (0, 1 - c). A Heun step is guided or not as a whole, by the t it starts from
(REPA's euler_sampler with heun). The default (0, 1) guides everywhere.

Time shift of sampling (time_shift S, default the run's t_shift): the flow grid's times go
through shift_t(t, S). LightningDiT's timestep_shift s (its transport/integrators.py ode,
hustvl/LightningDiT@2725fed: t_SiT -> s t_SiT / (1 + (s - 1) t_SiT) on linspace(0, 1, N)) is
our shift_t with S = 1 / s: 1 - shift_t_SiT(1 - t, s) = t / (s + (1 - s) t) = shift_t(t, 1 / s).

Public API:
    DiffusionConfig, Diffusion(config), Diffusion.q_sample, Diffusion.training_loss,
    Diffusion.sample, guided(model_fn, cfg_scale, cond_kwargs, uncond_kwargs), guidance_interval,
    score_from_velocity, SAMPLER_TABLE, SAMPLERS.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dittrain.config import LOSS_WEIGHTINGS, OBJECTIVES, T_SAMPLINGS  # the torch-free choice lists

ModelFn = Callable[..., torch.Tensor]


# RAE's dimension-dependent shift (Zheng et al. 2025, bytetriper/RAE @ a4d18c4 configs/stage2/training:
# time_dist_shift_dim = C H W of the latent, time_dist_shift_base 4096, the shift their square root's
# ratio): S = sqrt(C H W / 4096), 4096 being SD-VAE's 4 x 32 x 32 at 256 px, where S = 1. --t-shift auto
SHIFT_BASE_DIMS = 4096


def dimension_shift(latent_shape, base: int = SHIFT_BASE_DIMS) -> float:
    """S = sqrt(prod(latent_shape) / base): 6.93 for RAE's 768 x 16 x 16, 1 for SD-VAE's 4 x 32 x 32."""
    return math.sqrt(math.prod(int(n) for n in latent_shape) / base)


def shift_t(t, shift: float):
    """SD3's timestep shift t' = S t / (1 + (S - 1) t) of flow times t in [0, 1] (a tensor
    or a float); S = 1 is the identity, 0 and 1 stay put."""
    if shift == 1.0:
        return t
    return shift * t / (1 + (shift - 1) * t)


@dataclass(frozen=True)
class DiffusionConfig:
    objective: str = "ddpm"  # "ddpm" | "flow"
    num_timesteps: int = 1000  # ddpm training steps (flow's timestep scale: flow_time_scale)
    beta_start: float = 1e-4
    beta_end: float = 0.02
    learn_sigma: bool = True  # ddpm only: must match the model's learn_sigma
    vlb_weight: float = 1.0  # weight of the per-step VLB term in the hybrid loss
    logit_normal_mean: float = 0.0  # flow: t = sigmoid(N(mean, std))
    logit_normal_std: float = 1.0
    loss_weighting: str = "none"  # ddpm: none | min-snr (weight min(SNR, gamma) / SNR on the MSE)
    min_snr_gamma: float = 5.0
    t_sampling: str = "logit-normal"  # flow: logit-normal | uniform
    # flow: the model's timestep input is t x this. 1000 is DiT's embedder scale and SD3's; SiT, REPA and
    # LightningDiT feed t itself (1): the same sinusoid at 1000x lower frequencies, so another network
    flow_time_scale: float = 1000.0
    t_shift: float = 1.0  # flow: t -> S t / (1 + (S - 1) t) in training and sampling; 1: none

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be 'ddpm' or 'flow', got {self.objective!r}")
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"loss_weighting must be one of {LOSS_WEIGHTINGS}, got {self.loss_weighting!r}")
        if self.t_sampling not in T_SAMPLINGS:
            raise ValueError(f"t_sampling must be one of {T_SAMPLINGS}, got {self.t_sampling!r}")
        if self.loss_weighting == "min-snr" and self.objective != "ddpm":
            raise ValueError("min-snr loss weighting is for the ddpm objective (epsilon prediction)")
        if not self.min_snr_gamma > 0:
            raise ValueError(f"min_snr_gamma must be > 0, got {self.min_snr_gamma}")
        for name in ("t_shift", "flow_time_scale"):  # scales: finite and > 0
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"{name} must be a finite number > 0, got {getattr(self, name)}")
        if self.objective != "flow" and (self.t_shift != 1.0 or self.t_sampling != "logit-normal"):
            raise ValueError("t_shift and t_sampling are flow options (ddpm draws integer steps uniformly)")
        if not self.logit_normal_std > 0:
            raise ValueError(f"logit_normal_std must be > 0, got {self.logit_normal_std}")
        if self.objective != "flow" and self.flow_time_scale != 1000.0:
            raise ValueError("--flow-time-scale is a flow option (ddpm's model sees its step index 0..999)")

    @property
    def default_sampler(self) -> str:
        return "ddpm" if self.objective == "ddpm" else "euler"


# -----------------------------------------------------------------------------
# Classifier-free guidance


def guided(
    model_fn: ModelFn, cfg_scale: float, cond_kwargs: dict, uncond_kwargs: dict | None,
    channels: int | None = None,
) -> ModelFn:
    """A model callable (x, t) -> out that applies classifier-free guidance with ONE
    forward pass on the doubled batch [cond; uncond]:
        out = uncond + cfg_scale * (cond - uncond)
    Guidance applies to the first C channels (C = x's channels: eps or velocity); extra
    channels (the learned variance of ddpm) are taken from the conditional pass, as DiT
    does. cfg_scale == 1 (or no uncond_kwargs) is the plain conditional model.
    channels: guide only the first `channels` of the C (the rest conditional). The released
    facebookresearch/DiT (and SiT) samplers guide the first 3 of 4 latent channels, "for exact
    reproducibility" of their FIDs; channels=3 reproduces their numbers, None guides all C."""
    if cfg_scale == 1.0 or uncond_kwargs is None:
        return lambda x, t: model_fn(x, t, **cond_kwargs)
    if set(cond_kwargs) != set(uncond_kwargs):
        raise ValueError(
            f"cond and uncond kwargs differ: {sorted(cond_kwargs)} vs {sorted(uncond_kwargs)}"
        )

    def both(a, b, n):
        if a is None:
            return None
        b = b.to(a.device)
        if b.shape[0] != n:  # an unbatched uncond (e.g. the empty caption) serves every row
            b = b.expand(n, *a.shape[1:])
        return torch.cat([a, b])

    def fn(x, t):
        n = x.shape[0]
        C = x.shape[1] if channels is None else min(channels, x.shape[1])
        kwargs = {k: both(v, uncond_kwargs[k], n) for k, v in cond_kwargs.items()}
        out = model_fn(torch.cat([x, x]), torch.cat([t, t]), **kwargs)
        cond, uncond = out[:n], out[n:]
        g = uncond[:, :C] + cfg_scale * (cond[:, :C] - uncond[:, :C])
        return torch.cat([g, cond[:, C:]], dim=1)

    return fn


def in_interval(level: float, interval) -> bool:
    """Whether t = `level` (in [0, 1], 1 the noise end) is inside the guidance interval (LO, HI),
    both ends included (REPA: guidance_low <= t <= guidance_high); None: everywhere."""
    return interval is None or interval[0] <= level <= interval[1]


def guidance_interval(guided_fn: ModelFn, plain_fn: ModelFn, interval) -> Callable:
    """A sampling model function (x, t, level) -> out: `guided_fn(x, t)` (classifier-free
    guidance) where `level`, the evaluation's t in [0, 1] (1: the noise end), lies in
    interval = (LO, HI), `plain_fn(x, t)` (the conditional pass alone) elsewhere; None or
    (0, 1): guided_fn everywhere. The chains give `level` from their exact grid, so a
    boundary (REPA's 0.7) is compared with the grid's own float64 value."""
    if interval is None or (interval[0] <= 0.0 and interval[1] >= 1.0):
        return lambda x, t, level: guided_fn(x, t)
    return lambda x, t, level: (guided_fn if in_interval(level, interval) else plain_fn)(x, t)


# -----------------------------------------------------------------------------
# Helpers


def _randn(shape, generator: torch.Generator | None, device, dtype=torch.float32):
    # draw where the generator lives, then move: a CPU generator gives the same numbers
    # whatever device the model runs on
    gen_device = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=gen_device, dtype=dtype).to(device)


# Each float64 schedule table is copied to a device once, not at every lookup: a host-to-GPU
# copy of a pageable tensor blocks the host, several times per training step otherwise.
# Keyed by id(table) with the table kept alive beside its copy, so an id is never reused.
_ON_DEVICE: dict = {}


def _table_on(values: torch.Tensor, device) -> torch.Tensor:
    # a schedule table's copy on `device` (made once)
    if values.device != device:
        key = (id(values), device)
        if key not in _ON_DEVICE:
            _ON_DEVICE[key] = (values, values.to(device))
        values = _ON_DEVICE[key][1]
    return values


def _bcast(values: torch.Tensor, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # values (S,) float64 table, idx (N,) -> (N, 1, 1, 1) in x's dtype for broadcasting
    values = _table_on(values, x.device)
    out = values[idx.to(x.device)].to(x.dtype)
    return out.view(-1, *([1] * (x.dim() - 1)))


def flow_velocity(x0, noise):
    """The flow objective's target: the velocity d x_t / dt = noise - x0 of the path
    x_t = (1 - t) x0 + t noise (q_sample); what a loss on the velocity compares the output with."""
    return noise - x0


def mean_flat(x):
    return x.flatten(1).mean(dim=1)


def normal_kl(mean1, logvar1, mean2, logvar2):
    """KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)), element-wise, in nats."""
    return 0.5 * (
        -1.0
        + logvar2
        - logvar1
        + torch.exp(logvar1 - logvar2)
        + (mean1 - mean2) ** 2 * torch.exp(-logvar2)
    )


def _approx_std_normal_cdf(x):
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def discretized_gaussian_log_likelihood(x, means, log_scales):
    """log p(x) of data in [-1, 1] quantised to 256 bins under N(means, e^(2 log_scales)):
    the t = 0 decoder term of the VLB (improved DDPM; DiT keeps it for latents)."""
    centered = x - means
    inv_std = torch.exp(-log_scales)
    cdf_plus = _approx_std_normal_cdf(inv_std * (centered + 1.0 / 255.0))
    cdf_min = _approx_std_normal_cdf(inv_std * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(
        x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_delta)
    )


class _Schedule:
    """Posterior terms of a DDPM chain over an ascending subset of the training timesteps
    (all of them in training, a respaced subset when sampling with fewer steps). Derived
    from abar at the kept steps, as improved DDPM's respacing does: beta_i = 1 - abar_i /
    abar_{i-1}. Tables are float64 on the CPU."""

    def __init__(self, alphas_cumprod: torch.Tensor, timesteps: torch.Tensor):
        self.timesteps = timesteps  # (S,) int64, the model's timestep for each index
        ac = alphas_cumprod[timesteps]
        ac_prev = torch.cat([ac.new_ones(1), ac[:-1]])
        self.alphas_cumprod, self.alphas_cumprod_prev = ac, ac_prev
        self.betas = 1.0 - ac / ac_prev
        self.sqrt_recip_ac = torch.sqrt(1.0 / ac)
        self.sqrt_recipm1_ac = torch.sqrt(1.0 / ac - 1.0)
        # q(x_{i-1} | x_i, x0) = N(coef1 x0 + coef2 x_i, posterior_variance)
        self.posterior_variance = self.betas * (1.0 - ac_prev) / (1.0 - ac)
        # the variance is 0 at i = 0; clip the log there to the next value (improved DDPM)
        pv = self.posterior_variance
        self.posterior_log_variance_clipped = torch.log(torch.cat([pv[1:2], pv[1:]]))
        self.posterior_mean_coef1 = self.betas * torch.sqrt(ac_prev) / (1.0 - ac)
        self.posterior_mean_coef2 = (1.0 - ac_prev) * torch.sqrt(1.0 - self.betas) / (1.0 - ac)
        # "fixed large" variance (beta, with the first clipped), DiT's choice without learn_sigma
        self.fixed_large_log_variance = torch.log(torch.cat([pv[1:2], self.betas[1:]]))
        self.log_betas = torch.log(self.betas)

    def predict_x0(self, x_t, i, eps):
        return _bcast(self.sqrt_recip_ac, i, x_t) * x_t - _bcast(self.sqrt_recipm1_ac, i, x_t) * eps

    def q_posterior(self, x0, x_t, i):
        mean = (
            _bcast(self.posterior_mean_coef1, i, x_t) * x0
            + _bcast(self.posterior_mean_coef2, i, x_t) * x_t
        )
        return mean, _bcast(self.posterior_log_variance_clipped, i, x_t)

    def p_mean_logvar(self, out, x_t, i, learn_sigma: bool):
        """The model's p(x_{i-1} | x_i): mean from the predicted eps, log variance from v."""
        C = x_t.shape[1]
        eps = out[:, :C]
        if learn_sigma:
            # v in [-1, 1] interpolates log variance between the posterior's and beta's
            frac = (out[:, C:] + 1) / 2
            min_log = _bcast(self.posterior_log_variance_clipped, i, x_t)
            max_log = _bcast(self.log_betas, i, x_t)
            logvar = frac * max_log + (1 - frac) * min_log
        else:
            logvar = _bcast(self.fixed_large_log_variance, i, x_t).expand_as(x_t)
        x0 = self.predict_x0(x_t, i, eps)
        mean, _ = self.q_posterior(x0, x_t, i)
        return mean, logvar, x0, eps


# -----------------------------------------------------------------------------
# The diffusion process


class Diffusion:
    def __init__(self, config: DiffusionConfig | None = None, **overrides):
        config = config or DiffusionConfig(**overrides)
        self.config = config
        T = config.num_timesteps
        # schedule in float64: 1 - abar_t is tiny at small t and float32 would lose it
        self.betas = torch.linspace(config.beta_start, config.beta_end, T, dtype=torch.float64)
        self.alphas_cumprod = torch.cumprod(1.0 - self.betas, dim=0)
        self.train_schedule = _Schedule(self.alphas_cumprod, torch.arange(T))
        self.sqrt_ac, self.sqrt_1m_ac = torch.sqrt(self.alphas_cumprod), torch.sqrt(1 - self.alphas_cumprod)

    @property
    def learn_sigma(self) -> bool:
        return self.config.objective == "ddpm" and self.config.learn_sigma

    def model_timesteps(self, t: torch.Tensor) -> torch.Tensor:
        """What the model sees: ddpm step index as float, flow t in [0, 1] times flow_time_scale."""
        if self.config.objective == "flow":
            return t.float() * self.config.flow_time_scale
        return t.float()

    # --- noising ---

    def sample_timesteps(self, n: int, generator=None, device="cpu") -> torch.Tensor:
        """ddpm: uniform integers 0..T-1; flow: logit-normal (or uniform) t in (0, 1),
        then shifted by t_shift."""
        c = self.config
        gen_device = generator.device if generator is not None else device  # drawn there, then moved (_randn)
        if c.objective == "flow":
            if c.t_sampling == "uniform":
                t = torch.rand((n,), generator=generator, device=gen_device).to(device)
            else:
                t = torch.sigmoid(c.logit_normal_mean + c.logit_normal_std * _randn((n,), generator, device))
            return shift_t(t, c.t_shift)
        return torch.randint(
            0, self.config.num_timesteps, (n,), generator=generator, device=gen_device
        ).to(device)

    def snr(self, t: torch.Tensor) -> torch.Tensor:
        """ddpm: SNR(t) = abar_t / (1 - abar_t) at integer steps t, float64 on t's device."""
        ac = _table_on(self.alphas_cumprod, t.device)[t]
        return ac / (1 - ac)

    def loss_weights(self, t: torch.Tensor) -> torch.Tensor | None:
        """The per-sample weight of the MSE term (None: unweighted). min-snr (ddpm, eps):
        min(SNR(t), gamma) / SNR(t), i.e. 1 at noisy steps and gamma / SNR at clean ones."""
        if self.config.loss_weighting != "min-snr":
            return None
        snr = self.snr(t)
        return torch.clamp(snr, max=self.config.min_snr_gamma) / snr

    def flow_time_grid(self, steps: int, sampler: str = "euler", shift: float | None = None) -> list[float]:
        """The times a flow sampler steps through, from 1 (noise) to 0 (data): its grid
        (euler, heun: `steps` uniform intervals; sde: linspace(1, 0.04, steps), then 0), each
        time shifted by `shift` (None: the run's t_shift); dpm++, unipc: the diffusers
        scheduler's sigmas, shifted by it (flow_shift), ending at 0."""
        shift = self.config.t_shift if shift is None else shift
        method = SAMPLER_TABLE[sampler]
        if method.chain == "scheduler":
            return self._scheduler(method, steps, shift).sigmas.double().tolist()
        return shift_t(method.grid(steps), shift).tolist()

    def q_sample(self, x0, t, noise):
        """x_t from x0: ddpm sqrt(abar_t) x0 + sqrt(1 - abar_t) noise (t int);
        flow (1 - t) x0 + t noise (t float in [0, 1])."""
        if self.config.objective == "flow":
            t = t.to(x0.dtype).view(-1, *([1] * (x0.dim() - 1)))
            return (1 - t) * x0 + t * noise
        return _bcast(self.sqrt_ac, t, x0) * x0 + _bcast(self.sqrt_1m_ac, t, x0) * noise

    # --- training ---

    def training_loss(
        self,
        model: ModelFn,
        x0,
        model_kwargs=None,
        *,
        t=None,
        noise=None,
        generator=None,
        return_terms: bool = False,
    ):
        """Per-sample loss (N,) for a batch of clean latents x0 (N, C, H, W).
        t and noise are drawn from `generator` unless given. With return_terms, a dict
        {"loss", "mse", "vb"} of (N,) tensors (vb only with a learned variance; mse is the
        unweighted MSE, loss the weighted sum)."""
        model_kwargs = model_kwargs or {}
        N, C = x0.shape[:2]
        if t is None:
            t = self.sample_timesteps(N, generator, x0.device)
        if noise is None:
            noise = _randn(x0.shape, generator, x0.device, x0.dtype)
        x_t = self.q_sample(x0, t, noise)
        out = model(x_t, self.model_timesteps(t), **model_kwargs)
        self._check_channels(out, C)
        terms = {}
        if self.config.objective == "flow":
            terms["mse"] = mean_flat((out.float() - flow_velocity(x0, noise).float()) ** 2)
            terms["loss"] = terms["mse"]
        else:
            terms["mse"] = mean_flat((out[:, :C].float() - noise.float()) ** 2)
            weights = self.loss_weights(t)
            terms["loss"] = terms["mse"] if weights is None else weights.to(terms["mse"]) * terms["mse"]
            if self.learn_sigma:  # the VLB term is never weighted
                # stop-gradient on the eps part: the VLB term trains only the variance
                frozen = torch.cat([out[:, :C].detach(), out[:, C:]], dim=1).float()
                terms["vb"] = self._vb_bits(frozen, x0.float(), x_t.float(), t)
                terms["loss"] = terms["loss"] + self.config.vlb_weight * terms["vb"]
        return terms if return_terms else terms["loss"]

    def _vb_bits(self, out, x0, x_t, t):
        """The VLB term L_t in bits per dimension: KL(q(x_{t-1}|x_t,x0) || p(x_{t-1}|x_t))
        for t > 0 and the decoder NLL -log p(x0|x1) at t = 0."""
        s = self.train_schedule
        true_mean, true_logvar = s.q_posterior(x0, x_t, t)
        mean, logvar, _, _ = s.p_mean_logvar(out, x_t, t, learn_sigma=True)
        kl = mean_flat(normal_kl(true_mean, true_logvar, mean, logvar)) / math.log(2.0)
        nll = -mean_flat(discretized_gaussian_log_likelihood(x0, mean, 0.5 * logvar)) / math.log(
            2.0
        )
        return torch.where(t.to(kl.device) == 0, nll, kl)

    def _check_channels(self, out, C):
        want = 2 * C if self.learn_sigma else C
        if out.shape[1] != want:
            hint = (
                "flow and ddpm without learn_sigma want learn_sigma=False in the model"
                if want == C
                else "ddpm with learn_sigma wants learn_sigma=True in the model"
            )
            raise ValueError(
                f"model returned {out.shape[1]} channels for {C}-channel input, expected {want}: {hint}"
            )

    # --- sampling ---

    def respaced_timesteps(self, steps: int) -> torch.Tensor:
        """`steps` training timesteps evenly spread over 0..T-1, ascending, both ends
        included (DiT's respacing for e.g. "250")."""
        T = self.config.num_timesteps
        if not 1 <= steps <= T:
            raise ValueError(f"steps must be in 1..{T}, got {steps}")
        if steps == 1:
            return torch.tensor([T - 1])
        return torch.unique(
            torch.round(torch.linspace(0, T - 1, steps, dtype=torch.float64)).long()
        )

    @torch.no_grad()
    def sample(
        self,
        model: ModelFn,
        shape,
        *,
        steps: int = 50,
        sampler: str | None = None,
        cfg_scale: float = 1.0,
        cfg_channels: int | None = None,
        cfg_interval: tuple[float, float] | None = None,
        time_shift: float | None = None,
        model_kwargs: dict | None = None,
        uncond_kwargs: dict | None = None,
        generator: torch.Generator | None = None,
        device=None,
        noise=None,
        eta: float = 0.0,
    ):
        """Draw samples x0 of `shape` (N, C, H, W).

        model: the network, called model(x, t, **kwargs) (put it in eval mode first so
            label dropout is off); cfg_scale > 1 batches the unconditional pass given by
            uncond_kwargs (e.g. DiT.unconditional_kwargs(model_kwargs, empty_text)).
        sampler: "ddpm" (ancestral) or "ddim" (eta: 0 deterministic, 1 ~ ancestral) for
            the ddpm objective; "euler", "heun" (2 evaluations per step) or "sde" (SiT/REPA's
            Euler-Maruyama, `steps` evaluations) for flow; "dpm++" or "unipc" (diffusers'
            multistep solvers, `steps` evaluations) for either.
        cfg_interval: (LO, HI): guidance only where LO <= t <= HI (t in [0, 1], 1 the noise;
            ddpm: timestep / T); None: everywhere (module docstring).
        time_shift: flow: the grid's shift S (None: the run's t_shift).
        generator: the only source of randomness (initial noise, ancestral and SDE noise)."""
        sampler = sampler or self.config.default_sampler
        method = SAMPLER_TABLE.get(sampler)
        if method is None or self.config.objective not in method.objectives:
            raise ValueError(
                f"sampler {sampler!r} does not fit objective {self.config.objective!r}; "
                f"choose one of {SAMPLERS[self.config.objective]}"
            )
        if steps < method.min_steps:
            raise ValueError(f"{sampler} sampling needs at least {method.min_steps} steps, got {steps}")
        most = method.max_steps(self.config)
        if most is not None and steps > most:
            raise ValueError(f"{sampler} sampling takes at most {most} steps on this schedule, got {steps}")
        if time_shift is not None and not (self.config.objective == "flow" and 0 < time_shift < math.inf):
            raise ValueError(f"time_shift is a finite number > 0 for the flow objective, got {time_shift}")
        if cfg_interval is not None and not 0.0 <= cfg_interval[0] <= cfg_interval[1] <= 1.0:
            raise ValueError(f"cfg_interval must be (LO, HI) with 0 <= LO <= HI <= 1, got {cfg_interval}")
        if device is None:
            if noise is not None:
                device = noise.device
            elif isinstance(model, torch.nn.Module):
                device = next(model.parameters()).device
            else:
                device = "cpu"
        cond = model_kwargs or {}
        fn = guidance_interval(guided(model, cfg_scale, cond, uncond_kwargs, channels=cfg_channels),
                               guided(model, 1.0, cond, None), cfg_interval)
        x = noise.to(device) if noise is not None else _randn(tuple(shape), generator, device)
        if method.chain == "ddpm":
            return self._ddpm_chain(fn, x, steps, method.update, generator=generator, eta=eta)
        if method.chain == "scheduler":
            return self._scheduler_chain(fn, x, steps, method, shift=time_shift)
        return self._flow_chain(fn, x, steps, method, sampler, generator=generator, shift=time_shift)

    def _ddpm_chain(self, fn, x, steps, update, *, generator, eta: float):
        """Walk the respaced DDPM chain from the last kept step to 0; `update` makes each step.
        fn(x, t, level): level = timestep / T, the guidance interval's t."""
        s = _Schedule(self.alphas_cumprod, self.respaced_timesteps(steps))
        C, T = x.shape[1], self.config.num_timesteps
        for i in reversed(range(len(s.timesteps))):
            idx = torch.full((x.shape[0],), i, dtype=torch.long)
            t = torch.full((x.shape[0],), float(s.timesteps[i]), device=x.device)
            out = fn(x, t, float(s.timesteps[i]) / T).to(x.dtype)
            self._check_channels(out, C)
            x = update(s, x, out, i, idx, learn_sigma=self.learn_sigma, generator=generator, eta=eta)
        return x

    def _flow_chain(self, fn, x, steps, method, sampler, *, generator=None, shift=None):
        """Integrate from t = 1 (noise) to t = 0 (data) on the sampler's grid, shifted
        (flow_time_grid); method.update makes each step from the velocity field v(x, t), whose
        guidance is decided at t (or at `guide_at`: a Heun step's start). The state is kept in
        method.state_dtype (sde: float64) and handed to the model in the noise's dtype."""
        ts = self.flow_time_grid(steps, sampler, shift)
        n, dtype = x.shape[0], x.dtype
        state = method.state_dtype or dtype

        def v(x, t, guide_at=None):
            tt = torch.full((n,), t * self.config.flow_time_scale, device=x.device)
            out = fn(x.to(dtype), tt, t if guide_at is None else guide_at).to(state)
            self._check_channels(out, x.shape[1])
            return out

        x = x.to(state)
        for t, t_next in zip(ts[:-1], ts[1:], strict=True):
            x = method.update(v, x, t, t_next, generator=generator)
        return x.to(dtype)

    def _scheduler(self, method, steps: int, shift: float | None):
        """A fresh diffusers scheduler for `method` (dpm++, unipc) on this objective, its grid set
        for `steps` evaluations (module docstring: the settings and why)."""
        c = self.config
        if c.objective == "flow":
            kind = dict(use_flow_sigmas=True, prediction_type="flow_prediction",
                        flow_shift=float(c.t_shift if shift is None else shift))
        else:
            kind = dict(beta_start=c.beta_start, beta_end=c.beta_end, beta_schedule="linear",
                        prediction_type="epsilon")
        scheduler = method.update(num_train_timesteps=c.num_timesteps, timestep_spacing="linspace",
                                  final_sigmas_type="zero", lower_order_final=True, solver_order=2, **kind)
        scheduler.set_timesteps(steps)
        return scheduler

    def _scheduler_chain(self, fn, x, steps, method, *, shift=None):
        """diffusers' own denoising loop around its scheduler: at each of its timesteps one model
        evaluation (guided or not by the interval, at timestep / T or sigma_i), the first C channels
        (eps or velocity) handed to scheduler.step. Deterministic: nothing is drawn."""
        scheduler = self._scheduler(method, steps, shift)
        scheduler.set_begin_index(0)  # step i is index i, even where flow's int64 timesteps repeat
        n, C, dtype = x.shape[0], x.shape[1], x.dtype
        flow = self.config.objective == "flow"
        for i, step_t in enumerate(scheduler.timesteps):
            if flow:  # the solver's own sigma_i, not the timestep rounded down to an integer
                level = float(scheduler.sigmas[i])
                t = torch.full((n,), level * self.config.flow_time_scale, device=x.device)
            else:
                level = float(step_t) / self.config.num_timesteps
                t = torch.full((n,), float(step_t), device=x.device)
            out = fn(x, t, level).to(dtype)
            self._check_channels(out, C)
            x = scheduler.step(out[:, :C], step_t, x).prev_sample.to(dtype)
        return x


# -----------------------------------------------------------------------------
# Samplers: one entry of SAMPLER_TABLE each (its chain and its step); add one there, its
# name to dittrain.config.SAMPLERS (the CLI's choices; a test keeps the two equal) and a test.


def _ancestral_step(s: _Schedule, x, out, i, idx, *, learn_sigma, generator, eta):
    """ddpm: x_{i-1} ~ p(x_{i-1} | x_i), the model's mean plus its noise (none on the last step)."""
    mean, logvar, _, _ = s.p_mean_logvar(out, x, idx, learn_sigma)
    x = mean
    if i > 0:  # no noise on the last step
        x = x + torch.exp(0.5 * logvar) * _randn(x.shape, generator, x.device, x.dtype)
    return x


def _ddim_step(s: _Schedule, x, out, i, idx, *, learn_sigma, generator, eta):
    """ddim: x0 and eps from the prediction, re-noised to step i-1 (eta 0: deterministic)."""
    C = x.shape[1]
    eps = out[:, :C]
    x0 = s.predict_x0(x, idx, eps)
    ac, ac_prev = s.alphas_cumprod[i], s.alphas_cumprod_prev[i]
    sigma = eta * math.sqrt((1 - ac_prev) / (1 - ac)) * math.sqrt(1 - ac / ac_prev)
    x = math.sqrt(ac_prev) * x0 + math.sqrt(max(1 - ac_prev - sigma**2, 0.0)) * eps
    if sigma > 0:
        x = x + sigma * _randn(x.shape, generator, x.device, x.dtype)
    return x


def _euler_step(v, x, t: float, t_next: float, *, generator=None):
    dt = t_next - t  # negative
    return x + dt * v(x, t)


def _heun_step(v, x, t: float, t_next: float, *, generator=None):
    """Euler's prediction, then the mean of the slopes at both ends (2 evaluations); guided or
    not as a whole, by t (REPA's euler_sampler with heun decides both by t_cur)."""
    dt = t_next - t  # negative
    d = v(x, t)
    x_euler = x + dt * d
    return x + dt * 0.5 * (d + v(x_euler, t_next, guide_at=t))


def _uniform_grid(steps: int) -> torch.Tensor:
    """euler, heun: `steps` uniform intervals from t = 1 to 0 (float64)."""
    return torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)


# sde: where the stochastic steps end and the last, deterministic one starts (REPA's t_steps
# linspace(1., 0.04, num_steps); SiT's --last-step-size 0.04, one stride of 250 steps over [0, 1])
SDE_LAST_STEP = 0.04


def _sde_grid(steps: int) -> torch.Tensor:
    """sde: linspace(1, 0.04, steps) then 0 (float64): steps - 1 Euler-Maruyama steps, then the
    mean step to 0; `steps` model evaluations in all (REPA's --num-steps)."""
    return torch.cat([torch.linspace(1.0, SDE_LAST_STEP, steps, dtype=torch.float64),
                      torch.zeros(1, dtype=torch.float64)])


def score_from_velocity(v, x, t: float):
    """The score grad log p_t(x) of the linear path x_t = (1 - t) x0 + t eps from its velocity
    v = eps - x0 (REPA's get_score_from_velocity, path "linear": alpha = 1 - t, sigma = t, so
    (alpha / alpha') v - x over sigma^2 - (alpha / alpha') sigma' sigma = t): -((1 - t) v + x) / t."""
    return -((1.0 - t) * v + x) / t


def sde_diffusion(t: float) -> float:
    """w(t) = 2 t, the squared diffusion coefficient of the reverse SDE (REPA's compute_diffusion;
    SiT's diffusion_form "sigma", norm 1: w = sigma_t = t in its time, the noise sqrt(2 w))."""
    return 2.0 * t


def _euler_maruyama_step(v, x, t: float, t_next: float, *, generator=None):
    """sde: one Euler-Maruyama step of dx = (v - w/2 s) dt + sqrt(w) dW from t to t_next < t
    (module docstring); the step to t_next = 0 is the mean alone, no noise (REPA's last step)."""
    dt = t_next - t  # negative
    vel = v(x, t)
    w = sde_diffusion(t)
    drift = vel - 0.5 * w * score_from_velocity(vel, x, t)
    mean = x + drift * dt
    if t_next == 0.0:
        return mean
    z = _randn(x.shape, generator, x.device, x.dtype)
    return mean + math.sqrt(w) * math.sqrt(-dt) * z


def _diffusers_scheduler(name: str) -> Callable:
    """A diffusers scheduler class by name, imported when a sampler is built (diffusers is an
    extra: `--help` and the other samplers never import it)."""

    def make(**config):
        try:
            import diffusers
        except ModuleNotFoundError:
            raise ModuleNotFoundError(f"this sampler runs diffusers' {name}: pip install diffusers "
                                      "(it comes with ditkit's vae, data and export extras)") from None
        return getattr(diffusers, name)(**config)

    make.__name__ = name
    return make


@dataclass(frozen=True)
class Sampler:
    """A sampling method: the objectives it serves, the chain it walks ("ddpm": the respaced
    posterior chain; "flow": a time grid of the velocity field; "scheduler": a diffusers
    multistep scheduler's own loop, for either objective), its step (for "scheduler": the
    scheduler's constructor), and for a flow chain its grid (steps -> float64 times from 1 to 0,
    before the time shift) and the dtype its state is kept in (None: the noise's); `needs`: the
    module it imports (None: torch alone)."""

    objectives: tuple[str, ...]
    chain: str
    update: Callable
    about: str
    grid: Callable | None = None
    state_dtype: torch.dtype | None = None
    needs: str | None = None

    @property
    def min_steps(self) -> int:
        """The respaced posterior chain needs a previous step to step to; an ODE grid does not."""
        return 2 if self.chain == "ddpm" else 1

    def max_steps(self, config: DiffusionConfig) -> int | None:
        """The most steps on `config`'s schedule (None: no limit): T for the respaced chain; T - 1
        for a scheduler on the ddpm objective (its linspace spacing repeats a rounded timestep at T)."""
        if config.objective != "ddpm":
            return None
        return config.num_timesteps - (self.chain == "scheduler")


SAMPLER_TABLE: dict[str, Sampler] = {
    "ddpm": Sampler(("ddpm",), "ddpm", _ancestral_step, "ancestral DDPM (DiT's)"),
    "ddim": Sampler(("ddpm",), "ddpm", _ddim_step, "DDIM (eta: 0 deterministic, 1 ~ ancestral)"),
    "euler": Sampler(("flow",), "flow", _euler_step, "Euler steps of the flow ODE", _uniform_grid),
    "heun": Sampler(("flow",), "flow", _heun_step, "Heun's method (2 evaluations per step)", _uniform_grid),
    "sde": Sampler(("flow",), "flow", _euler_maruyama_step,
                   "Euler-Maruyama of the reverse SDE, w(t) = 2t, last step the mean (SiT's, REPA's)",
                   _sde_grid, torch.float64),
    "dpm++": Sampler(OBJECTIVES, "scheduler", _diffusers_scheduler("DPMSolverMultistepScheduler"),
                     "DPM-Solver++(2M), diffusers' DPMSolverMultistepScheduler (dpmsolver++)", needs="diffusers"),
    "unipc": Sampler(OBJECTIVES, "scheduler", _diffusers_scheduler("UniPCMultistepScheduler"),
                     "UniPC (bh2, order 2), diffusers' UniPCMultistepScheduler", needs="diffusers"),
}
# objective -> the names of its samplers, in table order
SAMPLERS = {o: tuple(n for n, m in SAMPLER_TABLE.items() if o in m.objectives) for o in OBJECTIVES}


__all__ = ["LOSS_WEIGHTINGS", "OBJECTIVES", "SAMPLERS", "SAMPLER_TABLE", "SDE_LAST_STEP", "T_SAMPLINGS", "Diffusion",
           "DiffusionConfig", "Sampler", "guidance_interval", "guided", "in_interval", "mean_flat", "normal_kl",
           "score_from_velocity", "sde_diffusion", "shift_t"]
