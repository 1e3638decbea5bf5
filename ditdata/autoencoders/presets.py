"""The autoencoder presets and the facts every kind of autoencoder is known by: the table that
``ditdata.autoencoders.kinds`` loads from and ``ditdata.autoencoders.taef2`` takes its weight file names from.

Standard library only (no torch, no diffusers): ``ditdata --help`` and the store's readers
can name a preset, a kind or a value range without loading a model.

    KIND_KL      a diffusers AutoencoderKL (a posterior: mean and std); found as a diffusers
                 folder, or as ONE checkpoint file in the LDM (CompVis) layout plus its LDM config
                 (``ldm_config``: ditdata/autoencoders/ldm.py), as VA-VAE ships
    KIND_TAEF2   the tiny FLUX.2-latent autoencoder (ditdata/autoencoders/taef2.py), deterministic
    KIND_PIXELS  no autoencoder: the image itself, deterministic
    KIND_RAE     a diffusers AutoencoderRAE (Zheng et al., 2025): a frozen representation encoder
                 (DINOv2 with registers, SigLIP2, MAE) and a trained ViT decoder, deterministic; its
                 latent is the encoder's normalised patch tokens on a fixed square grid

A kind's encoding and decoding live in ``ditdata.autoencoders.kinds.KINDS`` (one adapter per kind).
"""

from __future__ import annotations

from dataclasses import dataclass

KIND_KL = "autoencoder_kl"
KIND_TAEF2 = "taef2"
KIND_PIXELS = "pixels"
KIND_RAE = "autoencoder_rae"
RANGE_PM1 = "[-1,1]"
RANGE_01 = "[0,1]"
TAEF2_ENV = "DITKIT_TAEF2"
TAEF2_FILES = ("taef2_encoder.pth", "taef2_decoder.pth")  # (encoder, decoder)
TAEF2_SOURCE = "https://github.com/madebyollin/taesd"
VAVAE_ENV = "DITKIT_VAVAE"

# VA-VAE f16d32 (Yao et al. 2025, LightningDiT's tokenizer: an LDM KL autoencoder aligned to
# DINOv2), its architecture as an LDM config (ditdata.autoencoders.ldm's normalised form): five levels of
# 128 x (1, 1, 2, 2, 4) channels (/16), two ResNet blocks each, 32 latent channels, attention
# in the 16 px level (of its 256 px training resolution). Its config publishes no
# scale_factor: latents are stored unscaled, and training standardises them per channel.
VAVAE_F16D32 = {
    "embed_dim": 32,
    "ddconfig": {"double_z": True, "z_channels": 32, "resolution": 256, "in_channels": 3, "out_ch": 3,
                 "ch": 128, "ch_mult": [1, 1, 2, 2, 4], "num_res_blocks": 2, "attn_resolutions": [16]},
}


@dataclass(frozen=True)
class Preset:
    name: str
    kind: str  # KIND_KL | KIND_TAEF2 | KIND_PIXELS | KIND_RAE
    repo_id: str | None  # hub id (KIND_KL, KIND_RAE)
    subfolder: str | None
    scaling_factor: float
    shift_factor: float
    latent_channels: int
    downsample: int
    input_range: str  # value range the model itself takes: RANGE_PM1 | RANGE_01
    note: str = ""
    # an LDM-format checkpoint (KIND_KL): the file in the hub repo, its LDM config, and the
    # environment variable that may name a local copy (the file, or a directory holding it)
    filename: str | None = None
    ldm_config: dict | None = None
    env: str | None = None


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
        Preset("vavae-f16d32", KIND_KL, "hustvl/vavae-imagenet256-f16d32-dinov2", None, 1.0, 0.0, 32, 16,
               RANGE_PM1, f"VA-VAE (LightningDiT), 32 channels /16, aligned to DINOv2; no published scaling: "
               f"--latent-norm auto standardises per channel; a local copy through ${VAVAE_ENV}",
               filename="vavae-imagenet256-f16d32-dinov2.pt", ldm_config=VAVAE_F16D32, env=VAVAE_ENV),
        # the released RAEs (nyu-visionx on the hub, as diffusers' AutoencoderRAE page lists them): the
        # latent is C x 16 x 16 at 256 px (32 x 32 at 512), the decoder's patch (16) is the downsample
        *(Preset(name, KIND_RAE, f"nyu-visionx/{repo}", None, 1.0, 0.0, channels, 16, RANGE_01, note)
          for name, repo, channels, note in (
              ("rae-dinov2-b", "RAE-dinov2-wReg-base-ViTXL-n08", 768,
               "RAE: DINOv2-B with registers + ViT-XL decoder, 768 x 16 x 16 at 256 px (the paper's choice)"),
              ("rae-dinov2-b-512", "RAE-dinov2-wReg-base-ViTXL-n08-i512", 768,
               "RAE: DINOv2-B with registers, 512 px: 768 x 32 x 32"),
              ("rae-dinov2-s", "RAE-dinov2-wReg-small-ViTXL-n08", 384, "RAE: DINOv2-S with registers, 384 x 16 x 16"),
              ("rae-dinov2-l", "RAE-dinov2-wReg-large-ViTXL-n08", 1024,
               "RAE: DINOv2-L with registers, 1024 x 16 x 16"),
              ("rae-siglip2-b", "RAE-siglip2-base-p16-i256-ViTXL-n08", 768, "RAE: SigLIP2-B, 768 x 16 x 16"),
              ("rae-mae-b", "RAE-mae-base-p16-ViTXL-n08", 768, "RAE: MAE-B, 768 x 16 x 16"),
          )),
        Preset("taef2", KIND_TAEF2, None, None, 1.0, 0.0, 32, 8, RANGE_01,
               f"tiny FLUX.2-latent autoencoder, weights from ${TAEF2_ENV} or a directory"),
        Preset("pixels", KIND_PIXELS, None, None, 1.0, 0.0, 3, 1, RANGE_PM1,
               "no autoencoder: the image itself in [-1,1]"),
    )
}
