"""Optimizer-state memory of a DiT with --optimizer adamw and adamw8bit (issue 16).

    python bench/optimizer_memory.py [--model DiT-XL/2] [--resolution 256] [--classes 1000]
                                     [--optimizers adamw,adamw8bit] [--device cpu]

Builds the model as `dittrain run` does (4-channel latents of an f8 autoencoder, learned
sigma), gives every trainable parameter a zero gradient, takes ONE step of the optimizer the
trainer builds (dittrain.train.loop.build_optimizer, so the same lr, betas and weight decay), and
sums the bytes of the tensors in its state (distinct storages: bitsandbytes shares its
quantisation maps between parameters). Prints a Markdown table for bench/RESULTS.md. Needs
about 4x the fp32 model in RAM for adamw (weights, gradients, two moments): ~11 GB for XL/2.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import torch
from scratch import parser  # bench/scratch.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dittrain.config import TrainConfig  # noqa: E402
from dittrain.model.dit import DiT  # noqa: E402
from dittrain.model.sizes import get_config  # noqa: E402
from dittrain.train.optim import build_optimizer  # noqa: E402


def state_bytes(opt: torch.optim.Optimizer) -> tuple[int, Counter]:
    """(bytes of the distinct tensor storages in the optimizer's state, bytes by dtype)."""
    seen, by_dtype = {}, Counter()
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in seen:
                seen[v.untyped_storage().data_ptr()] = n = v.untyped_storage().nbytes()
                by_dtype[str(v.dtype).removeprefix("torch.")] += n
    return sum(seen.values()), by_dtype


def measure(name: str, optimizer: str, model: DiT, device: torch.device) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = build_optimizer(TrainConfig.from_flat(optimizer=optimizer), params, device)
    t0 = time.perf_counter()
    opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    total, by_dtype = state_bytes(opt)
    n = sum(p.numel() for p in params)
    row = {"model": name, "optimizer": optimizer, "params": n, "bytes": total, "per_param": total / n,
           "by_dtype": dict(by_dtype), "step_s": seconds}
    del opt
    for p in params:
        p.grad = None
    return row


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", default="DiT-XL/2")
    ap.add_argument("--resolution", type=int, default=256, help="image px (latents: /8, 4 channels)")
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--optimizers", default="adamw,adamw8bit")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    cfg = get_config(args.model, input_size=args.resolution // 8, in_channels=4, num_classes=args.classes,
                     learn_sigma=True)
    with torch.device("meta"):  # the values do not change the state's size: skip the init
        model = DiT(cfg)
    model = model.to_empty(device=device)
    if hasattr(model, "pos_embed"):  # frozen, so the optimizers never read it (RoPE models have none)
        torch.nn.init.zeros_(model.pos_embed)
    rows = [measure(args.model, o.strip(), model, device) for o in args.optimizers.split(",")]
    print(f"{args.model} at {args.resolution} px, {args.classes} classes: {rows[0]['params'] / 1e6:.1f}M trainable "
          f"parameters (fp32 weights {rows[0]['params'] * 4 / 1e9:.2f} GB), on {device}")
    print("| optimizer | state | bytes / parameter | by dtype | one step |")
    print("|---|---:|---:|---|---:|")
    for r in rows:
        dtypes = ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in sorted(r["by_dtype"].items(), key=lambda kv: -kv[1]))
        print(f"| {r['optimizer']} | {r['bytes'] / 1e9:.3f} GB ({r['bytes'] / 2**30:.2f} GiB) | {r['per_param']:.3f} | "
              f"{dtypes} | {r['step_s']:.1f} s |")


if __name__ == "__main__":
    main()
