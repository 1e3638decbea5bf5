"""Bytes per image per flip of cached REPA targets, and their fidelity, for ViT-S/B/L at 224 px.

    python bench/feature_bytes.py [--images 64] [--threads T] [--sizes S,B,L] [--pca 384,256,128]

For each DINOv2 size (transformers' Dinov2Model with the published widths and depths: S 384 x 12,
B 768 x 12, L 1024 x 24; patch 14 at 224 px = 16 x 16 = 256 patch tokens) it runs the encoder on
real photographs (scikit-image's data images, centre-cropped and tiled into 224 px views) and
stores the patch tokens the ways `ditdata features` can:

    fp16          256 x D x 2 bytes
    int8          256 x D x 1 + 256 x 4 (the per-token float32 scale: ditdata.store.quantize)
    int8+PCA K    256 x K x 1 + 256 x 4 (the PCA is fitted on the tokens of the images, as
                  `--features-dims K` does on a sample of the data; its K x D matrix lives once
                  in the feature set's manifest, not per image)

and reports, per way, the mean and the lowest cosine between each stored token (dequantized, and
mapped back through the PCA) and the fp32 encoder output, plus the PCA's explained variance.

The PCA is fitted on the tokens of the first half of the images and the cosines of every way
are measured on the other half (held out), as a feature set's PCA is fitted on a sample and
applied to all.

THE WEIGHTS ARE RANDOM (no hub here): the bytes are exact, and the int8 rows depend only on the
per-token spread of values, but the PCA rows depend on how concentrated the encoder's features
are, which differs between a random-weight ViT and trained DINOv2 (not measured with trained
weights yet): check `ditdata inspect`'s recorded explained variance and cosine on the real set.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from scratch import add_options, parse_on_device, parser  # noqa: E402  (bench/scratch.py)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ditdata.store import dequantize, quantize  # noqa: E402

SIZES = {"S": (384, 12, 6), "B": (768, 12, 12), "L": (1024, 24, 16)}
RES, PATCH = 224, 14


def photos(n: int) -> torch.Tensor:
    """(n, 3, 224, 224), ImageNet-normalised: views of scikit-image's colour photographs (square
    crops at three places along the longer side and two zooms, each also mirrored)."""
    from skimage import data, transform

    names = ["astronaut", "chelsea", "coffee", "rocket", "immunohistochemistry", "retina", "cat", "hubble_deep_field"]
    views = []
    for name in names:
        img = getattr(data, name)()
        if img.ndim != 3:
            continue
        img = img[..., :3].astype(np.float32) / 255.0
        h, w = img.shape[:2]
        side = min(h, w)
        crops = []
        for k in range(3):
            off = (max(h, w) - side) * k // 2
            crops.append(img[off:off + side, :side] if h > w else img[:side, off:off + side])
        for z in (2, 3):  # zooms on the centre and on the top-left quarter
            cut = side * (z - 1) // z
            crops.append(img[(h - cut) // 2:(h + cut) // 2, (w - cut) // 2:(w + cut) // 2])
        for c in crops:
            v = transform.resize(c, (RES, RES), anti_aliasing=True)
            views += [v, v[:, ::-1]]
    if n > len(views):
        raise SystemExit(f"feature_bytes.py: --images {n}: there are {len(views)} views")
    x = torch.from_numpy(np.ascontiguousarray(np.stack(views[:n]))).permute(0, 3, 1, 2).float()
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    return (x - mean) / std


def tokens(size: str, x: torch.Tensor) -> np.ndarray:
    """(N, 256, D) fp32 patch tokens of a random-weight DINOv2 of that size (CLS dropped)."""
    from transformers import Dinov2Config, Dinov2Model

    hidden, depth, heads = SIZES[size]
    torch.manual_seed(0)
    model = Dinov2Model(Dinov2Config(hidden_size=hidden, num_hidden_layers=depth, num_attention_heads=heads,
                                     image_size=RES, patch_size=PATCH)).eval()
    with torch.inference_mode():
        out = torch.cat([model(pixel_values=x[i:i + 4]).last_hidden_state for i in range(0, len(x), 4)])
    return out[:, 1:].numpy().astype(np.float32)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-12)


def pca(t: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, float]:
    """(components (k, D), mean (D,), explained variance) of the token vectors of t."""
    flat = t.reshape(-1, t.shape[-1]).astype(np.float64)
    mean = flat.mean(0)
    _, s, vt = np.linalg.svd(flat - mean, full_matrices=False)
    var = s**2
    return vt[:k].astype(np.float32), mean.astype(np.float32), float(var[:k].sum() / var.sum())


def rows_for(size: str, t: np.ndarray, ks: list[int]) -> list[dict]:
    fit, t = t[: len(t) // 2], t[len(t) // 2:]  # the PCA never sees the tokens it is judged on
    n, T, D = t.shape
    out = []
    half = t.astype(np.float16).astype(np.float32)
    out.append({"way": "fp16", "bytes": T * D * 2, "cos": cosines(half, t)})
    q, s = quantize(t)
    out.append({"way": "int8", "bytes": T * D + T * 4, "cos": cosines(dequantize(q, s), t)})
    for k in ks:
        comp, mean, explained = pca(fit, k)
        z = (t - mean) @ comp.T  # the stored K-dim targets
        qz, sz = quantize(z)
        back = dequantize(qz, sz) @ comp + mean
        out.append({"way": f"int8+PCA {k}", "bytes": T * k + T * 4, "cos": cosines(back, t), "explained": explained,
                    "cos_reduced": cosines(dequantize(qz, sz), z)})
    for r in out:
        r.update(size=f"ViT-{size}/14", dim=D, tokens=T, kib=r["bytes"] / 1024, cos_mean=float(r["cos"].mean()),
                 cos_min=float(r["cos"].min()))
        if "cos_reduced" in r:
            r["cos_reduced_mean"] = float(r.pop("cos_reduced").mean())
        del r["cos"]
    return out


def main() -> None:
    ap = parser(__doc__)
    add_options(ap, ("--images", 64, "224 px views of the photographs (at most 64)"),
                ("--sizes", "S,B,L", "DINOv2 sizes, of S, B, L"), ("--pca", "384,256,128", "PCA dims K for the int8+PCA rows"))
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args, _ = parse_on_device(ap)  # (--threads)
    x = photos(args.images)
    rows = []
    for size in args.sizes.split(","):
        t0 = time.perf_counter()
        t = tokens(size, x)
        rows += rows_for(size, t, [int(k) for k in args.pca.split(",") if int(k) < t.shape[-1]])
        print(f"ViT-{size}/14: {len(x)} images encoded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(f"{len(x)} images, 224 px, 256 patch tokens, random weights (see the docstring); PCA fitted on "
          f"{len(x) // 2}, cosines on the other {len(x) - len(x) // 2}\n")
    print("| encoder | stored as | bytes / image / flip | KiB | cosine to fp32 (mean / min) | PCA explained variance |")
    print("|---|---|---:|---:|---|---:|")
    for r in rows:
        ex = f"{r['explained']:.3f}" if "explained" in r else ""
        print(f"| {r['size']} (D={r['dim']}) | {r['way']} | {r['bytes']:,} | {r['kib']:.1f} | "
              f"{r['cos_mean']:.4f} / {r['cos_min']:.4f} | {ex} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
