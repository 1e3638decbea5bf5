"""DiT: sizes, parameter and FLOP counts against the paper, checkpoint compatibility,
adaLN-Zero init, conditioning, gradient checkpointing and the `dittrain models` table."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from tiny import assert_grads_close, backward_each

import dittrain.model as model_mod
from dittrain.cli import main as cli
from dittrain.model import build_model, drop_text_conditioning
from dittrain.sizes import num_params
from dittrain.specs import CONFIGS, flops_per_forward, get_config

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
