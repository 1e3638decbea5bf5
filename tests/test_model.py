"""DiT: sizes, parameter and FLOP counts against the paper, checkpoint compatibility,
adaLN-Zero init, conditioning, gradient checkpointing and the `dittrain models` table; the
LightningDiT blocks (SwiGLU, RMSNorm, 2-D RoPE) against their definitions, and the default
blocks against the DiT paper's network, bit for bit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from tiny import assert_grads_close, backward_each

import dittrain.model.dit as model_mod
from dittrain.cli import main as cli
from dittrain.model.dit import (
    DiTBlock,
    SwiGLU,
    apply_rope,
    build_model,
    drop_text_conditioning,
    num_params,
    rope_rows,
    rope_table,
    sincos_pos_embed_2d,
)
from dittrain.model.parts import NORMS
from dittrain.model.sizes import CONFIGS, LIGHTNING, flops_per_forward, get_config

# The DiT paper at 256 px: 4 latent channels, 32x32 latents, 1000 classes, learned sigma.
PAPER_256 = dict(input_size=32, in_channels=4, num_classes=1000, learn_sigma=True)
PAPER_PARAMS_M = {"DiT-S/2": 32.9, "DiT-B/2": 130.3, "DiT-L/2": 457.8, "DiT-XL/2": 674.8}
PAPER_GFLOPS = {"DiT-S/2": 6.06, "DiT-B/2": 23.01, "DiT-L/2": 80.70, "DiT-XL/2": 118.62}


def tiny(**overrides):
    kw = dict(input_size=8, in_channels=4, num_classes=10, hidden_size=64, depth=3, num_heads=4)
    kw.update(overrides)
    return build_model("DiT-T/2", **kw)


def randomize_(model, std=0.05, seed=0):
    """Non-zero weights everywhere, so outputs and gradients actually depend on every block
    (adaLN-Zero makes a fresh model's output and block gradients exactly zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "pos_embed":
                p.add_(std * torch.randn(p.shape, generator=g))
    return model


def inputs(n=3, C=4, size=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, C, size, size, generator=g)
    t = torch.tensor([0.0, 412.5, 999.0][:n])
    y = torch.tensor([0, 7, 10][:n])  # 10 = the null class
    return x, t, y


# -----------------------------------------------------------------------------
# registry and counts


def test_registry_names():
    for size in ("S", "B", "L", "XL"):
        for p in (2, 4, 8):
            assert f"DiT-{size}/{p}" in CONFIGS
    assert "DiT-T/2" in CONFIGS and "DiT-T/4" in CONFIGS
    xl = get_config("DiT-XL/2")
    assert (xl.hidden_size, xl.depth, xl.num_heads, xl.mlp_ratio, xl.patch_size) == (
        1152,
        28,
        16,
        4.0,
        2,
    )
    assert get_config("DiT-B/4", input_size=16).num_tokens == 16
    with pytest.raises(KeyError, match="DiT-XL/2"):
        get_config("DiT-XXL/2")
    with pytest.raises(ValueError):
        get_config("DiT-T/2", grad_checkpointing="sometimes")


@pytest.mark.parametrize("name", list(PAPER_PARAMS_M))
def test_param_counts_match_paper(name):
    # trainable parameters (the frozen sin-cos pos_embed is not counted, as in the paper);
    # measured: 32.87 / 130.32 / 457.84 / 674.83 M
    n = num_params(get_config(name, **PAPER_256))
    assert abs(n / 1e6 - PAPER_PARAMS_M[name]) / PAPER_PARAMS_M[name] < 0.005


@pytest.mark.parametrize("name", list(PAPER_GFLOPS))
def test_flops_match_paper(name):
    # measured: 6.056 / 23.005 / 80.698 / 118.621 G multiply-adds
    g = flops_per_forward(get_config(name, **PAPER_256)) / 1e9
    assert abs(g - PAPER_GFLOPS[name]) / PAPER_GFLOPS[name] < 0.005


def test_flops_xl2_512():
    g = flops_per_forward(get_config("DiT-XL/2", **{**PAPER_256, "input_size": 64})) / 1e9
    assert abs(g - 524.5) / 524.5 < 0.005  # measured 524.54


def test_flops_count_text_terms():
    base = get_config("DiT-T/2", input_size=8)
    text = get_config("DiT-T/2", input_size=8, text_pooled_dim=32, text_token_dim=48)
    assert (
        flops_per_forward(text, text_tokens=77)
        > flops_per_forward(text, text_tokens=0)
        > flops_per_forward(base)
    )


def test_meta_build_allocates_nothing():
    with torch.device("meta"):
        m = build_model("DiT-XL/2", **PAPER_256)
    assert all(p.is_meta for p in m.parameters())
    assert m.num_params() == num_params(get_config("DiT-XL/2", **PAPER_256))
    assert m.num_params(trainable_only=False) - m.num_params() == 256 * 1152  # pos_embed


# -----------------------------------------------------------------------------
# compatibility with the released facebookresearch/DiT checkpoints


def official_dit_shapes(
    depth, hidden, patch, in_channels=4, num_classes=1000, input_size=32, freq=256
):
    """Key -> shape of a class-conditional DiT with learned sigma, written out from the
    paper's architecture (timm PatchEmbed/Attention/Mlp names, adaLN-Zero, 1001-row label
    table with the null class, fixed pos_embed stored in the state dict)."""
    out = 2 * in_channels
    T = (input_size // patch) ** 2
    shapes = {
        "pos_embed": (1, T, hidden),
        "x_embedder.proj.weight": (hidden, in_channels, patch, patch),
        "x_embedder.proj.bias": (hidden,),
        "t_embedder.mlp.0.weight": (hidden, freq),
        "t_embedder.mlp.0.bias": (hidden,),
        "t_embedder.mlp.2.weight": (hidden, hidden),
        "t_embedder.mlp.2.bias": (hidden,),
        "y_embedder.embedding_table.weight": (num_classes + 1, hidden),
    }
    for i in range(depth):
        for name, (o, n) in {
            "attn.qkv": (3 * hidden, hidden),
            "attn.proj": (hidden, hidden),
            "mlp.fc1": (4 * hidden, hidden),
            "mlp.fc2": (hidden, 4 * hidden),
            "adaLN_modulation.1": (6 * hidden, hidden),
        }.items():
            shapes[f"blocks.{i}.{name}.weight"] = (o, n)
            shapes[f"blocks.{i}.{name}.bias"] = (o,)
    shapes.update(
        {
            "final_layer.linear.weight": (patch * patch * out, hidden),
            "final_layer.linear.bias": (patch * patch * out,),
            "final_layer.adaLN_modulation.1.weight": (2 * hidden, hidden),
            "final_layer.adaLN_modulation.1.bias": (2 * hidden,),
        }
    )
    return shapes


@pytest.mark.parametrize("input_size", [32, 64])  # the 256 and 512 px checkpoints
def test_official_xl2_state_dict_loads_strictly(input_size):
    shapes = official_dit_shapes(depth=28, hidden=1152, patch=2, input_size=input_size)
    assert len(shapes) == 8 + 28 * 10 + 4
    with torch.device("meta"):  # 675 M parameters: shapes only
        model = build_model("DiT-XL/2", **{**PAPER_256, "input_size": input_size})
        sd = {k: torch.empty(s) for k, s in shapes.items()}
    model.load_state_dict(
        sd, strict=True, assign=True
    )  # raises on any missing/extra/mis-shaped key
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == shapes


def test_official_layout_loads_real_weights():
    # the same layout at a small size, with real tensors: loading changes what the model computes
    shapes = official_dit_shapes(depth=2, hidden=64, patch=2, num_classes=10, input_size=8)
    g = torch.Generator().manual_seed(0)
    sd = {k: 0.05 * torch.randn(s, generator=g) for k, s in shapes.items()}
    model = tiny(depth=2, learn_sigma=True).eval()
    model.load_state_dict(sd, strict=True)
    x, t, y = inputs()
    assert model(x, t, y).abs().sum() > 0
    sd.pop("blocks.1.mlp.fc2.bias")
    with pytest.raises(RuntimeError, match="Missing"):
        tiny(depth=2).load_state_dict(sd, strict=True)


def test_optional_layers_add_keys_only_when_enabled():
    base = set(tiny().state_dict())
    qk = set(tiny(qk_norm=True).state_dict())
    text = set(tiny(text_pooled_dim=16, text_token_dim=24).state_dict())
    assert base < qk and all("q_norm" in k or "k_norm" in k for k in qk - base)
    assert base < text
    assert all(
        k.startswith(("text_", "blocks.")) and ("text_" in k or "cross" in k) for k in text - base
    )
    assert "y_embedder.embedding_table.weight" not in tiny(num_classes=0).state_dict()


def test_pos_embed_is_mae_sincos():
    # MAE/DiT: grid = meshgrid(w, h); first half of the channels from grid[0], second from
    # grid[1]; each half is [sin, cos] of pos * 1/10000^(i/(D/4))
    D, n = 64, 4
    grid = np.stack(np.meshgrid(np.arange(n, dtype=np.float32), np.arange(n, dtype=np.float32)))

    def emb1d(d, pos):
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2))
        out = pos.reshape(-1)[:, None] * omega[None]
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    want = np.concatenate([emb1d(D // 2, grid[0]), emb1d(D // 2, grid[1])], axis=1)
    model = tiny(hidden_size=D)
    assert not model.pos_embed.requires_grad
    np.testing.assert_allclose(model.pos_embed[0].numpy(), want, atol=1e-6)


# -----------------------------------------------------------------------------
# behaviour


def test_init_outputs_zeros_and_shapes():
    m = tiny(learn_sigma=True, qk_norm=True, text_pooled_dim=16, text_token_dim=24)
    x, t, y = inputs()
    text = dict(
        text_pooled=torch.randn(3, 16),
        text_tokens=torch.randn(3, 5, 24),
        text_mask=torch.tensor([[1, 1, 0, 0, 0]] * 3).bool(),
    )
    out = m(x, t, y, **text)
    assert out.shape == (3, 8, 8, 8)
    assert torch.equal(out, torch.zeros_like(out))
    out = tiny(learn_sigma=False, num_classes=0)(x, t.long())  # integer timesteps, unconditional
    assert out.shape == x.shape and not out.any()


def test_label_dropout_uses_null_class():
    m = randomize_(tiny()).eval()
    x, t, y = inputs()
    null = torch.full_like(y, 10)
    forced = m(x, t, y, force_drop_ids=torch.tensor([1, 0, 1]))
    ref = m(x, t, torch.where(torch.tensor([True, False, True]), null, y))
    torch.testing.assert_close(forced, ref)
    always = randomize_(tiny(class_dropout_prob=1.0)).train()
    torch.testing.assert_close(always(x, t, y), always(x, t, null))
    with pytest.raises(ValueError, match="pass y"):
        m(x, t)


def test_text_padding_is_ignored_and_empty_mask_is_safe():
    m = randomize_(tiny(num_classes=0, text_pooled_dim=16, text_token_dim=24)).eval()
    x, t, _ = inputs()
    g = torch.Generator().manual_seed(3)
    tokens = torch.randn(3, 6, 24, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]).bool()
    pooled = torch.randn(3, 16, generator=g)
    out = m(x, t, text_pooled=pooled, text_tokens=tokens, text_mask=mask)
    assert torch.isfinite(out).all()
    tokens2 = torch.where(mask[..., None], tokens, torch.randn_like(tokens))  # change only padding
    torch.testing.assert_close(
        m(x, t, text_pooled=pooled, text_tokens=tokens2, text_mask=mask), out
    )


def test_drop_text_conditioning():
    text = dict(
        text_pooled=torch.ones(3, 4),
        text_tokens=torch.ones(3, 2, 5),
        text_mask=torch.ones(3, 2).bool(),
    )
    empty = dict(
        text_pooled=torch.zeros(4),
        text_tokens=torch.zeros(2, 5),
        text_mask=torch.tensor([True, False]),
    )
    out = drop_text_conditioning(text, empty, torch.tensor([False, True, False]))
    assert out["text_pooled"][1].eq(0).all() and out["text_pooled"][[0, 2]].eq(1).all()
    assert out["text_tokens"][1].eq(0).all() and out["text_mask"][1].tolist() == [True, False]
    assert out["text_mask"][0].all()


@pytest.mark.parametrize("granularity, calls", [("every", 3), (2, 2)])
def test_grad_checkpointing_matches(monkeypatch, granularity, calls):
    torch.manual_seed(0)
    overrides = dict(learn_sigma=True, qk_norm=True, text_token_dim=24)
    ref = randomize_(tiny(**overrides)).train()
    ckpt = tiny(**overrides).train()
    ckpt.set_grad_checkpointing(granularity)
    ckpt.load_state_dict(ref.state_dict())
    x, t, y = inputs()
    kw = dict(
        text_tokens=torch.randn(3, 5, 24),
        text_mask=torch.ones(3, 5).bool(),
        force_drop_ids=torch.tensor([0, 1, 0]),
    )  # label dropout made deterministic

    n_calls = []
    real = model_mod.checkpoint
    monkeypatch.setattr(model_mod, "checkpoint", lambda *a, **k: n_calls.append(1) or real(*a, **k))
    losses = backward_each(lambda m: (m(x, t, y, **kw) ** 2).mean(), ref, ckpt)
    assert len(n_calls) == calls  # 3 blocks: every -> 3, every 2nd -> blocks 0 and 2
    torch.testing.assert_close(losses[0], losses[1])
    assert_grads_close(ref, ckpt, rtol=1e-5, atol=1e-6)
    assert any(
        p.grad.abs().sum() > 0 for n, p in ref.named_parameters() if n.startswith("blocks.0.")
    )


def test_meta_then_materialise():
    # the large-model path: build on meta, allocate, then fill with DiT's init
    with torch.device("meta"):
        m = tiny()
    m = m.to_empty(device="cpu")
    m.initialize_weights()
    x, t, y = inputs()
    assert not m(x, t, y).any()
    torch.testing.assert_close(m.pos_embed, tiny().pos_embed)
    assert m.pos_embed[0, 0, 16:32].eq(1).all()  # token (0, 0): cos(0) in both halves


def test_models_command_lists_sizes():
    result = CliRunner().invoke(cli, ["models"])
    assert result.exit_code == 0, result.output
    line = next(row for row in result.output.splitlines() if row.startswith("DiT-XL/2 "))
    assert "674.8M" in line and "118.62" in line
    assert "DiT-T/4" in result.output
    result = CliRunner().invoke(cli, ["models", "--resolution", "512"])
    assert "524.54" in next(
        row for row in result.output.splitlines() if row.startswith("DiT-XL/2 ")
    )


# -----------------------------------------------------------------------------
# LightningDiT blocks: SwiGLU, RMSNorm, 2-D RoPE


def grid_rotations(head_dim: int, grid: int, theta: float = 10000.0) -> torch.Tensor:
    """(T, head_dim, head_dim): RoPE by its definition, one rotation matrix per token of a
    row-major grid, block-diagonal in 2x2 planes: plane j < head_dim/4 of the first half turns by
    row * w_j, plane j of the second half by col * w_j, w_j = theta^(-2j / (head_dim / 2))."""
    half = head_dim // 2
    R = torch.zeros(grid * grid, head_dim, head_dim, dtype=torch.float64)
    for token in range(grid * grid):
        for offset, pos in ((0, token // grid), (half, token % grid)):  # (row half, column half)
            for j in range(half // 2):
                a = pos * theta ** (-2 * j / half)
                i = offset + 2 * j
                R[token, i:i + 2, i:i + 2] = torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]],
                                                          dtype=torch.float64)
    return R


def test_rope_is_the_rotation_of_its_definition():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 25, 16, generator=g, dtype=torch.float64).float()  # (N, heads, T, head_dim), 5x5 grid
    want = torch.einsum("tij,nhtj->nhti", grid_rotations(16, 5), q.double())
    torch.testing.assert_close(apply_rope(q, rope_table(16, 5)), want.float(), rtol=1e-5, atol=1e-5)
    cos, sin = rope_table(16, 5)
    assert cos.shape == sin.shape == (25, 16) and cos.dtype == torch.float32
    # the row half turns with the row only, the column half with the column only
    assert torch.equal(cos[7, :8], cos[9, :8]) and not torch.equal(cos[7, 8:], cos[9, 8:])  # (1, 2) vs (1, 4)
    assert torch.equal(cos[2, 8:], cos[17, 8:]) and not torch.equal(cos[2, :8], cos[17, :8])  # (0, 2) vs (3, 2)


def test_rope_logits_depend_on_relative_position_only():
    """<R(p) q, R(r) k> = <R(p + o) q, R(r + o) k> for any 2-D offset o: the rotated queries and
    keys of two tokens give the same attention logit wherever the pair sits on the grid."""
    grid, head_dim = 12, 32
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 1, 1, head_dim, generator=g).unbind(0)  # one query and one key vector
    rope = rope_table(head_dim, grid)
    every = torch.arange(grid * grid)
    rq = apply_rope(q.expand(1, 1, grid * grid, head_dim), rope)[0, 0]  # (T, head_dim): q at every position
    rk = apply_rope(k.expand(1, 1, grid * grid, head_dim), rope)[0, 0]
    logits = rq @ rk.T  # (T, T): q at token p against k at token r
    rows, cols = every // grid, every % grid
    inner = (rows < 6) & (cols < 6)  # the pairs inside the top-left 6x6, shifted by each offset
    p_idx = every[inner]
    for dy, dx in ((0, 1), (3, 0), (5, 4), (6, 6)):
        moved = p_idx + dy * grid + dx
        torch.testing.assert_close(logits[moved][:, moved], logits[p_idx][:, p_idx], rtol=1e-4, atol=1e-4)
        # moving only the query changes them: the logit does depend on the relative position
        assert (logits[moved][:, p_idx] - logits[p_idx][:, p_idx]).abs().max() > 1e-2


def test_swiglu_and_rmsnorm_match_their_definitions():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 24, generator=g)
    mlp = SwiGLU(24, 10)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    W, b = mlp.fc1.weight, mlp.fc1.bias  # (2H', D): W1's rows, then W3's
    W1, W3, b1, b3 = W[:10], W[10:], b[:10], b[10:]
    want = (torch.nn.functional.silu(x @ W1.T + b1) * (x @ W3.T + b3)) @ mlp.fc2.weight.T + mlp.fc2.bias
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)
    assert (mlp.fc1.out_features, mlp.fc2.in_features) == (20, 10)

    norm = NORMS["rms"].module(24)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24, generator=g))
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), want, rtol=1e-5, atol=1e-6)
    assert not [p for p in NORMS["layer"].module(24).parameters()]  # DiT's LayerNorm: no affine


def reference_forward(sd: dict, cfg, x, t, y) -> torch.Tensor:
    """The class-conditional DiT written out from its definitions, on a state dict: the paper's
    network (adaLN-Zero blocks, tanh-GELU MLP, affine-free LayerNorm, the sin-cos table in
    pos_embed) for default blocks; LightningDiT's with cfg.mlp / norm / pos (SwiGLU, RMSNorm
    x / sqrt(mean x^2 + eps) * w, q and k rotated by grid_rotations: pos=rope without the table,
    pos=sincos+rope with it, as hustvl/LightningDiT's forward always adds it)."""
    F = torch.nn.functional
    D, p, heads = cfg.hidden_size, cfg.patch_size, cfg.num_heads
    grid = cfg.input_size // p

    def norm(h, key):
        if cfg.norm == "rms":
            return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * sd[key + ".weight"]
        return F.layer_norm(h, (D,), eps=1e-6)

    def linear(h, key):
        return F.linear(h, sd[key + ".weight"], sd[key + ".bias"])

    def rotate(h):  # (N, heads, T, head_dim)
        R = grid_rotations(D // heads, grid).float()
        return torch.einsum("tij,nhtj->nhti", R, h)

    h = F.conv2d(x, sd["x_embedder.proj.weight"], sd["x_embedder.proj.bias"], stride=p).flatten(2).transpose(1, 2)
    if cfg.pos in ("sincos", "sincos+rope"):
        h = h + sd["pos_embed"]
    half = cfg.frequency_embedding_size // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half) / half)
    args = t.float()[:, None] * freqs[None]
    c = linear(F.silu(linear(torch.cat([torch.cos(args), torch.sin(args)], dim=-1), "t_embedder.mlp.0")),
               "t_embedder.mlp.2")
    c = c + sd["y_embedder.embedding_table.weight"][y]
    N, T, _ = h.shape
    for i in range(cfg.depth):
        b = f"blocks.{i}."
        shift1, scale1, gate1, shift2, scale2, gate2 = linear(F.silu(c), b + "adaLN_modulation.1").chunk(6, dim=1)
        a = norm(h, b + "norm1") * (1 + scale1.unsqueeze(1)) + shift1.unsqueeze(1)
        q, k, v = linear(a, b + "attn.qkv").reshape(N, T, 3, heads, D // heads).permute(2, 0, 3, 1, 4).unbind(0)
        if cfg.pos in ("rope", "sincos+rope"):
            q, k = rotate(q), rotate(k)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(N, T, D)
        h = h + gate1.unsqueeze(1) * linear(a, b + "attn.proj")
        m = norm(h, b + "norm2") * (1 + scale2.unsqueeze(1)) + shift2.unsqueeze(1)
        if cfg.mlp == "swiglu":
            u, w = linear(m, b + "mlp.fc1").chunk(2, dim=-1)
            m = linear(F.silu(u) * w, b + "mlp.fc2")
        else:
            m = linear(F.gelu(linear(m, b + "mlp.fc1"), approximate="tanh"), b + "mlp.fc2")
        h = h + gate2.unsqueeze(1) * m
    shift, scale = linear(F.silu(c), "final_layer.adaLN_modulation.1").chunk(2, dim=1)
    h = linear(norm(h, "final_layer.norm_final") * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1),
               "final_layer.linear")
    h = torch.einsum("nhwpqc->nchpwq", h.reshape(N, grid, grid, p, p, cfg.out_channels))
    return h.reshape(N, cfg.out_channels, grid * p, grid * p)


def test_default_blocks_are_the_dit_paper_network_bit_for_bit():
    """With the block choices at their defaults the model is the DiT of before: the released
    checkpoints' keys (test_official_*), no new ones, and the paper's forward, bit for bit."""
    m = randomize_(tiny(learn_sigma=True)).eval()
    cfg = m.config
    assert (cfg.mlp, cfg.norm, cfg.pos) == ("gelu", "layer", "sincos")
    assert set(m.state_dict()) == set(official_dit_shapes(depth=3, hidden=64, patch=2, num_classes=10,
                                                           input_size=8))
    x, t, y = inputs()
    with torch.no_grad():
        assert torch.equal(m(x, t, y), reference_forward(m.state_dict(), cfg, x, t, y))


LIGHT = dict(LIGHTNING, hidden_size=64, num_heads=4)  # head_dim 16


@pytest.mark.parametrize("pos", ["sincos+rope", "rope"])
def test_lightning_blocks_are_their_definitions(pos):
    """The presets' blocks (sincos+rope: the table added and q, k rotated) and pos=rope (what the
    presets were before: no table), against reference_forward; QK-norm on top of either."""
    m = randomize_(tiny(**{**LIGHT, "pos": pos, "qk_norm": True})).eval()
    cfg = m.config
    sd = m.state_dict()
    if pos == "rope":
        assert "pos_embed" not in sd and not hasattr(m, "pos_embed")  # RoPE alone: no table at all
    else:  # the frozen sin-cos table of DiT, beside the rotation
        assert not m.pos_embed.requires_grad
        torch.testing.assert_close(sd["pos_embed"][0], sincos_pos_embed_2d(64, 4))
    assert {"blocks.0.norm1.weight", "blocks.0.norm2.weight", "final_layer.norm_final.weight",
            "blocks.0.attn.q_norm.weight"} <= set(sd)
    assert sd["blocks.0.mlp.fc1.weight"].shape == (2 * cfg.mlp_hidden, 64) and cfg.mlp_hidden == 170  # 2 * 256 // 3
    x, t, y = inputs()
    with torch.no_grad():
        out = m(x, t, y)
        # reference_forward has no QK-norm: compare on a model without it (the presets' own)
        plain = randomize_(tiny(**{**LIGHT, "pos": pos})).eval()
        assert not any("q_norm" in k for k in plain.state_dict())
        torch.testing.assert_close(plain(x, t, y), reference_forward(plain.state_dict(), plain.config, x, t, y),
                                   rtol=1e-4, atol=1e-5)
        again, hidden = m(x, t, y, return_hidden=2)  # REPA's hidden tokens: the output unchanged
    assert torch.equal(again, out) and hidden.shape == (3, 16, 64)
    # the positions matter: the same tokens in another order give other outputs
    assert not torch.allclose(out, m(x.flip(-1), t, y).flip(-1), atol=1e-4)


def test_blocks_take_per_sample_rope_rows():
    """What token routing passes a block: the kept tokens x[n, idx[n]] with rope_rows(rope, idx)
    (N, T', head_dim). With idx a permutation per sample, the block's output is the full
    block's, permuted the same way (attention with RoPE sees positions, not the order); with
    idx = every token, bit for bit the shared table's."""
    torch.manual_seed(0)
    m = randomize_(tiny(**LIGHT)).eval()
    block = m.blocks[0]
    g = torch.Generator().manual_seed(3)
    x, c = torch.randn(3, 16, 64, generator=g), torch.randn(3, 64, generator=g)
    rope = rope_table(16, 4)
    with torch.no_grad():
        full = block(x, c, rope=rope)
        every = torch.arange(16).expand(3, 16)
        assert torch.equal(block(x, c, rope=rope_rows(rope, every)), full)
        idx = torch.stack([torch.randperm(16, generator=g) for _ in range(3)])  # (N, T')
        rows = rope_rows(rope, idx)
        assert rows[0].shape == (3, 16, 16)
        kept = torch.gather(x, 1, idx[..., None].expand(-1, -1, 64))
        want = torch.gather(full, 1, idx[..., None].expand(-1, -1, 64))
        torch.testing.assert_close(block(kept, c, rope=rows), want, rtol=1e-5, atol=1e-5)
        # a subset of 10 kept tokens runs too: (N, 10, D) with (N, 10, head_dim) tables
        assert block(kept[:, :10], c, rope=rope_rows(rope, idx[:, :10])).shape == (3, 10, 64)


@pytest.mark.parametrize("per_sample", [False, True])
def test_a_lightning_block_compiles_in_one_graph(per_sample):
    """dittrain.train.step.compile_model compiles each DiTBlock: with rope (a tuple kwarg, shared or per
    sample) dynamo traces it whole (fullgraph: no graph break) and computes what eager does."""
    torch._dynamo.reset()
    block = DiTBlock(64, 4, 170, qk_norm=True, cross=False, mlp="swiglu", norm="rms").eval()
    g = torch.Generator().manual_seed(4)
    x, c = torch.randn(2, 16, 64, generator=g), torch.randn(2, 64, generator=g)
    rope = rope_table(16, 4)
    if per_sample:
        rope = rope_rows(rope, torch.stack([torch.randperm(16, generator=g) for _ in range(2)]))
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, c, rope=rope), block(x, c, rope=rope))


def test_lightning_registry_and_counts():
    """LightningDiT-B and -XL at patch 1 and 2: DiT's sizes with swiglu + rms + sincos+rope, no QK-norm.
    Parameters: the published 675 M of LightningDiT-XL/1 on VA-VAE latents (32x16x16, 1000
    classes, no learned sigma); GFLOPs: the closed form, equal to the matmuls torch counts."""
    from torch.utils.flop_counter import FlopCounterMode

    for size, dit in (("B", "DiT-B"), ("XL", "DiT-XL")):
        for p in (1, 2):
            arch = CONFIGS[f"LightningDiT-{size}/{p}"]
            assert arch == {**CONFIGS[f"{dit}/2"], "patch_size": p, **LIGHTNING}
    assert LIGHTNING == dict(mlp="swiglu", norm="rms", pos="sincos+rope", qk_norm=False)
    vavae = dict(input_size=16, in_channels=32, num_classes=1000, learn_sigma=False)
    xl1 = get_config("LightningDiT-XL/1", **vavae)
    assert xl1.mlp_hidden == 3072 and xl1.num_tokens == 256
    assert abs(num_params(xl1) / 1e6 - 675) / 675 < 0.005  # measured 674.97 M
    for name in ("LightningDiT-XL/1", "LightningDiT-B/1", "custom:hidden=64,depth=2,heads=2,patch=2,mlp=swiglu"):
        with torch.device("meta"):
            m = build_model(name, **vavae).eval()
            with FlopCounterMode(display=False) as counted:
                m(torch.empty(1, 32, 16, 16), torch.ones(1), torch.zeros(1, dtype=torch.long))
        assert counted.get_total_flops() == 2 * flops_per_forward(m.config), name  # FLOPs = 2 x multiply-adds
    # SwiGLU's three matmuls of width H' = 2/3 of GELU's: the same MLP multiply-adds
    assert flops_per_forward(get_config("DiT-XL/2", input_size=32)) == flops_per_forward(
        get_config("DiT-XL/2", input_size=32, mlp="swiglu"))
