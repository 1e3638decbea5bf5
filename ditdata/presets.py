"""The autoencoder presets and the facts every kind of autoencoder is known by: the table that
``ditdata.vae`` loads from and ``ditdata.taef2`` takes its weight file names from.

Standard library only (no torch, no diffusers): ``ditdata --help`` and the store's readers
can name a preset, a kind or a value range without loading a model.

    KIND_KL      a diffusers AutoencoderKL (a posterior: mean and std)
    KIND_TAEF2   the tiny FLUX.2-latent autoencoder (ditdata/taef2.py), deterministic
    KIND_PIXELS  no autoencoder: the image itself, deterministic

A kind's encoding and decoding live in ``ditdata.vae.KINDS`` (one adapter per kind).
"""

from __future__ import annotations

from dataclasses import dataclass

KIND_KL = "autoencoder_kl"
KIND_TAEF2 = "taef2"
KIND_PIXELS = "pixels"
RANGE_PM1 = "[-1,1]"
RANGE_01 = "[0,1]"
TAEF2_ENV = "DITKIT_TAEF2"
TAEF2_FILES = ("taef2_encoder.pth", "taef2_decoder.pth")  # (encoder, decoder)
TAEF2_SOURCE = "https://github.com/madebyollin/taesd"


@dataclass(frozen=True)
class Preset:
    name: str
    kind: str  # KIND_KL | KIND_TAEF2 | KIND_PIXELS
    repo_id: str | None  # hub id (KIND_KL only)
    subfolder: str | None
    scaling_factor: float
    shift_factor: float
    latent_channels: int
    downsample: int
    input_range: str  # value range the model itself takes: RANGE_PM1 | RANGE_01
    note: str = ""


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("sd-vae-ft-ema", KIND_KL, "stabilityai/sd-vae-ft-ema", None, 0.18215, 0.0, 4, 8,
               RANGE_PM1, "SD 1.x VAE, EMA fine-tune (the DiT paper's choice)"),
        Preset("sd-vae-ft-mse", KIND_KL, "stabilityai/sd-vae-ft-mse", None, 0.18215, 0.0, 4, 8,
               RANGE_PM1, "SD 1.x VAE, MSE fine-tune (smoother decodes)"),
        Preset("sdxl-vae", KIND_KL, "stabilityai/sdxl-vae", None, 0.13025, 0.0, 4, 8,
               RANGE_PM1, "SDXL VAE (overflows in fp16; use fp32 or bf16)"),
        Preset("flux-vae", KIND_KL, "black-forest-labs/FLUX.1-schnell", "vae", 0.3611, 0.1159,
               16, 8, RANGE_PM1, "FLUX.1 VAE, 16 channels"),
        Preset("taef2", KIND_TAEF2, None, None, 1.0, 0.0, 32, 8, RANGE_01,
               f"tiny FLUX.2-latent autoencoder, weights from ${TAEF2_ENV} or a directory"),
        Preset("pixels", KIND_PIXELS, None, None, 1.0, 0.0, 3, 1, RANGE_PM1,
               "no autoencoder: the image itself in [-1,1]"),
    )
}
