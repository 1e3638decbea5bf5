"""REPA, representation alignment (Yu et al., 2024): `dittrain run --repa SET`.

The hidden tokens h (N, T, D) after block k (--repa-depth, 1-based) of the DiT go through a
projector, the paper's 3-layer MLP  D -> P -> P -> Dy  with SiLU (P: --repa-projector-dim),
and are pulled towards the targets y (N, T, Dy): patch features of a frozen encoder (DINOv2)
of the same image, read from a feature set of the store (`ditdata features`; the loader's
batch["feat"], the same rows and the same flip as batch["x"], as stored: targets(batch) is float32):

    L_repa = mean over samples n and tokens t of  1 - cos(proj(h)[n, t], y[n, t])
    loss   = diffusion loss + lambda L_repa          (lambda: --repa-weight; ddpm and flow alike)

As the reference (sihyun-yu/REPA@67f7145): models/sit.py build_mlp is the projector (Linear
SiLU Linear SiLU Linear, projector_dim 2048) applied to the output of block encoder_depth
(1-based: `(i + 1) == encoder_depth`, default 8); loss.py SILoss's proj_loss is the mean over
encoders, samples and tokens of -cos(z, z_tilde), and train.py adds proj_coeff (0.5) x it.
1 - cos has the same gradient: our repa_loss is proj_loss + 1 and repa_cos is -proj_loss.

The targets are the encoder's own tokens, as REPA's are: a feature set stored as a PCA
(`ditdata features --features-dims K`: centred coordinates c (N, T, K), storage["pca"] with
components W (K, Dy) and mean m (Dy,)) is rebuilt on the device, in fp32, as
y = c W + m, and the projector maps to the encoder's width Dy, so the cosine the feature set
records (cosine_to_fp32, of the rebuilt targets) is of exactly what is aligned. The run's
record says which ("targets": "reconstructed", or "stored": as stored; "target_dims": Dy):
a run recorded before this rule aligned a PCA set's K coordinates and records neither, and a
resume keeps its projector (Repa.check_resume in dittrain.train.losses).

A feature set whose token grid (h, w) is not the DiT's (input_size / patch per side) is
resized to the DiT's grid, bilinearly per channel, on the device (the startup line says so).
The resize (weights that sum to 1) and the PCA's affine map commute, so the coordinates are
resized (and, under --route, picked) first and rebuilt after: fewer channels and tokens.

The projector trains with the model (the same optimizer and settings, its gradients clipped
with the model's, DDP when the model is, in every checkpoint) but it is not the model: it is
not in the EMA, in ema.safetensors or any export, and sampling never sees it.

    projector = build_projector(hidden, width, dims, seed)    fixed init, whatever the device
    align = Alignment(projector, train_projector, depth=, weight=, grid=, target_grid=, pca=None)
    model_fn = align.capture(train_model)    the model for the diffusion loss; keeps the hidden tokens
    loss, cos = align.loss(model_fn.hidden, dittrain.data.targets(batch))
    weighted, metrics = align(fwd)           as the step's loss term (dittrain.train.losses: REPA's entry,
                                             Repa, builds it): lambda L_repa, {repa_loss, repa_cos}
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ditdata.common.errors import UserError
from dittrain.config import TrainConfig
from dittrain.data import targets
from dittrain.model.routing import TokenRoute, kept_targets
from dittrain.model.sizes import DiTConfig


class RepaError(UserError, ValueError):
    """REPA settings that do not fit the model or the feature set (one line)."""


class Projector(nn.Sequential):
    """(N, T, D) hidden tokens -> (N, T, Dy): Linear SiLU Linear SiLU Linear (the paper's MLP)."""

    def __init__(self, hidden: int, width: int, dims: int):
        super().__init__(nn.Linear(hidden, width), nn.SiLU(), nn.Linear(width, width), nn.SiLU(),
                         nn.Linear(width, dims))


def build_projector(hidden: int, width: int, dims: int, seed: int) -> Projector:
    """A projector on the CPU, initialised as the DiT's linear layers are (Xavier uniform, zero
    bias) from its own generator: the same weights on any device, and the global RNG (the
    model's init) untouched, so a REPA run's DiT starts where a plain run's does."""
    with torch.device("meta"):
        proj = Projector(hidden, width, dims)
    proj.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in proj:
            if isinstance(layer, nn.Linear):
                nn.init.xavier_uniform_(layer.weight, generator=gen)
                nn.init.zeros_(layer.bias)
    return proj


@lru_cache(maxsize=16)
def projector_parts(hidden: int, width: int, dims: int) -> tuple[int, ...]:
    """numel of each parameter of a Projector (built on the meta device: nothing is allocated)."""
    with torch.device("meta"):
        return tuple(p.numel() for p in Projector(hidden, width, dims).parameters())


def alignment_loss(projected: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean of 1 - cos, mean cos) over samples and tokens of projected and target (N, T, Dy),
    in fp32 (under autocast the projection is bf16/fp16); the cosine is detached (a figure)."""
    cos = (F.normalize(projected.float(), dim=-1) * F.normalize(target.float(), dim=-1)).sum(dim=-1)  # (N, T)
    return (1.0 - cos).mean(), cos.detach().mean()


def resize_targets(feat: torch.Tensor, grid: tuple[int, int], to: tuple[int, int]) -> torch.Tensor:
    """(N, h*w, Dy) tokens on grid (h, w), row-major -> (N, H*W, Dy) on grid `to` (H, W):
    bilinear per channel (antialiased when shrinking, so every source token counts)."""
    if tuple(grid) == tuple(to):
        return feat
    N, T, Dy = feat.shape
    x = feat.transpose(1, 2).reshape(N, Dy, *grid)  # (N, Dy, h, w)
    x = F.interpolate(x, size=tuple(to), mode="bilinear", align_corners=False,
                      antialias=to[0] < grid[0] or to[1] < grid[1])
    return x.flatten(2).transpose(1, 2)  # (N, H*W, Dy)


class _Capture:
    """The model as the diffusion loss calls it, model(x, t, **kw) -> output, asking it for the
    hidden tokens after block `depth` too and keeping them in .hidden."""

    def __init__(self, model, depth: int):
        self.model, self.depth, self.hidden = model, depth, None

    def __call__(self, x, t, **kwargs):
        out, self.hidden = self.model(x, t, return_hidden=self.depth, **kwargs)
        return out


def reconstruct(coords: torch.Tensor, pca: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """PCA coordinates (N, T, K) -> the encoder's tokens (N, T, Dy) = coords W + m, in fp32
    (outside autocast: a bf16 matmul would round the targets); pca: (W (K, Dy), m (Dy,))."""
    components, mean = pca
    with torch.autocast(coords.device.type, enabled=False):
        return torch.addmm(mean, coords.float().flatten(0, 1), components).unflatten(0, coords.shape[:2])


class Alignment:
    """REPA within a training step: projector (the module that trains and is checkpointed),
    train_projector (what the forward calls: it, or it in DDP), the block, the weight, and the
    model's token grid with the feature set's; pca: (components (K, Dy), mean (Dy,)) float32 on
    the device when the stored targets are PCA coordinates to rebuild (module docstring). As the
    step's loss term (dittrain.train.losses): it reads the hidden tokens after block `depth`; its
    module is the projector."""

    def __init__(self, projector: nn.Module, train_projector: nn.Module, *, depth: int, weight: float,
                 grid: tuple[int, int], target_grid: tuple[int, int],
                 pca: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.projector, self.train_projector = projector, train_projector
        self.depth, self.weight, self.grid, self.target_grid = depth, weight, tuple(grid), tuple(target_grid)
        self.pca = pca

    @property
    def hidden(self) -> int:
        return self.depth

    @property
    def module(self) -> nn.Module:
        return self.projector

    @property
    def train_module(self) -> nn.Module:
        return self.train_projector

    def __call__(self, fwd) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(lambda L_repa, the figures logged as repa_loss and repa_cos) of one micro-batch's
        forward (dittrain.train.losses.Forward: its hidden tokens, its batch's targets, its route)."""
        loss, cos = self.loss(fwd.hidden, targets(fwd.batch), fwd.route)
        return self.weight * loss, {"repa_loss": loss.detach(), "repa_cos": cos}

    def capture(self, train_model) -> _Capture:
        return _Capture(train_model, self.depth)

    def loss(self, hidden: torch.Tensor, feat: torch.Tensor,
             route: TokenRoute | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(REPA loss, mean cosine) of the hidden tokens (N, T, D) against the batch's targets
        (N, T', Dy) (or their PCA coordinates (N, T', K), rebuilt last), resized to the model's
        grid when T' is another grid. Under --route, when the block is a routed one, the hidden
        tokens are the kept ones (N, K, D) and so are the targets."""
        target = kept_targets(route, self.depth, resize_targets(feat, self.target_grid, self.grid))
        if self.pca is not None:
            target = reconstruct(target, self.pca)
        return alignment_loss(self.train_projector(hidden), target)


# ----------------------------------------------------------------------------- settings


def model_grid(model_cfg: DiTConfig) -> tuple[int, int]:
    side = model_cfg.input_size // model_cfg.patch_size
    return side, side


def check(cfg: TrainConfig, model_cfg: DiTConfig, record: dict, storage: dict) -> None:
    """--repa-* values that cannot work with this model or feature set (record: feature_record's;
    storage: its manifest's, with the measured cosine): RepaError before anything is written."""
    r, (h, w) = cfg.repa, record["grid"]
    # what `ditdata features` measured before writing (a set made another way may record nothing)
    measured = {k: storage[k] for k in ("cosine_to_fp32", "rounding_cosine") if k in storage}
    bad = sorted(k for k, v in measured.items() if not isinstance(v, int | float) or not math.isfinite(v))
    if r.repa_min_cosine > 0 and bad:
        raise RepaError(f"--repa {r.repa}: its manifest records {', '.join(f'{k} {measured[k]!r}' for k in bad)}; "
                        "recompute the set with `ditdata features`, or pass --repa-min-cosine 0 to train on it anyway")
    cosine = measured.get("cosine_to_fp32")
    if r.repa_min_cosine > 0 and cosine is not None and cosine < r.repa_min_cosine:
        raise RepaError(f"--repa {r.repa}: its stored targets keep a mean cosine of {cosine:.4f} to the encoder's "
                        f"fp32 output, below --repa-min-cosine {r.repa_min_cosine:g}; recompute it with "
                        "--features-dtype fp16 or more --features-dims, or pass --repa-min-cosine 0 to train on it")
    if h * w != record["tokens"]:
        raise RepaError(f"--repa {r.repa}: its encoder's grid {h}x{w} does not hold its {record['tokens']} tokens; "
                        "rerun `ditdata features` for this set")
    if not 1 <= r.repa_depth <= model_cfg.depth:
        raise RepaError(f"--repa-depth {r.repa_depth}: the model {cfg.model.model} has {model_cfg.depth} blocks; "
                        f"choose 1..{model_cfg.depth}")
    if not (math.isfinite(r.repa_weight) and r.repa_weight >= 0):
        raise RepaError(f"--repa-weight {r.repa_weight}: give a finite weight >= 0")
    if r.repa_projector_dim < 1:
        raise RepaError(f"--repa-projector-dim {r.repa_projector_dim}: give a width >= 1")


def feature_record(store) -> dict:
    """The run config's store["features"]: what a resume checks (the identity) and what the
    run was aligned to (module docstring: "targets", "target_dims"). store: a FeaturedStore
    (ditdata.store)."""
    fs = store.feature_set
    pca = checked_pca(fs, store.features_name)
    return {"name": store.features_name, "identity": fs.identity, "encoder": fs.encoder.get("name"),
            "tokens": fs.tokens, "dims": fs.dims, "dtype": fs.schema.tensors["feat"].dtype, "grid": list(fs.grid),
            "targets": "stored" if pca is None else "reconstructed",
            "target_dims": fs.dims if pca is None else int(pca["components"].shape[1])}


def checked_pca(fs, name: str) -> dict | None:
    """The feature set's PCA ({"components": (K, Dy), "mean": (Dy,)} float32), or None; RepaError
    when it does not fit its K stored dims or is not finite."""
    pca = fs.pca()
    if pca is None:
        return None
    comps, mean = (np.asarray(pca[k], dtype=np.float32) for k in ("components", "mean"))
    if comps.ndim != 2 or comps.shape[0] != fs.dims or mean.shape != comps.shape[1:]:
        raise RepaError(f"--repa {name}: its PCA has components {comps.shape} and mean {mean.shape}, not ({fs.dims}, "
                        "dim) and (dim,) for its stored dims; rerun `ditdata features` for this set")
    if not (np.isfinite(comps).all() and np.isfinite(mean).all()):
        raise RepaError(f"--repa {name}: its PCA holds non-finite values; rerun `ditdata features` for this set")
    return {"components": comps, "mean": mean}


def target_dims(record: dict) -> int:
    """The projector's output width: the encoder's width for rebuilt targets, else the stored
    dims (a record from before "target_dims" aligned to what is stored)."""
    return int(record.get("target_dims", record["dims"]))


def rebuilds(record: dict) -> bool:
    """Whether the run rebuilds the encoder's tokens from stored PCA coordinates."""
    return record.get("targets", "stored") == "reconstructed"


def pca_on(cfg: TrainConfig, record: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(components (K, Dy), mean (Dy,)) float32 on `device` of the run's feature set, read again
    from the store (the arrays live in its manifest, not in the run's record), which must still be
    the set the record names."""
    from ditdata.store import open_store

    store = open_store(cfg.data.latents, cache_dir=cfg.data.cache_dir or None, cache_limit=cfg.data.cache_limit,
                       features=record["name"])
    if store.feature_set.identity != record["identity"]:
        raise RepaError(f"--repa {record['name']}: the feature set changed while the run started; start it again")
    pca = checked_pca(store.feature_set, record["name"])
    if pca is None or pca["components"].shape[1] != target_dims(record):
        raise RepaError(f"--repa {record['name']}: its PCA is not the one the run records; start it again")
    return (torch.from_numpy(pca["components"]).to(device), torch.from_numpy(pca["mean"]).to(device))


def describe(cfg: TrainConfig, model_cfg: DiTConfig, record: dict, projector: nn.Module) -> str:
    """The startup line of a REPA run."""
    r, n = cfg.repa, sum(p.numel() for p in projector.parameters())
    rebuilt = f", rebuilt to the encoder's {target_dims(record)} dims from its PCA" if rebuilds(record) else ""
    line = (f"repa: {r.repa} (encoder {record['encoder']}, {record['tokens']} tokens x {record['dims']} dims "
            f"{record['dtype']}{rebuilt}), block {r.repa_depth} of {model_cfg.depth}, weight {r.repa_weight:g}, "
            f"projector {model_cfg.hidden_size}->{r.repa_projector_dim}->{r.repa_projector_dim}->"
            f"{target_dims(record)} ({n / 1e6:.2f} M params)")
    grid, to = tuple(record["grid"]), model_grid(model_cfg)
    if grid != to:
        line += f"; targets resized from the encoder's {grid[0]}x{grid[1]} grid to the model's {to[0]}x{to[1]} (bilinear)"
    return line


__all__ = ["Alignment", "Projector", "RepaError", "alignment_loss", "build_projector", "check", "checked_pca",
           "describe", "feature_record", "model_grid", "pca_on", "projector_parts", "rebuilds", "reconstruct",
           "resize_targets", "target_dims"]
