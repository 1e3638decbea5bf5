"""The training loop, readable top to bottom.

    store -> loader -> [AMP forward, diffusion loss, backward] x accumulation -> clip -> AdamW
          -> EMA -> log -> checkpoint (every N, at the end, on SIGTERM/SIGINT/SIGUSR1)

One process or many (torchrun: DDP, each rank its own part of the store) run the same
code. Everything the model needs to know about the data (latent shape, classes, text
dims) comes from the store's manifest. Exact resume: a checkpoint holds every stateful
part (model, EMA, optimizer, scaler, LR schedule, each rank's loader and RNG states), so
N steps straight and N/2 + kill + resume + N/2 give the same losses and weights.

The step itself is dittrain.train.step.TrainStep (shared with bench/gpu_train.py): queued on the
device without host reads, a NaN/inf step skipped on the device, settled by the host one
step late (`_Books`), except on the steps where the host acts (logs, checkpoints, samples,
evaluations, the last step, a stop), which are settled at once.

The file in the order a run goes: setup (dittrain.train.setup.setup: process group, device and
precision, the store and the config it implies; here the FID evaluator), building the run's
state (`_build`: a dittrain.train.checkpoint.RunState, every stateful part in one object, which is
what a checkpoint holds; the optimizer and schedule from dittrain.train.optim) and resuming it
(`_checkpoint_to_resume`, `_resume`), the loop itself (`_loop`), and what a run reports
(dittrain.train.log.Log: metrics records and sample grids to dittrain.train.loggers, the progress bar).

Loss terms (dittrain.train.losses, e.g. --repa's alignment): the store opens with the feature set
a term reads (batch["feat"]); a term's module (REPA's projector) is built beside the model, joins
its optimizer (after the model's parameters), its DDP and its checkpoints, and is never in the EMA.
--route (dittrain.model.routing): the step draws which tokens skip the middle blocks; nothing else
of the run changes (the model, its checkpoints and exports are a plain run's).
"""

from __future__ import annotations

import copy
import json
import shlex
import signal
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch
import torch.distributed as torch_dist

from ditdata.common import dist, files
from ditdata.common.extras import missing_extra
from ditdata.common.lock import DirLock
from ditdata.store import Store, refuse_inside_store
from dittrain.config import LoaderConfig, TrainConfig, latent_sources
from dittrain.data import LoaderStateError, build_loader, build_mixture
from dittrain.data.latent_norm import LatentNorm
from dittrain.data.mixture import check_resume as check_mixture_resume
from dittrain.diffusion import DiffusionConfig
from dittrain.model.dit import DiT, num_params
from dittrain.model.lora import describe as describe_lora
from dittrain.model.lora import inject, settings_of
from dittrain.model.routing import describe as describe_route
from dittrain.model.routing import route_of
from dittrain.model.sizes import DiTConfig
from dittrain.rundir import (
    EMA_EXPORT,
    CheckpointError,
    export_weights,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from dittrain.train import losses
from dittrain.train.checkpoint import CheckpointWriter, RunState
from dittrain.train.log import Log, evaluate, note, sample_grid, training_memory_hint, watched
from dittrain.train.optim import build_optimizer, build_schedule
from dittrain.train.resume import Resumption
from dittrain.train.setup import Run, TrainError, setup
from dittrain.train.step import Attempt, TrainStep, compile_model, compile_target, empty_text_on
from dittrain.train.validation import build as build_validation
from dittrain.train.validation import validate

# --------------------------------------------------------------------------- setup (dittrain.train.setup) and FID


def _evaluator(cfg: TrainConfig, store: Store):
    """--eval-every: the FID evaluator, made now so that a missing reference or Inception file
    stops the run before its first step (once it trains, a failed evaluation never stops it)."""
    if not cfg.eval.eval_every:
        return None
    if not cfg.eval.eval_ref:
        raise TrainError("--eval-every needs --eval-ref REF (an ADM reference batch, an .npz or folder of "
                         "images, or image shards)")
    try:
        from dittrain.eval import EvalError
        from dittrain.train.fid import TrainingEval
    except ImportError as e:
        raise missing_extra("--eval-every", "eval", e, TrainError) from e
    try:
        return TrainingEval(cfg.eval, resolution=(store.manifest.get("image") or {}).get("resolution"),
                            seed=cfg.optim.seed, log=lambda line: print(f"dittrain: {line}", file=sys.stderr),
                            objective=cfg.diffusion.objective)
    except EvalError as e:
        raise TrainError(f"--eval-every: {e}") from e


# --------------------------------------------------------------------------- building and resuming


def _build(run: Run, ckpt: dict | None) -> RunState:
    """A fresh RunState: model, EMA, optimizer, LR schedule, grad scaler, noise generator
    and this rank's loader (the kind a checkpoint to resume was saved with)."""
    cfg, device = run.cfg, run.device
    torch.manual_seed(cfg.optim.seed)
    model = DiT(run.model_cfg).to(device)
    adapter = settings_of(cfg.lora)  # --lora: the adapter's settings, else None
    if cfg.model.init_from and ckpt is None:
        # --init-from: a fresh run whose model (and so its EMA) starts from outside weights
        # (dittrain.inference.weights.init_model); recorded as the run config's "init"
        from dittrain.inference.weights import init_model

        record, notes = init_model(model, cfg.model.init_from)
        run.resolved["init"] = record
        for line in notes if run.master else ():
            print(line, file=sys.stderr)
        _check_lora_base(cfg, record)
    elif adapter is not None:  # a LoRA run's resume: its checkpoints hold the adapter, the base is rebuilt
        _lora_base(run, model)
    if adapter is not None:
        # peft's LoRA layers on the targeted linears (A drawn from the seeded generator, B zero: the model
        # starts as its base); every other parameter frozen. The EMA is of the adapter only: it shares the
        # frozen base's tensors with the model (they never change, so their average is themselves) and
        # averages its own copy of the adapter's A and B (an adapter still, which peft loads and merges).
        run.lora_names = inject(model, adapter)
        ema = copy.deepcopy(model, {id(p): p for p in model.parameters() if not p.requires_grad})
        ema.requires_grad_(False).eval()
    else:
        ema = DiT(run.model_cfg).to(device).requires_grad_(False)
        ema.load_state_dict(model.state_dict())
        ema.eval()
    # the loss terms' modules (--repa's projector: its own seeded init, so the model starts as a
    # plain run's does); their parameters after the model's: one optimizer, one lr, one clipping norm
    term_modules = losses.modules(cfg, run.model_cfg, run.resolved, device)
    params = [p for p in model.parameters() if p.requires_grad] + losses.trained(term_modules)
    opt = build_optimizer(cfg, params, device)
    sched = build_schedule(opt, cfg)
    scaler = torch.amp.GradScaler(device.type, enabled=run.amp_dtype == torch.float16)
    # Noise, timesteps and label/caption dropout come from this generator, on the device (no
    # host round trip per step); its state is part of every checkpoint.
    noise_gen = torch.Generator(device=device).manual_seed(cfg.optim.seed)
    # A resumed run keeps the loader it was saved with (auto might choose another today).
    kind = ckpt["ranks"][run.rank]["loader"]["kind"] if ckpt is not None else cfg.data.loader
    # ... and the window its order was cut into, unless --shuffle-window is given (the budget
    # sized it; today's budget or free RAM might size another, and the order would differ).
    window = cfg.data.shuffle_window or (ckpt["ranks"][run.rank]["loader"].get("shuffle_window")
                                    if ckpt is not None else None)
    try:
        d = cfg.data
        settings = LoaderConfig(kind=kind, resident_device=d.resident_device, workers=d.workers, shuffle_window=window,
                                memory=d.loader_memory, remainder=d.bucket_remainder)
        # --val-fraction: the held-out rows are never in a training batch
        held_out = run.validation.exclude if run.validation is not None else None
        if run.stores is not None:  # several --latents: one loader per store, mixed (dittrain.data.mixture)
            if held_out is not None:
                raise TrainError("--val-fraction holds out rows of one store; with several --latents, give the "
                                 "held-out store as --val-latents")
            saved = ckpt["ranks"][run.rank]["loader"] if ckpt is not None else None
            settings = LoaderConfig(kind=cfg.data.loader, resident_device=d.resident_device, workers=d.workers,
                                    shuffle_window=d.shuffle_window or None, memory=d.loader_memory)
            loader = build_mixture([_read(run, s) for s in run.stores], run.repeats, settings, batch_size=run.per_rank, seed=cfg.optim.seed,
                                   rank=run.rank, world_size=run.world, device=device,
                                   names=[path for path, _ in latent_sources(cfg.data.latents)],
                                   saved=saved if saved is not None and saved.get("kind") == "mixture" else None)
            kind = cfg.data.loader
        else:
            loader = build_loader(_read(run, run.store), settings, batch_size=run.per_rank, seed=cfg.optim.seed, rank=run.rank,
                                  world_size=run.world, device=device, exclude=held_out)
    except ValueError as e:  # LoaderError (does not fit) or settings the loader refuses
        raise TrainError(str(e)) from e
    if ckpt is not None and kind != cfg.data.loader:  # not what the user asked now: the checkpoint's
        loader.reason = f"{kind}: the checkpoint's, so its data order continues; " + loader.reason.split("; ", 1)[-1]
    return RunState(model=model, ema=ema, optimizer=opt, lr_schedule=sched, scaler=scaler, loader=loader,
                    noise_gen=noise_gen, config=run.resolved, device=device, rank=run.rank, world=run.world,
                    term_modules=term_modules, adapter_only=adapter is not None)


def _check_lora_base(cfg: TrainConfig, record: dict) -> None:
    """--lora freezes every base weight: a label embedder --init-from could not fill (another class
    count) would stay random, so it is refused."""
    if cfg.lora.lora and record.get("label_embedder") == "fresh":
        raise TrainError(f"--lora {cfg.lora.lora} keeps every weight of --init-from {cfg.model.init_from} frozen, but "
                         "its class count is not this store's, so the label embedder would stay random; fine-tune "
                         "it fully (without --lora), or use weights with this store's classes")


def _lora_base(run: Run, model: DiT) -> None:
    """A LoRA run's resume: the frozen base loaded again from what the run started from (its "init"
    record), refused in one line when that file is gone or no longer the same bytes."""
    from dittrain.inference.weights import init_model

    init = run.resolved.get("init") or {}
    source = init.get("from")
    if not source:
        raise TrainError(f"{run.out}: a --lora run whose record names no base weights (\"init\"); start a new --out")
    if not Path(source).exists():
        raise TrainError(f"{run.out}: its frozen base --init-from {source} is gone; put it back to resume (its "
                         "checkpoints hold the adapter only)")
    record, _ = init_model(model, source)
    if record["sha256"] != init.get("sha256"):
        raise TrainError(f"{run.out}: its frozen base {record['file']} has changed since the run started (sha256 "
                         f"{str(record['sha256'])[:12]}..., recorded {str(init.get('sha256'))[:12]}...); the adapter "
                         "was trained on the old one: restore it, or start a new --out")


def _read(run: Run, store: Store) -> Store:
    """A store as the loader reads it: with --caption-mix, its caption sets joined per sample
    (dittrain.train.captionmix; the step draws each sample's set)."""
    return store if run.caption_mix is None else run.caption_mix.view(store)


def _checkpoint_to_resume(run: Run) -> tuple[dict | None, Path | None]:
    """(checkpoint, its path) to continue from, or (None, None) for a fresh run; refuses a
    run directory with checkpoints but no --resume, and a checkpoint of another store, optimizer,
    model or objective; a resume keeps the record of what the run started from (--init-from)."""
    cfg, out = run.cfg, run.out
    latest = latest_checkpoint(out)
    if latest is not None and not cfg.checkpointing.resume:
        raise TrainError(f"{out} already holds checkpoints (latest {latest.name}); "
                         "pass --resume to continue it, or choose another --out")
    if latest is None:
        return None, None
    ckpt = load_checkpoint(latest)
    saved, identity = ckpt["config"], run.store.identity
    if (why := check_mixture_resume(saved, run.resolved)) is not None:  # several --latents: every store, in order
        raise CheckpointError(f"{latest}: {why}; resume with the stores it was trained on (their repeats may "
                              "change with --allow-changes), or start a new --out with --init-from")
    if saved["store"]["identity"] != identity:
        raise CheckpointError(
            f"{latest}: made with another latent store ({saved['store']['path']}, "
            f"{saved['store']['identity'][:19]}...) than {cfg.data.latents} "
            f"({identity[:19]}...); resume with the same store, or start a new --out")
    recorded = TrainConfig.from_record(saved["train"])  # by section, or flat (runs before the sections)
    optimizer = recorded.optim.optimizer  # runs from before --optimizer have its default, adamw
    if optimizer != cfg.optim.optimizer:
        raise CheckpointError(f"{latest}: made with --optimizer {optimizer}, not {cfg.optim.optimizer} (its optimizer "
                              f"state is {optimizer}'s); resume with --optimizer {optimizer}, or start a new --out")
    # a field the model config gained since the checkpoint was made (a DDT head's, the time embedding) reads as
    # its default: what the run was built with then
    defaults = {f.name: f.default for f in fields(DiTConfig)}
    if {**defaults, **saved["model"]} != run.resolved["model"]:
        raise CheckpointError(f"{latest}: model config differs from this run's "
                              f"({cfg.model.model} on {cfg.data.latents}); keep the original flags")
    # the loss, timestep and latent-normalisation options it was started with (a config saved
    # before they existed has their defaults)
    old = asdict(DiffusionConfig(**{k: v for k, v in (saved.get("diffusion") or {}).items()
                                    if k in DiffusionConfig.__dataclass_fields__}))
    new = run.resolved["diffusion"]
    allowed = run.resumption.allowed if run.resumption is not None else frozenset()
    # loss and timestep options a user let through (--allow-changes), by DiffusionConfig's names
    let = {_DIFFUSION_NAME.get(name, name) for name in allowed}
    changed = [k for k in new if old.get(k) != new[k] and k not in let]
    if changed:
        raise CheckpointError(f"{latest}: diffusion options differ from this run's ({', '.join(changed)}: "
                              f"{', '.join(f'{old.get(k)} -> {new[k]}' for k in changed)}); keep the original flags")
    old_norm = (saved.get("latents") or {"norm": "none"})
    if old_norm != run.resolved["latents"]:
        raise CheckpointError(f"{latest}: trained with --latent-norm {old_norm.get('norm')}, not "
                              f"{run.resolved['latents']['norm']}; keep the original flag")
    for term in losses.LOSS_TERMS.values():  # every entry, on or not: the run may have been made with it
        term.check_resume(latest, saved, recorded, cfg, run.resolved)
    # A resume continues the run's own weights: --init-from is ignored (with a note) and the
    # record of what the run started from (`first`) is kept.
    first = recorded.model.init_from
    if recorded.lora.lora and run.master:  # the base is what the record names, whatever --init-from says now
        print(f"note: resuming {run.out}: a --lora run, its frozen base loaded again from {first} (the checkpoints "
              "hold the adapter)", file=sys.stderr)
    elif cfg.model.init_from and run.master:
        print(f"note: resuming {run.out}: --init-from {cfg.model.init_from} is ignored (the run continues its "
              f"own weights{'; it started from ' + first if first else ''})", file=sys.stderr)
    run.resolved["train"]["model"]["init_from"] = first
    if "init" in saved:
        run.resolved["init"] = saved["init"]
    return ckpt, latest


# TrainConfig's names of the diffusion options whose DiffusionConfig names differ
_DIFFUSION_NAME = {"t_mean": "logit_normal_mean", "t_std": "logit_normal_std"}
# Changes (let through by --allow-changes) after which the data order cannot continue exactly
_ORDER = frozenset({"batch_size", "accumulation_steps", "seed", "shuffle_window", "bucket_remainder", "latents"})


def _resume(run: Run, state: RunState, ckpt: dict, path: Path) -> None:
    """Load the checkpoint. With data-order changes let through (--allow-changes), the loaders
    continue after as many samples as were drawn, in the order of the new settings."""
    changed = run.resumption.allowed & _ORDER if run.resumption is not None else frozenset()
    try:
        state.load_state_dict(ckpt, exact_order=not changed)
    except LoaderStateError as e:
        raise TrainError(f"{path}: cannot resume its data order: {e}; keep the original "
                         "--batch-size, --seed and loader flags") from e
    # The optimizer's lr and weight decay from this run's config, not the checkpoint's: a
    # loaded optimizer and LambdaLR bring back the values they were saved with, which after an
    # allowed change (--allow-changes --lr 3e-4) would silently keep the old ones.
    cfg, sched = run.cfg, state.lr_schedule
    sched.base_lrs = [cfg.optim.lr for _ in state.optimizer.param_groups]
    for group, f in zip(state.optimizer.param_groups, sched.lr_lambdas, strict=True):
        group["initial_lr"] = cfg.optim.lr
        group["weight_decay"] = cfg.optim.weight_decay
        group["lr"] = cfg.optim.lr * f(sched.last_epoch)  # LambdaLR's own formula: unchanged runs stay bit-exact


def _save(run: Run, state: RunState) -> None:
    """A checkpoint and the EMA export (every rank calls this: it gathers their states).

    --async-save: rank 0 hands a host copy of the state to run.saver and returns; the files
    exist once run.saver.wait() returns (in the next _save, or at the end of _train), and a
    failure of the previous write is raised here. Writes are made one at a time in step
    order, so keep-N pruning and a resume's latest_checkpoint see what synchronous saves give.

    Ranks: the gather in state_dict() is the collective, on the main thread at the same
    point on every rank. A synchronous save ends with a barrier: when any rank goes on, the
    file exists. With async writes a barrier here would promise nothing, so there is none;
    what holds instead: every rank's state is in rank 0's host copy when the gather returns,
    and the barrier at the end of _train comes after rank 0's wait, so no rank returns before
    the last checkpoint is on disk.
    """
    ckpt = state.state_dict()
    if run.master and run.cfg.checkpointing.async_save:
        if run.saver is None:
            run.saver = CheckpointWriter()
        run.saver.submit(run.out, state.step, ckpt, keep=run.cfg.checkpointing.keep, ema_state=ckpt["ema"], config=state.config)
    elif run.master:
        save_checkpoint(run.out, state.step, ckpt, keep=run.cfg.checkpointing.keep)
        export_weights(run.out / EMA_EXPORT, ckpt["ema"], state.config)  # a LoRA run's: the EMA adapter
    if run.world > 1 and not run.cfg.checkpointing.async_save:
        dist.barrier()


# --------------------------------------------------------------------------- the run


# The exit status of a run stopped by a signal (checkpoint saved, resumable): sysexits'
# EX_TEMPFAIL, "try again later", so Slurm requeue scripts and `until` loops can tell it from
# a finished run (0) and an error (1).
STOPPED_STATUS = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)  # SIGUSR1: Slurm's --signal=USR1@120


def run(cfg: TrainConfig, resumption: Resumption | None = None, *, progress: bool = True) -> dict:
    """Train as configured; rank 0 holds the run directory's lock for the whole run, so a
    second `dittrain run` (or --resume) on the same --out fails at once instead of writing
    into it too (DirectoryBusy). A run that fails before writing anything leaves no trace.
    resumption: what a resume changes against the run's record (dittrain.train.resume.settle).
    The result's "stopped" is the signal's name when a signal ended the run early.
    progress=False (-q/--quiet): no progress bar or progress lines."""
    # A run directory is never a latent store (readers never write one) nor an image-shard
    # folder: mixing a run's files into either would damage it.
    out = Path(cfg.checkpointing.out)
    refuse_inside_store(out, "--out", TrainError)
    if (out / "dataset.json").exists() or (out / ".fetch_state").exists():
        raise TrainError(f"--out {out} is an image-shard folder (from `ditdata fetch`); choose a run directory")
    if dist.launch_env().rank != 0:
        return _train(cfg, resumption, progress)
    with DirLock(cfg.checkpointing.out, "dittrain run"):
        return _train(cfg, resumption, progress)


def _train(cfg: TrainConfig, resumption: Resumption | None, progress: bool = True) -> dict:
    run = setup(cfg)  # a group it joins, the run also leaves (one the caller made, not: run.created_group)
    run.resumption = resumption
    run.evaluator = _evaluator(cfg, run.store)
    run.watch = watched(run)  # --sample-classes / --sample-prompts: checked (and embedded) before anything is written
    run.validation = build_validation(run)  # --val-fraction / --val-latents: the rows read, before anything is written
    if run.validation is not None:
        run.resolved["validation"] = run.validation.record
    ckpt, latest = _checkpoint_to_resume(run)
    state = _build(run, ckpt)
    try:
        if ckpt is not None:
            _resume(run, state, ckpt, latest)
        # Only now, with everything built and loaded, does the run write into its directory:
        # a run refused on its settings leaves nothing behind.
        _prepare_out(run, resumed_at=state.step if ckpt is not None else None)
        # the module the loop calls: the model, compiled (--compile: dittrain.train.step.compile_model),
        # in DDP over several ranks
        compiled = compile_model(state.model, compile_target(cfg.performance.compile, run.device),
                                 cfg.performance.compile_mode)
        train_model = _ddp(run, compiled)
        terms = losses.build(cfg, run.model_cfg, run.resolved, state.term_modules, lambda m: _ddp(run, m))
        if run.master:
            # how the run starts: resumed, from outside weights (--init-from) or from scratch
            origin = (f"resuming at step {state.step}" if ckpt is not None
                      else f"initialised from {cfg.model.init_from}" if cfg.model.init_from else "from scratch")
            # (a --lora run's model: its base's count, the adapter's is on the LoRA line)
            params = num_params(run.model_cfg) if run.lora_names else state.model.num_params()
            print(f"dittrain: {cfg.model.model} ({params / 1e6:.1f} M params) on {run.device}, "
                  f"{len(run.store)} latents {tuple(run.store.latent_shape)} from {cfg.data.latents}; loader "
                  f"{state.loader.kind} ({state.loader.reason}); global batch {cfg.optim.batch_size} = {run.world} "
                  f"rank(s) x {cfg.optim.accumulation_steps} accumulation x {run.per_rank}; latent norm "
                  f"{run.latent_norm}; {origin}", file=sys.stderr)
            if run.t_shift:
                print(f"dittrain: {run.t_shift}", file=sys.stderr)
            if (mixture := getattr(state.loader, "describe_mixture", None)) is not None:
                print(f"dittrain: mixture: {mixture()}", file=sys.stderr)  # what each store gives per epoch
            if (buckets := getattr(state.loader, "describe_buckets", None)) is not None:
                print(f"dittrain: aspect-ratio buckets: {buckets()}", file=sys.stderr)
            for line in losses.describe(cfg, run.model_cfg, run.resolved, state.term_modules):  # --repa's
                print(f"dittrain: {line}", file=sys.stderr)
            if run.caption_mix is not None:
                print(f"dittrain: {run.caption_mix.describe()}", file=sys.stderr)
            if run.lora_names:
                print(f"dittrain: {describe_lora(settings_of(cfg.lora), run.lora_names, state.model)}", file=sys.stderr)
            if (route := route_of(cfg.routing)) is not None:
                print(f"dittrain: {describe_route(route, run.model_cfg.depth, run.model_cfg.num_tokens)}", file=sys.stderr)
            if run.validation is not None:
                print(f"dittrain: {run.validation.describe()}", file=sys.stderr)
        # (the bar closes on errors too; out of GPU memory is one line naming the model, batch, precision)
        with (_Stop() as stop, Log(run, state, resumed=ckpt is not None, progress=progress) as log,
              training_memory_hint(run)):
            if run.validation is not None and ckpt is None:  # the curve's first point: the weights it starts from
                validate(run, state, 0, log)
            stopped = _loop(run, state, train_model, log, stop, terms)
            step = state.step
            if run.master and step == cfg.optim.max_steps and cfg.logging.sample_every > 0 and step % cfg.logging.sample_every:
                sample_grid(run, state.ema, step, log)  # the last grid
            if run.saver is not None:  # still under _Stop: a signal now cannot cut the last write short
                run.saver.wait()  # the last checkpoint is on disk; a failed write stops the run here
        measured = getattr(state.loader, "describe_measured", None)
        if run.master and measured is not None and (line := measured()) is not None:
            print(f"dittrain: {line}", file=sys.stderr)  # the startup line gave the estimate
    finally:
        state.loader.close()
        if run.saver is not None and (error := run.saver.close()) is not None:
            # another error is on its way out: the write it interrupted failed too
            print(f"note: {error}", file=sys.stderr)
    step = state.step
    if run.world > 1:
        torch_dist.barrier()
        # Leave the group before exiting: a gloo rank that exits with it still open can die
        # at interpreter shutdown when a peer closes first, and torchrun's agent on the
        # other node then waits out its 300 s exit barrier for an agent that failed.
        dist.leave(run.created_group)
    return {"step": step, "out": str(run.out), "nonfinite_skipped": state.nonfinite_total,
            "stopped": (stop.name or "a peer's signal") if stopped else None}


def _prepare_out(run: Run, resumed_at: int | None) -> None:
    """The run directory, its config.json, and a resumed run's metrics cut back to its step."""
    if not run.master:
        return
    out = run.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "samples").mkdir(exist_ok=True)
    if run.resumption is not None or resumed_at is not None:  # the record's history, with this resume's changes
        prior = run.resumption.history_at(resumed_at or 0) if run.resumption is not None else []
        run.resolved["history"] = prior
    _write_text(out / "config.json", json.dumps(run.resolved, indent=1))
    metrics = out / "metrics.jsonl"
    if resumed_at is not None and metrics.exists():
        # Drop log lines past the checkpoint we resume from: they will be logged again. A line
        # that does not parse (torn by a crash mid-write) is dropped too.
        keep = []
        for ln in metrics.read_text(errors="replace").splitlines():
            try:
                if json.loads(ln)["step"] <= resumed_at:
                    keep.append(ln)
            except (ValueError, KeyError, TypeError):
                continue
        _write_text(metrics, "".join(ln + "\n" for ln in keep))


def _ddp(run: Run, module: torch.nn.Module) -> torch.nn.Module:
    """The module in DDP over several ranks (the model, a loss term's module); itself on one."""
    if run.world == 1:
        return module
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(module, device_ids=[run.device.index] if run.device.type == "cuda" else None)


def _loop(run: Run, state: RunState, train_model, log: Log, stop: _Stop, terms: list = ()) -> bool:
    """Optimizer steps until max_steps or a stop request (STOP_SIGNALS); True when stopped early.

    Step k+1's forward and backward are queued before step k is settled (dittrain.train.step), so
    the host never makes the device wait; a step is settled at once where the host needs its
    outcome now: a log, checkpoint, sample or evaluation step, the last step, a stop."""
    cfg, world = run.cfg, run.world
    step = TrainStep(model=state.model, train_model=train_model, ema=state.ema, optimizer=state.optimizer,
                     scaler=state.scaler, diffusion=run.diffusion, cfg=cfg, gen=state.noise_gen, device=run.device,
                     amp_dtype=run.amp_dtype, norm=LatentNorm.from_config(run.resolved),
                     empty_text=empty_text_on(run.store, run.device), rank=run.rank, world=world, terms=terms,
                     captions=run.caption_mix)
    books = _Books(run, state, step, log)
    pending = None
    compiling, t0 = compile_target(cfg.performance.compile, run.device) != "off", time.perf_counter()
    while state.step < cfg.optim.max_steps:
        queued = step.backward(state.loader, stop=stop.requested)
        stopping = books.settle(pending)[1] if pending is not None else False
        pending = step.update(queued)
        # one process reads its own stop flag; ranks learn of any rank's request from a settle
        stopping = stopping or (world == 1 and stop.requested)
        # the next step (if kept) is one the host acts on: a log record, a checkpoint, a sample
        # grid, an evaluation, the last step
        nxt = state.step + 1
        if not (stopping or compiling
                or nxt % cfg.logging.log_every == 0 or nxt % cfg.checkpointing.save_every == 0
                or nxt == cfg.optim.max_steps or bool(cfg.logging.sample_every and nxt % cfg.logging.sample_every == 0)
                or (run.evaluator is not None and nxt % cfg.eval.eval_every == 0)
                or (run.validation is not None and nxt % cfg.eval.val_every == 0)):
            continue
        stepped, stop_now = books.settle(pending)
        pending, stopping = None, stopping or stop_now
        if compiling:  # the first step compiles (the forward, and the backward it needs)
            compiling = False
            if run.master:
                note(f"dittrain: first step {time.perf_counter() - t0:.1f} s, torch.compile "
                      f"({compile_target(cfg.performance.compile, run.device)}, mode {cfg.performance.compile_mode}) included")

        # ---- checkpoint, samples, stop requests (a skipped step honours a stop too) ----
        n = state.step
        if stopping or (stepped and (n % cfg.checkpointing.save_every == 0 or n == cfg.optim.max_steps)):
            _save(run, state)
        if stepped and run.master and cfg.logging.sample_every and n % cfg.logging.sample_every == 0:
            sample_grid(run, state.ema, n, log)
        if stepped and run.evaluator is not None and (n % cfg.eval.eval_every == 0 or n == cfg.optim.max_steps):
            evaluate(run, state, n, log)
        if stepped and run.validation is not None and (n % cfg.eval.val_every == 0 or n == cfg.optim.max_steps):
            validate(run, state, n, log)
        if stopping:
            if run.saver is not None:  # "checkpoint saved" is said once it is on disk
                run.saver.wait()
            if run.master:
                print(f"\ndittrain: stopped by signal at step {n} of {cfg.optim.max_steps} ({stop.name or 'on a peer'}); "
                      f"checkpoint saved; resume with: dittrain run --resume --out {shlex.quote(str(run.out))}",
                      file=sys.stderr)
            return n < cfg.optim.max_steps
    return False


class _Books:
    """What the host does with a settled step: a kept step advances the step counter, the LR
    schedule and the EMA and is logged; a skipped (NaN/inf) one is counted, and too many in a
    row stop the run."""

    def __init__(self, run: Run, state: RunState, step: TrainStep, log: Log):
        self.run, self.state, self.step, self.log = run, state, step, log
        self.consecutive_bad = 0

    def settle(self, attempt: Attempt) -> tuple[bool, bool]:
        """(kept, stop requested) of a queued step, its consequences applied."""
        state, cfg = self.state, self.run.cfg
        kept, stop = attempt.settle()
        if kept:
            self.consecutive_bad = 0
            self.step.ema_update()
            state.lr_schedule.step()
            state.step += 1
            self.log.step(attempt.loss, attempt.grad_norm, attempt.metrics, attempt.shapes)
            return kept, stop
        self.consecutive_bad += 1
        state.nonfinite_total += 1
        if self.consecutive_bad >= cfg.optim.max_nonfinite:
            raise TrainError(
                f"{self.consecutive_bad} consecutive non-finite losses at step {state.step}: training "
                "diverged. Lower --lr, use --amp bf16/fp32, or resume from an earlier checkpoint")
        self.log.skipped()
        return kept, stop


class _Stop:
    """STOP_SIGNALS: remember the request; the loop finishes its step, saves and exits."""

    def __init__(self):
        self.requested = False
        self.name = ""  # the signal that asked
        self._old = {}

    def __enter__(self):
        for sig in STOP_SIGNALS:
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True
        self.name = self.name or signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _write_text(path: Path, text: str) -> None:
    """Replace a run file atomically (a crash leaves the old or the new one, never half)."""
    try:
        files.write_text_atomic(path, text)
    except OSError as e:
        raise TrainError(f"{path}: could not write ({files.error_reason(e)})") from e


__all__ = ["run"]
