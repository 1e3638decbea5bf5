"""`dittrain plan --probe`: a few timed steps of one candidate on the actual device, with the
trainer's own step (dittrain.train.step.TrainStep: noise, AMP forward, loss, backward, clipping, the
optimizer dittrain.train.optim builds, EMA), on synthetic latents held on the device.

    result = probe(cfg, model_cfg, device, steps=3)      ProbeResult: s/step, first step, peak
    step, sched, loader = build(cfg, model_cfg, device)  the pieces, for a bench (bench/gpu_train.py)
    pending = run_steps(step, sched, loader, n)          n steps as dittrain.train.loop._loop runs them

Built as dittrain.train.loop._build builds a run: the model and its EMA, the loss terms and their
modules through their entries (dittrain.train.losses: --repa's projector, its targets synthetic:
int8 codes and a per-token scale, as a feature set stores them), the optimizer, the grad scaler
for fp16, --compile. The first step (compilation included) is
timed apart from the steady steps.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import sys
import time
from dataclasses import dataclass

import torch

from ditdata.common.devices import amp_dtype
from dittrain.config import TrainConfig
from dittrain.diffusion import Diffusion, DiffusionConfig
from dittrain.model.dit import DiT
from dittrain.model.lora import inject, settings_of
from dittrain.model.sizes import DiTConfig
from dittrain.train import losses
from dittrain.train.optim import build_optimizer, build_schedule
from dittrain.train.step import TrainStep, compile_model, compile_target


@dataclass(frozen=True)
class ProbeResult:
    seconds_per_step: float  # the median of the timed steps
    first_step_s: float  # the first step, torch.compile's compilation included
    peak_bytes: int | None  # torch.cuda.max_memory_allocated over the probe (CUDA), else None


class SyntheticLatents:
    """A synthetic store held on the device: `samples` random latents (fp16), labels and, with
    REPA targets, int8 codes and a per-token scale, as a feature set stores them. A batch is the
    next micro-batch of a fresh permutation per pass (an index_select, as the resident loader
    with the store on the GPU). An iterator of the trainer's batches: x (float32), y, feat,
    feat_scale; wait_seconds: the time spent in next(), as the trainer's loaders count it."""

    def __init__(self, model_cfg: DiTConfig, batch_size: int, device: torch.device, samples: int | None = None,
                 targets: tuple[int, int] | None = None):
        g = torch.Generator(device=device).manual_seed(0)
        n, c, s = max(samples or 2 * batch_size, batch_size), model_cfg.in_channels, model_cfg.input_size
        self.x = torch.randn((n, c, s, s), generator=g, device=device).to(torch.float16)
        self.y = (torch.randint(0, model_cfg.num_classes, (n,), generator=g, device=device)
                  if model_cfg.num_classes else None)
        self.feat = self.scale = None
        if targets is not None:  # (tokens, dims)
            self.feat = torch.randint(-127, 128, (n, *targets), generator=g, device=device, dtype=torch.int8)
            self.scale = torch.rand((n, targets[0]), generator=g, device=device) / 127
        self.gen, self.batch_size, self.pos, self.perm, self.wait_seconds = g, batch_size, n, None, 0.0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        t0 = time.perf_counter()
        if self.pos + self.batch_size > len(self.x):
            self.perm, self.pos = torch.randperm(len(self.x), generator=self.gen, device=self.x.device), 0
        idx = self.perm[self.pos:self.pos + self.batch_size]
        self.pos += self.batch_size
        batch = {"x": self.x.index_select(0, idx).float()}
        if self.y is not None:
            batch["y"] = self.y.index_select(0, idx)
        if self.feat is not None:
            batch["feat"], batch["feat_scale"] = self.feat.index_select(0, idx), self.scale.index_select(0, idx)
        self.wait_seconds += time.perf_counter() - t0
        return batch

    def close(self) -> None:
        pass


def build(cfg: TrainConfig, model_cfg: DiTConfig, device: torch.device, *, targets: tuple[int, int] | None = None,
          samples: int | None = None):
    """(TrainStep, LR schedule, loader) of one rank as dittrain.train.loop builds them. targets: the
    (tokens, dims) of the synthetic feature set (on the model's grid) a loss term reads (--repa's);
    samples: the synthetic store's size (default two micro-batches). The weights are initialised
    on the device itself (their values do not change speed or memory; an XL model made on the
    host takes seconds)."""
    torch.manual_seed(cfg.optim.seed)
    adapter = settings_of(cfg.lora)
    with device:
        model = DiT(model_cfg)
        if adapter is None:
            ema = DiT(model_cfg).requires_grad_(False)
    if adapter is not None:  # --lora: the adapter on the frozen base, an EMA of the adapter alone (as the loop)
        inject(model, adapter)
        ema = copy.deepcopy(model, {id(p): p for p in model.parameters() if not p.requires_grad})
        ema.requires_grad_(False)
    else:
        ema.load_state_dict(model.state_dict())
    ema.eval()
    # the run config's store section as dittrain.train.setup would record the synthetic feature set
    side = model_cfg.input_size // model_cfg.patch_size
    resolved = {"store": {"features": {"dims": targets[1], "grid": [side, side]}} if targets is not None else {}}
    if (name := losses.feature_set(cfg)) is not None and targets is None:
        raise ValueError(f"probe: a loss term reads feature set {name!r}: give targets=(tokens, dims)")
    built = losses.modules(cfg, model_cfg, resolved, device)
    terms = losses.build(cfg, model_cfg, resolved, built)
    opt = build_optimizer(cfg, [p for p in model.parameters() if p.requires_grad] + losses.trained(built), device)
    precision = amp_dtype(device, cfg.performance.amp)
    train_model = compile_model(model, compile_target(cfg.performance.compile, device), cfg.performance.compile_mode)
    diffusion = Diffusion(DiffusionConfig(objective=cfg.diffusion.objective, learn_sigma=model_cfg.learn_sigma))
    micro = cfg.optim.batch_size // cfg.optim.accumulation_steps
    step = TrainStep(model=model, train_model=train_model, ema=ema, optimizer=opt,
                     scaler=torch.amp.GradScaler(device.type, enabled=precision == torch.float16),
                     diffusion=diffusion, cfg=cfg, gen=torch.Generator(device=device).manual_seed(cfg.optim.seed),
                     device=device, amp_dtype=precision, terms=terms)
    return step, build_schedule(opt, cfg), SyntheticLatents(model_cfg, micro, device, samples, targets)


def run_steps(step: TrainStep, sched, loader, n: int, pending=None):
    """n optimizer steps as dittrain.train.loop._loop runs them: step k+1 queued before step k is
    settled (its EMA and LR schedule applied when kept)."""
    for _ in range(n):
        queued = step.backward(loader)
        if pending is not None and pending.settle()[0]:
            step.ema_update()
            sched.step()
        pending = step.update(queued)
    return pending


@contextlib.contextmanager
def _quiet_fd2():
    """fd 2 pointed at /dev/null: the profiler's C++ side (Kineto) prints profiler_start/stop
    lines there that no setting turns off."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def allocator_events(fn) -> list[tuple[int, int]]:
    """(time ns, bytes: + allocated, - freed) of every allocation and free of torch's CPU allocator
    while fn() ran, in order: torch.profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_fd2(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                  if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU)


def cpu_peak_bytes(fn) -> int:
    """The most bytes the CPU allocator held at once while fn() ran, counting only what it
    allocated in that time (run the whole setting inside fn: model, optimizer, steps): the CPU's
    counterpart of torch.cuda.max_memory_allocated."""
    live = peak = 0
    for _, nbytes in allocator_events(fn):
        live += nbytes
        peak = max(peak, live)
    return peak


def measured_peak(cfg: TrainConfig, model_cfg: DiTConfig, device: torch.device, *, steps: int = 2,
                  targets: tuple[int, int] | None = None) -> int:
    """The peak bytes of `steps` steps of this setting, everything built anew: on CUDA
    torch.cuda.max_memory_allocated, on the CPU the allocator's record (cpu_peak_bytes)."""
    if device.type == "cuda":
        return probe(cfg, model_cfg, device, steps=steps, targets=targets).peak_bytes

    def run():
        step, sched, loader = build(cfg, model_cfg, device, targets=targets)
        run_steps(step, sched, loader, steps).settle()

    return cpu_peak_bytes(run)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe(cfg: TrainConfig, model_cfg: DiTConfig, device: torch.device, *, steps: int = 3,
          targets: tuple[int, int] | None = None) -> ProbeResult:
    """Time `steps` steps after a first one (which compiles, with --compile) of this setting."""
    if device.type == "cuda":  # what an earlier probe left must not count
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    step, sched, loader = build(cfg, model_cfg, device, targets=targets)
    t0 = time.perf_counter()
    pending = run_steps(step, sched, loader, 1)
    pending.settle()
    sync(device)
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        pending = run_steps(step, sched, loader, 1, pending)
        pending.settle()
        sync(device)
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return ProbeResult(sorted(times)[len(times) // 2], first, peak)


__all__ = ["ProbeResult", "SyntheticLatents", "allocator_events", "build", "cpu_peak_bytes", "measured_peak", "probe",
           "run_steps"]
