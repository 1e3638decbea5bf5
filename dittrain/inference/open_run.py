"""Open a run: its weights, its config, its latent store and the store's autoencoder and
text encoder, with the errors of what uses them. `dittrain sample` (and --npz), `eval`,
`serve`, `export` and the ONNX engine open runs here and nowhere else.

    weights, config, store, note = load_for_sampling(RUN)       --ckpt [--latents --vae --model]
    model = load_model(weights, config, "cuda")                 the DiT, eval mode, float32
    ae = load_autoencoder(store, "cuda")                        latents -> pixels
    engine = TorchEngine(RUN); config, store, note = engine.open(); net = engine.network(dev)

The store a run recorded, or another one. A run records its store's path and identity
(the digest of its manifest). Opening uses the recorded path unless --latents names
another. A store with a different identity (re-encoded, appended to, copied and edited)
is accepted when it is COMPATIBLE with the model: the same latent shape and the
conditioning the model needs (the same number of classes; text embeddings of the same
widths). Then a note says so and its autoencoder and encoders are used. An incompatible
store is refused. Decoding needs only the latent space to be the same; the identity check
cannot prove that (two autoencoders may share a shape), which is why it is a note.

Weights without a run (a plain state dict such as facebookresearch/DiT's
DiT-XL-2-256x256.pt): the run config is inferred from the shapes (dittrain.inference.weights) and,
having no store, they need --vae (a dittrain.inference.weights.StandInStore) or --latents.

An engine is what draws a plan's network calls: TorchEngine here (the PyTorch DiT of
--ckpt), dittrain.inference.onnx.OnnxEngine (an exported file through onnxruntime). The command picks
one (`dittrain sample --engine`) and hands it to the sampler: open(device) -> (config,
store, note), network(device) -> the DiT-shaped callable, describe() -> a line or None,
record() -> what samples.json says of it, and its ckpt and vae.

Errors: SampleError (sampling, serving) and ExportError (dittrain.inference.export, dittrain.inference.onnx),
both UserErrors: one line, no traceback.

Public API:
    SampleError, ExportError, sampling_device, sampling_amp, model_config, diffusion_config,
    conditioning_kind, store_mismatches, check_store, open_run_store, run_store,
    load_for_sampling, load_model, class_names, load_autoencoder, load_text_encoder, TorchEngine.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import torch

from ditdata.common.devices import PRECISIONS, DeviceError, amp_dtype, resolve_device
from ditdata.common.errors import UserError, one_line
from ditdata.store import TEXT_FIELDS
from dittrain.config import recorded
from dittrain.diffusion import DiffusionConfig
from dittrain.inference.weights import (
    StandInStore,
    describe,
    infer_run_config,
    read_weights,
    stand_in_store,
    strip_prefixes,
)
from dittrain.model.dit import DiT
from dittrain.model.sizes import DiTConfig

TEXT_POOLED, TEXT_TOKENS, TEXT_MASK = TEXT_FIELDS


class SampleError(UserError):
    """A problem the user can fix (missing store, bad class, ...): one line, no traceback."""


class ExportError(UserError):
    """An export that cannot be made as asked: one line, nothing written."""


# -----------------------------------------------------------------------------
# Device and precision, in sampling's words


def check_new_output(path: Path, flag: str, error: type[UserError], *, overwrite: bool, hint: str = "") -> None:
    """An output of sampling or an export: never inside a latent store, and not there yet
    unless overwrite (flag: the option that named it; hint: what else to do)."""
    from ditdata.store import refuse_inside_store

    refuse_inside_store(path, flag, error)
    if path.exists() and not overwrite:
        raise error(f"{flag} {path} exists already; pass --overwrite to replace it{hint}")


def sampling_memory_hint(plan):
    """Out of GPU memory while sampling `plan` (a dittrain.inference.sample.SamplePlan): one line that
    names the model, batch and precision and what lowers memory (ditdata.common.memory)."""
    from ditdata.common.memory import halved, out_of_memory_hint

    b = plan.settings.batch_size
    batch = f"--batch-size {b}" + (f" ({2 * b} a forward with guidance)" if plan.guide else "")
    hints = [halved("--batch-size", b), "--precision bf16" if plan.amp is None and plan.device.type == "cuda" else None]
    return out_of_memory_hint(what=f"sampling {plan.name}", batch=batch, precision=plan.amp, hints=hints,
                              device=plan.device)


def sampling_device(device: str | torch.device | None = "auto") -> torch.device:
    """ditdata.common.devices.resolve_device (auto -> cuda when available, else cpu), with an
    unusable device as a SampleError in sampling's words."""
    try:
        return resolve_device(device)
    except DeviceError:
        pass
    try:
        torch.device(device)  # parses: then the trouble is CUDA
    except (RuntimeError, ValueError):
        raise SampleError(f"bad device {device!r}: use auto, cpu, cuda or cuda:N") from None
    raise SampleError(f"device {device!r} requested but CUDA is not available (use --device cpu)")


def sampling_amp(device: torch.device, precision: str) -> torch.dtype | None:
    """The model's autocast dtype (None: fp32); sampling's auto never picks fp16."""
    try:
        return amp_dtype(device, precision, without_bf16="fp32")
    except DeviceError:
        raise SampleError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}") from None


# -----------------------------------------------------------------------------
# The run's config and its store


def _known(cls, d: dict) -> dict:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names}


def model_config(config: dict) -> DiTConfig:
    """The DiTConfig of a resolved run config (keys this version does not know are ignored)."""
    if "model" not in config:
        raise SampleError("the run config has no 'model' section; not a dittrain run")
    return DiTConfig(**_known(DiTConfig, config["model"]))


def diffusion_config(config: dict) -> DiffusionConfig:
    return DiffusionConfig(**_known(DiffusionConfig, config.get("diffusion") or {}))


def conditioning_kind(cfg: DiTConfig) -> str:
    if cfg.num_classes:
        return "class"
    if cfg.text_pooled_dim or cfg.text_token_dim:
        return "text"
    return "none"


def store_mismatches(store, cfg: DiTConfig) -> list[str]:
    """Why `store` cannot serve a model of config `cfg` (empty when it can): the latent shape
    must be the model's input (a bucketed store's: its channels, every bucket's grid divisible
    by the patch) and the store must hold the conditioning the model takes."""
    problems = []
    want = (cfg.in_channels, cfg.input_size, cfg.input_size)
    if getattr(store, "buckets", ()):
        p = cfg.patch_size
        if store.latent_shape[0] != cfg.in_channels or any(b.latent_shape[1] % p or b.latent_shape[2] % p
                                                           for b in store.buckets):
            problems.append(f"its buckets' latents ({', '.join('x'.join(map(str, b.latent_shape)) for b in store.buckets)}) "
                            f"do not fit a model of {cfg.in_channels} channels and patch {p}")
    elif tuple(store.latent_shape) != want:
        problems.append(f"latents are {'x'.join(map(str, store.latent_shape))}, the model takes "
                        f"{'x'.join(map(str, want))}")
    cond = store.conditioning
    if cfg.num_classes:
        if cond.kind != "class":
            problems.append(f"the model is class-conditional ({cfg.num_classes} classes) but the "
                            f"store's conditioning is {cond.kind!r}")
        elif cond.num_classes not in (0, cfg.num_classes):  # 0: not recorded
            problems.append(f"the store has {cond.num_classes} classes, the model {cfg.num_classes}")
    tensors = store.schema.tensors
    for field, dim in ((TEXT_POOLED, cfg.text_pooled_dim), (TEXT_TOKENS, cfg.text_token_dim)):
        if not dim:
            continue
        spec = tensors.get(field) or store.schema.ragged.get(field)  # unpadded tokens: a ragged field
        if spec is None:
            problems.append(f"the model takes {field} (width {dim}) but the store has none")
        elif spec.shape[-1] != dim:
            problems.append(f"the store's {field} have width {spec.shape[-1]}, the model takes {dim}")
    return problems


def check_store(store, config: dict) -> str | None:
    """Raise SampleError when `store` cannot serve the run's model; return a note when it is
    compatible but not the store the run recorded (another identity); None when it is."""
    cfg = model_config(config)
    recorded = (config.get("store") or {}).get("identity")
    same = recorded is not None and store.identity == recorded
    problems = store_mismatches(store, cfg)
    if problems:
        what = "the run's own store, but" if same else "not the store this run was trained on, and"
        raise SampleError(f"{store.root}: {what} incompatible with its model: {'; '.join(problems)}")
    if same:
        return None
    why = (f"identity {store.identity[:19]}... != recorded {recorded[:19]}..." if recorded
           else "the run records no store identity")
    return (f"note: {store.root} is not the store this run was trained on ({why}); its latent shape and "
            "conditioning match the model, so its autoencoder and encoders are used")


def open_run_store(config: dict, latents: str | Path | None = None):
    """(store, note): the store at `latents`, else at the path the run recorded; checked
    with check_store. SampleError when it is missing, not a store, or incompatible."""
    from ditdata.store import StoreError, is_url, open_store

    path = latents if latents is not None else (config.get("store") or {}).get("path")
    if not path:
        raise SampleError("the run records no latent store; pass --latents STORE")
    remote = {}
    if is_url(str(path)):  # a store in object storage: through the cache the run trained with
        remote = {"cache_dir": recorded(config, "cache_dir") or None,
                  "cache_limit": recorded(config, "cache_limit") or None}
    elif latents is None and not Path(path).is_dir():
        raise SampleError(f"the run's latent store {path} is not there (moved or deleted?); "
                          "pass --latents STORE to say where it is now")
    try:
        store = open_store(str(path) if remote else path, **remote)
    except StoreError as e:
        if latents is not None:
            raise
        raise SampleError(one_line(e) + "; pass --latents STORE to use another copy") from e
    return store, check_store(store, config)


def run_store(config: dict, latents=None, vae: str | None = None, file=None):
    """(store, note): the run's store (or --latents), or, for weights that record none, a
    stand-in that decodes with --vae (dittrain.inference.weights.stand_in_store)."""
    if latents is not None or (config.get("store") or {}).get("path"):
        return open_run_store(config, latents)
    return stand_in_store(config, vae, file)


def load_for_sampling(ckpt, *, latents=None, vae: str | None = None,
                      model: str | None = None) -> tuple[dict, dict, object, str | None]:
    """(weights, run config, store, note) for sampling `ckpt` (a run directory, an EMA export,
    a checkpoint): the one place every sampling entry point (the command, --npz, eval, serve)
    turns --ckpt/--latents/--vae/--model into what it samples. A UserError on any problem.

    `ckpt` may also be a plain state dict (facebookresearch/DiT's DiT-XL-2-256x256.pt, or
    torch.save(model.state_dict())): its run config is inferred from the shapes (`model`: a
    name from `dittrain models` instead, dittrain.inference.weights), and, having no store, it needs
    `vae` (then the store is a dittrain.inference.weights.StandInStore) or `latents`."""
    source = read_weights(ckpt)
    if not source.plain:
        run_model = recorded(source.config, "model")
        if model is not None and model != run_model:
            raise SampleError(f"--model {model}: {ckpt} is a dittrain run of {run_model}; --model names the model "
                              "of a plain state dict")
        store, note = open_run_store(source.config, latents)
        return source.state, source.config, store, note
    config = infer_run_config(source.state, model, where=source.file)
    if latents is None:
        return (source.state, config, *stand_in_store(config, vae, source.file))
    store, _ = open_run_store(config, latents)  # checked: shape and conditioning fit the model
    return source.state, config, store, (f"note: {describe(config, source.file)}; {store.root}'s autoencoder "
                                         "and class names are used (its latents and conditioning fit)")


def load_model(weights: dict, config: dict, device="cpu") -> DiT:
    """The DiT of `config` with `weights` loaded strictly, in eval mode, float32, on `device`.
    Built on the meta device and filled by assignment, so no time goes into an init that the
    weights overwrite."""
    cfg = model_config(config)
    with torch.device("meta"):
        model = DiT(cfg)
    weights = strip_prefixes(weights)  # saved from a compiled or DDP-wrapped model
    try:
        model.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as e:
        raise SampleError(f"the weights do not fit the run's model config ({cfg.depth} blocks, "
                          f"hidden {cfg.hidden_size}): {one_line(e, 300)}") from e
    return model.to(device=sampling_device(device), dtype=torch.float32).eval().requires_grad_(False)


# -----------------------------------------------------------------------------
# What the store brings: class names, the autoencoder, the text encoder


def class_names(store) -> list[str] | None:
    cond = store.conditioning
    return list(cond.class_names) if cond.kind == "class" and cond.class_names else None


def load_autoencoder(store, device="cpu", vae: str | None = None):
    """The store's autoencoder (or the one at `vae`), with a one-line SampleError."""
    try:
        if isinstance(store, StandInStore):  # weights without a store: the --vae it was given
            return store.autoencoder(sampling_device(device), source=vae)
        from ditdata.autoencoders.kinds import store_autoencoder

        return store_autoencoder(store, sampling_device(device), source=vae)
    except Exception as e:  # DitdataError: the model is not on this machine, or differs
        msg = one_line(e)
        hint = "" if "--vae" in msg else " (pass --vae DIR to say where it is)"
        raise SampleError(f"cannot load the store's autoencoder: {msg}{hint}") from e


def load_text_encoder(store, device="cpu", pretrained: str | None = None, *, how: str = "pass"):
    """The store's text encoder (its weights at `pretrained`, if given), through the registry
    ditdata.textencoders (an open_clip tower, or the T5 / Gemma-2 encoder its manifest names,
    with its recorded max tokens and instruction), with a one-line SampleError whose hint
    begins with `how` (serve: "restart serve with")."""
    ragged = (store.conditioning.text or {}).get("layout") == "ragged"
    try:
        from ditdata.textencoders import store_text_encoder

        return store_text_encoder(store, device, pretrained=pretrained)
    except ImportError as e:
        raise SampleError(f"cannot embed prompts: the text encoder module is not available ({one_line(e)})") from e
    except Exception as e:  # DitdataError / StoreError: the model is not on this machine
        where = "FOLDER (the encoder saved with save_pretrained)" if ragged else "FILE_OR_TAG"
        raise SampleError(f"cannot load the store's text encoder: {one_line(e)} "
                          f"({how} --text-pretrained {where} to say where its weights are)") from e


# -----------------------------------------------------------------------------
# The PyTorch engine


class TorchEngine:
    """The PyTorch DiT of `ckpt` (load_for_sampling, then load_model on the plan's device):
    `dittrain sample --engine torch`, the default (module docstring: engines)."""

    def __init__(self, ckpt, *, latents=None, vae: str | None = None, model: str | None = None):
        self.ckpt, self.latents, self.vae, self.model = ckpt, latents, vae, model
        self.weights = self.config = None

    def open(self, device="auto") -> tuple[dict, object, str | None]:
        """(run config, store, note); the weights are kept for network()."""
        self.weights, self.config, store, note = load_for_sampling(self.ckpt, latents=self.latents, vae=self.vae,
                                                                   model=self.model)
        return self.config, store, note

    def network(self, device) -> DiT:
        return load_model(self.weights, self.config, device)

    def describe(self) -> str | None:
        return None

    def record(self) -> dict:
        return {}


__all__ = [
    "ExportError", "SampleError", "TorchEngine", "check_store", "class_names", "conditioning_kind",
    "diffusion_config", "load_autoencoder", "load_for_sampling", "load_model", "load_text_encoder", "model_config",
    "open_run_store", "run_store", "sampling_amp", "sampling_device", "store_mismatches",
]
