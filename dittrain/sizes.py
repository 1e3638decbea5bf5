"""What a DiT size costs: parameters, multiply-adds per forward, and the rows of `dittrain models`.

    num_params(config)           counted on the meta device (nothing is allocated)
    flops_per_forward(config)    the DiT paper's Gflops convention (dittrain.specs)
    describe("DiT-XL/2", ...)    one row of the `dittrain models` table
    models_table(...)            the whole table, as lines
"""

from __future__ import annotations

import torch

from ditdata.common.errors import UserError
from dittrain.model import DiT
from dittrain.specs import CONFIGS, DiTConfig, architecture, flops_per_forward, get_config


class ModelsError(UserError, ValueError):
    """`dittrain models` asked for a size that does not fit the latent (one line)."""


def num_params(config: DiTConfig, trainable_only: bool = True) -> int:
    """Parameter count without allocating: builds on the meta device."""
    with torch.device("meta"):
        return DiT(config).num_params(trainable_only)


def describe(name: str, **overrides) -> dict:
    """One row of `dittrain models`: name, size fields, parameters and GMACs per forward."""
    cfg = get_config(name, **overrides)
    return dict(name=name, depth=cfg.depth, hidden=cfg.hidden_size, heads=cfg.num_heads, patch=cfg.patch_size,
                tokens=cfg.num_tokens, params=num_params(cfg), gflops=flops_per_forward(cfg) / 1e9)


def models_table(resolution: int, downsample: int, channels: int, num_classes: int, learn_sigma: bool,
                 specs: tuple[str, ...] = ()) -> list[str]:
    """The lines of `dittrain models`: the registry's sizes whose patch splits the latent, then
    each of `specs` (names or custom sizes), all checked before any line is made."""
    if resolution % downsample:
        raise ModelsError(f"--resolution {resolution} is not a multiple of --downsample {downsample}")
    size = resolution // downsample
    for spec in specs:
        try:
            patch = architecture(spec)["patch_size"]
        except (KeyError, ValueError) as e:
            raise ModelsError(f"--model: {e.args[0]}") from None
        if size % patch:
            raise ModelsError(f"--model {spec}: patch {patch} does not split the {size}x{size} latent")
    rows = [name for name, arch in CONFIGS.items() if size % arch["patch_size"] == 0]  # whole patches only
    rows += [spec for spec in specs if spec not in rows]
    width = max(10, *map(len, rows))
    lines = [f"at {resolution} px: latent {channels}x{size}x{size}, {num_classes} classes, "
             f"learn_sigma={learn_sigma}; GFLOPs = multiply-adds per sample per forward",
             f"{'model':<{width}} {'depth':>5} {'hidden':>6} {'heads':>5} {'tokens':>6} {'params':>9} {'GFLOPs':>9}"]
    for name in rows:
        row = describe(name, input_size=size, in_channels=channels, num_classes=num_classes, learn_sigma=learn_sigma)
        lines.append(f"{name:<{width}} {row['depth']:>5} {row['hidden']:>6} {row['heads']:>5} {row['tokens']:>6} "
                     f"{row['params'] / 1e6:>8.1f}M {row['gflops']:>9.2f}")
    return lines


__all__ = ["ModelsError", "describe", "models_table", "num_params"]
