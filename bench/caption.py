"""Captioner throughput of `ditdata caption` (images/s), speed only.

    PYTHONPATH=bench python bench/caption.py [--n 32] [--batch-sizes 1,4,8] [--max-new-tokens 32]
                                             [--repeats 3] [--hidden 256] [--layers 4] [--device cpu]
                                             [--threads T] [--dir DIR]

Builds a small random Qwen2.5-VL (transformers' Qwen2_5_VLForConditionalGeneration: a text
decoder of --layers layers of width --hidden, a vision tower of 4 blocks of width 128, patch 14,
2x2 merge; a byte-level tokenizer built offline; images resized by its processor to at most
16 x 16 patches, i.e. 64 image tokens), saves it with save_pretrained, and times
ditdata.captions.caption() over N real photographs (bench/score.py's crops) for each batch size:
tar reading, JPEG decoding, the processor, generate() and the parquet writing (model loading
excluded: the rate is the summary's), --repeats times (the median, each run's rate and the load
average after them are printed: on a shared machine the other load moves these figures a lot). A random model never emits its end-of-sequence token, so
every caption runs to --max-new-tokens: the rate is that of N x max_new_tokens generated tokens.
The weights are random: the speed is that of this architecture, the text means nothing, and a
real 3B/7B VLM is far slower. fp32 on the CPU, bf16 weights on CUDA.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import sys
from pathlib import Path

from score import make_shards  # bench/score.py
from scratch import parse_on_device, parser, row, scratch_dir  # bench/scratch.py


def small_qwen_vl(folder: Path, hidden: int, layers: int) -> Path:
    """A random Qwen2.5-VL of the given text width and depth, with its processor, saved (tests/vlm_util.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from vlm_util import random_qwen_vl

    heads = max(1, hidden // 64)
    return random_qwen_vl(folder, max_patches=64, text=dict(
        hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 1e6}),
        vision=dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=hidden,
                    window_size=112, fullatt_block_indexes=[3]))


def main() -> None:
    ap = parser(__doc__, ("--n", 32, "photographs captioned"),
                ("--batch-sizes", "1,4,8", "batch sizes timed, comma-separated"),
                ("--max-new-tokens", 32, "tokens generated per caption"), ("--hidden", 256, "text decoder width"),
                ("--layers", 4, "text decoder layers"),
                ("--repeats", 3, "runs per batch size (the median is reported)"), scratch=True)
    args, _ = parse_on_device(ap)

    import torch
    import transformers

    from ditdata.captions import caption
    from ditdata.config import CaptionConfig

    with scratch_dir(args.dir, "ditkit-bench-caption-") as root:
        model_dir = small_qwen_vl(root / "model", args.hidden, args.layers)
        shutil.rmtree(root / "shards", ignore_errors=True)
        folder = make_shards(root / "shards", args.n, per_shard=max(8, args.n // 4))
        params = sum(p.numel() for p in transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
            model_dir).parameters())
        print(f"# random Qwen2.5-VL, {params / 1e6:.1f} M parameters (text {args.layers} x {args.hidden}), "
              f"{args.n} real-image crops, {args.max_new_tokens} new tokens each, device {args.device}, "
              f"torch {torch.__version__}, transformers {transformers.__version__}, threads "
              f"{torch.get_num_threads()}, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()})")
        print("| batch | images/s, median (runs) | generated tokens/s (median) | truncated (of N) | load average |")
        print("|---|---:|---:|---:|---:|")
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            rates = []
            for r in range(args.repeats):  # a fresh set each time; the machine's other load shows in the spread
                s = caption(CaptionConfig(shards=str(folder), captioner=str(model_dir), out_name=f"b{bs}-{r}",
                                          max_new_tokens=args.max_new_tokens, batch_size=bs, device=args.device,
                                          progress=False))
                rates.append(s["images_per_s"])
            rate = statistics.median(rates)
            print(row(bs, f"{rate:.2f} ({', '.join(f'{x:.2f}' for x in rates)})", f"{rate * args.max_new_tokens:.0f}",
                      s["counts"].get("truncated", 0), f"{os.getloadavg()[0]:.1f}"), flush=True)


if __name__ == "__main__":
    main()
