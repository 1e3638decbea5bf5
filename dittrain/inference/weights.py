"""Weights from outside a run: plain state dicts such as facebookresearch/DiT's released
`DiT-XL-2-256x256.pt`, the model their shapes imply, and the two uses of such weights:
sampling them without a latent store, and starting a run from them (--init-from).

    source = read_weights("DiT-XL-2-256x256.pt")   Weights: state, config (None: plain), file, kind
    config = infer_run_config(source.state)        the run config the shapes imply (DiT-XL/2, ...)
    store, note = stand_in_store(config, "sd-vae-ft-ema", source.file)   a store's part in sampling
    record, notes = init_model(model, "runs/exp1")  a fresh model <- a run's EMA (or any source)
    state, config = load_weights(RUN)              a dittrain source's own (weights_file: which file)

What the shapes say (facebookresearch/DiT's key names, which our DiT keeps):

    x_embedder.proj.weight              (D, C, p, p)  hidden size D, latent channels C, patch p
    pos_embed                           (1, T, D)     input size sqrt(T) * p
    blocks.N.*                                        depth: the number of blocks N
    blocks.0.mlp.*                                    the MLP part: the first of dittrain.model.parts.MLPS
                                                      whose module at fc2's width H has these shapes
    blocks.0.mlp.fc1.weight             (r D, D)      MLP ratio r; (2H', D) with fc2 (D, H'): SwiGLU,
                                                      r D = ceil(3H' / 2) (its width rule, inverted)
    blocks.0.norm1.*                                  the norm part: the first of NORMS with these shapes
                                                      (weight: RMSNorm; DiT's LayerNorm has none)
    t_embedder.mlp.0.weight             (D, F)        F sinusoidal timestep features
    y_embedder.embedding_table.weight   (K + 1, D)    K classes and the null class (absent: 0)
    final_layer.linear.weight           (p p C', D)   C' = 2C: learned sigma; C' = C: not
    blocks.0.attn.q_norm.weight                       present: QK-norm
    text_pooled_embedder.mlp.0.weight   (D, Dp)       present: pooled text embeddings of width Dp
    text_token_embedder.mlp.0.weight    (D, Dt)       present: cross-attention to tokens of width Dt

--init-from also reads a diffusers PixArtTransformer2DModel folder (config.json and
diffusion_pytorch_model.safetensors, or its sharded .index.json; a PixArtAlphaPipeline or PixArtSigmaPipeline
folder: its transformer/): its config must be the run's model (--model PixArt-XL/2 or a custom spec with
adaln=single), its in_channels the store's latent channels and its caption_channels the width of the store's text
tokens, each refused in one line naming both sides; the names are mapped by dittrain.model.pixart.

A RoPE model (pos=rope) has no pos_embed, so its input size is not in the shapes: its plain
state dict is refused; its run, checkpoints and EMA exports record it. Whether q and k are rotated
is not in the shapes either: pos_embed says the position part has a table (sincos, or
LightningDiT's sincos+rope), and the named size (or --model) says which of those.
The attention heads are not in the shapes: they come from the named size (dittrain.model.dit's
CONFIGS) with the same hidden size and depth, or from `--model NAME`, which replaces the
inferred name and architecture (its hidden size, depth and patch must be the weights'). A size
outside the registry is named by its fields, `--model custom:hidden=D,depth=N,heads=H,patch=p`.
The diffusion is DiT's: ddpm, 1000 steps, linear betas 1e-4..0.02 (DiffusionConfig's
defaults); a plain file does not say its objective, so a flow model saved as one reads as ddpm.

Files are read with torch.load(weights_only=True), memory-mapped (a 2.7 GB XL/2 file costs
nothing until its tensors are used), never with arbitrary pickle. DiT's own training
checkpoints ({"model", "ema", "opt", "args"}) also hold an argparse.Namespace, which is
allowed and ignored.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ditdata.common.errors import one_line
from ditdata.common.files import sha256_file
from ditdata.store import Conditioning, Schema, TensorSpec
from dittrain.config import TrainConfig, recorded
from dittrain.diffusion import DiffusionConfig
from dittrain.model.dit import DiT
from dittrain.model.parts import MLPS, NORMS, POSITIONS
from dittrain.model.sizes import (
    BLOCK_FIELDS,
    CONFIGS,
    CUSTOM_SPEC,
    DiTConfig,
    ModelSpecError,
    architecture,
    custom_name,
)
from dittrain.rundir import EMA_EXPORT, INT8_FORMAT, CheckpointError, latest_checkpoint, load_checkpoint

WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile, DistributedDataParallel
LABEL_TABLE = "y_embedder.embedding_table.weight"
_BLOCK = re.compile(r"^blocks\.(\d+)\.")


class WeightsError(CheckpointError):
    """Weights that cannot be read, do not describe a DiT, or do not fit a model."""


# --------------------------------------------------------------------------- reading


def weights_file(path) -> Path:
    """The file the weights of `path` are read from: a run directory's ema.safetensors, else
    its latest checkpoint; any other path as it is."""
    path = Path(path)
    if not path.is_dir():
        return path
    if (path / EMA_EXPORT).is_file():
        return path / EMA_EXPORT
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path}: no {EMA_EXPORT} and no checkpoints/step_*.pt")
    return latest


def load_weights(path) -> tuple[dict, dict]:
    """(state_dict, run config) from an EMA export (.safetensors, fp32 or dittrain export's
    fp16), an int8 export (.pt, dittrain export), a checkpoint (.pt, its EMA weights) or a run
    directory (its ema.safetensors, else its latest checkpoint)."""
    path = weights_file(path)
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                state = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:
            raise CheckpointError(f"{path}: unreadable safetensors ({type(e).__name__}: {e})") from e
        if "dittrain_config" not in meta:
            raise CheckpointError(f"{path}: no dittrain_config in its metadata; not a dittrain export")
        return state, json.loads(meta["dittrain_config"])
    ckpt = load_checkpoint(path)
    if isinstance(ckpt, dict) and ckpt.get("format") == INT8_FORMAT:
        return ckpt["state_dict"], ckpt["config"]
    if "ema" not in ckpt or "config" not in ckpt:
        raise CheckpointError(f"{path}: not a dittrain checkpoint (no 'ema'/'config')")
    return ckpt["ema"], ckpt["config"]



@dataclass(frozen=True)
class Weights:
    """A model's weights and what came with them."""

    state: dict  # key -> tensor, the wrapper prefixes stripped
    config: dict | None  # the run config of a dittrain source; None: a plain state dict
    file: Path  # the file read
    kind: str  # "export" (.safetensors) | "checkpoint" (a run's .pt: its EMA) | "int8" | "plain"
    step: int | None = None  # a checkpoint's step

    @property
    def plain(self) -> bool:
        return self.config is None


def strip_prefixes(state: dict) -> dict:
    """`state` without the prefixes a compiled or DDP-wrapped model puts on every key."""
    stripped = True
    while stripped and state:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if all(k.startswith(prefix) for k in state):
                state = {k[len(prefix):]: v for k, v in state.items()}
                stripped = True
    return state


def full_weights(path, error: type[Exception], what: str) -> Weights:
    """read_weights, refusing an int8 export (its torchao tensors are for sampling only):
    `what` says what wanted the weights and where to take them from instead."""
    w = read_weights(path)
    if w.kind == "int8":
        raise error(f"{w.file} is an int8 export (for sampling only); {what}")
    return w


def read_weights(path) -> Weights:
    """The weights of a run directory (its ema.safetensors, else its latest checkpoint), an
    EMA export (fp32, or fp16 from `dittrain export`), an int8 export (torchao weight-only, from
    `dittrain export`), a dittrain checkpoint .pt (its EMA) or a plain state dict file: a dict
    of tensors, or one wrapped as {"ema": ..., "model": ...} (the EMA taken when present)."""
    file = weights_file(path)
    if file.suffix == ".safetensors":
        state, config = load_weights(file)
        return Weights(with_base(strip_prefixes(state), config, file), config, file, "export")
    with torch.serialization.safe_globals([argparse.Namespace]):  # DiT training checkpoints' "args"
        obj = load_checkpoint(file, mmap=True)
    if isinstance(obj, dict) and obj.get("format") == INT8_FORMAT:
        return Weights(strip_prefixes(obj["state_dict"]), obj["config"], file, "int8")
    if isinstance(obj, dict) and "ema" in obj and "config" in obj:
        return Weights(with_base(strip_prefixes(obj["ema"]), obj["config"], file), obj["config"], file, "checkpoint",
                       obj.get("step"))
    state = obj
    if isinstance(obj, dict):
        state = obj.get("ema", obj.get("model", obj))
    if not isinstance(state, dict) or not state or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise WeightsError(f"{file}: neither a dittrain checkpoint nor a state dict of tensors "
                           "(nor one under 'ema' or 'model')")
    return Weights(strip_prefixes(state), None, file, "plain")


def with_base(state: dict, config: dict, file) -> dict:
    """`state` as a plain DiT state dict: itself, unless it is a --lora run's adapter (its EMA export or a
    checkpoint's "ema": the adapter's tensors alone), which is applied to the run's frozen base and merged
    (adapted_model; dittrain.model.lora.merged_state: W + (alpha / r) B A, peft's delta). So every reader of
    a run (sample, serve, export, --init-from) takes a LoRA run as it takes any other."""
    from dittrain.model import lora

    if not lora.is_adapter(state):
        return state
    return lora.merged_state(adapted_model(state, config, file))


def adapted_model(state: dict, config: dict, file) -> DiT:
    """A --lora run's adapter `state` on its frozen base: the DiT of its run config, the base loaded from its
    "init" record (the --init-from weights, checked to be the same bytes), peft's LoRA layers put in and the
    adapter loaded; float32 on the CPU. WeightsError (one line) when the base is gone or has changed."""
    from dittrain.model import lora

    settings = lora.settings_of((config.get("train") or {}).get("lora") or {})
    init = config.get("init") or {}
    if settings is None or not init.get("from"):
        raise WeightsError(f"{file}: a LoRA adapter whose run config records no --lora or no base weights (init)")
    source = init["from"]
    if not Path(source).exists():
        raise WeightsError(f"{file} is a LoRA adapter of the base {source}, which is gone: put it back, or use the "
                           "weights `dittrain export --merge-lora` wrote from the run")
    known = set(DiTConfig.__dataclass_fields__)
    with torch.random.fork_rng(devices=[]):  # building and injecting draw random numbers: not the caller's
        model = DiT(DiTConfig(**{k: v for k, v in config["model"].items() if k in known}))
        record, _ = init_model(model, source)
        if record["sha256"] != init.get("sha256"):
            raise WeightsError(f"{file} is a LoRA adapter of {record['file']}, which has changed since the run "
                               "started (another sha256): the adapter was trained on the old one; restore it")
        lora.inject(model, settings)
    try:
        lora.load_adapter(model, state)
    except lora.LoraError as e:
        raise WeightsError(f"{file}: {e}") from None
    return model.eval()


# --------------------------------------------------------------------------- what the shapes imply


def _shape(state: dict, key: str) -> tuple[int, ...] | None:
    v = state.get(key)
    return None if v is None else tuple(v.shape)


def _architecture(state: dict, where) -> dict:
    """The DiTConfig fields the shapes tell (all but num_heads); see the module docstring."""
    needed = ("x_embedder.proj.weight", "t_embedder.mlp.0.weight", "blocks.0.mlp.fc1.weight",
              "blocks.0.mlp.fc2.weight", "final_layer.linear.weight")
    missing = [k for k in needed if k not in state]
    if missing:
        raise WeightsError(f"{where}: not a DiT state dict (no {missing[0]}); expected facebookresearch/DiT's "
                           "key names")
    if "pos_embed" not in state:
        raise WeightsError(f"{where}: a DiT state dict without pos_embed, a RoPE model (pos=rope), whose input size "
                           "its shapes do not tell: sample or export its run directory, checkpoint or EMA export "
                           "(they record it)")
    proj = _shape(state, "x_embedder.proj.weight")
    if len(proj) != 4 or proj[2] != proj[3]:
        raise WeightsError(f"{where}: x_embedder.proj.weight is {proj}, not (hidden, channels, p, p)")
    D, C, p, _ = proj
    T = _shape(state, "pos_embed")[1]
    grid = math.isqrt(T)
    if grid * grid != T:
        raise WeightsError(f"{where}: pos_embed has {T} tokens, not a square grid")
    out = _shape(state, "final_layer.linear.weight")[0]
    if out not in (p * p * C, 2 * p * p * C):
        raise WeightsError(f"{where}: final_layer.linear has {out} outputs; a patch {p} model of {C} channels "
                           f"has {p * p * C} (or {2 * p * p * C} with learned sigma)")
    table = _shape(state, LABEL_TABLE)
    pooled = _shape(state, "text_pooled_embedder.mlp.0.weight")
    tokens = _shape(state, "text_token_embedder.mlp.0.weight")
    # the MLP's hidden width H is fc2's input (GELU: fc1 D -> M, fc2 M -> D; SwiGLU: fc1 D -> 2H',
    # fc2 H' -> D); the part, the first whose module has these shapes at that width; the GELU width
    # M, of those its width rule turns into H (SwiGLU's H' = floor(2M / 3): two), the one with the
    # shorter ratio (4 rather than 4.00087). No part: DiT's at fc1's width, which mismatch() words
    hidden = _shape(state, "blocks.0.mlp.fc2.weight")[1]
    mlp = _part(state, "blocks.0.mlp.", MLPS, D, hidden)
    widths = MLPS[mlp].gelu_widths(hidden) if mlp else []
    if widths:
        width = min(widths, key=lambda m: len(f"{m / D:g}"))
    else:
        mlp, width = DiTConfig.mlp, _shape(state, "blocks.0.mlp.fc1.weight")[0]
    return dict(
        input_size=grid * p, in_channels=C, patch_size=p, hidden_size=D,
        depth=len({int(m.group(1)) for k in state if (m := _BLOCK.match(k))}),
        mlp_ratio=width / D, mlp=mlp, norm=_part(state, "blocks.0.norm1.", NORMS, D) or DiTConfig.norm,
        num_classes=table[0] - 1 if table else 0,  # the last row is the null class
        learn_sigma=out == 2 * p * p * C, qk_norm="blocks.0.attn.q_norm.weight" in state,
        text_pooled_dim=pooled[1] if pooled else None, text_token_dim=tokens[1] if tokens else None,
        frequency_embedding_size=_shape(state, "t_embedder.mlp.0.weight")[1],
    )


def _part(state: dict, prefix: str, parts, *args) -> str | None:
    """The first of `parts` whose module, built (on meta) with `args`, has exactly the keys and shapes
    of `state` under `prefix`; None: none has."""
    have = {k[len(prefix):]: tuple(v.shape) for k, v in state.items() if k.startswith(prefix)}
    for name, part in parts.items():
        with torch.device("meta"):
            module = part.module(*args)
        if {k: tuple(v.shape) for k, v in module.state_dict().items()} == have:
            return name
    return None


_KINDS = BLOCK_FIELDS[:3]  # mlp, norm, pos: the block choices a --model must share with the shapes (QK-norm:
# the shapes decide)


def _blocks(spec: dict) -> tuple:
    """The MLP, norm and position kinds of architecture fields (DiT's where not given)."""
    return tuple(spec.get(k, getattr(DiTConfig, k)) for k in _KINDS)


def _shaped(spec: dict) -> tuple:
    """What the shapes tell of _blocks(spec): the MLP, the norm, and whether the position part adds
    a table (pos_embed); a rotation has no weights (sincos and sincos+rope look alike)."""
    mlp, norm, pos = _blocks(spec)
    return mlp, norm, POSITIONS[pos].table is not None


def _size(arch: dict) -> str:
    blocks = "".join(f", {k} {v}" for k, v in zip(_KINDS, _blocks(arch), strict=True) if v != getattr(DiTConfig, k))
    return f"hidden {arch['hidden_size']}, depth {arch['depth']}, patch {arch['patch_size']}{blocks}"


def _name_and_heads(arch: dict, model: str | None, where) -> tuple[str, int, str]:
    """(model name, attention heads, position part): --model's, else the named size with the
    weights' hidden size, depth and blocks (its name with the weights' patch)."""
    if model is not None:
        try:
            spec = architecture(model)  # a registry name or a custom:hidden=..,depth=..,heads=..,patch=.. spec
        except KeyError:
            raise WeightsError(f"--model {model}: unknown; choose one of {', '.join(CONFIGS)}, or "
                               f"{CUSTOM_SPEC}") from None
        except ModelSpecError as e:
            raise WeightsError(f"--model: {e}") from None
        hidden = MLPS[arch["mlp"]].width  # the MLP width of a ratio (SwiGLU: two ratios may give one width)
        width = hidden(int(arch["hidden_size"] * spec.get("mlp_ratio", arch["mlp_ratio"])))  # a custom spec's ratio
        if (any(spec[k] != arch[k] for k in ("hidden_size", "depth", "patch_size"))
                or width != hidden(int(arch["hidden_size"] * arch["mlp_ratio"])) or _shaped(spec) != _shaped(arch)):
            raise WeightsError(f"--model {model} ({_size(spec)}) does not fit {where} ({_size(arch)})")
        return model, spec["num_heads"], _blocks(spec)[2]
    for name, spec in CONFIGS.items():  # a named size with these blocks
        if (spec["hidden_size"], spec["depth"]) == (arch["hidden_size"], arch["depth"]) and _shaped(spec) == _shaped(arch):
            return f"{name.rsplit('/', 1)[0]}/{arch['patch_size']}", spec["num_heads"], _blocks(spec)[2]
    suggestion = custom_name(arch["hidden_size"], arch["depth"], "?", arch["patch_size"], arch["mlp_ratio"],
                             mlp=arch["mlp"], norm=arch["norm"], qk_norm=arch["qk_norm"])
    raise WeightsError(f"{where}: no named DiT size has hidden {arch['hidden_size']} and depth {arch['depth']}, "
                       "and the shapes do not tell the attention heads: pass --model NAME (see `dittrain "
                       f"models`) or --model {suggestion} with the heads it was trained with")


def mismatch(state: dict, expected: dict) -> str | None:
    """How weights `state` fail to fit a model's state dict `expected` (None: they fit): the
    first key, in the model's order, whose shapes differ, then the missing and unexpected keys."""
    parts = []
    for k, v in expected.items():
        if k in state and tuple(state[k].shape) != tuple(v.shape):
            parts.append(f"{k} is {tuple(state[k].shape)} in the weights but {tuple(v.shape)} in the model")
            break
    for what, keys in (("missing", [k for k in expected if k not in state]),
                       ("unexpected", [k for k in state if k not in expected])):
        if keys:
            parts.append(f"{what} {len(keys)} key(s) ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})")
    return "; ".join(parts) or None


def infer_model(state: dict, model: str | None = None, *, where="the weights") -> tuple[str, DiTConfig]:
    """(name, DiTConfig) of a plain DiT state dict, from its shapes (meta tensors will do);
    model: a name from `dittrain models` instead of the inferred one. WeightsError when the
    shapes are not a DiT's or the heads cannot be told."""
    arch = _architecture(state, where)
    name, heads, pos = _name_and_heads(arch, model, where)
    try:
        cfg = DiTConfig(**arch, num_heads=heads, pos=pos)
    except AssertionError as e:
        raise WeightsError(f"{where}: shapes of no valid DiT ({e})") from e
    with torch.device("meta"):
        expected = DiT(cfg).state_dict()
    problem = mismatch(state, expected)
    if problem:
        raise WeightsError(f"{where}: not the layout of a {name} ({_size(arch)}): {problem}")
    return name, cfg


def infer_run_config(state: dict, model: str | None = None, *, where="the weights") -> dict:
    """The resolved run config a plain state dict implies: {"train" (model: the inferred
    name, objective ddpm), "model", "diffusion" (DiT's)}, and no "store" (it has none)."""
    name, cfg = infer_model(state, model, where=where)
    train = TrainConfig.from_flat(model=name, objective="ddpm", learn_sigma=cfg.learn_sigma, qk_norm=cfg.qk_norm,
                                  class_dropout=cfg.class_dropout_prob)
    return {"train": asdict(train), "model": asdict(cfg),
            "diffusion": asdict(DiffusionConfig(objective="ddpm", learn_sigma=cfg.learn_sigma))}


def describe(config: dict, file) -> str:
    """One line on what a plain state dict was read as."""
    m, d = config["model"], config["diffusion"]
    cond = (f"{m['num_classes']} classes" if m["num_classes"] else
            "text-conditioned" if m["text_pooled_dim"] or m["text_token_dim"] else "unconditional")
    sigma = "learned sigma" if m["learn_sigma"] else "fixed sigma"
    return (f"{Path(file).name} is a plain state dict: {recorded(config, 'model')} inferred from its shapes "
            f"({m['in_channels']}x{m['input_size']}x{m['input_size']} latents, {cond}, {sigma}; "
            f"{d['objective']}, {d['num_timesteps']} steps)")


# --------------------------------------------------------------------------- sampling without a store


def _load_autoencoder(vae: str, in_channels: int):
    """The autoencoder `vae` on the CPU, through ditdata's loading path (presets such as
    sd-vae-ft-ema from the local hub cache, diffusers folders, the TAEF2 folder), checked to
    make the model's latents."""
    from ditdata.autoencoders.kinds import load_autoencoder  # imported when needed, as Store.autoencoder does

    try:
        ae = load_autoencoder(vae, "cpu")
    except Exception as e:  # DitdataError: not on this machine, not an autoencoder, ...
        raise WeightsError(f"cannot load --vae {vae}: {one_line(e)}") from e
    if ae.latent_channels != in_channels:
        raise WeightsError(f"--vae {vae} makes {ae.latent_channels}-channel latents; the model takes "
                           f"{in_channels} channels")
    return ae


class StandInStore:
    """What sampling needs of a latent store, for weights that come without one (a plain
    state dict and --vae): plan_samples, run_plan, store_mismatches and sample_to_files
    accept it. It holds no samples.

        root          the weights file (there is no store directory)
        identity      None (no manifest)
        latent_shape  (C, H, W): the model's input
        conditioning  ditdata.store.Conditioning: "class" with the model's classes (no
                      names), or "none"
        schema        a Schema of that latent alone (no text fields)
        manifest      what a manifest would say: {"vae", "conditioning", "latent", "image"}
        resolution    the images' size in pixels (input size x the autoencoder's downsample)
        autoencoder(device, source=None)   the --vae autoencoder (another one: `source`)
        empty_caption() -> {}; len() == 0; shards == []
    """

    identity = None
    shards: tuple = ()

    def __init__(self, cfg: DiTConfig, autoencoder, vae: str, root):
        self.root, self.vae, self._ae, self._in_channels = Path(root), vae, autoencoder, cfg.in_channels
        self.latent_shape = (cfg.in_channels, cfg.input_size, cfg.input_size)
        self.conditioning = (Conditioning("class", cfg.num_classes) if cfg.num_classes else Conditioning("none"))
        self.schema = Schema(tensors={"latent": TensorSpec(self.latent_shape, "float32")},
                             columns={"key": "string"})
        self.resolution = cfg.input_size * autoencoder.downsample
        cond = ({"type": "class", "num_classes": cfg.num_classes, "class_names": None} if cfg.num_classes
                else {"type": "none"})
        self.manifest = {"vae": dict(autoencoder.info), "conditioning": cond,
                         "latent": {"shape": list(self.latent_shape)},
                         "image": {"resolution": self.resolution}}

    def __len__(self) -> int:
        return 0

    def empty_caption(self) -> dict:
        return {}

    def autoencoder(self, device="cpu", *, source: str | None = None):
        if source is not None and source != self.vae:
            self._ae, self.vae = _load_autoencoder(source, self._in_channels), source
        return self._ae.to(device)


def stand_in_store(config: dict, vae: str | None, file) -> tuple[StandInStore, str]:
    """(store, note) for sampling the plain state dict `file` (run config `config`, from
    infer_run_config) with the autoencoder `vae`, loaded now: a missing one fails before any
    sampling. WeightsError without vae, and for text models (they need a store's text
    encoder and empty caption: --latents)."""
    cfg = DiTConfig(**config["model"])
    if cfg.text_pooled_dim or cfg.text_token_dim:
        raise WeightsError(f"{file} is a text-conditioned DiT: sampling it needs the text encoder and "
                           "empty-caption embedding of a latent store; pass --latents STORE")
    if not vae:
        raise WeightsError(f"{file} is a plain state dict: it names no latent store, hence no autoencoder; "
                           "pass --vae NAME_OR_DIR (e.g. sd-vae-ft-ema) or --latents STORE")
    ae = _load_autoencoder(vae, cfg.in_channels)
    store = StandInStore(cfg, ae, vae, file)
    note = (f"note: {describe(config, file)}; decoding with {vae} ({ae.latent_channels} latent channels, "
            f"downsample {ae.downsample}): {store.resolution}x{store.resolution} px images"
            f"{', classes by index (no names)' if cfg.num_classes else ''}")
    return store, note


# --------------------------------------------------------------------------- starting a run from weights


def _classes(shape: tuple[int, ...] | None) -> int:
    return shape[0] - 1 if shape else 0


PIXART_CLASS = "PixArtTransformer2DModel"
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"


def pixart_folder(path) -> Path | None:
    """The diffusers PixArtTransformer2DModel folder at `path`: the folder itself, or the transformer/ of a
    pipeline folder; None when it is neither (a run directory's config.json names no diffusers class)."""
    path = Path(path)
    if not path.is_dir():
        return None
    for folder in (path, path / "transformer"):
        try:
            config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(config, dict) and config.get("_class_name") == PIXART_CLASS:
            return folder
    return None


def read_pixart(folder: Path, where) -> tuple[dict, dict, list[Path]]:
    """(config.json, diffusers' state dict, the files read) of a PixArtTransformer2DModel folder: its
    safetensors, one file or shards listed by the .index.json (never a pickled .bin)."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    single, index = folder / DIFFUSERS_WEIGHTS, folder / f"{DIFFUSERS_WEIGHTS}.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            files = [folder / name for name in sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))]
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise WeightsError(f"{where}: unreadable {index.name} ({type(e).__name__}: {e})") from e
    else:
        raise WeightsError(f"{where}: a {PIXART_CLASS} folder without {DIFFUSERS_WEIGHTS} (nor its .index.json); "
                           "save it with save_pretrained(safe_serialization=True): .bin files are not read")
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:
            raise WeightsError(f"{where}: unreadable {f.name} ({type(e).__name__}: {e})") from e
    return config, state, files


def _pixart_spec(fields: dict) -> str:
    """The --model that builds the PixArt of `fields`: a preset when one has these sizes, else a custom spec."""
    arch = {k: fields[k] for k in ("hidden_size", "depth", "num_heads", "patch_size", "adaln", "pos_interpolation",
                                   "micro_conditions")}
    for name, spec in CONFIGS.items():
        if all(spec.get(k, getattr(DiTConfig, k)) == v for k, v in arch.items()):
            return name
    return custom_name(arch["hidden_size"], arch["depth"], arch["num_heads"], arch["patch_size"], adaln="single",
                       pos_interpolation=arch["pos_interpolation"], micro_conditions=arch["micro_conditions"])


def init_pixart(model: DiT, source, folder: Path) -> tuple[dict, list[str]]:
    """--init-from a diffusers PixArtTransformer2DModel folder: its config checked against the run's model (one
    line naming both sides: the model, the store's latent channels, the store's text width), its weights mapped
    (dittrain.model.pixart.from_diffusers) and loaded strictly; pos_embed stays the model's own (diffusers saves
    none). A sample size other than the store's is a note: the positions follow the run's grid, as PixArt's own
    training at a new resolution rebuilds them."""
    from dittrain.model.pixart import PixArtConfigError, from_diffusers, pixart_fields

    where = f"--init-from {source}"
    config, theirs, files = read_pixart(folder, where)
    try:
        fields = pixart_fields(config)
    except PixArtConfigError as e:
        raise WeightsError(f"{where}: a {PIXART_CLASS} our PixArt blocks cannot hold: {e}") from None
    cfg, notes = model.config, []
    spec = _pixart_spec(fields)
    if cfg.adaln != "single" or not cfg.text_token_dim:
        raise WeightsError(f"{where} is a diffusers {PIXART_CLASS}; this run's model is not a PixArt "
                           f"(adaln={cfg.adaln}{', no text tokens' if not cfg.text_token_dim else ''}): run it with "
                           f"--model {spec} on a store with text tokens")
    checks = (("in_channels", fields["in_channels"], "the store's latent channels", cfg.in_channels),
              ("caption_channels", fields["text_token_dim"], "the store's text token width", cfg.text_token_dim),
              ("out_channels", f"{2 * fields['in_channels'] if fields['learn_sigma'] else fields['in_channels']}",
               "the run's (--learn-sigma, --objective ddpm for PixArt's)", f"{cfg.out_channels}"))
    for name, have, what, want in checks:
        if have != want:
            raise WeightsError(f"{where}: its {name} is {have} but {what} is {want}")
    arch = ("hidden_size", "depth", "num_heads", "patch_size", "pos_interpolation", "micro_conditions")
    differ = [f"{k} {fields[k]:g} vs {getattr(cfg, k):g}" for k in arch if fields[k] != getattr(cfg, k)]
    if differ:
        raise WeightsError(f"{where}: its architecture is not this run's model ({', '.join(differ)}: the folder's "
                           f"first); run it with --model {spec}")
    if fields["input_size"] != cfg.input_size:
        notes.append(f"note: {where} was made for {fields['input_size']}x{fields['input_size']} latents, this store's "
                     f"are {cfg.input_size}x{cfg.input_size}: the sin-cos positions follow this run's grid")
    own = model.state_dict()
    state = from_diffusers(theirs, cfg.depth)
    state["pos_embed"] = own["pos_embed"]  # computed from the run's config (diffusers saves none)
    _load_fitting(model, state, own, where)
    record = {"from": str(Path(source).resolve()), "file": str(files[0].resolve()), "kind": "diffusers-pixart",
              "sha256": sha256_file(files[0]) if len(files) == 1 else {f.name: sha256_file(f) for f in files},
              "step": None, "model": spec, "store_identity": None, "label_embedder": "none",
              "diffusers_config": {k: v for k, v in config.items() if not k.startswith("_")}}
    return record, notes


def _load_fitting(model: DiT, state: dict, own: dict, where: str) -> None:
    """`state` loaded into `model` (whose state dict is `own`), strictly; first a WeightsError naming `where` and
    the first key or shape that does not fit (mismatch), rather than torch's list of every one."""
    problem = mismatch(state, own)
    if problem:
        raise WeightsError(f"{where} does not fit this run's model: {problem}")
    model.load_state_dict(state, strict=True)


def init_model(model: DiT, source) -> tuple[dict, list[str]]:
    """Load the weights of `source` into `model`, a freshly built DiT, to fine-tune it:
    a plain state dict file, an EMA export, a run directory (its EMA) or a checkpoint .pt
    (its EMA), or a diffusers PixArtTransformer2DModel folder (init_pixart). Shapes must fit, except the label embedder: another number of classes (or
    none) keeps the model's own freshly initialised table, with a note; any other
    difference is a WeightsError naming the first key and both shapes (or the missing
    and unexpected keys). Returns (the record for the run config, notes to print)."""
    path = Path(source)
    if not path.exists():
        raise WeightsError(f"--init-from {source}: no such file or run directory")
    folder = pixart_folder(path)
    if folder is not None:  # a diffusers PixArtTransformer2DModel (or a PixArt pipeline's transformer/)
        return init_pixart(model, source, folder)
    w = full_weights(path, WeightsError, f"--init-from {source}: fine-tune from the run it was exported from, "
                     "or its fp32/fp16 weights")
    state, own, notes = dict(w.state), model.state_dict(), []
    have, want = _shape(state, LABEL_TABLE), _shape(own, LABEL_TABLE)
    if have != want and (have is None or want is None or have[1:] == want[1:]):
        state.pop(LABEL_TABLE, None)
        if want is not None:
            state[LABEL_TABLE] = own[LABEL_TABLE]
        notes.append(f"note: --init-from {source} has {_classes(have)} classes, this run {_classes(want)}: "
                     "the label embedder is initialised afresh, every other weight comes from it")
    _load_fitting(model, state, own, f"--init-from {source}")
    config = w.config or {}
    record = {"from": str(path.resolve()), "file": str(w.file.resolve()), "kind": w.kind,
              "sha256": sha256_file(w.file), "step": w.step,
              "model": recorded(config, "model"),
              "store_identity": (config.get("store") or {}).get("identity"),
              "label_embedder": "fresh" if notes else "loaded"}
    return record, notes


__all__ = [
    "LABEL_TABLE", "PIXART_CLASS", "StandInStore", "init_pixart", "pixart_folder", "read_pixart", "Weights", "WeightsError", "describe", "infer_model", "infer_run_config",
    "full_weights", "init_model", "load_weights", "mismatch", "read_weights", "stand_in_store", "strip_prefixes", "weights_file", "with_base", "adapted_model",
]
