"""PixArt in diffusers' layout: our adaLN-single DiT (DiTConfig.adaln = "single", the PixArt-* presets) against
diffusers' PixArtTransformer2DModel, both ways, on names and shapes only (no files: dittrain.inference.weights
reads a diffusers folder, dittrain.inference.export writes one).

    pixart_fields(config_json)        a PixArtTransformer2DModel's config.json -> the DiTConfig fields it implies
    diffusers_config(cfg)             DiTConfig -> the PixArtTransformer2DModel config that holds it
    from_diffusers(state, depth)      diffusers' state dict -> ours
    to_diffusers(state, depth)        ours -> diffusers'

The names (diffusers @ 0.42, transformers/pixart_transformer_2d.py, attention.py BasicTransformerBlock with
norm_type "ada_norm_single", normalization.py AdaLayerNormSingle, embeddings.py PixArtAlpha*):

    pos_embed.proj                                 x_embedder.proj            the patch convolution
    adaln_single.emb.timestep_embedder.linear_1/2  t_embedder.mlp.0/2         the timestep MLP (256 -> D -> D)
    adaln_single.emb.resolution_embedder, ...      resolution_embedder, ...   the micro-conditions' MLPs
    adaln_single.linear                            t_block.1                  adaLN-single: c -> t0 (N, 6D)
    caption_projection.linear_1/2                  text_token_embedder.mlp.0/2  T5 width -> D -> D, tanh-GELU
    transformer_blocks.i.scale_shift_table         blocks.i.scale_shift_table (6, D)
    transformer_blocks.i.attn1.to_q/to_k/to_v      blocks.i.attn.qkv          concatenated q, k, v (3D, D)
    transformer_blocks.i.attn1.to_out.0            blocks.i.attn.proj
    transformer_blocks.i.attn2.to_q                blocks.i.cross_attn.q
    transformer_blocks.i.attn2.to_k/to_v           blocks.i.cross_attn.kv     concatenated k, v (2D, D)
    transformer_blocks.i.attn2.to_out.0            blocks.i.cross_attn.proj
    transformer_blocks.i.ff.net.0.proj / ff.net.2  blocks.i.mlp.fc1 / fc2
    scale_shift_table                              final_layer.scale_shift_table (2, D)
    proj_out                                       final_layer.linear

Neither side has norm weights (elementwise_affine False). diffusers' pos_embed buffer is not saved (persistent
False); ours is the frozen pos_embed, computed from the config (DiT.initialize_weights), never loaded from a
diffusers folder.
"""

from __future__ import annotations

import torch

# diffusers' one-to-one names -> ours (prefix -> prefix, each with .weight and .bias)
_TOP = {
    "pos_embed.proj.": "x_embedder.proj.",
    "adaln_single.emb.timestep_embedder.linear_1.": "t_embedder.mlp.0.",
    "adaln_single.emb.timestep_embedder.linear_2.": "t_embedder.mlp.2.",
    "adaln_single.emb.resolution_embedder.linear_1.": "resolution_embedder.mlp.0.",
    "adaln_single.emb.resolution_embedder.linear_2.": "resolution_embedder.mlp.2.",
    "adaln_single.emb.aspect_ratio_embedder.linear_1.": "aspect_ratio_embedder.mlp.0.",
    "adaln_single.emb.aspect_ratio_embedder.linear_2.": "aspect_ratio_embedder.mlp.2.",
    "adaln_single.linear.": "t_block.1.",
    "caption_projection.linear_1.": "text_token_embedder.mlp.0.",
    "caption_projection.linear_2.": "text_token_embedder.mlp.2.",
    "proj_out.": "final_layer.linear.",
}
_BLOCK = {"attn1.to_out.0.": "attn.proj.", "attn2.to_q.": "cross_attn.q.", "attn2.to_out.0.": "cross_attn.proj.",
          "ff.net.0.proj.": "mlp.fc1.", "ff.net.2.": "mlp.fc2."}
# ours fused, theirs split (in this order along the output dim): Attention.qkv's (3, heads, head_dim) layout
_FUSED = {"attn.qkv.": ("attn1.to_q.", "attn1.to_k.", "attn1.to_v."), "cross_attn.kv.": ("attn2.to_k.", "attn2.to_v.")}
_PARAMS = ("weight", "bias")


class PixArtConfigError(ValueError):
    """A diffusers config this model cannot hold (the message is one line, without the source)."""


def pixart_fields(config: dict) -> dict:
    """The DiTConfig fields a PixArtTransformer2DModel config.json implies: hidden_size, depth, num_heads,
    patch_size, in_channels, learn_sigma, input_size, text_token_dim, adaln, pos_interpolation, micro_conditions
    (the defaults diffusers fills: interpolation_scale max(sample_size // 64, 1), use_additional_conditions
    sample_size == 128). PixArtConfigError for what our blocks do not have."""
    c = {k: v for k, v in config.items() if not k.startswith("_")}

    def get(key, default):
        return c.get(key, default) if c.get(key) is not None else default

    checks = (("norm_type", "ada_norm_single"), ("activation_fn", "gelu-approximate"), ("norm_elementwise_affine", False),
              ("attention_bias", True), ("attention_type", "default"))
    for key, want in checks:
        if get(key, want) != want:
            raise PixArtConfigError(f"{key} is {c[key]!r}; ours is PixArt's {want!r}")
    if float(get("norm_eps", 1e-6)) != 1e-6:
        raise PixArtConfigError(f"norm_eps is {c['norm_eps']}; ours is PixArt's 1e-6")
    heads, head_dim = int(get("num_attention_heads", 16)), int(get("attention_head_dim", 72))
    D, C = heads * head_dim, int(get("in_channels", 4))
    out = int(get("out_channels", C))
    if out not in (C, 2 * C):
        raise PixArtConfigError(f"out_channels {out} is neither in_channels {C} nor twice it (learned sigma)")
    if get("cross_attention_dim", D) != D:
        raise PixArtConfigError(f"cross_attention_dim {c['cross_attention_dim']} is not the width {D}")
    if get("caption_channels", None) is None:
        raise PixArtConfigError("caption_channels is null (no caption projection); ours reads text tokens")
    sample = int(get("sample_size", 128))
    micro = get("use_additional_conditions", sample == 128)
    return dict(hidden_size=D, depth=int(get("num_layers", 28)), num_heads=heads, patch_size=int(get("patch_size", 2)),
                in_channels=C, learn_sigma=out == 2 * C, input_size=sample, text_token_dim=int(c["caption_channels"]),
                adaln="single", pos_interpolation=float(get("interpolation_scale", max(sample // 64, 1))),
                micro_conditions=8 if micro else 0)


def diffusers_config(cfg) -> dict:
    """The PixArtTransformer2DModel keyword arguments that hold DiTConfig `cfg` (an adaLN-single text model with
    PixArt's blocks; dittrain.inference.export refuses the others first). A micro-conditioned model's factor
    must be 8: diffusers' pipeline passes the image's pixels, its VAE's factor."""
    return dict(num_attention_heads=cfg.num_heads, attention_head_dim=cfg.head_dim, in_channels=cfg.in_channels,
                out_channels=cfg.out_channels, num_layers=cfg.depth, sample_size=cfg.input_size,
                patch_size=cfg.patch_size, cross_attention_dim=cfg.hidden_size, caption_channels=cfg.text_token_dim,
                interpolation_scale=cfg.pos_interpolation, use_additional_conditions=bool(cfg.micro_conditions),
                norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
                activation_fn="gelu-approximate", attention_bias=True, num_embeds_ada_norm=1000)


def _renamed(state: dict, out: dict, names: dict[str, str], *, to_ours: bool, theirs_at: str = "",
             ours_at: str = "") -> set[str]:
    """The weights and biases of `names` ({diffusers' prefix: ours}, under theirs_at / ours_at) that `state`
    holds, put in `out` under the other side's names: diffusers' -> ours when to_ours, else ours -> diffusers'.
    Those a model may lack (the micro-conditions' MLPs) are skipped. Returns the keys of `state` taken."""
    used = set()
    for theirs, ours in names.items():
        src, dst = (theirs_at + theirs, ours_at + ours) if to_ours else (ours_at + ours, theirs_at + theirs)
        for p in _PARAMS:
            if src + p in state:
                out[dst + p] = state[src + p]
                used.add(src + p)
    return used


def from_diffusers(state: dict, depth: int) -> dict:
    """diffusers' PixArtTransformer2DModel state dict -> ours (keys it has that no mapping names are kept as
    they are, so that a strict load names them)."""
    out = {}
    used = _renamed(state, out, _TOP, to_ours=True)
    if "scale_shift_table" in state:
        out["final_layer.scale_shift_table"] = state["scale_shift_table"]
        used.add("scale_shift_table")
    for i in range(depth):
        t, o = f"transformer_blocks.{i}.", f"blocks.{i}."
        if t + "scale_shift_table" in state:
            out[o + "scale_shift_table"] = state[t + "scale_shift_table"]
            used.add(t + "scale_shift_table")
        used |= _renamed(state, out, _BLOCK, to_ours=True, theirs_at=t, ours_at=o)
        for ours, parts in _FUSED.items():
            for p in _PARAMS:
                keys = [t + part + p for part in parts]
                if all(k in state for k in keys):
                    out[o + ours + p] = torch.cat([state[k] for k in keys], dim=0)
                    used.update(keys)
    out.update({k: v for k, v in state.items() if k not in used and k != "pos_embed.pos_embed"})
    return out


def to_diffusers(state: dict, depth: int) -> dict:
    """Our adaLN-single DiT's state dict -> PixArtTransformer2DModel's (pos_embed left out: diffusers computes
    its own, not saved)."""
    out = {}
    _renamed(state, out, _TOP, to_ours=False)
    out["scale_shift_table"] = state["final_layer.scale_shift_table"]
    for i in range(depth):
        t, o = f"transformer_blocks.{i}.", f"blocks.{i}."
        out[t + "scale_shift_table"] = state[o + "scale_shift_table"]
        for theirs, ours in _BLOCK.items():  # every block of ours has all of them: a missing one fails here
            for p in _PARAMS:
                out[t + theirs + p] = state[o + ours + p]
        for ours, parts in _FUSED.items():
            for p in _PARAMS:
                for part, chunk in zip(parts, state[o + ours + p].chunk(len(parts), dim=0), strict=True):
                    out[t + part + p] = chunk
    return {k: v.contiguous() for k, v in out.items()}


__all__ = ["PixArtConfigError", "diffusers_config", "from_diffusers", "pixart_fields", "to_diffusers"]
