"""RAE latents: `ditdata encode --vae rae:DIR` speed, and the bytes an image costs in the store.

    python bench/rae_encode.py [--preset rae-dinov2-s] [--n 64] [--batch-size 16] [--device cpu]

The released weights are not on this machine, so the RAE is a random diffusers AutoencoderRAE of
the preset's architecture (its encoder: DINOv2 with registers of the preset's width, 12 layers,
patch 14 on a 224 px input; its decoder: the released ViT-XL, 1152 wide, 28 layers, 16 heads, MLP
4096, patch 16, bytetriper/RAE configs/decoder/ViTXL/config.json @ a4d18c4). Speed does not depend
on the weights' values. Encoding runs only the encoder; the decoder is built (and loaded) too.
The images are real photos (bench/encode.py's), packed by `ditdata fetch`, encoded at 256 px.
Bytes per image are the store's shard files over its images (fp16 latents, no flips).
"""

from __future__ import annotations

from pathlib import Path

import torch
from encode import photo_shards  # bench/encode.py
from scratch import add_device_args, parser, scratch_dir  # bench/scratch.py

WIDTHS = {"rae-dinov2-s": 384, "rae-dinov2-b": 768, "rae-dinov2-l": 1024}


def save_random_rae(path: Path, preset: str) -> Path:
    """A random diffusers AutoencoderRAE of `preset`'s architecture saved at `path` (seed 0)."""
    from diffusers import AutoencoderRAE

    torch.manual_seed(0)
    AutoencoderRAE(encoder_type="dinov2", encoder_hidden_size=WIDTHS[preset], encoder_patch_size=14,
                   encoder_num_hidden_layers=12, decoder_hidden_size=1152, decoder_num_hidden_layers=28,
                   decoder_num_attention_heads=16, decoder_intermediate_size=4096, patch_size=16,
                   encoder_input_size=224).save_pretrained(str(path))
    return path


def main():
    ap = parser(__doc__, ("--n", 64, "images"), ("--batch-size", 16, "encode's batch"),
                ("--workers", 2, "encode's decoding workers"), ("--preset", "rae-dinov2-s", "architecture"))
    add_device_args(ap, threads=False)
    args = ap.parse_args()

    from ditdata.encode import EncodeConfig, encode

    width = WIDTHS[args.preset]
    with scratch_dir(None, "ditkit-rae-bench-") as tmp:
        save_random_rae(tmp / "rae", args.preset)
        photo_shards(tmp, args.n)
        r = encode(EncodeConfig(shards=str(tmp / "shards"), out=str(tmp / "store"), vae=f"rae:{tmp / 'rae'}",
                                resolution=256, device=args.device, batch_size=args.batch_size,
                                workers=args.workers, progress=False))
        stored = sum(p.stat().st_size for p in (tmp / "store").rglob("*") if p.is_file() and "manifest" not in p.name)
        print(f"\n{args.n} images, random {args.preset} architecture ({width} x 16 x 16 latents) at 256 px on "
              f"{args.device} (torch threads {torch.get_num_threads()})\n")
        print("| what | value |\n|---|---:|")
        print(f"| encode images/s (batch {args.batch_size}, {args.workers} decode workers) | {r['images_per_s']:.2f} |")
        print(f"| stored bytes per image (fp16, zarr) | {stored / args.n:,.0f} |")
        print(f"| latent bytes per image (fp16, {width} x 16 x 16) | {width * 256 * 2:,} |")


if __name__ == "__main__":
    main()
