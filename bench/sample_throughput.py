"""Evaluation-sampling speed: images/s of the FID protocols, and how long an FID-50K takes.

    python3 bench/sample_throughput.py [--models DiT-S/2,DiT-XL/2] [--batch-sizes 64,256]
                                       [--protocols ddpm250,euler50] [--timed-steps 10]
                                       [--amp bf16|fp16|fp32] [--json results.json] [--device cuda]
    python3 bench/sample_throughput.py --device cpu --models DiT-S/2 --batch-sizes 4 \\
        --timed-steps 2                                      # smoke test, no GPU

What one configuration measures (DiT at 256 px: 4x32x32 latents, 1000 classes, learn_sigma,
randomly initialised: the weights' values do not change the speed):

  protocol       ddpm250: DiT's FID protocol, 250 respaced ancestral DDPM steps, CFG 1.5
                 (every step one forward on the doubled batch [cond; uncond]);
                 euler50: 50 Euler steps of the flow objective, CFG 1.5 (SiT/LightningDiT-style)
  s/step         the real sampler (dittrain.diffusion.Diffusion.sample with guided CFG, in
                 the autocast dtype sampling uses) run for --timed-steps respaced steps after
                 one warm-up call, divided by the steps. A respaced step costs the same whatever
                 the total (one network call on the doubled batch plus element-wise updates), so
                 the protocol's time per batch is s/step x its steps; this is what makes an
                 XL/2 figure take seconds instead of the minutes a full 250-step batch takes.
  images/s       batch / (s/step x steps)
  FID-50K        50,000 / images/s: the DiT part only. The autoencoder decode (sd-vae-ft-ema at
                 256 px) and the Inception pass are extra; they are not measured here because
                 the GPU machine has no diffusers: both are small beside 250 XL/2 steps.

Needs torch only (PYTHONPATH=. python3 bench/sample_throughput.py on a bare GPU machine).
Without CUDA (and without --device cpu) it prints why and exits with status 2.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch
from scratch import add_device_args, add_options, open_device, parser, sync  # bench/scratch.py

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ditdata.common.devices import amp_dtype, autocast  # noqa: E402
from dittrain.diffusion import Diffusion, DiffusionConfig  # noqa: E402
from dittrain.model.dit import DiT  # noqa: E402
from dittrain.model.sizes import get_config  # noqa: E402

LATENT = (4, 32, 32)  # 256 px through an f8 autoencoder with 4 channels
NUM_CLASSES = 1000
FID_N = 50_000
# protocol -> (objective, sampler, steps, cfg scale)
PROTOCOLS = {"ddpm250": ("ddpm", "ddpm", 250, 1.5), "euler50": ("flow", "euler", 50, 1.5)}


def measure(name: str, protocol: str, batch: int, device: torch.device, args) -> dict:
    objective, sampler, steps, cfg_scale = PROTOCOLS[protocol]
    learn_sigma = objective == "ddpm"
    cfg = get_config(name, input_size=LATENT[-1], in_channels=LATENT[0], num_classes=NUM_CLASSES,
                     class_dropout_prob=0.1, learn_sigma=learn_sigma)
    with device:
        model = DiT(cfg).eval().requires_grad_(False)
    diffusion = Diffusion(DiffusionConfig(objective=objective, learn_sigma=learn_sigma))
    dtype = amp_dtype(device, args.amp, without_bf16="fp32")
    g = torch.Generator(device=device).manual_seed(0)
    y = torch.randint(0, NUM_CLASSES, (batch,), generator=g, device=device)
    cond = {"y": y}
    uncond = model.unconditional_kwargs(cond)
    # ddpm respacing needs at least 2 steps; the timed count stays well under the protocol's
    timed = max(2, min(args.timed_steps, steps))

    def run(n_steps: int) -> None:
        with autocast(device, dtype):
            diffusion.sample(model, (batch, *LATENT), steps=n_steps, sampler=sampler, cfg_scale=cfg_scale,
                             model_kwargs=cond, uncond_kwargs=uncond, generator=g, device=device)

    run(2)  # warm-up: allocator, cuBLAS heuristics
    sync(device)
    t0 = time.perf_counter()
    run(timed)
    sync(device)
    per_step = (time.perf_counter() - t0) / timed
    ips = batch / (per_step * steps)
    row = {"model": name, "protocol": protocol, "batch": batch, "steps": steps, "cfg": cfg_scale,
           "timed_steps": timed, "s_per_step": per_step, "images_per_s": ips, "fid50k_hours": FID_N / ips / 3600,
           "amp": str(dtype).replace("torch.", "") if dtype else "fp32"}
    if device.type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    return row


def main(argv=None) -> int:
    p = parser(__doc__)
    add_options(p, ("--models", "DiT-S/2,DiT-XL/2", "DiT sizes"), ("--batch-sizes", "64,256", "samples per forward"),
                ("--protocols", "ddpm250,euler50", "sampler and steps"), ("--timed-steps", 10, "steps timed"))
    p.add_argument("--amp", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    add_device_args(p, "cuda")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = open_device(args, "no CUDA device: nothing measured (use --device cpu for a smoke test)")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"device: {name}; torch {torch.__version__}")
    print("| model | protocol | batch | s/step | images/s | FID-50K (h, DiT only) |")
    print("|---|---|---:|---:|---:|---:|")
    rows = []
    for model in args.models.split(","):
        for protocol in args.protocols.split(","):
            for batch in (int(b) for b in args.batch_sizes.split(",")):
                try:
                    row = measure(model, protocol, batch, device, args)
                except torch.OutOfMemoryError:
                    row = {"model": model, "protocol": protocol, "batch": batch, "oom": True}
                    print(f"| {model} | {protocol} | {batch} | OOM | | |", flush=True)
                    rows.append(row)
                    break
                rows.append(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # the model of measure() is gone: free its memory for the next
                print(f"| {model} | {protocol} | {batch} | {row['s_per_step']:.4f} | {row['images_per_s']:.2f} | "
                      f"{row['fid50k_hours']:.2f} |", flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps({"device": name, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
