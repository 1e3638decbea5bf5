"""What one training step holds in device memory, predicted without allocating anything: a
model of the trainer's own tensors (`dittrain plan`, issue 27).

    fp = footprint(Setting(config, micro_batch=64, accumulation=4, mode="every", precision="bf16"))
    fp.peak, fp.parts()       bytes: weights, ema, optimizer, gradients, activations, workspace, data

The terms, each from what the trainer builds (dittrain.train.loop._build, dittrain.train.step.TrainStep):

  weights      fp32 master weights: every parameter of the DiT (the frozen pos_embed too) and of
               the loss terms' modules, --repa's projector (ModelParts: the real model counted on
               the meta device; a term's Cost, dittrain.train.losses)
  ema          the EMA copy of the DiT (a term's module has none)
  --lora       (Setting.lora) the base frozen: weights are the base's plus the adapter's A and B, the
               EMA, the optimizer state and the gradients the adapter's alone (the final layer has
               none); activations and autocast copies as a full run's (the frozen linears' inputs are
               still kept: their input gradient needs the weights, and the adapter's A needs the input).
               A bound: the frozen conditioning path (embedders, adaLN) keeps less than the table, which
               full runs measured: 5-11% above the CPU allocator's peak on S/2 and B/2 (bench/lora_memory.py)
  optimizer    the state of the real optimizer class (optimizer_state_bytes: one step of
               dittrain.train.optim.build_optimizer's optimizer on probe tensors of every size)
  gradients    fp32 gradients of the trainable parameters, those alive at the peak
  activations  what the forward keeps for the backward: activation_table.json's bytes per
               sample per block and checkpointing mode (measured by bench/activation_memory.py
               --table as coefficients of T*D, T*H, T*heads, ...) at this model's sizes, plus
               autocast's bf16/fp16 copies of the weights the saved matmuls read
  workspace    the transient of the block whose backward (or forward) runs at the peak: its
               recomputation (checkpointed modes: what "none" keeps and the mode does not). The
               backward's own temporaries (one op's gradient buffers) are left out: the peaks
               measured on the CPU allocator lie up to 3.5% above the prediction (bench/RESULTS.md)
  data         the micro-batch on the device (latents, a term's tensors: REPA targets) and a store held there

The peak is the largest of four moments of a step (Footprint.moment names it): the end of the
forward (the autocast cache still holds every weight copy), the backward of the last block
(every activation kept, the first gradients), the backward of the first block (most gradients
allocated), and the optimizer step (every gradient, no activation). From the second micro-batch
of an accumulation on, every gradient is alive throughout. bf16 and fp16 use the bf16 rows (the
same widths); the bench measured them under CPU autocast: the assumption is that CUDA's autocast
treats the DiT's ops as the CPU's does (matmuls, convolutions and attention in 16 bits; norms,
the residual stream and the loss in fp32), which `bench/activation_memory.py --check --device
cuda` verifies on a GPU.

The table (dittrain/plan/activation_table.json, data: measured, not worked out) holds coefficients of
the features below, fitted exactly by the bench on small shapes, so a new model size needs no
new measurement. Its keys begin with the block kind, "mlp,norm,pos,qk": the names of the block's
parts (dittrain.model.parts; block_kind), the bench measuring every combination registered; a
part the table has no rows for is refused in one line (FootprintError), a new size of a known one
is not:
  BLOCK["mlp,norm,pos,qk/dtype/kernel"][mode]  one block: per sample BLOCK_SAMPLE, then per step
      BLOCK_FIXED; kernel: fused (flash, memory-efficient, cuDNN or the CPU's flash attention:
      the output and a logsumexp are kept) or math (the attention matrix too: the T*T*heads column)
  OUTSIDE["mlp,norm,pos,qk/dtype/loss"]  "head" (the embedders) and "tail" (the final layer and
      the loss), each per sample OUTSIDE_SAMPLE, per step OUTSIDE_FIXED
  REPA[dtype]  --repa's projector and targets: REPA_FEATURES (a loss term's row: its Cost names it)
dtype: fp32, or bf16 (CPU autocast; fp16 reads the same rows).

A loss term is in the footprint through its entry (dittrain.train.losses.LOSS_TERMS): Setting's
field of the entry's name holds its planned settings (repa: block, projector width, target
dims), and the entry's cost() of them says its parameters, its table row and features, its
batch tensors (term_costs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

from ditdata.common.errors import UserError
from dittrain.model.parts import BLOCK_PARTS, POSITIONS
from dittrain.model.routing import Route, block_tokens, full_precision_block
from dittrain.model.sizes import DiTConfig
from dittrain.train.losses import LOSS_TERMS, Cost

TABLE = Path(__file__).with_name("activation_table.json")


@lru_cache(maxsize=1)
def activation_table() -> SimpleNamespace:
    """The measured table (SOURCE, BLOCK, OUTSIDE, REPA), read once, when a footprint needs it."""
    return SimpleNamespace(**json.loads(TABLE.read_text()))


# The features the table's coefficients multiply (activation_table.json; the bench fits them).
# One block on T tokens, per sample: T*D, T*H (the MLP's hidden width, its part's width rule), T*heads, T, D, T*T*heads
# (the attention matrix, which only the math kernel keeps).
BLOCK_SAMPLE = ("TD", "TH", "Th", "T", "D", "TTh")
# One block, per step: the parameters of its attention and adaLN linear layers (together: both are
# 10 (D^2 + D), in a fixed ratio) and of its MLP's: the autocast copies the saved matmuls keep.
BLOCK_FIXED = ("attn+ada", "mlp")
# Outside the blocks (embedders, final layer, the loss), per sample: T*D, latent elements, D, 1;
# per step: linear/convolution parameters outside the blocks, the rotary table of a rotary position
# part (T*head_dim: RoPE's; 0 for sin-cos), 1.
OUTSIDE_SAMPLE = ("TD", "E", "D", "1")
OUTSIDE_FIXED = ("linear", "rope", "1")
# --repa's projector and targets, per sample: T*width, T*target dims, T*D, T; per step: its linear
# parameters (dittrain.train.losses.Repa.cost gives them).
REPA_FEATURES = ("TP", "TY", "TD", "T", "linear")
MODES = ("none", "every", "selective", "attn", "mlp")  # what the table has; k is every + none
FP32, HALF = "fp32", "bf16"  # the table's two dtypes; fp16 uses the bf16 rows (same widths)
PARTS = ("weights", "ema", "optimizer", "gradients", "activations", "workspace", "data")


class FootprintError(UserError, ValueError):
    """A setting the memory model has no measured row for (one line)."""


# ----------------------------------------------------------------------------- features


def block_kind(config: DiTConfig) -> str:
    """The block's parts by name (and QK-norm), as the table's key: "gelu,layer,sincos,noqk" is DiT's
    own block."""
    return ",".join((*(getattr(config, parts.field) for parts in BLOCK_PARTS), "qk" if config.qk_norm else "noqk"))


def loss_kind(objective: str, learn_sigma: bool) -> str:
    """The loss's key: ddpm-sigma (DiT: eps MSE + the VLB term), ddpm, flow."""
    return "flow" if objective == "flow" else ("ddpm-sigma" if learn_sigma else "ddpm")


def block_sample(config: DiTConfig, tokens: int, head: bool = False) -> tuple[int, ...]:
    """The BLOCK_SAMPLE features of one block; head: a DDT head's (its width, heads and MLP, and its adaLN
    regressed per token: what a trunk block keeps per sample of width D (the modulation's input and its
    shifts, scales and gates) it keeps for each of the T tokens, so the D feature is T x W)."""
    if head:
        T, W, h = tokens, config.head_hidden, config.head_heads
        return (T * W, T * config.head_mlp_hidden, T * h, T, T * W, T * T * h)
    T, D, h = tokens, config.hidden_size, config.num_heads
    return (T * D, T * config.mlp_hidden, T * h, T, D, T * T * h)


def outside_sample(config: DiTConfig, part: str = "head") -> tuple[int, ...]:
    """The OUTSIDE_SAMPLE features of the embedders ("head") or the final layer and the loss ("tail"); a
    DiT^DH's final layer is at the DDT head's width, modulated per token (its D feature T x W, as the
    head's blocks)."""
    T, D = config.num_tokens, config.hidden_size
    if part == "tail" and config.head_depth:
        return (T * config.head_hidden, config.in_channels * config.input_size ** 2, T * config.head_hidden, 1)
    return (T * D, config.in_channels * config.input_size ** 2, D, 1)


def ddt_wiring_bytes(config: DiTConfig, dtype: str) -> int:
    """Bytes per sample a DDT head's wiring keeps beyond its blocks and final layer: silu(t + s)'s input
    and output (T x D each: SiLU's backward and s_projector's matmul read them; the residual stream's fp32,
    the matmul's input its 16-bit cast under autocast) and the condition s (T x W, s_projector's output,
    shared by every head block's adaLN and the final layer's: counted once); 0 without a head."""
    if not config.head_depth:
        return 0
    T, D, W = config.num_tokens, config.hidden_size, config.head_hidden
    return 4 * T * D + (4 if dtype == FP32 else 2) * (T * D + T * W)


def outside_fixed(config: DiTConfig) -> tuple[int, ...]:
    rope = POSITIONS[config.pos].step_table(config.num_tokens, config.head_dim)
    return (model_parts(config).outside_linear, rope, 1)


def dot(coefficients, features) -> float:
    return sum(c * f for c, f in zip(coefficients, features, strict=True))


@dataclass(frozen=True)
class ModelParts:
    """Parameter counts of the real DiT (built on the meta device: nothing is allocated)."""

    total: int  # every parameter (the frozen pos_embed too): the weights and the EMA
    trainable: tuple[int, ...]  # numel of each trainable parameter: gradients, optimizer state
    block: int  # trainable parameters of one block
    block_linear: tuple[int, int]  # linear parameters of a block's attention + adaLN, and of its MLP
    outside_linear: int  # linear and convolution parameters outside the blocks (a DDT head's blocks too)
    head_block: int = 0  # a DiT^DH: trainable parameters of one DDT head block
    head_block_linear: tuple[int, int] = (0, 0)  # ... and its linear parameters, as block_linear
    # --lora: the EMA holds the adapter alone (its frozen base is the model's own tensors) and the final layer
    # is frozen (no gradient); a full run: the EMA is a copy of every parameter, the final layer trains
    ema: int | None = None  # parameters the EMA holds (None: total)
    final_trainable: bool = True


@lru_cache(maxsize=64)
def model_parts(config: DiTConfig, lora: tuple[int, str] | None = None) -> ModelParts:
    """lora: (rank, targets) of --lora: the base frozen, the adapter's A (r x in) and B (out x r) of each
    targeted linear trainable (dittrain.model.lora's target_names on this model)."""
    import torch

    from dittrain.model.dit import DiT

    with torch.device("meta"):
        model = DiT(replace(config, grad_checkpointing="none"))
    if lora is not None:
        return _lora_parts(model, config, *lora)

    def linear(block) -> tuple[int, int]:
        groups = {"attn": 0, "mlp": 0, "adaLN_modulation": 0}
        for name, p in block.named_parameters():
            top = name.split(".")[0]
            if top in groups and _in_linear(block, name):
                groups[top] += p.numel()
        return groups["attn"] + groups["adaLN_modulation"], groups["mlp"]

    heads = list(getattr(model, "head_blocks", ()))
    blocks = {id(p) for b in (*model.blocks, *heads) for p in b.parameters()}
    outside = sum(p.numel() for name, p in model.named_parameters() if id(p) not in blocks and _in_linear(model, name))
    return ModelParts(total=sum(p.numel() for p in model.parameters()),
                      trainable=tuple(p.numel() for p in model.parameters() if p.requires_grad),
                      block=sum(p.numel() for p in model.blocks[0].parameters() if p.requires_grad),
                      block_linear=linear(model.blocks[0]), outside_linear=outside,
                      head_block=sum(p.numel() for p in heads[0].parameters() if p.requires_grad) if heads else 0,
                      head_block_linear=linear(heads[0]) if heads else (0, 0))


def _lora_parts(model, config: DiTConfig, rank: int, targets: str) -> ModelParts:
    """ModelParts of --lora RANK on `targets`: trainable are the adapters' A and B (r (in + out) per linear),
    the EMA holds them alone; the weights, the activations and the autocast copies are the base's (the
    adapter's own activations, r per token and linear, are left out: r / D of a linear's input)."""
    from dittrain.model.lora import target_names

    full = model_parts(config)
    names = target_names(model, targets)
    pairs = {n: (rank * model.get_submodule(n).in_features, model.get_submodule(n).out_features * rank) for n in names}
    trainable = tuple(x for pair in pairs.values() for x in pair)

    def in_block(prefix: str) -> int:
        return sum(sum(pair) for n, pair in pairs.items() if n.startswith(prefix))

    return replace(full, total=full.total + sum(trainable), trainable=trainable, block=in_block("blocks.0."),
                   head_block=in_block("head_blocks.0.") if config.head_depth else 0, ema=sum(trainable),
                   final_trainable=False)


def _in_linear(module, name: str) -> bool:
    """Whether parameter `name` belongs to a Linear or Conv2d (what autocast copies to 16 bits)."""
    import torch.nn as nn

    owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
    return isinstance(owner, nn.Linear | nn.Conv2d)


# ----------------------------------------------------------------------------- optimizer state

# Probe tensor sizes: every power of two from 64 to 262,144 elements (bitsandbytes keeps 32-bit
# state below 4,096 elements: the ladder crosses it); a parameter between two rungs is interpolated.
_LADDER = tuple(2 ** k for k in range(6, 19))


@lru_cache(maxsize=4)
def _state_ladder(optimizer: str) -> tuple[tuple[int, int], ...]:
    """(numel, state bytes) of the real optimizer (dittrain.train.optim.build_optimizer, on the CPU)
    for one parameter of each ladder size, after one step; storages shared between parameters
    (bitsandbytes' quantisation maps) are left out."""
    import torch

    from dittrain.config import TrainConfig
    from dittrain.train.optim import build_optimizer

    params = [torch.nn.Parameter(torch.zeros(n)) for n in _LADDER]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = build_optimizer(TrainConfig.from_flat(optimizer=optimizer), params, torch.device("cpu"))
    opt.step()
    owners: dict[int, set[int]] = {}
    for i, p in enumerate(params):
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor):
                owners.setdefault(v.untyped_storage().data_ptr(), set()).add(i)
    rows = []
    for i, p in enumerate(params):
        seen = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for v in opt.state[p].values()
                if isinstance(v, torch.Tensor) and len(owners[v.untyped_storage().data_ptr()]) == 1}
        rows.append((_LADDER[i], sum(seen.values())))
    return tuple(rows)


def optimizer_state_bytes(optimizer: str, numels) -> int:
    """Bytes of the optimizer's state for parameters of these sizes."""
    ladder = _state_ladder(optimizer)
    return sum(_interpolate(ladder, n) for n in numels)


def _interpolate(ladder, n: int) -> float:
    (n0, b0), (n1, b1) = ladder[0], ladder[1]
    for (lo, blo), (hi, bhi) in zip(ladder, ladder[1:], strict=False):
        if n <= hi:
            (n0, b0), (n1, b1) = (lo, blo), (hi, bhi)
            break
    else:
        (n0, b0), (n1, b1) = ladder[-2], ladder[-1]
    if n < n0:  # below the smallest rung: its bytes per element
        return b0 * n / n0
    return b0 + (b1 - b0) * (n - n0) / (n1 - n0)


# ----------------------------------------------------------------------------- the setting


@dataclass(frozen=True)
class Setting:
    """What decides a step's memory: the model, the micro-batch and the settings that change it."""

    config: DiTConfig  # the model as the store implies it (its grad_checkpointing is not read: mode is)
    micro_batch: int = 1  # samples per forward on this device
    accumulation: int = 1  # micro-batches per optimizer step
    mode: str | int = "none"  # --grad-checkpointing: none | every | k | attn | mlp | selective
    precision: str = FP32  # the autocast dtype: fp32 | bf16 | fp16 (resolved, never auto)
    optimizer: str = "adamw"
    kernel: str = "fused"  # the self-attention kernel: fused (flash, efficient, cudnn, CPU flash) | math
    loss: str = "ddpm-sigma"  # loss_kind()
    route: Route | None = None  # --route
    # the loss terms' planned settings, one field per entry of dittrain.train.losses.LOSS_TERMS that
    # plans, named after it (its planned(); None: off): term_costs reads them through the entry
    repa: tuple[int, int, int] | None = None  # --repa: (block, projector width, target dims)
    resident_bytes: int = 0  # a store held on this device (--resident-device cuda)
    lora: tuple[int, str] | None = None  # --lora: (rank, targets); None: a full run

    @property
    def dtype(self) -> str:
        return FP32 if self.precision == FP32 else HALF


@dataclass(frozen=True)
class Footprint:
    """Bytes at the predicted peak of a step, by part (PARTS), and the moment it happens."""

    weights: int
    ema: int
    optimizer: int
    gradients: int
    activations: int
    workspace: int
    data: int
    moment: str
    moments: dict = field(default_factory=dict, compare=False)  # every moment's total bytes

    @property
    def peak(self) -> int:
        return sum(getattr(self, name) for name in PARTS)

    def parts(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in PARTS}


def _row(rows: dict, key: str, what: str):
    try:
        return rows[key]
    except KeyError:
        raise FootprintError(f"no measured activation memory for {what} ({key}); measure it with "
                             "`python bench/activation_memory.py --table`") from None


def block_modes(mode: str | int, depth: int) -> list[str]:
    """The table mode of each block for --grad-checkpointing `mode` (k: every k-th block
    checkpointed, counting from the first, as dittrain.model.dit.DiT.forward does)."""
    k = int(mode) if str(mode).isdigit() else None
    if k is not None:
        if k < 1:
            raise FootprintError(f"--grad-checkpointing {mode}: k must be >= 1")
        return ["every" if i % k == 0 else "none" for i in range(depth)]
    if mode not in MODES:
        raise FootprintError(f"--grad-checkpointing {mode}: choose none, every, k, attn, mlp or selective")
    return [str(mode)] * depth


class _Blocks:
    """Kept bytes and recomputation of each block of a setting."""

    def __init__(self, s: Setting):
        cfg = s.config
        self.s, self.cfg, self.parts = s, cfg, model_parts(cfg, s.lora)
        rows = _row(activation_table().BLOCK, f"{block_kind(cfg)}/{s.dtype}/{s.kernel}", f"{block_kind(cfg)} blocks")
        # the trunk's blocks, then a DiT^DH's head blocks (the same kind at the head's width; the knob counts
        # over both, as DiT.forward does; a route only ever covers trunk blocks)
        self.n = cfg.depth + cfg.head_depth
        self.head = [False] * cfg.depth + [True] * cfg.head_depth
        self.modes = block_modes(s.mode, self.n)
        self.tokens = [*block_tokens(s.route, cfg.depth, cfg.num_tokens), *[cfg.num_tokens] * cfg.head_depth]
        # each block's rows: a 16-bit step's fp32 ones for the block a TREAD route runs with autocast off
        self.rows = [rows] * self.n
        self.full = full_precision_block(s.route, cfg.depth) if s.dtype != FP32 else None
        if self.full is not None:
            self.rows[self.full] = _row(activation_table().BLOCK, f"{block_kind(cfg)}/{FP32}/{s.kernel}",
                                        f"{block_kind(cfg)} blocks in fp32")

    def linear(self, i: int) -> tuple[int, int]:
        """Block i's linear parameters (attention + adaLN, MLP): a trunk block's or a head block's."""
        return self.parts.head_block_linear if self.head[i] else self.parts.block_linear

    def params(self, i: int) -> int:
        return self.parts.head_block if self.head[i] else self.parts.block

    def kept(self, i: int, mode: str | None = None) -> float:
        """What block i keeps for the backward in `mode` (default: its own)."""
        coef, n = self.rows[i][mode or self.modes[i]], len(BLOCK_SAMPLE)
        return (self.s.micro_batch * dot(coef[:n], block_sample(self.cfg, self.tokens[i], self.head[i]))
                + dot(coef[n:], self.linear(i)))

    def recompute(self, i: int) -> float:
        """What block i's checkpointed part makes again (in its forward too, transiently)."""
        return max(0.0, self.kept(i, "none") - self.kept(i))

    def saved_casts(self) -> float:
        """The 16-bit weight copies the kept activations hold (saved by non-checkpointed matmuls)."""
        n = len(BLOCK_SAMPLE)
        return sum(dot(rows[m][n:], self.linear(i)) for i, (rows, m) in enumerate(zip(self.rows, self.modes, strict=True)))


def _outside_row(s: Setting):
    return _row(activation_table().OUTSIDE, f"{block_kind(s.config)}/{s.dtype}/{s.loss}", f"the {s.loss} loss")


def _outside_kept(s: Setting, part: str) -> float:
    """What the embedders ("head") or the final layer and the loss ("tail") keep."""
    cfg, coef, n = s.config, _outside_row(s)[part], len(OUTSIDE_SAMPLE)
    return s.micro_batch * dot(coef[:n], outside_sample(cfg, part)) + dot(coef[n:], outside_fixed(cfg))


def term_costs(s: Setting) -> list[Cost]:
    """What the loss terms planned in `s` add to its step: each entry's cost of Setting's field of
    its name (dittrain.train.losses), on the tokens that reach each block (the kept ones when routed)."""
    tokens = block_tokens(s.route, s.config.depth, s.config.num_tokens)
    return [term.cost(s.config, tokens, planned) for name, term in LOSS_TERMS.items()
            if (planned := getattr(s, name, None)) is not None]


def _terms_kept(s: Setting, costs: list[Cost]) -> float:
    """What the loss terms keep for the backward: per sample their table row's coefficients of
    their features, per step its last coefficient of their parameter count."""
    kept = []
    for c in (c for c in costs if c.table):
        coef, n = _row(getattr(activation_table(), c.table), s.dtype, c.what), len(c.per_sample)
        kept.append(s.micro_batch * dot(coef[:n], c.per_sample) + dot(coef[n:], (sum(c.params),)))
    return sum(kept)


def kept_bytes(s: Setting) -> float:
    """Everything the forward keeps for the backward (the activations at the backward's start)."""
    blocks = _Blocks(s)
    return (sum(blocks.kept(i) for i in range(blocks.n)) + _outside_kept(s, "head") + _outside_kept(s, "tail")
            + _terms_kept(s, term_costs(s)) + s.micro_batch * ddt_wiring_bytes(s.config, s.dtype))


def _cast_cache(s: Setting, blocks: _Blocks) -> float:
    """The 16-bit weight copies autocast holds until the forward ends beyond those the kept
    activations count: the ones of checkpointed blocks."""
    if s.dtype == FP32:
        return 0.0
    # the blocks under autocast (not a route's fp32 one)
    cast = sum(sum(blocks.linear(i)) for i in range(blocks.n) if i != blocks.full)
    every = 2.0 * (cast + blocks.parts.outside_linear)
    n = len(OUTSIDE_SAMPLE)
    saved = blocks.saved_casts() + sum(_outside_row(s)[p][n] for p in ("head", "tail")) * blocks.parts.outside_linear
    return max(0.0, every - saved)


def footprint(s: Setting) -> Footprint:
    """The predicted peak of one training step of setting `s` (module docstring)."""
    cfg, parts, blocks, costs = s.config, model_parts(s.config, s.lora), _Blocks(s), term_costs(s)
    extra = tuple(n for c in costs for n in c.params)  # the terms' modules: trained beside the model
    trainable = (*parts.trainable, *extra)
    grads = 4 * sum(trainable)
    kept = [blocks.kept(i) for i in range(blocks.n)]
    # the embedders' activations (and the terms', REPA's backward coming with the aligned block's)
    # stay to the end of the backward; the final layer's and the loss's go before the blocks' backward;
    # a DDT head's wiring (s and silu(t + s)) before the trunk's
    head, tail = _outside_kept(s, "head") + _terms_kept(s, costs), _outside_kept(s, "tail")
    wiring = s.micro_batch * ddt_wiring_bytes(cfg, s.dtype)
    # the micro-batch on the device: float32 latents and labels; the terms' tensors (REPA's int8
    # targets and scales)
    per_sample = 4 * cfg.in_channels * cfg.input_size ** 2 + 8 + sum(c.data_per_sample for c in costs)
    last, data = blocks.n - 1, s.micro_batch * per_sample
    # the final layer's parameters: its adaLN modulation (D -> 2D) and its linear (D -> p^2 x C_out); D is a
    # DiT^DH's head width
    D, pp = cfg.head_hidden if cfg.head_depth else cfg.hidden_size, cfg.patch_size ** 2
    final_layer = 2 * D * D + 2 * D + (D + 1) * pp * cfg.out_channels if parts.final_trainable else 0
    # gradients alive: from the second micro-batch of an accumulation on, all of them; else the
    # backward allocates them block by block, from the final layer down to the first block
    accumulating = s.accumulation > 1
    moments = {  # name: (gradients, activations, workspace, data)
        "forward end": (grads if accumulating else 0, head + sum(kept) + wiring + tail + _cast_cache(s, blocks),
                        max(blocks.recompute(i) for i in range(blocks.n)), data),
        "backward, last block": (grads if accumulating else 4 * (blocks.params(last) + final_layer),
                                 head + sum(kept) + wiring, blocks.recompute(last), data),
        "backward, first block": (grads if accumulating else grads - 4 * parts.block, head + kept[0],
                                  blocks.recompute(0), data),
        "optimizer step": (grads, 0, 0, 0),
    }
    moment, (g, a, w, d) = max(moments.items(), key=lambda kv: sum(kv[1]))
    weights, optimizer = 4 * (parts.total + sum(extra)), int(optimizer_state_bytes(s.optimizer, trainable))
    ema = 4 * (parts.total if parts.ema is None else parts.ema)  # --lora: the adapter's EMA alone
    state = weights + ema + optimizer + s.resident_bytes
    return Footprint(weights=weights, ema=ema, optimizer=optimizer, gradients=int(g), activations=int(a),
                     workspace=int(w), data=int(d) + s.resident_bytes, moment=moment,
                     moments={name: int(state + sum(parts_)) for name, parts_ in moments.items()})


__all__ = ["BLOCK_FIXED", "BLOCK_SAMPLE", "FP32", "ddt_wiring_bytes", "HALF", "MODES", "OUTSIDE_FIXED", "OUTSIDE_SAMPLE", "PARTS",
           "REPA_FEATURES", "Footprint", "FootprintError", "ModelParts", "Setting", "block_kind",
           "block_modes", "block_sample", "dot", "footprint", "kept_bytes", "loss_kind", "model_parts",
           "optimizer_state_bytes", "outside_fixed", "outside_sample", "term_costs"]
