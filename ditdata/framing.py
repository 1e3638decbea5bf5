"""How an image becomes the array that is encoded: the ADM / DiT centre crop, and the
aspect-ratio buckets (`ditdata encode --buckets AREA[:STEP]`) with the cover crop that lands an
image on its bucket. `Framing` is what encode (and `ditdata features`) call per image: the square
crop without buckets, the bucket and its cover crop with them.

The crop
--------
The exact rule (`center_crop`), for a target resolution N and an upright RGB image:

1. while the short side is at least 2N: halve both sides (integer division) with a
   BOX filter (cheap, alias-free reduction of large photos);
2. resize with BICUBIC so that the short side is exactly N (the long side rounded);
3. crop the central N x N square, offsets floor((W - N) / 2), floor((H - N) / 2).

The result is uint8 (N, N, 3). The flipped variant mirrors that crop left-right. Value
scaling (to [0, 1] or [-1, 1]) is the autoencoder's business (ditdata.autoencoders.kinds).

`cover_crop` is the same rule for a W x H rectangle (an aspect-ratio bucket, below):
halve while both sides are at least twice the target's, BICUBIC to the smallest size that
covers W x H with the aspect ratio kept (each side rounded), central W x H crop. For W = H = N
it is `center_crop`.

The buckets
-----------
The sizes are the steps of a staircase under the hyperbola W * H = AREA^2 on the grid of
multiples of STEP, for aspect ratios W / H from 1:2 to 2:1 (ends included when they land
on the grid):

- for every width W, the tallest H with W * H <= AREA^2 (the "floor" rule of the usual
  bucketing tools), and its mirror (H, W);
- where two neighbours differ in both sides (near the square, where the hyperbola is
  steep), the corner between them, (W_narrow, H_wide): a little under AREA^2.

So neighbouring buckets differ in one side by STEP, and an image sent to the bucket
nearest its aspect ratio (distance in log ratio), resized to cover it and centre-cropped
by the excess, loses at most STEP pixels in the cropped direction (half of it, mostly);
an image beyond the extreme ratios goes to the extreme bucket and may lose more, which
encode counts (`cropped_beyond_step`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ditdata.errors import DitdataError

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


# ----------------------------------------------------------------------------- buckets

MAX_RATIO = 2.0  # the widest bucket is 2:1, the tallest 1:2


class BucketSpecError(DitdataError):
    """A --buckets AREA[:STEP] that names no usable bucket list."""


@dataclass(frozen=True)
class BucketSpec:
    """AREA[:STEP]: buckets of about AREA^2 pixels with sides multiples of STEP."""

    area: int
    step: int

    @property
    def text(self) -> str:
        return f"{self.area}:{self.step}"

    def sizes(self) -> list[tuple[int, int]]:
        return bucket_sizes(self.area, self.step)


def parse_spec(text: str, factor: int, patch: int = 2) -> BucketSpec:
    """--buckets AREA[:STEP] for an autoencoder of downsample `factor`: STEP defaults to
    factor * patch (so every latent grid divides by the DiT's patch). Refuses (one line)
    what names no bucket list: not integers, AREA not a positive multiple of STEP, STEP not
    a multiple of `factor`."""
    head = f"--buckets {text}"
    area_text, _, step_text = str(text).partition(":")
    try:
        area = int(area_text)
        step = int(step_text) if step_text else factor * patch
    except ValueError:
        raise BucketSpecError(f"{head}: expected AREA or AREA:STEP in pixels (integers), e.g. 256 or "
                              f"512:{factor * patch}") from None
    if step <= 0 or step % factor:
        raise BucketSpecError(f"{head}: STEP {step} must be a positive multiple of the autoencoder's downsample "
                              f"factor {factor} (the default, {factor * patch}, also divides by the patch size 2)")
    if area <= 0 or area % step:
        fits = " or ".join(str(a) for a in (area // step * step, area // step * step + step) if a > 0)
        raise BucketSpecError(f"{head}: AREA {area} must be a positive multiple of STEP {step}, e.g. {fits}")
    return BucketSpec(area, step)


def bucket_sizes(area: int, step: int, max_ratio: float = MAX_RATIO) -> list[tuple[int, int]]:
    """The (W, H) bucket sizes of AREA:STEP (module docstring), sorted by W / H."""
    budget = area * area
    # the wide half (W >= H), from the square out to one past the widest ratio
    floor = []
    w = step * max(1, math.isqrt(budget) // step)
    while True:
        h = budget // w // step * step
        if h < step:
            break
        floor.append((w, h))
        if w > max_ratio * h:
            break
        w += step
    stairs = []
    for (w1, h1), (w2, h2) in zip(floor, floor[1:], strict=False):
        stairs.append((w1, h1))
        if w1 != w2 and h1 != h2:
            stairs.append((w1, h2))
    stairs.append(floor[-1])
    wide = {(w, h) for w, h in stairs if h <= w <= max_ratio * h}
    return sorted(wide | {(h, w) for w, h in wide}, key=lambda s: s[0] / s[1])


def nearest(size: tuple[int, int], sizes: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is nearest that of `size` (w, h), in log ratio; a tie
    goes to the first in `sizes`."""
    r = math.log(size[0] / size[1])
    return min(sizes, key=lambda b: abs(math.log(b[0] / b[1]) - r))


def crop_pixels(size: tuple[int, int], bucket: tuple[int, int]) -> int:
    """How many pixels (width or height, of the resized image) preprocess.cover_crop cuts off
    an image of `size` to land it on `bucket`."""
    w, h = cover_size(size, bucket)
    return max(w - bucket[0], h - bucket[1])


@dataclass(frozen=True)
class Framing:
    """How an image becomes the array encoded: the ADM centre crop to `resolution`, or with
    bucket `sizes` (--buckets) the cover crop onto the bucket nearest its aspect ratio.
    Called with a PIL image: (bucket (W, H) or None, uint8 (H, W, 3), extra meta)."""

    resolution: int
    sizes: tuple | None = None

    def __call__(self, img):
        if self.sizes is None:
            return None, center_crop(img, self.resolution), {}
        bucket = nearest(img.size, self.sizes)
        return bucket, cover_crop(img, bucket), {"crop": crop_pixels(img.size, bucket)}
