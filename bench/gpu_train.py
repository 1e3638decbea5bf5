"""DiT training speed on one GPU: images/s, MFU and peak memory, from a synthetic in-memory store.

    python3 bench/gpu_train.py [--models DiT-S/2,DiT-B/2,DiT-XL/2] [--batch-sizes 64,128,256]
                               [--grad-ckpt none,attn,mlp,every] [--steps 15] [--warmup 5] [--compile]
                               [--amp bf16|fp16|fp32] [--json results.json] [--device cuda]
    python3 bench/gpu_train.py --device cpu --models DiT-T/2 --steps 2      # smoke test, no GPU

What one configuration measures (DiT at 256 px: 4x32x32 latents, 1000 classes, ddpm with
learn_sigma, as DiT on ImageNet-256):

  ms/step, images/s   mean over --steps timed optimizer steps, after --warmup steps that are
                      left out (allocator warm-up, cuDNN/cuBLAS heuristics, torch.compile)
  TFLOP/s, MFU        model FLOPs: 2 (FLOPs per multiply-add) x 3 (forward + backward) x
                      dittrain.model.flops_per_forward(config) x batch, per second, over the
                      dense bf16 peak of the device (H100/H200: 989 TFLOP/s; --peak-tflops to
                      override). The recomputed forward of gradient checkpointing is NOT
                      counted (model FLOPs, not hardware FLOPs), so checkpointing shows as a
                      lower MFU. A bf16 matmul (8192^3) is also timed to give the device's
                      measured peak, and MFU against it is reported beside.
  peak memory         torch.cuda.max_memory_allocated over the configuration: weights, EMA,
                      gradients, AdamW state, activations, and the 64 MiB synthetic store
                      (the allocator's reserve, also in the JSON, is more)

THE STEP MIRRORS dittrain/train.py's loop; it is not imported from there, because the loop
lives inside `run()` and needs a latent store on disk. It is built from the same public
pieces, in the same order: DiT(get_config(...)) on the device with an EMA copy; Diffusion
with the model's learn_sigma; noise, timesteps and class-dropout draws from one device
generator; torch.autocast(bf16) around Diffusion.training_loss(...).mean(); GradScaler
(enabled only for fp16); backward; the non-finite check (a host sync, as in the loop);
unscale_; clip_grad_norm_(1.0); AdamW (fused on CUDA, lr 1e-4, no weight decay) step;
scaler.update(); the LR schedule's step; EMA by torch._foreach_lerp_(ema, model, 1 - 0.9999).
TF32 on. Gradient accumulation 1, one process (no DDP), no logging or checkpoints.

THE DATA is a resident store in GPU memory (--store-size latents of 4x32x32 fp16 with labels,
random numbers): a fresh permutation per epoch, a batch is one index_select + float32, as
dittrain's ResidentLoader with resident_device=cuda. Nothing is read from disk: this script
needs torch and numpy only (the store module and its zarr/webdataset backends are not
imported), so it runs on a bare GPU machine with `PYTHONPATH=. python3 bench/gpu_train.py`.

A configuration that runs out of memory is recorded as OOM and the larger batch sizes of
the same model and checkpointing setting are skipped. Results are printed as a markdown
table as they come and, with --json, rewritten to that file after every configuration (a
run cut short keeps what it measured). Without CUDA (and without --device cpu) the script
prints why and exits with status 2, measuring nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ditdata.store.devices import amp_dtype as trainer_amp  # noqa: E402
from dittrain.diffusion import Diffusion, DiffusionConfig  # noqa: E402
from dittrain.model import DiT, flops_per_forward, get_config  # noqa: E402

# A copy of dittrain.train.PEAK_FLOPS (dense bf16/fp16 tensor-core FLOP/s by device name):
# importing dittrain.train would pull in the store module and its dependencies.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "RTX 4090": 165e12,
              "RTX 3090": 71e12, "A6000": 155e12, "V100": 125e12}

LATENT = (4, 32, 32)  # 256 px through an f8 autoencoder with 4 channels
NUM_CLASSES = 1000
CLASS_DROPOUT, EMA_DECAY, LR, GRAD_CLIP = 0.1, 0.9999, 1e-4, 1.0


class ResidentLatents:
    """A synthetic store held on the device: x (n, C, h, w) fp16, y (n,) int64. Batches are
    the next batch_size samples of a fresh permutation per epoch (index_select + float32)."""

    def __init__(self, n: int, device: torch.device, seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)
        self.x = torch.randn((n, *LATENT), generator=g, device=device).to(torch.float16)
        self.y = torch.randint(0, NUM_CLASSES, (n,), generator=g, device=device)
        self.gen, self.n, self.pos = g, n, n
        self.perm = None

    def next(self, batch_size: int) -> dict:
        idx = []
        need = batch_size
        while need:
            if self.pos == self.n:
                self.perm, self.pos = torch.randperm(self.n, generator=self.gen, device=self.x.device), 0
            take = min(need, self.n - self.pos)
            idx.append(self.perm[self.pos:self.pos + take])
            self.pos += take
            need -= take
        idx = idx[0] if len(idx) == 1 else torch.cat(idx)
        return {"x": self.x.index_select(0, idx).float(), "y": self.y.index_select(0, idx)}


def amp_of(name: str, device: torch.device) -> tuple[torch.dtype | None, bool]:
    """(autocast dtype or None, grad scaler needed): the trainer's rule (ditdata.store.devices)."""
    dtype = trainer_amp(device, name)
    return dtype, dtype is torch.float16


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, batch: int, ckpt: str, data: ResidentLatents, device: torch.device, args) -> dict:
    """Build model, EMA, optimizer as train.py does; run warm-up + timed steps; free everything."""
    cfg = get_config(name, input_size=LATENT[-1], in_channels=LATENT[0], num_classes=NUM_CLASSES,
                     class_dropout_prob=CLASS_DROPOUT, learn_sigma=True, grad_checkpointing=ckpt)
    torch.manual_seed(0)
    with device:  # initialised in place: the weights' values do not change the speed
        model = DiT(cfg)
        ema = DiT(cfg).requires_grad_(False)
    ema.load_state_dict(model.state_dict())
    ema.eval()
    diffusion = Diffusion(DiffusionConfig(objective="ddpm", learn_sigma=cfg.learn_sigma))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    amp_dtype, needs_scaler = amp_of(args.amp, device)
    scaler = torch.amp.GradScaler(device.type, enabled=needs_scaler)
    noise_gen = torch.Generator(device=device).manual_seed(0)
    train_model = torch.compile(model) if args.compile else model
    ema_params, model_params = list(ema.parameters()), list(model.parameters())

    def step() -> None:  # dittrain/train.py's optimizer step, accumulation 1, one rank
        opt.zero_grad(set_to_none=True)
        b = data.next(batch)
        x0 = b["x"]
        noise = torch.randn(x0.shape, generator=noise_gen, device=device)
        t = diffusion.sample_timesteps(batch, generator=noise_gen, device=device)
        u = torch.rand(batch, generator=noise_gen, device=device)
        kwargs = {"y": b["y"], "force_drop_ids": u < CLASS_DROPOUT}
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            loss = diffusion.training_loss(train_model, x0, kwargs, t=t, noise=noise).mean()
        scaler.scale(loss).backward()
        if not torch.isfinite(loss.detach()):  # the loop's NaN/inf check (a host sync)
            raise RuntimeError(f"non-finite loss in {name} batch {batch}")
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        scaler.step(opt)
        scaler.update()
        sched.step()
        with torch.no_grad():
            torch._foreach_lerp_(ema_params, model_params, 1.0 - EMA_DECAY)

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    sync(device)
    warm = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t1 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t1)
    ms = 1e3 * sum(times) / len(times)
    flops = 6 * flops_per_forward(cfg) * batch  # per optimizer step
    row = {"model": name, "params_m": model.num_params() / 1e6, "grad_ckpt": ckpt, "batch": batch,
           "ms_per_step": ms, "ms_min": 1e3 * min(times), "ms_max": 1e3 * max(times),
           "images_per_s": batch / (ms / 1e3), "tflops": flops / (ms / 1e3) / 1e12,
           "warmup_s": warm, "status": "ok"}
    if device.type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    return row


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def matmul_peak(device: torch.device, n: int = 8192, reps: int = 50) -> float:
    """FLOP/s of a large bf16 matmul: what the tensor cores give here, for a second MFU."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t)


def fmt(row: dict, peak: float | None, measured: float | None) -> str:
    if row["status"] != "ok":
        return f"| {row['model']} | {row['grad_ckpt']} | {row['batch']} | - | - | - | - | - | {row['status']} |"
    mfu = f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "-"
    mfu_m = f"{100 * row['mfu_measured']:.1f}%" if row.get("mfu_measured") is not None else "-"
    mem = f"{row['peak_mem_gib']:.1f}" if "peak_mem_gib" in row else "-"
    return (f"| {row['model']} | {row['grad_ckpt']} | {row['batch']} | {row['ms_per_step']:.1f} | "
            f"{row['images_per_s']:.0f} | {row['tflops']:.1f} | {mfu} / {mfu_m} | {mem} | ok |")


HEADER = ("| model | grad ckpt | batch | ms/step | images/s | TFLOP/s | MFU (spec / measured peak) | "
          "peak mem (GiB) | status |\n|---|---|---:|---:|---:|---:|---:|---:|---|")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="DiT-S/2,DiT-B/2,DiT-XL/2")
    ap.add_argument("--batch-sizes", default=None, help="comma list (default 64,128,256; 2,4 on the CPU)")
    ap.add_argument("--grad-ckpt", default="none,every",
                    help="comma list of none | every | k | attn | mlp (the --grad-checkpointing of dittrain run)")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; 1 on the CPU)")
    ap.add_argument("--amp", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                    help="auto: bf16 on GPUs that have it (else fp16 + grad scaler), fp32 on the CPU")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (compiles per configuration)")
    ap.add_argument("--store-size", type=int, default=8192, help="latents in the in-memory store (at most 256 on the CPU)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: by device name)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None, help="write the results here (after every configuration)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_train: CUDA is not available on this machine; nothing measured. "
              "Run it on a GPU machine, or smoke-test with --device cpu --models DiT-T/2 --steps 2.",
              file=sys.stderr)
        sys.exit(2)
    on_cpu = device.type == "cpu"
    args.batch_sizes = args.batch_sizes or ("2,4" if on_cpu else "64,128,256")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    args.warmup = args.warmup if args.warmup is not None else (1 if on_cpu else 5)
    ckpts = [c.strip() for c in args.grad_ckpt.split(",")]
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        dev_name = torch.cuda.get_device_name(device)
    else:
        dev_name = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    peak = args.peak_tflops * 1e12 if args.peak_tflops else next(
        (v for k, v in PEAK_FLOPS.items() if device.type == "cuda" and k in dev_name), None)
    amp_dtype, _ = amp_of(args.amp, device)
    measured = matmul_peak(device) if device.type == "cuda" else None
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": dev_name,
           "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "amp": str(amp_dtype).replace("torch.", "") if amp_dtype else "fp32",
           "peak_flops": peak, "measured_bf16_matmul_flops": measured}
    print(f"gpu_train: {dev_name}, torch {torch.__version__} (CUDA {torch.version.cuda}), amp {env['amp']}, "
          f"{'compiled' if args.compile else 'eager'}; {args.warmup} warm-up + {args.steps} timed steps per "
          f"configuration; peak {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s"
          + (f" (bf16 matmul 8192^3 measured: {measured / 1e12:.0f} TFLOP/s)" if measured else ""), flush=True)

    data = ResidentLatents(args.store_size if not on_cpu else min(args.store_size, 256), device)
    rows: list[dict] = []

    def save() -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"env": env, "args": vars(args), "results": rows}, indent=1))

    print(HEADER, flush=True)
    t_all = time.perf_counter()
    for name in args.models.split(","):
        for ckpt in ckpts:
            oom_at = None
            for batch in batches:
                if oom_at is not None:
                    row = {"model": name, "grad_ckpt": ckpt, "batch": batch,
                           "status": f"skipped (OOM at batch {oom_at})"}
                else:
                    free(device)
                    try:
                        row = measure(name, batch, ckpt, data, device, args)
                    except torch.cuda.OutOfMemoryError:
                        row = {"model": name, "grad_ckpt": ckpt, "batch": batch, "status": "OOM"}
                        oom_at = batch
                    if row["status"] == "ok":
                        ips_flops = row["tflops"] * 1e12
                        row["mfu"] = ips_flops / peak if peak else None
                        row["mfu_measured"] = ips_flops / measured if measured else None
                    free(device)
                rows.append(row)
                print(fmt(row, peak, measured), flush=True)
                save()
    print(f"\n{len(rows)} configurations in {time.perf_counter() - t_all:.0f} s; MFU = 6 x flops_per_forward x "
          f"batch / step time / peak (recomputation of checkpointed blocks not counted)"
          + (f"; wrote {args.json}" if args.json else ""), flush=True)
    if not any(r["status"] == "ok" for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
