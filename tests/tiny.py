"""Tiny randomly initialised models, small real-image datasets, and the gradients of two
models compared, for tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def tiny_kl(latent_channels: int = 4, **config):
    """A diffusers AutoencoderKL with a /2 downsample and a few thousand parameters."""
    import diffusers
    import torch

    torch.manual_seed(0)
    return diffusers.AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16), layers_per_block=1, latent_channels=latent_channels,
        norm_num_groups=4, sample_size=32, **config,
    )


def save_tiny_kl(path: Path, **config) -> Path:
    tiny_kl(**config).save_pretrained(str(path))
    return path


# --------------------------------------------------------------------------- LDM-format checkpoints


def tiny_ldm_kl(latent_channels: int = 4, attention: bool = False):
    """A diffusers AutoencoderKL that an LDM config can describe (LDM normalises in 32 groups:
    widths 32 and 64, /2), every weight perturbed so that no two norms or biases are alike.
    attention: an attention block after each ResNet block of its second (lowest-resolution)
    level too, as VA-VAE has in its fifth."""
    import diffusers
    import torch

    torch.manual_seed(0)
    down, up = ("DownEncoderBlock2D", "DownEncoderBlock2D"), ("UpDecoderBlock2D", "UpDecoderBlock2D")
    if attention:
        down, up = ("DownEncoderBlock2D", "AttnDownEncoderBlock2D"), ("AttnUpDecoderBlock2D", "UpDecoderBlock2D")
    model = diffusers.AutoencoderKL(down_block_types=down, up_block_types=up, block_out_channels=(32, 64),
                                    layers_per_block=1, latent_channels=latent_channels, sample_size=32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


# diffusers' AutoencoderKL names -> the LDM (CompVis) names of the same weights, written for the
# tests from the LDM Encoder/Decoder layout (the loader under test uses diffusers' own mapping).
# The decoder's diffusers block k is LDM level n-1-k ({up}); attention 1x1 convs are Linear here.
_LDM_NAMES = (
    (r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.", r"encoder.down.\1.block.\2."),
    (r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample."),
    (r"encoder\.down_blocks\.(\d+)\.attentions\.(\d+)\.", r"encoder.down.\1.attn.\2."),
    (r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.", "decoder.up.{up}.block.\\2."),
    (r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.", "decoder.up.{up}.upsample."),
    (r"decoder\.up_blocks\.(\d+)\.attentions\.(\d+)\.", "decoder.up.{up}.attn.\\2."),
    (r"mid_block\.resnets\.0\.", "mid.block_1."), (r"mid_block\.resnets\.1\.", "mid.block_2."),
    (r"mid_block\.attentions\.0\.", "mid.attn_1."), (r"conv_shortcut", "nin_shortcut"),
    (r"conv_norm_out", "norm_out"),
)
_LDM_ATTENTION = (("group_norm.", "norm."), ("to_q.", "q."), ("to_k.", "k."), ("to_v.", "v."),
                  ("to_out.0.", "proj_out."))


def ldm_state_dict(model) -> dict:
    """The model's weights under their LDM names, attention projections as 1x1 convolutions."""
    import re

    n = len(model.config.block_out_channels)
    out = {}
    for name, w in model.state_dict().items():
        m = re.match(r"decoder\.up_blocks\.(\d+)\.", name)
        for pattern, repl in _LDM_NAMES:
            name = re.sub(pattern, repl.replace("{up}", str(n - 1 - int(m.group(1))) if m else ""), name)
        if ".attn" in name:
            for a, b in _LDM_ATTENTION:
                name = name.replace(a, b)
            w = w[:, :, None, None] if w.ndim == 2 else w
        out[name] = w.clone()
    return out


def ldm_config(model, *, resolution: int = 32, scale_factor: float | None = None, sd_layout: bool = False) -> dict:
    """The LDM config of the model (CompVis autoencoder layout: model.params.{embed_dim, ddconfig},
    with a loss section as VA-VAE's has); sd_layout: a whole latent diffusion config's
    first_stage_config beside scale_factor, as Stable Diffusion's v1-inference.yaml."""
    c = model.config
    attn = [resolution >> i for i, t in enumerate(c.down_block_types) if t.startswith("Attn")]
    ddconfig = {"double_z": True, "z_channels": c.latent_channels, "resolution": resolution, "in_channels": 3,
                "out_ch": 3, "ch": c.block_out_channels[0],
                "ch_mult": [w // c.block_out_channels[0] for w in c.block_out_channels],
                "num_res_blocks": c.layers_per_block, "attn_resolutions": attn, "dropout": 0.0}
    params = {"embed_dim": c.latent_channels, "ddconfig": ddconfig,
              "lossconfig": {"target": "ldm.modules.losses.LPIPSWithDiscriminator", "params": {"kl_weight": 1e-6}}}
    if sd_layout:
        params = {"first_stage_config": {"target": "ldm.models.autoencoder.AutoencoderKL", "params": params}}
    if scale_factor is not None:
        params["scale_factor"] = scale_factor
    return {"model": {"target": "ldm.models.autoencoder.AutoencoderKL", "params": params}}


def save_ldm(model, path: Path, *, config: Path | None = None, prefix: str = "", extra: dict | None = None,
             **config_options) -> tuple[Path, Path]:
    """(checkpoint, config yaml): the model in the LDM layout as one file (.safetensors, or a torch
    pickle under "state_dict" as VA-VAE's .pt, with `extra` tensors such as a loss network's
    beside it), every key under `prefix` (e.g. first_stage_model.)."""
    import torch
    import yaml

    state = {prefix + k: v for k, v in ldm_state_dict(model).items()} | dict(extra or {})
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    else:
        torch.save({"state_dict": state, "global_step": torch.tensor(7)}, path)
    config = config or path.with_suffix(".yaml")
    config.write_text(yaml.safe_dump(ldm_config(model, **config_options)))
    return path, config


def real_images() -> dict[str, np.ndarray]:
    """Real photographs shipped inside scikit-image (RGB uint8)."""
    from skimage import data

    return {"astronaut": data.astronaut(), "chelsea": data.chelsea(), "coffee": data.coffee(),
            "rocket": data.rocket()}


def class_tree(root: Path, per_class: int = 2, size: int | None = None) -> Path:
    """class folders (one per real photo) holding shifted crops of it, as PNG."""
    for name, arr in real_images().items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            img = Image.fromarray(arr[i * 7:, i * 11:])
            if size:
                img = img.resize((size, size), Image.Resampling.BICUBIC)
            img.save(root / name / f"{i:03d}.png")
    return root


def fetch_tree(tree: Path, out: Path, samples_per_shard: int = 2, **options) -> Path:
    from ditdata.fetch import fetch

    fetch(tree, out, samples_per_shard=samples_per_shard, processes=1, progress=False,
          encode_format="png", **options)
    return out


def sample_photos() -> dict[str, np.ndarray]:
    """real_images() plus the two photographs scikit-learn ships (china, flower), RGB uint8."""
    from sklearn.datasets import load_sample_images

    bunch = load_sample_images()
    names = [Path(f).stem for f in bunch.filenames]
    return {**real_images(), **dict(zip(names, bunch.images, strict=True))}


def random_crops(n: int, size: int = 64, seed: int = 0) -> np.ndarray:
    """n random size x size crops of sample_photos() (each photo first shrunk to 4x `size` on
    its short side so a crop shows a recognisable part of it), uint8 (n, size, size, 3)."""
    rng = np.random.default_rng(seed)
    photos = []
    for arr in sample_photos().values():
        img = Image.fromarray(arr)
        scale = 4 * size / min(img.size)
        photos.append(np.asarray(img.resize((round(img.width * scale), round(img.height * scale)),
                                            Image.Resampling.BICUBIC)))
    out = np.empty((n, size, size, 3), np.uint8)
    for i in range(n):
        p = photos[rng.integers(len(photos))]
        y, x = rng.integers(p.shape[0] - size + 1), rng.integers(p.shape[1] - size + 1)
        out[i] = p[y:y + size, x:x + size]
    return out


def save_random_inception(path: Path, seed: int = 0) -> Path:
    """torch-fidelity's FID InceptionV3, randomly initialised, saved as a plain state dict in
    the format of its real weights file (same keys and shapes), so tests load it through
    dittrain.eval's real loading path. The library has no architecture-only constructor: its
    weight load is skipped while building (nothing is downloaded). The convolutions are
    re-initialised kaiming-normal (the default init gives nearly constant features) and
    BatchNorm is left at identity statistics (mean 0, var 1, weight 1, bias 0)."""
    from unittest import mock

    import torch
    from torch_fidelity import feature_extractor_inceptionv3 as fi

    class Architecture(fi.FeatureExtractorInceptionV3):
        def load_state_dict(self, state_dict, strict=True, assign=False):
            return None  # the random weights stay

    torch.manual_seed(seed)
    with mock.patch.object(fi, "load_state_dict_from_url", lambda *a, **k: {}):
        net = Architecture("random-inception", ["2048"])
    for m in net.modules():
        if isinstance(m, torch.nn.Conv2d):
            torch.nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
        elif isinstance(m, torch.nn.BatchNorm2d):
            m.reset_parameters()
    torch.save(net.state_dict(), path)
    return path


def backward_each(loss_of, *models) -> list:
    """loss_of(model).backward() for each model in turn: the losses (the gradients stay in .grad)."""
    losses = []
    for m in models:
        loss = loss_of(m)
        loss.backward()
        losses.append(loss)
    return losses


def assert_grads_close(ref, other, *, rtol: float, atol: float) -> int:
    """Each parameter's gradient in `other` within rtol/atol of `ref`'s, parameter by parameter
    in order (None where `ref`'s is None): how many of `ref`'s gradients are not all zero."""
    import torch

    nonzero = 0
    for (name, p), q in zip(ref.named_parameters(), other.parameters(), strict=True):
        if p.grad is None:
            assert q.grad is None, name
            continue
        torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=name)
        nonzero += bool(p.grad.abs().sum() > 0)
    return nonzero


def nudged(model, scale: float):
    """`model` with scale x N(0, 1) noise (the global RNG) added to every trainable parameter: a
    fresh DiT is adaLN-Zero's identity in every block, which would test nothing."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn_like(p))
    return model


def step_inputs(step, batch: dict) -> tuple:
    """(x0, t, noise, kwargs) for TrainStep._losses on a class batch: seeded timesteps, noise from
    the global generator, no label dropped (what the step tests of REPA and loss terms compare)."""
    import torch

    x0 = batch["x"]
    t = step.diffusion.sample_timesteps(len(x0), generator=torch.Generator().manual_seed(2))
    kwargs = {"y": batch["y"], "force_drop_ids": torch.zeros(len(x0), dtype=torch.bool)}
    return x0, t, torch.randn_like(x0), kwargs


def tiny_rae(**config):
    """A diffusers AutoencoderRAE with a tiny random Dinov2WithRegisters inside (64 wide, one layer,
    patch 14 on a 56 px input: a 4 x 4 grid of 64-d tokens), a one-layer ViT decoder drawing 32 px
    images (decoder patch 8), and per-channel, per-position latent statistics as the released
    checkpoints carry."""
    import diffusers
    import torch

    torch.manual_seed(0)
    kw = dict(encoder_type="dinov2", encoder_hidden_size=64, encoder_patch_size=14, encoder_num_hidden_layers=1,
              decoder_hidden_size=32, decoder_num_hidden_layers=1, decoder_num_attention_heads=2,
              decoder_intermediate_size=64, patch_size=8, encoder_input_size=56,
              latents_mean=(torch.randn(64, 4, 4) * 0.1).tolist(), latents_std=(torch.rand(64, 4, 4) + 0.5).tolist())
    return diffusers.AutoencoderRAE(**{**kw, **config}).eval()


def save_tiny_rae(path: Path, **config) -> Path:
    tiny_rae(**config).save_pretrained(str(path))
    return path
