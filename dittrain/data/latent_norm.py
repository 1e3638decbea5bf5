"""Latent normalisation: what the model sees of a store's latents, and its inverse.

`dittrain run --latent-norm channel` standardises every latent channel c with the store's
RECORDED per-channel statistics (manifest "stats", computed by `ditdata encode` over the
stored latents), as LightningDiT does:

    x' = (x - mean_c) / std_c          before the model (train.py, once per batch, on the device)
    x  = x' * std_c + mean_c           before the autoencoder decodes (sample.run_plan)

It matters for autoencoders stored with scale 1 (TAEF2: channels far from unit variance), and
most for those that publish no scaling factor at all (VA-VAE: LightningDiT trains only on
channel-normalised latents). `--latent-norm auto`, the default, is resolved when a run starts
(`choose`): channel where the store's manifest says its autoencoder has no published scaling
factor (its "vae" entry's "latent_norm": "channel", ditdata.autoencoders.kinds), none otherwise; the run
records the resolved value, never auto. The values used are copied into the run config's
"latents" section,

    {"norm": "none"}  or  {"norm": "channel", "mean": [C], "std": [C], "stats_count": N}

so sampling, exports and serving undo exactly what training did, whatever later becomes
of the store. A config without the section (older runs) is "none".
"""

from __future__ import annotations

import math

import torch

from ditdata.common.errors import UserError
from dittrain.config import LATENT_NORMS

RESOLVED = ("none", "channel")  # what a run records and a "latents" section holds


class LatentNormError(UserError, ValueError):
    """The store cannot give what --latent-norm asks for."""


def choose(store, norm: str) -> tuple[str, str]:
    """(none | channel, the startup line's words for it): `norm` itself, or what auto picks
    for `store` (the module docstring) and why."""
    if norm not in LATENT_NORMS:
        raise LatentNormError(f"--latent-norm must be one of {', '.join(LATENT_NORMS)}, got {norm!r}")
    if norm != "auto":
        return norm, norm
    vae = store.manifest.get("vae") or {}
    name = vae.get("name") or vae.get("id")
    if vae.get("latent_norm") == "channel":
        return "channel", f"channel (auto: the store's autoencoder {name} has no published scaling factor)"
    return "none", f"none (auto: the store's autoencoder {name} scales its latents by {vae.get('scaling_factor')})"


def latent_record(store, norm: str) -> dict:
    """The run config's "latents" section for `norm` on `store` (auto: as `choose` resolves it);
    LatentNormError (one line) when `channel` finds no usable per-channel statistics in the
    store's manifest."""
    norm, _ = choose(store, norm)
    if norm == "none":
        return {"norm": "none"}
    stats = store.manifest.get("stats") or {}
    mean, std = list(stats.get("mean") or []), list(stats.get("std") or [])
    channels = store.latent_shape[0]
    where = f"{store.root}/manifest.json"
    if not stats.get("count") or len(mean) != channels or len(std) != channels:
        raise LatentNormError(f"--latent-norm channel: {where} records no per-channel latent mean/std for its "
                              f"{channels} channels; re-encode the store with `ditdata encode`, or use --latent-norm none")
    bad = [c for c, s in enumerate(std) if not (math.isfinite(s) and s > 0) or not math.isfinite(mean[c])]
    if bad:
        raise LatentNormError(f"--latent-norm channel: {where} records a zero or non-finite std/mean for "
                              f"channel(s) {bad}, which cannot be standardised; use --latent-norm none")
    return {"norm": "channel", "mean": [float(v) for v in mean], "std": [float(v) for v in std],
            "stats_count": int(stats["count"])}


class LatentNorm:
    """normalize / denormalize latents (N, C, H, W) as a run's "latents" record says
    (identity for "none"); the per-channel tensors are made once per device."""

    def __init__(self, record: dict | None = None):
        record = record or {"norm": "none"}
        if record.get("norm", "none") not in RESOLVED:
            raise LatentNormError(f"unknown latent normalisation {record.get('norm')!r} in the run config")
        self.record = record
        self.enabled = record.get("norm") == "channel"
        self._on: dict = {}

    @classmethod
    def from_config(cls, config: dict) -> LatentNorm:
        """Of a run's resolved config (no "latents" section: none)."""
        return cls(config.get("latents"))

    def _stats(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (x.device, x.dtype)
        if key not in self._on:
            shape = (1, -1) + (1,) * (x.dim() - 2)
            mean = torch.tensor(self.record["mean"], dtype=torch.float64).view(shape)
            std = torch.tensor(self.record["std"], dtype=torch.float64).view(shape)
            self._on[key] = (mean.to(x.device, x.dtype), std.to(x.device, x.dtype))
        mean, std = self._on[key]
        if x.shape[1] != mean.shape[1]:
            raise LatentNormError(f"latents have {x.shape[1]} channels, the run's latent stats {mean.shape[1]}")
        return mean, std

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """Store latents -> what the model sees."""
        if not self.enabled:
            return x
        mean, std = self._stats(x)
        return (x - mean) / std

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        """What the model samples -> store latents (what the autoencoder decodes)."""
        if not self.enabled:
            return z
        mean, std = self._stats(z)
        return z * std + mean


__all__ = ["LATENT_NORMS", "RESOLVED", "LatentNorm", "LatentNormError", "choose", "latent_record"]
