"""What a run is before it trains: the process group, the device and precision, the store
and the configs it implies (`setup`), with nothing written anywhere.

    run = setup(cfg)        a Run: settings, rank / world, device, autocast dtype, store,
                            DiT config, diffusion, the resolved config, the per-rank batch

The resolved config (dittrain.config's docstring) is what config.json and every checkpoint
hold. dittrain.train.loop builds the run's state from a Run and trains it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ditdata.common import dist
from ditdata.common.devices import amp_dtype, resolve_device
from ditdata.common.errors import UserError
from ditdata.store import Store, open_store
from dittrain.config import TrainConfig, latent_sources
from dittrain.data.latent_norm import choose, latent_record
from dittrain.data.mixture import check_stores, mixture_record, pooled_latent_record
from dittrain.diffusion import SHIFT_BASE_DIMS, Diffusion, DiffusionConfig, dimension_shift
from dittrain.model.routing import check as check_route
from dittrain.model.routing import route_of
from dittrain.model.sizes import NAMED_FIELDS, DiTConfig, get_config
from dittrain.train.captionmix import resolve as resolve_caption_mix
from dittrain.train.checkpoint import CheckpointWriter
from dittrain.train.loggers import parse_loggers
from dittrain.train.losses import feature_set
from dittrain.train.losses import on as loss_terms
from dittrain.train.resume import Resumption
from dittrain.train.resume import load as load_record
from dittrain.train.step import compile_model, compile_target


class TrainError(UserError):
    """A run cannot start or continue; the message says why and what to do."""


def training_device(name: str) -> torch.device:
    """--device as ditdata.common.devices reads it (auto: cuda:LOCAL_RANK when there is a
    GPU, else cpu; DeviceError for an unknown name or CUDA without a GPU), cpu or cuda only."""
    device = resolve_device(name)
    if device.type not in ("cpu", "cuda"):
        raise TrainError(f"--device {name}: dittrain trains on cpu or cuda")
    return device


def model_config_for(cfg: TrainConfig, store: Store, recorded: dict | None = None) -> DiTConfig:
    """The DiT config a store implies: in_channels, input size, classes and text dims come
    from the store (its latent shape and conditioning); the architecture from the named size,
    with --qk-norm / --no-qk-norm over the name's QK-norm, or, for a resume, `recorded`: the
    run record's resolved model, whose architecture (NAMED_FIELDS) is what the weights were
    made for, whatever the name means today (the LightningDiT presets were pos=rope with QK-norm
    until they matched the reference: such a run resumes as that).
    A bucketed store's input size is its top manifest's bucket (the square one, else the most
    populated; a non-square one gives the square of its shorter side): the grid of the model's
    pos_embed; every bucket's grid is computed (dittrain.model.dit), so each must divide by the patch."""
    c, h, w = store.latent_shape
    if h != w and not store.buckets:
        raise TrainError(f"latents are {h}x{w}; DiT here needs square latents (or a bucketed store: "
                         "ditdata encode --buckets)")
    h = min(h, w)  # a bucketed store's non-square top bucket: the square of its shorter side
    cond = store.conditioning  # num_classes is 0 and the text dims None unless the store has them
    learn_sigma = cfg.model.learn_sigma if cfg.model.learn_sigma is not None else cfg.diffusion.objective == "ddpm"
    # --grad-checkpointing 2 is recorded as the int 2 (the model config is compared on resume)
    granularity = cfg.performance.grad_checkpointing
    granularity = int(granularity) if str(granularity).isdigit() else granularity
    if recorded is not None:  # a resume: the architecture it was trained with
        arch = {k: recorded[k] for k in NAMED_FIELDS if k in recorded}
    else:  # --qk-norm / --no-qk-norm over the name's; neither (None): the name's own
        arch = {} if cfg.model.qk_norm is None else {"qk_norm": bool(cfg.model.qk_norm)}
    try:
        return get_config(
            cfg.model.model, input_size=h, in_channels=c, num_classes=cond.num_classes,
            class_dropout_prob=cfg.diffusion.class_dropout, learn_sigma=learn_sigma, **arch,
            text_pooled_dim=cond.pooled_dim,
            text_token_dim=cond.tokens_shape[-1] if cond.tokens_shape else None,
            grad_checkpointing=granularity,
        )
    except KeyError as e:
        raise TrainError(f"unknown model {cfg.model.model!r}; see `dittrain models`, or name a size "
                         "custom:hidden=H,depth=D,heads=N,patch=P") from e
    except AssertionError as e:
        raise TrainError(f"{cfg.model.model} does not fit latents {c}x{h}x{w}: {e}") from e


def recorded_model(cfg: TrainConfig) -> dict | None:
    """The resolved model of the run's record (config.json) when this start is a resume of a
    recorded run, else None."""
    if not (cfg.checkpointing.resume and cfg.checkpointing.out):
        return None
    record = load_record(cfg.checkpointing.out)  # RecordError (one line) for an unreadable one
    model = (record or {}).get("model")
    return model if isinstance(model, dict) else None


def check_buckets(cfg: TrainConfig, store: Store, model_cfg: DiTConfig) -> list[dict] | None:
    """A bucketed store's buckets as the run config records them (None for a plain store);
    TrainError (one line) for a bucket whose latent grid the patch does not divide."""
    if not store.buckets:
        return None
    p = model_cfg.patch_size
    bad = [b.name for b in store.buckets if b.latent_shape[1] % p or b.latent_shape[2] % p]
    if bad:
        raise TrainError(f"{cfg.model.model} has patch {p}, which does not divide the latents of bucket(s) "
                         f"{', '.join(bad)}; choose a model with patch {p // 2 or 1}, or re-encode with a --buckets STEP "
                         f"that is a multiple of the autoencoder's factor x {p}")
    return [{"name": b.name, "size": list(b.size), "latent_shape": list(b.latent_shape),
             "num_samples": b.num_samples} for b in store.buckets]



def check_lora(cfg: TrainConfig, model_cfg: DiTConfig) -> None:
    """--lora: a one-line TrainError (or LoraError) for a run without --init-from (an adapter on random
    weights adapts nothing), without peft, or for a rank or targets that do not fit the model (checked on
    a meta-device DiT: nothing is allocated)."""
    from dittrain.model import lora

    settings = lora.settings_of(cfg.lora)
    if settings is None:
        if cfg.lora.lora < 0:
            lora.check(lora.LoraSettings(cfg.lora.lora))
        return
    lora.check(settings)
    if not cfg.model.init_from:
        raise TrainError(f"--lora {settings.rank} needs --init-from WEIGHTS: the pretrained model the adapter "
                         "fine-tunes (frozen)")
    lora.import_peft()  # the train extra's: missing, one line before anything is built
    from dittrain.model.dit import DiT

    with torch.device("meta"):
        model = DiT(model_cfg)
    lora.check_rank(model, settings, lora.target_names(model, settings.targets))


def text_token_count(store: Store) -> int:
    """Caption tokens per sample the model cross-attends to (0 for a store without them)."""
    shape = store.conditioning.tokens_shape
    return shape[0] if shape else 0


@dataclass
class Run:
    """What a run is, besides its state: the settings, where it runs, its data and its loss."""

    cfg: TrainConfig
    rank: int
    world: int
    device: torch.device
    amp_dtype: torch.dtype | None  # autocast dtype; None: fp32
    store: Store
    model_cfg: DiTConfig
    diffusion: Diffusion
    resolved: dict  # the config saved in config.json and every checkpoint (dittrain.config)
    per_rank: int  # the micro-batch of one rank
    created_group: bool = False  # this process joined the process group (and so leaves it)
    evaluator: object | None = None  # --eval-every: the FID evaluator (every rank shares the work)
    saver: CheckpointWriter | None = None  # --async-save, rank 0: the background writer (made by the first save)
    resumption: Resumption | None = None  # a resume of a recorded run: what it changes (dittrain.train.resume)
    latent_norm: str = ""  # the startup line's words for the latent normalisation (dittrain.data.latent_norm.choose)
    t_shift: str = ""  # the startup line's words for --t-shift auto (resolve_t_shift); "" when given
    watch: dict | None = None  # what the EMA grids show: {"labels": [...]} or {"text": {...}} (log.watched)
    stores: list | None = None  # several --latents: every store, `store` first (dittrain.data.mixture); else None
    repeats: list | None = None  # and each one's repeats per epoch
    validation: object | None = None  # --val-fraction / --val-latents: dittrain.train.validation.Validation
    lora_names: list | None = None  # --lora: the linears its adapter is on (dittrain.model.lora.inject)
    caption_mix: object | None = None  # --caption-mix: dittrain.train.captionmix.CaptionMix, else None

    @property
    def master(self) -> bool:
        return self.rank == 0

    @property
    def out(self) -> Path:
        return Path(self.cfg.checkpointing.out)


def setup(cfg: TrainConfig) -> Run:
    """Join the process group, choose the device and precision, open the store and resolve
    the config it implies. Nothing is written anywhere."""
    env = dist.launch_env()
    rank, world = env.rank, env.world_size
    device = training_device(cfg.performance.device)
    created_group = dist.join(device)  # several ranks (torchrun) and no group yet: nccl on CUDA, else gloo
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if cfg.performance.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    # the store with the feature set a loss term reads (--repa; a missing or stale set is a one-line StoreError)
    sources = mixed_sources(cfg)
    store = open_store(sources[0][0] if sources else cfg.data.latents, cache_dir=cfg.data.cache_dir or None,
                       cache_limit=cfg.data.cache_limit, features=feature_set(cfg))
    # several --latents: the first store is the run's (its autoencoder, conditioning and shape; the one sampling
    # opens), the others must match it (dittrain.data.mixture.check_stores: one line naming the one that differs)
    stores = [store] + [open_store(path, cache_dir=cfg.data.cache_dir or None, cache_limit=cfg.data.cache_limit)
                        for path, _ in sources[1:]]
    if sources:
        check_stores(stores, [path for path, _ in sources])
    model_cfg = model_config_for(cfg, store, recorded_model(cfg))
    buckets = check_buckets(cfg, store, model_cfg)
    # --latent-norm auto becomes what it picks for this store, in the record too: a resume and
    # sampling see none or channel (dittrain.data.latent_norm)
    cfg.data.latent_norm, latent_words = choose(store, cfg.data.latent_norm)
    # the loss terms' checks (one-line errors) and what the record keeps for each, beside the
    # store's identity (--repa: its feature set's, so a resume refuses another set)
    terms = {}
    for term in loss_terms(cfg):
        terms |= term.record(cfg, store, model_cfg)
    check_route(route_of(cfg.routing), model_cfg.depth, cfg.model.model)  # RouteError: one line
    check_lora(cfg, model_cfg)  # --lora: its rank and targets on this model, before anything is built
    shift_words = resolve_t_shift(cfg, store)
    diff_cfg, latents = diffusion_config(cfg, model_cfg, store)
    if sources and latents["norm"] == "channel":  # the stats of all the mixed stores' latents together
        latents = pooled_latent_record(stores, cfg.data.latent_norm)
    resolved = {
        "train": asdict(cfg),
        "model": asdict(model_cfg),
        "diffusion": asdict(diff_cfg),
        "latents": latents,
        "store": {"path": store.location, "identity": store.identity,
                  "num_samples": len(store)},
    }
    resolved["store"] |= terms
    # --caption-mix: the caption sets each sample's text is drawn from, held by every store read (one line if not)
    caption_mix = resolve_caption_mix(cfg, store, stores[1:])
    if caption_mix is not None:
        resolved["store"]["caption_mix"] = caption_mix.record
    if buckets is not None:  # the sizes `dittrain sample --size` and serve offer
        resolved["store"]["buckets"] = buckets
    if sources:  # the mixed stores, their identities (a resume refuses others) and repeats
        resolved["store"]["mixture"] = mixture_record(stores, [r or 1.0 for _, r in sources])
    per_rank, rem = divmod(cfg.optim.batch_size, world * cfg.optim.accumulation_steps)
    if rem or per_rank == 0:
        raise TrainError(f"--batch-size {cfg.optim.batch_size} must be a multiple of ranks ({world}) x "
                         f"--accumulation-steps ({cfg.optim.accumulation_steps})")
    parse_loggers(cfg.logging.logger)  # an unknown --logger, or wandb without its extra, stops the run before it starts
    compile_target(cfg.performance.compile, device)
    compile_model(None, "off", cfg.performance.compile_mode)  # validates the mode before anything is written
    # auto: bf16 on GPUs that have it, else fp16 (with a grad scaler); fp32 on the CPU
    return Run(cfg, rank, world, device, amp_dtype(device, cfg.performance.amp), store, model_cfg,
               Diffusion(diff_cfg), resolved, per_rank, created_group, latent_norm=latent_words, t_shift=shift_words,
               stores=stores if sources else None, repeats=[r or 1.0 for _, r in sources] or None,
               caption_mix=caption_mix)


def mixed_sources(cfg: TrainConfig) -> list[tuple[str, float | None]]:
    """[(path, repeats)] of several --latents (dittrain.config.latent_sources), [] for one store (opened as
    given, as before mixtures); TrainError (one line) for a bad repeats, or a setting that reads one store."""
    if isinstance(cfg.data.latents, str):  # one store, opened as given; "STORE:R" alone names no store
        spec = cfg.data.latents
        try:
            alone = "://" not in spec and not Path(spec).exists() and latent_sources(spec)[0][1] is not None
        except (ValueError, IndexError):
            alone = False
        if alone:
            raise TrainError(f"--latents {spec}: repeats (:R) mean something between several stores only; "
                             "give the one store without them")
        return []
    try:
        sources = latent_sources(cfg.data.latents)
    except ValueError as e:
        raise TrainError(str(e)) from e
    if len(sources) < 2:
        raise TrainError(f"--latents {cfg.data.latents}: repeats (:R) mean something between several stores only; "
                         "give the one store without them")
    if feature_set(cfg):
        raise TrainError("--repa reads one store's feature set; it does not take several --latents yet")
    return sources


def resolve_t_shift(cfg: TrainConfig, store: Store) -> str:
    """--t-shift auto becomes RAE's S = sqrt(C H W / 4096) of the store's latent, in the record too (a resume
    and sampling see the number); the startup line's words for it ("" when the shift was given)."""
    if cfg.diffusion.t_shift != "auto":
        return ""
    if cfg.diffusion.objective != "flow":
        raise TrainError("--t-shift auto is a flow option (ddpm draws integer steps uniformly): add --objective flow")
    shape = tuple(store.latent_shape)
    cfg.diffusion.t_shift = dimension_shift(shape)
    return (f"--t-shift auto: sqrt({' x '.join(map(str, shape))} / {SHIFT_BASE_DIMS}) = {cfg.diffusion.t_shift:.4f} "
            "(RAE's dimension-dependent shift), recorded")


def diffusion_config(cfg: TrainConfig, model_cfg: DiTConfig, store: Store) -> tuple[DiffusionConfig, dict]:
    """The objective with its loss and timestep options, and the run config's "latents"
    section (dittrain.data.latent_norm: the store's per-channel stats with --latent-norm channel)."""
    try:  # DiffusionConfig refuses options of the other objective (min-snr on flow, a t-shift on ddpm)
        diff_cfg = DiffusionConfig(
            objective=cfg.diffusion.objective, learn_sigma=model_cfg.learn_sigma, loss_weighting=cfg.diffusion.loss_weighting,
            min_snr_gamma=cfg.diffusion.min_snr_gamma, logit_normal_mean=cfg.diffusion.t_mean, logit_normal_std=cfg.diffusion.t_std,
            t_sampling=cfg.diffusion.t_sampling, t_shift=cfg.diffusion.t_shift,
            flow_time_scale=cfg.diffusion.flow_time_scale)
    except ValueError as e:  # a plain ValueError: as a one-line user error
        raise TrainError(str(e)) from e
    return diff_cfg, latent_record(store, cfg.data.latent_norm)  # LatentNormError: a user error already


__all__ = ["Run", "TrainError", "check_buckets", "check_lora", "diffusion_config", "mixed_sources", "model_config_for", "recorded_model", "setup",
           "text_token_count", "training_device"]
