"""DiT training speed on one GPU: the trainer's own step (dittrain.train.step.TrainStep), settled
one step late as dittrain.train.loop's loop does, per configuration.

    python3 bench/gpu_train.py [--configs SPEC;SPEC;...] [--steps 10] [--warmup 3] [--json out.json]
    python3 bench/gpu_train.py --device cpu --configs "DiT-T/2:4:none:off;DiT-T/2:4:selective:blocks"  # smoke test

A configuration SPEC is MODEL:BATCH:CKPT:COMPILE[:MODE[:LOADER[:EXTRA]]]
  CKPT      --grad-checkpointing: none | every | k | attn | mlp | selective
  COMPILE   --compile: off | blocks (each DiTBlock, regional) | model (the whole forward)
  MODE      torch.compile mode: default | reduce-overhead (CUDA graphs) | max-autotune-no-cudagraphs
  LOADER    gpu (default: dittrain.plan.probe's synthetic store held on the device, a batch = one
            index_select of a fresh permutation per pass, no disk, torch only) | resident-cuda | resident | streaming (dittrain.data's loaders over
            a real latent store written to --store-dir first: needs ditdata's store backends, zarr)
  EXTRA     options joined by "+" (with the gpu loader):
            repa: `dittrain run --repa` on synthetic targets held on the device like the
              latents, ViT-B/14's 768 dims on the model's token grid (16 x 16 for XL/2, as ViT-B/14
              at 224 px), int8 + per-token scale, block 8, weight 0.5, projector 2048 (dittrain.train.repa,
              as dittrain.train.loop builds it: dittrain.plan.probe.build); the row next to
              the same configuration without it gives REPA's step-time overhead
            route=RATE,START,END: `dittrain run --route RATE:START:END` (TREAD, dittrain.model.routing);
              its MFU counts the FLOPs the routed step computes (flops_per_forward(tokens=))
            latent=CxHxW: the latents' shape (default 4x32x32; 32x16x16 is VA-VAE's at 256 px,
              what LightningDiT-XL/1 trains on)
A recipe row, recipe:NAME[:BATCH[:MODEL]], is one of pipelines/configs/recipes/NAME.toml as its [run]
table says (model, batch, precision, objective, optimizer settings, --repa on synthetic targets,
--route, the velocity cosine term; the latents' shape from its [encode] autoencoder), at its global batch
in micro-batches of at most 256 with --grad-checkpointing selective when a micro-batch of the recipe's
precision would not otherwise fit (fp32, or accumulation); BATCH and MODEL override the recipe's (a CPU
smoke test: recipe:sit_xl2_repa:2:DiT-T/2).
The default list (CUDA) covers DiT-XL/2, B/2 and S/2 at batch 256, eager against compiled,
CUDA graphs for the small models, checkpointing every block against selective checkpointing,
the loaders' data wait for DiT-S/2 (only where zarr imports), XL/2 with --repa and with
--route 0.5:2:24 (TREAD's i = 2, j = depth - 4), and LightningDiT-XL/1 on VA-VAE's 32x16x16 latents.

What one configuration reports (DiT at 256 px: 4x32x32 latents unless latent=, 1000 classes, ddpm with
learn_sigma, bf16 autocast on the GPU; AdamW fused, lr 1e-4, clipping at 1.0, EMA 0.9999, TF32):
  ms/step, images/s   wall time of --steps timed steps / steps, after --warmup untimed ones
                      (compilation, CUDA-graph recording, allocator warm-up); no per-step sync,
                      as in the trainer: step k+1's forward/backward is queued before step k
                      is settled (dittrain.train.step)
  compile s           the warm-up's time beyond --warmup eager-speed steps (~ the compile time)
  MFU                 2 x 3 x dittrain.model.sizes.flops_per_forward(config) x batch per second over the
                      dense bf16 peak (H100/H200: 989 TFLOP/s), and over a measured 8192^3 bf16
                      matmul; recomputation of checkpointing is not counted (model FLOPs)
  peak memory         torch.cuda.max_memory_allocated over the configuration
  host syncs/step     calls torch.cuda.set_sync_debug_mode("warn") flags during the timed steps
                      (item(), bool(), synchronizing copies...), per step. The settle's event
                      wait on the PREVIOUS step is not one (the device is already busy with the
                      next step) and is not counted.
  data wait           time inside next(loader) / wall time, over the timed steps
  SDPA                dittrain.model.attention.attention_backend: the attention kernel for this shape/dtype

A configuration that runs out of memory or fails to compile is recorded with its error and
the script goes on. Results print as a markdown table as they come and, with --json, are
rewritten after every configuration (a run cut short keeps what it measured). Without CUDA
(and without --device cpu) the script prints why and exits with status 2.
"""

from __future__ import annotations

import gc
import json
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from scratch import add_device_args, open_device, parser, sync  # bench/scratch.py

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ditdata.common.devices import amp_dtype as trainer_amp  # noqa: E402
from ditdata.common.devices import gpu_named  # noqa: E402
from dittrain.config import SECTION_OF, TrainConfig  # noqa: E402
from dittrain.model.attention import attention_backend  # noqa: E402
from dittrain.model.dit import num_params  # noqa: E402
from dittrain.model.routing import block_tokens, parse_route  # noqa: E402  (TREAD's counting, as a new run)
from dittrain.model.routing import check as check_route  # noqa: E402
from dittrain.model.sizes import flops_per_forward, get_config  # noqa: E402
from dittrain.plan.probe import build as build_step  # noqa: E402 (the step as dittrain.train.loop builds it)
from dittrain.plan.probe import run_steps  # noqa: E402 (n steps as dittrain.train.loop._loop runs them)

LATENT = (4, 32, 32)  # 256 px through an f8 autoencoder with 4 channels
REPA_DIMS = 768  # DINOv2 ViT-B/14's patch features (its 16 x 16 tokens at 224 px: the XL/2 grid)
REPA_DEPTH, REPA_PROJECTOR = 8, 2048  # dittrain run's --repa-depth and --repa-projector-dim defaults
NUM_CLASSES = 1000
DEFAULT_CUDA = ";".join([  # the targets first: a run cut short keeps what matters most
    "DiT-XL/2:256:none:off", "DiT-XL/2:256:none:blocks", "DiT-XL/2:256:none:off:default:gpu:repa",
    "DiT-XL/2:256:none:off:default:gpu:route=0.5,2,24", "LightningDiT-XL/1:256:none:off:default:gpu:latent=32x16x16",
    "DiT-S/2:256:none:off", "DiT-S/2:256:none:model:reduce-overhead",
    "DiT-XL/2:256:every:blocks", "DiT-XL/2:256:selective:blocks", "DiT-XL/2:256:every:off",
    "DiT-S/2:256:none:blocks", "DiT-S/2:256:none:model", "DiT-S/2:256:none:blocks:reduce-overhead",
    "DiT-B/2:256:none:off", "DiT-B/2:256:none:blocks", "DiT-B/2:256:none:model:reduce-overhead",
    "DiT-S/2:256:none:model:reduce-overhead:resident-cuda", "DiT-S/2:256:none:model:reduce-overhead:streaming",
    "DiT-XL/2:256:none:blocks:default:gpu:repa", "DiT-XL/2:256:none:blocks:default:gpu:route=0.5,2,24",
    "LightningDiT-XL/1:256:none:blocks:default:gpu:latent=32x16x16",
])
DEFAULT_CPU = ("DiT-T/2:4:none:off;DiT-T/2:4:selective:off;DiT-T/2:4:none:off:default:gpu:repa;"
               "DiT-T/2:4:none:off:default:gpu:route=0.5,1,4")


def real_loader(spec: dict, device: torch.device, args):
    """One of dittrain.data's loaders over a real latent store written to --store-dir first."""
    if spec["repa"] or spec["route"] or spec["latent"] != LATENT:
        raise SystemExit("gpu_train: repa, route= and latent= rows use the gpu loader (synthetic latents on the device)")
    from scratch import synthetic_store  # bench/scratch.py (imports the store module: zarr)

    from dittrain.data import LoaderConfig, build_loader

    store = synthetic_store(Path(args.store_dir) / f"store-{args.store_size}", args.store_size, 10_000)
    loader_kind, resident_device = {"resident-cuda": ("resident", "cuda"), "resident": ("resident", "cpu"),
                                    "streaming": ("streaming", "cpu")}[spec["loader"]]
    settings = LoaderConfig(kind=loader_kind, resident_device=resident_device if device.type == "cuda" else "cpu",
                            workers=args.workers)
    return build_loader(str(store), settings, batch_size=spec["batch"], seed=0, device=device)


RECIPES = ROOT / "pipelines" / "configs" / "recipes"
RECIPE_MICRO = 256  # a recipe's global batch runs in micro-batches of at most this many samples
RECIPE_LATENTS = {"vavae-f16d32": (32, 16, 16)}  # else an f8 4-channel autoencoder's LATENT at 256 px


def recipe_settings(name: str) -> dict:
    """The TrainConfig fields a recipe's [run] table sets, checked and converted by `dittrain run`'s own
    --config reader, and the latents' shape its [encode] table's autoencoder gives."""
    from ditdata.common import configfile
    from dittrain.cli import RunCommand, run_cmd

    path = RECIPES / f"{name}.toml"
    data = configfile.read(path)
    run = configfile.command_table(path, data, "run")
    values = configfile.defaults_from(run_cmd, path, run, {**SECTION_OF, **RunCommand.EXTRA})
    latent = RECIPE_LATENTS.get((data.get("encode") or {}).get("vae"), LATENT)
    return {"train": values, "latent": latent}


def recipe_row(spec: str, parts: list[str]) -> dict:
    parts = [*parts[:3], ":".join(parts[3:])] if len(parts) > 4 else parts  # MODEL may be custom:...
    if not 2 <= len(parts) <= 4:
        raise SystemExit(f"gpu_train: config {spec!r}: want recipe:NAME[:BATCH[:MODEL]]")
    got = recipe_settings(parts[1])
    train = got["train"]
    batch = int(parts[2]) if len(parts) > 2 else int(train.get("batch_size", 256))
    micro = min(batch, RECIPE_MICRO)
    fp32 = train.get("amp") == "fp32"
    return {"model": parts[3] if len(parts) > 3 else train["model"], "batch": batch,
            "grad_ckpt": "selective" if fp32 or micro < batch else "none", "compile": "off", "mode": "default",
            "loader": "gpu", "repa": bool(train.get("repa")), "route": train.get("route", ""),
            "latent": got["latent"], "recipe": parts[1], "accumulation": batch // micro, "train": train}


def parse_spec(spec: str) -> dict:
    parts = spec.strip().split(":")
    if parts[0] == "recipe":
        return recipe_row(spec, parts)
    if parts[0] == "custom":  # a custom size, custom:hidden=..., holds a colon of its own
        parts = [f"custom:{parts[1]}", *parts[2:]]
    if not 4 <= len(parts) <= 7:
        raise SystemExit(f"gpu_train: config {spec!r}: want MODEL:BATCH:CKPT:COMPILE[:MODE[:LOADER[:EXTRA]]]")
    model, batch, ckpt, comp = parts[:4]
    mode = parts[4] if len(parts) > 4 else "default"
    loader = parts[5] if len(parts) > 5 else "gpu"
    row = {"model": model, "batch": int(batch), "grad_ckpt": ckpt, "compile": comp, "mode": mode, "loader": loader,
           "repa": False, "route": "", "latent": LATENT}
    for option in (parts[6].split("+") if len(parts) == 7 else []):
        key, _, value = option.partition("=")
        if key == "repa" and not value:
            row["repa"] = True
        elif key == "route" and value:
            row["route"] = value.replace(",", ":")  # --route's RATE:START:END
        elif key == "latent" and value:
            row["latent"] = tuple(int(v) for v in value.split("x"))
        else:
            raise SystemExit(f"gpu_train: config {spec!r}: unknown option {option!r} (repa, route=R,S,E, latent=CxHxW)")
    return row


def build(spec: dict, device: torch.device, args):
    """(model config, TrainStep, LR schedule, loader, autocast dtype) of one configuration, built by
    dittrain.plan.probe as dittrain.train.loop builds a run (one rank); the gpu loader is probe's synthetic
    store on the device, the others dittrain.data's over a real store."""
    ckpt = int(spec["grad_ckpt"]) if spec["grad_ckpt"].isdigit() else spec["grad_ckpt"]
    latent = spec["latent"]
    recipe = spec.get("train")
    learn_sigma = True if recipe is None else recipe.get("learn_sigma", recipe.get("objective", "ddpm") == "ddpm")
    qk = {} if recipe is None or recipe.get("qk_norm") is None else {"qk_norm": recipe["qk_norm"]}
    cfg = get_config(spec["model"], input_size=latent[-1], in_channels=latent[0], num_classes=NUM_CLASSES,
                     class_dropout_prob=0.1, learn_sigma=learn_sigma, grad_checkpointing=ckpt, **qk)
    check_route(parse_route(spec["route"]), cfg.depth, spec["model"])  # as dittrain run: END within the model
    repa = dict(repa="synthetic", repa_depth=min(REPA_DEPTH, cfg.depth), repa_weight=0.5,
                repa_projector_dim=REPA_PROJECTOR) if spec["repa"] else {}
    if recipe is not None:  # the recipe's own settings; the synthetic feature set stands for its targets
        keep = {k: v for k, v in recipe.items() if k not in ("model", "learn_sigma", "qk_norm", "latents", "out")}
        if args.amp != "auto":  # --amp overrides the recipe's precision (the CPU smoke test: fp32)
            keep["amp"] = recipe["amp"] = args.amp
        repa = {k: v for k, v in repa.items() if k not in ("repa_depth",)} if repa else {}
        if repa:
            repa["repa_depth"] = min(int(keep.pop("repa_depth", REPA_DEPTH)), cfg.depth)
        tcfg = TrainConfig.from_flat(**{**keep, **repa, "batch_size": spec["batch"],
                                        "accumulation_steps": spec["accumulation"], "grad_checkpointing": spec["grad_ckpt"],
                                        "route": spec["route"]})
    else:
        tcfg = TrainConfig.from_flat(batch_size=spec["batch"], grad_clip=1.0, ema=0.9999, lr=1e-4, seed=0,
                                     amp=args.amp, compile=spec["compile"], compile_mode=spec["mode"],
                                     route=spec["route"], **repa)
    gpu = spec["loader"] == "gpu"
    step, sched, loader = build_step(tcfg, cfg, device, samples=args.store_size if gpu else None,
                                     targets=(cfg.num_tokens, REPA_DIMS) if spec["repa"] else None)
    if not gpu:
        loader = real_loader(spec, device, args)
    return cfg, step, sched, loader, trainer_amp(device, tcfg.performance.amp)


def measure(spec: dict, device: torch.device, args) -> dict:
    cfg, step, sched, loader, amp_dtype = build(spec, device, args)
    try:
        t0 = time.perf_counter()
        pending = run_steps(step, sched, loader, 1)
        sync(device)
        first = time.perf_counter() - t0
        pending = run_steps(step, sched, loader, args.warmup - 1, pending)
        sync(device)
        warm = time.perf_counter() - t0
        wait0 = loader.wait_seconds
        syncs = []
        t1 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                pending = run_steps(step, sched, loader, args.steps, pending)
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
            syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
        sync(device)
        dt = time.perf_counter() - t1
        pending.settle()
    finally:
        loader.close()
    ms = 1e3 * dt / args.steps
    route = parse_route(spec["route"])
    flops = 6 * flops_per_forward(cfg, tokens=block_tokens(route, cfg.depth, cfg.num_tokens)) * spec["batch"]
    row = {**spec, "latent": list(spec["latent"]), "params_m": num_params(cfg) / 1e6, "ms_per_step": ms,
           "images_per_s": spec["batch"] / (ms / 1e3), "tflops": flops / (ms / 1e3) / 1e12,
           "first_step_s": first, "warmup_s": warm,
           "compile_s": max(0.0, first - ms / 1e3) if spec["compile"] != "off" else 0.0,
           "host_syncs_per_step": len(syncs) / args.steps if device.type == "cuda" else None,
           "sync_sites": sorted(set(s.split("\n")[0][:160] for s in syncs))[:5],
           "data_wait_frac": (loader.wait_seconds - wait0) / dt if dt > 0 else 0.0,
           "sdpa": sdpa_name(cfg, spec["batch"], amp_dtype or torch.float32, device), "status": "ok"}
    if device.type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    return row


def sdpa_name(cfg, batch: int, dtype: torch.dtype, device: torch.device) -> str:
    """The attention kernel's name; a torch without the dispatcher's query must not cost the row."""
    try:
        return attention_backend(cfg, batch, dtype, device)
    except Exception as e:
        return f"unknown ({type(e).__name__})"


def free(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()  # compiled graphs (and CUDA-graph pools) of the previous configuration
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


def fmt(row: dict) -> str:
    head = (f"| {row['recipe'] + ': ' if row.get('recipe') else ''}{row['model']} | {row['batch']}"
            f"{' (' + str(row['batch'] // row['accumulation']) + ' x ' + str(row['accumulation']) + ')' if row.get('accumulation', 1) > 1 else ''}"
            f"{', ' + row['train'].get('amp', 'auto') if row.get('train') else ''} | {row['grad_ckpt']} | {row['compile']} | {row['mode']} | "
            f"{row['loader']}{' + repa' if row.get('repa') else ''}{' + route ' + row['route'] if row.get('route') else ''}"
            f"{' + latent ' + 'x'.join(map(str, row['latent'])) if tuple(row.get('latent', LATENT)) != LATENT else ''} |")
    if row["status"] != "ok":
        return f"{head} - | - | - | - | - | - | - | - | {row['status']} |"
    mfu = f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "-"
    mfu_m = f"{100 * row['mfu_measured']:.1f}%" if row.get("mfu_measured") is not None else "-"
    mem = f"{row['peak_mem_gib']:.1f}" if "peak_mem_gib" in row else "-"
    syncs = f"{row['host_syncs_per_step']:.2f}" if row["host_syncs_per_step"] is not None else "-"
    return (f"{head} {row['ms_per_step']:.1f} | {row['images_per_s']:.0f} | {mfu} / {mfu_m} | {mem} | "
            f"{row['compile_s']:.1f} | {syncs} | {100 * row['data_wait_frac']:.2f}% | {row['sdpa']} | ok |")


HEADER = ("| model | batch | grad ckpt | compile | mode | loader | ms/step | images/s | MFU (spec / measured peak) | "
          "peak mem (GiB) | compile s | host syncs/step | data wait | SDPA | status |\n"
          "|---|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|")


def main():
    ap = parser(__doc__)
    ap.add_argument("--configs", default=None, help="SPEC;SPEC;... (see above; default: the list for the device)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first, >= 1 (default 3; 1 on the CPU)")
    ap.add_argument("--amp", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                    help="auto: bf16 on GPUs that have it (else fp16 + grad scaler), fp32 on the CPU")
    ap.add_argument("--store-size", type=int, default=None,
                    help="latents in the store (default 20000 on CUDA, 64 on the CPU)")
    ap.add_argument("--store-dir", default=None, help="where real loaders' store is written (default: a temp dir)")
    ap.add_argument("--workers", type=int, default=4, help="streaming loader processes")
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: by device name)")
    add_device_args(ap, "cuda", threads=False)
    ap.add_argument("--json", default=None, help="write the results here (after every configuration)")
    args = ap.parse_args()
    device = open_device(args, "gpu_train: CUDA is not available on this machine; nothing measured. "
                               "Run it on a GPU machine, or smoke-test with --device cpu.")
    on_cpu = device.type == "cpu"
    specs = [parse_spec(s) for s in (args.configs or (DEFAULT_CPU if on_cpu else DEFAULT_CUDA)).split(";") if s]
    args.warmup = max(1, args.warmup if args.warmup is not None else (1 if on_cpu else 3))
    args.store_size = args.store_size or (64 if on_cpu else 20_000)
    args.store_dir = args.store_dir or tempfile.mkdtemp(prefix="gpu_train-")
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        dev_name = torch.cuda.get_device_name(device)
    else:
        dev_name = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    card = gpu_named(dev_name) if device.type == "cuda" else None  # dense bf16 peaks: ditdata.common.devices.GPUS
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (card.peak_flops if card is not None else None)
    measured = matmul_peak(device) if device.type == "cuda" else None
    amp_dtype = trainer_amp(device, args.amp)
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": dev_name,
           "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "amp": str(amp_dtype).replace("torch.", "") if amp_dtype else "fp32",
           "peak_flops": peak, "measured_bf16_matmul_flops": measured}
    print(f"gpu_train: {dev_name}, torch {torch.__version__} (CUDA {torch.version.cuda}), amp {env['amp']}; "
          f"{args.warmup} warm-up + {args.steps} timed steps per configuration; peak "
          f"{peak / 1e12 if peak else float('nan'):.0f} TFLOP/s"
          + (f" (bf16 matmul 8192^3 measured: {measured / 1e12:.0f} TFLOP/s)" if measured else ""), flush=True)
    rows: list[dict] = []

    def save() -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"env": env, "args": vars(args), "results": rows}, indent=1))

    print(HEADER, flush=True)
    t_all = time.perf_counter()
    for spec in specs:
        free(device)
        try:
            row = measure(spec, device, args)
        except torch.cuda.OutOfMemoryError:
            row = {**spec, "status": "OOM"}
        except ImportError as e:  # a real loader without the store's backends (zarr)
            row = {**spec, "status": f"skipped ({e})"}
        except Exception as e:  # e.g. a compiler missing on this machine: say so, measure the rest
            row = {**spec, "status": f"error: {type(e).__name__}: {' '.join(str(e).split())[:200]}"}
        if row["status"] == "ok":
            row["mfu"] = row["tflops"] * 1e12 / peak if peak else None
            row["mfu_measured"] = row["tflops"] * 1e12 / measured if measured else None
        free(device)
        rows.append(row)
        print(fmt(row), flush=True)
        save()
    print(f"\n{len(rows)} configurations in {time.perf_counter() - t_all:.0f} s; MFU = 6 x flops_per_forward x "
          f"batch / step time / peak (recomputation of checkpointed blocks not counted)"
          + (f"; wrote {args.json}" if args.json else ""), flush=True)
    if not any(r["status"] == "ok" for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
