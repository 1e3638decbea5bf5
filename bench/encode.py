"""Encoding throughput: `ditdata encode` against the naive extract-features loop.

    python bench/encode.py --taef2 ../shared/models/taef2 [--n 96] [--resolution 256] [--device cpu]

Both paths start from the same image shards (real photos from scikit-image and
scikit-learn, random crops saved as JPEG, packed by `ditdata fetch`) and apply the same
ADM center crop, so only the pipeline differs:

  naive     for each image: decode it, crop it, encode it alone (batch 1), np.save one
            .npy per sample (the fast-DiT extract_features pattern, single process)
  ditdata   `ditdata encode`: decoding in worker processes overlapped with batched
            encoding, written to a zarr latent store

Images/s is images encoded per wall-clock second, model loading excluded.
"""

from __future__ import annotations

import io
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from scratch import add_device_args, parser, scratch_dir  # bench/scratch.py


def make_photos(root: Path, n: int, seed: int = 0) -> Path:
    """n JPEGs of 300-700 px, cut at random from real photographs, 4 class folders."""
    from skimage import data
    from sklearn.datasets import load_sample_images

    photos = [data.astronaut(), data.chelsea(), data.coffee(), data.rocket(), *load_sample_images().images]
    rng = np.random.default_rng(seed)
    for i in range(n):
        src = photos[i % len(photos)]
        h, w = src.shape[:2]
        ch, cw = rng.integers(h // 2, h + 1), rng.integers(w // 2, w + 1)
        top, left = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
        img = Image.fromarray(src[top:top + ch, left:left + cw])
        scale = rng.uniform(300, 700) / max(img.size)
        img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.Resampling.BICUBIC)
        d = root / f"class{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        img.save(d / f"{i:05d}.jpg", quality=90)
    return root


def photo_shards(root: Path, n: int, samples_per_shard: int = 16) -> Path:
    """make_photos' n JPEGs under root/photos, packed by `ditdata fetch` into root/shards."""
    from ditdata.fetch import fetch

    make_photos(root / "photos", n)
    fetch(root / "photos", root / "shards", samples_per_shard=samples_per_shard, processes=2, progress=False)
    return root / "shards"


def naive(shards: Path, out: Path, ae, resolution: int, device: str) -> int:
    from ditdata.framing import center_crop
    from ditdata.imageshards import folder as imageshards

    out.mkdir(parents=True, exist_ok=True)
    n = 0
    for shard in imageshards.list_shards(shards):
        for s in imageshards.iter_shard(shard):
            img = Image.open(io.BytesIO(s.image)).convert("RGB")
            x = torch.from_numpy(center_crop(img, resolution)).permute(2, 0, 1)[None].float().div(255).to(device)
            with torch.no_grad():
                z, _ = ae.encode(x)
            np.save(out / f"{s.key}.npy", z[0].cpu().numpy())
            n += 1
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return n


def main():
    ap = parser(__doc__, ("--n", 96, "images"), ("--resolution", 256, "image side, px"),
                ("--batch-size", 32, "encode's batch"), ("--workers", 2, "encode's decoding workers"),
                ("--samples-per-shard", 16, "images per fetched shard"))
    ap.add_argument("--taef2", required=True, help="directory with taef2_encoder.pth and taef2_decoder.pth")
    add_device_args(ap, threads=False)
    args = ap.parse_args()

    from ditdata.autoencoders.kinds import load_autoencoder
    from ditdata.encode import EncodeConfig, encode

    with scratch_dir(None, "ditkit-encode-bench-") as tmp:
        photo_shards(tmp, args.n, args.samples_per_shard)
        ae = load_autoencoder(args.taef2, device=args.device)
        naive(tmp / "shards", tmp / "warm", ae, args.resolution, args.device)  # warm-up (caches, kernels)
        shutil.rmtree(tmp / "warm")

        t = time.perf_counter()
        n = naive(tmp / "shards", tmp / "naive", ae, args.resolution, args.device)
        naive_rate = n / (time.perf_counter() - t)

        r = encode(EncodeConfig(shards=str(tmp / "shards"), out=str(tmp / "store"), vae=args.taef2,
                                resolution=args.resolution, device=args.device, batch_size=args.batch_size,
                                workers=args.workers, progress=False))
        ours = r["images_per_s"]
        print(f"\n{n} images, TAEF2 at {args.resolution} px on {args.device} "
              f"(torch threads {torch.get_num_threads()})\n")
        print("| pipeline | images/s | speed-up |\n|---|---:|---:|")
        print(f"| naive loop (batch 1, one .npy each) | {naive_rate:.2f} | 1.0x |")
        print(f"| ditdata encode (batch {args.batch_size}, {args.workers} decode workers) | {ours:.2f} | "
              f"{ours / naive_rate:.1f}x |")


if __name__ == "__main__":
    main()
