"""CLIP scoring throughput of `ditdata score` (samples/s).

    python bench/score.py [--n 256] [--batch-sizes 32,64] [--clip ViT-B-32] [--device cpu]
                          [--workers N] [--threads T] [--dir /tmp/ditkit-bench-score]

Builds an image-shard folder of N real photographs (random crops, 160-640 px a side,
of the scikit-image and scikit-learn sample pictures, JPEG quality 90) with captions, and
times for each batch size:

  end to end   ditdata.scoring.score.score() over the folder: tar reading, JPEG decoding and the
               model's preprocessing in worker threads, image + text towers, parquet
               writing (model loading excluded)
  model only   ClipModel.score_pixels() on already preprocessed pixels (both towers)
  decode only  the decoding pipeline alone: tar reading, JPEG decoding and the PIL steps
               of the preprocessing in the worker threads, batched to pixels (no model)

The weights are randomly initialised (pretrained=None): the speed is that of the real
architecture, the scores mean nothing. fp32 on the CPU, bf16 autocast on CUDA.
"""

from __future__ import annotations

import io
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image
from scratch import parser  # bench/scratch.py

from ditdata.imageshards import folder as imageshards


def source_images() -> list[tuple[str, np.ndarray]]:
    from skimage import data
    from sklearn.datasets import load_sample_images

    pics = [(n, getattr(data, n)()) for n in ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field",
                                               "immunohistochemistry")]
    names = ["china", "flower"]
    pics += list(zip(names, load_sample_images().images, strict=True))
    return [(n, a) for n, a in pics if a.ndim == 3 and a.shape[2] == 3]


def make_shards(folder: Path, n: int, per_shard: int = 128, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    pics = source_images()
    folder.mkdir(parents=True, exist_ok=True)
    num_shards = (n + per_shard - 1) // per_shard
    for s in range(num_shards):
        count = min(per_shard, n - s * per_shard)
        with imageshards.ShardWriter(folder, s) as w:
            for i in range(count):
                name, a = pics[rng.integers(len(pics))]
                h, wd = a.shape[:2]
                ch, cw = (int(rng.integers(min(160, h), min(640, h) + 1)), int(rng.integers(min(160, wd), min(640, wd) + 1)))
                y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, wd - cw + 1))
                buf = io.BytesIO()
                Image.fromarray(a[y:y + ch, x:x + cw]).save(buf, "JPEG", quality=90)
                key = imageshards.sample_key(s, i, per_shard)
                caption = f"a photograph of {name.replace('_', ' ')}, crop {i} of shard {s}"
                w.write(key, buf.getvalue(), "jpg", {"key": key, "caption": caption, "width": cw, "height": ch},
                        caption)
        imageshards.write_shard_stats(folder, s, {"count": count, "successes": count})
    imageshards.write_json_atomic(folder / imageshards.DATASET_INFO, {
        "format": imageshards.FORMAT, "version": imageshards.VERSION, "kind": "captions",
        "num_shards": num_shards, "num_samples": n})
    return folder


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--batch-sizes", default="32,64")
    ap.add_argument("--clip", default="ViT-B-32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workers", type=int, default=None, help="decoding threads (default: ditdata's)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()

    import torch

    from ditdata.clip import load_clip
    from ditdata.config import ScoreConfig
    from ditdata.scoring.score import prepared_samples, score

    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(args.dir or tempfile.mkdtemp(prefix="ditkit-bench-score-"))
    shutil.rmtree(root / "shards", ignore_errors=True)
    folder = make_shards(root / "shards", args.n)
    clip = load_clip(args.clip, None, device=args.device)
    samples = [s for tar in imageshards.list_shards(folder) for s in imageshards.iter_shard(tar)]
    print(f"# {args.clip} random init, {args.n} real-image crops, device {args.device}, "
          f"torch {torch.__version__} threads {torch.get_num_threads()}, {os.cpu_count()} CPUs "
          f"({platform.processor() or platform.machine()})")
    workers = args.workers if args.workers is not None else min(8, os.cpu_count() or 1)
    print(f"# decoding threads: {workers}")
    print("| batch | end to end (samples/s) | model only (samples/s) | decode only (samples/s) |")
    print("|---|---|---|---|")
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        # model only: both towers on preprocessed pixels, one warm-up batch first
        pixels = clip.preprocess_images([s.decode() for s in samples[:bs]])  # on the device
        caps = [s.caption for s in samples[:bs]]
        clip.score_pixels(pixels, caps)
        t = time.perf_counter()
        done = 0
        for start in range(0, args.n, bs):
            chunk = samples[start:start + bs]
            px = pixels[: len(chunk)]
            clip.score_pixels(px, [s.caption for s in chunk])
            done += len(chunk)
        model_rate = done / (time.perf_counter() - t)
        t = time.perf_counter()
        batch = []
        for tar in imageshards.list_shards(folder):
            for _, prepared, *_ in prepared_samples(imageshards.iter_shard(tar), clip.prepare_image, workers, 2 * bs):
                batch.append(prepared)
                if len(batch) == bs:
                    clip.pixels(batch)
                    batch = []
        if batch:
            clip.pixels(batch)
        decode_rate = args.n / (time.perf_counter() - t)
        summary = score(ScoreConfig(folder, pretrained=None, clip=args.clip, device=args.device, batch_size=bs,
                                    workers=workers, overwrite=True, progress=False))
        print(f"| {bs} | {summary['samples_per_s']:.1f} | {model_rate:.1f} | {decode_rate:.1f} |", flush=True)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
