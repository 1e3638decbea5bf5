"""Feature encoders: the frozen models whose patch tokens a feature set stores (`ditdata
features`, `ditdata encode --features`), e.g. DINOv2 for REPA.

``load_encoder(name, store_resolution, resolution=None, device=..., option="--encoder", resize="reference")``
resolves NAME through
``SOURCES``, in this order:

1. ``python:MODULE:FUNCTION``: FUNCTION() (MODULE a dotted module name on sys.path, or a
   path to a .py file) returns a torch module mapping float images (N, 3, H, W) in [0, 1]
   (resized ones may overshoot it slightly: the default resize does not clamp) to patch
   tokens (N, tokens, dim). It may carry ``resolution`` (its input px) and
   ``grid`` ((h, w), or n for a square n x n grid); without them the input is the store's
   resolution and the grid square. Its weights_sha256 is a digest of its state_dict. Its
   failures and its outputs are checked as the user's (ditdata.common.usercode): an exception
   inside it is one line naming it, a non-finite output stops the command before anything of
   the shard is stored;
2. a preset of ``PRESETS``: ``dinov2-vits14`` ... ``dinov2-vitg14`` (facebook/dinov2-*) and
   ``dinov2-vits14-reg`` ... (facebook/dinov2-with-registers-*), found in the LOCAL Hugging
   Face cache;
3. a local directory saved with transformers' save_pretrained (config.json + weights) of a
   model type in ``MODEL_TYPES``;
4. a hub id ``org/name``, from the local Hugging Face cache only.

Nothing is downloaded: as for the autoencoders (ditdata/autoencoders/kinds.py), a hub model that is not in
the cache fails at once with one line naming the `hf download` command that fetches it.

Why Hugging Face transformers rather than timm: it loads from the same Hugging Face cache
through the same ``from_pretrained(local_files_only=True)`` / ``save_pretrained`` path that
diffusers already uses here for the autoencoders, and it ships the library's own
Dinov2Config / Dinov2WithRegistersConfig, so tests build tiny random DINOv2s that go
through the real loader.

What the encoder sees (``--features-resize``, ditdata.config.FEATURE_RESIZES): the store's
centre crop (uint8, at the store's resolution; the ADM crop REPA's preprocessing makes too)
as floats x / 255 in [0, 1], then, by default ("reference"), exactly as REPA's training does
(sihyun-yu/REPA@67f7145 train.py preprocess_raw_image, its 'dinov2' branch): normalised with
the ImageNet mean and std (DINOv2 only), then resized to the encoder's input resolution by
``F.interpolate(mode="bicubic")``: not antialiased, not clamped (bicubic overshoots [0, 1] a
little at edges, and the encoder sees that). A DINOv2's position embeddings (pretrained on a
37 x 37 grid, 518 px) are resampled ONCE at load to the token grid, bicubic and antialiased,
the class token's kept: REPA's utils.py load_encoders with timm's resample_abs_pos_embed
defaults, where transformers would interpolate them at every call (bicubic, not antialiased,
for Dinov2Model). "antialias" is how ditkit made feature sets before it followed REPA:
resized bicubic, antialiased and clamped to [0, 1], then normalised, the position embeddings
left to transformers. At 256 -> 224 (and 512 -> 448) antialiasing changes little, so there is
no quality reason to prefer it; it is kept only so that a feature set begun that way can be
finished (or remade) with the same targets (its encoder record says "resize": that string).

The input resolution rule is REPA's recipe, ``(store resolution // 16) * patch``, which
keeps the token grid at the store resolution / 16 per side: 256 px -> 224 px for patch 14
(16 x 16 tokens), 512 -> 448 (32 x 32), as REPA's ``224 * (resolution // 256)``;
``--features-resolution`` overrides it. Output: the patch tokens of last_hidden_state only
(the CLS and register tokens are dropped), (N, tokens, dim), in row-major order over the
grid. last_hidden_state is after the final layernorm (transformers' Dinov2Model applies
self.layernorm to the encoder's output), i.e. DINOv2's own ``x_norm_patchtokens``, the output
REPA aligns to.

Importing this module is cheap: torch and transformers are imported inside the loaders.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ditdata.common.errors import described
from ditdata.common.extras import installed_version
from ditdata.common.files import sha256_file, state_dict_sha256
from ditdata.common.hub import HubPreset, cached_snapshot, model_source, required_weights, saved_model_type
from ditdata.common.usercode import PYTHON_PREFIX, UserCodeError, check_weights, user_call, user_function
from ditdata.config import FEATURE_RESIZES, FEATURE_RESOLUTION_RULE
from ditdata.errors import DitdataError

GRID_DIVISOR = 16  # input px = (store px // 16) * patch: FEATURE_RESOLUTION_RULE
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# --features-resize -> the encoder record's "resize" (module docstring). "antialias"'s string is
# what every feature set made before the choice records: a resume compares records, keep it as is.
RESIZES = {"reference": "bicubic, not antialiased, not clamped (REPA's preprocess_raw_image)",
           "antialias": "bicubic, antialiased, clamped to [0, 1]"}
assert tuple(RESIZES) == FEATURE_RESIZES


@dataclass(frozen=True)
class Preset(HubPreset):
    """A named encoder: its hub repository and width (patch 14, 224 px pretraining)."""

    dim: int


# DINOv2's four sizes (letter of the preset, word of the hub repository, width); each comes
# plain and with registers, so the presets are the eight pairs: dinov2-vits14 ... dinov2-vitg14
# (facebook/dinov2-small ...), then dinov2-vits14-reg ... (facebook/dinov2-with-registers-small ...)
_DINOV2_SIZES = (("s", "small", 384), ("b", "base", 768), ("l", "large", 1024), ("g", "giant", 1536))
PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset(f"dinov2-vit{letter}14{suffix}", f"facebook/dinov2-{variant}{size}", dim)
    for suffix, variant in (("", ""), ("-reg", "with-registers-"))
    for letter, size, dim in _DINOV2_SIZES
)}

# transformers config.json model_type -> its model class; every one of them puts the CLS
# token and then config.num_register_tokens register tokens before the patch tokens
MODEL_TYPES = {"dinov2": "Dinov2Model", "dinov2_with_registers": "Dinov2WithRegistersModel"}


def default_feature_set_name(encoder: str) -> str:
    """The feature set's name when --out-name is not given: the preset's name, the
    directory's or hub repository's last part, the FUNCTION of python:MODULE:FUNCTION."""
    s = str(encoder).strip()
    if s.startswith(PYTHON_PREFIX):
        s = s.rpartition(":")[2]
    elif s not in PRESETS:
        s = Path(s.rstrip("/")).name or s
    s = re.sub(r"[^A-Za-z0-9_.-]+", "-", s).strip("-._")[:64]
    return s or "features"


def input_resolution(store_resolution: int, patch: int, override: int | None, name: str) -> int:
    """The encoder's input px (module docstring); an override must be a multiple of the patch."""
    if override is not None:
        if override < 1 or override % patch:
            lo = max(patch, override // patch * patch)
            raise DitdataError(f"--features-resolution {override}: not a multiple of {name}'s patch {patch}; "
                               f"use e.g. {lo} or {lo + patch}")
        return override
    px = store_resolution // GRID_DIVISOR * patch
    if px < patch:
        raise DitdataError(f"store resolution {store_resolution} px is below {GRID_DIVISOR}: the rule "
                           f"{FEATURE_RESOLUTION_RULE} gives no tokens; pass --features-resolution N")
    return px


# --------------------------------------------------------------------------- the wrapper


class FeatureEncoder:
    """A frozen encoder and the facts a feature set records about it (``info``: name, id,
    kind, weights_sha256, resolution, patch, grid, tokens, dim, library and its version).

    ``__call__(x)`` takes images (N, 3, H, W) float in [0, 1] on its device, at any size,
    and returns their patch tokens (N, tokens, dim) float32 (module docstring)."""

    def __init__(self, net, info: dict[str, Any], normalize: tuple | None, option: str = "--encoder",
                 resize: str = "reference"):
        self.net = net.eval().requires_grad_(False)
        self.info = dict(info)
        self.normalize, self.resize = normalize, resize
        self.source = f"{option} {info['name']}"  # how its errors name it: the option the user gave
        check_weights(self.net.state_dict(), self.source)  # NaN weights: every target would be NaN

    name = property(lambda self: self.info["name"])
    resolution = property(lambda self: int(self.info["resolution"]))
    tokens = property(lambda self: int(self.info["tokens"]))
    dim = property(lambda self: int(self.info["dim"]))

    def to(self, device) -> FeatureEncoder:
        self.net.to(device)
        return self

    def preprocess(self, x):
        """Images (N, 3, H, W) float in [0, 1] -> the encoder's input (N, 3, r, r) (module docstring)."""
        import torch.nn.functional as F

        r = self.resolution
        size = None if tuple(x.shape[-2:]) == (r, r) else (r, r)
        if self.resize == "antialias":  # ditkit's earlier rule: resize (antialiased, clamped), then normalise
            if size is not None:
                x = F.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False).clamp_(0, 1)
            return self._normalized(x)
        # REPA's order: Normalize, then F.interpolate(x, 224 * (resolution // 256), mode='bicubic')
        x = self._normalized(x)
        if size is not None:
            x = F.interpolate(x, size=size, mode="bicubic", align_corners=False)
        return x

    def _normalized(self, x):
        if self.normalize is None:
            return x
        import torch

        mean, std = (torch.tensor(v, device=x.device, dtype=x.dtype).view(1, 3, 1, 1) for v in self.normalize)
        return (x - mean) / std

    def __call__(self, x):
        """Its patch tokens; its failure, or output of another type or shape, is the user's
        (ditdata.common.usercode). Finiteness is checked where the keys are known (Targets)."""
        import torch

        out = user_call(self.source, self.net, self.preprocess(x))
        want = (x.shape[0], self.tokens, self.dim)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or not out.is_floating_point():
            got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"
            raise UserCodeError(f"{self.source}: returned {got}, expected floating-point {want} (images, tokens, dim)")
        return out.float()


def _info(name: str, ident: str, kind: str, sha: dict, resolution: int, patch: int | None,
          grid: tuple[int, int], dim: int, library: str, resize: str, **extra) -> dict[str, Any]:
    """A FeatureEncoder.info (the feature set's "encoder" entry), keys in their recorded order."""
    return {"name": name, "id": ident, "kind": kind, "weights_sha256": sha, "resolution": int(resolution),
            "patch": patch, "grid": [int(grid[0]), int(grid[1])], "tokens": int(grid[0] * grid[1]),
            "dim": int(dim), **extra, "resize": RESIZES[resize], "library": library,
            "library_version": installed_version(library)}


# --------------------------------------------------------------------------- transformers


def _patch_tokens(model, prefix: int):
    """last_hidden_state without the `prefix` tokens (CLS, registers) before the patches."""
    import torch

    class PatchTokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x):
            return self.model(pixel_values=x).last_hidden_state[:, prefix:]

    return PatchTokens()


def resample_positions(model, grid: tuple[int, int]) -> tuple[int, int]:
    """Resample a transformers DINOv2's position embeddings (1, 1 + n*n, D), in place, to `grid`
    (h, w) once, as REPA does at load (utils.py load_encoders: timm.layers.pos_embed
    .resample_abs_pos_embed with its defaults: the class token's kept, the n x n patch grid
    resized in float32 by F.interpolate bicubic, antialiased, align_corners False). transformers
    then uses them as they are (its interpolate_pos_encoding returns them when the grid matches).
    Returns the pretrained grid (n, n)."""
    import torch
    import torch.nn.functional as F

    emb = model.embeddings
    if getattr(emb, "position_embeddings", None) is None:
        raise DitdataError(f"{type(model).__name__} has no position embeddings to resample; "
                           "pass --features-resize antialias")
    pos = emb.position_embeddings.data  # (1, 1 + n*n, D)
    n, dim = math.isqrt(pos.shape[1] - 1), pos.shape[-1]
    if (n, n) != tuple(grid):
        patches = pos[:, 1:].float().reshape(1, n, n, dim).permute(0, 3, 1, 2)  # (1, D, n, n)
        patches = F.interpolate(patches, size=tuple(grid), mode="bicubic", align_corners=False, antialias=True)
        patches = patches.permute(0, 2, 3, 1).reshape(1, -1, dim).to(pos.dtype)  # (1, h*w, D)
        emb.position_embeddings = torch.nn.Parameter(torch.cat([pos[:, :1], patches], dim=1), requires_grad=False)
    return n, n


def _from_dir(model_dir: Path, name: str, ident: str, store_resolution: int, override: int | None,
              revision: str | None = None, option: str = "--encoder", resize: str = "reference") -> FeatureEncoder:
    kind = saved_model_type(model_dir, MODEL_TYPES, f"feature encoder {name}", error=DitdataError)
    # the weight files transformers loads (safetensors first), relative to model_dir
    files, safe = required_weights(model_dir, error=DitdataError)
    sha = {f: sha256_file(model_dir / f) for f in files}
    from ditdata.autoencoders.kinds import quiet_transformers

    transformers = quiet_transformers(f"feature encoder {name}", "features")
    try:
        model = getattr(transformers, MODEL_TYPES[kind]).from_pretrained(
            str(model_dir), local_files_only=True, use_safetensors=safe)
    except Exception as e:  # corrupt or incompatible files: one line for the CLI
        raise DitdataError(f"cannot load feature encoder {name} from {model_dir}: {described(e)}") from e
    model = model.float()
    cfg = model.config
    patch = int(cfg.patch_size)
    px = input_resolution(store_resolution, patch, override, name)
    prefix = 1 + int(getattr(cfg, "num_register_tokens", 0) or 0)
    grid = (px // patch, px // patch)
    extra = {}
    if resize == "reference":  # the antialias rule left them to transformers (and records nothing of them)
        n = resample_positions(model, grid)
        extra["position_embeddings"] = (f"{n[0]}x{n[1]} resampled to {grid[0]}x{grid[1]} once at load, bicubic, "
                                        "antialiased (REPA's timm resample_abs_pos_embed)")
    info = _info(name, ident, kind, sha, px, patch, grid, cfg.hidden_size, "transformers", resize,
                 revision=revision, dropped_tokens=prefix, normalize="imagenet", **extra)
    return FeatureEncoder(_patch_tokens(model, prefix), info, (IMAGENET_MEAN, IMAGENET_STD), option, resize)


def _from_hub(repo_id: str, name: str, store_resolution: int, override: int | None,
              option: str = "--encoder", resize: str = "reference") -> FeatureEncoder:
    snap = cached_snapshot(repo_id, "feature encoder", name, "features",
                           "a local directory saved with save_pretrained (--encoder DIR)", DitdataError)
    return _from_dir(snap, name, repo_id, store_resolution, override, revision=snap.name, option=option,
                     resize=resize)


# --------------------------------------------------------------------------- python:


def _grid(net, tokens: int, label: str) -> tuple[int, int]:
    """The token grid (h, w) of a python: encoder: its `grid` attribute, an int n for a square
    n x n grid or a pair (h, w); without one the tokens must make a square grid."""
    grid = getattr(net, "grid", None)
    if grid is None:
        side = math.isqrt(tokens)
        if side * side != tokens:
            raise DitdataError(f"{label}: {tokens} tokens are not a square grid; give the module a `grid` "
                               "attribute (h, w)")
        return side, side
    if isinstance(grid, int) and not isinstance(grid, bool):
        grid = (grid, grid)
    try:
        h, w = (int(g) for g in grid)
        if h < 1 or w < 1 or isinstance(grid, str | bytes):
            raise ValueError
    except (TypeError, ValueError):
        raise DitdataError(f"{label}: its `grid` attribute is {grid!r}; give an int n (a square n x n grid) or "
                           "a pair (h, w) of positive ints") from None
    if h * w != tokens:
        raise DitdataError(f"{label}: its grid {h}x{w} does not match the {tokens} tokens it returns")
    return h, w


def _from_python(spec: str, store_resolution: int, override: int | None, device, option: str,
                 resize: str) -> FeatureEncoder:
    import torch

    label = f"{option} {spec}"
    _, fn_name, fn = user_function(spec, label, "ditkit_encoder", DitdataError)
    net = user_call(label, fn, what=f"{fn_name}()")
    if not isinstance(net, torch.nn.Module):
        raise DitdataError(f"{label}: {fn_name}() returned a {type(net).__name__}, not a torch module")
    px = override or getattr(net, "resolution", None) or store_resolution
    try:
        px = operator.index(px)
        if px < 1 or isinstance(px, bool):
            raise TypeError
    except TypeError:
        raise DitdataError(f"{label}: its `resolution` attribute is {px!r}; give its input size in pixels as an "
                           "int, or leave it out (the store's resolution)") from None
    net = net.eval().requires_grad_(False).to(device)
    with torch.inference_mode():
        probe = user_call(label, net, torch.zeros(1, 3, px, px, device=device))
    if not isinstance(probe, torch.Tensor) or probe.ndim != 3 or not probe.is_floating_point():
        got = f"{probe.dtype} {tuple(probe.shape)}" if isinstance(probe, torch.Tensor) else type(probe).__name__
        raise DitdataError(f"{label}: returned {got} for (1, 3, {px}, {px}); expected floating-point "
                           "(N, tokens, dim)")
    tokens = int(probe.shape[1])
    grid = _grid(net, tokens, label)
    patch = px // grid[0] if px % grid[0] == 0 and px // grid[0] == px // grid[1] else None
    info = _info(spec, spec, "python", {"state_dict": state_dict_sha256(net.state_dict())}, px, patch, grid,
                 int(probe.shape[2]), "torch", resize)
    return FeatureEncoder(net, info, None, option, resize)


# --------------------------------------------------------------------------- resolving


def _preset(s: str, res: int, override: int | None, device, option: str, resize: str) -> FeatureEncoder:
    return _from_hub(PRESETS[s].repo_id, s, res, override, option, resize)


def _directory(s: str, res: int, override: int | None, device, option: str, resize: str) -> FeatureEncoder:
    path = Path(s).expanduser().resolve()
    return _from_dir(path, str(path), str(path), res, override, option=option, resize=resize)


def _hub_id(s: str, res: int, override: int | None, device, option: str, resize: str) -> FeatureEncoder:
    return _from_hub(s, s, res, override, option, resize)


# where NAME comes from (ditdata.common.hub.model_source, in the module docstring's order) -> its loader
SOURCES = {"python": _from_python, "preset": _preset, "directory": _directory, "hub": _hub_id}


def load_encoder(name: str, store_resolution: int, resolution: int | None = None, device="cpu",
                 option: str = "--encoder", resize: str = "reference") -> FeatureEncoder:
    """The feature encoder NAME (module docstring) on `device`, in float32, for a store of
    `store_resolution` px; `resolution` overrides its input px; `resize`: one of
    FEATURE_RESIZES (--features-resize). DitdataError when it is not on disk or not usable;
    `option`: the command-line option that named it, which its errors name."""
    if resize not in RESIZES:
        raise DitdataError(f"--features-resize {resize!r}: use one of {', '.join(RESIZES)}")
    source, s = model_source(name, "feature encoder", PRESETS, DitdataError)
    return SOURCES[source](s, store_resolution, resolution, device, option, resize).to(device)


__all__ = ["FeatureEncoder", "IMAGENET_MEAN", "IMAGENET_STD", "MODEL_TYPES", "PRESETS", "RESIZES", "SOURCES",
           "default_feature_set_name", "input_resolution", "load_encoder", "resample_positions"]
