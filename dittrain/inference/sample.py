"""`dittrain sample`: a run's EMA weights + its latent store -> PNG samples and a grid.

    weights, config, store, note = load_for_sampling(RUN)    dittrain.inference.open_run: weights, config, store
    images = sample_images(weights, config, store, SampleConfig(cfg_scale=4.0), labels=[207] * 16)
    save_png(make_grid(images, nrow=4), "grid.png")

Everything the model needs besides its weights comes from the store: the autoencoder
that turns sampled latents into pixels (with the manifest's scaling and shift), the class
names, the text encoder that embeds prompts, and the empty-caption embedding that is the
unconditional input of classifier-free guidance for text models. Opening a run (its
weights, config and store, the store another one may replace, plain state dicts) is
dittrain.inference.open_run's.

Determinism: the initial noise of all samples is drawn first from one CPU generator seeded
with --seed, then the noise of the stochastic samplers (ddpm's ancestral steps, sde's
Euler-Maruyama steps) batch after batch from the same generator, and random class labels
from a separate generator with the same seed. So a seed gives the same images on every run
with the same --batch-size and device; the deterministic samplers (ddim, euler, heun) do not
depend on --batch-size either.

One pass checks and plans: plan_samples turns the run's config, its store and the user's
choices into a frozen SamplePlan (conditions per sample, layout, sampler, device, precision)
before any weights or encoders load (|--cfg| <= MAX_CFG_SCALE); run_plan draws it and
checks each batch's latents and decoded images are finite (NonFiniteSamples: NaN would be
written as black pixels, so nothing is written). sample_images (the API and the
trainer's grids) and sample_to_files (the command) both go through them. The command draws
with the engine it is given (dittrain.inference.open_run.TorchEngine, dittrain.inference.onnx.OnnxEngine).
--route-guidance (SampleConfig.route_guidance; dittrain.inference.route_guidance): the plan holds the
run's route, and run_plan hands the sampler TREAD's two routed passes in place of CFG's pair.

Public API:
    pick_labels, balanced_labels, class_mode, parse_classes, embed_prompts, check_sampler,
    check_guidance_times, SamplePlan,
    MAX_CFG_SCALE, NonFiniteSamples, check_finite, plan_samples, run_plan, sample_images, make_grid, save_png, output_paths, write_samples,
    sample_to_files (the command), write_training_grid (the trainer's EMA grids), store_text,
    run_sizes, default_size, choose_size (a bucketed run's sizes).
    Opening a run (its weights, store and autoencoder; SampleError) is dittrain.inference.open_run's.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ditdata.common import files as files_api
from ditdata.common.devices import autocast
from ditdata.store import TEXT_FIELDS
from dittrain.config import (
    CFG_EVERYWHERE,
    MAX_CFG_SCALE,
    ROUTE_GUIDANCE_CONDS,
    SampleConfig,
    parse_cfg_interval,
    recorded,
)
from dittrain.data.latent_norm import LatentNorm
from dittrain.diffusion import SAMPLER_TABLE, SAMPLERS, Diffusion, DiffusionConfig
from dittrain.inference import open_run, route_guidance
from dittrain.inference.open_run import SampleError
from dittrain.model.dit import DiT
from dittrain.model.routing import Route
from dittrain.model.sizes import DiTConfig

GRID_NAME = "grid.png"  # --out DIR: DIR/grid.png
SINGLES_DIR = "samples"  # --out DIR: DIR/samples/NNNN.png
INDEX_NAME = "samples.json"  # beside the singles: what each file is and how it was made
TEXT_POOLED, TEXT_TOKENS, TEXT_MASK = TEXT_FIELDS
_S = SampleConfig()  # the defaults of every sampling entry point


# -----------------------------------------------------------------------------
# A bucketed run's sizes: what `dittrain sample --size` and serve's size menu offer
#
# A run trained on a bucketed store (ditdata encode --buckets) records its buckets in its config
# (store.buckets: name "WxH" in pixels, size [W, H], latent_shape [C, h, w], num_samples) and
# samples at any of them; the default is the bucket whose latents are the model's square input,
# else the most populated one (the top manifest's choice). A run on a plain store samples at its
# one size, as ever: it has no sizes, and --size is refused.


def run_sizes(config: dict) -> list[dict]:
    """A bucketed run's buckets as its config records them ({"name": "WxH", "size": [W, H],
    "latent_shape": [C, h, w], "num_samples"}), sorted by name; [] for a run on a plain store."""
    return sorted((config.get("store") or {}).get("buckets") or [], key=lambda b: b["name"])


def default_size(config: dict, cfg: DiTConfig) -> str | None:
    """The bucket sampled without --size: the one of the model's square input, else the most
    populated (the top manifest's choice); None for a plain run."""
    buckets = run_sizes(config)
    if not buckets:
        return None
    square = [b for b in buckets if b["latent_shape"][1:] == [cfg.input_size, cfg.input_size]]
    return (square or sorted(buckets, key=lambda b: -b["num_samples"]))[0]["name"]


def choose_size(config: dict, cfg: DiTConfig, size: str | None) -> tuple[str | None, tuple[int, int]]:
    """(bucket name, latent (H, W)) to sample at: `size` ("WxH" px, e.g. "352x176"), or the
    default; (None, the model's square input) for a plain run without --size. SampleError (one
    line, listing the sizes) for a size that is not one of the run's buckets."""
    buckets = run_sizes(config)
    given = None if size is None else str(size).strip().lower().replace(" ", "")
    if given is not None and not buckets:
        raise SampleError(f"--size {size}: this run was trained on a store without aspect-ratio buckets, so it samples "
                          "at its own size only; leave out --size")
    name = given or default_size(config, cfg)
    if name is None:
        return None, (cfg.input_size, cfg.input_size)
    chosen = next((b for b in buckets if b["name"] == name), None)
    if chosen is None:
        raise SampleError(f"--size {size}: not a bucket of this run's store; choose one of "
                          f"{', '.join(b['name'] for b in buckets)} (WxH pixels)")
    _, h, w = chosen["latent_shape"]
    return chosen["name"], (h, w)



# -----------------------------------------------------------------------------
# Conditions


def parse_classes(values, num_classes: int, names: list[str] | None = None) -> list[int]:
    """--class values -> class indices. Each value is an index, a class name from the
    manifest, "all", or a comma-separated list of those. Order is kept; repeats allowed."""
    out: list[int] = []
    for value in values:
        for token in str(value).split(","):
            token = token.strip()
            if not token:
                continue
            if token.lower() == "all":
                out.extend(range(num_classes))
            elif re.fullmatch(r"[+-]?\d+", token):
                c = int(token)
                if not 0 <= c < num_classes:
                    raise SampleError(f"class {c} is out of range: the model has {num_classes} "
                                      f"classes (0..{num_classes - 1})")
                out.append(c)
            else:
                lowered = [n.lower() for n in names or []]
                if names and token in names:
                    out.append(names.index(token))
                elif token.lower() in lowered:
                    out.append(lowered.index(token.lower()))
                else:
                    known = f" or one of the class names ({', '.join(names[:10])}" \
                            f"{', ...' if len(names) > 10 else ''})" if names else ""
                    raise SampleError(f"unknown class {token!r}: not an index 0..{num_classes - 1}{known}")
    return out


def pick_labels(n: int, num_classes: int, seed: int = 0) -> list[int]:
    """n class labels drawn uniformly with their own generator seeded by `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, num_classes, (n,), generator=g).tolist()


CLASS_MODES = ("random", "balanced")  # --classes words that choose the labels of --n samples


def class_mode(values) -> str | None:
    """"random" or "balanced" when the --class values are that one word (any case), else None;
    SampleError when the word comes with other classes."""
    tokens = [t.strip().lower() for v in values for t in str(v).split(",") if t.strip()]
    modes = [t for t in tokens if t in CLASS_MODES]
    if not modes:
        return None
    if len(tokens) > 1:
        raise SampleError(f"--classes {modes[0]} chooses the classes itself: give it alone, not with other classes")
    return modes[0]


def balanced_labels(n: int, num_classes: int, seed: int = 0) -> list[int]:
    """n class labels, each class n // num_classes times and n % num_classes classes (drawn
    with the seed, so a small n is not biased towards the low indices) once more, in an order
    permuted with their own generator seeded by `seed`."""
    g = torch.Generator().manual_seed(seed)
    extra = torch.randperm(num_classes, generator=g)[: n % num_classes]
    labels = torch.cat([torch.arange(num_classes).repeat(n // num_classes), extra])
    return labels[torch.randperm(n, generator=g)].tolist()


def embed_prompts(store, prompts: list[str], *, tokens: bool, device="cpu", text_encoder=None,
                  pretrained: str | None = None) -> dict[str, torch.Tensor]:
    """Prompts -> {"text_pooled" (N, Dp)[, "text_tokens" (N, L, Dt), "text_mask" (N, L)]} with
    the store's text encoder, rounded to the store's storage dtype (what training saw)."""
    if text_encoder is None:
        text_encoder = open_run.load_text_encoder(store, device, pretrained)
    emb = text_encoder.embed_text(list(prompts), tokens=tokens)
    out = {}
    for k, v in emb.items():
        v = torch.as_tensor(v)
        if v.dtype != torch.bool:
            # the field as the store holds it (unpadded text tokens: a ragged field; int8: codes x scales)
            spec = store.schema.tensors.get(k) or store.schema.ragged.get(k)
            dt = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(spec.dtype) if spec else None
            if spec is not None and spec.dtype == "int8":
                from ditdata.store import dequantize, quantize

                v = torch.from_numpy(dequantize(*quantize(v.float().numpy(), axis=-1), axis=-1))
            v = v.float() if dt is None else v.to(dt).float()
        out[k] = v.cpu()
    return out


def empty_caption(store) -> dict[str, torch.Tensor]:
    """The manifest's empty-caption embedding (unbatched tensors), for guidance."""
    empty = {k: torch.from_numpy(np.array(v)) for k, v in store.conditioning.empty.items()}
    if not empty:
        raise SampleError(f"{store.root}: the manifest has no empty-caption embedding, which a "
                          "text model needs for classifier-free guidance")
    return {k: v if v.dtype == torch.bool else v.float() for k, v in empty.items()}


# -----------------------------------------------------------------------------
# Sampling


def check_guidance_times(config: DiffusionConfig, settings: SampleConfig) -> SampleConfig:
    """settings with cfg_interval checked as (LO, HI) floats and time_shift resolved (flow: the
    run's t_shift where None; ddpm: None), or SampleError: an interval outside 0..1, a shift
    that is not a finite number > 0, or a shift for a ddpm run."""
    try:
        interval = parse_cfg_interval(settings.cfg_interval)
    except ValueError as e:
        raise SampleError(f"--cfg-interval {e}") from None
    shift = settings.time_shift
    if config.objective != "flow":
        if shift is not None:
            raise SampleError(f"--time-shift {shift:g} shifts a flow run's time grid; this run is {config.objective} "
                              "(leave it out)")
    elif shift is None:
        shift = config.t_shift
    elif not 0 < shift < math.inf:  # NaN too
        raise SampleError(f"--time-shift must be a finite number > 0 (1: none), got {shift:g}")
    return replace(settings, cfg_interval=interval, time_shift=shift)


def check_sampler(config: DiffusionConfig, sampler: str | None, steps: int) -> str:
    """The sampler to use (default: the objective's), or SampleError if it or `steps` do not fit."""
    sampler = sampler or config.default_sampler
    if sampler not in SAMPLERS[config.objective]:
        raise SampleError(f"sampler {sampler!r} does not fit the {config.objective!r} objective; "
                          f"choose one of {', '.join(SAMPLERS[config.objective])}")
    if config.objective == "ddpm" and steps > config.num_timesteps:
        raise SampleError(f"steps must be in 1..{config.num_timesteps} for the ddpm objective, got {steps}")
    method = SAMPLER_TABLE[sampler]
    least = method.min_steps  # a respaced posterior chain needs 2 steps
    if steps < least:
        raise SampleError(f"the {sampler} sampler needs at least {least} steps, got {steps}")
    most = method.max_steps(config)  # a scheduler's linspace grid on ddpm: T - 1
    if most is not None and steps > most:
        raise SampleError(f"the {sampler} sampler takes at most {most} steps on this {config.objective} schedule, "
                          f"got {steps}")
    if method.needs and importlib.util.find_spec(method.needs) is None:  # before any work
        raise SampleError(f"the {sampler} sampler runs {method.needs}' {method.update.__name__}: pip install {method.needs} "
                          "(it comes with ditkit's vae, data and export extras)")
    return sampler


class NonFiniteSamples(SampleError):
    """Sampling gave NaN or inf (`stage`: "latents" or "images") for `samples` (indices in
    `plan`): nothing of the call is kept. describe() words it for a caller (--npz: a chunk)."""

    def __init__(self, plan: SamplePlan, stage: str, samples: list[int]):
        self.plan, self.stage, self.samples = plan, stage, samples
        super().__init__(self.describe())

    def describe(self, *, offset: int = 0, seed: str | None = None, after: str = "nothing was written") -> str:
        p, s, first = self.plan, self.plan.settings, self.samples[0]
        which = f"sample {first + offset}" if len(self.samples) == 1 else \
            f"{len(self.samples)} samples (the first: {first + offset})"
        if p.labels is not None:
            which += f", class {p.labels[first]}"
        elif p.prompts is not None:
            text = p.prompts[first]
            which += f", prompt {text if len(text) <= 40 else text[:37] + '...'!r}"
        guidance = f", cfg {s.cfg_scale:g}" if p.kind != "none" else ""
        return (f"sampling gave NaN/inf {'latents' if self.stage == 'latents' else 'decoded images'} for {which} "
                f"(seed {seed or s.seed}{guidance}, {s.steps} {s.sampler} steps); {after}: lower --cfg, sample "
                "with --precision fp32, or check that the weights are finite")


def check_finite(x: torch.Tensor, stage: str, plan: SamplePlan, start: int = 0) -> None:
    """NonFiniteSamples when a batch (N, ...) of `plan`'s samples from `start` holds NaN or inf."""
    bad = ~torch.isfinite(x.detach().flatten(1)).all(1)
    if bool(bad.any()):
        raise NonFiniteSamples(plan, stage, [start + int(i) for i in bad.nonzero().flatten()])


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(N, 3, H, W) float in [0, 1] -> (N, H, W, 3) uint8."""
    x = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).cpu().numpy()


# -----------------------------------------------------------------------------
# The plan: every check and choice of a sampling call, made once, before anything heavy


@dataclass(frozen=True, eq=False)
class SamplePlan:
    """What one sampling call draws, checked against the run's model, its store and the
    user's choices before weights, encoders or the autoencoder load. Built by plan_samples
    (the one place sampling validates), drawn by run_plan, written by sample_to_files."""

    model: DiTConfig
    diffusion: DiffusionConfig
    settings: SampleConfig  # as given, the sampler resolved (never None)
    device: torch.device
    amp: torch.dtype | None  # the model's autocast dtype; None: fp32
    name: str  # the run's model name (log, samples.json)
    kind: str  # the model's conditioning: class | text | none
    total: int  # samples in all
    labels: tuple[int, ...] | None = None  # class models: the class of each sample
    prompts: tuple[str, ...] | None = None  # text models given prompts: the prompt of each
    text: dict | None = None  # text models given embeddings: {field: (total, ...)}
    groups: tuple[int, ...] | None = None  # the singles' folder (class / prompt index); None: flat
    records: tuple[dict, ...] = ()  # what samples.json says of each sample
    nrow: int = 1
    rows_per_class: bool = False  # the layout: a grid row per class or prompt (else flat)
    latents: dict | None = None  # the run's "latents" record (dittrain.data.latent_norm): undone before decoding
    grid: tuple[int, int] = (0, 0)  # (H, W) of the sampled latents: the model's square, or a bucket's
    size: str | None = None  # a bucketed run: the bucket sampled ("WxH" px; dittrain.inference.sample)
    route: Route | None = None  # --route-guidance: the run's route its passes take (dittrain.inference.route_guidance)

    @property
    def guide(self) -> bool:
        """Classifier-free guidance applies: a conditional model and a scale other than 1."""
        return self.kind != "none" and self.settings.cfg_scale != 1.0

    def describe(self) -> str:
        s, many = self.settings, "s" if self.total > 1 else ""
        guidance = f", cfg {s.cfg_scale:g}" if self.kind != "none" else ""
        if self.route is not None:  # in place of classifier-free guidance
            guidance = ", " + route_guidance.describe(self.route, s.route_guidance, s.cfg_scale, s.route_guidance_cond)
        if guidance and s.cfg_channels:
            guidance += f" on the first {s.cfg_channels} channels"
        if guidance and tuple(s.cfg_interval) != CFG_EVERYWHERE:
            guidance += f" for t in [{s.cfg_interval[0]:g}, {s.cfg_interval[1]:g}]"
        shift = f", time shift {s.time_shift:g}" if s.time_shift not in (None, 1.0) else ""
        at = f" at {self.size} px" if self.size else ""
        return (f"sampling {self.total} image{many}{at} with {self.name} ({self.diffusion.objective}, {s.sampler}, "
                f"{s.steps} steps{shift}{guidance}) on {self.device}, seed {s.seed}")

    def record(self) -> dict:
        """How the samples were made, for samples.json."""
        s = self.settings
        guided = self.kind != "none"
        return {"model": self.name, "objective": self.diffusion.objective, "sampler": s.sampler,
                "steps": s.steps, "cfg_scale": s.cfg_scale if guided else None,
                "cfg_channels": s.cfg_channels or None,
                "cfg_interval": list(s.cfg_interval) if guided else None, "time_shift": s.time_shift, "seed": s.seed,
                "batch_size": s.batch_size, "layout": "row per class" if self.rows_per_class else "flat",
                **({"size": self.size} if self.size else {}),
                **({"route_guidance": {"rates": list(s.route_guidance), "scale": s.cfg_scale, "route": str(self.route),
                                       "route_convention": self.route.convention, "cond": s.route_guidance_cond}}
                   if self.route is not None else {})}


_IS = {"class": "class-conditional (use --class)", "text": "text-conditioned (use --prompt)",
       "none": "unconditional"}


def _check_choices(kind: str, settings: SampleConfig, *, classes, prompts, text, n, n_per_class, nrow) -> None:
    """The choices that need neither the store nor any model: counts, and conditions that fit."""
    if n is not None and n_per_class is not None:
        raise SampleError("give either --n (samples in all) or --n-per-class (one row per class), not both")
    for value, name in ((n, "--n"), (n_per_class, "--n-per-class"), (settings.batch_size, "--batch-size"),
                        (settings.steps, "--steps"), (nrow, "--nrow")):
        if value is not None and value < 1:
            raise SampleError(f"{name} must be at least 1, got {value}")
    if kind != "none" and not abs(settings.cfg_scale) <= MAX_CFG_SCALE:  # NaN too
        raise SampleError(f"--cfg {settings.cfg_scale:g} is out of range: the guidance scale must be in "
                          f"-{MAX_CFG_SCALE:g}..{MAX_CFG_SCALE:g} (1: no guidance; DiT samples with 1.5 to 4)")
    if kind != "class" and classes:
        raise SampleError(f"--class needs a class-conditional model; this one is {_IS[kind]}")
    if kind != "text" and (prompts or text is not None):
        raise SampleError(f"--prompt needs a text-conditioned model; this one is {_IS[kind]}")
    if kind == "text" and not prompts and text is None:
        raise SampleError("this model is text-conditioned: give at least one --prompt")
    if n_per_class is not None and kind == "class" and class_mode(classes):
        raise SampleError("--classes random/balanced chooses the classes of --n samples; not with --n-per-class")
    if kind == "none" and n_per_class is not None:
        raise SampleError("--n-per-class needs a class or text model; this one is unconditional (use --n)")


def _spread(choices: int, n: int, n_per_class: int | None) -> list[int]:
    """Indices into `choices` things, one per sample: each n_per_class times in turn (a row
    each), else cycled over n samples."""
    if n_per_class is not None:
        return [i for i in range(choices) for _ in range(n_per_class)]
    return [i % choices for i in range(n)]


def _text_inputs(text: dict, cfg: DiTConfig) -> dict[str, torch.Tensor]:
    """The text fields the model takes, from embeddings {field: (N, ...)}."""
    takes = {TEXT_POOLED: cfg.text_pooled_dim, TEXT_TOKENS: cfg.text_token_dim, TEXT_MASK: cfg.text_token_dim}
    keys = [k for k in TEXT_FIELDS if takes[k]]
    missing = [k for k in keys if text.get(k) is None]
    if missing:
        raise SampleError(f"the text embeddings lack {missing}, which this model takes")
    return {k: torch.as_tensor(text[k]) for k in keys}


def plan_samples(config: dict, store, settings: SampleConfig = _S, *, model: DiTConfig | None = None,
                 device="auto", classes=(), prompts=(), text: dict | None = None, n: int | None = None,
                 n_per_class: int | None = None, per_class_dir: bool = False,
                 nrow: int | None = None, size: str | None = None) -> SamplePlan:
    """Check a sampling call and decide all it draws; SampleError on the first problem.

    config: the run's resolved config (model: its DiTConfig, when the caller holds the DiT).
    classes (indices, names, "all", comma lists: parse_classes) or prompts are cycled over
    n samples (default settings.n; classes drawn with the seed when none are given), or
    n_per_class = K: K samples of each class (default: all) or prompt, a grid row each.
    text: a text model's embeddings {field: (N, ...)}, one sample each, instead of prompts.
    per_class_dir: the singles in a folder per class or prompt in the flat layout too.
    nrow: images per grid row (default: K in rows, else ceil(sqrt(samples))); size: a bucketed run's "WxH"."""
    cfg = model or open_run.model_config(config)
    bucket, grid = choose_size(config, cfg, size)
    diffusion, kind = open_run.diffusion_config(config), open_run.conditioning_kind(cfg)
    _check_choices(kind, settings, classes=classes, prompts=prompts, text=text, n=n, n_per_class=n_per_class,
                   nrow=nrow)
    settings = replace(check_guidance_times(diffusion, settings),
                       sampler=check_sampler(diffusion, settings.sampler, settings.steps))
    route = None
    if settings.route_guidance is not None:  # TREAD's guidance: the run's route, two rates
        settings = replace(settings, route_guidance=route_guidance.check_rates(settings.route_guidance))
        route = route_guidance.run_route(config)
        if settings.route_guidance_cond not in ROUTE_GUIDANCE_CONDS:
            raise SampleError(f"--route-guidance-cond {settings.route_guidance_cond!r}: one of "
                              f"{', '.join(ROUTE_GUIDANCE_CONDS)}")
        if not abs(settings.cfg_scale) <= MAX_CFG_SCALE:  # an unconditional model's too
            raise SampleError(f"--cfg {settings.cfg_scale:g} is out of range: the guidance scale must be in "
                              f"-{MAX_CFG_SCALE:g}..{MAX_CFG_SCALE:g} (TREAD's route guidance: 1.5)")
        if tuple(settings.cfg_interval) != tuple(CFG_EVERYWHERE):  # its passes replace CFG's, at every step
            raise SampleError("--cfg-interval applies to classifier-free guidance; --route-guidance guides at "
                              "every step: give one of them")
    dev = open_run.sampling_device(device)
    count = settings.n if n is None else n
    picks = labels = texts = None
    records: list[dict] = []
    if kind == "class":
        names = open_run.class_names(store)
        mode = class_mode(classes)
        chosen = [] if mode else parse_classes(classes, cfg.num_classes, names)
        # the class of each sample: the chosen ones laid out by _spread (all classes for rows when
        # none are chosen), else n drawn with the seed (mode "balanced": balanced_labels)
        if mode == "balanced":
            labels = balanced_labels(count, cfg.num_classes, settings.seed)
        elif n_per_class is None and not chosen:
            labels = pick_labels(count, cfg.num_classes, settings.seed)
        else:
            chosen = chosen or list(range(cfg.num_classes))
            labels = [chosen[i] for i in _spread(len(chosen), count, n_per_class)]
        picks = labels
        records = [{"class": c, "class_name": names[c] if names and c < len(names) else None} for c in labels]
    elif kind == "text" and text is not None:
        text = _text_inputs(text, cfg)
        count = len(next(iter(text.values())))
    elif kind == "text":
        picks = _spread(len(prompts), count, n_per_class)
        texts = [prompts[i] for i in picks]
        records = [{"prompt_index": i, "prompt": prompts[i]} for i in picks]
    total = len(picks) if picks is not None else count
    if total < 1:
        raise SampleError("nothing to sample: n must be at least 1")
    return SamplePlan(
        model=cfg, diffusion=diffusion, settings=settings, device=dev, amp=open_run.sampling_amp(dev, settings.precision),
        name=recorded(config, "model", "DiT"), kind=kind, total=total,
        labels=_tuple(labels), prompts=_tuple(texts), text=text,
        groups=_tuple(picks) if n_per_class is not None or per_class_dir else None,
        records=tuple(records) or tuple({} for _ in range(total)),
        nrow=nrow or n_per_class or _square(total), rows_per_class=n_per_class is not None,
        latents=config.get("latents"), grid=grid, size=bucket, route=route,
    )


def _tuple(values) -> tuple | None:
    return None if values is None else tuple(values)


def _square(n: int) -> int:
    """Images per row of an (about) square grid of n."""
    return math.ceil(math.sqrt(n))


def run_plan(model, plan: SamplePlan, store, *, autoencoder=None, text_encoder=None, vae: str | None = None,
             text_pretrained: str | None = None) -> np.ndarray:
    """Draw a plan with `model` (a DiT on plan.device; in eval mode for the call, then put back
    in its mode) and decode with the store's autoencoder (or `autoencoder`, or the one at
    `vae`): (N, H, W, 3) uint8. Prompts are embedded with `text_encoder` or the store's.
    NonFiniteSamples (a SampleError) when a batch's latents or images hold NaN or inf."""
    # the model's inputs for all samples and, for text models, the empty caption (guidance)
    empty = None
    if plan.kind == "class":
        cond = {"y": torch.tensor(plan.labels, dtype=torch.long)}
    elif plan.kind == "none":
        cond = {}
    else:
        cond = plan.text
        if cond is None:
            emb = embed_prompts(store, list(plan.prompts), tokens=bool(plan.model.text_token_dim), device=plan.device,
                                text_encoder=text_encoder, pretrained=text_pretrained)
            cond = _text_inputs(emb, plan.model)
        empty = empty_caption(store)
    s, dev = plan.settings, plan.device
    if plan.route is not None and not isinstance(model, DiT):
        raise SampleError("--route-guidance routes the PyTorch DiT's tokens: use --engine torch (an ONNX file has "
                          "no routes)")
    generator = torch.Generator().manual_seed(s.seed)
    noise = torch.randn((plan.total, plan.model.in_channels, *plan.grid), generator=generator)  # all first
    if autoencoder is None:
        autoencoder = open_run.load_autoencoder(store, dev, vae)
    diffusion = Diffusion(plan.diffusion)
    norm = LatentNorm(plan.latents)  # --latent-norm channel: back to the store's latents before decoding
    was_training = model.training
    model.eval()
    out = []
    try:
        for start in range(0, plan.total, s.batch_size):
            sl = slice(start, min(start + s.batch_size, plan.total))
            kwargs = {k: v[sl].to(dev) for k, v in cond.items()}
            uncond = model.unconditional_kwargs(kwargs, empty) if plan.guide else None
            net, scale = model, s.cfg_scale if plan.guide else 1.0
            if plan.route is not None:  # TREAD's two routed passes in place of CFG's pair (route_guidance)
                both = model.unconditional_kwargs(kwargs, empty) if s.route_guidance_cond == "null" else kwargs
                net = route_guidance.route_guided(model, plan.route, s.route_guidance, s.cfg_scale, both,
                                                  generator=generator, channels=s.cfg_channels or None)
                kwargs, uncond, scale = {}, None, 1.0
            with autocast(dev, plan.amp):
                z = diffusion.sample(
                    net, noise[sl].shape, steps=s.steps, sampler=s.sampler,
                    cfg_scale=scale, cfg_channels=s.cfg_channels or None,
                    cfg_interval=s.cfg_interval, time_shift=s.time_shift, model_kwargs=kwargs,
                    uncond_kwargs=uncond, generator=generator, device=dev, noise=noise[sl],
                )
            check_finite(z, "latents", plan, start)  # NaN would be black pixels, written as if fine
            with torch.no_grad():
                x = autoencoder.decode(norm.denormalize(z.float()))
            check_finite(x, "images", plan, start)
            out.append(to_uint8(x))
    finally:
        model.train(was_training)
    return np.concatenate(out)


def sample_images(
    weights,
    config: dict,
    store,
    settings: SampleConfig = _S,
    *,
    labels=None,
    prompts: list[str] | None = None,
    text: dict | None = None,
    device="auto",
    autoencoder=None,
    text_encoder=None,
    vae: str | None = None,
    text_pretrained: str | None = None,
) -> np.ndarray:
    """Sample with the run's model and decode with the store's autoencoder.

    weights: a state dict (e.g. from load_weights) or the DiT itself (the trainer's EMA
        model: used on its own device, put in eval mode for the call and restored).
    settings: cfg scale (1 = none; ignored for unconditional models), its channels and its
        interval, steps, sampler, time shift, seed, batch size and precision (SampleConfig);
        settings.n samples when there are no labels / prompts / text.
    labels: (N,) class indices for class models; None: settings.n labels drawn with the seed.
    prompts: N prompts for text models, embedded with the store's text encoder (or
        `text_encoder`); or `text`: their embeddings, {"text_pooled" (N, Dp), ...}.
    autoencoder: a loaded store autoencoder to reuse (the trainer's, between grids).
    Returns (N, H, W, 3) uint8 images."""
    module = weights if isinstance(weights, torch.nn.Module) else None
    if labels is not None:
        labels = torch.as_tensor(labels, dtype=torch.long).reshape(-1).tolist()
    given = labels if labels is not None else prompts  # exactly these: one sample each
    plan = plan_samples(config, store, settings, model=module.config if isinstance(module, DiT) else None,
                        device=device if module is None else next(module.parameters()).device,
                        classes=labels or (), prompts=prompts or (), text=text,
                        n=settings.n if given is None else len(given))
    model = module if module is not None else open_run.load_model(weights, config, plan.device)
    return run_plan(model, plan, store, autoencoder=autoencoder, text_encoder=text_encoder, vae=vae,
                    text_pretrained=text_pretrained)


# -----------------------------------------------------------------------------
# Grids and files


def make_grid(images, nrow: int = 8, padding: int = 2, pad_value: int = 0) -> np.ndarray:
    """(N, H, W, 3) uint8 (or a list of HxWx3) -> one (H', W', 3) uint8 image with `nrow`
    images per row (torchvision's make_grid layout: `padding` px around every tile)."""
    images = np.asarray(images)
    if images.ndim != 4 or images.shape[-1] != 3 or len(images) == 0:
        raise ValueError(f"expected images (N, H, W, 3) with N >= 1, got {images.shape}")
    n, h, w, _ = images.shape
    ncol = max(1, min(nrow, n))
    nrows = math.ceil(n / ncol)
    p = padding
    grid = np.full((nrows * (h + p) + p, ncol * (w + p) + p, 3), pad_value, dtype=np.uint8)
    for i, img in enumerate(images):
        r, c = divmod(i, ncol)
        grid[p + r * (h + p): p + r * (h + p) + h, p + c * (w + p): p + c * (w + p) + w] = img
    return grid


def save_png(image: np.ndarray, path) -> Path:
    """Write an (H, W, 3) uint8 array as a PNG, creating parent folders."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.ascontiguousarray(image)).save(path, format="PNG")
    return path


def output_paths(out) -> tuple[Path, Path]:
    """--out -> (grid path, folder of the singles):
    NAME.png -> (NAME.png, NAME/); DIR -> (DIR/grid.png, DIR/samples/)."""
    out = Path(out)
    suffix = out.suffix.lower()
    if suffix == ".png":
        return out, out.with_suffix("")
    if suffix in (".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff"):
        raise SampleError(f"--out {out}: samples are written as PNG; give NAME.png or a folder")
    if out.is_file():
        raise SampleError(f"--out {out} is an existing file; give NAME.png or a folder")
    return out / GRID_NAME, out / SINGLES_DIR


def check_output(out) -> None:
    """A bad --out fails before any work: a PNG name or a folder, never inside a store."""
    output_paths(out)
    from ditdata.store import refuse_inside_store

    refuse_inside_store(out, "--out", SampleError)


def write_samples(images: np.ndarray, out, *, nrow: int, groups: list[int] | None = None,
                  records: list[dict] | None = None, meta: dict | None = None,
                  grid_scale: int = 1) -> dict:
    """Write the grid and every sample as its own PNG (see output_paths); with `groups`
    (one class or prompt index per sample) the singles go to SINGLES/<group>/NNNN.png,
    numbered within the group, else SINGLES/NNNN.png. An index samples.json beside them
    lists each file with its record. grid_scale > 1 enlarges the grid (nearest neighbour,
    for tiny images); singles keep their size. Returns {"grid", "singles_dir", "files"}."""
    grid_path, singles = output_paths(out)
    files, counts = [], {}
    for i, img in enumerate(images):
        if groups is None:
            rel = f"{i:04d}.png"
        else:
            g = groups[i]
            rel = f"{g}/{counts.get(g, 0):04d}.png"
            counts[g] = counts.get(g, 0) + 1
        files.append(save_png(img, singles / rel))
    grid = make_grid(images, nrow=nrow)
    if grid_scale > 1:
        grid = grid.repeat(grid_scale, axis=0).repeat(grid_scale, axis=1)
    save_png(grid, grid_path)
    index = {
        **(meta or {}),
        "grid": str(grid_path),
        "grid_size": [int(grid.shape[1]), int(grid.shape[0])],
        "nrow": nrow,
        "samples": [{"file": p.relative_to(singles).as_posix(), **((records or [{}] * len(files))[i])}
                    for i, p in enumerate(files)],
    }
    files_api.write_text_atomic(singles / INDEX_NAME, json.dumps(index, indent=1, ensure_ascii=False) + "\n")
    return {"grid": grid_path, "grid_shape": grid.shape, "singles_dir": singles, "files": files}


_AUTOENCODERS: dict = {}  # (store root, device) -> autoencoder, reused between training grids


def kept_autoencoder(store, device: torch.device):
    """The store's autoencoder on `device`, loaded once and kept for the next call (the
    trainer's grids and evaluations: one store per run, so one is kept at a time)."""
    key = (str(Path(store.root).resolve()), str(device))
    if key not in _AUTOENCODERS:
        _AUTOENCODERS.clear()
        _AUTOENCODERS[key] = open_run.load_autoencoder(store, device)
    return _AUTOENCODERS[key]


def store_text(store, n: int) -> dict[str, torch.Tensor]:
    """The text embeddings of the store's first n samples (for grids without a text encoder)."""
    store = max(store.buckets, key=lambda b: b.num_samples).store if store.buckets else store  # its largest bucket
    if "text_tokens" in store.schema.ragged and store.shards:  # unpadded tokens: padded to the longest of them
        from ditdata.store import dequantize
        from ditdata.store.schema import pad_ragged

        names = ["text_tokens", *(["text_tokens_scale"] if "text_tokens_scale" in store.schema.ragged else [])]
        data = store.read(store.shards[0], fields=names, start=0, stop=n)
        flat = dequantize(data["text_tokens"], data.get("text_tokens_scale"), axis=-1)
        tokens, mask = pad_ragged(flat, data[store.schema.ragged["text_tokens"].length])
        return {"text_tokens": torch.from_numpy(tokens), TEXT_MASK: torch.from_numpy(mask)}
    fields_ = [f for f in TEXT_FIELDS if f in store.schema.tensors]
    if not fields_ or not store.shards:
        raise SampleError(f"{store.root}: the store holds no text embeddings")
    data = store.read(store.shards[0], fields=fields_, start=0, stop=n)
    return {k: torch.from_numpy(np.asarray(v, dtype=bool if k == TEXT_MASK else np.float32)) for k, v in data.items()}


def write_training_grid(model, config: dict, store, path, settings: SampleConfig = _S, *, device=None,
                        labels: list[int] | None = None, text: dict | None = None) -> Path:
    """The trainer's EMA sample grid: always the same conditions and noise (the seed's), so grids
    of successive steps differ only by training. Class models: `labels` (--sample-classes), else
    settings.n classes drawn with the seed; text models: `text`, embeddings {field: (N, ...)} of
    --sample-prompts, else those of the store's first settings.n captions (no text encoder
    needed); unconditional: settings.n samples. settings: SampleConfig (the trainer's: its
    --sample-steps, --sample-cfg and --seed). The store's autoencoder is loaded once per store
    and device (`device`, default the model's) and kept. Writes an (about) square PNG grid at
    `path` and returns it."""
    cfg = model.config if isinstance(model, DiT) else open_run.model_config(config)
    dev = next(model.parameters()).device if device is None else open_run.sampling_device(device)
    kind = open_run.conditioning_kind(cfg)
    n = settings.n
    if kind == "class" and labels is None:
        labels = pick_labels(n, cfg.num_classes, settings.seed)
    if kind == "text" and text is None:
        text = store_text(store, n)
    if kind == "class" or kind == "text":  # one sample per watched condition
        n = len(labels) if kind == "class" else len(next(iter(text.values())))
        settings = replace(settings, n=n)
    images = sample_images(model, config, store, settings, labels=labels if kind == "class" else None,
                           text=text if kind == "text" else None, autoencoder=kept_autoencoder(store, dev))
    return save_png(make_grid(images, nrow=_square(len(images))), path)


def sample_to_files(
    engine,
    out,
    *,
    classes=(),
    prompts=(),
    n: int | None = None,
    n_per_class: int | None = None,
    per_class_dir: bool = False,
    nrow: int | None = None,
    settings: SampleConfig = _S,
    device="auto",
    text_pretrained: str | None = None,
    grid_scale: int = 1,
    size: str | None = None,
    log=print,
) -> dict:
    """The `dittrain sample` command: open, plan, sample, write, report.

    engine: what draws the network calls, as the command chose it (--engine):
    dittrain.inference.open_run.TorchEngine (the PyTorch DiT of --ckpt, with --latents, --vae, --model)
    or dittrain.inference.onnx.OnnxEngine (an exported .onnx file through onnxruntime).
    Flat layout: n samples (default settings.n); classes / prompts are cycled over them
    (classes drawn at random with the seed when none are given); nrow = ceil(sqrt(n)).
    Row layout (n_per_class = K): one row of K samples per class (default: all classes)
    or per prompt, singles under SINGLES/<class or prompt index>/ (as per_class_dir).
    settings: cfg scale, steps, sampler, seed, batch size and precision (SampleConfig); size: plan_samples'."""
    check_output(out)
    config, store, note = engine.open(device)
    plan = plan_samples(config, store, settings, device=device, classes=classes, prompts=list(prompts), n=n,
                        n_per_class=n_per_class, per_class_dir=per_class_dir, nrow=nrow, size=size)
    if note:
        log(note)
    log(plan.describe())
    with open_run.sampling_memory_hint(plan):
        network = engine.network(plan.device)
        if engine.describe():
            log(engine.describe())
        images = run_plan(network, plan, store, vae=engine.vae, text_pretrained=text_pretrained)
    meta = {"ckpt": str(Path(engine.ckpt).resolve()) if engine.ckpt is not None else None,
            "store": str(store.root.resolve()), **engine.record(), **plan.record()}
    result = write_samples(images, out, nrow=plan.nrow, groups=plan.groups, records=plan.records, meta=meta,
                           grid_scale=grid_scale)
    # where the grid and the singles went
    h, w = result["grid_shape"][:2]
    cols = max(1, min(plan.nrow, plan.total))
    singles, first, last = result["singles_dir"], result["files"][0], result["files"][-1]
    log(f"grid:    {result['grid']}  ({math.ceil(plan.total / cols)} x {min(plan.nrow, plan.total)} samples, "
        f"{w}x{h} px)")
    log(f"singles: {len(result['files'])} PNGs of {images.shape[2]}x{images.shape[1]} px under {singles}/ "
        f"({first.relative_to(singles)} .. {last.relative_to(singles)}; index {INDEX_NAME})")
    return {**result, "images": images, "labels": _list(plan.labels), "prompts": _list(plan.prompts)}


def _list(values) -> list | None:
    return None if values is None else list(values)


__all__ = [
    "CLASS_MODES", "MAX_CFG_SCALE", "NonFiniteSamples", "SamplePlan", "balanced_labels", "check_finite",
    "check_guidance_times", "check_sampler", "choose_size", "class_mode", "default_size", "embed_prompts",
    "make_grid", "output_paths", "parse_classes", "run_sizes",
    "pick_labels", "plan_samples", "run_plan", "sample_images", "sample_to_files", "save_png", "store_text",
    "write_samples", "write_training_grid",
]
