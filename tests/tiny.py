"""Tiny randomly initialised models and small real-image datasets for tests."""

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
