"""Loss terms: what the backward takes beside the diffusion loss, one entry of LOSS_TERMS each.

    loss = diffusion loss + the weighted loss of every term that is on

Within the step (dittrain.train.step.TrainStep) a term is called on every micro-batch with what
the forward gave it, a Forward (the batch, x0, t, noise, the model kwargs, x_t, the model's
output and, for a term that reads them, the hidden tokens after its block), and returns

    weighted, metrics = term(fwd)    weighted: () the loss it adds, its weight applied;
                                     metrics: {name: () tensor}, detached, on the device

The step adds the weighted losses into the backward and carries the metrics (the mean over the
micro-batches, then over the ranks in the step's one all-reduce); a metric that is not finite
skips the step on the device, as a non-finite diffusion loss does. The logs write the metrics
under their own names (metrics.jsonl, TensorBoard's train/NAME) and the progress bar those in
the entry's `shown`. The names are global: start them with the term's (repa_loss, repa_cos).

An entry (a LossTerm) also says what the run around the term needs; every method has a default
that needs nothing (LossTerm: always on, nothing read, nothing trained beside the model):

    on(cfg)                        whether it is on for this TrainConfig
    features(cfg)                  the store's feature set it reads (batch["feat"]), or None
    record(cfg, store, model_cfg)  its checks (a one-line UserError, before anything is written);
                                   what the run config's "store" section keeps for it (a dict)
    make_module(cfg, model_cfg, resolved, device)
                                   a module that trains beside the model, or None: its parameters
                                   join the optimizer and the clipping after the model's, it is in
                                   DDP when the model is, every checkpoint holds it under
                                   `state_key`; never in the EMA, an export or sampling
    build(cfg, model_cfg, resolved, module, train_module)
                                   the term the step calls (default: the entry itself);
                                   train_module: the module as the forward calls it (in DDP or not)
    describe(cfg, model_cfg, resolved, module)
                                   its startup line, or None
    check_resume(latest, saved, recorded, cfg, resolved)
                                   what a resume must keep (CheckpointError); asked of every entry,
                                   on or not (the run may have been made with it)
    planned(cfg, model_cfg, store), cost(model_cfg, tokens, planned), flag(cfg)
                                   for `dittrain plan`: its settings there (the field of its name in
                                   dittrain.plan.footprint.Setting), what it adds to a step (a Cost),
                                   how the plan's header names it

The term the step calls has `hidden` (the 1-based block whose tokens it reads, or None),
`module` (whose parameters are clipped with the model's) and `train_module` (for DDP's no_sync
during accumulation), both None for a term without one.

Adding a term: its entry here and one line in LOSS_TERMS (its math in a module of its own when
it is more than a few lines, as REPA's is in dittrain.train.repa); tests/test_loss_terms.py
registers a toy one. A term's settings are TrainConfig fields (dittrain.config), each with its
resume rule (dittrain.train.resume).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ditdata.common.errors import UserError
from dittrain.config import TrainConfig
from dittrain.diffusion import flow_velocity
from dittrain.model.sizes import DiTConfig
from dittrain.rundir import CheckpointError
from dittrain.train import repa


class LossTermError(UserError, ValueError):
    """Loss terms that cannot be on together (one line)."""


class Forward:
    """One micro-batch's forward as the loss terms see it. The diffusion loss calls it as it
    would the model, model(x_t, t, **kwargs) -> output; it asks the model for the hidden tokens
    after block `block` (1-based; None: none) too (DiT's return_hidden) and keeps what it gave."""

    def __init__(self, model, block: int | None, batch: dict, x0: torch.Tensor, t: torch.Tensor,
                 noise: torch.Tensor, kwargs: dict):
        self.model, self.block = model, block
        self.batch, self.x0, self.t, self.noise, self.kwargs = batch, x0, t, noise, kwargs  # the step's draws
        self.x_t = self.output = self.hidden = None  # (N, C, H, W) the noised input, the output; (N, T, D)

    def __call__(self, x, t, **kwargs):
        if self.block is None:
            out = self.model(x, t, **kwargs)
        else:
            out, self.hidden = self.model(x, t, return_hidden=self.block, **kwargs)
        self.x_t, self.output = x, out
        return out

    @property
    def route(self):
        """--route's kept tokens of this micro-batch (dittrain.model.routing.TokenRoute), or None."""
        return self.kwargs.get("route")


@dataclass(frozen=True)
class Cost:
    """What a term adds to one training step, for dittrain.plan: its parameters (trained: fp32
    weights, gradients and optimizer state), the activations it keeps (its row of the measured
    table, dittrain/plan/activation_table.json, whose per-sample coefficients multiply `per_sample`
    and whose last one the parameter count), its batch tensors on the device and its forward's
    multiply-adds."""

    params: tuple[int, ...] = ()  # numel of each parameter of its module
    table: str = ""  # its key in the activation table ("": it keeps nothing measured)
    what: str = ""  # the table row's name in an error ("no measured activation memory for --repa")
    per_sample: tuple[float, ...] = ()  # the features the table's per-sample coefficients multiply
    data_per_sample: int = 0  # bytes of its batch tensors per sample (REPA's int8 targets and scales)
    macs_per_sample: float = 0.0  # multiply-adds of its forward per sample, beside the DiT's
    targets: tuple[int, int] | None = None  # the feature set it reads, (tokens, dims): what --probe makes up


class LossTerm:
    """A table entry: the defaults of a term that is always on, reads nothing, trains nothing
    beside the model and is its own step-side term (module docstring)."""

    name = ""  # the key in LOSS_TERMS
    state_key: str | None = None  # its module's key in a checkpoint
    shown: tuple[str, ...] = ()  # the metrics the progress bar shows
    hidden: int | None = None  # as the step's term: the block whose tokens it reads
    module = train_module = None  # as the step's term: none

    def on(self, cfg: TrainConfig) -> bool:
        return True

    def features(self, cfg: TrainConfig) -> str | None:
        return None

    def record(self, cfg: TrainConfig, store, model_cfg: DiTConfig) -> dict:
        return {}

    def make_module(self, cfg: TrainConfig, model_cfg: DiTConfig, resolved: dict, device) -> nn.Module | None:
        return None

    def build(self, cfg: TrainConfig, model_cfg: DiTConfig, resolved: dict, module, train_module):
        return self

    def describe(self, cfg: TrainConfig, model_cfg: DiTConfig, resolved: dict, module) -> str | None:
        return None

    def check_resume(self, latest: Path, saved: dict, recorded: TrainConfig, cfg: TrainConfig, resolved: dict) -> None:
        return None

    def planned(self, cfg: TrainConfig, model_cfg: DiTConfig, store):
        return None

    def cost(self, model_cfg: DiTConfig, tokens: list[int], planned) -> Cost:
        return Cost()

    def flag(self, cfg: TrainConfig) -> str:
        return ""

    def __call__(self, fwd: Forward) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError(f"loss term {self.name!r}: define __call__ or build()")


# ----------------------------------------------------------------------------- REPA


class Repa(LossTerm):
    """--repa SET: block --repa-depth's hidden tokens aligned with feature set SET through a
    projector (dittrain.train.repa: the math, the checks, the startup line). The step's term is
    dittrain.train.repa.Alignment; the plan's settings are (block, projector width, target dims)."""

    name, state_key, shown = "repa", "projector", ("repa_loss",)
    PLANNED_DIMS = 768  # plan without a store: DINOv2 ViT-B/14's 768-dim tokens assumed (on the model's grid)

    def on(self, cfg):
        return bool(cfg.repa.repa)

    def features(self, cfg):
        return cfg.repa.repa or None

    def record(self, cfg, store, model_cfg):
        """The feature set's record, beside the store's identity: a resume refuses another set."""
        if store.buckets:  # its targets' grid is one square grid
            raise repa.RepaError(f"--repa {cfg.repa.repa}: not supported on a bucketed store ({cfg.data.latents}); "
                                 "train without --repa")
        features = repa.feature_record(store)
        repa.check(cfg, model_cfg, features, store.feature_set.storage)
        return {"features": features}

    def make_module(self, cfg, model_cfg, resolved, device):
        """The projector from the model's hidden width to the targets' width (the encoder's, for a
        PCA set's rebuilt targets; repa.target_dims), with its own seeded init: the model starts
        as a plain run's does."""
        dims = repa.target_dims(resolved["store"]["features"])
        return repa.build_projector(model_cfg.hidden_size, cfg.repa.repa_projector_dim, dims, cfg.optim.seed).to(device)

    def build(self, cfg, model_cfg, resolved, module, train_module):
        record = resolved["store"]["features"]
        device = next(module.parameters()).device
        return repa.Alignment(module, train_module, depth=cfg.repa.repa_depth, weight=cfg.repa.repa_weight,
                              grid=repa.model_grid(model_cfg), target_grid=tuple(record["grid"]),
                              pca=repa.pca_on(cfg, record, device) if repa.rebuilds(record) else None)

    def describe(self, cfg, model_cfg, resolved, module):
        return repa.describe(cfg, model_cfg, resolved["store"]["features"], module)

    def check_resume(self, latest, saved, recorded, cfg, resolved):
        """A resume aligns to the feature set, and with the projector, it was started with (the
        record refuses other flags: this holds without a record, and for a set recomputed since)."""
        r, old = cfg.repa, saved["store"].get("features") or {}
        if (recorded.repa.repa, recorded.repa.repa_projector_dim) != (r.repa, r.repa_projector_dim):
            was = f"--repa {recorded.repa.repa} --repa-projector-dim {recorded.repa.repa_projector_dim}"
            raise CheckpointError(f"{latest}: made {'with ' + was if recorded.repa.repa else 'without --repa'}; "
                                  "resume with the same REPA flags, or start a new --out")
        new = resolved["store"].get("features") or {}
        if old.get("identity") != new.get("identity"):
            raise CheckpointError(f"{latest}: aligned to feature set {r.repa!r} {str(old.get('identity'))[:19]}..., and "
                                  f"the store's {r.repa!r} is now another one ({str(new.get('identity'))[:19]}...); "
                                  "resume with the set it was trained with, or start a new --out")
        if new:
            # It keeps the targets it trained with, and so its projector's shape: a run recorded
            # before the rebuilt targets aligned a PCA set's stored coordinates (and says nothing).
            new["targets"], new["target_dims"] = old.get("targets", "stored"), repa.target_dims(old)

    def planned(self, cfg, model_cfg, store):
        """(block, projector width, the targets' width as aligned: a PCA set's rebuilt ones are
        the encoder's; planned a little high for them, its K stored dims counted at that width)."""
        r = cfg.repa
        if not 1 <= r.repa_depth <= model_cfg.depth:
            raise repa.RepaError(f"--repa-depth {r.repa_depth}: {cfg.model.model} has {model_cfg.depth} blocks")
        dims = (repa.target_dims(repa.feature_record(store)) if store is not None else self.PLANNED_DIMS)
        return r.repa_depth, r.repa_projector_dim, dims

    def cost(self, model_cfg, tokens, planned):
        """The projector's parameters and the matmuls D -> P -> P -> Dy on the tokens that reach
        its block (its kept ones when routed); what it keeps per sample: T*P, T*Dy, T*D, T
        (activation_table.json's REPA rows); its int8 targets and fp32 per-token scales."""
        block, width, dims = planned
        T, D = tokens[block - 1], model_cfg.hidden_size
        return Cost(params=repa.projector_parts(D, width, dims), table="REPA", what="--repa",
                    per_sample=(T * width, T * dims, T * D, T), data_per_sample=model_cfg.num_tokens * (dims + 4),
                    macs_per_sample=T * (D * width + width * width + width * dims),
                    targets=(model_cfg.num_tokens, dims))

    def flag(self, cfg):
        return f"--repa {cfg.repa.repa}"


# ----------------------------------------------------------------------------- the velocity's direction


class VelocityCosine(LossTerm):
    """--velocity-cosine-weight W (flow only): LightningDiT's cosine loss (hustvl/LightningDiT
    transport/transport.py training_losses and train.py @ 2725fed4: `use_cosine_loss`, on in its
    released configs, and `loss = cos_loss.mean() + mse_loss`, weight 1), added to the velocity MSE:

        W x mean over the batch and the positions (h, w) of 1 - cos(v_pred[n, :, h, w], v[n, :, h, w])

    the cosine over the CHANNELS at each latent position (torch's cosine_similarity on dim 1 of
    (N, C, H, W), as the reference), v the flow's target (dittrain.diffusion.flow_velocity). The
    reference's velocity is data - noise, ours noise - data: both sides flip, the cosine does not.
    Its metric velocity_cosine_loss is the unweighted mean; the logged loss stays the diffusion
    loss (the reference logs the MSE alone too). It keeps a few latent-sized tensors for the
    backward, which `dittrain plan` leaves out."""

    name, shown = "velocity_cosine", ("velocity_cosine_loss",)

    def on(self, cfg):
        return cfg.diffusion.velocity_cosine_weight > 0

    def record(self, cfg, store, model_cfg):
        if cfg.diffusion.objective != "flow":
            raise LossTermError(f"--velocity-cosine-weight {cfg.diffusion.velocity_cosine_weight:g} is a flow option "
                                f"(the cosine to the velocity the model predicts); --objective is "
                                f"{cfg.diffusion.objective}: add --objective flow, or leave it out")
        return {}

    def build(self, cfg, model_cfg, resolved, module, train_module):
        return _Cosine(cfg.diffusion.velocity_cosine_weight)

    def describe(self, cfg, model_cfg, resolved, module):
        return (f"velocity cosine: loss += {cfg.diffusion.velocity_cosine_weight:g} x mean(1 - cos(output, velocity)) "
                "over the channels at each position (LightningDiT's cosine loss)")

    def flag(self, cfg):
        return f"--velocity-cosine-weight {cfg.diffusion.velocity_cosine_weight:g}"


class _Cosine:
    """VelocityCosine as the step calls it: the weight, and no module or hidden tokens."""

    hidden = module = train_module = None

    def __init__(self, weight: float):
        self.weight = weight

    def __call__(self, fwd: Forward) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        v = flow_velocity(fwd.x0, fwd.noise).float()  # (N, C, H, W), the target
        cos = F.cosine_similarity(fwd.output.float(), v, dim=1)  # (N, H, W): over the channels
        loss = (1 - cos).mean()  # over the positions, then the batch (every sample has as many)
        return self.weight * loss, {"velocity_cosine_loss": loss.detach()}


# ----------------------------------------------------------------------------- the table

LOSS_TERMS: dict[str, LossTerm] = {
    "repa": Repa(),
    "velocity_cosine": VelocityCosine(),
}


def on(cfg: TrainConfig) -> list[LossTerm]:
    """The entries on for this config, in table order (the order their modules join the optimizer)."""
    return [term for term in LOSS_TERMS.values() if term.on(cfg)]


def feature_set(cfg: TrainConfig) -> str | None:
    """The store's feature set the run reads (opened with the store: batch["feat"]), or None."""
    wanted = {term.name: term.features(cfg) for term in on(cfg) if term.features(cfg)}
    if len(set(wanted.values())) > 1:
        raise LossTermError(f"loss terms {', '.join(wanted)} read different feature sets "
                            f"({', '.join(map(repr, wanted.values()))}); a run reads one")
    return next(iter(wanted.values()), None)


def modules(cfg: TrainConfig, model_cfg: DiTConfig, resolved: dict, device) -> dict[str, nn.Module]:
    """{state_key: module} of the terms on that train one beside the model, in table order."""
    out = {}
    for term in on(cfg):
        module = term.make_module(cfg, model_cfg, resolved, device)
        if module is not None:
            out[term.state_key] = module
    return out


def trained(built: dict[str, nn.Module]) -> list[nn.Parameter]:
    """The parameters the terms' modules add to the optimizer and the clipping, after the model's."""
    return [p for module in built.values() for p in module.parameters() if p.requires_grad]


def build(cfg: TrainConfig, model_cfg: DiTConfig, resolved: dict, built: dict[str, nn.Module], wrap=None) -> list:
    """The terms as the step calls them; wrap(module): what the forward calls (DDP over ranks)."""
    out = []
    for term in on(cfg):
        module = _module(term, built)
        train_module = wrap(module) if module is not None and wrap is not None else module
        out.append(term.build(cfg, model_cfg, resolved, module, train_module))
    return out


def describe(cfg: TrainConfig, model_cfg: DiTConfig, resolved: dict, built: dict[str, nn.Module]) -> list[str]:
    """The startup lines of the terms on (--repa: what is aligned to what)."""
    lines = (term.describe(cfg, model_cfg, resolved, _module(term, built)) for term in on(cfg))
    return [line for line in lines if line is not None]


def _module(term: LossTerm, built: dict[str, nn.Module]) -> nn.Module | None:
    return built.get(term.state_key) if term.state_key else None


def shown(cfg: TrainConfig) -> tuple[str, ...]:
    """The metrics the progress bar shows beside the loss, in table order."""
    return tuple(name for term in on(cfg) for name in term.shown)


def hidden_block(terms) -> int | None:
    """The one block whose hidden tokens the step's terms read (the model returns one block's)."""
    blocks = {term.hidden for term in terms if term.hidden is not None}
    if len(blocks) > 1:
        raise LossTermError(f"loss terms read the hidden tokens of blocks {sorted(blocks)}; the model returns "
                            "one block's")
    return next(iter(blocks), None)


__all__ = ["LOSS_TERMS", "Cost", "Forward", "LossTerm", "LossTermError", "Repa", "VelocityCosine", "build", "describe",
           "feature_set", "hidden_block", "modules", "on", "shown", "trained"]
