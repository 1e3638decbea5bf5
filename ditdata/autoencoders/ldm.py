"""LDM-format (CompVis) KL autoencoders: one checkpoint file plus its LDM yaml config, the way
VA-VAE (LightningDiT's tokenizer), the original Stable Diffusion VAEs and many research
tokenizers ship, made into a diffusers AutoencoderKL (which ``ditdata.autoencoders.kinds`` then wraps like any
other AutoencoderKL: encode and decode are the KL kind's).

    cfg = read_config("vavae_f16d32.yaml")     the architecture, normalised (the manifest records it)
    module = load_module(Path("vavae.pt"), cfg)  a diffusers AutoencoderKL holding the checkpoint's weights

The config is read in the layouts these models ship with: ``model.params.{embed_dim, ddconfig}``
(a CompVis autoencoder config such as autoencoder_kl_f8.yaml, and VA-VAE's), or
``model.params.first_stage_config.params.{embed_dim, ddconfig}`` beside
``model.params.scale_factor`` (a whole Stable Diffusion config such as v1-inference.yaml), or
the normalised dict itself. Only the architecture is kept, as
``{"embed_dim": E, "ddconfig": {...}, "scale_factor": S}`` (scale_factor only where the config
has one: then the autoencoder has a published scaling factor); the loss, data, trainer and any
paths are not architecture and are left out.

The conversion is diffusers' own: the config and checkpoint mappings of its single-file
loader's AutoencoderKL entry (what ``AutoencoderKL.from_single_file`` runs). Two things differ
from calling from_single_file, both needed for VA-VAE:

- VA-VAE has self-attention INSIDE its lowest-resolution encoder and decoder levels (ddconfig
  ``attn_resolutions: [16]`` at ``resolution: 256`` with five levels: the fifth, at 16 px, has an
  attention block after each ResNet block). diffusers' AutoencoderKL can hold that
  (AttnDownEncoderBlock2D / AttnUpDecoderBlock2D), but from_single_file's config mapping always
  builds the attention-free blocks, and its checkpoint mapping passes those attention weights
  through unconverted, where they are dropped with a warning: it returns another network. Here
  the levels that attn_resolutions names get the attention blocks, and their weights are
  converted by diffusers' helper for VAE attention (the one it uses for the mid-block's).
- Without accelerate, from_single_file loads non-strictly: a weight the checkpoint lacks would
  stay randomly initialised. Here every weight must be present with its shape, else one line
  says what does not fit.

Only the autoencoder's weights are taken from the checkpoint (encoder., decoder., quant_conv.,
post_quant_conv., alone or under first_stage_model. / vae.): VA-VAE's checkpoint also holds its
loss networks and its DINOv2 teacher, and the mapping selects by substrings ("down.1") that
are not meant for other networks' names. Nothing is fetched: the checkpoint is a local file and
the config a local yaml or a dict. torch and diffusers are imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ditdata.common.errors import described, one_line
from ditdata.common.extras import require
from ditdata.errors import DitdataError

# The ddconfig entries that define the network (the rest, e.g. dropout, do not change its weights)
ARCHITECTURE = ("double_z", "z_channels", "resolution", "in_channels", "out_ch", "ch", "ch_mult",
                "num_res_blocks", "attn_resolutions")
REQUIRED = ("z_channels", "in_channels", "out_ch", "ch", "ch_mult", "num_res_blocks")
# ddconfig options of the LDM Encoder/Decoder that diffusers' AutoencoderKL has only at these values
FIXED = {"double_z": True, "attn_type": "vanilla", "use_linear_attn": False, "tanh_out": False,
         "give_pre_end": False, "resamp_with_conv": True, "in_channels": 3, "out_ch": 3}
# the autoencoder's own weights, and where whole-pipeline checkpoints keep them (diffusers' LDM_VAE_KEYS)
PARTS = ("encoder.", "decoder.", "quant_conv.", "post_quant_conv.")
PREFIXES = ("", "first_stage_model.", "vae.")
ATTN_DOWN, ATTN_UP = "AttnDownEncoderBlock2D", "AttnUpDecoderBlock2D"
LDM_SPEC = "ldm:"  # --vae ldm:CHECKPOINT (with --vae-config CONFIG.yaml)
LAYOUTS = ("model.params.{embed_dim, ddconfig}, or model.params.first_stage_config.params.{embed_dim, ddconfig} "
           "(an LDM autoencoder config such as VA-VAE's vavae_f16d32.yaml)")


def checkpoint_of(spec: str | None) -> Path | None:
    """The file of ``--vae ldm:CHECKPOINT``; None for any other --vae."""
    if not spec or not spec.startswith(LDM_SPEC):
        return None
    if not spec[len(LDM_SPEC):].strip():
        raise DitdataError(f"--vae {spec}: name the checkpoint file, e.g. {LDM_SPEC}vavae.pt")
    return Path(spec[len(LDM_SPEC):].strip()).expanduser()


# --------------------------------------------------------------------------- the config


def read_config(source: str | Path | Mapping) -> dict[str, Any]:
    """The normalised architecture of an LDM config (module docstring) from a yaml file or a
    dict (either layout, or normalised already); DitdataError (one line) when it is none."""
    if isinstance(source, Mapping):
        raw, where = dict(source), "the LDM config"
    else:
        raw, where = _read_yaml(Path(source)), str(source)
    if not isinstance(raw, dict):
        raise DitdataError(f"{where}: not an LDM config (a mapping with {LAYOUTS} was expected)")
    params, scale = _params(raw)
    dd, embed = params.get("ddconfig"), params.get("embed_dim")
    if not isinstance(dd, Mapping) or embed is None:
        raise DitdataError(f"{where}: no ddconfig and embed_dim; expected {LAYOUTS}")
    missing = [k for k in REQUIRED if k not in dd]
    if missing:
        raise DitdataError(f"{where}: ddconfig lacks {', '.join(missing)}")
    try:
        cfg = {"embed_dim": int(embed), "ddconfig": _architecture(dd)}
        if scale is not None:
            cfg["scale_factor"] = float(scale)
    except (TypeError, ValueError) as e:
        raise DitdataError(f"{where}: {one_line(e)} (numbers and lists of numbers expected)") from e
    _check(cfg, dd, where)
    return cfg


def _read_yaml(path: Path) -> Any:
    yaml = require("yaml", f"the LDM config {path}", "vae", DitdataError)
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except OSError as e:
        raise DitdataError(f"cannot read the LDM config {path}: {described(e)}") from e
    except yaml.YAMLError as e:
        raise DitdataError(f"{path}: not readable as YAML ({one_line(e, 200)})") from e


def _params(raw: dict) -> tuple[Mapping, Any]:
    """(the mapping holding embed_dim and ddconfig, the scale_factor or None)."""
    if "ddconfig" in raw:  # normalised (a manifest's record)
        return raw, raw.get("scale_factor")
    model = raw.get("model")
    params = model.get("params") if isinstance(model, Mapping) else None
    if not isinstance(params, Mapping):
        return {}, None
    scale = params.get("scale_factor")  # the latent diffusion model's, beside its first stage
    first = params.get("first_stage_config")
    if isinstance(first, Mapping):
        params = first.get("params")
    return (params if isinstance(params, Mapping) else {}), scale


def _architecture(dd: Mapping) -> dict[str, Any]:
    """The ddconfig's ARCHITECTURE entries as JSON values (flags, integers, lists of integers)."""
    def value(v):
        if isinstance(v, bool):
            return v
        return [int(x) for x in v] if isinstance(v, list | tuple) else int(v)

    out = {key: value(dd[key]) for key in ARCHITECTURE if key in dd}
    out.setdefault("double_z", True)  # the LDM Encoder's defaults
    out.setdefault("attn_resolutions", [])
    return out


def _check(cfg: dict, dd: Mapping, where: str) -> None:
    """What diffusers' AutoencoderKL cannot be: refused with the reason."""
    for key, want in FIXED.items():
        if key in dd and dd[key] != want:
            raise DitdataError(f"{where}: ddconfig {key}: {dd[key]!r} is not supported (diffusers' AutoencoderKL "
                               f"has {key} {want!r})")
    arch = cfg["ddconfig"]
    if cfg["embed_dim"] != arch["z_channels"]:
        raise DitdataError(f"{where}: embed_dim {cfg['embed_dim']} != ddconfig z_channels {arch['z_channels']}; "
                           "diffusers' AutoencoderKL has one latent width for both")
    if not arch["ch_mult"] or arch["num_res_blocks"] < 1 or arch["ch"] < 1:
        raise DitdataError(f"{where}: ddconfig ch, ch_mult and num_res_blocks must be positive")
    if arch["attn_resolutions"] and "resolution" not in arch:
        raise DitdataError(f"{where}: ddconfig attn_resolutions needs resolution (it places the attention)")
    if "scale_factor" in cfg and not cfg["scale_factor"] > 0:
        raise DitdataError(f"{where}: scale_factor must be positive, not {cfg['scale_factor']}")


def attention_levels(cfg: dict) -> list[int]:
    """The encoder/decoder levels with attention blocks: level i works at resolution / 2**i."""
    arch = cfg["ddconfig"]
    return [i for i in range(len(arch["ch_mult"])) if arch.get("resolution", 0) >> i in arch["attn_resolutions"]]


# --------------------------------------------------------------------------- the checkpoint


def read_checkpoint(path: Path) -> dict:
    """The autoencoder's weights in `path` (.safetensors, .ckpt, .pt: read by diffusers'
    single-file reader, under "state_dict" where it is), with the first_stage_model. / vae.
    prefix taken off and everything else left out."""
    utils = _single_file_utils()
    try:
        state = utils.load_single_file_checkpoint(str(path), local_files_only=True)
    except Exception as e:  # not a checkpoint, or one torch will not unpickle as weights only
        raise DitdataError(f"cannot read the checkpoint {path}: {described(e)}") from e
    if not isinstance(state, Mapping):
        raise DitdataError(f"{path}: not a state dict (a {type(state).__name__})")
    prefix = next((p for p in PREFIXES if f"{p}encoder.conv_in.weight" in state), None)
    if prefix is None:
        keys = ", ".join(list(state)[:3])
        raise DitdataError(f"{path}: no KL autoencoder weights (encoder.conv_in.weight, alone or under "
                           f"first_stage_model. or vae.); its {len(state)} entries begin {keys}")
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix) and k[len(prefix):].startswith(PARTS)}


def _single_file_utils():
    require("diffusers", "an LDM-format autoencoder", "vae", DitdataError)
    try:
        from diffusers.loaders import single_file_utils
        from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES  # noqa: F401
    except ImportError as e:
        raise DitdataError(f"LDM-format autoencoders need diffusers >= 0.28 (its single-file loader): "
                           f"{one_line(e)}") from e
    return single_file_utils


# --------------------------------------------------------------------------- the module


def load_module(path: Path, cfg: dict, label: str | None = None):
    """A diffusers AutoencoderKL (float32, eval) with the weights of the checkpoint `path`, of
    the normalised LDM config `cfg`. DitdataError (one line) when they do not fit."""
    import torch
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    label = label or str(path)
    ldm = read_checkpoint(path)
    config = diffusers_config(cfg, ldm)
    try:
        state = SINGLE_FILE_LOADABLE_CLASSES["AutoencoderKL"]["checkpoint_mapping_fn"](checkpoint=ldm, config=config)
        _convert_level_attention(state, ldm, cfg)
    except Exception as e:  # a checkpoint whose layout the mapping does not expect
        raise DitdataError(f"{label}: diffusers cannot convert the checkpoint with its LDM config: "
                           f"{described(e)}") from e
    state = {k: v for k, v in state.items() if v is not None}  # the mapping's .get() of an absent weight
    try:
        with torch.device("meta"):  # no time goes into an init the checkpoint overwrites
            module = AutoencoderKL.from_config(config)
    except Exception as e:  # e.g. widths that 32 normalisation groups do not divide
        raise DitdataError(f"{label}: its LDM config makes no diffusers AutoencoderKL: {described(e)}") from e
    _check_fit(module.state_dict(), state, label)
    module.load_state_dict({k: v.float().contiguous() for k, v in state.items()}, strict=True, assign=True)
    return module.eval()


def diffusers_config(cfg: dict, ldm: dict) -> dict:
    """The diffusers AutoencoderKL config of the LDM config `cfg` (and checkpoint `ldm`, which
    diffusers reads its sample size from): diffusers' own mapping, with attention blocks in the
    levels the ddconfig puts attention in (module docstring)."""
    _single_file_utils()
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    config_mapping_fn = SINGLE_FILE_LOADABLE_CLASSES["AutoencoderKL"]["config_mapping_fn"]
    first_stage = {"params": {"embed_dim": cfg["embed_dim"], "ddconfig": cfg["ddconfig"]}}
    config = config_mapping_fn(original_config={"model": {"params": {"first_stage_config": first_stage}}},
                               checkpoint=ldm, scaling_factor=cfg.get("scale_factor", 1.0))
    levels, n = attention_levels(cfg), len(cfg["ddconfig"]["ch_mult"])
    config["down_block_types"] = [ATTN_DOWN if i in levels else t for i, t in enumerate(config["down_block_types"])]
    # the decoder's blocks run from the lowest resolution up: its k-th block is level n-1-k
    config["up_block_types"] = [ATTN_UP if n - 1 - k in levels else t for k, t in enumerate(config["up_block_types"])]
    return config


def _convert_level_attention(state: dict, ldm: dict, cfg: dict) -> None:
    """The attention weights inside the levels, in diffusers' names (by diffusers' helper for
    VAE attention), in place of the LDM-named copies the checkpoint mapping passed through."""
    utils = _single_file_utils()
    n = len(cfg["ddconfig"]["ch_mult"])
    for level in attention_levels(cfg):
        for old, new in ((f"encoder.down.{level}.attn", f"encoder.down_blocks.{level}.attentions"),
                         (f"decoder.up.{level}.attn", f"decoder.up_blocks.{n - 1 - level}.attentions")):
            keys = [k for k in ldm if k.startswith(old + ".")]
            for k in keys:
                state.pop(k, None)
            utils.update_vae_attentions_ldm_to_diffusers(keys, state, ldm, mapping={"old": old, "new": new})


def _check_fit(want: dict, got: dict, label: str) -> None:
    """Every weight the model has, of its shape, and nothing else: else one line naming a few."""
    missing = [k for k in want if k not in got]
    unexpected = [k for k in got if k not in want]
    shapes = [f"{k} {tuple(got[k].shape)} vs {tuple(want[k].shape)}" for k in want
              if k in got and tuple(got[k].shape) != tuple(want[k].shape)]
    problems = [f"{len(items)} {what} (e.g. {', '.join(items[:2])})"
                for what, items in (("weights missing", missing), ("unexpected weights", unexpected),
                                    ("weights of another shape (checkpoint vs config)", shapes)) if items]
    if problems:
        raise DitdataError(f"{label}: the checkpoint does not fit its LDM config: {'; '.join(problems)}; "
                           "check --vae-config (ddconfig ch, ch_mult, num_res_blocks, z_channels, attn_resolutions)")


__all__ = ["LDM_SPEC", "attention_levels", "checkpoint_of", "diffusers_config", "load_module", "read_checkpoint", "read_config"]
