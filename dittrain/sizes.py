"""What a DiT size costs: parameters, multiply-adds per forward, and the rows of `dittrain models`.

    num_params(config)           counted on the meta device (nothing is allocated)
    flops_per_forward(config)    the DiT paper's Gflops convention (dittrain.specs)
    describe("DiT-XL/2", ...)    one row of the `dittrain models` table
"""

from __future__ import annotations

import torch

from dittrain.model import DiT
from dittrain.specs import DiTConfig, flops_per_forward, get_config


def num_params(config: DiTConfig, trainable_only: bool = True) -> int:
    """Parameter count without allocating: builds on the meta device."""
    with torch.device("meta"):
        return DiT(config).num_params(trainable_only)


def describe(name: str, **overrides) -> dict:
    """One row of `dittrain models`: name, size fields, parameters and GMACs per forward."""
    cfg = get_config(name, **overrides)
    return dict(name=name, depth=cfg.depth, hidden=cfg.hidden_size, heads=cfg.num_heads, patch=cfg.patch_size,
                tokens=cfg.num_tokens, params=num_params(cfg), gflops=flops_per_forward(cfg) / 1e9)


__all__ = ["describe", "num_params"]
