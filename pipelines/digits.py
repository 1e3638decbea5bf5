"""The 1,797 handwritten digits scikit-learn ships (load_digits: 8x8 scans, values 0..16) as a
class-folder tree of greyscale PNGs upscaled to SIZE px, ROOT/<digit>/NNNN.png, for
`ditdata fetch --kind classes`: the data of pipelines/demo.sh (and of bench/latent_norm.py).

    python pipelines/digits.py ROOT SIZE
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits


def digits_tree(root: Path, size: int) -> int:
    """Writes the tree; the number of digits."""
    digits = load_digits()
    for i, (img, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        folder = root / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        pixels = np.round(img * (255 / 16)).astype(np.uint8)
        Image.fromarray(pixels, "L").resize((size, size), Image.Resampling.BICUBIC).save(folder / f"{i:04d}.png")
    return len(digits.images)


if __name__ == "__main__":
    root = Path(sys.argv[1])
    print(f"{digits_tree(root, int(sys.argv[2]))} digits written to {root}", file=sys.stderr)
