"""Image preprocessing before the autoencoder, as in the ADM / DiT reference.

The exact rule (`center_crop`), for a target resolution N and an upright RGB image:

1. while the short side is at least 2N: halve both sides (integer division) with a
   BOX filter (cheap, alias-free reduction of large photos);
2. resize with BICUBIC so that the short side is exactly N (the long side rounded);
3. crop the central N x N square, offsets floor((W - N) / 2), floor((H - N) / 2).

The result is uint8 (N, N, 3). The flipped variant mirrors that crop left-right. Value
scaling (to [0, 1] or [-1, 1]) is the autoencoder's business (ditdata.vae).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

CROP_RULE = (
    "ADM center crop: halve with BOX while short side >= 2N, BICUBIC so short side = N, "
    "central N x N crop (floor offsets)"
)


def center_crop(img: Image.Image, resolution: int) -> np.ndarray:
    n = resolution
    while min(img.size) >= 2 * n:
        img = img.resize(tuple(s // 2 for s in img.size), resample=Image.Resampling.BOX)
    scale = n / min(img.size)
    img = img.resize(tuple(round(s * scale) for s in img.size), resample=Image.Resampling.BICUBIC)
    arr = np.asarray(img.convert("RGB"))
    top = (arr.shape[0] - n) // 2
    left = (arr.shape[1] - n) // 2
    return arr[top:top + n, left:left + n].copy()  # contiguous and writable


def hflip(arr: np.ndarray) -> np.ndarray:
    """Mirror (..., H, W, C) images left-right."""
    return np.ascontiguousarray(arr[..., :, ::-1, :])
