"""The torch code of the DiT's block parts, the modules and tables that dittrain.model.parts names
(its registries say which name builds which, with what width and cost; dittrain.model.dit puts
them into the blocks). Nothing here knows a part's name.

    Mlp, SwiGLU                 the MLPs (D, H) -> a module (N, T, D) -> (N, T, D)
    layer_norm, rms_norm        the adaLN-modulated norms, D -> a module
    sincos_pos_embed_2d         DiT's fixed 2-D sin-cos table, added to the tokens
    rope_table                  2-D axial rotary position embedding: (cos, sin) of a token grid
    rope_rows, apply_rope       the rows of a subset of tokens; q or k rotated by a table

The state-dict names (fc1, fc2, norm weights) are those of the released DiT checkpoints, so they
load strictly. LightningDiT's own SwiGLU names its matmuls w12 (W1 then W3, fused, as fc1 here) and
w3 (as fc2) (hustvl/LightningDiT models/swiglu_ffn.py @ 2725fed4): its files would need those two
renamed, which nothing here does. Importable from dittrain.model.dit too, as before.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# MLPs


class Mlp(nn.Module):
    """DiT's MLP: fc2(gelu_tanh(fc1(x))), D -> H -> D."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class SwiGLU(nn.Module):
    """SwiGLU (Shazeer, 2020): W2 (silu(x W1) * (x W3)). W1 and W3 are one matmul, fc1
    (D -> 2H', W1's rows first), so the block runs three matmuls in two calls; fc2 is W2
    (H' -> D). H' is DiTConfig.mlp_hidden, 2M // 3 of the GELU width M: the GELU MLP's parameters
    (its width rule, dittrain.model.parts)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        a, b = self.fc1(x).chunk(2, dim=-1)  # (N, T, H') each: x W1, x W3
        return self.fc2(F.silu(a) * b)


# -----------------------------------------------------------------------------
# Norms: the adaLN-modulated ones (norm1, norm2, norm_final)


def layer_norm(dim: int) -> nn.Module:
    """DiT's LayerNorm: no affine (the modulation scales and shifts)."""
    return nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)


def rms_norm(dim: int) -> nn.Module:
    """LightningDiT's RMSNorm, x / sqrt(mean x^2 + eps) * w: it keeps its learned weight (its
    parameter counts include it)."""
    return nn.RMSNorm(dim, eps=1e-6)


# -----------------------------------------------------------------------------
# Position embedding


def _grid_positions(grid: int | tuple[int, int], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols), each (h, w) float64: token (i, j) of an h x w grid, row-major (index i * w + j)."""
    h, w = (grid, grid) if isinstance(grid, int) else (int(grid[0]), int(grid[1]))  # a side (square) or (h, w)
    return torch.meshgrid(torch.arange(h, dtype=torch.float64, device=device),
                          torch.arange(w, dtype=torch.float64, device=device), indexing="ij")


def sincos_pos_embed_2d(dim: int, grid: int | tuple[int, int], scale: tuple[float, float] | None = None) -> torch.Tensor:
    """(h * w, dim) for a grid of h rows and w columns (an int: square): the first half of the
    channels encodes the column, the second the row, each as [sin, cos] of the position times
    frequencies 1 / 10000^(i / (dim/4)). This is the MAE/DiT layout (tokens in row-major
    order), computed in float64; a non-square grid is the same formula at its positions.
    scale (sh, sw): the positions of rows and columns multiplied by them (PixArt's interpolation:
    DiTConfig.pos_interpolation); None: 1."""
    assert dim % 4 == 0
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4))  # (D/4,)
    rows, cols = _grid_positions(grid)  # (h, w) each; token index = row * w + col
    if scale is not None:
        rows, cols = rows * scale[0], cols * scale[1]

    def emb_1d(p):
        out = p.reshape(-1)[:, None] * omega[None]  # (M, D/4)
        return torch.cat([torch.sin(out), torch.cos(out)], dim=1)  # (M, D/2)

    # MAE's meshgrid(w, h) puts the COLUMN coordinate in its "emb_h" half; keep that order
    return torch.cat([emb_1d(cols), emb_1d(rows)], dim=1).float()


def rope_table(head_dim: int, grid: int | tuple[int, int], theta: float = 10000.0,
               device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D axial rotary position embedding (RoFormer's rotation, EVA-02's 2-D layout): (cos, sin),
    each (h * w, head_dim) float32 for a grid of h rows and w columns (an int: square), tokens
    in row-major order. The first half of a head's dims turns with the token's row, the second
    half with its column; within each half the pairs (2i, 2i + 1) turn by the angle
    pos * theta^(-2i / (head_dim / 2)), i < head_dim / 4, so both entries of a pair share a
    column of the tables. This is LightningDiT's rotation (hustvl/LightningDiT @ 2725fed4: EVA-02's
    VisionRotaryEmbeddingFast at dim = head_dim / 2, theta 10000, on q and k of every head;
    tests/test_lightningdit.py checks it element by element). Computed in float64, on `device`
    itself: a table made on the host and copied would make every forward wait for the GPU."""
    assert head_dim % 4 == 0, "2-D RoPE needs a head dim that is a multiple of 4"
    half = head_dim // 2
    freqs = theta ** (-torch.arange(0, half, 2, dtype=torch.float64, device=device) / half)  # (head_dim/4,)
    freqs = freqs.repeat_interleave(2)  # (half,): one angle per pair
    rows, cols = _grid_positions(grid, device)  # (h, w) each; token index = row * w + col
    angles = torch.cat([rows.reshape(-1, 1) * freqs, cols.reshape(-1, 1) * freqs], dim=1)  # (T, head_dim)
    return angles.cos().float(), angles.sin().float()


def rope_rows(rope: tuple[torch.Tensor, torch.Tensor], idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the rotary tables (cos, sin) (T, head_dim) for tokens idx (N, T') (indices
    into the row-major grid): per-sample tables (N, T', head_dim), what a block takes for the
    kept tokens of a routed subset x[n, idx[n]]."""
    cos, sin = rope
    return cos[idx], sin[idx]


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x (N, heads, T, head_dim) rotated by rope = (cos, sin), (T, head_dim) for every sample or
    (N, T, head_dim) per sample: x * cos + rot(x) * sin with rot(x0, x1) = (-x1, x0) on each pair.
    In float32 (a bf16 rotation of a large angle is coarse), back in x's dtype."""
    cos, sin = rope
    if cos.dim() == 3:  # per sample: broadcast over heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    xf = x.float()
    pairs = xf.unflatten(-1, (-1, 2))  # (..., head_dim/2, 2)
    rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    return (xf * cos + rotated * sin).to(x.dtype)


__all__ = ["Mlp", "SwiGLU", "apply_rope", "layer_norm", "rms_norm", "rope_rows", "rope_table", "sincos_pos_embed_2d"]
