"""int8 latents (`ditdata encode --dtype int8`) against float16: the bytes an image costs, and
what the rounding does to the decoder's output.

    python bench/int8_latents.py [--taef2 ../shared/models/taef2] [--rae rae-dinov2-b] [--n 16]
                                 [--device cpu]

For each autoencoder, N real photos (bench/encode.py's) packed by `ditdata fetch` are encoded at
256 px twice, `--dtype float16` and `--dtype int8` (a float32 scale per token: the C channels at
one position, ditdata.store.quantize), and each store's latents are decoded by the autoencoder its
manifest names, as `dittrain sample` and `ditdata inspect --decode` find it. Reported:

    bytes / image          the store's shard files over its images (zarr, no flips)
    latent SNR (dB)        10 log10(sum z16^2 / sum (z8 - z16)^2) over every stored value
    PSNR int8 vs fp16      the decoder's output from the int8 latents against its output from the
                           float16 ones (pixels in [0, 1]): what int8 storage changes in an image
    PSNR vs the photo      each decoder output against the centre-cropped photo it encodes (only
                           meaningful for real weights: a random decoder does not reconstruct)

Autoencoders: TAEF2 with its real weights (--taef2 DIR; 32 x 32 x 32 latents at 256 px), and a
random diffusers AutoencoderRAE of --rae's architecture (bench/rae_encode.py's: the released
weights are not on this machine), whose figures depend on random weights and latent statistics,
not the released DINOv2's, so they show the mechanism, not the released model's loss.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from encode import photo_shards  # bench/encode.py
from rae_encode import save_random_rae  # bench/rae_encode.py
from scratch import add_device_args, parser, scratch_dir  # bench/scratch.py


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def _photos(shards: Path, resolution: int) -> dict[str, np.ndarray]:
    """{key: the centre crop `ditdata encode` encoded, float in [0, 1]}."""
    from ditdata.framing import center_crop
    from ditdata.imageshards import folder as imageshards

    return {s.key: center_crop(s.decode(), resolution).astype(np.float32) / 255
            for shard in imageshards.list_shards(shards) for s in imageshards.iter_shard(shard)}


def _decoded(store_dir: Path, device: str, batch: int = 4) -> tuple[dict[str, np.ndarray], np.ndarray, int]:
    """({key: decoded image (H, W, 3) in [0, 1]}, every latent value (float32), bytes / image)."""
    from ditdata.autoencoders.kinds import autoencoder_from_manifest
    from ditdata.store import LATENT_SCALES, open_store, values

    store = open_store(store_dir)
    ae = autoencoder_from_manifest(store.manifest["vae"], device=torch.device(device), strict=True)
    fields = ["latent", "key", *(["latent_scale"] if LATENT_SCALES["latent"] in store.schema.tensors else [])]
    images, latents = {}, []
    for shard in store.shards:
        data = store.read(shard, fields=fields)
        z = values(data, "latent")
        latents.append(z)
        for i in range(0, len(z), batch):
            with torch.no_grad():
                x = ae.decode(torch.from_numpy(z[i:i + batch]).to(device)).float().cpu()
            for key, img in zip(data["key"][i:i + batch], x.permute(0, 2, 3, 1).numpy(), strict=True):
                images[key] = img
    stored = sum(s.record["bytes"] for s in store.shards)
    return images, np.concatenate(latents), stored // len(store)


def measure(name: str, vae: str, shards: Path, tmp: Path, args) -> dict:
    from ditdata.encode import EncodeConfig, encode

    out = {}
    for dtype in ("float16", "int8"):
        encode(EncodeConfig(shards=str(shards), out=str(tmp / f"{name}-{dtype}"), vae=vae, resolution=256,
                            dtype=dtype, device=args.device, batch_size=8, workers=2, progress=False))
        out[dtype] = _decoded(tmp / f"{name}-{dtype}", args.device)
    photos = _photos(shards, 256)
    (im16, z16, b16), (im8, z8, b8) = out["float16"], out["int8"]
    keys = sorted(photos)
    return {
        "name": name, "shape": z16.shape[1:], "bytes": (b16, b8),
        "snr": 10 * np.log10(float((z16.astype(np.float64) ** 2).sum()) / float(((z8 - z16).astype(np.float64) ** 2).sum())),
        "psnr_8_16": float(np.mean([_psnr(im8[k], im16[k]) for k in keys])),
        "psnr_photo": (float(np.mean([_psnr(im16[k], photos[k]) for k in keys])),
                       float(np.mean([_psnr(im8[k], photos[k]) for k in keys]))),
    }


def main():
    ap = parser(__doc__, ("--n", 16, "photos"), ("--taef2", "", "TAEF2 weights folder (real weights); '' for none"),
                ("--rae", "rae-dinov2-b", "the random RAE's architecture (rae-dinov2-s, -b, -l; '' for none)"))
    add_device_args(ap, threads=False)
    args = ap.parse_args()

    with scratch_dir(None, "ditkit-int8-bench-") as tmp:
        photo_shards(tmp, args.n, 8)
        rows = []
        if args.taef2:
            rows.append(measure("TAEF2 (real weights)", args.taef2, tmp / "shards", tmp, args))
        if args.rae:
            vae = f"rae:{save_random_rae(tmp / 'rae', args.rae)}"
            rows.append(measure(f"{args.rae} (random weights)", vae, tmp / "shards", tmp, args))
        print(f"\n{args.n} photos at 256 px, {args.device} (torch threads {torch.get_num_threads()})\n")
        print("| autoencoder | latent | bytes / image fp16 | bytes / image int8 | latent SNR (dB) | PSNR int8 vs fp16 "
              "(dB) | PSNR vs the photo, fp16 / int8 (dB) |")
        print("|---|---|---:|---:|---:|---:|---|")
        for r in rows:
            print(f"| {r['name']} | {' x '.join(map(str, r['shape']))} | {r['bytes'][0]:,} | {r['bytes'][1]:,} | "
                  f"{r['snr']:.1f} | {r['psnr_8_16']:.1f} | {r['psnr_photo'][0]:.2f} / {r['psnr_photo'][1]:.2f} |")


if __name__ == "__main__":
    main()
