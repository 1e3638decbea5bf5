"""What a REPA target costs per image: computed every step (the reference way) or read from the store.

    python bench/repa_target_cost.py [--images 64] [--batch-size 32] [--threads T] [--size S] [--dir DIR]

The reference way (REPA's training script) keeps the JPEGs and, at EVERY step, decodes each image,
(randomly flips it,) resizes it to 224 px (bicubic), normalises it and runs the frozen encoder on
it. Cached, the same targets are computed once by `ditdata features` and a run reads them from
the store beside the latents. This times both on this machine's CPU, per image:

    reference   PIL decode of a 256 px JPEG (quality 95) + flip + resize to 224 + normalise, then
                the forward of a DINOv2 ViT-S/14 (transformers' Dinov2Model, the published size,
                random weights: the cost does not depend on them), batches of --batch-size
    cached      the streaming loader over a store with that encoder's feature set (256 tokens x
                384 dims int8 + per-token scale, as `ditdata features` writes it), 2 workers;
                the targets handed over as stored (int8) and, apart, dequantized to float32 on
                the CPU

Both sides use the same images (scikit-image's photographs, crops of them, as 256 px JPEGs).
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import numpy as np
import torch
from feature_bytes import photos  # bench/feature_bytes.py
from scratch import parse_on_device, parser, scratch_dir  # bench/scratch.py

SIZES = {"S": (384, 12, 6), "B": (768, 12, 12)}


def jpegs(n: int) -> list[bytes]:
    from PIL import Image

    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    x = (photos(n) * std + mean).clamp(0, 1)  # back to [0, 1] pixels
    x = torch.nn.functional.interpolate(x, size=256, mode="bicubic", antialias=True).clamp(0, 1)
    out = []
    for img in (x.permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8):
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, "JPEG", quality=95)
        out.append(buf.getvalue())
    return out


def encoder(size: str):
    from transformers import Dinov2Config, Dinov2Model

    hidden, depth, heads = SIZES[size]
    torch.manual_seed(0)
    return Dinov2Model(Dinov2Config(hidden_size=hidden, num_hidden_layers=depth, num_attention_heads=heads,
                                    image_size=224, patch_size=14)).eval()


def reference(files: list[bytes], model, batch: int) -> tuple[float, float]:
    """(ms per image for decode+resize, ms per image for the forward), over all files."""
    from PIL import Image

    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    rng = np.random.default_rng(0)
    prep = fwd = 0.0
    for i in range(0, len(files), batch):
        t0 = time.perf_counter()
        imgs = []
        for f in files[i:i + batch]:
            img = Image.open(io.BytesIO(f)).convert("RGB")
            if rng.random() < 0.5:
                img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            imgs.append(np.asarray(img.resize((224, 224), Image.Resampling.BICUBIC)))
        x = (torch.from_numpy(np.stack(imgs)).permute(0, 3, 1, 2).float() / 255 - mean) / std
        t1 = time.perf_counter()
        with torch.inference_mode():
            model(pixel_values=x).last_hidden_state[:, 1:]
        t2 = time.perf_counter()
        prep, fwd = prep + t1 - t0, fwd + t2 - t1
    return prep / len(files) * 1e3, fwd / len(files) * 1e3


def cached(root: Path, n: int, dims: int, batch: int, workers: int) -> tuple[float, float]:
    """(ms per sample handed over as stored, ms per sample dequantized to float32 on the CPU)."""
    from feature_loader import write  # bench/feature_loader.py: the same synthetic store layout

    from ditdata.store import open_store
    from dittrain.data import StreamingLoader

    write(root, n, min(1024, n), dims, "int8")
    store = open_store(root / "store", features="vitb")
    out = []
    for dequantize in (False, True):
        loader = StreamingLoader(store, batch_size=batch, workers=workers, memory="auto")
        next(loader)
        steps = max(1, 2 * n // batch)
        t = time.perf_counter()
        for _ in range(steps):
            b = next(loader)
            if dequantize:
                feat = b["feat"].float()
                if "feat_scale" in b:
                    feat = feat * b["feat_scale"].unsqueeze(-1)
        out.append((time.perf_counter() - t) / (steps * batch) * 1e3)
        loader.close()
    return out[0], out[1]


def main() -> None:
    ap = parser(__doc__, ("--images", 64, "JPEGs the reference side decodes and encodes"),
                ("--batch-size", 32, "the reference side's encoder batch"),
                ("--store-samples", 4096, "samples of the cached side's store"),
                ("--workers", 2, "the cached side's streaming loader processes"), scratch=True)
    ap.add_argument("--size", default="S", choices=sorted(SIZES), help="the DINOv2 size of the reference side")
    args, _ = parse_on_device(ap)  # (--threads)
    files = jpegs(args.images)
    model = encoder(args.size)
    reference(files[: args.batch_size], model, args.batch_size)  # warm-up
    prep, fwd = reference(files, model, args.batch_size)
    with scratch_dir(args.dir, "ditkit-repa-cost-") as root:
        raw, deq = cached(root, args.store_samples, SIZES[args.size][0], 256, args.workers)
    print(f"\nViT-{args.size}/14 at 224 px, {args.images} images, batch {args.batch_size}, "
          f"{torch.get_num_threads()} torch threads\n")
    print("| way | ms per image | images/s |\n|---|---:|---:|")
    rows = [("reference: JPEG decode + flip + resize + normalise", prep),
            (f"reference: ViT-{args.size}/14 forward", fwd), ("reference: total, every step", prep + fwd),
            ("cached: read from the store (int8 as stored, 2 workers)", raw),
            ("cached: read + dequantize to float32 on the CPU", deq)]
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} | {1e3 / ms:,.0f} |")
    print(f"\nreference / cached (as stored): {(prep + fwd) / raw:,.0f}x")


if __name__ == "__main__":
    main()
