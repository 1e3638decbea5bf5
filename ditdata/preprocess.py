"""Image preprocessing before the autoencoder, as in the ADM / DiT reference.

The exact rule (`center_crop`), for a target resolution N and an upright RGB image:

1. while the short side is at least 2N: halve both sides (integer division) with a
   BOX filter (cheap, alias-free reduction of large photos);
2. resize with BICUBIC so that the short side is exactly N (the long side rounded);
3. crop the central N x N square, offsets floor((W - N) / 2), floor((H - N) / 2).

The result is uint8 (N, N, 3). The flipped variant mirrors that crop left-right. Value
scaling (to [0, 1] or [-1, 1]) is the autoencoder's business (ditdata.vae).

`cover_crop` is the same rule for a W x H rectangle (an aspect-ratio bucket, ditdata.buckets):
halve while both sides are at least twice the target's, BICUBIC to the smallest size that
covers W x H with the aspect ratio kept (each side rounded), central W x H crop. For W = H = N
it is `center_crop`.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

CROP_RULE = (
    "ADM center crop: halve with BOX while short side >= 2N, BICUBIC so short side = N, "
    "central N x N crop (floor offsets)"
)


COVER_RULE = (
    "cover crop: halve with BOX while both sides >= 2x the bucket's, BICUBIC to the smallest size covering "
    "the bucket (aspect ratio kept), central W x H crop (floor offsets)"
)


def center_crop(img: Image.Image, resolution: int) -> np.ndarray:
    return cover_crop(img, (resolution, resolution))


def cover_crop(img: Image.Image, size: tuple[int, int]) -> np.ndarray:
    """uint8 (H, W, 3): `img` resized to cover size (W, H) and centre-cropped to it (module docstring)."""
    w, h = size
    while _halves(img.size, size):
        img = img.resize(tuple(s // 2 for s in img.size), resample=Image.Resampling.BOX)
    img = img.resize(cover_size(img.size, size), resample=Image.Resampling.BICUBIC)
    arr = np.asarray(img.convert("RGB"))
    top = (arr.shape[0] - h) // 2
    left = (arr.shape[1] - w) // 2
    return arr[top:top + h, left:left + w].copy()  # contiguous and writable


def _halves(size, target) -> bool:
    return size[0] >= 2 * target[0] and size[1] >= 2 * target[1]


def cover_size(size: tuple[int, int], target: tuple[int, int]) -> tuple[int, int]:
    """The (W, H) cover_crop resizes an image of `size` to before cropping it to `target`."""
    while _halves(size, target):
        size = (size[0] // 2, size[1] // 2)
    scale = max(target[0] / size[0], target[1] / size[1])
    return max(target[0], round(size[0] * scale)), max(target[1], round(size[1] * scale))


def hflip(arr: np.ndarray) -> np.ndarray:
    """Mirror (..., H, W, C) images left-right."""
    return np.ascontiguousarray(arr[..., :, ::-1, :])
