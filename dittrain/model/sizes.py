"""The DiT sizes: the model's config, the one registry of named sizes, custom sizes, and
what one costs (parameters, multiply-adds per forward, the rows of `dittrain models`).

    DiTConfig                        every field of a DiT (architecture + what the data implies)
    CONFIGS                          "DiT-XL/2" -> the architecture fields (the paper's Table 1, plus T),
                                     "LightningDiT-XL/1" -> the same sizes with LightningDiT's blocks
    get_config(name, **overrides)    a registry name or "custom:hidden=..,depth=..,heads=..,patch=.."
    flops_per_forward(config)        multiply-adds of one sample's forward (the paper's Gflops)

Block choices (DiTConfig.mlp / norm / pos): names in the block-part registries of
dittrain.model.parts (MLPS, NORMS, POSITIONS), which DiTConfig checks a value against and whose
entries give what this file counts: an MLP's width rule (mlp_hidden: SwiGLU's H' = 2M // 3 of
the GELU width M) and matmuls per token (flops_per_forward), a position's width checks. DiT's
blocks by default (gelu, layer, sincos); LightningDiT (Yao et al., 2025) swaps in a SwiGLU MLP,
RMSNorm and 2-D rotary position embedding on top of the sin-cos table (sincos+rope). A custom spec
names them (",mlp=swiglu,norm=rms,pos=sincos+rope"), every registered part included.

Arithmetic on names and numbers only (the grad-checkpointing knob is read by
dittrain.model.checkpointing): the network itself, and what it counts in parameters (the
rows of `dittrain models`), is dittrain.model.dit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ditdata.common.errors import UserError
from dittrain.model.checkpointing import checkpoint_every
from dittrain.model.parts import BLOCK_PARTS, MLPS, POSITIONS


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
    # the block parts, names in dittrain.model.parts' registries (MLPS, NORMS, POSITIONS)
    mlp: str = "gelu"  # gelu | swiglu (its width rule: the same parameters as the GELU MLP)
    norm: str = "layer"  # layer | rms: the adaLN-modulated norms of the blocks and the final layer
    pos: str = "sincos"  # sincos (a fixed pos_embed added to the tokens) | rope (q and k rotated, no pos_embed) | sincos+rope (both)
    text_pooled_dim: int | None = None  # pooled text embedding, added to c
    text_token_dim: int | None = None  # token embeddings, through cross-attention
    # "none" | "every" | k (every k-th block) | "attn" / "mlp" (that branch of every block) |
    # "selective" (every block, keeping its matmul and attention outputs)
    grad_checkpointing: str | int = "none"
    frequency_embedding_size: int = 256  # sinusoidal timestep features

    def __post_init__(self):
        assert self.input_size % self.patch_size == 0, "input_size must be a multiple of patch_size"
        assert self.hidden_size % self.num_heads == 0, "hidden_size must be a multiple of num_heads"
        for parts in BLOCK_PARTS:
            assert getattr(self, parts.field) in parts, f"{parts.field} must be one of {', '.join(parts)}"
        problem = POSITIONS[self.pos].check(self.hidden_size, self.num_heads)  # e.g. RoPE's head dim
        assert problem is None, problem
        checkpoint_every(self.grad_checkpointing)  # validates the knob

    @property
    def out_channels(self) -> int:
        return self.in_channels * 2 if self.learn_sigma else self.in_channels

    @property
    def num_tokens(self) -> int:
        return (self.input_size // self.patch_size) ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        """The MLP's hidden width (H' of SwiGLU): its part's width rule of the GELU width M."""
        return MLPS[self.mlp].width(int(self.hidden_size * self.mlp_ratio))


# The sizes of the DiT paper (Table 1) plus a tiny one for CPU tests and demos.
_SIZES = {
    "T": dict(depth=6, hidden_size=192, num_heads=4),
    "S": dict(depth=12, hidden_size=384, num_heads=6),
    "B": dict(depth=12, hidden_size=768, num_heads=12),
    "L": dict(depth=24, hidden_size=1024, num_heads=16),
    "XL": dict(depth=28, hidden_size=1152, num_heads=16),
}
_PATCHES = {"T": (2, 4), "S": (2, 4, 8), "B": (2, 4, 8), "L": (2, 4, 8), "XL": (2, 4, 8)}

# LightningDiT (Yao et al., 2025, "Reconstruction vs. Generation", hustvl/LightningDiT @ 2725fed4):
# DiT's B and XL sizes with patch 1 (its VA-VAE latents, 32x16x16 at 256 px, are already /16) or
# 2, and the blocks of its released configs (configs/lightningdit_xl_vavae_f16d32.yaml: use_swiglu,
# use_rmsnorm, use_rope true, use_qknorm false, wo_shift false). Its forward adds the fixed sin-cos
# pos_embed to the tokens whether or not it rotates q and k (models/lightningdit.py), hence
# sincos+rope. --qk-norm adds QK-norm (the 800-epoch config's advice against NaN losses).
# Until the presets matched the reference they were pos=rope (no pos_embed) with QK-norm: runs made
# then record that resolved config and keep it (dittrain.train.setup.model_config_for).
LIGHTNING = dict(mlp="swiglu", norm="rms", pos="sincos+rope", qk_norm=False)
_LIGHTNING_SIZES = {"B": (1, 2), "XL": (1, 2)}

# The one registry: "DiT-XL/2" -> the architecture fields of DiTConfig. Data-dependent
# fields (input_size, in_channels, num_classes, text dims) come from the latent store.
CONFIGS: dict[str, dict] = {
    **{f"DiT-{size}/{p}": dict(_SIZES[size], patch_size=p) for size in _SIZES for p in _PATCHES[size]},
    **{f"LightningDiT-{size}/{p}": dict(_SIZES[size], patch_size=p, **LIGHTNING)
       for size, patches in _LIGHTNING_SIZES.items() for p in patches},
}


# Sizes outside the registry, named by their fields: "custom:hidden=512,depth=8,heads=8,patch=2"
# (",mlp_ratio=R" and the block choices optional: ",mlp=swiglu,norm=rms,pos=rope,qk_norm=1").
# Such a name works wherever a registry name does.
CUSTOM_PREFIX = "custom:"
_CUSTOM_FIELDS = {"hidden": "hidden_size", "depth": "depth", "heads": "num_heads", "patch": "patch_size",
                  "mlp_ratio": "mlp_ratio", "mlp": "mlp", "norm": "norm", "pos": "pos", "qk_norm": "qk_norm"}
_CUSTOM_REQUIRED = ("hidden", "depth", "heads", "patch")
BLOCK_FIELDS = (*(parts.field for parts in BLOCK_PARTS), "qk_norm")  # DiTConfig's block choices, in custom-spec order
# the DiTConfig fields a model name decides (a preset's or a custom spec's); the others come from the data
# and the run's flags. A run's record keeps them resolved, so a resume builds what it trained even where a
# preset's meaning has changed since (dittrain.train.setup.model_config_for)
NAMED_FIELDS = ("hidden_size", "depth", "num_heads", "patch_size", "mlp_ratio", *BLOCK_FIELDS)
CUSTOM_SPEC = "custom:hidden=H,depth=D,heads=N,patch=P"  # the grammar, for messages


def _custom_choices() -> dict[str, dict]:
    """The optional keys that name a choice, key -> {spelling: value}: the block parts registered
    now (a part registered at run time is spelled like the built-in ones), and QK-norm."""
    return {**{parts.field: {name: name for name in parts} for parts in BLOCK_PARTS}, "qk_norm": {"0": False, "1": True}}


class ModelSpecError(UserError, ValueError):
    """A custom model spec that does not parse; the message is one line."""


def parse_custom(spec: str) -> dict:
    """"custom:hidden=D,depth=N,heads=H,patch=p[,mlp_ratio=r][,mlp=..][,norm=..][,pos=..][,qk_norm=0|1]"
    -> the architecture fields of DiTConfig (as CONFIGS holds them, plus the optional ones given);
    ModelSpecError otherwise."""
    named = _custom_choices()
    choices = ", ".join(f"{key} ({'|'.join(values)})" for key, values in named.items())
    valid = (f"valid keys: {', '.join(_CUSTOM_REQUIRED)} (positive integers, required), mlp_ratio "
             f"(optional, default {DiTConfig.mlp_ratio:g}), {choices} (optional, DiT's first), "
             "e.g. custom:hidden=512,depth=8,heads=8,patch=2")

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
        if key in named:
            if value not in named[key]:
                fail(f"{key}={value} is none of {'|'.join(named[key])}")
            arch[_CUSTOM_FIELDS[key]] = named[key][value]
            continue
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
    problem = POSITIONS[arch.get("pos", DiTConfig.pos)].check(D, H)  # RoPE's head dim, sin-cos's width
    if problem:
        fail(problem)
    if MLPS[arch.get("mlp", DiTConfig.mlp)].width(int(D * arch.get("mlp_ratio", DiTConfig.mlp_ratio))) < 1:
        fail(f"mlp_ratio {arch['mlp_ratio']} leaves the MLP no hidden units")
    return arch


def custom_name(hidden_size: int, depth: int, num_heads: int | str, patch_size: int, mlp_ratio: float = 4.0,
                **blocks) -> str:
    """The custom spec of these fields (mlp_ratio and the block choices, BLOCK_FIELDS, only when not
    the default; num_heads "?" for a spec to complete)."""
    ratio = f",mlp_ratio={mlp_ratio:g}" if mlp_ratio != DiTConfig.mlp_ratio else ""
    named = _custom_choices()
    spelled = {key: next(s for s, v in named[key].items() if v == value)
               for key, value in blocks.items() if value != getattr(DiTConfig, key)}
    choices = "".join(f",{key}={spelled[key]}" for key in BLOCK_FIELDS if key in spelled)
    return (f"{CUSTOM_PREFIX}hidden={hidden_size},depth={depth},heads={num_heads},patch={patch_size}{ratio}"
            f"{choices}")


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


def flops_per_forward(config: DiTConfig, text_tokens: int = 0, tokens: list[int] | None = None) -> int:
    """Multiply-adds of ONE sample's forward pass (multiply by 2 for FLOPs, by 3 for
    forward + backward). Counts every matmul: patch embedding, timestep MLP, the adaLN
    regressions (once per sample, not per token), per block q/k/v/out projections, the
    attention scores QK^T and the weighted sum AV, the MLP, the final layer; with text,
    the text embedders and the cross-attention (L = text_tokens). Leaves out
    element-wise work (norms, softmax, activations, modulation, the label lookup, the
    rotation of RoPE, SwiGLU's gate).
    This is the convention of the DiT paper's Gflops: XL/2 at 256 px gives 118.62 G.
    tokens: the tokens each block sees (token routing: dittrain.model.routing.block_tokens); default all T."""
    D, T, p = config.hidden_size, config.num_tokens, config.patch_size
    L = text_tokens if config.text_token_dim else 0
    total = sum(block_flops(config, t, L) for t in tokens or [T] * config.depth)
    total += T * config.in_channels * p * p * D  # patch embedding
    total += config.frequency_embedding_size * D + D * D  # timestep MLP
    total += 2 * D * D + T * D * p * p * config.out_channels  # final adaLN + linear
    if config.text_pooled_dim:
        total += config.text_pooled_dim * D + D * D
    if L:
        total += L * (config.text_token_dim * D + D * D)
    return total


def block_flops(config: DiTConfig, tokens: int, text_tokens: int = 0) -> int:
    """Multiply-adds of one block on `tokens` tokens of one sample (flops_per_forward's terms)."""
    D, T, H, L = config.hidden_size, tokens, config.mlp_hidden, text_tokens
    # qkv, proj, the MLP: its part's matmuls of D x H (GELU: fc1 + fc2, D -> H -> D; SwiGLU: fc1
    # D -> 2H' as two, fc2 H' -> D)
    per_block = T * (3 * D * D + D * D + MLPS[config.mlp].matmuls * D * H)
    per_block += 2 * T * T * D  # QK^T and AV, all heads together
    per_block += 6 * D * D  # adaLN modulation, once per sample
    if L:
        per_block += T * D * D + L * 2 * D * D + T * D * D  # q, kv, proj
        per_block += 2 * T * L * D  # QK^T and AV
    return per_block



__all__ = ["BLOCK_FIELDS", "CONFIGS", "NAMED_FIELDS", "CUSTOM_PREFIX", "CUSTOM_SPEC", "LIGHTNING", "DiTConfig",
           "ModelSpecError", "architecture", "block_flops", "custom_name", "flops_per_forward", "get_config",
           "parse_custom"]
