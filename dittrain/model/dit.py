"""DiT: a Diffusion Transformer with adaLN-Zero blocks (Peebles & Xie, 2023).

Notation follows the paper: an input latent x of shape (N, C, H, W) is cut into
p x p patches, giving T = (H / p) * (W / p) tokens of width D (hidden_size). The
conditioning vector c (N, D) is the sum of the timestep embedding, the class
embedding and, for text models, the projected pooled text embedding; every block
regresses scale/shift/gate from c (adaLN-Zero). Text token embeddings, when present,
enter each block through an extra cross-attention layer.

This file is the network only, and what it counts (parameters, the rows of `dittrain
models`): no I/O and no diffusion math (see diffusion.py). Its neighbours:
dittrain.model.sizes (DiTConfig, the registry of sizes, custom sizes, FLOPs),
dittrain.model.checkpointing (the knob and the selective policy), dittrain.model.attention
(which attention kernel runs), dittrain.model.routing (TREAD). Import their names from them.

With learn_sigma=True and class conditioning the state-dict names and shapes are
those of the released facebookresearch/DiT checkpoints, so they load strictly.
QK-norm and the text layers add keys only when enabled.

Block choices (DiTConfig.mlp / norm / pos): each is a name in the registries of
dittrain.model.parts (MLPS, NORMS, POSITIONS), whose entry builds the part; their torch code is
dittrain.model.layers. DiT's tanh-GELU MLP, affine-free LayerNorm and fixed 2-D sin-cos table
(added to the tokens, kept in pos_embed) by default; LightningDiT's SwiGLU MLP, RMSNorm with its
learned weight and 2-D axial rotary position embedding (q and k rotated in every self-attention,
apply_rope: no pos_embed at all) on request. The text cross-attention keeps its affine LayerNorm
(norm_cross) and unrotated queries and keys whatever the choices: text tokens have no image
position.

DiT^DH (RAE, Zheng et al. 2025; DiTConfig.head_depth > 0): the blocks above are the trunk, fed
c = silu(t + y) (its reference's: the blocks' adaLN applies its own SiLU on top), with Gaussian Fourier time
features (FourierTimestepEmbedder, time_embed="fourier"); then the DDT head (_build_head, _head): the trunk's
tokens become a per-token condition s = s_projector(silu(t + tokens)) (N, T, W), the noisy latent is patched
again at the head's width W (no position table; RoPE at its head dim), head_blocks run on it under s (their
adaLN, and the final layer's, regressed per token: per_token), and the final layer at width W gives the output.
bench/ddt_reference.py checks this against the reference's DiTwDDTHead on the same weights.

PixArt-alpha / PixArt-Sigma (Chen et al. 2023, 2024; DiTConfig.adaln = "single", the PixArt-* presets): the same
network under adaLN-single, which fits as config fields rather than a sibling class because every other part is
DiT's own (patch embedding, sin-cos table, timestep MLP, GELU MLP, affine-free LayerNorm, learned sigma, the text
token MLP that is PixArt's caption projection) and the trainer, sampler, EMA, checkpoints and plan then need no
second code path. What changes (reference: PixArt-alpha/PixArt-alpha @ cac2fd3 diffusion/model/nets/PixArt.py and
diffusers' PixArtTransformer2DModel, whose key names dittrain.inference.weights maps): c (N, D) is regressed ONCE,
t0 = t_block(c) (N, 6D), and block i takes (shift, scale, gate) x 2 = scale_shift_table_i (6, D) + t0 reshaped
(N, 6, D); a block's cross-attention has no norm before it (PixArt's block); the final layer's (shift, scale) =
its scale_shift_table (2, D) + c. The sin-cos positions are PixArt's (pos_interpolation: i * base / n / s), and
micro_conditions adds PixArt-alpha 1024's embedded image size and aspect ratio to c.
tests/test_pixart.py loads the same random weights into diffusers' class and into this one and compares outputs.

Any token grid (aspect-ratio buckets, dittrain.data.bucketed): an input (N, C, H, W) gives the
grid (H/p, W/p) of T = (H/p)(W/p) tokens in row-major order; the position part's table and rotary
tables are computed for that grid (the added table cached per grid and device), and unpatchify
returns (N, C, H, W). The configured square grid (input_size/p per side) uses the frozen
pos_embed parameter itself, so checkpoints, exports and a square run's numbers are unchanged.

RoPE interface (what token routing relies on): DiT.forward computes rope = (cos, sin) once,
each (T, head_dim) in row-major token order, and passes it to every block as `rope=`
(None for a position part without rotation: sin-cos); blocks and attention also take
per-sample tables (N, T', head_dim) of a subset of tokens, rope_rows(rope, idx) with idx (N, T').

Public API: DiT(config), build_model(name, **overrides), drop_text_conditioning(...), and
dittrain.model.layers' (importable from here as before): rope_table(...), rope_rows(rope, idx),
apply_rope(x, rope), sincos_pos_embed_2d(dim, grid), Mlp, SwiGLU.
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ditdata.common.errors import UserError
from dittrain.model.checkpointing import (
    CHECKPOINT_SELECTIVE,
    SAC_HOOKS,
    block_recompute,
    checkpoint_every,
    selective_checkpoint_context,
)
from dittrain.model.layers import Mlp, SwiGLU, apply_rope, rope_rows, rope_table, sincos_pos_embed_2d
from dittrain.model.parts import MLPS, NORMS, POSITIONS
from dittrain.model.routing import TokenRoute, gather_tokens, rejoin_tokens
from dittrain.model.sizes import CONFIGS, DiTConfig, architecture, flops_per_forward, get_config


def _autocasting(device_type: str) -> bool:
    """Whether autocast is on for this device type (never on devices without autocast: meta)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


# -----------------------------------------------------------------------------
# Embedders


def per_token(v):
    """An adaLN regression as rows of tokens: (N, D) -> (N, 1, D), one row for every token; (N, T, D),
    a DDT head's (regressed from each token of the trunk's output), as it is."""
    return v.unsqueeze(1) if v.dim() == 2 else v


def modulate(x, shift, scale):
    # x (N, T, D), shift/scale (N, D) or per token (N, T, D): the adaLN affine, per sample (or per token)
    # instead of learned per channel
    return x * (1 + per_token(scale)) + per_token(shift)


class PatchEmbed(nn.Module):
    """(N, C, H, W) -> (N, T, D): a stride-p convolution is a linear map of each patch."""

    def __init__(self, patch_size: int, in_channels: int, hidden_size: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)  # (N, D, H/p, W/p) -> (N, T, D)


class TimestepEmbedder(nn.Module):
    """Scalar timesteps (N,) -> (N, D): sinusoidal features, then a 2-layer MLP.
    Timesteps may be fractional; diffusion.py feeds 0..999 for ddpm and 1000 * t for flow."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.frequency_embedding_size = frequency_embedding_size
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size),
        )

    @staticmethod
    def timestep_embedding(t, dim: int, max_period: float = 10000.0):
        # [cos(t w_i), sin(t w_i)] with w_i geometric from 1 to 1/max_period (the GLIDE layout,
        # which the released checkpoints were trained with)
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device) / half)
        args = t.float()[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            emb = F.pad(emb, (0, 1))
        return emb

    def forward(self, t):
        t_freq = self.timestep_embedding(t, self.frequency_embedding_size)
        return self.mlp(t_freq.to(self.mlp[0].weight.dtype))


class FourierTimestepEmbedder(nn.Module):
    """Scalar timesteps (N,) -> (N, D): Gaussian Fourier features [sin(2 pi t W), cos(2 pi t W)] of fixed
    random frequencies W (size,) ~ N(0, 1), then a 2-layer MLP: RAE's DiT^DH time embedding
    (bytetriper/RAE @ a4d18c4 src/stage2/models/model_utils.py GaussianFourierEmbedding: scale 1, 256
    frequencies, W a frozen parameter, the sines first). Its frequencies suit t in [0, 1]: the model
    wants --flow-time-scale 1, what its reference feeds."""

    def __init__(self, hidden_size: int, size: int = 256):
        super().__init__()
        # frozen like pos_embed: a Parameter because it is state (drawn once, saved, loaded)
        self.W = nn.Parameter(torch.empty(size), requires_grad=False)
        self.mlp = nn.Sequential(nn.Linear(2 * size, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))

    def forward(self, t):
        args = t.float()[:, None] * self.W.float()[None] * (2 * math.pi)  # (N, size)
        features = torch.cat([torch.sin(args), torch.cos(args)], dim=-1)  # (N, 2 size)
        return self.mlp(features.to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    """Class labels (N,) -> (N, D). Row `num_classes` is the null class of classifier-free
    guidance; during training each label is replaced by it with probability dropout_prob.
    The null row is always present (the released checkpoints have 1001 rows), so a model
    trained without dropout can still be fine-tuned with it."""

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float):
        super().__init__()
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob
        # _weight skips Embedding's own normal_ init, which on the meta device drags in
        # torch._dynamo (seconds); DiT.initialize_weights fills the table anyway
        self.embedding_table = nn.Embedding(
            num_classes + 1, hidden_size, _weight=torch.empty(num_classes + 1, hidden_size)
        )

    def forward(self, labels, train: bool, force_drop_ids=None):
        # force_drop_ids (N,) bool/int, 1 = use the null class: deterministic dropout for tests
        if force_drop_ids is not None:
            drop = force_drop_ids.to(device=labels.device).bool()
        elif train and self.dropout_prob > 0:
            drop = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
        else:
            drop = None
        if drop is not None:
            labels = torch.where(drop, torch.full_like(labels, self.num_classes), labels)
        return self.embedding_table(labels)


class TextEmbedder(nn.Module):
    """A caption embedding -> the model width D through a 2-layer MLP: the pooled embedding
    (N, Dp) -> (N, D), added to c like the class embedding (SiLU, as the timestep MLP), or the
    token embeddings (N, L, Dt) -> (N, L, D), computed once and shared by all blocks
    (tanh-GELU, as the blocks' MLPs)."""

    def __init__(self, in_dim: int, hidden_size: int, act: nn.Module):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden_size), act, nn.Linear(hidden_size, hidden_size))

    def forward(self, x):
        return self.mlp(x)


def drop_text_conditioning(text, empty, drop):
    """Caption dropout for classifier-free guidance, done by the TRAINER (not the model):
    rows where drop (N,) is True get the store's empty-caption embedding. There is no
    learned null text embedding because the empty caption's embedding is the natural
    unconditional input and the sampler must use exactly the same one (the manifest's).

    text, empty: dicts with any of text_pooled (N, Dp) / (Dp,), text_tokens (N, L, Dt) /
    (L, Dt), text_mask (N, L) / (L,). Returns a new dict for the keys of `text`. Unpadded
    stores' batches are as long as their longest caption and the empty caption has a length of
    its own: the shorter of the two is padded (zero tokens, mask False) to the other's length."""
    L_text, L_empty = _text_len(text), _text_len(empty)
    if L_text is not None and L_empty is not None and L_text != L_empty:
        L = max(L_text, L_empty)
        text, empty = _pad_text(text, L), _pad_text(empty, L)
    out = {}
    for key, value in text.items():
        if value is None:
            out[key] = None
            continue
        e = empty[key].to(device=value.device, dtype=value.dtype).expand_as(value)
        m = drop.to(value.device).view(-1, *([1] * (value.dim() - 1)))
        out[key] = torch.where(m, e, value)
    return out


def _text_len(text: dict) -> int | None:
    """L of text_tokens (N, L, Dt) / (L, Dt), None without tokens."""
    t = text.get("text_tokens")
    return None if t is None else t.shape[-2]


def _pad_text(text: dict, L: int) -> dict:
    """text_tokens and text_mask padded along L to `L` (zeros, False); the rest as is."""
    out = dict(text)
    for key in ("text_tokens", "text_mask"):
        t = text.get(key)
        if t is None:
            continue
        axis = t.dim() - 2 if key == "text_tokens" else t.dim() - 1
        short = L - t.shape[axis]
        if short > 0:
            pad = list(t.shape)
            pad[axis] = short
            out[key] = torch.cat([t, torch.zeros(pad, dtype=t.dtype, device=t.device)], dim=axis)
    return out


# -----------------------------------------------------------------------------
# Transformer blocks


class _Heads(nn.Module):
    """What both attentions share: the head split, the optional QK-norm (RMSNorm over each
    head's dim, q_norm / k_norm) and the output projection (proj)."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        if qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=1e-6)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=1e-6)
        self.qk_norm = qk_norm
        self.proj = nn.Linear(dim, dim)

    def _norm(self, q, k, v):
        if self.qk_norm:  # in fp32: under autocast a bf16 input misses the fused rms_norm
            q, k = self.q_norm(q.float()).to(v.dtype), self.k_norm(k.float()).to(v.dtype)
        return q, k


class Attention(_Heads):
    """Multi-head self-attention; names (qkv, proj) match timm's, which DiT used. With `rope`
    (cos, sin), q and k are rotated by their tokens' positions after the QK-norm."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool = False):
        super().__init__(dim, num_heads, qk_norm)
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, rope=None):
        # x (N, T, D); rope: None, or (cos, sin) each (T, head_dim) or per sample (N, T, head_dim)
        N, T, D = x.shape
        # (N, T, 3D) -> (3, N, heads, T, head_dim): the timm layout the checkpoints expect
        qkv = self.qkv(x).reshape(N, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self._norm(q, k, v)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        x = F.scaled_dot_product_attention(q, k, v)  # (N, heads, T, head_dim)
        return self.proj(x.transpose(1, 2).reshape(N, T, D))


class CrossAttention(_Heads):
    """Image tokens (queries) attend to text tokens (keys/values), with a padding mask."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool = False):
        super().__init__(dim, num_heads, qk_norm)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)

    def forward(self, x, context, mask=None):
        # x (N, T, D), context (N, L, D), mask (N, L) bool, True = a real token
        N, T, D = x.shape
        L = context.shape[1]
        q = self.q(x).reshape(N, T, self.num_heads, self.head_dim).transpose(1, 2)
        kv = self.kv(context).reshape(N, L, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        k, v = kv.unbind(0)
        q, k = self._norm(q, k, v)
        attn_mask, empty = None, None
        if mask is not None:
            mask = mask.bool()
            # a row with no real token would softmax over nothing (NaN): let it see token 0,
            # then zero its output, so "no text" means "no cross-attention contribution"
            empty = ~mask.any(dim=1)
            mask = torch.cat(
                [mask[:, :1] | empty[:, None], mask[:, 1:]], dim=1
            )  # no in-place: compile-friendly
            attn_mask = mask[:, None, None, :]  # (N, 1, 1, L), broadcast over heads and queries
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        x = self.proj(x.transpose(1, 2).reshape(N, T, D))
        if empty is not None:
            x = x.masked_fill(empty[:, None, None], 0.0)
        return x


class DiTBlock(nn.Module):
    """adaLN-Zero block: c regresses (shift, scale, gate) for attention and MLP; gates start
    at zero so every block is the identity at initialisation.
    With text tokens, a cross-attention layer sits between them (pre-LayerNorm, residual,
    not modulated: it already sees the text; its output projection starts at zero).
    mlp, norm: the block choices (names in dittrain.model.parts MLPS, NORMS); mlp_hidden: the MLP's
    hidden width."""

    def __init__(
        self, hidden_size: int, num_heads: int, mlp_hidden: int, qk_norm: bool, cross: bool,
        mlp: str = "gelu", norm: str = "layer", adaln: str = "zero",
    ):
        super().__init__()
        self.norm1 = NORMS[norm].module(hidden_size)
        self.attn = Attention(hidden_size, num_heads, qk_norm=qk_norm)
        self.adaln_single = adaln == "single"
        if cross:
            # PixArt's block feeds x itself to its cross-attention (no norm, no parameters)
            self.norm_cross = nn.Identity() if self.adaln_single else nn.LayerNorm(hidden_size, eps=1e-6)
            self.cross_attn = CrossAttention(hidden_size, num_heads, qk_norm=qk_norm)
        self.norm2 = NORMS[norm].module(hidden_size)
        self.mlp = MLPS[mlp].module(hidden_size, mlp_hidden)
        if self.adaln_single:
            # adaLN-single: this block's learned offsets of the shared t0 (N, 6D); filled by initialize_weights
            self.scale_shift_table = nn.Parameter(torch.empty(6, hidden_size))
        else:
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))
        # recompute="selective" also recomputes matmul outputs this wide (None: keep them all);
        # bench/activation_memory.py sets it to the MLP width to measure that variant
        self.selective_recompute_width: int | None = None

    def forward(self, x, c, context=None, context_mask=None, recompute=None, rope=None):
        # x (N, T, D), c (N, D); recompute: "attn" | "mlp" | None, the branch whose activations
        # are recomputed in the backward pass instead of kept, or "selective", the whole block
        # with its matmul/attention outputs kept (DiT.forward passes block_recompute(knob)).
        # rope: None, or (cos, sin) of x's tokens, (T, head_dim) or per sample (N, T, head_dim).
        # The checkpoint sits INSIDE forward so that a compiled block (block.compile()) traces
        # it with its policy: an SAC region around a compiled block would run it eagerly.
        if recompute == CHECKPOINT_SELECTIVE:
            # a partial, not a lambda: dynamo accepts only a function or a partial as context_fn;
            # respect_saved_tensors_hooks: save_on_cpu and the like see what the policy keeps
            context_fn = partial(selective_checkpoint_context, self.selective_recompute_width)
            return checkpoint(self.forward, x, c, context, context_mask, use_reentrant=False,
                              context_fn=context_fn, rope=rope, **SAC_HOOKS)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.modulation(c)
        attn_args = (x, shift_msa, scale_msa, gate_msa, context, context_mask, rope)
        if recompute == "attn":
            x = checkpoint(self._attention, *attn_args, use_reentrant=False)
        else:
            x = self._attention(*attn_args)
        if recompute == "mlp":
            return checkpoint(self._mlp, x, shift_mlp, scale_mlp, gate_mlp, use_reentrant=False)
        return self._mlp(x, shift_mlp, scale_mlp, gate_mlp)

    def modulation(self, c):
        """The six (shift, scale, gate) of attention and MLP: (N, D) each from c (N, D) (adaLN-Zero), (N, T, D)
        each in a DDT head (c per token), or (N, 1, D) each under adaLN-single, where c is the shared t0 (N, 6D)
        and each is scale_shift_table[j] + t0[:, jD:(j+1)D] (PixArt's t2i_modulate inputs)."""
        if self.adaln_single:
            N, D = c.shape[0], self.scale_shift_table.shape[1]
            return (self.scale_shift_table[None] + c.reshape(N, 6, D)).chunk(6, dim=1)
        return self.adaLN_modulation(c).chunk(6, dim=-1)

    def _attention(self, x, shift, scale, gate, context, context_mask, rope):
        # the attention branch with its residuals: self-attention, then (text) cross-attention
        x = x + per_token(gate) * self.attn(modulate(self.norm1(x), shift, scale), rope)
        if context is not None:
            x = x + self.cross_attn(self.norm_cross(x), context, context_mask)
        return x

    def _mlp(self, x, shift, scale, gate):
        return x + per_token(gate) * self.mlp(modulate(self.norm2(x), shift, scale))


class FinalLayer(nn.Module):
    """adaLN, then a linear map of each token back to a p x p x out_channels patch."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int, norm: str = "layer",
                 adaln: str = "zero"):
        super().__init__()
        self.norm_final = NORMS[norm].module(hidden_size)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        if adaln == "single":  # PixArt's T2IFinalLayer: (shift, scale) = its table (2, D) + c, no regression
            self.scale_shift_table = nn.Parameter(torch.empty(2, hidden_size))
        else:
            self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x, c):
        # c (N, D), or per token (N, T, D) in a DDT head
        if hasattr(self, "scale_shift_table"):
            shift, scale = (self.scale_shift_table[None] + c[:, None]).chunk(2, dim=1)  # (N, 1, D) each
        else:
            shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


# -----------------------------------------------------------------------------
# The model


class DiT(nn.Module):
    def __init__(self, config: DiTConfig):
        super().__init__()
        self.config = cfg = config
        D = cfg.hidden_size
        self.in_channels = cfg.in_channels
        self.out_channels = cfg.out_channels
        self.patch_size = cfg.patch_size

        self.x_embedder = PatchEmbed(cfg.patch_size, cfg.in_channels, D)
        if cfg.time_embed == "fourier":
            self.t_embedder = FourierTimestepEmbedder(D, cfg.frequency_embedding_size)
        else:
            self.t_embedder = TimestepEmbedder(D, cfg.frequency_embedding_size)
        if cfg.num_classes:
            self.y_embedder = LabelEmbedder(cfg.num_classes, D, cfg.class_dropout_prob)
        if cfg.text_pooled_dim and cfg.adaln != "single":  # PixArt conditions on the tokens alone
            self.text_pooled_embedder = TextEmbedder(cfg.text_pooled_dim, D, nn.SiLU())
        if cfg.text_token_dim:
            self.text_token_embedder = TextEmbedder(cfg.text_token_dim, D, nn.GELU(approximate="tanh"))
        # the position part: a table added to the tokens (DiT's sin-cos), rotated q and k (RoPE), or both
        self.position = POSITIONS[cfg.pos]
        if self.position.table is not None:
            # the square grid's table, a frozen Parameter (not a buffer) because the released
            # checkpoints store it under "pos_embed". RoPE models have none: their positions enter
            # the attention (rope_table), computed in each forward
            self.pos_embed = nn.Parameter(torch.zeros(1, cfg.num_tokens, D), requires_grad=False)
        # (grid h, grid w, device, dtype) -> (1, T, D): the tables of the other grids (buckets),
        # made once each; not state (a pure function of the grid), never saved
        self._pos_tables: dict[tuple, torch.Tensor] = {}
        if cfg.micro_conditions:
            # PixArt-alpha 1024's size embedders (PixArtMS's csize_embedder and ar_embedder; diffusers'
            # resolution_embedder, aspect_ratio_embedder): the timestep's sinusoid of a size, then a MLP to D/3
            self.resolution_embedder = TimestepEmbedder(D // 3, cfg.frequency_embedding_size)
            self.aspect_ratio_embedder = TimestepEmbedder(D // 3, cfg.frequency_embedding_size)
        if cfg.adaln == "single":  # adaLN-single: the ONE regression of every block's modulation, t0 (N, 6D)
            self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(D, 6 * D))
        self.blocks = nn.ModuleList(
            DiTBlock(D, cfg.num_heads, cfg.mlp_hidden, cfg.qk_norm, cross=bool(cfg.text_token_dim),
                     mlp=cfg.mlp, norm=cfg.norm, adaln=cfg.adaln)
            for _ in range(cfg.depth)
        )
        if cfg.head_depth:  # DiT^DH: the DDT head, and the final layer at its width
            self._build_head()
        else:
            self.final_layer = FinalLayer(D, cfg.patch_size, cfg.out_channels, norm=cfg.norm, adaln=cfg.adaln)
        self.initialize_weights()

    def _build_head(self):
        """RAE's DDT head (bytetriper/RAE @ a4d18c4 src/stage2/models/DDT.py DiTwDDTHead), its names ours:
        head_embedder (its x_embedder: x_t patched again at the head's width W, no position table),
        s_projector (the trunk's tokens, D -> W; none when D == W), head_blocks (the trunk's block kind at
        width W with head_heads heads, modulated per token by s), final_layer at width W (per token too).
        The trunk is blocks and x_embedder (its s_embedder), as in a DiT."""
        cfg, W = self.config, self.config.head_hidden
        self.head_embedder = PatchEmbed(cfg.patch_size, cfg.in_channels, W)
        self.s_projector = nn.Linear(cfg.hidden_size, W) if cfg.hidden_size != W else nn.Identity()
        self.head_blocks = nn.ModuleList(
            DiTBlock(W, cfg.head_heads, cfg.head_mlp_hidden, cfg.qk_norm, cross=False, mlp=cfg.mlp, norm=cfg.norm)
            for _ in range(cfg.head_depth)
        )
        self.final_layer = FinalLayer(W, cfg.patch_size, cfg.out_channels, norm=cfg.norm)

    @torch.no_grad()
    def initialize_weights(self):
        """DiT's init; a DiT^DH's is its reference's (DiTwDDTHead.initialize_weights as its model builds it,
        xavier_uniform_init=False): every linear keeps torch's own init (reset_parameters, so that a model
        built on meta gets it too) where DiT's are xavier-uniform with zero bias. Then both: the sin-cos
        table, the patch embeddings (a DiT^DH's two) xavier-uniform as linears, the label table and the time
        MLP's weights N(0, 0.02), Fourier frequencies N(0, 1), and adaLN-Zero. Call again after `to_empty()`
        when the model was built on meta."""
        if self.x_embedder.proj.weight.is_meta:  # nothing to fill: a meta model is for counting only
            return

        def _basic_init(module):
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:  # a block part's linear may have none
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and module.weight is not None:
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

        head_blocks = tuple(getattr(self, "head_blocks", ()))
        if head_blocks:
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.RMSNorm, nn.LayerNorm)):
                    module.reset_parameters()
        else:
            self.apply(_basic_init)
        if self.position.table is not None:
            self.pos_embed.copy_(self._table(self.square_grid).unsqueeze(0))
        # the patch embedding is a linear map of the flattened patch
        for embedder in (self.x_embedder, *([self.head_embedder] if head_blocks else [])):
            w = embedder.proj.weight
            nn.init.xavier_uniform_(w.view(w.shape[0], -1))
            nn.init.zeros_(embedder.proj.bias)
        if self.config.num_classes:
            nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        if isinstance(self.t_embedder, FourierTimestepEmbedder):
            nn.init.normal_(self.t_embedder.W, std=1.0)
        if self.config.adaln == "single":
            self._init_pixart()
            return
        # adaLN-Zero: every block starts as the identity and the output is exactly zero
        for block in (*self.blocks, *head_blocks):
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
            if hasattr(block, "cross_attn"):  # cross-attention joins the residual at zero too
                nn.init.zeros_(block.cross_attn.proj.weight)
                nn.init.zeros_(block.cross_attn.proj.bias)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].weight)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)

    def _init_pixart(self):
        """The rest of PixArt's initialize_weights (PixArt.py, PixArtMS.py), after the DiT's common part: t_block,
        the caption projection and the size embedders N(0, 0.02); each cross-attention's output projection and the
        final linear zero; the scale_shift_tables randn / sqrt(D) (as their __init__ draws them). No adaLN-Zero:
        the shared t_block is not zeroed, so the gates do not start at zero (the reference's choice)."""
        D = self.config.hidden_size
        nn.init.normal_(self.t_block[1].weight, std=0.02)
        if self.config.text_token_dim:
            nn.init.normal_(self.text_token_embedder.mlp[0].weight, std=0.02)
            nn.init.normal_(self.text_token_embedder.mlp[2].weight, std=0.02)
        if self.config.micro_conditions:
            for embedder in (self.resolution_embedder, self.aspect_ratio_embedder):
                nn.init.normal_(embedder.mlp[0].weight, std=0.02)
                nn.init.normal_(embedder.mlp[2].weight, std=0.02)
        for block in self.blocks:
            nn.init.normal_(block.scale_shift_table, std=D**-0.5)
            if hasattr(block, "cross_attn"):
                nn.init.zeros_(block.cross_attn.proj.weight)
                nn.init.zeros_(block.cross_attn.proj.bias)
        nn.init.normal_(self.final_layer.scale_shift_table, std=D**-0.5)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)

    def _table(self, grid: tuple[int, int]) -> torch.Tensor:
        """The position part's table (T, D) of a grid (h, w); with pos_interpolation s > 0, PixArt's positions:
        token i of a side of n at i * base / n / s, base = the configured side (diffusers' get_2d_sincos_pos_embed
        with base_size and interpolation_scale)."""
        s = self.config.pos_interpolation
        if not s:
            return self.position.table(self.config.hidden_size, grid)
        base = self.square_grid[0]
        return self.position.table(self.config.hidden_size, grid, scale=(base / grid[0] / s, base / grid[1] / s))

    def set_grad_checkpointing(self, granularity: str | int) -> None:
        """Change the checkpointing knob of a built model ("none", "every", k, "attn", "mlp" or
        "selective")."""
        checkpoint_every(granularity)
        self.config = replace(self.config, grad_checkpointing=granularity)

    def num_params(self, trainable_only: bool = True) -> int:
        # trainable_only leaves out the frozen pos_embed, as the paper's counts do
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def unconditional_kwargs(self, cond: dict, empty_text: dict | None = None) -> dict:
        """The kwargs of the unconditional pass of classifier-free guidance, matching `cond`:
        labels -> the null class, text -> the store's empty-caption embedding (empty_text,
        keys text_pooled / text_tokens / text_mask, unbatched or batched)."""
        uncond = dict(cond)
        if cond.get("y") is not None:
            uncond["y"] = torch.full_like(cond["y"], self.config.num_classes)
        text = {
            k: cond[k]
            for k in ("text_pooled", "text_tokens", "text_mask")
            if cond.get(k) is not None
        }
        if text:
            if empty_text is None:
                raise ValueError("a text model needs the empty-caption embedding for guidance")
            n = next(iter(text.values())).shape[0]
            drop = torch.ones(n, dtype=torch.bool)
            uncond.update(drop_text_conditioning(text, empty_text, drop))
        return uncond

    @property
    def square_grid(self) -> tuple[int, int]:
        """(h, w) tokens of the configured input_size: the grid pos_embed holds."""
        side = self.config.input_size // self.patch_size
        return side, side

    def token_grid(self, x: torch.Tensor) -> tuple[int, int]:
        """(h, w) = (H/p, W/p) of latents x (N, C, H, W); a side that p does not divide is refused."""
        H, W = x.shape[-2:]
        p = self.patch_size
        if H % p or W % p:
            raise ValueError(f"latents {H}x{W} do not divide into {p}x{p} patches")
        return H // p, W // p

    def pos_table(self, grid: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
        """The position table (1, T, D) of a grid (h, w) (sin-cos): pos_embed itself for the square
        grid (so a checkpoint's table is the one used), else computed once per grid and device."""
        if tuple(grid) == self.square_grid:
            return self.pos_embed
        key = (*grid, like.device, self.pos_embed.dtype)
        if key not in self._pos_tables:
            table = self._table(grid).unsqueeze(0)
            self._pos_tables[key] = table.to(device=like.device, dtype=self.pos_embed.dtype)
        return self._pos_tables[key]

    def unpatchify(self, x, grid: tuple[int, int] | None = None):
        # (N, T, p*p*C) -> (N, C, h*p, w*p); grid (h, w), default the square grid of T tokens
        N, T, _ = x.shape
        p, C = self.patch_size, self.out_channels
        if grid is None:
            h = w = int(T**0.5)
        else:
            h, w = grid
        x = x.reshape(N, h, w, p, p, C)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(N, C, h * p, w * p)

    def forward(
        self, x, t, y=None, text_pooled=None, text_tokens=None, text_mask=None, force_drop_ids=None,
        return_hidden: int = 0, route: TokenRoute | None = None,
    ):
        """
        x: (N, C, H, W) latents; t: (N,) timesteps (int or float, 0..1000 scale)
        y: (N,) class labels, num_classes = the null class (unconditional)
        text_pooled: (N, Dp); text_tokens: (N, L, Dt); text_mask: (N, L) bool, True = real token
        force_drop_ids: (N,) 1 = replace the label by the null class (deterministic dropout)
        returns (N, out_channels, H, W): eps (or velocity), then the variance channels if learn_sigma
        return_hidden = k >= 1: returns (that output, the tokens after the k-th block (N, T, D)),
            what REPA aligns (dittrain.train.repa); the output is the same either way
        route: token routing (dittrain.model.routing, TREAD): blocks route.start..route.end (0-based, both
            included) run on the tokens route.idx (N, K); the others skip them and rejoin after block
            route.end; with route.full_after, under autocast, the next block runs with autocast off.
            The hidden tokens of a routed block are the kept ones, (N, K, D) (the last routed one's too)
        """
        cfg = self.config
        grid = self.token_grid(x)  # (h, w) = (H/p, W/p)
        x_t = x  # the input (N, C, H, W), which a DDT head reads again
        x = self.x_embedder(x)  # (N, T, D), T = h * w
        if self.position.table is not None:
            x = x + self.pos_table(grid, x)
        rope = None  # the rotary tables of the grid, once for every block
        if self.position.rotary is not None:
            rope = self.position.rotary(cfg.head_dim, grid, device=x.device)
        t_emb = self.t_embedder(t)  # (N, D)
        if cfg.micro_conditions:  # PixArt-alpha 1024: + the embedded image size and aspect ratio (N, D)
            t_emb = t_emb + self._micro_conditions(grid, t_emb)
        c, context = self._conditioning(t_emb, y, text_pooled, text_tokens, force_drop_ids)
        if cfg.head_depth:  # DiT^DH: c = silu(t + y) (the blocks' adaLN applies its own SiLU on top)
            c = F.silu(c)
        # what the blocks regress from: c itself (adaLN-Zero: each block its own), or adaLN-single's shared
        # t0 = t_block(c) (N, 6D), to which each block adds its scale_shift_table; the final layer takes c
        mod = self.t_block(c) if cfg.adaln == "single" else c

        training = self.training and torch.is_grad_enabled()
        k = checkpoint_every(cfg.grad_checkpointing) if training else 0
        recompute = block_recompute(cfg.grad_checkpointing) if training else None
        if return_hidden and not 1 <= return_hidden <= len(self.blocks):
            raise ValueError(f"return_hidden={return_hidden}: the model has {len(self.blocks)} blocks")
        hidden = None
        full_next = False  # TREAD: the block after the rejoin runs with autocast off
        for i, block in enumerate(self.blocks):
            if route is not None and i == route.start:  # the routed tokens leave: (N, K, D)
                x_all, rope_all = x, rope
                x, rope = gather_tokens(x, route.idx), None if rope is None else rope_rows(rope, route.idx)
            if full_next:
                x = self._full_precision(block, k and i % k == 0, x, mod, context, text_mask, recompute, rope)
                full_next = False
            elif k and i % k == 0:
                # recompute this block's activations in backward: memory for ~1/3 more compute
                x = checkpoint(block, x, mod, context, text_mask, use_reentrant=False, rope=rope)
            else:
                x = block(x, mod, context, text_mask, recompute=recompute, rope=rope)  # (N, T, D)
            if i + 1 == return_hidden:
                hidden = x  # (N, T, D) after block k; (N, K, D) when it is routed
            if route is not None and i == route.end:  # and rejoin after the last routed block: (N, T, D)
                x, rope = rejoin_tokens(x_all, x, route.idx), rope_all
                full_next = route.full_after and _autocasting(x.device.type)
        if cfg.head_depth:  # the DDT head, its final layer modulated per token
            x = self._head(x_t, x, t_emb, grid, k, recompute)  # (N, T, p^2 * out_channels)
        else:
            x = self.final_layer(x, c)  # (N, T, p^2 * out_channels)
        x = self.unpatchify(x, grid)  # (N, out_channels, H, W)
        return (x, hidden) if return_hidden else x

    def _head(self, x_t, s, t_emb, grid, k, recompute):
        """The DDT head (DiTwDDTHead.forward after its encoder blocks): the trunk's tokens s (N, T, D) become
        the per-token condition s = s_projector(silu(t + s)) (N, T, W); the noisy latent x_t, patched again at
        width W, runs through the head blocks under it (RoPE at the head's head dim where the position part
        rotates, no table). Returns (the head's tokens modulated by the final layer, (N, T, p^2 C_out))."""
        cfg = self.config
        s = self.s_projector(F.silu(t_emb.unsqueeze(1) + s))  # (N, T, W)
        x = self.head_embedder(x_t)  # (N, T, W)
        rope = None
        if self.position.rotary is not None:
            rope = self.position.rotary(cfg.head_head_dim, grid, device=x.device)
        for j, block in enumerate(self.head_blocks):
            if k and (cfg.depth + j) % k == 0:  # the knob counts the head's blocks after the trunk's
                x = checkpoint(block, x, s, None, None, use_reentrant=False, rope=rope)
            else:
                x = block(x, s, None, None, recompute=recompute, rope=rope)  # (N, T, W)
        return self.final_layer(x, s)

    @staticmethod
    def _full_precision(block, checkpointed, x, c, context, text_mask, recompute, rope):
        """One block with autocast off, its inputs in its weights' dtype: what TREAD's reference runs
        right after a rejoin (CompVis/tread fccf77cc735a dit.py DiT.forward, fp32_next: the first block
        to see the rejoined sequence, whose routed tokens come from an earlier depth)."""
        dtype = next(block.parameters()).dtype

        def cast(v):
            return v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v

        x, c, context, rope = cast(x), cast(c), cast(context), None if rope is None else tuple(map(cast, rope))
        with torch.autocast(x.device.type, enabled=False):
            if checkpointed:
                return checkpoint(block, x, c, context, text_mask, use_reentrant=False, rope=rope)
            return block(x, c, context, text_mask, recompute=recompute, rope=rope)

    def _micro_conditions(self, grid, like):
        """PixArt-alpha 1024's micro-conditions (N, D) (diffusers' PixArtAlphaCombinedTimestepSizeEmbeddings): the
        image's (height, width) in pixels, each embedded to D/3, and its aspect ratio height / width, to D/3,
        concatenated. The image is the latent grid x patch x micro_conditions pixels a side: the size diffusers'
        pipeline passes for the image it makes (PixArt's training passed each bucket's)."""
        N, f = like.shape[0], self.patch_size * self.config.micro_conditions
        height, width = grid[0] * f, grid[1] * f
        size = torch.tensor([height, width], dtype=torch.float32, device=like.device).repeat(N)  # (2N,): h, w, h, w..
        ratio = torch.full((N,), height / width, dtype=torch.float32, device=like.device)
        size_emb = self.resolution_embedder(size).reshape(N, -1)  # (N, 2D/3)
        return torch.cat([size_emb, self.aspect_ratio_embedder(ratio)], dim=1).to(like.dtype)  # (N, D)

    def _conditioning(self, t_emb, y, text_pooled, text_tokens, force_drop_ids):
        """c (N, D), the sum of the timestep embedding t_emb (N, D), the class and pooled-text embeddings,
        and the text tokens each block cross-attends to, (N, L, D) (None without text tokens)."""
        cfg = self.config
        c = t_emb
        if cfg.num_classes:
            y = _given(y, "this model is class-conditional: pass y (use num_classes for the null class)")
            c = c + self.y_embedder(y, self.training, force_drop_ids)
        if cfg.text_pooled_dim and cfg.adaln != "single":  # PixArt's c is t alone: a pooled embedding is not read
            text_pooled = _given(text_pooled, "this model takes a pooled text embedding: pass text_pooled")
            c = c + self.text_pooled_embedder(text_pooled.to(c.dtype))
        context = None
        if cfg.text_token_dim:
            text_tokens = _given(text_tokens, "this model cross-attends to text tokens: pass text_tokens (and text_mask)")
            context = self.text_token_embedder(text_tokens.to(c.dtype))  # (N, L, D)
        return c, context

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self.config).items())


def _given(x, message: str):
    """`x`, which the model's configuration needs: a ValueError saying what to pass when it is None."""
    if x is None:
        raise ValueError(message)
    return x


def build_model(name: str, **overrides) -> DiT:
    """build_model("DiT-XL/2", input_size=32, num_classes=1000) -> DiT.
    Build under `with torch.device("meta"):` to count parameters of big models for free."""
    return DiT(get_config(name, **overrides))


# ----------------------------------------------------------------------------- what a size costs: `dittrain models`


class ModelsError(UserError, ValueError):
    """`dittrain models` asked for a size that does not fit the latent (one line)."""


def num_params(config: DiTConfig, trainable_only: bool = True) -> int:
    """Parameter count without allocating: builds on the meta device."""
    with torch.device("meta"):
        return DiT(config).num_params(trainable_only)


def describe(name: str, **overrides) -> dict:
    """One row of `dittrain models`: name, size fields, parameters and GMACs per forward."""
    cfg = get_config(name, **overrides)
    return dict(name=name, depth=cfg.depth, hidden=cfg.hidden_size, heads=cfg.num_heads, patch=cfg.patch_size,
                tokens=cfg.num_tokens, params=num_params(cfg), gflops=flops_per_forward(cfg) / 1e9,
                head=(cfg.head_depth, cfg.head_hidden, cfg.head_heads) if cfg.head_depth else None)


def models_table(resolution: int, downsample: int, channels: int, num_classes: int, learn_sigma: bool,
                 specs: tuple[str, ...] = ()) -> list[str]:
    """The lines of `dittrain models`: the registry's sizes whose patch splits the latent, then
    each of `specs` (names or custom sizes), all checked before any line is made."""
    if resolution % downsample:
        raise ModelsError(f"--resolution {resolution} is not a multiple of --downsample {downsample}")
    size = resolution // downsample
    for spec in specs:
        try:
            patch = architecture(spec)["patch_size"]
        except (KeyError, ValueError) as e:
            raise ModelsError(f"--model: {e.args[0]}") from None
        if size % patch:
            raise ModelsError(f"--model {spec}: patch {patch} does not split the {size}x{size} latent")
    rows = [name for name, arch in CONFIGS.items() if size % arch["patch_size"] == 0]  # whole patches only
    rows += [spec for spec in specs if spec not in rows]
    width = max(10, *map(len, rows))
    lines = [f"at {resolution} px: latent {channels}x{size}x{size}, {num_classes} classes, "
             f"learn_sigma={learn_sigma}; GFLOPs = multiply-adds per sample per forward",
             f"{'model':<{width}} {'depth':>5} {'hidden':>6} {'heads':>5} {'tokens':>6} {'params':>9} {'GFLOPs':>9}"]
    heads = set()
    for name in rows:
        row = describe(name, input_size=size, in_channels=channels, num_classes=num_classes, learn_sigma=learn_sigma)
        depth = f"{row['depth']}+{row['head'][0]}" if row["head"] else row["depth"]  # trunk + DDT head blocks
        heads |= {row["head"]} if row["head"] else set()
        lines.append(f"{name:<{width}} {depth:>5} {row['hidden']:>6} {row['heads']:>5} {row['tokens']:>6} "
                     f"{row['params'] / 1e6:>8.1f}M {row['gflops']:>9.2f}")
    lines += [f"depth D+K: a DiT^DH, D trunk blocks then a DDT head of K blocks {w} wide with {h} heads (RAE)"
              for _, w, h in sorted(heads)]
    return lines


# Mlp, SwiGLU and the position functions live in dittrain.model.layers (the parts' torch code) and
# are importable from here as before
__all__ = ["DiT", "Mlp", "ModelsError", "SwiGLU", "apply_rope", "build_model", "describe", "drop_text_conditioning",
           "models_table", "modulate", "num_params", "rope_rows", "rope_table", "sincos_pos_embed_2d"]
