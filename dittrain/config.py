"""Run configuration: every training knob with its default, in one place.

`TrainConfig` is what a user sets, in sections (data, model, diffusion, optim,
checkpointing, logging, eval, performance, repa, routing, lora); the `dittrain run` flags map 1:1 onto its
field names. The resolved config saved in config.json, in every checkpoint and in the EMA
export adds what is DERIVED from the latent store (never set by hand):

    {"train": asdict(TrainConfig)      by section: {"data": {"latents", ...}, "optim": {"lr", ...}, ...}
     "model": asdict(DiTConfig)        in_channels, input_size, num_classes, text dims
     "diffusion": asdict(DiffusionConfig),  loss weighting, flow t sampling and shift too
     "latents": {"norm": "none"} or {"norm": "channel", "mean": [C], "std": [C], ...}
                (dittrain.data.latent_norm: the store's stats the model's inputs were standardised with;
                "train" records --latent-norm resolved too: none or channel, never auto)
     "store": {"path": absolute path, "identity": manifest digest, "num_samples": N,
               "features": {"name", "identity", ...} of the --repa feature set, only with it,
               "buckets": [{"name": "WxH", "size": [W, H], "latent_shape": [C, h, w],
                            "num_samples": N}, ...] of a bucketed store, only with one},
     "init": what --init-from loaded (dittrain.inference.weights.init_model's record), only with it}
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

# ------------------------------------------------------------------------------ choices
# Every choice list of dittrain, in one place and without torch: the CLI's click.Choice
# lists read these (so `dittrain --help` loads nothing heavy), and the modules that check a
# value use the same tuples (tests/test_train_config.py checks both).

OBJECTIVES = ("ddpm", "flow")  # ddpm: epsilon (DiT); flow: rectified flow, velocity (dittrain.diffusion)
# dittrain sample --sampler: ddpm/ddim for ddpm runs, euler/heun/sde for flow, dpm++/unipc (diffusers'
# multistep schedulers) for both (dittrain.diffusion.SAMPLER_TABLE)
SAMPLERS = ("ddpm", "ddim", "euler", "heun", "sde", "dpm++", "unipc")
LOSS_WEIGHTINGS = ("none", "min-snr")  # ddpm
T_SAMPLINGS = ("logit-normal", "uniform")  # flow: how training draws t
LATENT_NORMS = ("auto", "none", "channel")  # dittrain.data.latent_norm (auto: resolved to none or channel at the start)
OPTIMIZERS = ("adamw", "adamw8bit")  # dittrain.train.optim
LR_SCHEDULES = ("constant", "cosine", "linear")  # dittrain.train.optim.lr_at
AMP_MODES = ("auto", "bf16", "fp16", "fp32")  # --amp: ditdata.common.devices.PRECISIONS, in --help's order
PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # sample / serve --precision: ditdata.common.devices.PRECISIONS
# --grad-checkpointing (dittrain.model.checkpointing): these, or k >= 1 (every k-th block)
GRAD_CHECKPOINTING = ("none", "every", "attn", "mlp", "selective")
CHECKPOINT_BRANCHES = ("attn", "mlp")  # recompute one branch of every block instead of whole blocks
CHECKPOINT_SELECTIVE = "selective"  # every block, keeping its matmul and attention outputs
COMPILE = ("off", "auto", "blocks", "model")  # --compile (dittrain.train.step.compile_target)
COMPILE_TARGETS = ("off", "blocks", "model")  # what --compile resolves to
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's
LOADERS = ("auto", "resident", "streaming")  # dittrain.data
# a bucketed store's last partial batch of each bucket (dittrain.data.bucketed): pad it with repeats
# (the default: every sample seen every epoch) or drop it
BUCKET_REMAINDERS = ("pad", "drop")
RESIDENT_DEVICES = ("cpu", "cuda")  # where a resident store lives
LOGGERS = ("jsonl", "tensorboard", "wandb")  # dittrain.train.loggers
# --route-convention (dittrain.model.routing): how --route's START:END count. tread: as TREAD's reference
# (CompVis/tread: start_layer_idx..end_layer_idx, 0-based, both routed) with its full-precision block after the
# rejoin; half-open: dittrain's first meaning (blocks START <= i < END, no such block), what a run recorded
# before this field means
ROUTE_CONVENTIONS = ("tread", "half-open")
# `dittrain sample --route-guidance` (dittrain.inference.route_guidance): the condition of its two routed passes.
# null: the null class / empty caption in both, as TREAD's rf.py sample_tread (class_drop_prob=1.0); cond: the
# sample's own class or prompt in both
ROUTE_GUIDANCE_CONDS = ("null", "cond")
ROUTE_GUIDANCE_CFG = 1.5  # --cfg's default with --route-guidance: sample_tread's cfg_scale (and inference.py's)
# The DiT's block choices (DiTConfig.mlp / norm / pos) are not here: they are the names of the block-part
# registries, dittrain.model.parts MLPS, NORMS and POSITIONS (without torch too), where each part's entry
# holds all that is known of it


# AdamW's betas unless --adam-betas says otherwise: DiT's (facebookresearch/DiT train.py: torch's defaults).
# A string "B1,B2" in the config, as the flag and a --config file spell it (and config.json records it)
ADAM_BETAS = "0.9,0.999"


def parse_adam_betas(text: str) -> tuple[float, float]:
    """"B1,B2" -> (B1, B2), each a finite number with 0 <= B < 1 (Adam's moment decays: 1 would never
    forget, and the bias correction 1 - B^t would divide by zero); ValueError with a one-line reason."""
    import math

    parts = [p.strip() for p in str(text).split(",")]
    try:
        betas = tuple(float(p) for p in parts)
    except ValueError:
        betas = ()
    if len(parts) != 2 or len(betas) != 2:
        raise ValueError(f"{text!r} is not two numbers B1,B2 (e.g. 0.9,0.95)")
    for name, b in zip(("B1", "B2"), betas, strict=True):
        if not (math.isfinite(b) and 0 <= b < 1):
            raise ValueError(f"{text!r}: {name} = {b:g} is outside [0, 1) (Adam's moment decay)")
    return betas


def adam_betas_text(betas: tuple[float, float]) -> str:
    """(B1, B2) -> "B1,B2", the one spelling a record holds (0.90, 0.950 -> "0.9,0.95")."""
    return ",".join(repr(float(b)) for b in betas)

# |guidance scale| beyond this is refused (--cfg, --sample-cfg, --eval-cfg; dittrain.inference.sample.plan_samples):
# DiT guides with 1.5..4, and a finite but absurd scale (1e308) overflows the samples to NaN.
MAX_CFG_SCALE = 100.0
# --val-fraction / --val-latents (dittrain.train.validation): the validation loss is evaluated at this many t,
# the midpoints of as many equal bins of the objective's t range (ddpm: timesteps 50, 150, ..., 950; flow: t =
# 0.05, 0.15, ..., 0.95), each a curve of its own (val/loss_t<T>)
VAL_TIMESTEPS = 10
# --repa refuses a feature set whose stored targets keep less than this mean cosine to the encoder's fp32
# output (dittrain.train.repa.check): int8 keeps about 0.9999 and a PCA to a few hundred dims about 0.95;
# below it the projector aligns to something else than the encoder's features
REPA_MIN_COSINE = 0.9
# --cfg-interval LO,HI: guidance only where LO <= t <= HI, t in [0, 1] with 1 the noise end (flow: its t; ddpm:
# timestep / 1000); the default guides everywhere (dittrain.diffusion.guidance_interval)
CFG_EVERYWHERE = (0.0, 1.0)


def parse_cfg_interval(value) -> tuple[float, float]:
    """--cfg-interval "LO,HI" (or a pair) -> (LO, HI) with 0 <= LO <= HI <= 1; ValueError (one
    line) otherwise."""
    text = value if isinstance(value, str) else ",".join(map(str, value))
    parts = [p.strip() for p in text.split(",")]
    try:
        lo, hi = (float(p) for p in parts)
    except ValueError:
        raise ValueError(f"{text!r} is not LO,HI: two numbers in 0..1, e.g. 0,0.7 (guidance for t <= 0.7)") from None
    if not 0.0 <= lo <= hi <= 1.0:  # NaN fails too
        raise ValueError(f"{text!r}: LO,HI must satisfy 0 <= LO <= HI <= 1 (t runs from 0, the data, to 1, the noise)")
    return lo, hi


def format_cfg_interval(interval) -> str:
    """(LO, HI) as --cfg-interval writes it: "0.0,0.7" (repr: read back exactly)."""
    lo, hi = interval
    return f"{float(lo)!r},{float(hi)!r}"


# --latents: one store, or several mixed (dittrain.data.mixture). Each entry is "PATH" or "PATH:R", R > 0 its
# repeats per epoch (kohya's num_repeats, any positive number: 0.3 is 30% of the store per epoch, 3 is every
# sample three times); one store is recorded as the plain string runs recorded before mixtures, several as a list.
def latent_sources(value) -> list[tuple[str, float | None]]:
    """--latents as given ("PATH", "PATH:R", or a list of them) -> [(PATH, R or None where no :R is given)];
    ValueError (one line) for an R that is not a positive finite number. The split is at the last ":" when what
    follows reads as a number, so URLs (s3://b/store, http://host:8080/store) stay whole."""
    import math

    specs = [value] if isinstance(value, str) else list(value or ())
    out = []
    for spec in specs:
        spec = str(spec)
        head, sep, tail = spec.rpartition(":")
        try:
            repeats = float(tail) if sep and head and "/" not in tail else None
        except ValueError:
            repeats = None
        if repeats is None:
            out.append((spec, None))
            continue
        if not (math.isfinite(repeats) and repeats > 0):
            raise ValueError(f"--latents {spec}: the repeats after ':' must be a positive number (1: each sample "
                             "once per epoch, 0.3: 30% of the store, 3: each sample three times)")
        out.append((head, repeats))
    return [s for s in out if s[0]]


def latents_value(given) -> str | list[str]:
    """The data.latents field of the --latents given (click's tuple of a repeatable option, a config file's
    string or list): "" for none, the string itself for one store (as runs recorded it before mixtures), a
    list for several."""
    specs = [given] if isinstance(given, str) else [str(g) for g in given or ()]
    specs = [s for s in specs if s]
    return "" if not specs else specs[0] if len(specs) == 1 else specs


def latents_of_record(store: dict) -> str | list[str]:
    """The --latents a bare resume continues with, from the run record's "store" section: the mixture's
    stores where the run found them, with their repeats (a list), else the one store's path."""
    mixture = store.get("mixture")
    if not mixture:
        return store["path"]
    return [m["path"] if float(m["repeats"]) == 1 else f"{m['path']}:{float(m['repeats'])!r}" for m in mixture]


def _repeats_changed(old, new) -> bool:
    """--latents is learned on a resume when the same number of mixed stores take other repeats (what each
    store contributes per epoch); another path alone (a store moved) is safe, and another list of stores is
    refused by the checkpoint's store identities (dittrain.data.mixture.check_resume)."""
    try:
        a, b = latent_sources(old), latent_sources(new)
    except ValueError:
        return False
    return len(a) == len(b) > 1 and [r or 1.0 for _, r in a] != [r or 1.0 for _, r in b]


@dataclass(frozen=True)
class SampleConfig:
    """Sampling settings and their defaults: `dittrain sample` and the trainer's EMA grids."""

    cfg_scale: float = 4.0  # classifier-free guidance (1: none)
    steps: int = 50
    sampler: str | None = None  # None: ddpm for the ddpm objective, euler for flow
    seed: int = 0
    batch_size: int = 32  # samples per forward pass (CFG doubles it)
    precision: str = "auto"  # auto (bf16 on GPUs that have it, else fp32) | fp32 | bf16 | fp16
    n: int = 16  # samples when neither --n nor --n-per-class says (the trainer's EMA grids too)
    cfg_channels: int = 0  # guide the first N latent channels only (DiT's released sampler: 3); 0: all
    # TREAD's guidance by selection rates (dittrain.inference.route_guidance): (strong, weak) rates of two routed
    # passes instead of CFG's pair, scaled by cfg_scale; None: off. Its inference.py uses (0.3, 0.7) at 1.5
    # (ROUTE_GUIDANCE_CFG: `dittrain sample`'s --cfg default with it)
    route_guidance: tuple[float, float] | None = None
    route_guidance_cond: str = ROUTE_GUIDANCE_CONDS[0]  # null | cond: the condition of both passes
    # guide only where LO <= t <= HI (t in [0, 1], 1 = noise; REPA's guidance_high 0.7 is (0, 0.7)); else the
    # conditional pass alone
    cfg_interval: tuple[float, float] = CFG_EVERYWHERE
    # flow: shift the sampling time grid by t -> S t / (1 + (S - 1) t); None: the run's --t-shift (LightningDiT's
    # timestep_shift s, in its reversed time, is S = 1 / s)
    time_shift: float | None = None


@dataclass(frozen=True)
class EvalSampleConfig:
    """`dittrain sample --npz`: the defaults of evaluation samples (the DiT paper's FID-50K
    protocol) where --steps / --cfg / --n are not given; SampleConfig's otherwise."""

    ddpm_steps: int = 250  # a ddpm run: 250 ancestral ddpm steps
    flow_steps: int = 50  # a flow run: 50 Euler steps
    cfg_scale: float = 1.5
    n: int = 50_000
    # Samples per chunk file (the unit of resuming and of sharing out over ranks): a multiple
    # of the usual batch sizes, so batches stay full; ~200 chunks for 50K, which keeps 8 ranks
    # evenly busy; a kill loses at most one chunk per rank (~50 MB at 256 px).
    chunk_size: int = 256


# ------------------------------------------------------------------------------ library settings
# What the library functions behind `dittrain sample --npz`, `dittrain serve`, `dittrain export
# --format onnx` and the trainer's loader take instead of a long keyword list, with the defaults
# they had as keywords (the command line reads them too); frozen: a call's settings, not a run's
# record.


@dataclass(frozen=True)
class NpzConfig:
    """`dittrain sample --npz`'s settings (dittrain.inference.eval_samples.sample_to_npz): what
    job.json records besides the conditions and the device. Steps and guidance default to the
    FID protocol (EvalSampleConfig), the rest to SampleConfig's."""

    steps: int | None = None  # None: EvalSampleConfig.ddpm_steps / flow_steps, by the run's objective
    cfg_scale: float = EvalSampleConfig.cfg_scale
    n: int = EvalSampleConfig.n
    chunk_size: int = EvalSampleConfig.chunk_size
    cfg_channels: int = SampleConfig.cfg_channels
    cfg_interval: tuple[float, float] = SampleConfig.cfg_interval
    time_shift: float | None = SampleConfig.time_shift
    sampler: str | None = SampleConfig.sampler
    seed: int = SampleConfig.seed
    batch_size: int = SampleConfig.batch_size
    precision: str = SampleConfig.precision


@dataclass(frozen=True)
class ServeConfig:
    """`dittrain serve`'s settings (dittrain.inference.serve): where the page listens, how it
    samples, what one request may ask, and where the run's parts are if not where it says."""

    host: str = "127.0.0.1"  # 0.0.0.0 opens the page to the network (no login)
    port: int = 7860
    device: str = "auto"
    precision: str = SampleConfig.precision
    batch_size: int = SampleConfig.batch_size  # samples per forward pass; part of what decides ddpm and sde images
    max_images: int = 64  # per request
    max_steps: int = 1000  # per request (ddpm: at most its timesteps)
    queue_size: int = 32  # requests waiting their turn before new ones are turned away
    latents: str | None = None  # the run's latent store, if not where it recorded
    vae: str | None = None  # the autoencoder to decode with (as `dittrain sample --vae`)
    model: str | None = None  # a plain state dict's model
    text_pretrained: str | None = None  # the text encoder's weights, if not where the store's manifest says


@dataclass(frozen=True)
class OnnxConfig:
    """How `dittrain export --format onnx` traces and checks (dittrain.inference.onnx.export_onnx)."""

    tolerance: float = 1e-4  # the largest |onnxruntime - PyTorch|, times max(1, max |PyTorch output|)
    max_batch: int = 1024  # the dynamic batch axis' upper bound (guidance doubles the sampling batch)
    opset: int | None = None  # None: the exporter's


@dataclass(frozen=True)
class LoaderConfig:
    """How dittrain.data.build_loader reads a store; the run facts (batch size, seed, ranks,
    device) are its own arguments. `dittrain run` fills it from its data section
    (DataSection: loader -> kind, loader_memory -> memory, bucket_remainder -> remainder), whose
    defaults are these, except memory: the library's loaders have no budget unless asked, a run's
    is "auto" (tests/test_data.py checks the two agree)."""

    kind: str = LOADERS[0]  # auto | resident | streaming (dittrain.data.budget.choose_loader)
    resident_device: str = RESIDENT_DEVICES[0]  # cpu | cuda: where a resident store lives
    workers: int = 4  # streaming loader processes (0: read in this process)
    shuffle_window: int | None = None  # streaming: shards shuffled together; None: sized by the budget (4 without)
    prefetch: int | None = None  # streaming: batch slots per worker; None: sized by the budget (4 without)
    memory: str | int | None = None  # streaming budget: auto, a size ("2GiB") or bytes; None: no budget
    memory_fraction: float = 0.5  # auto: resident when this rank's part needs at most this share of the memory
    split: str = "part"  # how ranks share the data: part | batch (dittrain.data's docstring)
    remainder: str = BUCKET_REMAINDERS[0]  # a bucketed store's last partial batch per bucket: pad | drop
    with_index: bool = False  # batches also carry each sample's row ("index") and flip choice ("flip")


# ------------------------------------------------------------------------------ resume classes
# Every TrainConfig field says, where it is defined, what a resume does when it differs from the
# run's record (dittrain.train.resume; tests/test_train_config.py fails on a field without one):

SAFE = "safe"  # does not change what is learned (how long, how often to save or log, the device): applied
LEARNED = "learned"  # the optimisation itself: refused unless --allow-changes, then recorded in the history
FIXED = "fixed"  # what the weights or the optimizer state are made of: never (a new run: --init-from RUN)
START = "start"  # how this command starts, not a setting of the run (--out, --resume, --init-from): not compared
RESUME_CLASSES = (SAFE, LEARNED, FIXED, START)


_DEFAULT = object()  # setting(absent=): none given, a record without the field means its default


def setting(default, resume: str, *, learned_if=None, needs: str = "", resolves_auto: bool = False, flag: str = "",
            absent=_DEFAULT, learned_when=None):
    """A TrainConfig field: its default, and what a resume does with a change of it (RESUME_CLASSES).
    learned_if(recorded TrainConfig) -> True: a SAFE change that is LEARNED for this run (--max-steps
    under a cosine schedule, which ends at max_steps); needs: the field without which this one means
    nothing (--repa-depth without --repa is refused); resolves_auto: the start resolves "auto" and
    records the result, so "auto" on a resume means the recorded value; flag: the flag when it is not
    --field-name; absent: what a run record without the field means, when not the default (a field that
    came later to say how an older field reads: --route-convention); learned_when(recorded value, new value)
    -> True: a SAFE change that is LEARNED (--latents: other repeats of the mixed stores)."""
    if resume not in RESUME_CLASSES:
        raise ValueError(f"resume class {resume!r}: one of {', '.join(RESUME_CLASSES)}")
    return field(default=default, metadata={"resume": resume, "learned_if": learned_if, "needs": needs,
                                            "resolves_auto": resolves_auto, "flag": flag,
                                            "absent": default if absent is _DEFAULT else absent,
                                            "learned_when": learned_when})


def _cosine(recorded: TrainConfig) -> bool:
    """max_steps is learned under a cosine schedule, or a linear one without --lr-decay-end: it ends at max_steps,
    so another length bends every later lr."""
    return recorded.optim.lr_schedule == "cosine" or (recorded.optim.lr_schedule == "linear"
                                                      and not recorded.optim.lr_decay_end)


# ------------------------------------------------------------------------------ TrainConfig
# `dittrain run`'s knobs in sections; the flags map 1:1 onto the field names (unique over all
# sections), `dittrain run --help` lists them under the same headings, and config.json keeps
# the same sections ({"train": {"data": {...}, "model": {...}, ...}}).


@dataclass
class DataSection:
    """The latent store and how it is read (dittrain.data)."""

    # the latent store (ditdata encode --out), or its URL (s3://, gs://, http(s)://); several stores mixed
    # ("PATH:R" each, R its repeats per epoch; dittrain.data.mixture) are a list: their paths may move (safe),
    # other repeats change what is learned, another list of stores is refused by the checkpoint's identities
    latents: str | list[str] = setting("", SAFE, learned_when=_repeats_changed)
    cache_dir: str = setting("", SAFE)  # a URL store's local cache ("": $XDG_CACHE_HOME/ditkit/stores, ditdata.store.remote)
    cache_limit: str = setting("", SAFE)  # its size limit ("": 50 GiB, remote.DEFAULT_CACHE_LIMIT); LRU shards are removed
    # auto (channel where the store's autoencoder publishes no scaling factor, e.g. VA-VAE; else none) |
    # none | channel (standardise with the store's per-channel mean/std); recorded resolved
    latent_norm: str = setting("auto", FIXED, resolves_auto=True)
    loader: str = setting(LoaderConfig.kind, SAFE)  # auto | resident | streaming (a bucketed store: auto | resident)
    bucket_remainder: str = setting(LoaderConfig.remainder, LEARNED)  # a bucketed store: each bucket's last partial batch, pad (with repeats) | drop
    resident_device: str = setting(LoaderConfig.resident_device, SAFE)  # cpu | cuda: where a resident store lives
    workers: int = setting(LoaderConfig.workers, SAFE)  # streaming loader processes
    shuffle_window: int = setting(0, LEARNED)  # streaming: shards shuffled together in memory (0: the most, up to 4, that fit loader_memory)
    # streaming: budget for the loader's own memory (windows, slots, batches): auto (25% of the
    # available RAM over this machine's ranks, at most 4 GiB) or a size such as 2GiB, 512MiB
    loader_memory: str = setting("auto", SAFE)
    # a store with several caption sets (ditdata encode --captions alt,SET,...): which one each sample's text
    # is, drawn per sample per step (dittrain.train.captionmix): "" the store's first set only; SET=W,... fixed
    # proportions; clip-score[:temperature=T,threshold=S] SANA's rule over the sets' CLIP scores
    caption_mix: str = setting("", LEARNED)


@dataclass
class ModelSection:
    """The network (dittrain.model.dit) and where its first weights come from."""

    model: str = setting("DiT-B/2", FIXED)  # a name from `dittrain models` (DiT-XL/2, LightningDiT-XL/1, ...) or custom:hidden=H,depth=D,heads=N,patch=P
    learn_sigma: bool | None = setting(None, FIXED)  # None: True for ddpm (as DiT), False for flow
    # None: the model's own (a custom spec's qk_norm=0|1; the presets: off, as LightningDiT's released configs);
    # True / False: QK-norm on / off whatever the model says. A resume builds the architecture its record holds
    qk_norm: bool | None = setting(None, FIXED)
    init_from: str = setting("", START)  # fine-tune from these weights: a plain state dict, an EMA export, a run, a checkpoint


@dataclass
class DiffusionSection:
    """The objective and its loss (dittrain.diffusion.DiffusionConfig), and CFG dropout."""

    objective: str = setting("ddpm", FIXED)  # ddpm (epsilon, DiT) | flow (rectified flow, velocity)
    loss_weighting: str = setting("none", LEARNED)  # ddpm: none | min-snr
    min_snr_gamma: float = setting(5.0, LEARNED)
    t_sampling: str = setting("logit-normal", LEARNED)  # flow: logit-normal | uniform
    t_mean: float = setting(0.0, LEARNED)  # flow logit-normal: t = sigmoid(N(t_mean, t_std))
    t_std: float = setting(1.0, LEARNED)
    # flow: t -> S t / (1 + (S - 1) t) in training and the sampling grid; 1: none; "auto": RAE's S = sqrt(C H W /
    # 4096) of the store's latent (dittrain.diffusion.dimension_shift), recorded as the number
    t_shift: float | str = setting(1.0, LEARNED, resolves_auto=True)
    # flow: loss += W x mean(1 - cos(output, velocity)) over the channels at each position (LightningDiT's
    # cosine loss, weight 1 there; dittrain.train.losses.VelocityCosine); 0: off
    velocity_cosine_weight: float = setting(0.0, LEARNED)
    # flow: the model's timestep input is t x S (1000: DiT's and SD3's scale; 1: SiT, REPA, LightningDiT)
    flow_time_scale: float = setting(1000.0, FIXED)
    class_dropout: float = setting(0.1, LEARNED)  # labels -> null class, for classifier-free guidance
    caption_dropout: float = setting(0.1, LEARNED)  # captions -> the empty caption's embedding


@dataclass
class OptimSection:
    """The optimisation (DiT: AdamW, lr 1e-4, no weight decay, global batch 256, EMA 0.9999)."""

    batch_size: int = setting(256, LEARNED)  # GLOBAL batch per optimizer step, over ranks and accumulation
    accumulation_steps: int = setting(1, LEARNED)
    lr: float = setting(1e-4, LEARNED)
    # AdamW's "beta1,beta2" (parse_adam_betas; dittrain.train.optim): DiT's 0.9,0.999; LightningDiT trains with 0.9,0.95
    adam_betas: str = setting(ADAM_BETAS, LEARNED)
    weight_decay: float = setting(0.0, LEARNED)
    optimizer: str = setting("adamw", FIXED)  # adamw (torch, fp32 state) | adamw8bit (bitsandbytes, 8-bit state)
    warmup_steps: int = setting(0, LEARNED)
    lr_schedule: str = setting("constant", LEARNED)  # constant | cosine (to min_lr at max_steps) | linear (RAE's)
    min_lr: float = setting(0.0, LEARNED)
    # linear: lr held until this step (or the warmup's end), then linear to min_lr at lr_decay_end (0: max_steps)
    lr_decay_start: int = setting(0, LEARNED)
    lr_decay_end: int = setting(0, LEARNED)
    grad_clip: float = setting(1.0, LEARNED)  # max grad norm; 0 disables clipping (the norm is still logged)
    max_steps: int = setting(400_000, SAFE, learned_if=_cosine)
    ema: float = setting(0.9999, LEARNED)
    max_nonfinite: int = setting(20, SAFE)  # consecutive NaN/inf losses before giving up
    seed: int = setting(0, LEARNED)  # the data order, the noise and the initial weights


@dataclass
class CheckpointingSection:
    """The run directory and its checkpoints (dittrain.train.checkpoint)."""

    out: str = setting("", START)  # the run directory
    resume: bool = setting(False, START)
    save_every: int = setting(5000, SAFE)
    keep: int = setting(3, SAFE)  # checkpoints kept
    async_save: bool = setting(True, SAFE)  # write checkpoints from a background thread after a host copy


@dataclass
class LoggingSection:
    """Where the figures and sample grids go (dittrain.train.loggers; jsonl is always on)."""

    log_every: int = setting(100, SAFE)
    sample_every: int = setting(5000, SAFE)  # EMA sample grid every N steps and at the end (0: never)
    sample_steps: int = setting(SampleConfig.steps, SAFE)
    sample_cfg: float = setting(SampleConfig.cfg_scale, SAFE)
    # what the grids show, the same every grid: class indices or names, comma-separated ("": SampleConfig.n
    # classes drawn with the seed); a text file, one prompt a line ("": the store's first SampleConfig.n captions)
    sample_classes: str = setting("", SAFE)
    sample_prompts: str = setting("", SAFE)
    logger: str = setting("tensorboard,jsonl", SAFE)  # comma-separated: jsonl, tensorboard, wandb
    wandb_project: str = setting("", SAFE)  # "": $WANDB_PROJECT, else "ditkit" (dittrain.train.loggers)
    wandb_name: str = setting("", SAFE)  # "": $WANDB_NAME, else the run directory's name


@dataclass
class EvalSection:
    """FID during training (off by default): FID-eval_n of the EMA model every eval_every steps."""

    eval_every: int = setting(0, SAFE)  # 0: never
    eval_n: int = setting(5000, SAFE)
    eval_ref: str = setting("", SAFE)  # the reference: an ADM batch .npz, an .npz or folder of images, image shards
    eval_inception: str = setting("", SAFE)  # the FID Inception weights file ("": $DITKIT_INCEPTION or the torch hub cache)
    eval_steps: int = setting(0, SAFE)  # 0: the FID protocol's (EvalSampleConfig: 250 ddpm steps, 50 Euler for flow)
    eval_cfg: float = setting(EvalSampleConfig.cfg_scale, SAFE)
    eval_sampler: str | None = setting(None, SAFE)  # None: the objective's (ddpm, euler); sde: REPA's FID protocol
    eval_cfg_interval: str = setting(format_cfg_interval(CFG_EVERYWHERE), SAFE)  # LO,HI: guided where LO <= t <= HI
    eval_time_shift: float | None = setting(None, SAFE)  # flow: the sampling grid's shift; None: the run's --t-shift
    eval_batch_size: int = setting(64, SAFE)  # samples per forward while evaluating (CFG doubles it)
    # A held-out validation loss (dittrain.train.validation): the live weights' plain MSE at VAL_TIMESTEPS fixed t
    # values with fixed noise, every val_every steps, at the start and at the end. val_fraction: that share of the
    # store's rows, drawn with a seed of the validation's own (the same rows for every run on the store), never
    # trained on (FIXED: another split trains on other rows); 0: none
    val_fraction: float = setting(0.0, FIXED)
    val_latents: str = setting("", SAFE)  # or a second store to validate on, all its rows (training keeps every row)
    # 1000: at DiT's batch of 256, one evaluation of 1% of ImageNet (12.8K rows x 10 t, forwards only) costs about
    # 14% of the 1000 steps' compute (bench/RESULTS.md), 0.2% of it 3%; the curve still gets 400 points over 400K steps
    val_every: int = setting(1000, SAFE)


@dataclass
class PerformanceSection:
    """Speed and memory on the device."""

    device: str = setting("auto", SAFE)  # auto | cpu | cuda
    amp: str = setting("auto", LEARNED, flag="--precision")  # auto (bf16 on GPUs that have it, else fp16; fp32 on CPU) | bf16 | fp16 | fp32
    grad_checkpointing: str = setting("none", SAFE)  # none | every | k (every k-th block) | attn | mlp | selective
    # torch.compile: off | auto (blocks on CUDA, off on the CPU) | blocks (each DiTBlock: regional,
    # one short compile) | model (the whole forward). OFF by default until measured on a GPU.
    compile: str = setting("off", SAFE)
    compile_mode: str = setting("default", SAFE)  # default | reduce-overhead (CUDA graphs: launch-bound small models) | max-autotune
    tf32: bool = setting(True, LEARNED)


@dataclass
class RepaSection:
    """REPA, representation alignment (Yu et al., 2024; dittrain.train.repa): a small projector maps the
    hidden tokens after block repa_depth onto a feature set of the store (`ditdata features`, e.g.
    DINOv2 patch tokens); the loss adds repa_weight x (1 - cosine). Off unless repa names a set."""

    repa: str = setting("", FIXED)  # the feature set ("": off)
    repa_depth: int = setting(8, LEARNED, needs="repa")  # align the tokens after this block (1-based; the paper's 8 for SiT-XL/2)
    repa_weight: float = setting(0.5, LEARNED, needs="repa")  # lambda: loss = diffusion loss + lambda x REPA loss
    repa_projector_dim: int = setting(2048, FIXED, needs="repa")  # the projector MLP's width: hidden -> P -> P -> feature dims
    # refuse a set whose stored targets keep a lower mean cosine to the encoder's fp32 output (its
    # manifest's storage.cosine_to_fp32), or record a non-finite one; 0: train on any set
    repa_min_cosine: float = setting(REPA_MIN_COSINE, SAFE, needs="repa")


@dataclass
class RoutingSection:
    """Token routing, TREAD (Krause et al., 2025; dittrain.model.routing): during training a random fraction
    of the tokens skips the middle blocks and rejoins after them. Training only: sampling (unless `dittrain
    sample --route-guidance` asks), evaluation and exports use every token. Off unless route is given."""

    # RATE:START:END as TREAD writes it: blocks START..END (0-based, both routed), e.g. 0.5:2:24 on DiT-XL/2's
    # 28 blocks (the paper's i = 2, j = depth - 4); "": off
    route: str = setting("", LEARNED)
    # how route reads (ROUTE_CONVENTIONS); a record from before this field has half-open, and keeps it on resume
    route_convention: str = setting(ROUTE_CONVENTIONS[0], LEARNED, needs="route", absent="half-open")


# --lora-targets' default: every block's attention (self and cross) and MLP linears (dittrain.model.lora says why)
LORA_TARGETS = "attn.qkv,attn.proj,cross_attn.q,cross_attn.kv,cross_attn.proj,mlp.fc1,mlp.fc2"


@dataclass
class LoraSection:
    """LoRA fine-tuning (Hu et al., 2021; dittrain.model.lora, through peft): the --init-from weights stay
    frozen and a rank-r adapter B A (scaled alpha / r) beside each targeted linear trains; only the adapter
    is in the optimizer, the EMA and the checkpoints, the frozen base is rebuilt from the run's "init"
    record. Off unless lora gives a rank. Rank and targets make the adapter's tensors (fixed); alpha and
    dropout change no tensor, only how the adapter acts and learns (alpha scales its output, dropout
    regularises its input), so a resume may change them like the lr (learned)."""

    lora: int = setting(0, FIXED)  # the adapter's rank r (0: off, a full fine-tune); needs --init-from
    # comma-separated linears to adapt: names (a module named so, or ending in .NAME, as peft's target_modules
    # list) or regular expressions (fully matching the module's name, as peft's target_modules string)
    lora_targets: str = setting(LORA_TARGETS, FIXED, needs="lora")
    lora_alpha: float = setting(0.0, LEARNED, needs="lora")  # the scale's numerator (alpha / r); 0: the rank (scale 1)
    lora_dropout: float = setting(0.0, LEARNED, needs="lora")  # dropout on the adapter's input (peft's lora_dropout)


# `dittrain plan` takes these options of `dittrain run` (the same ones): the run it plans
PLAN_RUN_OPTIONS = ("latents", "cache_dir", "cache_limit", "model", "objective", "learn_sigma", "qk_norm", "batch_size",
                    "accumulation_steps", "optimizer", "max_steps", "amp", "grad_checkpointing", "compile", "loader",
                    "resident_device", "workers", "device", "repa", "repa_depth", "repa_projector_dim", "route", "lora",
                    "lora_targets",
                    "eval_steps", "eval_cfg", "eval_batch_size")

SECTIONS = {"data": DataSection, "model": ModelSection, "diffusion": DiffusionSection, "optim": OptimSection,
            "checkpointing": CheckpointingSection, "logging": LoggingSection, "eval": EvalSection,
            "performance": PerformanceSection, "repa": RepaSection, "routing": RoutingSection, "lora": LoraSection}
# field name -> its section: every flag of `dittrain run` is the name of one field
SECTION_OF = {f.name: section for section, cls in SECTIONS.items() for f in fields(cls)}
# field name -> what a run record without it means, for the fields whose absence is not their default
ABSENT = {f.name: f.metadata["absent"] for cls in SECTIONS.values() for f in fields(cls)
          if f.metadata["absent"] != f.default}


@dataclass
class TrainConfig:
    """Every knob of a training run, by section: cfg.optim.lr, cfg.data.latents, ..."""

    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    diffusion: DiffusionSection = field(default_factory=DiffusionSection)
    optim: OptimSection = field(default_factory=OptimSection)
    checkpointing: CheckpointingSection = field(default_factory=CheckpointingSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    eval: EvalSection = field(default_factory=EvalSection)
    performance: PerformanceSection = field(default_factory=PerformanceSection)
    repa: RepaSection = field(default_factory=RepaSection)
    routing: RoutingSection = field(default_factory=RoutingSection)
    lora: LoraSection = field(default_factory=LoraSection)

    @classmethod
    def from_flat(cls, **values) -> TrainConfig:
        """From field names alone (the command line's options): TrainConfig.from_flat(lr=3e-4)."""
        unknown = sorted(set(values) - set(SECTION_OF))
        if unknown:
            raise TypeError(f"TrainConfig has no field {', '.join(unknown)}")
        by_section: dict[str, dict] = {}
        for name, value in values.items():
            by_section.setdefault(SECTION_OF[name], {})[name] = value
        return cls(**{s: SECTIONS[s](**kw) for s, kw in by_section.items()})

    @classmethod
    def from_record(cls, record: dict) -> TrainConfig:
        """From a run's recorded "train" (config.json, a checkpoint, an EMA export): by section,
        or flat as runs recorded it before the sections. Fields the record lacks (knobs added
        later) take their defaults; names this version does not know are ignored."""
        record = record or {}
        flat = {}
        for key, value in record.items():
            if key in SECTIONS and isinstance(value, dict):
                flat.update(value)
            else:
                flat[key] = value
        # a field that says how an older one reads: what its absence means (setting(absent=))
        flat = {**ABSENT, **flat}
        return cls.from_flat(**{k: v for k, v in flat.items() if k in SECTION_OF})

    def flat(self) -> dict:
        """Field name -> value over all sections (what the command line's defaults read)."""
        return {name: getattr(getattr(self, section), name) for name, section in SECTION_OF.items()}


def recorded(config: dict | None, name: str, default=None):
    """One knob of a run's recorded config (config.json, a checkpoint, an EMA export, an ONNX
    file's metadata): config["train"] by section, or flat as runs recorded it before the
    sections; `default` where the record has none (weights without a run config); a record that
    predates a field with setting(absent=) has that (route_convention: half-open)."""
    train = (config or {}).get("train") or {}
    section = train.get(SECTION_OF.get(name, ""))
    if isinstance(section, dict) and name in section:
        return section[name]
    if train and name in ABSENT and name not in train:  # a run recorded before the field: what that means
        return ABSENT[name]
    value = train.get(name, default)
    return default if isinstance(value, dict) else value
