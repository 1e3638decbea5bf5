"""The training loop, readable top to bottom.

    store -> loader -> [AMP forward, diffusion loss, backward] x accumulation -> clip -> AdamW
          -> EMA -> log -> checkpoint (every N, at the end, on SIGTERM/SIGINT)

One process or many (torchrun: DDP, each rank its own part of the store) run the same
code. Everything the model needs to know about the data (latent shape, classes, text
dims) comes from the store's manifest. Exact resume: a checkpoint holds every stateful
part (model, EMA, optimizer, scaler, LR schedule, each rank's loader and RNG states), so
N steps straight and N/2 + kill + resume + N/2 give the same losses and weights.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ditdata.store import DirLock, StoreError, files, open_store, refuse_inside_store
from dittrain.checkpoint import (
    EMA_EXPORT,
    CheckpointError,
    export_weights,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from dittrain.config import TrainConfig
from dittrain.data import build_loader
from dittrain.diffusion import Diffusion, DiffusionConfig
from dittrain.model import DiT, drop_text_conditioning, flops_per_forward, get_config

# Dense bf16/fp16 tensor-core peak FLOP/s by device name, for MFU. Unknown devices: no MFU.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "RTX 4090": 165e12,
              "RTX 3090": 71e12, "A6000": 155e12, "V100": 125e12}


class TrainError(Exception):
    """A run cannot start or continue; the message says why and what to do."""


# --------------------------------------------------------------------------- setup


def _distributed() -> tuple[int, int, int]:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return rank, world, int(os.environ.get("LOCAL_RANK", 0))


def _device(cfg: TrainConfig, local_rank: int) -> torch.device:
    if cfg.device == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(cfg.device)
    except RuntimeError:
        raise TrainError(f"--device {cfg.device!r}: not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainError(f"--device {cfg.device}: CUDA is not available on this machine")
    if device.type not in ("cpu", "cuda"):
        raise TrainError(f"--device {cfg.device}: dittrain trains on cpu or cuda")
    return device


def _amp(cfg: TrainConfig, device: torch.device) -> tuple[torch.dtype | None, bool]:
    """(autocast dtype or None for fp32, whether a grad scaler is needed)."""
    amp = cfg.amp
    if amp == "auto":
        if device.type != "cuda":
            return None, False  # CPU: fp32 (bf16 autocast is very slow on many CPUs)
        amp = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return {"fp32": (None, False), "bf16": (torch.bfloat16, False), "fp16": (torch.float16, True)}[amp]


def model_config_for(cfg: TrainConfig, manifest: dict):
    """The DiT config a store implies: in_channels, input size, classes and text dims come
    from the manifest; the architecture from the named size."""
    c, h, w = manifest["latent"]["shape"]
    if h != w:
        raise TrainError(f"latents are {h}x{w}; DiT here needs square latents")
    cond = manifest["conditioning"] or {}
    text = cond.get("text") or {}
    learn_sigma = cfg.learn_sigma if cfg.learn_sigma is not None else cfg.objective == "ddpm"
    tokens = text.get("tokens_shape")
    try:
        return get_config(
            cfg.model, input_size=h, in_channels=c,
            num_classes=int(cond.get("num_classes") or 0) if cond.get("type") == "class" else 0,
            class_dropout_prob=cfg.class_dropout, learn_sigma=learn_sigma, qk_norm=cfg.qk_norm,
            text_pooled_dim=text.get("pooled_dim") if cond.get("type") == "text" else None,
            text_token_dim=tokens[-1] if cond.get("type") == "text" and tokens else None,
            grad_checkpointing=_granularity(cfg.grad_checkpointing),
        )
    except KeyError as e:
        raise TrainError(f"unknown model {cfg.model!r}; see `dittrain models`") from e
    except AssertionError as e:
        raise TrainError(f"{cfg.model} does not fit latents {c}x{h}x{w}: {e}") from e
    except ValueError as e:  # e.g. --grad-checkpointing foo
        raise TrainError(str(e)) from e


def _granularity(g: str):
    return int(g) if str(g).isdigit() else g


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup from 0, then constant or cosine down to min_lr at max_steps."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "cosine":
        span = max(1, cfg.max_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
    return cfg.lr


def _rng_state(device: torch.device) -> dict:
    np_state = np.random.get_state(legacy=False)
    np_state["state"] = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in np_state["state"].items()}
    state = {"python": random.getstate(), "numpy": np_state, "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(_tuples(state["python"]))
    np_state = dict(state["numpy"])
    np_state["state"] = {k: (np.array(v, dtype=np.uint64) if isinstance(v, list) else v)
                         for k, v in np_state["state"].items()}
    np.random.set_state(np_state)
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _tuples(x):
    """random.setstate wants tuples; a checkpoint may hand back lists."""
    return tuple(_tuples(v) for v in x) if isinstance(x, list | tuple) else x


class _Stop:
    """SIGTERM/SIGINT: remember the request; the loop finishes its step, saves and exits."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _all_ranks_any(flag: bool, device, world: int) -> bool:
    if world == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _mean_over_ranks(x: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        x /= world
    return x


def _gather(obj, world: int) -> list:
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


# --------------------------------------------------------------------------- the run


def run(cfg: TrainConfig) -> dict:
    """Train as configured; rank 0 holds the run directory's lock for the whole run, so a
    second `dittrain run` (or --resume) on the same --out fails at once instead of writing
    into it too (DirectoryBusy). A run that fails before writing anything leaves no trace."""
    _check_out(Path(cfg.out))
    if _distributed()[0] != 0:
        return _train(cfg)
    with DirLock(cfg.out, "dittrain run"):
        return _train(cfg)


def _check_out(out: Path) -> None:
    """A run directory is never a latent store (readers never write one) nor an image-shard
    folder: mixing a run's files into either would damage it."""
    try:
        refuse_inside_store(out, "--out")
    except StoreError as e:
        raise TrainError(str(e)) from None
    if (out / "dataset.json").exists() or (out / ".fetch_state").exists():
        raise TrainError(f"--out {out} is an image-shard folder (from `ditdata fetch`); choose a run directory")


def _train(cfg: TrainConfig) -> dict:
    rank, world, local_rank = _distributed()
    device = _device(cfg, local_rank)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if cfg.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    master = rank == 0
    out = Path(cfg.out)

    # ---- the store decides the shapes ----
    try:
        store = open_store(cfg.latents)
    except StoreError as e:
        raise TrainError(str(e)) from e
    model_cfg = model_config_for(cfg, store.manifest)
    diff_cfg = DiffusionConfig(objective=cfg.objective, learn_sigma=model_cfg.learn_sigma)
    resolved = {
        "train": asdict(cfg),
        "model": asdict(model_cfg),
        "diffusion": asdict(diff_cfg),
        "store": {"path": str(Path(cfg.latents).resolve()), "identity": store.identity,
                  "num_samples": len(store)},
    }
    per_rank, rem = divmod(cfg.batch_size, world * cfg.accumulation_steps)
    if rem or per_rank == 0:
        raise TrainError(f"--batch-size {cfg.batch_size} must be a multiple of ranks ({world}) x "
                         f"--accumulation-steps ({cfg.accumulation_steps})")

    # ---- resume or start ----
    ckpt = None
    latest = latest_checkpoint(out)
    if latest is not None and not cfg.resume:
        raise TrainError(f"{out} already holds checkpoints (latest {latest.name}); "
                         "pass --resume to continue it, or choose another --out")
    if cfg.resume and latest is not None:
        ckpt = load_checkpoint(latest)
        if ckpt["config"]["store"]["identity"] != store.identity:
            raise CheckpointError(
                f"{latest}: made with another latent store ({ckpt['config']['store']['path']}, "
                f"{ckpt['config']['store']['identity'][:19]}...) than {cfg.latents} "
                f"({store.identity[:19]}...); resume with the same store, or start a new --out")
        if ckpt["config"]["model"] != resolved["model"]:
            raise CheckpointError(f"{latest}: model config differs from this run's "
                                  f"({cfg.model} on {cfg.latents}); keep the original flags")

    # ---- model, EMA, optimizer, loss ----
    torch.manual_seed(cfg.seed)
    model = DiT(model_cfg).to(device)
    ema = DiT(model_cfg).to(device).requires_grad_(False)
    ema.load_state_dict(model.state_dict())
    ema.eval()
    diffusion = Diffusion(diff_cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, cfg) / cfg.lr if cfg.lr else 0.0)
    amp_dtype, needs_scaler = _amp(cfg, device)
    scaler = torch.amp.GradScaler(device.type, enabled=needs_scaler)
    # Noise, timesteps and label/caption dropout come from this generator, on the device (no
    # host round trip per step); its state is part of every checkpoint. Every rank draws for
    # the GLOBAL micro-batch and keeps its own slice, so with a loader that hands each rank
    # its slice of the global batch, N ranks compute what one process would.
    noise_gen = torch.Generator(device=device).manual_seed(cfg.seed)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    global_micro = per_rank * world

    # A resumed run keeps the loader it was saved with (auto might choose another today).
    kind = ckpt["ranks"][rank]["loader"]["kind"] if ckpt is not None else cfg.loader
    try:
        loader = build_loader(
            store, batch_size=per_rank, kind=kind, seed=cfg.seed, rank=rank, world_size=world,
            device=device, resident_device=cfg.resident_device, workers=cfg.workers,
            shuffle_window=cfg.shuffle_window,
        )
    except ValueError as e:  # LoaderError (does not fit) or settings the loader refuses
        raise TrainError(str(e)) from e
    step, nonfinite_total = 0, 0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        ema.load_state_dict(ckpt["ema"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["lr_schedule"])
        scaler.load_state_dict(ckpt["scaler"])
        saved = ckpt["ranks"][rank]
        try:
            loader.load_state_dict(saved["loader"])
        except ValueError as e:
            raise TrainError(f"{latest}: cannot resume its data order: {e}; keep the original "
                             "--batch-size, --seed and loader flags") from e
        _set_rng_state(saved["rng"], device)
        noise_gen.set_state(saved["noise_gen"])
        step, nonfinite_total = ckpt["step"], ckpt.get("nonfinite_total", 0)
    # Only now, with everything built and loaded, does the run write into its directory:
    # a run refused on its settings leaves nothing behind.
    if master:
        out.mkdir(parents=True, exist_ok=True)
        (out / "samples").mkdir(exist_ok=True)
        _write_text(out / "config.json", json.dumps(resolved, indent=1))
        if ckpt is not None:
            _truncate_metrics(out / "metrics.jsonl", step)
    train_model = model
    if cfg.compile:
        train_model = torch.compile(model)
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_model = DDP(train_model, device_ids=[device.index] if device.type == "cuda" else None)
    empty_text = {k: torch.from_numpy(v.astype(np.float32) if v.dtype != bool else v).to(device)
                  for k, v in store.empty_caption().items()}

    # ---- bookkeeping ----
    tokens = (resolved_tokens(store) or 0) if model_cfg.text_token_dim else 0
    flops_step = 6 * flops_per_forward(model_cfg, tokens) * cfg.batch_size  # 2 FLOPs/MAC x (fwd + 2 bwd)
    peak = next((v for k, v in PEAK_FLOPS.items() if device.type == "cuda"
                 and k in torch.cuda.get_device_name(device)), None)
    writer = _tensorboard(out) if master else None
    if master:
        print(f"dittrain: {cfg.model} ({model.num_params() / 1e6:.1f} M params) on {device}, "
              f"{len(store)} latents {tuple(store.latent_shape)} from {cfg.latents}; loader "
              f"{loader.kind} ({loader.reason}); global batch {cfg.batch_size} = {world} rank(s) x "
              f"{cfg.accumulation_steps} accumulation x {per_rank}; "
              f"{'resuming at step ' + str(step) if ckpt else 'from scratch'}", file=sys.stderr)

    def save(final: bool = False) -> None:
        ranks = _gather({"loader": loader.state_dict(), "rng": _rng_state(device),
                         "noise_gen": noise_gen.get_state()}, world)
        if master:
            state = {"step": step, "model": model.state_dict(), "ema": ema.state_dict(),
                     "optimizer": opt.state_dict(), "lr_schedule": sched.state_dict(),
                     "scaler": scaler.state_dict(), "ranks": ranks, "config": resolved,
                     "nonfinite_total": nonfinite_total}
            save_checkpoint(out, step, state, keep=cfg.keep)
            export_weights(out / EMA_EXPORT, ema.state_dict(), resolved)
        if world > 1:
            dist.barrier()

    consecutive_bad = 0
    log_path = out / "metrics.jsonl"
    t_last, wait_last, steps_since = time.perf_counter(), loader.wait_seconds, 0
    bar = _progress(master, step, cfg.max_steps)
    with _Stop() as stop, bar:  # (the bar closes on errors too: its line stays whole)
        while step < cfg.max_steps:
            # ---- one optimizer step: accumulation micro-batches ----
            opt.zero_grad(set_to_none=True)
            loss_sum = torch.zeros((), device=device)
            for micro in range(cfg.accumulation_steps):
                batch = next(loader)
                x0 = batch["x"]
                noise = torch.randn((global_micro, *x0.shape[1:]), generator=noise_gen, device=device)[mine]
                t = diffusion.sample_timesteps(global_micro, generator=noise_gen, device=device)[mine]
                u = torch.rand(global_micro, generator=noise_gen, device=device)[mine]
                kwargs = _conditioning(batch, empty_text, cfg, u)
                sync = micro == cfg.accumulation_steps - 1 or world == 1
                ctx = contextlib.nullcontext() if sync else train_model.no_sync()
                with ctx:
                    with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                        loss = diffusion.training_loss(train_model, x0, kwargs, t=t, noise=noise).mean()
                    scaler.scale(loss / cfg.accumulation_steps).backward()
                loss_sum += loss.detach()
            loss_mean = _mean_over_ranks(loss_sum / cfg.accumulation_steps, world)

            # ---- NaN/inf: skip the step, count it, give up after too many in a row ----
            if not torch.isfinite(loss_mean):
                consecutive_bad += 1
                nonfinite_total += 1
                opt.zero_grad(set_to_none=True)
                if consecutive_bad >= cfg.max_nonfinite:
                    raise TrainError(
                        f"{consecutive_bad} consecutive non-finite losses at step {step}: training "
                        "diverged. Lower --lr, use --amp bf16/fp32, or resume from an earlier checkpoint")
                continue
            consecutive_bad = 0
            scaler.unscale_(opt)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
            scaler.step(opt)
            scaler.update()
            sched.step()
            with torch.no_grad():  # EMA: e <- d e + (1 - d) p
                torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1.0 - cfg.ema)
            step += 1
            steps_since += 1

            # ---- log ----
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                now = time.perf_counter()
                dt_ = now - t_last
                wait = loader.wait_seconds - wait_last
                ips = steps_since * cfg.batch_size / dt_ if dt_ > 0 else 0.0
                rec = {"step": step, "loss": loss_mean.item(), "lr": sched.get_last_lr()[0],
                       "grad_norm": float(grad_norm), "images_per_s": ips,
                       "data_wait_frac": wait / dt_ if dt_ > 0 else 0.0,
                       "nonfinite_skipped": nonfinite_total}
                if device.type == "cuda":
                    rec["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
                if peak:
                    rec["mfu"] = flops_step * steps_since / dt_ / (peak * world)
                if master:
                    with open(log_path, "a") as f:
                        f.write(json.dumps(rec) + "\n")
                    if writer is not None:
                        for k, v in rec.items():
                            if k != "step":
                                writer.add_scalar(f"train/{k}", v, step)
                    bar.set_postfix_str(f"loss {rec['loss']:.4f} lr {rec['lr']:.2e} "
                                        f"{ips:.0f} img/s wait {100 * rec['data_wait_frac']:.0f}%")
                t_last, wait_last, steps_since = now, loader.wait_seconds, 0
            bar.update(1)

            # ---- checkpoint, samples, stop requests ----
            stopping = _all_ranks_any(stop.requested, device, world)
            if step % cfg.save_every == 0 or step == cfg.max_steps or stopping:
                save()
            if master and cfg.sample_every and step % cfg.sample_every == 0:
                _sample_grid(ema, resolved, store, out / "samples" / f"step_{step:08d}.png", cfg, device)
            if stopping:
                if master:
                    print(f"\ndittrain: stopped by signal at step {step}; checkpoint saved, "
                          f"resume with --resume", file=sys.stderr)
                break
    bar.close()
    loader.close()
    if master and step == cfg.max_steps and cfg.sample_every > 0 and step % cfg.sample_every:
        _sample_grid(ema, resolved, store, out / "samples" / f"step_{step:08d}.png", cfg, device)
    if writer is not None:
        writer.close()
    if world > 1:
        dist.barrier()
    return {"step": step, "out": str(out), "nonfinite_skipped": nonfinite_total}


def resolved_tokens(store) -> int | None:
    text = (store.manifest["conditioning"] or {}).get("text") or {}
    shape = text.get("tokens_shape")
    return shape[0] if shape else None


def _conditioning(batch: dict, empty_text: dict, cfg: TrainConfig, u: torch.Tensor) -> dict:
    """Model kwargs of a batch. u (B,) uniform draws decide classifier-free-guidance
    dropout: labels -> the null class (u < class_dropout), captions -> the store's
    empty-caption embedding (u < caption_dropout)."""
    kwargs = {}
    if "y" in batch:
        kwargs["y"] = batch["y"]
        kwargs["force_drop_ids"] = u < cfg.class_dropout
    text = {k: batch[k] for k in ("text_pooled", "text_tokens", "text_mask") if k in batch}
    if text:
        kwargs |= drop_text_conditioning(text, empty_text, u < cfg.caption_dropout)
    return kwargs


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop log lines past the checkpoint we resume from: they will be logged again. A line
    that does not parse (torn by a crash mid-write) is dropped too."""
    if not path.exists():
        return
    keep = []
    for ln in path.read_text(errors="replace").splitlines():
        try:
            if json.loads(ln)["step"] <= step:
                keep.append(ln)
        except (ValueError, KeyError, TypeError):
            continue
    _write_text(path, "".join(ln + "\n" for ln in keep))


def _write_text(path: Path, text: str) -> None:
    """Replace a run file atomically (a crash leaves the old or the new one, never half)."""
    try:
        files.write_text_atomic(path, text)
    except OSError as e:
        raise TrainError(f"{path}: could not write ({files.error_reason(e)})") from e


def _tensorboard(out: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is the optional [train] extra
        return None
    return SummaryWriter(str(out / "tensorboard"))


def _progress(enabled: bool, start: int, total: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=start, disable=not enabled, unit="step", dynamic_ncols=True,
                file=sys.stderr, mininterval=1.0)


def _sample_grid(ema, resolved: dict, store, path: Path, cfg: TrainConfig, device) -> None:
    """An EMA sample grid, when the store's autoencoder can be loaded here (else a note)."""
    try:
        from dittrain.sample import write_training_grid
    except ImportError:
        return
    try:
        write_training_grid(ema, resolved, store, path, steps=cfg.sample_steps, cfg_scale=cfg.sample_cfg,
                            seed=cfg.seed, device=device)
    except Exception as e:  # samples are a convenience: never kill a run over them
        print(f"dittrain: no sample grid at {path.name} ({type(e).__name__}: {e})", file=sys.stderr)
