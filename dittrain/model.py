"""DiT: a Diffusion Transformer with adaLN-Zero blocks (Peebles & Xie, 2023).

Notation follows the paper: an input latent x of shape (N, C, H, W) is cut into
p x p patches, giving T = (H / p) * (W / p) tokens of width D (hidden_size). The
conditioning vector c (N, D) is the sum of the timestep embedding, the class
embedding and, for text models, the projected pooled text embedding; every block
regresses scale/shift/gate from c (adaLN-Zero). Text token embeddings, when present,
enter each block through an extra cross-attention layer.

This file is the network only: no I/O and no diffusion math (see diffusion.py).

With learn_sigma=True and class conditioning the state-dict names and shapes are
those of the released facebookresearch/DiT checkpoints, so they load strictly.
QK-norm and the text layers add keys only when enabled.

Public API:
    DiTConfig, CONFIGS (the registry), get_config(name or "custom:hidden=..,depth=..,heads=..,patch=.."),
    build_model(name, **overrides), DiT(config),
    flops_per_forward(config), num_params(config), drop_text_conditioning(...),
    attention_backend(config, batch_size, dtype, device) (which SDPA kernel runs),
    selective_checkpoint_context() (grad_checkpointing="selective").
"""

from __future__ import annotations

import inspect
import math
from dataclasses import asdict, dataclass, replace
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from ditdata.common.errors import UserError

# checkpoint(respect_saved_tensors_hooks=True) (newer torch): saved-tensors hooks (save_on_cpu,
# bench/activation_memory.py's counter) see what a selective policy keeps; older torch has no
# such argument, and the policy works the same without it.
_SAC_HOOKS = ({"respect_saved_tensors_hooks": True}
              if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters else {})

# -----------------------------------------------------------------------------
# Config and registry


@dataclass(frozen=True)
class DiTConfig:
    input_size: int = 32  # latent height = width (256 px / VAE downsample 8)
    in_channels: int = 4  # latent channels
    patch_size: int = 2
    hidden_size: int = 1152
    depth: int = 28
    num_heads: int = 16
    mlp_ratio: float = 4.0
    num_classes: int = 1000  # 0 = no class conditioning
    class_dropout_prob: float = 0.1  # label -> null class, for classifier-free guidance
    learn_sigma: bool = True  # output 2C channels: eps and the variance interpolation v
    qk_norm: bool = False  # RMSNorm on q and k per head (stabilises bf16 / large lr)
    text_pooled_dim: int | None = None  # pooled text embedding, added to c
    text_token_dim: int | None = None  # token embeddings, through cross-attention
    # "none" | "every" | k (every k-th block) | "attn" / "mlp" (that branch of every block) |
    # "selective" (every block, keeping its matmul and attention outputs)
    grad_checkpointing: str | int = "none"
    frequency_embedding_size: int = 256  # sinusoidal timestep features

    def __post_init__(self):
        assert self.input_size % self.patch_size == 0, "input_size must be a multiple of patch_size"
        assert self.hidden_size % self.num_heads == 0, "hidden_size must be a multiple of num_heads"
        checkpoint_every(self.grad_checkpointing)  # validates the knob

    @property
    def out_channels(self) -> int:
        return self.in_channels * 2 if self.learn_sigma else self.in_channels

    @property
    def num_tokens(self) -> int:
        return (self.input_size // self.patch_size) ** 2


# The sizes of the DiT paper (Table 1) plus a tiny one for CPU tests and demos.
_SIZES = {
    "T": dict(depth=6, hidden_size=192, num_heads=4),
    "S": dict(depth=12, hidden_size=384, num_heads=6),
    "B": dict(depth=12, hidden_size=768, num_heads=12),
    "L": dict(depth=24, hidden_size=1024, num_heads=16),
    "XL": dict(depth=28, hidden_size=1152, num_heads=16),
}
_PATCHES = {"T": (2, 4), "S": (2, 4, 8), "B": (2, 4, 8), "L": (2, 4, 8), "XL": (2, 4, 8)}

# The one registry: "DiT-XL/2" -> the architecture fields of DiTConfig. Data-dependent
# fields (input_size, in_channels, num_classes, text dims) come from the latent store.
CONFIGS: dict[str, dict] = {
    f"DiT-{size}/{p}": dict(_SIZES[size], patch_size=p) for size in _SIZES for p in _PATCHES[size]
}


# Sizes outside the registry, named by their fields: "custom:hidden=512,depth=8,heads=8,patch=2"
# (",mlp_ratio=R" optional). Such a name works wherever a registry name does.
CUSTOM_PREFIX = "custom:"
_CUSTOM_FIELDS = {"hidden": "hidden_size", "depth": "depth", "heads": "num_heads", "patch": "patch_size",
                  "mlp_ratio": "mlp_ratio"}
_CUSTOM_REQUIRED = ("hidden", "depth", "heads", "patch")
CUSTOM_SPEC = "custom:hidden=H,depth=D,heads=N,patch=P"  # the grammar, for messages


class ModelSpecError(UserError, ValueError):
    """A custom model spec that does not parse; the message is one line."""


def parse_custom(spec: str) -> dict:
    """"custom:hidden=D,depth=N,heads=H,patch=p[,mlp_ratio=r]" -> the architecture fields of
    DiTConfig (as CONFIGS holds them, plus mlp_ratio when given); ModelSpecError otherwise."""
    valid = (f"valid keys: {', '.join(_CUSTOM_REQUIRED)} (positive integers, required), mlp_ratio "
             f"(optional, default {DiTConfig.mlp_ratio:g}), e.g. custom:hidden=512,depth=8,heads=8,patch=2")

    def fail(why: str):
        raise ModelSpecError(f"model {spec!r}: {why}; {valid}")

    if not spec.startswith(CUSTOM_PREFIX):
        fail(f"a custom size starts with {CUSTOM_PREFIX!r}")
    given: dict[str, str] = {}
    for item in spec[len(CUSTOM_PREFIX):].split(","):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not key or not value:
            fail(f"{item.strip()!r} is not key=value")
        if key not in _CUSTOM_FIELDS:
            fail(f"unknown key {key!r}")
        if key in given:
            fail(f"{key} is given twice")
        given[key] = value
    missing = [k for k in _CUSTOM_REQUIRED if k not in given]
    if missing:
        fail(f"missing {', '.join(missing)}")
    arch = {}
    for key, value in given.items():
        try:
            number = float(value) if key == "mlp_ratio" else int(value)
        except ValueError:
            number = None
        if number is None or not math.isfinite(number) or number <= 0:
            fail(f"{key}={value} is not a positive {'number' if key == 'mlp_ratio' else 'integer'}")
        arch[_CUSTOM_FIELDS[key]] = number
    D, H = arch["hidden_size"], arch["num_heads"]
    if D % H:
        fail(f"hidden {D} is not divisible by heads {H}")
    if D % 4:
        fail(f"hidden {D} is not a multiple of 4 (the 2-D sin-cos position embedding needs it)")
    if int(D * arch.get("mlp_ratio", DiTConfig.mlp_ratio)) < 1:
        fail(f"mlp_ratio {arch['mlp_ratio']} leaves the MLP no hidden units")
    return arch


def custom_name(hidden_size: int, depth: int, num_heads: int | str, patch_size: int,
                mlp_ratio: float = 4.0) -> str:
    """The custom spec of these fields (mlp_ratio only when not the default; num_heads "?" for a
    spec to complete)."""
    ratio = f",mlp_ratio={mlp_ratio:g}" if mlp_ratio != DiTConfig.mlp_ratio else ""
    return f"{CUSTOM_PREFIX}hidden={hidden_size},depth={depth},heads={num_heads},patch={patch_size}{ratio}"


def architecture(name: str) -> dict:
    """The architecture fields of a registry name or a custom spec (KeyError: an unknown name,
    ModelSpecError: a custom spec that does not parse)."""
    if name.startswith(CUSTOM_PREFIX):
        return parse_custom(name)
    if name not in CONFIGS:
        raise KeyError(f"unknown model {name!r}; choose one of {', '.join(CONFIGS)}, or a custom size "
                       f"{CUSTOM_SPEC}")
    return dict(CONFIGS[name])


def get_config(name: str, **overrides) -> DiTConfig:
    """get_config("DiT-XL/2", input_size=32) or get_config("custom:hidden=512,depth=8,heads=8,patch=2")."""
    return DiTConfig(**{**architecture(name), **overrides})


def build_model(name: str, **overrides) -> DiT:
    """build_model("DiT-XL/2", input_size=32, num_classes=1000) -> DiT.
    Build under `with torch.device("meta"):` to count parameters of big models for free."""
    return DiT(get_config(name, **overrides))


# grad_checkpointing values that recompute one branch of every block instead of whole blocks
CHECKPOINT_BRANCHES = ("attn", "mlp")
# grad_checkpointing value that checkpoints every block selectively (see selective_checkpoint_policy)
CHECKPOINT_SELECTIVE = "selective"


def checkpoint_every(granularity: str | int | None) -> int:
    """The grad_checkpointing knob as "checkpoint every k-th block" (0 = never; a branch
    knob, "attn" or "mlp", and "selective" checkpoint no whole block: see block_recompute)."""
    if granularity in (None, "none", 0, False) or granularity in (*CHECKPOINT_BRANCHES, CHECKPOINT_SELECTIVE):
        return 0
    if granularity == "every":
        return 1
    if isinstance(granularity, int) and granularity > 0:
        return granularity
    if isinstance(granularity, str) and granularity.isdigit() and int(granularity) > 0:
        return int(granularity)
    raise ValueError(f"grad_checkpointing must be 'none', 'every', k >= 1, 'attn', 'mlp' or 'selective', "
                     f"got {granularity!r}")


def checkpoint_branch(granularity: str | int | None) -> str | None:
    """The branch every block recomputes in the backward pass: "attn" (norm1, modulate,
    self-attention and the text cross-attention), "mlp" (norm2, modulate, MLP), or None."""
    checkpoint_every(granularity)  # validates the knob
    return granularity if granularity in CHECKPOINT_BRANCHES else None


def block_recompute(granularity: str | int | None) -> str | None:
    """What DiTBlock.forward's `recompute` gets for this knob: "attn", "mlp", "selective" or None
    (whole-block checkpointing, "every" / k, is done around the block by DiT.forward)."""
    if granularity == CHECKPOINT_SELECTIVE:
        return CHECKPOINT_SELECTIVE
    return checkpoint_branch(granularity)


# -----------------------------------------------------------------------------
# Selective activation checkpointing

_aten = torch.ops.aten
# The ops whose outputs selective checkpointing keeps: the matmuls (nn.Linear reaches the
# dispatcher as addmm / mm, batched products as bmm / baddbmm) and every fused SDPA kernel
# (their outputs include the logsumexp the attention backward needs). Recomputing these
# would cost as much as the forward itself; what is left to recompute (LayerNorm, modulate,
# GELU, gates, residual adds, chunk/views) is element-wise, cheap in FLOPs.
SELECTIVE_SAVE_OPS = frozenset(
    op.default
    for op in (
        _aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten._scaled_mm,
        _aten._scaled_dot_product_flash_attention,
        _aten._scaled_dot_product_efficient_attention,
        _aten._scaled_dot_product_cudnn_attention,
        _aten._scaled_dot_product_flash_attention_for_cpu,
        _aten._scaled_dot_product_fused_attention_overrideable,
    )
)


def selective_checkpoint_policy(recompute_width: int | None = None):
    """The policy of grad_checkpointing="selective": MUST_SAVE the outputs of SELECTIVE_SAVE_OPS,
    PREFER_RECOMPUTE everything else (PREFER: torch.compile's partitioner may still choose to
    keep a fused element-wise result; MUST: it may not drop a matmul output).

    recompute_width: also recompute the matmuls whose output's last dim is this width (the
    MLP's fc1, mlp_ratio * D wide: 4 of the ~10 D-wide tensors kept per token and block;
    matched by width, so with mlp_ratio 3 it would catch qkv as well).

    The knob keeps EVERY matmul output (recompute_width=None), measured on DiT-S/2, 32x32
    latents, batch 16, fp32 (bench/activation_memory.py; bench/RESULTS.md, issue 17): it keeps
    0.56x the activations of "none" (814 of 1463 MiB), about what checkpointing every 2nd
    block keeps (0.53x), but recomputes no matmul at all where "2" recomputes half the model's
    forward (+17% of the step's FLOPs): the same memory for only element-wise recompute.
    Recomputing fc1 too keeps 0.36x (526 MiB) for +10% of the step's FLOPs (fc1 is a third of
    a block's forward); that is a different trade, below "mlp" in both memory (0.46x) and
    recompute (+20%), and stays a bench variant (DiTBlock.selective_recompute_width) until a
    GPU measurement says whether it earns a knob value of its own.
    An SDPA output includes its logsumexp ((N, heads, T) fp32), which the backward needs.
    """

    def policy(ctx, func, *args, **kwargs):
        if func in SELECTIVE_SAVE_OPS:
            out = getattr(ctx, "op_output", None)
            if recompute_width is not None and isinstance(out, torch.Tensor) and out.shape[-1] == recompute_width:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_checkpoint_context(recompute_width: int | None = None):
    """A `context_fn` for torch.utils.checkpoint.checkpoint with the selective policy."""
    return create_selective_checkpoint_contexts(selective_checkpoint_policy(recompute_width))


# -----------------------------------------------------------------------------
# Embedders


def modulate(x, shift, scale):
    # x (N, T, D), shift/scale (N, D): the adaLN affine, per sample instead of learned per channel
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


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
    (L, Dt), text_mask (N, L) / (L,). Returns a new dict for the keys of `text`."""
    out = {}
    for key, value in text.items():
        if value is None:
            out[key] = None
            continue
        e = empty[key].to(device=value.device, dtype=value.dtype).expand_as(value)
        m = drop.to(value.device).view(-1, *([1] * (value.dim() - 1)))
        out[key] = torch.where(m, e, value)
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
    """Multi-head self-attention; names (qkv, proj) match timm's, which DiT used."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool = False):
        super().__init__(dim, num_heads, qk_norm)
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        N, T, D = x.shape
        # (N, T, 3D) -> (3, N, heads, T, head_dim): the timm layout the checkpoints expect
        qkv = self.qkv(x).reshape(N, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self._norm(q, k, v)
        x = F.scaled_dot_product_attention(q, k, v)  # (N, heads, T, head_dim)
        return self.proj(x.transpose(1, 2).reshape(N, T, D))


# -----------------------------------------------------------------------------
# Which scaled_dot_product_attention kernel runs

# torch's SDPBackend -> the name attention_backend reports; on the CPU torch's FLASH_ATTENTION
# is its own fused kernel (not Dao's), reported as "cpu-flash"
_SDPA_NAMES = {
    SDPBackend.FLASH_ATTENTION: "flash",
    SDPBackend.EFFICIENT_ATTENTION: "efficient",
    SDPBackend.CUDNN_ATTENTION: "cudnn",
    SDPBackend.MATH: "math",
    SDPBackend.OVERRIDEABLE: "overrideable",
}
SDPA_BACKENDS = {**{name: backend for backend, name in _SDPA_NAMES.items()}, "cpu-flash": SDPBackend.FLASH_ATTENTION}


def _self_attention_qkv(config: DiTConfig, batch_size: int, dtype: torch.dtype, device, requires_grad: bool):
    # q, k, v as Attention.forward makes them: views of one (N, T, 3D) tensor, (N, heads, T, head_dim)
    # with the strides of that permute (QK-norm makes q and k contiguous copies). torch.empty:
    # the choice looks at shapes, strides, dtype and device, never at values
    N, T, D, H = batch_size, config.num_tokens, config.hidden_size, config.num_heads
    qkv = torch.empty(N, T, 3 * D, dtype=dtype, device=device, requires_grad=requires_grad)
    q, k, v = qkv.reshape(N, T, 3, H, D // H).permute(2, 0, 3, 1, 4).unbind(0)
    if config.qk_norm:
        q, k = q.contiguous(), k.contiguous()
    return q, k, v


def _sdpa_choice(q, k, v, device) -> str:
    # aten._fused_sdp_choice is the very selection F.scaled_dot_product_attention makes (same
    # checks, same priority order: torch._C._get_sdp_priority_order(), honouring sdpa_kernel)
    with torch.no_grad():
        backend = SDPBackend(torch.ops.aten._fused_sdp_choice(q, k, v))
    name = _SDPA_NAMES.get(backend, str(backend))
    return "cpu-flash" if name == "flash" and torch.device(device).type == "cpu" else name


def attention_backend(config: DiTConfig, batch_size: int, dtype: torch.dtype = torch.float32, device="cpu",
                      requires_grad: bool = True) -> str:
    """The scaled_dot_product_attention kernel the model's self-attention runs for this batch
    size, dtype (the autocast dtype under AMP) and device: "flash", "efficient", "cudnn" or
    "math" on CUDA, "cpu-flash" or "math" on the CPU. Asks torch's own dispatcher (no kernel
    runs; it allocates the (N, T, 3D) qkv tensor uninitialised, once). requires_grad: the
    training case (some kernels lack a backward for some head dims / GPUs). Honours an
    enclosing torch.nn.attention.sdpa_kernel(...)."""
    q, k, v = _self_attention_qkv(config, batch_size, dtype, device, requires_grad)
    return _sdpa_choice(q, k, v, device)


def attention_backends_available(config: DiTConfig, batch_size: int, dtype: torch.dtype = torch.float32,
                                 device="cpu", requires_grad: bool = True) -> list[str]:
    """The kernels that can run the model's self-attention at this shape, in torch's priority
    order (the first is attention_backend's answer unless sdpa_kernel restricts it). Force one
    for timing with `with attention_kernel(name):`."""
    q, k, v = _self_attention_qkv(config, batch_size, dtype, device, requires_grad)
    order = [SDPBackend(i) for i in torch._C._get_sdp_priority_order()]
    available = []
    for backend in order:
        if backend not in _SDPA_NAMES:
            continue
        try:
            with sdpa_kernel([backend]):
                name = _sdpa_choice(q, k, v, device)
        except RuntimeError:  # "No available kernel": this one cannot run these inputs
            continue
        if SDPA_BACKENDS[name] == backend:
            available.append(name)
    return available


def attention_kernel(name: str):
    """A context manager that lets scaled_dot_product_attention use only the named kernel
    (a name attention_backend returns); inside it, an attention that kernel cannot run raises."""
    if name not in SDPA_BACKENDS:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {', '.join(SDPA_BACKENDS)}")
    return sdpa_kernel([SDPA_BACKENDS[name]])


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


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class DiTBlock(nn.Module):
    """adaLN-Zero block: c regresses (shift, scale, gate) for attention and MLP; gates start
    at zero so every block is the identity at initialisation.
    With text tokens, a cross-attention layer sits between them (pre-LayerNorm, residual,
    not modulated: it already sees the text; its output projection starts at zero)."""

    def __init__(
        self, hidden_size: int, num_heads: int, mlp_ratio: float, qk_norm: bool, cross: bool
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads, qk_norm=qk_norm)
        if cross:
            self.norm_cross = nn.LayerNorm(hidden_size, eps=1e-6)
            self.cross_attn = CrossAttention(hidden_size, num_heads, qk_norm=qk_norm)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))
        # recompute="selective" also recomputes matmul outputs this wide (None: keep them all);
        # bench/activation_memory.py sets it to the MLP width to measure that variant
        self.selective_recompute_width: int | None = None

    def forward(self, x, c, context=None, context_mask=None, recompute=None):
        # x (N, T, D), c (N, D); recompute: "attn" | "mlp" | None, the branch whose activations
        # are recomputed in the backward pass instead of kept, or "selective", the whole block
        # with its matmul/attention outputs kept (DiT.forward passes block_recompute(knob)).
        # The checkpoint sits INSIDE forward so that a compiled block (block.compile()) traces
        # it with its policy: an SAC region around a compiled block would run it eagerly.
        if recompute == CHECKPOINT_SELECTIVE:
            # a partial, not a lambda: dynamo accepts only a function or a partial as context_fn;
            # respect_saved_tensors_hooks: save_on_cpu and the like see what the policy keeps
            context_fn = partial(selective_checkpoint_context, self.selective_recompute_width)
            return checkpoint(self.forward, x, c, context, context_mask, use_reentrant=False,
                              context_fn=context_fn, **_SAC_HOOKS)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(
            c
        ).chunk(6, dim=1)
        attn_args = (x, shift_msa, scale_msa, gate_msa, context, context_mask)
        if recompute == "attn":
            x = checkpoint(self._attention, *attn_args, use_reentrant=False)
        else:
            x = self._attention(*attn_args)
        if recompute == "mlp":
            return checkpoint(self._mlp, x, shift_mlp, scale_mlp, gate_mlp, use_reentrant=False)
        return self._mlp(x, shift_mlp, scale_mlp, gate_mlp)

    def _attention(self, x, shift, scale, gate, context, context_mask):
        # the attention branch with its residuals: self-attention, then (text) cross-attention
        x = x + gate.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift, scale))
        if context is not None:
            x = x + self.cross_attn(self.norm_cross(x), context, context_mask)
        return x

    def _mlp(self, x, shift, scale, gate):
        return x + gate.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift, scale))


class FinalLayer(nn.Module):
    """adaLN, then a linear map of each token back to a p x p x out_channels patch."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
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
        self.t_embedder = TimestepEmbedder(D, cfg.frequency_embedding_size)
        if cfg.num_classes:
            self.y_embedder = LabelEmbedder(cfg.num_classes, D, cfg.class_dropout_prob)
        if cfg.text_pooled_dim:
            self.text_pooled_embedder = TextEmbedder(cfg.text_pooled_dim, D, nn.SiLU())
        if cfg.text_token_dim:
            self.text_token_embedder = TextEmbedder(cfg.text_token_dim, D, nn.GELU(approximate="tanh"))
        # fixed 2-D sin-cos position embedding; a frozen Parameter (not a buffer) because the
        # released checkpoints store it under "pos_embed"
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.num_tokens, D), requires_grad=False)
        self.blocks = nn.ModuleList(
            DiTBlock(D, cfg.num_heads, cfg.mlp_ratio, cfg.qk_norm, cross=bool(cfg.text_token_dim))
            for _ in range(cfg.depth)
        )
        self.final_layer = FinalLayer(D, cfg.patch_size, cfg.out_channels)
        self.initialize_weights()

    @torch.no_grad()
    def initialize_weights(self):
        """DiT's init. Call again after `to_empty()` when the model was built on meta."""
        if self.pos_embed.is_meta:  # nothing to fill: a meta model is for counting only
            return

        def _basic_init(module):
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and module.weight is not None:
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

        self.apply(_basic_init)
        grid = self.config.input_size // self.patch_size
        self.pos_embed.copy_(sincos_pos_embed_2d(self.config.hidden_size, grid).unsqueeze(0))
        # the patch embedding is a linear map of the flattened patch
        w = self.x_embedder.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)
        if self.config.num_classes:
            nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        # adaLN-Zero: every block starts as the identity and the output is exactly zero
        for block in self.blocks:
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
            if hasattr(block, "cross_attn"):  # cross-attention joins the residual at zero too
                nn.init.zeros_(block.cross_attn.proj.weight)
                nn.init.zeros_(block.cross_attn.proj.bias)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].weight)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)

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

    def unpatchify(self, x):
        # (N, T, p*p*C) -> (N, C, H, W)
        N, T, _ = x.shape
        p, C = self.patch_size, self.out_channels
        h = w = int(T**0.5)
        x = x.reshape(N, h, w, p, p, C)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(N, C, h * p, w * p)

    def forward(
        self, x, t, y=None, text_pooled=None, text_tokens=None, text_mask=None, force_drop_ids=None
    ):
        """
        x: (N, C, H, W) latents; t: (N,) timesteps (int or float, 0..1000 scale)
        y: (N,) class labels, num_classes = the null class (unconditional)
        text_pooled: (N, Dp); text_tokens: (N, L, Dt); text_mask: (N, L) bool, True = real token
        force_drop_ids: (N,) 1 = replace the label by the null class (deterministic dropout)
        returns (N, out_channels, H, W): eps (or velocity), then the variance channels if learn_sigma
        """
        cfg = self.config
        x = self.x_embedder(x) + self.pos_embed  # (N, T, D), T = H * W / p^2
        c = self.t_embedder(t)  # (N, D)
        if cfg.num_classes:
            if y is None:
                raise ValueError(
                    "this model is class-conditional: pass y (use num_classes for the null class)"
                )
            c = c + self.y_embedder(y, self.training, force_drop_ids)
        if cfg.text_pooled_dim:
            if text_pooled is None:
                raise ValueError("this model takes a pooled text embedding: pass text_pooled")
            c = c + self.text_pooled_embedder(text_pooled.to(c.dtype))
        context = None
        if cfg.text_token_dim:
            if text_tokens is None:
                raise ValueError(
                    "this model cross-attends to text tokens: pass text_tokens (and text_mask)"
                )
            context = self.text_token_embedder(text_tokens.to(c.dtype))  # (N, L, D)

        training = self.training and torch.is_grad_enabled()
        k = checkpoint_every(cfg.grad_checkpointing) if training else 0
        recompute = block_recompute(cfg.grad_checkpointing) if training else None
        for i, block in enumerate(self.blocks):
            if k and i % k == 0:
                # recompute this block's activations in backward: memory for ~1/3 more compute
                x = checkpoint(block, x, c, context, text_mask, use_reentrant=False)
            else:
                x = block(x, c, context, text_mask, recompute=recompute)  # (N, T, D)
        x = self.final_layer(x, c)  # (N, T, p^2 * out_channels)
        return self.unpatchify(x)  # (N, out_channels, H, W)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self.config).items())


# -----------------------------------------------------------------------------
# Position embedding


def sincos_pos_embed_2d(dim: int, grid_size: int) -> torch.Tensor:
    """(grid_size^2, dim): the first half of the channels encodes the row, the second the
    column, each as [sin, cos] of the position times frequencies 1 / 10000^(i / (dim/4)).
    This is the MAE/DiT layout (tokens in row-major order), computed in float64."""
    assert dim % 4 == 0
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4))  # (D/4,)
    pos = torch.arange(grid_size, dtype=torch.float64)
    rows, cols = torch.meshgrid(pos, pos, indexing="ij")  # token index = row * grid + col

    def emb_1d(p):
        out = p.reshape(-1)[:, None] * omega[None]  # (M, D/4)
        return torch.cat([torch.sin(out), torch.cos(out)], dim=1)  # (M, D/2)

    # MAE's meshgrid(w, h) puts the COLUMN coordinate in its "emb_h" half; keep that order
    return torch.cat([emb_1d(cols), emb_1d(rows)], dim=1).float()


# -----------------------------------------------------------------------------
# Counting


def num_params(config: DiTConfig, trainable_only: bool = True) -> int:
    """Parameter count without allocating: builds on the meta device."""
    with torch.device("meta"):
        return DiT(config).num_params(trainable_only)


def flops_per_forward(config: DiTConfig, text_tokens: int = 0) -> int:
    """Multiply-adds of ONE sample's forward pass (multiply by 2 for FLOPs, by 3 for
    forward + backward). Counts every matmul: patch embedding, timestep MLP, the adaLN
    regressions (once per sample, not per token), per block q/k/v/out projections, the
    attention scores QK^T and the weighted sum AV, the MLP, the final layer; with text,
    the text embedders and the cross-attention (L = text_tokens). Leaves out
    element-wise work (norms, softmax, activations, modulation, the label lookup).
    This is the convention of the DiT paper's Gflops: XL/2 at 256 px gives 118.62 G."""
    D, T, p = config.hidden_size, config.num_tokens, config.patch_size
    H = int(D * config.mlp_ratio)
    L = text_tokens if config.text_token_dim else 0

    per_block = T * (3 * D * D + D * D + 2 * D * H)  # qkv, proj, fc1 + fc2
    per_block += 2 * T * T * D  # QK^T and AV, all heads together
    per_block += 6 * D * D  # adaLN modulation, once per sample
    if L:
        per_block += T * D * D + L * 2 * D * D + T * D * D  # q, kv, proj
        per_block += 2 * T * L * D  # QK^T and AV
    total = config.depth * per_block
    total += T * config.in_channels * p * p * D  # patch embedding
    total += config.frequency_embedding_size * D + D * D  # timestep MLP
    total += 2 * D * D + T * D * p * p * config.out_channels  # final adaLN + linear
    if config.text_pooled_dim:
        total += config.text_pooled_dim * D + D * D
    if L:
        total += L * (config.text_token_dim * D + D * D)
    return total


def describe(name: str, **overrides) -> dict:
    """One row of `dittrain models`: name, size fields, parameters and GMACs per forward."""
    cfg = get_config(name, **overrides)
    return dict(
        name=name,
        depth=cfg.depth,
        hidden=cfg.hidden_size,
        heads=cfg.num_heads,
        patch=cfg.patch_size,
        tokens=cfg.num_tokens,
        params=num_params(cfg),
        gflops=flops_per_forward(cfg) / 1e9,
    )


__all__ = [
    "CONFIGS",
    "CUSTOM_PREFIX",
    "CUSTOM_SPEC",
    "ModelSpecError",
    "architecture",
    "custom_name",
    "parse_custom",
    "CHECKPOINT_SELECTIVE",
    "DiT",
    "DiTConfig",
    "SDPA_BACKENDS",
    "SELECTIVE_SAVE_OPS",
    "attention_backend",
    "attention_backends_available",
    "attention_kernel",
    "block_recompute",
    "build_model",
    "checkpoint_branch",
    "checkpoint_every",
    "describe",
    "drop_text_conditioning",
    "flops_per_forward",
    "get_config",
    "num_params",
    "selective_checkpoint_context",
    "selective_checkpoint_policy",
]
