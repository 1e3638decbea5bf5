"""The optimizer and its learning-rate schedule, as `dittrain run` builds them.

    --optimizer adamw | adamw8bit    build_optimizer: torch's fused AdamW, or bitsandbytes' 8-bit one
    --adam-betas B1,B2               both optimizers' (beta1, beta2)
    --lr-schedule constant | cosine | linear   lr_at: linear warmup from 0, then constant, cosine to --min-lr
                                     at max_steps, or linear to --min-lr between --lr-decay-start and --lr-decay-end

DiT's recipe is the default: AdamW, lr 1e-4, betas (0.9, 0.999), no weight decay, no warmup.
LightningDiT's (hustvl/LightningDiT train.py and configs/*.yaml @ 2725fed4): AdamW, lr 2e-4,
betas (0.9, 0.95) (its `optimizer.beta2`), no weight decay, no warmup, no clipping unless its
config names `max_grad_norm` (the released ones do not). RAE's (bytetriper/RAE @ a4d18c4
src/utils/optim_utils.py build_scheduler, type linear, warmup_from_zero false): lr 2e-4 held for its
"warmup" epochs, then linear to final_lr at decay_end_epoch, held after: --lr-schedule linear with
--lr-decay-start and --lr-decay-end at those steps, --min-lr its final_lr.
"""

from __future__ import annotations

import math

import torch

from ditdata.common.errors import UserError
from ditdata.common.extras import BITSANDBYTES_LOGGERS, require
from dittrain.config import OPTIMIZERS, TrainConfig, parse_adam_betas


class OptimizerError(UserError, ValueError):
    """An --optimizer that does not exist here or lacks its extra, or --adam-betas that are not
    two numbers in [0, 1) (one line)."""


def adam_betas(cfg: TrainConfig) -> tuple[float, float]:
    """--adam-betas as (beta1, beta2); OptimizerError for a value outside [0, 1) or not two numbers
    (the command line checks them too; this holds for a config made in Python)."""
    try:
        return parse_adam_betas(cfg.optim.adam_betas)
    except ValueError as e:
        raise OptimizerError(f"--adam-betas {e}") from None


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup from 0, then constant, cosine down to min_lr at max_steps, or linear: lr until
    lr_decay_start (or the warmup's end, the later), then linearly to min_lr at lr_decay_end (0: max_steps),
    min_lr after (RAE's rule: progress (step - start) / (end - start))."""
    if cfg.optim.warmup_steps and step < cfg.optim.warmup_steps:
        return cfg.optim.lr * (step + 1) / cfg.optim.warmup_steps
    if cfg.optim.lr_schedule == "linear":
        start = max(cfg.optim.warmup_steps, cfg.optim.lr_decay_start)
        end = max(start, cfg.optim.lr_decay_end or cfg.optim.max_steps)
        if step < start:
            return cfg.optim.lr
        if step >= end:
            return cfg.optim.min_lr
        return cfg.optim.lr - (cfg.optim.lr - cfg.optim.min_lr) * (step - start) / max(end - start, 1)
    if cfg.optim.lr_schedule == "cosine":
        span = max(1, cfg.optim.max_steps - cfg.optim.warmup_steps)
        progress = min(1.0, (step - cfg.optim.warmup_steps) / span)
        return cfg.optim.min_lr + 0.5 * (cfg.optim.lr - cfg.optim.min_lr) * (1 + math.cos(math.pi * progress))
    return cfg.optim.lr


def build_schedule(opt: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """lr_at as a LambdaLR (a factor of --lr; a checkpoint holds its state)."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, cfg) / cfg.optim.lr if cfg.optim.lr else 0.0)


def build_optimizer(cfg: TrainConfig, params: list, device: torch.device) -> torch.optim.Optimizer:
    """--optimizer: torch's AdamW (fp32 moments) or bitsandbytes' AdamW8bit (block-wise 8-bit
    moments; tensors under 4096 elements keep fp32 ones), with the same hyperparameters: lr,
    --adam-betas, eps 1e-8 (torch's default, LightningDiT's and DiT's), --weight-decay."""
    adam = dict(lr=cfg.optim.lr, betas=adam_betas(cfg), eps=1e-8, weight_decay=cfg.optim.weight_decay)
    if cfg.optim.optimizer == "adamw":
        # fused: one kernel for all parameters, and it can skip a step on the device (found_inf;
        # dittrain.train.step), so a NaN/inf step costs no host sync; on the CPU too
        return torch.optim.AdamW(params, **adam, fused=True)
    if cfg.optim.optimizer not in OPTIMIZERS:
        raise OptimizerError(f"--optimizer {cfg.optim.optimizer}: choose {' or '.join(OPTIMIZERS)}")
    # bitsandbytes' import notes on its optional 4-bit CPU kernel are noise here (BITSANDBYTES_LOGGERS says why)
    bnb = require("bitsandbytes", "--optimizer adamw8bit", "optim", OptimizerError, quiet=BITSANDBYTES_LOGGERS)
    return bnb.optim.AdamW8bit(params, **adam)


__all__ = ["OptimizerError", "adam_betas", "build_optimizer", "build_schedule", "lr_at"]
