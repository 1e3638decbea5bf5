"""One optimizer step, queued on the device without the host waiting for it.

    TrainStep.backward(loader)   micro-batches: noise, t, dropout, AMP forward, loss, backward
    TrainStep.update(pending)    unscale, clip, the optimizer step (skipped ON THE DEVICE when
                                 the loss or the gradient norm is NaN/inf), the verdict copied
                                 to pinned host memory behind an event
    Attempt.settle()             the host reads that verdict (ok, stop), waiting only for the
                                 step it belongs to
    TrainStep.ema_update()       EMA: e <- d e + (1 - d) p, for a step that was kept

Why this shape: reading a device scalar on the host (`bool(isfinite(loss))`, `loss.item()`)
waits for everything queued so far, so the GPU idles while Python prepares the next step;
for a small DiT that idle time is a large share of the step. Here the loop
(dittrain.train.loop._loop) queues step k+1's forward and backward BEFORE it settles step k, so
the one wait per step is for a step that is already done by the time the device starts the
next one. What needs the verdict on the host (the step counter, the LR schedule, the EMA, the
non-finite counters, logging) happens at the settle; what must not wait for it (skipping a
poisoned update) is decided on the device: torch's fused AdamW takes a `found_inf` tensor
and leaves parameters, moments and its step count untouched when it is 1 (what GradScaler
uses). The EMA is updated after the settle, one step late in time but from the same
parameters (step k+1's forward and backward do not change them), so the result is the same
as updating it right after the optimizer step. An optimizer without device-side skipping
(bitsandbytes' 8-bit AdamW) falls back to a host read of the verdict before its step.

Scalars (loss, grad norm, the loss terms' metrics) stay on the device; dittrain.train.log.Log
reads them every --log-every steps only. With several ranks the loss, the metrics and every
rank's stop request travel in one all-reduce per step (a collective on the device stream, not a
host read), so every rank settles the same verdict.

Loss terms (dittrain.train.losses: one entry of LOSS_TERMS each, e.g. --repa's alignment): each
is called on every micro-batch with the forward (losses.Forward: the model's output and, when a
term reads them, the hidden tokens of its block, which the forward then also returns), and the
backward takes the diffusion loss + the terms' weighted losses. A term's module (REPA's
projector) steps and is clipped with the model (its parameters after the model's; not in the
EMA). Pending.loss stays the diffusion loss (comparable with plain runs); the terms' metrics ride
beside it (Pending.metrics, {name: () tensor}), in the same all-reduce, and a non-finite one
skips the step as a non-finite loss does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ditdata.common.devices import autocast
from ditdata.common.errors import UserError
from ditdata.store import TEXT_FIELDS
from dittrain.config import COMPILE_MODES, COMPILE_TARGETS, TrainConfig
from dittrain.data.latent_norm import LatentNorm
from dittrain.diffusion import Diffusion
from dittrain.model.dit import drop_text_conditioning
from dittrain.model.routing import draw, keep_rows, route_of
from dittrain.train.losses import Forward, hidden_block


@dataclass
class Pending:
    """Step k's forward and backward, queued: the mean loss over micro-batches (this rank's)."""

    loss: torch.Tensor  # () fp32, on the device
    stop: bool  # this rank was asked to stop (SIGTERM/SIGINT) before the step
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # the loss terms': {name: () fp32}, on the device
    # (B, C, H, W) of each micro-batch's latents, this rank's: a bucketed store's differ (the logs show them)
    shapes: tuple[tuple[int, ...], ...] = ()


class Attempt:
    """An optimizer step queued on the device; `settle()` gives its verdict on the host."""

    def __init__(self, loss: torch.Tensor, grad_norm: torch.Tensor, ok: torch.Tensor, stop: torch.Tensor,
                 metrics: dict[str, torch.Tensor] | None = None, shapes: tuple[tuple[int, ...], ...] = ()):
        self.loss, self.grad_norm = loss, grad_norm  # () device tensors: mean over ranks; total norm
        self.shapes = shapes  # Pending.shapes: the micro-batches' latent shapes
        self.metrics = metrics or {}  # the loss terms': {name: () device tensor}, mean over ranks
        dev = ok.device
        # [ok, stop] copied behind the step's own work: waiting on the event waits for this
        # step only, never for work queued after it
        self._host = torch.empty(2, pin_memory=dev.type == "cuda")
        self._host.copy_(torch.stack([ok.float(), stop.float()]), non_blocking=dev.type == "cuda")
        self._event = None
        if dev.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        self._verdict: tuple[bool, bool] | None = None

    def settle(self) -> tuple[bool, bool]:
        """(kept: the update was applied, stop: some rank asked the run to stop)."""
        if self._verdict is None:
            if self._event is not None:
                self._event.synchronize()
            ok, stop = self._host.tolist()
            self._verdict = (ok > 0.5, stop > 0.5)
        return self._verdict


class TrainStep:
    """The optimizer step of dittrain run, for the loop and for bench/gpu_train.py alike.

    model: the DiT whose parameters train (the EMA follows it); train_model: what the forward
    calls (the model, compiled, in DDP); ema: the EMA copy. cfg: batch size, accumulation,
    clipping, EMA decay, dropout rates (TrainConfig). Every rank draws the noise, timesteps
    and dropout of the GLOBAL micro-batch from `gen` and keeps its slice, so N ranks compute
    what one process would. terms: the loss terms as the step calls them (dittrain.train.losses.build;
    their modules train with the model). --route (cfg.routing, dittrain.model.routing): each
    micro-batch's kept tokens, drawn from `gen` too. captions: --caption-mix
    (dittrain.train.captionmix.CaptionMix): the loader brings every mixed caption set's tokens, and
    each sample's set is drawn here, seeded by the loader's batch index (not from `gen`).
    """

    def __init__(self, *, model, train_model, ema, optimizer, scaler, diffusion: Diffusion, cfg: TrainConfig,
                 gen: torch.Generator, device: torch.device, amp_dtype: torch.dtype | None,
                 norm: LatentNorm | None = None, empty_text: dict | None = None, rank: int = 0, world: int = 1,
                 terms: Sequence = (), captions=None):
        self.train_model, self.optimizer, self.scaler, self.diffusion = train_model, optimizer, scaler, diffusion
        self.cfg, self.gen, self.device, self.amp_dtype = cfg, gen, device, amp_dtype
        self.norm, self.empty_text, self.world, self.terms = norm, empty_text or {}, world, tuple(terms)
        self.captions = captions  # --caption-mix (dittrain.train.captionmix.CaptionMix): each sample's set, or None
        self.hidden = hidden_block(self.terms)  # the block whose tokens the forward returns for them, or None
        self.route, self.patch = route_of(cfg.routing), model.config.patch_size  # --route, or None
        # clipped together: one total norm over the model's and the terms' modules' gradients
        self.params = [p for p in model.parameters() if p.requires_grad] + [
            p for term in self.terms if term.module is not None for p in term.module.parameters() if p.requires_grad]
        # the EMA follows the trained parameters (a frozen one, pos_embed or a --lora run's base, is its own average)
        pairs = [(e, p) for e, p in zip(ema.parameters(), model.parameters(), strict=True) if p.requires_grad]
        self.ema_params, self.model_params = [e for e, _ in pairs], [p for _, p in pairs]
        self.per_rank = cfg.optim.batch_size // (world * cfg.optim.accumulation_steps)
        self.mine = slice(rank * self.per_rank, (rank + 1) * self.per_rank)
        self.max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        self.device_skip = bool(getattr(optimizer, "_step_supports_amp_scaling", False))

    def backward(self, loader, *, stop: bool = False) -> Pending:
        """Zero the gradients, then forward and backward every micro-batch of the next step."""
        cfg, world, device, gen = self.cfg, self.world, self.device, self.gen
        self.optimizer.zero_grad(set_to_none=True)
        global_micro = self.per_rank * world
        loss_sum = torch.zeros((), device=device)
        metric_sums: dict[str, torch.Tensor] = {}
        shapes = []
        for micro in range(cfg.optim.accumulation_steps):
            batch = next(loader)
            if self.captions is not None:  # each sample's caption set, drawn for the loader's batch index
                batch = self.captions.pick(batch, loader.batches - 1, global_micro, self.mine)
            x0 = batch["x"] if self.norm is None else self.norm.normalize(batch["x"])  # on the device
            shapes.append(tuple(x0.shape))
            noise = torch.randn((global_micro, *x0.shape[1:]), generator=gen, device=device)[self.mine]
            t = self.diffusion.sample_timesteps(global_micro, generator=gen, device=device)[self.mine]
            u = torch.rand(global_micro, generator=gen, device=device)[self.mine]
            kwargs = conditioning(batch, self.empty_text, cfg, u)
            if self.route is not None:  # --route: the kept tokens, drawn like the noise (exact resume)
                # T of this batch's grid (a bucketed store's batches differ in shape)
                tokens = (x0.shape[-2] // self.patch) * (x0.shape[-1] // self.patch)
                kwargs["route"] = keep_rows(draw(self.route, global_micro, tokens, gen, device), self.mine)
            sync = micro == cfg.optim.accumulation_steps - 1 or world == 1
            with contextlib.nullcontext() if sync else self._no_sync():
                with autocast(device, self.amp_dtype):
                    total, loss, metrics = self._losses(batch, x0, kwargs, t, noise)
                self.scaler.scale(total / cfg.optim.accumulation_steps).backward()
            loss_sum += loss.detach()
            for name, value in metrics.items():  # fp32 (a term under autocast may give bf16), for the all-reduce
                value = value.detach().float()
                metric_sums[name] = metric_sums[name] + value if name in metric_sums else value
        acc = cfg.optim.accumulation_steps
        return Pending(loss_sum / acc, stop, {name: v / acc for name, v in metric_sums.items()}, tuple(shapes))

    def _losses(self, batch: dict, x0, kwargs: dict, t, noise):
        """(what the backward takes, the diffusion loss, the loss terms' metrics {name: ()})."""
        if not self.terms:
            loss = self.diffusion.training_loss(self.train_model, x0, kwargs, t=t, noise=noise).mean()
            return loss, loss, {}
        fwd = Forward(self.train_model, self.hidden, batch, x0, t, noise, kwargs)  # the loss sees the output only
        loss = self.diffusion.training_loss(fwd, x0, kwargs, t=t, noise=noise).mean()
        total, metrics = loss, {}
        for term in self.terms:
            weighted, figures = term(fwd)
            total, metrics = total + weighted, metrics | figures
        return total, loss, metrics

    def _no_sync(self):
        """DDP's no_sync of the model and of the terms' modules (accumulation steps)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.train_model.no_sync())
        for term in self.terms:
            if term.train_module is not None:
                stack.enter_context(term.train_module.no_sync())
        return stack

    def update(self, pending: Pending) -> Attempt:
        """Clip and step, unless the loss or the gradient norm is non-finite (decided on the
        device); the returned Attempt settles the verdict."""
        loss, stop, metrics = pending.loss, torch.full((), float(pending.stop), device=self.device), pending.metrics
        if self.world > 1:  # the mean loss (and the terms' metrics) and "any rank stops" in one collective
            both = torch.stack([loss, stop, *metrics.values()])
            dist.all_reduce(both, op=dist.ReduceOp.SUM)
            loss, stop = both[0] / self.world, both[1] > 0
            metrics = dict(zip(metrics, (both[2:] / self.world).unbind(), strict=True))
        if self.scaler.is_enabled():
            self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        ok = torch.isfinite(loss) & torch.isfinite(grad_norm)  # the same on every rank (DDP's gradients are)
        if metrics:  # a term's metrics are its loss and figures of it: non-finite with it
            ok = ok & torch.isfinite(torch.stack(list(metrics.values()))).all()
        self._gated_step(ok)
        if self.scaler.is_enabled():  # fp16: the scale backs off after inf/NaN gradients
            self.scaler.update()
        return Attempt(loss, grad_norm, ok, stop, metrics, pending.shapes)

    def _gated_step(self, ok: torch.Tensor) -> None:
        opt = self.optimizer
        if not self.device_skip:  # e.g. bitsandbytes: only the host can skip its step
            if bool(ok):
                opt.step()
            return
        opt.grad_scale, opt.found_inf = None, (~ok).float()  # gradients are already unscaled
        try:
            opt.step()
        finally:
            del opt.grad_scale, opt.found_inf

    @torch.no_grad()
    def ema_update(self) -> None:
        """e <- d e + (1 - d) p for the step just settled as kept."""
        torch._foreach_lerp_(self.ema_params, self.model_params, 1.0 - self.cfg.optim.ema)


class CompileError(UserError, ValueError):
    """A --compile or --compile-mode value torch.compile does not have here (one line)."""


def compile_target(knob: str, device: torch.device) -> str:
    """--compile as what gets compiled: "off", "blocks" or "model" (auto: blocks on CUDA, off
    on the CPU, where compiling costs more time than a short run saves)."""
    if knob == "auto":
        return "blocks" if device.type == "cuda" else "off"
    if knob not in COMPILE_TARGETS:
        raise CompileError(f"--compile {knob}: choose off, auto, blocks or model")
    return knob


def compile_model(model, how: str, mode: str = "default"):
    """What the forward calls. blocks: each DiTBlock compiled in place (regional compilation:
    one graph serves every block, so the compile is short, and the state dict keeps its
    names; checkpointing lives inside DiTBlock.forward, so it is compiled with its policy);
    model: the whole forward as one graph (a wrapper; the model itself stays eager)."""
    if mode not in COMPILE_MODES:
        raise CompileError(f"--compile-mode {mode}: choose one of {', '.join(COMPILE_MODES)}")
    if how == "off":
        return model
    kw = {} if mode == "default" else {"mode": mode}
    if next(model.parameters()).device.type == "cpu":  # "No CUDA runtime is found": true, and beside the point
        import logging

        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    if how == "blocks":
        for block in (*model.blocks, *getattr(model, "head_blocks", ())):  # a DiT^DH's head blocks too
            block.compile(**kw)
        return model
    return torch.compile(model, **kw)


def conditioning(batch: dict, empty_text: dict, cfg: TrainConfig, u: torch.Tensor) -> dict:
    """Model kwargs of a batch. u (B,) uniform draws decide classifier-free-guidance
    dropout: labels -> the null class (u < class_dropout), captions -> the store's
    empty-caption embedding (u < caption_dropout)."""
    kwargs = {}
    if "y" in batch:
        kwargs["y"] = batch["y"]
        kwargs["force_drop_ids"] = u < cfg.diffusion.class_dropout
    text = {k: batch[k] for k in TEXT_FIELDS if k in batch}
    if text:
        kwargs |= drop_text_conditioning(text, empty_text, u < cfg.diffusion.caption_dropout)
    return kwargs


def empty_text_on(store, device: torch.device) -> dict:
    """The store's empty-caption embedding (caption dropout's stand-in), on the device."""
    return {k: torch.from_numpy(v.astype(np.float32) if v.dtype != bool else v).to(device)
            for k, v in store.empty_caption().items()}
