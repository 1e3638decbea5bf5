"""`dittrain plan`: which settings of a training run fit this GPU, which is fastest, and how long
the run and its FID-50K take, before anything starts.

    request = PlanRequest(cfg, given, latent_shape=(4, 32, 32), classes=1000, memory=24 * 2**30)
    plan = make_plan(request)          the model, the target, every candidate, the pick
    for line in report(plan): ...      the table, the pick's `dittrain run` command, the times

A candidate is one choice of what `dittrain run` leaves open for a given global batch: the
micro-batch and accumulation, --grad-checkpointing, --optimizer, --compile (with --probe on a
GPU: no compiled step has been recorded), at the run's precision. Its memory is
dittrain.plan.footprint's model of the trainer's tensors; its speed the FLOPs over the rate recorded
on this card (dittrain.plan.throughput), or what --probe measures on the actual device
(dittrain.plan.probe). The flags the user gave are fixed: only the others are searched. The table
shows, for each checkpointing mode and optimizer, the largest micro-batch that fits (or, when
none does, the smallest with what it needs); --all shows every candidate.

A candidate fits when its predicted peak, plus MARGIN of it (the caching allocator's
fragmentation and the model's error), fits the memory: --gpu-memory less a CUDA context, the
free memory of --device cuda, --gpu's nominal memory less a context, or the CPU's available
memory.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from ditdata.common.bytesize import format_size
from ditdata.common.devices import GPUS, Gpu, gpu_named
from ditdata.common.errors import UserError
from dittrain.config import EvalSampleConfig, TrainConfig
from dittrain.model.routing import block_tokens, route_of
from dittrain.model.routing import check as check_route
from dittrain.model.sizes import DiTConfig, flops_per_forward
from dittrain.plan.footprint import Footprint, FootprintError, Setting, block_modes, footprint, loss_kind, term_costs
from dittrain.plan.probe import ProbeResult
from dittrain.plan.throughput import RECORD_SOURCE, RECORDS, Rate, rate, step_flops
from dittrain.train.losses import Cost, feature_set
from dittrain.train.losses import on as loss_terms

MARGIN = 0.10  # of the predicted peak, kept free: fragmentation of the caching allocator, the model's error
CUDA_CONTEXT = 2**30  # what the CUDA context and libraries take outside torch's allocator (conservative)
# --grad-checkpointing values searched, from the least recomputation to the most (k: every k-th block)
SEARCHED_MODES = ("none", "selective", "mlp", "attn", "4", "3", "2", "every")
SEARCHED = ("accumulation_steps", "grad_checkpointing", "optimizer", "compile")  # what plan may choose
# adamw8bit keeps the same settings but rounds the optimizer's moments: the pick takes it only where it
# is this much faster (a larger micro-batch) than an adamw setting that fits, or where adamw does not fit
EIGHT_BIT_PENALTY = 1.10


class PlanError(UserError, ValueError):
    """A request plan cannot answer (one line): nothing fits, an unknown model, missing input."""


@dataclass
class PlanRequest:
    """What `dittrain plan` was asked: a run's settings and where it will run."""

    cfg: TrainConfig  # dittrain run's settings (the flags given, defaults elsewhere)
    given: frozenset = frozenset()  # the TrainConfig fields the user set: fixed, not searched
    latent_shape: tuple[int, int, int] | None = None  # without --latents: C, H, W
    classes: int = 0  # without --latents: classes (0: unconditional)
    samples: int | None = None  # without --latents: the dataset's size (for epochs)
    memory: int | None = None  # --gpu-memory, bytes
    gpu: str | None = None  # --gpu NAME
    epochs: float | None = None
    probe: bool = False
    probe_steps: int = 3
    show_all: bool = False


@dataclass
class Target:
    """Where the run trains: the device type, the memory a step may use, the card (for speed)."""

    device: str  # "cuda" or "cpu"
    capacity: int  # bytes the step's predicted peak (with MARGIN) must fit in
    source: str  # where that figure comes from, in words
    gpu: Gpu | None  # the card (speed records and peaks), when known
    precision: str  # fp32 | bf16 | fp16: --precision resolved for this target
    kernel: str  # the self-attention kernel the table row follows: fused | math


@dataclass
class Candidate:
    micro: int
    accumulation: int
    mode: str
    optimizer: str
    compile: str
    fp: Footprint
    fits: bool
    seconds: float | None = None  # predicted seconds per optimizer step (None: no rate for this card)
    rate: Rate | None = None
    relative: float = math.inf  # seconds on the recorded card: what ranks candidates when this card has no rate
    probed: ProbeResult | None = None

    @property
    def measured_seconds(self) -> float | None:
        return self.probed.seconds_per_step * self.accumulation if self.probed is not None else None

    def settings(self) -> dict:
        """The TrainConfig fields this candidate sets."""
        return {"accumulation_steps": self.accumulation, "grad_checkpointing": self.mode,
                "optimizer": self.optimizer, "compile": self.compile}


@dataclass
class Plan:
    request: PlanRequest
    model: DiTConfig
    target: Target
    candidates: list[Candidate]
    pick: Candidate
    num_samples: int | None  # the dataset's size, when known
    store: object | None = None  # the opened store (--latents)
    notes: list[str] = field(default_factory=list)
    costs: list[Cost] = field(default_factory=list)  # what the loss terms add (dittrain.train.losses)

    @property
    def config(self) -> TrainConfig:
        """The run's settings with the pick's choices (and --epochs as --max-steps)."""
        length = {"max_steps": steps_and_epochs(self)[0]} if self.request.epochs is not None else {}
        return with_settings(self.request.cfg, {**self.pick.settings(), **length})


def with_settings(cfg: TrainConfig, values: dict) -> TrainConfig:
    flat = cfg.flat()
    flat.update(values)
    return TrainConfig.from_flat(**flat)


# ----------------------------------------------------------------------------- the model and its data


def _model_config(req: PlanRequest) -> tuple[DiTConfig, object | None, int | None]:
    """(the DiT the run would build, its store or None, the dataset's size): from the store as
    `dittrain run` derives it (dittrain.train.setup.model_config_for), or from --latent-shape/--classes."""
    from ditdata.store import Conditioning
    from dittrain.train.setup import TrainError, model_config_for

    cfg = req.cfg
    if cfg.data.latents:
        from ditdata.store import open_store

        store = open_store(cfg.data.latents, cache_dir=cfg.data.cache_dir or None, cache_limit=cfg.data.cache_limit,
                           features=feature_set(cfg))
        shape_of, samples = store, len(store)
    elif req.latent_shape is None:
        raise PlanError("give --latents STORE, or --latent-shape CxHxW (and --classes N) for a store not made yet")
    else:
        store, samples = None, req.samples
        cond = Conditioning(kind="class" if req.classes else "none", num_classes=req.classes)
        shape_of = _Shape(tuple(req.latent_shape), cond)
    try:
        model = model_config_for(cfg, shape_of)
    except TrainError as e:
        raise PlanError(str(e)) from None
    if model.text_token_dim:
        raise PlanError(f"{cfg.data.latents}: a store with caption tokens (cross-attention) is not modelled by "
                        "dittrain plan yet; its blocks' memory was never measured")
    return model, store, samples


@dataclass(frozen=True)
class _Shape:
    """What dittrain.train.setup.model_config_for reads of a store, for a store not made yet."""

    latent_shape: tuple[int, int, int]
    conditioning: object
    buckets: tuple = ()  # a planned store has no aspect-ratio buckets


# ----------------------------------------------------------------------------- the target


def _target(req: PlanRequest, model: DiTConfig, probe_device) -> Target:
    """The device, the memory a step may use and the card, from --gpu-memory, --device and --gpu;
    the precision and the attention kernel the step would run with there."""
    gpu = gpu_named(req.gpu)
    if req.gpu and gpu is None:
        raise PlanError(f"--gpu {req.gpu}: not a card this table knows ({', '.join(GPUS)}); give --gpu-memory "
                        "SIZE instead (speeds then need --probe)")
    device = probe_device.type if probe_device is not None else ("cuda" if (gpu or req.memory) else "cpu")
    if probe_device is not None and probe_device.type == "cuda":
        import torch

        gpu = gpu or gpu_named(torch.cuda.get_device_name(probe_device))
    # the bytes a step may use, and where that comes from: --gpu-memory less a CUDA context, the
    # free memory of --device cuda, --gpu's memory less a context, or the CPU's available memory
    if req.memory is not None:
        context = " less 1 GiB for the CUDA context" if device == "cuda" else ""
        capacity, source = (req.memory - (CUDA_CONTEXT if device == "cuda" else 0),
                            f"--gpu-memory {format_size(req.memory)}{context}")
    elif probe_device is not None and device == "cuda":
        import torch

        from ditdata.common.devices import gpu_memory

        free, _ = gpu_memory(probe_device)
        capacity, source = free, f"the free memory of {probe_device} ({torch.cuda.get_device_name(probe_device)})"
    elif gpu is not None:
        capacity, source = (int(gpu.memory_gib * 2**30) - CUDA_CONTEXT,
                            f"the {gpu.name}'s {gpu.memory_gib:g} GB less 1 GiB for the CUDA context")
    else:
        from dittrain.data.budget import available_memory

        capacity, where = available_memory()
        if capacity is None:
            raise PlanError("the available memory is unknown here: give --gpu-memory SIZE")
        source = f"the CPU's available memory ({where})"
    # --precision resolved as the trainer resolves it (auto: bf16 on GPUs that have it, else fp16;
    # fp32 on the CPU)
    amp = req.cfg.performance.amp
    if amp != "auto":
        precision = amp
    elif device != "cuda":
        precision = "fp32"
    elif probe_device is not None:
        import torch

        precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    else:
        precision = "fp16" if gpu is not None and not gpu.bf16 else "bf16"
    # the self-attention kernel's table row: what torch picks on the device, else what CUDA's
    # fused kernels take (head dims that are multiples of 8, up to 256)
    if probe_device is None:
        kernel = "math" if model.head_dim % 8 or model.head_dim > 256 else "fused"
    else:
        import torch

        from dittrain.model.attention import attention_backend

        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        kernel = "math" if attention_backend(model, 2, dtype, probe_device) == "math" else "fused"
    return Target(device, capacity, source, gpu, precision, kernel)


# ----------------------------------------------------------------------------- candidates


def _choices(req: PlanRequest, model: DiTConfig, target: Target) -> dict:
    """The values searched for each open setting (a fixed one: the user's value only)."""
    cfg, given = req.cfg, req.given
    batch = cfg.optim.batch_size
    if "accumulation_steps" in given:
        if batch % cfg.optim.accumulation_steps:
            raise PlanError(f"--batch-size {batch} is not a multiple of --accumulation-steps "
                            f"{cfg.optim.accumulation_steps}")
        micros = [batch // cfg.optim.accumulation_steps]
    else:
        micros = [m for m in range(batch, 0, -1) if batch % m == 0]
    if "grad_checkpointing" in given:
        block_modes(cfg.performance.grad_checkpointing, model.depth)  # a bad value: one line
        modes = [str(cfg.performance.grad_checkpointing)]
    else:
        modes = [m for m in SEARCHED_MODES if not m.isdigit() or int(m) < model.depth]
    if "optimizer" in given:
        optimizers = [cfg.optim.optimizer]
    else:
        optimizers = ["adamw"] + (["adamw8bit"] if importlib.util.find_spec("bitsandbytes") else [])
    if "compile" in given or not (req.probe and target.device == "cuda"):
        compiles = [cfg.performance.compile]
    else:
        compiles = ["off", "blocks"]
    return {"micro": micros, "mode": modes, "optimizer": optimizers, "compile": compiles}


def resident_bytes(req: PlanRequest, store, target: Target) -> int:
    """A store held in GPU memory (--resident-device cuda): every tensor of every sample (its latents,
    flipped twins, REPA targets), as the resident loader holds them; 0 otherwise."""
    if store is None or req.cfg.data.resident_device != "cuda" or target.device != "cuda":
        return 0
    from ditdata.store.schema import numpy_dtype

    per_sample = sum(math.prod(t.shape) * numpy_dtype(t.dtype).itemsize for t in store.schema.tensors.values())
    return len(store) * (per_sample + 8)


def _order(c: Candidate) -> tuple:
    """Fastest first: measured, else predicted seconds (on the recorded card where this one has no
    record), adamw8bit's counted EIGHT_BIT_PENALTY slower; ties: fewer accumulation steps, less
    recomputation (SEARCHED_MODES' order), adamw, eager."""
    seconds = c.measured_seconds if c.probed is not None else c.relative if c.seconds is None else c.seconds
    seconds *= EIGHT_BIT_PENALTY if c.optimizer == "adamw8bit" else 1.0
    mode_rank = SEARCHED_MODES.index(c.mode) if c.mode in SEARCHED_MODES else len(SEARCHED_MODES)
    return (not c.fits, seconds, c.accumulation, mode_rank, c.optimizer != "adamw", c.compile != "off")


def shown(plan: Plan) -> list[Candidate]:
    """The table's rows: for each checkpointing mode, optimizer and compile, the largest micro-batch
    that fits, else the smallest; adamw8bit only where it fits a larger micro-batch than adamw."""
    if plan.request.show_all:
        return sorted(plan.candidates, key=_order)
    best: dict[tuple, Candidate] = {}
    for c in plan.candidates:  # the micro-batches come largest first: keep the first that fits, else the last
        held = best.get((c.mode, c.optimizer, c.compile))
        if held is None or not held.fits:
            best[c.mode, c.optimizer, c.compile] = c
    rows = []
    for (mode, optimizer, comp), c in best.items():
        adamw = best.get((mode, "adamw", comp))
        if optimizer != "adamw" and adamw is not None and (not c.fits or (adamw.fits and adamw.micro >= c.micro)):
            continue
        rows.append(c)
    if plan.pick not in rows:
        rows.append(plan.pick)
    return sorted(rows, key=_order)


# ----------------------------------------------------------------------------- the plan


def make_plan(req: PlanRequest, *, log=None) -> Plan:
    """Every candidate with its memory and speed, and the fastest that fits (PlanError: none does).
    log: where --probe's lines go."""
    try:
        probe_device = probe_device_of(req)
        model, store, samples = _model_config(req)
        try:
            route = route_of(req.cfg.routing)
            check_route(route, model.depth, req.cfg.model.model)  # END beyond the last block
        except UserError as e:  # RouteError
            raise PlanError(str(e)) from None
        # the loss terms' settings, as footprint's Setting holds them: by entry name (dittrain.train.losses;
        # repa: block, projector width, target dims), for the terms that are planned
        try:
            planned = {term.name: term.planned(req.cfg, model, store) for term in loss_terms(req.cfg)}
        except UserError as e:  # a setting that cannot work with this model (--repa-depth beyond it)
            raise PlanError(str(e)) from None
        planned = {name: value for name, value in planned.items() if value is not None}
        costs = term_costs(Setting(model, route=route, **planned))
        target = _target(req, model, probe_device)
        # the candidates: every searched checkpointing mode, optimizer, micro-batch and compile, with
        # the memory footprint predicts for it
        resident = resident_bytes(req, store, target)
        cfg, choices = req.cfg, _choices(req, model, target)
        common = dict(precision=target.precision, kernel=target.kernel, loss=loss_kind(cfg.diffusion.objective,
                      model.learn_sigma), route=route, resident_bytes=resident, lora=lora_of(cfg, model), **planned)
        candidates = []
        for mode in choices["mode"]:
            for optimizer in choices["optimizer"]:
                for micro in choices["micro"]:
                    fp = footprint(Setting(model, micro_batch=micro, accumulation=cfg.optim.batch_size // micro,
                                           mode=mode, optimizer=optimizer, **common))
                    fits = fp.peak * (1 + MARGIN) <= target.capacity
                    for comp in choices["compile"]:
                        candidates.append(Candidate(micro, cfg.optim.batch_size // micro, mode, optimizer, comp,
                                                    fp, fits))
        # each one's c.seconds and c.rate from the card's record (dittrain.plan.throughput), when it has one
        tokens = block_tokens(route, model.depth, model.num_tokens)
        extra = sum((cost.macs_per_sample for cost in costs), 0.0)  # the terms' matmuls (REPA's projector)
        for c in candidates:
            flops = step_flops(model, c.mode, tokens, extra) * cfg.optim.batch_size
            c.rate = rate(target.gpu, model, c.micro, target.precision)
            if c.rate is not None:
                c.seconds = flops / c.rate.flops_per_s
            c.relative = flops / rate(GPUS[RECORDS[0].gpu], model, c.micro, target.precision).flops_per_s
        fitting = [c for c in candidates if c.fits]
        if not fitting:
            smallest = min(candidates, key=lambda c: c.fp.peak)
            need = smallest.fp.peak * (1 + MARGIN) + (CUDA_CONTEXT if target.device == "cuda" else 0)
            raise PlanError(
                f"nothing fits in {format_size(target.capacity)} ({target.source}): the smallest setting, micro-batch "
                f"{smallest.micro} with --grad-checkpointing {smallest.mode} and --optimizer {smallest.optimizer}, "
                f"needs {format_size(smallest.fp.peak)} (+{MARGIN:.0%} headroom), so at least {format_size(need)} "
                f"of {'GPU memory' if target.device == 'cuda' else 'memory'}; or a smaller model or --batch-size")
        plan = Plan(req, model, target, candidates, min(fitting, key=_order), samples, store, costs=costs)
        steps_and_epochs(plan)  # --epochs without the dataset's size: refused before any probe
        if req.probe:
            _probe(plan, probe_device, log)
        return plan
    except FootprintError as e:
        raise PlanError(str(e)) from None


def lora_of(cfg, model) -> tuple[int, str] | None:
    """--lora as footprint's Setting holds it, (rank, targets), checked on the model (PlanError: one line).
    Its speed is planned as a full run's: the frozen weights' gradients it skips are not taken off."""
    import torch

    from dittrain.model import lora
    from dittrain.model.dit import DiT

    settings = lora.settings_of(cfg.lora)
    if settings is None:
        return None
    try:
        lora.check(settings)
        with torch.device("meta"):
            dit = DiT(model)
        lora.check_rank(dit, settings, lora.target_names(dit, settings.targets))
    except UserError as e:
        raise PlanError(str(e)) from None
    return settings.rank, settings.targets


def probe_device_of(req: PlanRequest):
    """The device this machine would train on (--device, auto: CUDA when there is one), when the
    plan is for it: with --probe, a --device given, or neither --gpu-memory nor --gpu; else None."""
    if not (req.probe or "device" in req.given or (req.memory is None and req.gpu is None)):
        return None
    from dittrain.train.setup import TrainError, training_device

    try:
        return training_device(req.cfg.performance.device)
    except (TrainError, ValueError) as e:
        raise PlanError(str(e)) from None


def _probe(plan: Plan, device, log) -> None:
    """--probe: a few timed steps of each fitting candidate shown (the largest micro-batch of each
    mode), fastest measured first; the pick is then the fastest measured."""
    from dittrain.plan.probe import probe

    if device is None:
        raise PlanError("--probe runs on the actual device: give --device cuda or --device cpu")
    for c in [c for c in shown(plan) if c.fits]:
        cfg, model, _, targets = _probe_setting(plan, c, device)
        try:
            c.probed = probe(cfg, model, device, steps=plan.request.probe_steps, targets=targets)
        except Exception as e:  # out of memory: that candidate is out (anything else is an error)
            from ditdata.common.memory import is_out_of_memory

            if not is_out_of_memory(e):
                raise
            c.fits = False
            plan.notes.append(f"--probe: micro-batch {c.micro} with {c.mode} ran out of memory; left out")
        if log is not None and c.probed is not None:
            log(f"probe: micro-batch {c.micro} x {c.accumulation}, --grad-checkpointing {c.mode}, {c.optimizer}, "
                f"--compile {c.compile}: {c.measured_seconds:.3f} s/step (first step {c.probed.first_step_s:.1f} s)")
    probed = [c for c in plan.candidates if c.probed is not None and c.fits]
    if probed:
        plan.pick = c = min(probed, key=_order)
        if c.probed.peak_bytes is None:  # the CPU: the pick's peak, on the allocator's record
            from dittrain.plan.probe import measured_peak

            cfg, model, _, targets = _probe_setting(plan, c, device)
            c.probed = replace(c.probed, peak_bytes=measured_peak(cfg, model, device, targets=targets))
        plan.notes.append(f"--probe: the pick's measured peak {format_size(c.probed.peak_bytes)} (predicted "
                          f"{format_size(c.fp.peak)}) on {device}")


def _probe_setting(plan: Plan, c: Candidate, device) -> tuple:
    """(TrainConfig, DiTConfig, device, targets) of candidate c as dittrain.plan.probe builds it."""
    cfg = with_settings(plan.request.cfg, {**c.settings(), "amp": plan.target.precision, "device": str(device)})
    model = replace(plan.model, grad_checkpointing=int(c.mode) if c.mode.isdigit() else c.mode)
    # the synthetic feature set a loss term reads (--repa's targets), as the store's (or planned) dims
    return cfg, model, device, next((cost.targets for cost in plan.costs if cost.targets is not None), None)


# ----------------------------------------------------------------------------- time


def steps_and_epochs(plan: Plan) -> tuple[int, float | None]:
    """(optimizer steps of the run, epochs they make when the dataset's size is known)."""
    req, n = plan.request, plan.num_samples
    batch = req.cfg.optim.batch_size
    if req.epochs is not None:
        if not n:
            raise PlanError("--epochs needs the dataset's size: --latents STORE or --samples N")
        return max(1, math.ceil(req.epochs * n / batch)), req.epochs
    steps = req.cfg.optim.max_steps
    return steps, (steps * batch / n if n else None)


def fid_seconds(plan: Plan) -> tuple[float, int, int, float] | None:
    """(seconds, sampler steps, forwards per image, cfg scale) of 50,000 evaluation samples at the
    run's eval settings (--eval-steps 0: the protocol's 250 ddpm / 50 Euler steps; guidance other than
    1 doubles each forward's batch), from the rate at the sampling batch; None without a rate."""
    cfg, ev = plan.request.cfg, EvalSampleConfig()
    steps = cfg.eval.eval_steps or (ev.ddpm_steps if cfg.diffusion.objective == "ddpm" else ev.flow_steps)
    guided = cfg.eval.eval_cfg != 1.0 and (plan.model.num_classes or plan.model.text_pooled_dim)
    rows = 2 if guided else 1
    r = rate(plan.target.gpu, plan.model, cfg.eval.eval_batch_size * rows, plan.target.precision)
    if r is None:
        return None
    flops = 2 * flops_per_forward(plan.model) * ev.n * steps * rows
    return flops / r.flops_per_s, steps, rows, cfg.eval.eval_cfg


# ----------------------------------------------------------------------------- what is printed




def run_settings(plan: Plan) -> dict:
    """The TrainConfig fields `dittrain run` needs for the pick: those the user gave and the pick's
    choices that are not the defaults (the rest are run's defaults already)."""
    defaults, cfg = TrainConfig().flat(), plan.config.flat()
    chosen = {k for k in SEARCHED if cfg[k] != defaults[k]}
    keep = ("latents", "model", "batch_size", *(("max_steps",) if plan.request.epochs is not None else ()))
    return {k: cfg[k] for k in cfg if k in plan.request.given or k in chosen or k in keep}


def table_lines(plan: Plan) -> list[str]:
    """The candidates' table, the pick marked with *."""
    probed = any(c.probed is not None for c in plan.candidates)
    rows = shown(plan)
    unit, scale = ("GiB", 2**30) if max(c.fp.peak for c in rows) >= 2**30 else ("MiB", 2**20)

    def size(n: float) -> str:
        return f"{n / scale:.1f}"

    head = (f"  {'micro x acc':>11} {'checkpointing':<13} {'optimizer':<9} {'compile':<7} | {'weights':>7} {'EMA':>5} "
            f"{'optim':>5} {'grads':>5} {'activ':>6} {'work':>5} {'data':>5} | {'peak':>6} {'fits':<4} | "
            f"{'img/s':>7}" + (f" {'probed':>7}" if probed else ""))
    lines = [f"{unit} at the predicted peak of a step, by part; img/s predicted"
             + (", and measured by --probe" if probed else ""), head]
    for c in rows:
        fp, speed = c.fp, plan.request.cfg.optim.batch_size
        predicted = f"{speed / c.seconds:7.0f}" if c.seconds else f"{'-':>7}"
        line = (f"{'*' if c is plan.pick else ' '} {f'{c.micro} x {c.accumulation}':>11} {c.mode:<13} {c.optimizer:<9} "
                f"{c.compile:<7} | {size(fp.weights):>7} {size(fp.ema):>5} {size(fp.optimizer):>5} {size(fp.gradients):>5} "
                f"{size(fp.activations):>6} {size(fp.workspace):>5} {size(fp.data):>5} | {size(fp.peak):>6} "
                f"{'yes' if c.fits else 'no':<4} | {predicted}")
        if probed:
            line += f" {speed / c.measured_seconds:7.1f}" if c.measured_seconds else f" {'-':>7}"
        lines.append(line)
    return lines


def header_lines(plan: Plan) -> list[str]:
    from dittrain.plan.footprint import model_parts

    m, t, cfg = plan.model, plan.target, plan.request.cfg
    adapter = lora_of(cfg, m)
    params = sum(model_parts(m).trainable)
    cond = f"{m.num_classes} classes" if m.num_classes else "unconditional"
    speed = ("speed: " + (f"{t.gpu.name}: {plan.pick.rate.source}; {RECORD_SOURCE}; selective's element-wise "
                          "recomputation and --compile are not in the records" if plan.pick.rate is not None
                          else "no throughput recorded for this device (--gpu NAME or --probe on the device)"))
    head = f" + a DDT head of {m.head_depth} blocks {m.head_hidden} wide" if m.head_depth else ""
    return [f"{cfg.model.model}: {params / 1e6:.1f} M parameters, {m.depth} blocks of {m.num_tokens} tokens{head}, "
            f"{m.in_channels}x{m.input_size}x{m.input_size} latents, {cond}; global batch {cfg.optim.batch_size}, "
            f"{t.precision}" + (f", --route {cfg.routing.route}" if cfg.routing.route else "")
            + "".join(f", {flag}" for term in loss_terms(cfg) if (flag := term.flag(cfg)))
            + (f", --lora {adapter[0]}: {sum(model_parts(m, adapter).trainable) / 1e6:.2f} M trainable (the adapter), "
               "the base frozen" if adapter else ""),
            f"memory: {format_size(t.capacity)} for the step ({t.source}); a setting fits when its peak + "
            f"{MARGIN:.0%} does", speed]


def time_lines(plan: Plan) -> list[str]:
    """The run's length and GPU-hours, and the FID-50K sampling time."""
    steps, epochs = steps_and_epochs(plan)
    c = plan.pick
    seconds = c.measured_seconds if c.probed is not None else c.seconds
    length = f"{steps:,} steps" + (f" ({epochs:,.1f} epochs of {plan.num_samples:,} samples)" if epochs else "")
    where = plan.target.gpu.name if plan.target.gpu is not None else plan.target.device
    if seconds is None:
        lines = [f"time: {length}; no speed for this device: --gpu NAME or --probe"]
    else:
        how = "measured by --probe" if c.probed is not None else "predicted"
        hours = steps * seconds / 3600
        lines = [f"time: {length} at {seconds:.3g} s/step ({how}): {hours:,.1f} GPU-hours ({hours / 24:.1f} days) "
                 f"on the {where}"]
    fid = fid_seconds(plan)
    if fid is not None:
        secs, n_steps, rows, scale = fid
        lines.append(f"FID-50K: {n_steps} sampler steps at CFG {scale:g} ({rows} forward rows per image): about "
                     f"{secs / 3600:.1f} GPU-hours on the {where} (from the training rate at --eval-batch-size "
                     f"{plan.request.cfg.eval.eval_batch_size}, not measured; decoding and Inception extra)")
    return lines


def loader_lines(plan: Plan) -> list[str]:
    """What the loader must deliver (the pick's samples/s) against what the store gives here."""
    c, store, cfg = plan.pick, plan.store, plan.request.cfg
    seconds = c.measured_seconds if c.probed is not None else c.seconds
    need = f"{cfg.optim.batch_size / seconds:,.0f} samples/s" if seconds else "its samples/s (speed unknown)"
    if store is None:
        return [f"loader: needs {need}; no store given (--latents): its read rate is not checked"]
    from dittrain.data.budget import choose_loader

    kind, _, reason = choose_loader(store, kind=cfg.data.loader, resident_device=cfg.data.resident_device)
    if kind == "resident":
        return [f"loader: needs {need}; {reason}: batches come from memory, no reading while training"]
    read = store_read_rate(store)
    rate_words = f"{read:,.0f} samples/s from one process here" if read else "its read rate is not measured (a URL)"
    return [f"loader: needs {need}; {reason}; the store reads {rate_words} (--workers {cfg.data.workers} share it)"]


def store_read_rate(store, seconds: float = 1.0) -> float | None:
    """Samples/s of bulk reads of the store's tensors and labels here (its first shards, for about
    `seconds`; what is cached in RAM reads faster than a cold disk); None for a URL store."""
    import time

    if "://" in str(store.location):
        return None
    fields = [*store.schema.tensors, *[f for f in ("label",) if f in store.schema.columns]]
    n, t0 = 0, time.perf_counter()
    for shard in store.shards:
        for start in range(0, shard.num_samples, 1024):
            n += len(next(iter(store.read(shard, fields=fields, start=start, stop=start + 1024).values())))
            if time.perf_counter() - t0 > seconds:
                return n / (time.perf_counter() - t0)
    return n / max(time.perf_counter() - t0, 1e-9)


def run_command(plan: Plan) -> str:
    """The pick as a `dittrain run` command line (STORE, RUN and a --lora run's WEIGHTS to fill in where not known)."""
    import shlex

    from dittrain.train.resume import flag

    words = ["dittrain", "run"]
    for name, value in run_settings(plan).items():
        if value is None:
            continue
        if isinstance(value, bool):
            words.append(flag(name) if value else "--no-" + flag(name)[2:])
        else:
            on = flag(name)
            words += [on, str(value) if value != "" or name != "latents" else "STORE"]
    if plan.request.cfg.lora.lora:  # --lora adapts pretrained weights (plan does not take them): to fill in
        words += ["--init-from", "WEIGHTS"]
    return " ".join(shlex.quote(w) if w not in ("STORE", "WEIGHTS") else w for w in [*words, "--out", "RUN"])


def report(plan: Plan) -> list[str]:
    """Everything `dittrain plan` prints: the table, the pick and its command, the times."""
    c = plan.pick
    speed = (f", {plan.request.cfg.optim.batch_size / c.measured_seconds:,.1f} img/s measured" if c.probed is not None
             else f", {plan.request.cfg.optim.batch_size / c.seconds:,.0f} img/s" if c.seconds else "")
    pick = (f"pick: micro-batch {c.micro} x {c.accumulation} accumulation, --grad-checkpointing {c.mode}, "
            f"--optimizer {c.optimizer}, --compile {c.compile}: {format_size(c.fp.peak)} predicted peak "
            f"({c.fp.moment}){speed}")
    return [*header_lines(plan), "", *table_lines(plan), "", *plan.notes, pick, "  " + run_command(plan),
            *time_lines(plan), *loader_lines(plan)]


def write_config_file(plan: Plan, path: str) -> str:
    """The pick's settings as a `dittrain run --config` file (dittrain.train.resume.config_toml); its line."""
    from ditdata.common.files import write_text_atomic
    from dittrain.train.resume import config_toml

    try:
        write_text_atomic(Path(path), config_toml(plan.config))
    except OSError as e:
        raise PlanError(f"--write-config {path}: could not write ({e.strerror or e})") from None
    return f"wrote {path} (dittrain run --config {path} --out RUN)"


def request_from(options: dict, given: set, *, latent_shape: str | None, gpu_memory: str | None,
                 **plan_options) -> PlanRequest:
    """A PlanRequest from `dittrain plan`'s options: dittrain run's (`options`, by field name;
    `given`: those set by the user), --latent-shape CxHxW and --gpu-memory SIZE as written."""
    from ditdata.common.bytesize import parse_size

    shape = None
    if latent_shape is not None:
        try:
            shape = tuple(int(v) for v in latent_shape.lower().split("x"))
        except ValueError:
            shape = ()
        if len(shape) != 3 or min(shape) < 1:
            raise PlanError(f"--latent-shape {latent_shape}: write CxHxW, e.g. 4x32x32")
    try:
        memory = parse_size(gpu_memory, "--gpu-memory") if gpu_memory is not None else None
    except ValueError as e:
        raise PlanError(str(e)) from None
    return PlanRequest(TrainConfig.from_flat(**options), frozenset(given & set(options)), latent_shape=shape,
                       memory=memory, **plan_options)


__all__ = ["CUDA_CONTEXT", "MARGIN", "RECORD_SOURCE", "SEARCHED", "SEARCHED_MODES", "Candidate", "Plan", "PlanError",
           "PlanRequest", "Target", "fid_seconds", "loader_lines", "report", "request_from", "run_command",
           "write_config_file", "make_plan", "run_settings", "shown", "steps_and_epochs",
           "table_lines", "time_lines", "with_settings"]
