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
    frequency_embedding_size: int = 256  # sinusoidal timestep features (Gaussian Fourier: W's length)
    # the timestep embedding, one of TIME_EMBEDDINGS: "sinusoid" (DiT's: fixed geometric frequencies) or
    # "fourier" (RAE's DiT^DH: fixed random Gaussian frequencies W ~ N(0, 1), features of 2 pi t W, which
    # want t in [0, 1]: --flow-time-scale 1, as the reference feeds it)
    time_embed: str = "sinusoid"
    # the DDT head of DiT^DH (RAE, Zheng et al. 2025): head_depth wide blocks of width head_hidden and
    # head_heads heads after the trunk's `depth`, reading the noisy latent itself (its own patch embedding, no
    # position table) modulated per token by the trunk's output. 0: a plain DiT
    head_depth: int = 0
    head_hidden: int = 0
    head_heads: int = 0
    # the adaLN, one of ADALN: "zero" (DiT's adaLN-Zero: every block regresses its 6 D modulation from c) or
    # "single" (PixArt-alpha's adaLN-single, Chen et al. 2023, sec. 2.3: ONE regression t0 = t_block(c) (N, 6 D)
    # shared by all blocks, each adding its own learned scale_shift_table (6, D); PixArt's block: no norm before
    # the cross-attention; the final layer's shift and scale are its table (2, D) plus c itself)
    adaln: str = "zero"
    # the sin-cos table's positions: 0 = DiT's (token i of a side at position i); s > 0 = PixArt's (diffusers'
    # interpolation_scale s: position i * (base / n) / s on a side of n tokens, base = input_size / patch, so
    # every grid spans the configured one; the 512 px PixArt checkpoints 1, the 1024 px ones 2)
    pos_interpolation: float = 0.0
    # PixArt-alpha 1024's micro-conditions (diffusers' use_additional_conditions): the image's height, width and
    # aspect ratio, embedded and added to the timestep embedding. 0 = none; f > 0 = on, the image being the
    # latent x f pixels per side (f: the autoencoder's downsample, 8), as diffusers' pipeline passes its size
    micro_conditions: int = 0

    def __post_init__(self):
        assert self.input_size % self.patch_size == 0, "input_size must be a multiple of patch_size"
        assert self.hidden_size % self.num_heads == 0, "hidden_size must be a multiple of num_heads"
        for parts in BLOCK_PARTS:
            assert getattr(self, parts.field) in parts, f"{parts.field} must be one of {', '.join(parts)}"
        problem = POSITIONS[self.pos].check(self.hidden_size, self.num_heads)  # e.g. RoPE's head dim
        assert problem is None, problem
        checkpoint_every(self.grad_checkpointing)  # validates the knob
        assert self.time_embed in TIME_EMBEDDINGS, f"time_embed must be one of {', '.join(TIME_EMBEDDINGS)}"
        if self.head_depth:
            assert self.head_hidden > 0 and self.head_heads > 0, "a DDT head needs head_hidden and head_heads"
            assert self.head_hidden % self.head_heads == 0, "head_hidden must be a multiple of head_heads"
            if POSITIONS[self.pos].rotary is not None:  # the head rotates its q and k too (no table)
                problem = POSITIONS["rope"].check(self.head_hidden, self.head_heads)
                assert problem is None, f"the DDT head: {problem}"
        assert self.adaln in ADALN, f"adaln must be one of {', '.join(ADALN)}"
        if self.adaln == "single":
            assert not self.head_depth, "adaln=single (PixArt's) has no DDT head"
        assert self.pos_interpolation >= 0, "pos_interpolation must be >= 0 (0: DiT's positions)"
        if self.pos_interpolation:
            assert POSITIONS[self.pos].table is not None, "pos_interpolation scales a table: pos must have one"
        if self.micro_conditions:
            assert self.adaln == "single", "micro_conditions are PixArt's: they need adaln=single"
            assert self.hidden_size % 3 == 0, "micro_conditions need a hidden size divisible by 3 (D/3 per size)"

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

    @property
    def head_mlp_hidden(self) -> int:
        """The DDT head's MLP width: the same rule at head_hidden (RAE's blocks share mlp_ratio)."""
        return MLPS[self.mlp].width(int(self.head_hidden * self.mlp_ratio))

    @property
    def head_head_dim(self) -> int:
        return self.head_hidden // self.head_heads if self.head_heads else 0

    @property
    def time_features(self) -> int:
        """Width of the timestep features the time MLP reads: sin and cos of each frequency."""
        return 2 * self.frequency_embedding_size if self.time_embed == "fourier" else self.frequency_embedding_size


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

# RAE's DiT^DH (Zheng et al. 2025, "Diffusion Transformers with Representation Autoencoders", bytetriper/RAE
# @ a4d18c4, src/stage2/models/DDT.py DiTwDDTHead): a LightningDiT trunk (SwiGLU, RMSNorm, the sin-cos
# table added and q, k rotated: use_swiglu, use_rmsnorm, use_rope, use_pos_embed true, use_qknorm false),
# Gaussian Fourier timestep features, and a DDT head of 2 blocks 2048 wide with 16 heads, patch 1 on the
# RAE's 16x16 token grid. S and XL are the released training configs' (configs/stage2/training/ImageNet256/
# DiTDH-S_DINOv2-B.yaml: hidden [384, 2048], depth [12, 2], heads [6, 16]; DiTDH-XL_DINOv2-B.yaml: [1152,
# 2048], [28, 2], [16, 16]); B and L are the paper's scaling sizes, DiT-B's and DiT-L's trunks with the same
# head, which no released config spells out.
DDT_HEAD = dict(head_depth=2, head_hidden=2048, head_heads=16, time_embed="fourier")
_DDT_SIZES = ("S", "B", "L", "XL")

# PixArt-alpha / PixArt-Sigma (Chen et al. 2023, 2024; PixArt-alpha/PixArt-alpha @ cac2fd3 diffusion/model/nets/
# PixArt.py, PixArtMS.py; diffusers' PixArtTransformer2DModel): DiT-XL/2's size and blocks (GELU MLP, affine-free
# LayerNorm eps 1e-6, sin-cos table) under adaLN-single, cross-attention to T5 tokens through the caption projection
# (our text_token_embedder: Linear, tanh-GELU, Linear), learned sigma. The data give the text width (4096 for T5-XXL).
# "PixArt-XL/2": the 256/512 px checkpoints (interpolation scale 1: PixArt-XL-2-512x512, PixArt-Sigma-XL-2-512-MS);
# "PixArt-XL/2-1024": PixArt-XL-2-1024-MS (scale 2 and the size micro-conditions of an 8x autoencoder);
# "PixArt-Sigma-XL/2-1024": PixArt-Sigma-XL-2-1024-MS (scale 2, no micro-conditions)
PIXART = dict(adaln="single", pos_interpolation=1.0)
_PIXART = {"PixArt-XL/2": PIXART, "PixArt-XL/2-1024": dict(PIXART, pos_interpolation=2.0, micro_conditions=8),
           "PixArt-Sigma-XL/2-1024": dict(PIXART, pos_interpolation=2.0)}

# The one registry: "DiT-XL/2" -> the architecture fields of DiTConfig. Data-dependent
# fields (input_size, in_channels, num_classes, text dims) come from the latent store.
CONFIGS: dict[str, dict] = {
    **{f"DiT-{size}/{p}": dict(_SIZES[size], patch_size=p) for size in _SIZES for p in _PATCHES[size]},
    **{f"LightningDiT-{size}/{p}": dict(_SIZES[size], patch_size=p, **LIGHTNING)
       for size, patches in _LIGHTNING_SIZES.items() for p in patches},
    **{f"DiTDH-{size}/1": dict(_SIZES[size], patch_size=1, **LIGHTNING, **DDT_HEAD) for size in _DDT_SIZES},
    **{name: dict(_SIZES["XL"], patch_size=2, **arch) for name, arch in _PIXART.items()},
}
# the paper's spelling, accepted wherever a name is (a caret is awkward in some shells: zsh's extended glob)
ALIASES = {f"DiT^DH-{size}/1": f"DiTDH-{size}/1" for size in _DDT_SIZES}


# Sizes outside the registry, named by their fields: "custom:hidden=512,depth=8,heads=8,patch=2"
# (",mlp_ratio=R" and the block choices optional: ",mlp=swiglu,norm=rms,pos=rope,qk_norm=1").
# Such a name works wherever a registry name does.
CUSTOM_PREFIX = "custom:"
_CUSTOM_FIELDS = {"hidden": "hidden_size", "depth": "depth", "heads": "num_heads", "patch": "patch_size",
                  "mlp_ratio": "mlp_ratio", "mlp": "mlp", "norm": "norm", "pos": "pos", "qk_norm": "qk_norm",
                  "time": "time_embed", "head_depth": "head_depth", "head_hidden": "head_hidden",
                  "head_heads": "head_heads", "adaln": "adaln", "pos_interp": "pos_interpolation",
                  "micro": "micro_conditions"}
TIME_EMBEDDINGS = ("sinusoid", "fourier")
ADALN = ("zero", "single")  # DiT's adaLN-Zero, PixArt's adaLN-single
_PIXART_FIELDS = ("adaln", "pos_interpolation", "micro_conditions")  # a custom spec's ",adaln=single,pos_interp=S,micro=F"
_HEAD_FIELDS = ("head_depth", "head_hidden", "head_heads")  # all three or none
_CUSTOM_REQUIRED = ("hidden", "depth", "heads", "patch")
BLOCK_FIELDS = (*(parts.field for parts in BLOCK_PARTS), "qk_norm")  # DiTConfig's block choices, in custom-spec order
# the DiTConfig fields a model name decides (a preset's or a custom spec's); the others come from the data
# and the run's flags. A run's record keeps them resolved, so a resume builds what it trained even where a
# preset's meaning has changed since (dittrain.train.setup.model_config_for)
NAMED_FIELDS = ("hidden_size", "depth", "num_heads", "patch_size", "mlp_ratio", *BLOCK_FIELDS, "time_embed",
                *_HEAD_FIELDS, *_PIXART_FIELDS)
CUSTOM_SPEC = "custom:hidden=H,depth=D,heads=N,patch=P"  # the grammar, for messages


def _custom_choices() -> dict[str, dict]:
    """The optional keys that name a choice, key -> {spelling: value}: the block parts registered
    now (a part registered at run time is spelled like the built-in ones), and QK-norm."""
    return {**{parts.field: {name: name for name in parts} for parts in BLOCK_PARTS}, "qk_norm": {"0": False, "1": True},
            "time": {name: name for name in TIME_EMBEDDINGS}, "adaln": {name: name for name in ADALN}}


class ModelSpecError(UserError, ValueError):
    """A custom model spec that does not parse; the message is one line."""


def parse_custom(spec: str) -> dict:
    """"custom:hidden=D,depth=N,heads=H,patch=p[,mlp_ratio=r][,mlp=..][,norm=..][,pos=..][,qk_norm=0|1]
    [,time=sinusoid|fourier][,head_depth=K,head_hidden=W,head_heads=M]" -> the architecture fields of DiTConfig (as CONFIGS holds them, plus the optional ones given);
    ModelSpecError otherwise."""
    named = _custom_choices()
    choices = ", ".join(f"{key} ({'|'.join(values)})" for key, values in named.items())
    valid = (f"valid keys: {', '.join(_CUSTOM_REQUIRED)} (positive integers, required), mlp_ratio "
             f"(optional, default {DiTConfig.mlp_ratio:g}), {choices} (optional, DiT's first), "
             "head_depth, head_hidden, head_heads (a DDT head: all three or none), "
             "pos_interp (a positive number), micro (a positive integer) (PixArt's, with adaln=single), "
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
    if any(k in given for k in _HEAD_FIELDS) and not all(k in given for k in _HEAD_FIELDS):
        fail(f"a DDT head needs all of {', '.join(_HEAD_FIELDS)}")
    arch = {}
    for key, value in given.items():
        if key in named:
            if value not in named[key]:
                fail(f"{key}={value} is none of {'|'.join(named[key])}")
            arch[_CUSTOM_FIELDS[key]] = named[key][value]
            continue
        real = key in ("mlp_ratio", "pos_interp")
        try:
            number = float(value) if real else int(value)
        except ValueError:
            number = None
        if number is None or not math.isfinite(number) or number <= 0:
            fail(f"{key}={value} is not a positive {'number' if real else 'integer'}")
        arch[_CUSTOM_FIELDS[key]] = number
    D, H = arch["hidden_size"], arch["num_heads"]
    if D % H:
        fail(f"hidden {D} is not divisible by heads {H}")
    problem = POSITIONS[arch.get("pos", DiTConfig.pos)].check(D, H)  # RoPE's head dim, sin-cos's width
    if problem:
        fail(problem)
    if MLPS[arch.get("mlp", DiTConfig.mlp)].width(int(D * arch.get("mlp_ratio", DiTConfig.mlp_ratio))) < 1:
        fail(f"mlp_ratio {arch['mlp_ratio']} leaves the MLP no hidden units")
    if arch.get("adaln") != "single" and ("pos_interpolation" in arch or "micro_conditions" in arch):
        fail("pos_interp and micro are PixArt's: they need adaln=single")
    if arch.get("micro_conditions") and D % 3:
        fail(f"micro needs a hidden size divisible by 3, not {D}")
    if "head_depth" in arch:
        if arch.get("adaln") == "single":
            fail("adaln=single (PixArt's) has no DDT head")
        if arch["head_hidden"] % arch["head_heads"]:
            fail(f"head_hidden {arch['head_hidden']} is not divisible by head_heads {arch['head_heads']}")
        if POSITIONS[arch.get("pos", DiTConfig.pos)].rotary is not None:  # the head rotates q and k too
            problem = POSITIONS["rope"].check(arch["head_hidden"], arch["head_heads"])
            if problem:
                fail(f"the DDT head: {problem}")
    return arch


def custom_name(hidden_size: int, depth: int, num_heads: int | str, patch_size: int, mlp_ratio: float = 4.0,
                **blocks) -> str:
    """The custom spec of these fields (mlp_ratio, the block choices, BLOCK_FIELDS, the time embedding and
    a DDT head's fields, only when not the default; num_heads "?" for a spec to complete)."""
    ratio = f",mlp_ratio={mlp_ratio:g}" if mlp_ratio != DiTConfig.mlp_ratio else ""
    named = _custom_choices()
    spelled = {key: next(s for s, v in named["time" if key == "time_embed" else key].items() if v == value)
               for key, value in blocks.items()
               if key not in (*_HEAD_FIELDS, *_PIXART_FIELDS) and value != getattr(DiTConfig, key)}
    choices = "".join(f",{key}={spelled[key]}" for key in BLOCK_FIELDS if key in spelled)
    if "time_embed" in spelled:
        choices += f",time={spelled['time_embed']}"
    if blocks.get("head_depth"):
        choices += "".join(f",{key}={blocks[key]}" for key in _HEAD_FIELDS)
    if blocks.get("adaln", DiTConfig.adaln) != DiTConfig.adaln:
        choices += f",adaln={blocks['adaln']}"
        if blocks.get("pos_interpolation"):
            choices += f",pos_interp={blocks['pos_interpolation']:g}"
        if blocks.get("micro_conditions"):
            choices += f",micro={blocks['micro_conditions']}"
    return (f"{CUSTOM_PREFIX}hidden={hidden_size},depth={depth},heads={num_heads},patch={patch_size}{ratio}"
            f"{choices}")


def architecture(name: str) -> dict:
    """The architecture fields of a registry name or a custom spec (KeyError: an unknown name,
    ModelSpecError: a custom spec that does not parse)."""
    if name.startswith(CUSTOM_PREFIX):
        return parse_custom(name)
    name = ALIASES.get(name, name)
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
    the text embedders and the cross-attention (L = text_tokens); with a DDT head, its patch
    embedding, the projection of the trunk's tokens to its width, its blocks and its final layer,
    whose adaLN regressions run per token (they read the trunk's tokens, not one vector). Leaves out
    element-wise work (norms, softmax, activations, modulation, the label lookup, the
    rotation of RoPE, SwiGLU's gate, the Gaussian Fourier features).
    This is the convention of the DiT paper's Gflops: XL/2 at 256 px gives 118.62 G.
    tokens: the tokens each block sees (token routing: dittrain.model.routing.block_tokens); default all T."""
    D, T, p = config.hidden_size, config.num_tokens, config.patch_size
    L = text_tokens if config.text_token_dim else 0
    total = sum(block_flops(config, t, L) for t in tokens or [T] * config.depth)
    total += T * config.in_channels * p * p * D  # patch embedding
    total += config.time_features * D + D * D  # timestep MLP
    if config.head_depth:
        Dh = config.head_hidden
        total += config.head_depth * block_flops(config, T, head=True)
        total += T * config.in_channels * p * p * Dh  # the head's patch embedding of x_t
        total += T * D * Dh if D != Dh else 0  # s_projector: the trunk's tokens to the head's width
        total += T * 2 * Dh * Dh + T * Dh * p * p * config.out_channels  # final adaLN (per token) + linear
    elif config.adaln == "single":  # the one t_block regression (N, 6D); the final layer's table is added, no matmul
        total += 6 * D * D + T * D * p * p * config.out_channels
        if config.micro_conditions:  # 3 size embedders (height, width, aspect ratio): 256 -> D/3 -> D/3 each
            total += 3 * (config.frequency_embedding_size * (D // 3) + (D // 3) ** 2)
    else:
        total += 2 * D * D + T * D * p * p * config.out_channels  # final adaLN + linear
    if config.text_pooled_dim and config.adaln != "single":  # PixArt reads no pooled embedding
        total += config.text_pooled_dim * D + D * D
    if L:
        total += L * (config.text_token_dim * D + D * D)
    return total


def block_flops(config: DiTConfig, tokens: int, text_tokens: int = 0, head: bool = False) -> int:
    """Multiply-adds of one block on `tokens` tokens of one sample (flops_per_forward's terms);
    head: a block of the DDT head (its width, its MLP, the adaLN per token, no text)."""
    if head:
        D, H, L = config.head_hidden, config.head_mlp_hidden, 0
    else:
        D, H, L = config.hidden_size, config.mlp_hidden, text_tokens
    T = tokens
    # qkv, proj, the MLP: its part's matmuls of D x H (GELU: fc1 + fc2, D -> H -> D; SwiGLU: fc1
    # D -> 2H' as two, fc2 H' -> D)
    per_block = T * (3 * D * D + D * D + MLPS[config.mlp].matmuls * D * H)
    per_block += 2 * T * T * D  # QK^T and AV, all heads together
    if config.adaln != "single" or head:  # adaLN-single: the blocks add their table to the shared t0, no matmul
        per_block += 6 * D * D * (T if head else 1)  # adaLN modulation, once per sample (a head's: per token)
    if L:
        per_block += T * D * D + L * 2 * D * D + T * D * D  # q, kv, proj
        per_block += 2 * T * L * D  # QK^T and AV
    return per_block


__all__ = ["ADALN", "PIXART", "ALIASES", "BLOCK_FIELDS", "CONFIGS", "DDT_HEAD", "TIME_EMBEDDINGS", "NAMED_FIELDS", "CUSTOM_PREFIX", "CUSTOM_SPEC", "LIGHTNING", "DiTConfig",
           "ModelSpecError", "architecture", "block_flops", "custom_name", "flops_per_forward", "get_config",
           "parse_custom"]
