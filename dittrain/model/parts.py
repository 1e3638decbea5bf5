"""The DiT's block parts: one registry per kind of part (MLP, norm, position), one entry per
variant, and everything the code knows of a part is in its entry. Read by the DiT that builds
the parts (dittrain.model.dit), DiTConfig's checks, widths and FLOPs and the custom spec
(dittrain.model.sizes), the attention kernel choice (dittrain.model.attention), the help of
`dittrain models --model` and `run --model`, `dittrain plan` (dittrain.plan.throughput,
dittrain.plan.footprint), reading plain state dicts (dittrain.inference.weights) and the bench
that measures the memory table (bench/activation_memory.py).

    MLPS       DiTConfig.mlp   gelu: DiT's tanh-GELU MLP | swiglu: LightningDiT's silu(x W1) * (x W3), then W2
    NORMS      DiTConfig.norm  layer: DiT's LayerNorm (no affine) | rms: LightningDiT's RMSNorm (learned weight)
    POSITIONS  DiTConfig.pos   sincos: DiT's fixed 2-D table added to the tokens | rope: 2-D rotary q and k,
                               no table | sincos+rope: both, LightningDiT's (the table added AND q, k rotated)

The first entry of each is DiT's own and the default; the LightningDiT presets
(mlp=swiglu, norm=rms, pos=sincos+rope) and `custom:...,mlp=swiglu,norm=rms,pos=...` choose the
others. pos=rope (no pos_embed) is what the LightningDiT presets meant before they matched the
reference; runs and checkpoints made with it keep loading and sampling as they trained. A registry is a mapping name ->
entry in that order (iterating it gives the names), and its entries say:

    MlpPart(name, module, width, matmuls)
        module(D, H)       the block's MLP, x (N, T, D) -> (N, T, D)
        width(M)           its hidden width H from the GELU width M = int(mlp_ratio * D)
        matmuls            matmuls of D x H per token: its multiply-adds are matmuls * T * D * H
    NormPart(name, module)
        module(D)          an adaLN-modulated norm (norm1, norm2, norm_final)
    PositionPart(name, table, rotary, check)
        table(D, (h, w))   (h w, D) added to the tokens; the configured square grid's is the
                           frozen pos_embed parameter (the released checkpoints' key). None: no table
        rotary(head_dim, (h, w), device)   (cos, sin), each (h w, head_dim): q and k of every
                           self-attention rotated (dittrain.model.layers.apply_rope). None: none
        check(D, heads)    why these widths cannot take it (one line), or None

How an entry enters `dittrain plan`'s activation-memory model (dittrain.plan.footprint): its
name is its part of the measured table's key ("gelu,layer,sincos,noqk" is DiT's block), an MLP's
width is the table's T*H feature and a rotary part's tables its T*head_dim one. The coefficients
themselves are measured, per combination of the registered parts (bench/activation_memory.py
--table); a combination the table has no row for is refused by `dittrain plan` in one line.

The module (torch) is built lazily: this file imports no torch, so the CLI's help and
dittrain.config's readers stay light; the built-in parts' torch code is dittrain.model.layers,
imported when a model is built. A state dict is read as the first part whose module has its
shapes (dittrain.inference.weights), so a part with another's shapes is told apart only by name.

Adding a part: its module (dittrain.model.layers, or code of your own) and its entry below, or
MLPS.register(MlpPart(...)) at run time; tests/test_block_parts.py does it end to end.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar


def _layers(name: str) -> Callable:
    """dittrain.model.layers.<name>, imported at its first call: torch loads when a model is built,
    not when these names are read."""

    def call(*args, **kwargs):
        from dittrain.model import layers

        return getattr(layers, name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


def _any_width(hidden: int, heads: int) -> str | None:
    return None


@dataclass(frozen=True)
class MlpPart:
    """An MLP of the blocks (the module docstring)."""

    name: str
    module: Callable[[int, int], Any]  # (D, H) -> the block's mlp
    width: Callable[[int], int]  # GELU width M -> H; non-decreasing, without bound
    matmuls: int  # of D x H, per token

    def gelu_widths(self, hidden: int) -> list[int]:
        """The GELU widths M whose hidden width is `hidden` (SwiGLU: two M may give one H'), smallest
        first; [] when the rule gives no M that width."""
        lo, hi = 1, max(1, hidden)
        while self.width(hi) < hidden:
            if hi > 2 ** 40:  # a rule that never gets there
                return []
            hi *= 2
        while lo < hi:  # the smallest M with width(M) >= hidden
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if self.width(mid) < hidden else (lo, mid)
        out = []
        while self.width(lo + len(out)) == hidden:
            out.append(lo + len(out))
        return out


@dataclass(frozen=True)
class NormPart:
    """A norm of the blocks and the final layer (the module docstring)."""

    name: str
    module: Callable[[int], Any]  # D -> the norm


@dataclass(frozen=True)
class PositionPart:
    """How token positions enter the network (the module docstring)."""

    name: str
    table: Callable | None = None  # (D, (h, w)) -> (h w, D), added to the tokens
    rotary: Callable | None = None  # (head_dim, (h, w), device=) -> (cos, sin), each (h w, head_dim)
    check: Callable[[int, int], str | None] = _any_width  # (D, heads) -> why not, or None

    def step_table(self, tokens: int, head_dim: int) -> int:
        """Elements of the rotary table (cos and sin, (T, head_dim) each) a training step holds:
        the footprint's "rope" feature; 0 without one."""
        return tokens * head_dim if self.rotary is not None else 0


P = TypeVar("P", MlpPart, NormPart, PositionPart)
# a name appears in custom specs ("key=value,..."), in help ("a|b") and in the memory table's keys
# ("mlp,norm,pos,qk/dtype/kernel")
_NAME = re.compile(r"[A-Za-z0-9_.+-]+")


class Registry(Mapping, Generic[P]):
    """The parts of one kind, name -> entry, in the order they are listed (DiT's first)."""

    def __init__(self, field: str, *parts: P):
        self.field = field  # the DiTConfig field, and the custom spec's key
        self._parts: dict[str, P] = {}
        for part in parts:
            self.register(part)

    def register(self, part: P) -> P:
        """Add `part` (after the others); a name already taken is refused."""
        if not _NAME.fullmatch(part.name):
            raise ValueError(f"{self.field}={part.name!r}: a part's name is letters, digits and _ . + - only")
        if part.name in self._parts:
            raise ValueError(f"{self.field}={part.name} is registered already")
        self._parts[part.name] = part
        return part

    def unregister(self, name: str) -> P:
        """Remove part `name` (its name is unknown again) and return it."""
        return self._parts.pop(name)

    def __getitem__(self, name: str) -> P:
        return self._parts[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)

    def __repr__(self) -> str:
        return f"Registry({self.field}: {'|'.join(self)})"


def _rope_check(hidden: int, heads: int) -> str | None:
    # 2-D RoPE: half of each head's dims turn with the row, half with the column, in pairs
    if (hidden // heads) % 4:
        return (f"pos=rope needs a head dim (hidden / heads = {hidden // heads}) that is a multiple of 4 (row and "
                "column halves, rotated in pairs)")
    return None


def _sincos_check(hidden: int, heads: int) -> str | None:
    # the table's channels: a [sin, cos] half per axis, each of D/4 frequencies
    return f"hidden {hidden} is not a multiple of 4 (the 2-D sin-cos position embedding needs it)" if hidden % 4 else None


def _both_check(hidden: int, heads: int) -> str | None:
    # the table's width rule and the rotation's head-dim rule, each worded as its own part words it
    problem = _sincos_check(hidden, heads) or _rope_check(hidden, heads)
    return problem and problem.replace("pos=rope", "pos=sincos+rope")


MLPS: Registry[MlpPart] = Registry(
    "mlp",
    MlpPart("gelu", _layers("Mlp"), width=lambda m: m, matmuls=2),  # fc1 D -> M, fc2 M -> D
    # three matmuls (W1 and W3 fused as one D -> 2H' matmul, W2), so H' = floor(2M / 3) keeps the
    # weights at the GELU MLP's 2DM (exactly when 3 divides M: D = 768 -> 2048, 1152 -> 3072) and its
    # biases 2H' + D instead of M + D. That is LightningDiT's rounding (int(2/3 * M)), so its parameter
    # counts are theirs
    MlpPart("swiglu", _layers("SwiGLU"), width=lambda m: 2 * m // 3, matmuls=3),
)
NORMS: Registry[NormPart] = Registry(
    "norm",
    NormPart("layer", _layers("layer_norm")),
    NormPart("rms", _layers("rms_norm")),
)
POSITIONS: Registry[PositionPart] = Registry(
    "pos",
    PositionPart("sincos", table=_layers("sincos_pos_embed_2d"), check=_sincos_check),
    # no pos_embed at all: the positions enter the attention, the tables computed in each forward
    PositionPart("rope", rotary=_layers("rope_table"), check=_rope_check),
    # LightningDiT's (hustvl/LightningDiT models/lightningdit.py @ 2725fed4: `x_embedder(x) +
    # self.pos_embed` whatever use_rope says, and with use_rope EVA-02's 2-D rotary on q and k of
    # every block): the frozen sin-cos pos_embed added to the tokens AND q, k rotated
    PositionPart("sincos+rope", table=_layers("sincos_pos_embed_2d"), rotary=_layers("rope_table"), check=_both_check),
)
BLOCK_PARTS = (MLPS, NORMS, POSITIONS)  # in DiTConfig's and the custom spec's order


def spec_choices() -> str:
    """The block choices of a custom spec, as the help lists them: ",mlp=gelu|swiglu,norm=..,pos=.."."""
    return "".join(f",{parts.field}={'|'.join(parts)}" for parts in BLOCK_PARTS)


__all__ = ["BLOCK_PARTS", "MLPS", "NORMS", "POSITIONS", "MlpPart", "NormPart", "PositionPart", "Registry",
           "spec_choices"]
