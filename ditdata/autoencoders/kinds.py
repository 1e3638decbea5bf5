"""Autoencoders: one registry and one wrapper for encoding (``ditdata encode``) and decoding
(``ditdata inspect --decode``, ``dittrain sample``).

``load_autoencoder(name_or_path)`` resolves, in this order:

1. a preset name from ``PRESETS`` (``sd-vae-ft-ema``, ``sd-vae-ft-mse``, ``sdxl-vae``,
   ``flux-vae``, ``vavae-f16d32``, ``taef2``, ``pixels``);
2. ``ldm:CHECKPOINT`` with ``vae_config`` (its LDM yaml config, or the dict): an AutoencoderKL
   from ONE checkpoint file in the LDM (CompVis) layout, as VA-VAE, the original Stable
   Diffusion VAEs and many research tokenizers ship (ditdata/autoencoders/ldm.py: diffusers' single-file
   conversion). Scaled by the config's ``scale_factor`` where it has one; without one the
   latents are stored unscaled (1.0, shift 0) and the entry says ``"latent_norm": "channel"``:
   ``dittrain run --latent-norm auto`` then standardises them per channel;
3. an existing local directory: one holding ``taef2_encoder.pth`` + ``taef2_decoder.pth``
   is TAEF2; one with a ``config.json`` whose ``_class_name`` is ``AutoencoderKL`` (or a
   diffusers pipeline directory with such a ``vae/`` subfolder) is a diffusers AutoencoderKL
   whose scaling and shift come from its config; one holding an LDM preset's checkpoint
   (``vavae-imagenet256-f16d32-dinov2.pt``) is that preset;
4. a hub id ``org/name`` or ``org/name/subfolder``: a diffusers AutoencoderKL from the
   LOCAL Hugging Face cache only (``ditdata.common.hub.hub_cache_dir``: ``$HF_HUB_CACHE``, else
   ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``, in huggingface_hub's order).

Nothing is ever downloaded: a model that is not on disk fails at once with a
``DitdataError`` naming the model and how to provide it. The ``taef2`` preset finds its
weights through ``$DITKIT_TAEF2`` (a directory) or takes the directory itself; ``vavae-f16d32``
through ``$DITKIT_VAVAE`` (its checkpoint, or a directory holding it), else the hub cache.

Latent convention (all kinds): ``encode`` takes images (B, 3, H, W) in [0, 1] and returns
the SCALED posterior mean ``z = (mean - shift) * scale`` and the scaled std
``std * scale`` (None for deterministic autoencoders); ``decode`` inverts the scaling and
returns images in [0, 1], clamped. A sample of the posterior is ``z + std * eps``.

Kinds are a table: ``KINDS`` maps each kind (``ditdata.autoencoders.presets``: a diffusers AutoencoderKL,
TAEF2, pixels) to its adapter (``AutoencoderKind``: encode, decode, and how it is found as a
preset, a directory or a manifest entry); the presets themselves live in ``ditdata.autoencoders.presets``.

``Autoencoder.info`` is exactly the store manifest's ``"vae"`` entry;
``autoencoder_from_manifest`` rebuilds the autoencoder a store was made with, trusting the
manifest's scaling and shift (and, for an LDM checkpoint, its recorded ``ldm_config``).
Importing this module is cheap (torch and diffusers are imported inside the functions that
need them).
"""

from __future__ import annotations

import importlib.util
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ditdata.autoencoders.ldm import LDM_SPEC, checkpoint_of
from ditdata.autoencoders.presets import (  # noqa: F401  (re-exported: the presets' names, as before)
    KIND_KL,
    KIND_PIXELS,
    KIND_RAE,
    KIND_TAEF2,
    PRESETS,
    RANGE_01,
    RANGE_PM1,
    TAEF2_ENV,
    TAEF2_FILES,
    TAEF2_SOURCE,
    Preset,
)
from ditdata.common.errors import described
from ditdata.common.extras import require
from ditdata.common.files import read_json, sha256_file
from ditdata.common.hub import download_command, hub_cache_dir, not_cached_message, saved_weights
from ditdata.errors import DitdataError

if TYPE_CHECKING:
    import torch

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(/[\w.-]+)*")


def _info(name: str, ident: str | None, *, sha: dict[str, str] | None, scaling: float, shift: float,
          channels: int, downsample: int, input_range: str, kind: str, subfolder: str | None = None,
          revision: str | None = None, latent_norm: str = "none", ldm_config: dict | None = None) -> dict[str, Any]:
    """An ``Autoencoder.info`` (the manifest's ``"vae"`` entry), keys in their recorded order.
    ``latent_norm``: the normalisation training should give these latents (``dittrain run
    --latent-norm auto``): "channel" where the autoencoder publishes no scaling factor, else
    "none". ``ldm_config``: the architecture of an LDM checkpoint (ditdata.autoencoders.ldm), else None."""
    return {
        "name": name,
        "id": ident,
        "subfolder": subfolder,
        "revision": revision,
        "weights_sha256": sha,
        "scaling_factor": float(scaling),
        "shift_factor": float(shift),
        "latent_channels": int(channels),
        "downsample": int(downsample),
        "input_range": input_range,
        "kind": kind,
        "latent_norm": latent_norm,
        "ldm_config": ldm_config,
    }


def _preset_info(p: Preset, ident: str | None, sha: dict[str, str] | None) -> dict[str, Any]:
    """The info of a preset whose facts are fixed (TAEF2, pixels)."""
    return _info(p.name, ident, sha=sha, scaling=p.scaling_factor, shift=p.shift_factor,
                 channels=p.latent_channels, downsample=p.downsample, input_range=p.input_range,
                 kind=p.kind)


def _fact(key: str, cast=None) -> property:
    """A read-only view of one ``info`` entry."""
    return property(lambda self: self.info[key] if cast is None else cast(self.info[key]))


# --------------------------------------------------------------------------- wrapper


class Autoencoder:
    """A torch module plus the facts a latent store needs about it.

    ``info`` is the manifest entry: name, id, subfolder, revision, weights_sha256,
    scaling_factor, shift_factor, latent_channels, downsample, input_range, kind, latent_norm,
    ldm_config (``_info``).
    ``weights_sha256`` maps each weight file actually loaded (path relative to the model
    directory) to its sha256; None for ``pixels``. What the module itself does with the
    pixels is its kind's business (``KINDS``); the scaling and value range are done here,
    the same for every kind.
    """

    def __init__(self, module: Any, info: dict[str, Any]):
        import torch

        self.module = module
        self.info = dict(info)
        self.adapter = KINDS[self.info["kind"]]
        self._device = torch.device("cpu")
        self._dtype = torch.float32
        if module is not None:
            from ditdata.common.usercode import check_weights

            module.eval().requires_grad_(False)
            # weights that hold NaN would make every latent non-finite: refused here, once, for every kind
            check_weights(module.state_dict(), f"autoencoder {self.info['name']}")
            p = next(module.parameters())
            self._device, self._dtype = p.device, p.dtype

    # -- facts (views of ``info``)
    name = _fact("name")
    kind = _fact("kind")
    scaling_factor = _fact("scaling_factor", float)
    shift_factor = _fact("shift_factor", float)
    latent_channels = _fact("latent_channels", int)
    downsample = _fact("downsample", int)
    deterministic = property(lambda self: self.adapter.deterministic,
                             doc="True when ``encode`` returns no std (TAEF2, pixels).")
    # -- where it runs and in what precision (changed by to() only)
    device = property(lambda self: self._device)
    dtype = property(lambda self: self._dtype)

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        self._check_size(height, width)
        return (self.latent_channels, height // self.downsample, width // self.downsample)

    def to(self, device: Any = None, dtype: torch.dtype | None = None) -> Autoencoder:
        import torch

        if device is not None and torch.device(device) != self._device:
            self._device = torch.device(device)
            if self.module is not None:
                self.module.to(device=self._device)
        if dtype is not None and dtype != self._dtype:
            self._dtype = dtype
            if self.module is not None:
                self.module.to(dtype=self._dtype)
        return self

    def __repr__(self) -> str:
        return (f"Autoencoder({self.name!r}, kind={self.kind}, latent={self.latent_channels}ch "
                f"/{self.downsample}, scale={self.scaling_factor}, shift={self.shift_factor}, "
                f"device={self.device}, dtype={self.dtype})")

    def _check_size(self, height: int, width: int) -> None:
        d = self.downsample
        if height % d or width % d:
            raise DitdataError(
                f"autoencoder {self.name}: image size {height}x{width} is not a multiple of {d}")
        problem = self.adapter.size_problem(self.info, height, width)
        if problem:
            raise DitdataError(f"autoencoder {self.name}: {problem}")

    # -- encode / decode
    def encode(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """images (B, 3, H, W) float in [0, 1] (uint8 0..255 is accepted too) ->
        (scaled mean (B, C, H/d, W/d) float32, scaled std of the same shape or None)."""
        import torch

        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"expected images of shape (B, 3, H, W), got {tuple(images.shape)}")
        self._check_size(images.shape[-2], images.shape[-1])
        if images.dtype == torch.uint8:
            images = images.float() / 255.0
        x = images.to(device=self._device, dtype=self._dtype)
        if self.info["input_range"] == RANGE_PM1:
            x = x * 2.0 - 1.0
        with torch.no_grad():
            mean, std = self.adapter.encode(self.module, x)
        scale, shift = self.scaling_factor, self.shift_factor
        z = (mean.float() - shift) * scale
        if std is not None:
            std = std.float() * scale
        return z, std

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """scaled latents (B, C, h, w), any float dtype -> images (B, 3, h*d, w*d) float32 in
        [0, 1], clamped."""
        import torch

        if z.ndim != 4 or z.shape[1] != self.latent_channels:
            raise ValueError(f"autoencoder {self.name}: expected latents (B, "
                             f"{self.latent_channels}, h, w), got {tuple(z.shape)}")
        latents = z.to(device=self._device, dtype=torch.float32) / self.scaling_factor
        latents = (latents + self.shift_factor).to(self._dtype)
        with torch.no_grad():
            x = self.adapter.decode(self.module, latents)
        x = x.float()
        if self.info["input_range"] == RANGE_PM1:
            x = (x + 1.0) / 2.0
        return x.clamp(0.0, 1.0)


# --------------------------------------------------------------------------- kinds


class AutoencoderKind:
    """One kind of autoencoder: what its module does to (value-ranged, unscaled) tensors and
    how it is found on disk. A new kind is a subclass, an entry in ``KINDS`` (and in
    ``ditdata.autoencoders.presets``) and a test; ``Autoencoder``, ``load_autoencoder`` and
    ``autoencoder_from_manifest`` dispatch through the table and need no change.

    ``dir_hint`` names, for the error about an unrecognised directory, what a directory of
    this kind holds (None: the kind has no directory). ``has_weights`` False: the kind
    loads nothing, so a manifest's entry suffices and ``source`` is never consulted."""

    name: str
    deterministic = True  # encode returns no std
    has_weights = True
    dir_hint: str | None = None
    no_buckets: str | None = None  # why `ditdata encode --buckets` cannot use this kind (None: it can)

    def encode(self, module, x) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, 3, H, W) in the kind's input range -> (mean, std or None), unscaled."""
        raise NotImplementedError

    def decode(self, module, latents) -> torch.Tensor:
        """Unscaled latents -> images in the kind's input range (not clamped)."""
        raise NotImplementedError

    def from_preset(self, preset: Preset, device: Any, dtype: torch.dtype) -> Autoencoder:
        raise NotImplementedError

    def from_dir(self, path: Path, device: Any, dtype: torch.dtype) -> Autoencoder | None:
        """The autoencoder in directory `path`, or None when it is not one of this kind."""
        return None

    def from_manifest(self, entry: dict[str, Any], device: Any, dtype: torch.dtype) -> Autoencoder:
        """The autoencoder a store's manifest entry records, found where it was recorded."""
        raise NotImplementedError

    def size_problem(self, info: dict[str, Any], height: int, width: int) -> str | None:
        """Why images of this size cannot be encoded (beyond the downsample's multiple), or None."""
        return None


class _TAEF2Kind(AutoencoderKind):
    name = KIND_TAEF2
    dir_hint = f"{' + '.join(TAEF2_FILES)} (TAEF2)"

    def encode(self, module, x):
        return module.encode(x), None

    def decode(self, module, latents):
        return module.decode(latents)

    def from_preset(self, preset, device, dtype):
        return _taef2(_taef2_from_env(), device, dtype)

    def from_dir(self, path, device, dtype):
        return _taef2(path, device, dtype) if _is_taef2_dir(path) else None

    def from_manifest(self, entry, device, dtype):
        # a TAEF2 whose recorded directory is gone is found through $DITKIT_TAEF2
        d = Path(entry["id"]) if entry.get("id") else None
        return _taef2(d if d and _is_taef2_dir(d) else _taef2_from_env(), device, dtype)


class _KLKind(AutoencoderKind):
    """A diffusers AutoencoderKL, found as a diffusers folder (local or in the hub cache) or as
    one LDM-format checkpoint with its LDM config (a preset's ``filename``, ``ldm:``, a manifest
    entry with ``ldm_config``): loaded, both are the same module."""

    name = KIND_KL
    deterministic = False
    dir_hint = ("a diffusers AutoencoderKL (config.json + diffusion_pytorch_model.safetensors) or "
                + " / ".join(f"{p.filename} ({p.name})" for p in PRESETS.values() if p.filename))

    def encode(self, module, x):
        dist = module.encode(x).latent_dist
        return dist.mean, dist.std

    def decode(self, module, latents):
        return module.decode(latents).sample

    def from_preset(self, preset, device, dtype):
        if preset.filename:  # one LDM-format checkpoint (VA-VAE)
            return _ldm_preset(preset, preset.ldm_config, device, dtype)
        return _kl_from_hub(preset.repo_id, preset.subfolder, device, dtype, name=preset.name,
                            scaling=preset.scaling_factor, shift=preset.shift_factor)

    def from_dir(self, path, device, dtype):
        for cand in (path, path / "vae"):  # a model directory, or a pipeline's vae/
            cfg = _kl_config(cand)
            if cfg is not None and cfg.get("_class_name") == "AutoencoderKL":
                return _kl_from_dir(cand, device, dtype)
        for p in PRESETS.values():  # a directory holding an LDM preset's checkpoint
            if p.filename and (path / p.filename).is_file():
                return _ldm(path / p.filename, p.ldm_config, device, dtype, name=p.name)
        return None

    def from_manifest(self, entry, device, dtype):
        if entry.get("ldm_config"):
            return _ldm_from_manifest(entry, device, dtype)
        ident, name = entry.get("id"), entry.get("name")
        if ident and Path(ident).is_absolute():  # local directories are recorded absolute
            if not Path(ident).is_dir():
                raise DitdataError(f"store autoencoder {name!r}: {ident} is not on "
                                   "this machine; pass its directory (--vae DIR)")
            return _kl_from_dir(Path(ident), device, dtype)
        if ident and _HUB_ID.fullmatch(ident):
            sub = entry.get("subfolder")
            return _from_hub_pinned(lambda rev: _kl_from_hub(ident, sub, device, dtype, name=name or ident, revision=rev),
                                    ident, entry.get("revision"), name or ident)
        raise DitdataError(f"store autoencoder {name!r}: unusable id {ident!r}; "
                           "pass its directory (--vae DIR)")


class _PixelsKind(AutoencoderKind):
    name = KIND_PIXELS
    has_weights = False

    def encode(self, module, x):
        return x, None

    def decode(self, module, latents):
        return latents

    def from_preset(self, preset, device, dtype):
        return _pixels(device, dtype)

    def from_manifest(self, entry, device, dtype):
        return _pixels(device, dtype)


RAE_SPEC = "rae:"  # --vae rae:DIR, a local AutoencoderRAE folder named as one
RAE_CLASS = "AutoencoderRAE"


class _RAEKind(AutoencoderKind):
    """A diffusers AutoencoderRAE (Zheng et al., 2025, "Diffusion Transformers with Representation
    Autoencoders"): its ``encode`` resizes the [0, 1] images to the encoder's input (bicubic), applies
    the encoder's mean and std, takes the frozen encoder's patch tokens and normalises them with the
    checkpoint's latent statistics; ``decode`` runs its ViT decoder and undoes the pixel
    normalisation. Nothing of that is redone here: the latent is what ``AutoencoderRAE.encode`` returns.

    The token grid is fixed by the encoder's input size, whatever the image's: the decoder always
    draws ``image_size`` px squares. So the images must be that square (``--resolution`` equal to
    it) and ``--buckets`` is refused: an RAE would squash every bucket to the same square grid."""

    name = KIND_RAE
    no_buckets = ("encodes one square size only: its encoder resizes every image to its own square input, so every "
                  "bucket would be squashed to the same token grid; encode at its --resolution without --buckets")
    dir_hint = f"a diffusers {RAE_CLASS} (config.json + diffusion_pytorch_model.safetensors)"

    def encode(self, module, x):
        return module.encode(x).latent, None

    def decode(self, module, latents):
        return module.decode(latents).sample

    def from_preset(self, preset, device, dtype):
        return _rae_from_hub(preset.repo_id, preset.subfolder, None, device, dtype, name=preset.name)

    def from_dir(self, path, device, dtype):
        cfg = _kl_config(path)
        return _rae_from_dir(path, device, dtype) if cfg and cfg.get("_class_name") == RAE_CLASS else None

    def from_manifest(self, entry, device, dtype):
        ident, name = entry.get("id"), entry.get("name")
        if ident and Path(ident).is_absolute():
            if not Path(ident).is_dir():
                raise DitdataError(f"store autoencoder {name!r}: {ident} is not on this machine; pass its "
                                   f"folder (--vae {RAE_SPEC}DIR)")
            return _rae_from_dir(Path(ident), device, dtype, name=name)
        if ident and _HUB_ID.fullmatch(ident):
            sub = entry.get("subfolder")
            return _from_hub_pinned(lambda rev: _rae_from_hub(ident, sub, rev, device, dtype, name=name or ident),
                                    ident, entry.get("revision"), name or ident)
        raise DitdataError(f"store autoencoder {name!r}: unusable id {ident!r}; pass its folder "
                           f"(--vae {RAE_SPEC}DIR)")

    def size_problem(self, info, height, width):
        rae = info.get("rae") or {}
        side = rae.get("image_size")
        if side and (height, width) != (side, side):
            return (f"takes {side}x{side} images only, got {height}x{width} (an RAE resizes every image to its "
                    f"encoder's {rae.get('encoder_input_size')} px square and decodes {side} px squares): use "
                    f"--resolution {side}, without --buckets")
        return None


# kind -> adapter; directories are recognised in this order
KINDS: dict[str, AutoencoderKind] = {k.name: k for k in (_TAEF2Kind(), _KLKind(), _RAEKind(), _PixelsKind())}


# --------------------------------------------------------------------------- helpers


def _is_taef2_dir(path: Path) -> bool:
    return all((path / f).is_file() for f in TAEF2_FILES)


def _kl_config(path: Path) -> dict[str, Any] | None:
    cfg = path / "config.json"
    if not cfg.is_file():
        return None
    try:
        return read_json(cfg)
    except (OSError, ValueError):
        return None


def quiet_third_party_imports() -> None:
    """Call before importing diffusers or torchao: with torchao installed (the export extra)
    the imports print lines that are noise for ditkit. torch warns once per enum that torchao registers
    as a pytree constant (a deprecation, harmless), and diffusers 0.42 looks for tensor classes
    torchao 0.18 no longer has, which matters only for torchao-quantised diffusers checkpoints
    (ditkit never loads one). Both loggers are turned down to errors; nothing else is."""
    import logging

    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer").setLevel(logging.ERROR)


def quiet_transformers(subject: str, extra: str):
    """transformers imported for `subject` (DitdataError naming `extra` where it is missing), with
    its per-load progress bars and advice turned off: noise in a command's output."""
    quiet_third_party_imports()
    transformers = require("transformers", subject, extra, DitdataError)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def _load_diffusers(model_dir: Path, dtype: torch.dtype, label: str,
                    class_name: str = "AutoencoderKL") -> tuple[Any, dict[str, str]]:
    """diffusers' `class_name` from a local folder, and the sha256 of the weight files it loads
    (it prefers safetensors; relative to model_dir), each failure one line."""
    weights = saved_weights(model_dir, ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin"))
    if weights is None:
        raise DitdataError(f"no diffusion_pytorch_model.safetensors or .bin weights in {model_dir}")
    files, safe = weights
    sha = {f: sha256_file(model_dir / f) for f in files}
    quiet_third_party_imports()
    diffusers = require("diffusers", f"autoencoder {label}", "vae", DitdataError)
    if not hasattr(diffusers, class_name):  # AutoencoderRAE came with diffusers 0.37
        raise DitdataError(f"autoencoder {label}: this diffusers ({diffusers.__version__}) has no {class_name}; "
                           "upgrade diffusers (0.37 or later)")
    try:
        module = getattr(diffusers, class_name).from_pretrained(
            str(model_dir), torch_dtype=dtype, use_safetensors=safe, local_files_only=True,
            low_cpu_mem_usage=importlib.util.find_spec("accelerate") is not None)
    except Exception as e:  # corrupt or incompatible files: one line for the CLI
        raise DitdataError(f"cannot load {class_name} {label} from {model_dir}: {described(e)}") from e
    return module, sha


def _kl_info(name: str, ident: str, subfolder: str | None, revision: str | None,
             sha: dict[str, str], module: Any, scaling: float | None,
             shift: float | None) -> dict[str, Any]:
    cfg = module.config
    if scaling is None:
        scaling = cfg.get("scaling_factor", None) or 0.18215
    if shift is None:
        shift = cfg.get("shift_factor", None) or 0.0
    return _info(name, ident, subfolder=subfolder, revision=revision, sha=sha, scaling=scaling,
                 shift=shift, channels=cfg["latent_channels"],
                 downsample=2 ** (len(cfg["block_out_channels"]) - 1), input_range=RANGE_PM1,
                 kind=KIND_KL)


def _missing_hub_message(name: str, repo_id: str, subfolder: str | None, cache: Path,
                         revision: str | None = None, detail: str = "", filename: str | None = None,
                         instead: str = "a local diffusers directory (--vae DIR)") -> str:
    """Not in the cache: the whole repo (or its `subfolder`), or one checkpoint `filename`."""
    files = (filename,) if filename else ()
    command = download_command(repo_id, *files, include=f"{subfolder}/*" if subfolder else None, revision=revision)
    what = repo_id + (f" (subfolder {subfolder})" if subfolder else "") + (f" file {filename}" if filename else "")
    label = f"'{name}' = {what}" if name != repo_id else what
    return not_cached_message(f"autoencoder {label}{' at revision ' + revision if revision else ''}", cache,
                              command, detail, instead)


def _snapshot(repo_id: str, subfolder: str | None, revision: str | None, name: str) -> Path:
    """The cached snapshot directory of ``repo_id`` (never touching the network)."""
    cache = hub_cache_dir()
    hub = require("huggingface_hub", f"autoencoder {name} ({repo_id})", "vae", DitdataError)
    try:
        path = hub.snapshot_download(
            repo_id, revision=revision, cache_dir=str(cache), local_files_only=True,
            allow_patterns=[f"{subfolder}/*"] if subfolder else None)
    except Exception as e:
        detail = type(e).__name__
        raise DitdataError(_missing_hub_message(name, repo_id, subfolder, cache, revision,
                                                detail)) from e
    return Path(path)


# --------------------------------------------------------------------------- loaders


def _taef2(weights_dir: Path, device: Any, dtype: torch.dtype) -> Autoencoder:
    from ditdata.autoencoders.taef2 import TAEF2

    weights_dir = weights_dir.expanduser().resolve()
    sha = {f: sha256_file(weights_dir / f) for f in TAEF2_FILES}
    try:
        module = TAEF2.from_dir(weights_dir)
    except Exception as e:
        raise DitdataError(f"cannot load TAEF2 weights from {weights_dir}: {described(e)}") from e
    info = _preset_info(PRESETS["taef2"], str(weights_dir), sha)
    return Autoencoder(module, info).to(device, dtype)


def _taef2_from_env() -> Path:
    env = os.environ.get(TAEF2_ENV)
    if env and _is_taef2_dir(Path(env).expanduser()):
        return Path(env)
    where = f"${TAEF2_ENV}={env} holds no {' + '.join(TAEF2_FILES)}" if env else \
        f"${TAEF2_ENV} is not set"
    raise DitdataError(f"autoencoder 'taef2': weights not found ({where}): set {TAEF2_ENV}=DIR "
                       f"or pass --vae DIR, where DIR holds {' and '.join(TAEF2_FILES)} "
                       f"from {TAEF2_SOURCE}")


def _pixels(device: Any, dtype: torch.dtype) -> Autoencoder:
    return Autoencoder(None, _preset_info(PRESETS["pixels"], None, None)).to(device, dtype)


def _kl_from_dir(path: Path, device: Any, dtype: torch.dtype, name: str | None = None,
                 scaling: float | None = None, shift: float | None = None) -> Autoencoder:
    path = path.expanduser().resolve()
    module, sha = _load_diffusers(path, dtype, name or str(path))
    info = _kl_info(name or str(path), str(path), None, None, sha, module, scaling, shift)
    return Autoencoder(module, info).to(device, dtype)


def _kl_from_hub(repo_id: str, subfolder: str | None, device: Any, dtype: torch.dtype, *,
                 name: str, revision: str | None = None, scaling: float | None = None,
                 shift: float | None = None) -> Autoencoder:
    snap = _snapshot(repo_id, subfolder, revision, name)
    model_dir = snap / subfolder if subfolder else snap
    cfg = _kl_config(model_dir)
    if cfg is None:
        raise DitdataError(_missing_hub_message(
            name, repo_id, subfolder, hub_cache_dir(), revision,
            f"snapshot {snap.name} has no {subfolder + '/' if subfolder else ''}config.json"))
    if cfg.get("_class_name") == RAE_CLASS:  # a cached hub id of an RAE
        return _rae_from_dir(model_dir, device, dtype, name=name, ident=repo_id, subfolder=subfolder,
                             revision=snap.name)
    if cfg.get("_class_name") != "AutoencoderKL":
        raise DitdataError(f"{repo_id}{'/' + subfolder if subfolder else ''} is a "
                           f"{cfg.get('_class_name')}, not an AutoencoderKL")
    module, sha = _load_diffusers(model_dir, dtype, name)
    info = _kl_info(name, repo_id, subfolder, snap.name, sha, module, scaling, shift)
    return Autoencoder(module, info).to(device, dtype)


def _rae_from_dir(path: Path, device: Any, dtype: torch.dtype, *, name: str | None = None, ident: str | None = None,
                  subfolder: str | None = None, revision: str | None = None) -> Autoencoder:
    """An AutoencoderRAE folder (config.json + weights): the manifest entry records its encoder
    (type, patch, input size) and the image size its decoder draws, beside the usual facts."""
    path = path.expanduser().resolve()
    label = name or f"{RAE_SPEC}{path}"
    cfg = _kl_config(path)
    if cfg is None or cfg.get("_class_name") != RAE_CLASS:
        found = f"a {cfg.get('_class_name')} config" if cfg else "no readable config.json"
        raise DitdataError(f"--vae {label}: {path} is not a diffusers {RAE_CLASS} folder ({found})")
    module, sha = _load_diffusers(path, dtype, label, RAE_CLASS)
    c = module.config
    info = _info(label, ident or str(path), subfolder=subfolder, revision=revision, sha=sha, scaling=1.0, shift=0.0,
                 channels=c["encoder_hidden_size"], downsample=module.decoder_patch_size, input_range=RANGE_01,
                 kind=KIND_RAE)
    # the latent is (C, g, g) for every input: g = encoder_input_size / encoder_patch_size
    info["rae"] = {"encoder_type": c["encoder_type"], "encoder_patch_size": int(c["encoder_patch_size"]),
                   "encoder_input_size": int(c["encoder_input_size"]), "image_size": int(module.decoder_image_size),
                   "grid": int(module.num_patches ** 0.5)}
    return Autoencoder(module, info).to(device, dtype)


def _rae_from_hub(repo_id: str, subfolder: str | None, revision: str | None, device: Any, dtype: torch.dtype, *,
                  name: str) -> Autoencoder:
    snap = _snapshot(repo_id, subfolder, revision, name)
    model_dir = snap / subfolder if subfolder else snap
    if _kl_config(model_dir) is None:
        raise DitdataError(_missing_hub_message(
            name, repo_id, subfolder, hub_cache_dir(), revision,
            f"snapshot {snap.name} has no {subfolder + '/' if subfolder else ''}config.json",
            instead=f"a local {RAE_CLASS} folder (--vae {RAE_SPEC}DIR)"))
    return _rae_from_dir(model_dir, device, dtype, name=name, ident=repo_id, subfolder=subfolder, revision=snap.name)


def _ldm(checkpoint: Path, config: str | Path | dict, device: Any, dtype: torch.dtype, *,
         name: str | None = None, ident: str | None = None, revision: str | None = None) -> Autoencoder:
    """An LDM-format checkpoint file with its LDM config (a yaml path or the normalised dict):
    scaled by the config's scale_factor, else stored unscaled and marked for channel
    normalisation. `ident`: a hub id (the file is in the cache), else the file's path."""
    from ditdata.autoencoders.ldm import load_module, read_config

    path = checkpoint.expanduser().absolute()  # not resolved: a hub cache file is a link into blobs/
    if not path.is_file():
        raise DitdataError(f"{LDM_SPEC}{checkpoint}: no such checkpoint file")
    cfg = read_config(config)
    name = name or f"{LDM_SPEC}{path}"
    module = load_module(path, cfg, label=name)
    scale = cfg.get("scale_factor")
    info = _kl_info(name, ident or str(path), None, revision, {path.name: sha256_file(path)}, module,
                    1.0 if scale is None else scale, 0.0)
    info.update(latent_norm="channel" if scale is None else "none", ldm_config=cfg)
    return Autoencoder(module, info).to(device, dtype)


def _ldm_preset(preset: Preset, config: dict, device: Any, dtype: torch.dtype) -> Autoencoder:
    """An LDM preset's checkpoint: from ``$ENV`` (the file, or a directory holding it) when set,
    else from the hub cache."""
    env = os.environ.get(preset.env) if preset.env else None
    if not env:
        return _ldm_from_hub(preset.repo_id, preset.filename, None, config, preset.name, device, dtype)
    where = Path(env).expanduser()
    path = where / preset.filename if where.is_dir() else where
    if not path.is_file():
        raise DitdataError(f"autoencoder {preset.name!r}: ${preset.env}={env} is not {preset.filename} nor a "
                           f"directory holding it; point ${preset.env} at it, or unset it to use the Hugging Face "
                           f"cache (`{download_command(preset.repo_id, preset.filename)}`)")
    return _ldm(path, config, device, dtype, name=preset.name)


def _ldm_from_hub(repo_id: str, filename: str, revision: str | None, config: dict, name: str,
                  device: Any, dtype: torch.dtype) -> Autoencoder:
    """One checkpoint file of a hub repo, from the local cache only."""
    cache = hub_cache_dir()
    hub = require("huggingface_hub", f"autoencoder {name} ({repo_id})", "vae", DitdataError)
    preset = PRESETS.get(name)
    instead = (f"${preset.env}=FILE (the file, or a directory holding it)" if preset is not None and preset.env
               else f"--vae {LDM_SPEC}FILE")
    try:
        path = Path(hub.hf_hub_download(repo_id, filename, revision=revision, cache_dir=str(cache),
                                        local_files_only=True))
    except Exception as e:
        raise DitdataError(_missing_hub_message(name, repo_id, None, cache, revision, type(e).__name__,
                                                filename=filename, instead=instead)) from e
    snapshot = path.parents[len(Path(filename).parts) - 1]  # .../snapshots/COMMIT/FILENAME
    return _ldm(path, config, device, dtype, name=name, ident=repo_id, revision=snapshot.name)


def _ldm_from_manifest(entry: dict[str, Any], device: Any, dtype: torch.dtype) -> Autoencoder:
    """An LDM checkpoint where the entry recorded it (a local file; a hub file, at its commit
    if cached), with the recorded config; a preset's moved file is found as the preset is."""
    ident, name, config = entry.get("id"), entry.get("name"), entry["ldm_config"]
    preset = PRESETS.get(name) if name else None
    if ident and Path(ident).is_absolute():
        if Path(ident).is_file():
            return _ldm(Path(ident), config, device, dtype, name=name)
        if preset is not None and preset.filename:
            return _ldm_preset(preset, config, device, dtype)
        raise DitdataError(f"store autoencoder {name!r}: {ident} is not on this machine; pass its "
                           f"checkpoint (--vae {LDM_SPEC}FILE; the manifest has its config)")
    filename = next(iter(entry.get("weights_sha256") or {}), None)
    if ident and _HUB_ID.fullmatch(ident) and filename:
        return _from_hub_pinned(lambda rev: _ldm_from_hub(ident, filename, rev, config, name or ident, device, dtype),
                                ident, entry.get("revision"), name or ident)
    raise DitdataError(f"store autoencoder {name!r}: unusable id {ident!r}; pass its checkpoint "
                       f"(--vae {LDM_SPEC}FILE)")


def load_autoencoder(name_or_path: str, device: Any = "cpu", dtype: torch.dtype | None = None, *,
                     vae_config: str | Path | dict | None = None) -> Autoencoder:
    """Load a preset, ``ldm:CHECKPOINT`` with its ``vae_config``, a local directory or a cached
    hub id (see the module docstring). ``dtype`` defaults to float32. Raises ``DitdataError``
    when the model is not on disk."""
    import torch

    dtype = dtype or torch.float32
    s = str(name_or_path).strip()
    checkpoint = checkpoint_of(s)
    if vae_config is not None and checkpoint is None:
        raise DitdataError(f"--vae-config {vae_config} goes with --vae {LDM_SPEC}CHECKPOINT (one LDM-format "
                           f"checkpoint file), not with --vae {s}")
    if checkpoint is not None:
        if vae_config is None:
            raise DitdataError(f"--vae {s}: an LDM-format checkpoint needs its LDM config: --vae-config CONFIG.yaml "
                               "(model.params.embed_dim and ddconfig)")
        return _ldm(checkpoint, vae_config, device, dtype)
    preset = PRESETS.get(s)
    if preset is not None:
        return KINDS[preset.kind].from_preset(preset, device, dtype)
    if s.startswith(RAE_SPEC):
        folder = Path(s[len(RAE_SPEC):]).expanduser()
        if not folder.is_dir():
            raise DitdataError(f"--vae {s}: {folder} is not a directory (an {RAE_CLASS} folder: config.json + "
                               "diffusion_pytorch_model.safetensors, as save_pretrained writes it)")
        return _rae_from_dir(folder, device, dtype)
    path = Path(s).expanduser()
    if path.is_dir():  # each kind in turn recognises its directories (KINDS)
        for kind in KINDS.values():
            ae = kind.from_dir(path, device, dtype)
            if ae is not None:
                return ae
        cfg = _kl_config(path)
        found = f"a {cfg.get('_class_name')} config" if cfg else "no config.json"
        expected = " or ".join(k.dir_hint for k in KINDS.values() if k.dir_hint)
        raise DitdataError(f"{path}: not a recognised autoencoder directory ({found}); expected {expected}")
    if path.exists():
        raise DitdataError(f"{s}: an autoencoder is a directory, one of the presets {', '.join(PRESETS)}, "
                           f"or one LDM-format checkpoint given as --vae {LDM_SPEC}{s} --vae-config CONFIG.yaml")
    if _HUB_ID.fullmatch(s) and ".." not in s:
        parts = s.split("/")
        repo_id, sub = "/".join(parts[:2]), "/".join(parts[2:]) or None
        return _kl_from_hub(repo_id, sub, device, dtype, name=s)
    raise DitdataError(f"unknown autoencoder {s!r}: not a preset ({', '.join(PRESETS)}), "
                       f"not {LDM_SPEC}CHECKPOINT, not an existing directory, not a hub id (org/name)")


def _from_hub_pinned(load: Callable[[str | None], Autoencoder], repo_id: str, revision: str | None,
                     name: str) -> Autoencoder:
    """load(revision): the recorded commit from the cache; when only another commit is cached,
    load(None) with a warning (the caller's sha256 check tells whether its weights are the same)."""
    try:
        return load(revision)
    except DitdataError as pinned_error:
        if revision is None:
            raise
        try:
            ae = load(None)
        except DitdataError:
            raise pinned_error from None
    warnings.warn(f"autoencoder {name!r}: revision {revision} of {repo_id} is not cached, "
                  f"using {ae.info['revision']}", stacklevel=4)
    return ae


def store_autoencoder(store, device: Any = "cpu", *, source: str | None = None) -> Autoencoder:
    """The autoencoder a latent store was made with (its manifest's "vae"), from the local
    cache or `source` (a path): decode(z) -> images in [0, 1]."""
    return autoencoder_from_manifest(store.manifest["vae"], device=device, source=source)


def autoencoder_from_manifest(vae_entry: dict[str, Any], device: Any = "cpu",
                              dtype: torch.dtype | None = None, *, source: str | None = None,
                              strict: bool = False) -> Autoencoder:
    """Rebuild the autoencoder a store was made with from its manifest ``"vae"`` entry.

    The manifest is the source of truth for scaling and shift. The model is found at
    ``source`` when given (a directory or name, e.g. from ``--vae``; ``ldm:CHECKPOINT`` takes
    the entry's recorded LDM config), else at the recorded id (a local directory or
    checkpoint, or a hub id at the recorded revision in the local cache); a TAEF2 whose
    recorded directory is gone falls back to ``$DITKIT_TAEF2``, a preset's moved LDM checkpoint
    to the preset's own search. When the weights loaded differ from the recorded sha256 a
    warning is issued (``strict=True``: an error).
    """
    import torch

    dtype = dtype or torch.float32
    e = dict(vae_entry)
    kind = KINDS.get(e.get("kind"))
    if source is not None and (kind is None or kind.has_weights):
        config = e.get("ldm_config") if checkpoint_of(source) is not None else None
        ae = load_autoencoder(source, device, dtype, vae_config=config)
    elif kind is None:
        raise DitdataError(f"store manifest names an unknown autoencoder kind {e.get('kind')!r}")
    else:
        ae = kind.from_manifest(e, device, dtype)
    # The loaded autoencoder is the one the entry records: kind and shapes must agree (an
    # error), weights should (a warning; an error when `strict`).
    if ae.kind != e.get("kind"):
        raise DitdataError(f"store was encoded with a {e.get('kind')} autoencoder, got a {ae.kind}")
    for key in ("latent_channels", "downsample", "input_range"):
        if key in e and e[key] != ae.info[key]:
            raise DitdataError(f"store autoencoder {e.get('name')!r}: {key} is {e[key]} in the "
                               f"manifest but {ae.info[key]} in {ae.info['id']}")
    want, got = e.get("weights_sha256"), ae.info["weights_sha256"]
    if want and got != want:
        msg = (f"store autoencoder {e.get('name')!r}: the weights loaded from {ae.info['id']} "
               f"differ from those the store was encoded with (sha256 {got} != {want})")
        if strict:
            raise DitdataError(msg)
        warnings.warn(msg, stacklevel=2)
    ae.info["scaling_factor"] = float(e["scaling_factor"])
    ae.info["shift_factor"] = float(e.get("shift_factor") or 0.0)
    if e.get("name"):
        ae.info["name"] = e["name"]
    return ae
