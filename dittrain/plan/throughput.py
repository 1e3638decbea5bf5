"""Training speed on known GPUs: what the cards are, and what was measured on them
(`dittrain plan`; the trainer's MFU reads the peaks).

    (GPUS, gpu_named: the known cards, ditdata.common.devices)
    RECORDS                       steps measured by bench/gpu_train.py (bench/RESULTS.md)
    rate(gpu, config, micro)      Rate: the FLOP/s a step of this model reaches there, and its source
    step_flops(config, ...)       FLOPs one sample's training step computes, recomputation included

The speed model: a step's time is its FLOPs (6 x the forward's multiply-adds per sample, plus
what checkpointing recomputes, at 2 FLOPs per multiply-add) over the rate the hardware reached
on the record of the same model (else the record of the nearest width) at the same number of
tokens per micro-batch, interpolated log-log between recorded micro-batches (and extrapolated
below the smallest from its two smallest). A card without records: the recorded card's rate
scaled by the ratio of dense bf16 peaks, a rough figure. Unrecorded choices: torch.compile (the
records are eager; compiled rows get the eager rate), selective checkpointing's element-wise
recomputation (no matmul: no FLOPs counted), fp32 (TF32: half the bf16 rate assumed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ditdata.common.devices import GPUS, Gpu
from dittrain.model.parts import MLPS
from dittrain.model.sizes import DiTConfig, block_flops, flops_per_forward, get_config


@dataclass(frozen=True)
class Record:
    """One configuration measured by bench/gpu_train.py."""

    gpu: str
    model: str
    batch: int
    mode: str  # --grad-checkpointing
    images_per_s: float
    peak_gib: float  # torch.cuda.max_memory_allocated


# bench/RESULTS.md, "dittrain: GPU training (bench/gpu_train.py)": measured 2026-11-30 on one H200,
# torch 2.11.0+cu130, bf16 autocast, eager, fused AdamW with EMA, DiT at 256 px (4x32x32 latents,
# 1000 classes, ddpm with learned sigma), data resident on the GPU.
RECORD_SOURCE = ("bench/gpu_train.py on one H200, 2026-11-30 (torch 2.11, bf16, eager; bench/RESULTS.md "
                 "'dittrain: GPU training')")
LATENT = (4, 32, 32)
RECORDS = tuple(Record("H200", *row) for row in (
    ("DiT-S/2", 64, "none", 1184, 4.2), ("DiT-S/2", 128, "none", 2329, 7.7), ("DiT-S/2", 256, "none", 3114, 14.7),
    ("DiT-S/2", 64, "every", 648, 1.3), ("DiT-S/2", 128, "every", 1340, 1.9), ("DiT-S/2", 256, "every", 2313, 3.1),
    ("DiT-B/2", 64, "none", 1072, 9.4), ("DiT-B/2", 128, "none", 1399, 16.4), ("DiT-B/2", 256, "none", 1556, 30.4),
    ("DiT-B/2", 64, "every", 633, 3.3), ("DiT-B/2", 128, "every", 1098, 4.6), ("DiT-B/2", 256, "every", 1184, 7.0),
    ("DiT-XL/2", 64, "none", 346, 35.6), ("DiT-XL/2", 128, "none", 379, 59.6), ("DiT-XL/2", 256, "none", 394, 107.7),
    ("DiT-XL/2", 64, "every", 257, 13.9), ("DiT-XL/2", 128, "every", 288, 16.3), ("DiT-XL/2", 256, "every", 298, 22.1),
))


def record_config(model: str, mode: str = "none") -> DiTConfig:
    c, h, _ = LATENT
    return get_config(model, input_size=h, in_channels=c, num_classes=1000, learn_sigma=True,
                      grad_checkpointing=int(mode) if str(mode).isdigit() else mode)


def recompute_flops(config: DiTConfig, mode: str | int, tokens: list[int] | None = None) -> float:
    """Multiply-adds one sample's backward computes again under --grad-checkpointing `mode`:
    the forward of checkpointed blocks (every, k), of one branch (attn: qkv, proj and the
    attention products; mlp: the MLP, its part's matmuls), none for selective (element-wise only) and none.
    tokens: each block's tokens (routing), default all of them."""
    depth, T = config.depth, config.num_tokens
    # the trunk's blocks (routed or not), then a DiT^DH's head blocks, all T tokens: (tokens, head?)
    blocks = [(t, False) for t in tokens or [T] * depth] + [(T, True)] * config.head_depth
    k = int(mode) if str(mode).isdigit() else (1 if mode == "every" else 0)
    if k:
        return sum(block_flops(config, blocks[i][0], head=blocks[i][1]) for i in range(0, len(blocks), k))

    def widths(head: bool) -> tuple[int, int]:
        return (config.head_hidden, config.head_mlp_hidden) if head else (config.hidden_size, config.mlp_hidden)

    if mode == "attn":
        return sum(t * 4 * widths(h)[0] ** 2 + 2 * t * t * widths(h)[0] for t, h in blocks)
    if mode == "mlp":
        return sum(t * MLPS[config.mlp].matmuls * widths(h)[0] * widths(h)[1] for t, h in blocks)
    return 0.0


def step_flops(config: DiTConfig, mode: str | int, tokens: list[int] | None = None, extra: float = 0.0) -> float:
    """FLOPs of one sample's training step: 2 x (3 x the forward's multiply-adds + the
    recomputation), `extra` multiply-adds per forward beside the DiT (--repa's projector);
    tokens: each block's tokens (routing), default all of them."""
    forward = flops_per_forward(config, tokens=tokens) + extra
    return 2 * (3 * forward + recompute_flops(config, mode, tokens))


@dataclass(frozen=True)
class Rate:
    flops_per_s: float  # what the hardware computed per second (recomputation included)
    source: str  # where the figure comes from, in words
    rough: bool  # scaled from another card, or an fp32 guess


def _interpolate(points: list[tuple[int, float]], x: float) -> float:
    """log-log through (micro-batch, rate); below the first point the slope of the first two;
    above the last, the last rate (the card is saturated)."""
    if x >= points[-1][0]:
        return points[-1][1]
    pairs = list(zip(points, points[1:], strict=False))
    (x0, y0), (x1, y1) = next(((a, b) for a, b in pairs if x <= b[0]), pairs[0])
    slope = math.log(y1 / y0) / math.log(x1 / x0)
    return y0 * (x / x0) ** slope


def nearest_model(config: DiTConfig) -> str:
    """The recorded model closest in width, then depth, to `config` (its name if recorded)."""
    models = sorted({r.model for r in RECORDS})
    return min(models, key=lambda m: (abs(math.log(record_config(m).hidden_size / config.hidden_size)),
                                      abs(record_config(m).depth - config.depth)))


def rate(gpu: Gpu | None, config: DiTConfig, micro_batch: int, precision: str = "bf16") -> Rate | None:
    """The FLOP/s a training step of `config` at this micro-batch reaches on `gpu` (module docstring);
    None for a card the table does not know (or none given)."""
    if gpu is None:
        return None
    model = nearest_model(config)
    ref = record_config(model)
    # the same tokens per micro-batch as on the record's model
    equivalent = micro_batch * config.num_tokens / ref.num_tokens
    # (micro-batch, FLOP/s) of the model's records without checkpointing
    points = sorted((r.batch, r.images_per_s * step_flops(ref, "none")) for r in RECORDS if r.model == model
                    and r.mode == "none")
    flops = _interpolate(points, equivalent)
    recorded = {r.gpu for r in RECORDS}
    source = f"{model}'s record" + ("" if model_matches(config, model) else " (the nearest recorded width)")
    if equivalent < points[0][0]:
        source += f", extrapolated below its smallest micro-batch ({points[0][0]})"
    rough = gpu.name not in recorded
    if rough:
        base = GPUS[sorted(recorded)[0]]
        flops *= gpu.peak_flops / base.peak_flops
        source += f", scaled from the {base.name} by dense bf16 peak ({gpu.peak_flops / 1e12:.0f} / " \
                  f"{base.peak_flops / 1e12:.0f} TFLOP/s)"
    if precision == "fp32":
        flops, rough, source = flops / 2, True, source + ", fp32 assumed at half the bf16 rate"
    return Rate(flops, source, rough)


def model_matches(config: DiTConfig, model: str) -> bool:
    ref = record_config(model)
    return (config.hidden_size, config.depth, config.num_heads, config.patch_size, config.mlp) == (
        ref.hidden_size, ref.depth, ref.num_heads, ref.patch_size, ref.mlp)


__all__ = ["LATENT", "RECORDS", "RECORD_SOURCE", "Rate", "Record", "nearest_model",
           "rate", "recompute_flops", "record_config", "step_flops"]
