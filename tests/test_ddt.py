"""DiT^DH, RAE's DiT with a DDT head (Zheng et al. 2025; bytetriper/RAE @ a4d18c4 src/stage2/models/DDT.py):
the presets' sizes and parameter counts against the reference's (bench/ddt_reference.py built its class and
counted them, and matched our outputs on the same weights), the FLOPs torch counts, the head's wiring (it
reads x_t again, modulated per token by the trunk), its init, grad checkpointing and compile over the head,
the custom spec, and --t-shift auto's formula. Runs on RAE latents are in tests/test_rae.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dittrain.diffusion import dimension_shift
from dittrain.model.dit import DiT, build_model, num_params
from dittrain.model.sizes import (
    CONFIGS,
    DDT_HEAD,
    LIGHTNING,
    ModelSpecError,
    architecture,
    custom_name,
    flops_per_forward,
    get_config,
)

RAE_LATENT = dict(input_size=16, in_channels=768, num_classes=1000, learn_sigma=False)
TINY = ("custom:hidden=32,depth=2,heads=2,patch=1,mlp=swiglu,norm=rms,pos=sincos+rope,time=fourier,"
        "head_depth=2,head_hidden=64,head_heads=4")
TINY_LATENT = dict(input_size=4, in_channels=8, num_classes=10, learn_sigma=False)


def _random(model: DiT, seed: int = 0) -> DiT:
    """Every weight random: adaLN-Zero makes a fresh model's output 0 whatever its wiring."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def test_presets_are_the_papers_sizes_with_the_reference_counts():
    trunks = {"S": (384, 12, 6), "B": (768, 12, 12), "L": (1024, 24, 16), "XL": (1152, 28, 16)}
    for size, (hidden, depth, heads) in trunks.items():
        arch = CONFIGS[f"DiTDH-{size}/1"]
        assert arch == dict(hidden_size=hidden, depth=depth, num_heads=heads, patch_size=1, **LIGHTNING, **DDT_HEAD)
        assert architecture(f"DiT^DH-{size}/1") == arch  # the paper's spelling
    assert DDT_HEAD == dict(head_depth=2, head_hidden=2048, head_heads=16, time_embed="fourier")
    # every parameter (the frozen pos_embed and Fourier frequencies too) as DiTwDDTHead counts them for the
    # released configs: 196,455,764 (S) and 838,675,796 (XL), bench/ddt_reference.py
    assert num_params(get_config("DiTDH-S/1", **RAE_LATENT), trainable_only=False) == 196_455_764
    assert num_params(get_config("DiTDH-XL/1", **RAE_LATENT), trainable_only=False) == 838_675_796
    trainable = num_params(get_config("DiTDH-XL/1", **RAE_LATENT))
    assert trainable == 838_675_796 - 256 * 1152 - 256  # less pos_embed (T x D) and W (256)


@pytest.mark.parametrize("name", ["DiTDH-S/1", "DiTDH-XL/1", TINY])
def test_flops_are_the_matmuls_torch_counts(name):
    latent = RAE_LATENT if name.startswith("DiTDH") else TINY_LATENT
    with torch.device("meta"):
        model = build_model(name, **latent).eval()
        C, side = latent["in_channels"], latent["input_size"]
        with FlopCounterMode(display=False) as counted:
            model(torch.empty(1, C, side, side), torch.ones(1), torch.zeros(1, dtype=torch.long))
    assert counted.get_total_flops() == 2 * flops_per_forward(model.config)  # FLOPs = 2 x multiply-adds


def test_the_head_reads_x_t_under_the_trunks_tokens():
    model = _random(build_model(TINY, **TINY_LATENT)).eval()
    keys = model.state_dict().keys()
    for key in ("head_embedder.proj.weight", "s_projector.weight", "head_blocks.1.adaLN_modulation.1.weight",
                "t_embedder.W", "pos_embed"):
        assert key in keys
    assert model.final_layer.linear.weight.shape == (8, 64)  # the final layer at the head's width
    x, t, y = torch.randn(2, 8, 4, 4), torch.rand(2), torch.tensor([1, 2])
    with torch.no_grad():
        out = model(x, t, y)
        # the head's own path from x_t: with the trunk's patch embedding fixed, x_t still changes the output
        # through head_embedder (a DiT's only path from x is x_embedder)
        model.head_embedder.proj.weight.mul_(2)
        assert not torch.allclose(model(x, t, y), out)
        model.head_embedder.proj.weight.div_(2)
        # per-token modulation: the head's adaLN reads (N, T, W), one row per token of the trunk's output
        seen = {}
        hook = model.head_blocks[0].adaLN_modulation.register_forward_hook(
            lambda m, args, result: seen.update(c=args[0].shape))  # None: the output stays
        model(x, t, y)
        hook.remove()
    assert seen["c"] == (2, 16, 64)


def test_init_is_the_references():
    torch.manual_seed(0)
    model = build_model(TINY, **TINY_LATENT)
    x, t, y = torch.randn(2, 8, 4, 4), torch.rand(2), torch.tensor([1, 2])
    with torch.no_grad():
        assert torch.equal(model(x, t, y), torch.zeros(2, 8, 4, 4))  # adaLN-Zero and a zero final layer
    W = model.t_embedder.W
    assert not W.requires_grad and W.shape == (256,) and 0.7 < W.std().item() < 1.3  # N(0, 1), frozen
    # the blocks' linears keep torch's init (kaiming-uniform, bound 1 / sqrt(fan_in)): DiTwDDTHead builds with
    # xavier_uniform_init=False, where DiT's own init makes them xavier-uniform (bound sqrt(6 / (fan_in + fan_out)))
    qkv = model.blocks[0].attn.qkv.weight  # 32 -> 96
    assert qkv.abs().max().item() <= 1 / math.sqrt(32) < math.sqrt(6 / (32 + 96))
    assert model.blocks[0].attn.qkv.bias.abs().max().item() > 0  # torch's bias init, not zero
    with torch.device("meta"):  # built on meta, then materialised: the same init from initialize_weights
        meta = build_model(TINY, **TINY_LATENT)
    meta.to_empty(device="cpu")
    meta.initialize_weights()
    assert meta.t_embedder.W.std().item() > 0.5 and torch.equal(meta.final_layer.linear.weight, torch.zeros(8, 64))


@pytest.mark.parametrize("mode", ["every", 1, 3, "attn", "mlp", "selective"])
def test_grad_checkpointing_covers_the_head(mode):
    """The same loss and gradients with the knob as without; 3 checkpoints block 0 and the head's first
    (block 3 of 4 counted over trunk and head)."""
    def grads(granularity):
        torch.manual_seed(0)
        model = _random(build_model(TINY, **TINY_LATENT, grad_checkpointing=granularity)).train()
        torch.manual_seed(1)
        x, t, y = torch.randn(2, 8, 4, 4), torch.rand(2), torch.tensor([1, 2])
        model(x, t, y, force_drop_ids=torch.zeros(2)).square().mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    want, got = grads("none"), grads(mode)
    assert want.keys() == got.keys() and any(k.startswith("head_blocks") for k in got)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_compiled_blocks_include_the_head():
    from dittrain.train.step import compile_model

    model = _random(build_model(TINY, **TINY_LATENT)).eval()
    x, t, y = torch.randn(2, 8, 4, 4), torch.rand(2), torch.tensor([1, 2])
    with torch.no_grad():
        want = model(x, t, y)
    compile_model(model, "blocks", "default")
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in (*model.blocks, *model.head_blocks))
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, y), want, rtol=1e-4, atol=1e-5)


def test_custom_spec_of_a_head_and_its_one_line_errors():
    arch = architecture(TINY)
    assert (arch["head_depth"], arch["head_hidden"], arch["head_heads"], arch["time_embed"]) == (2, 64, 4, "fourier")
    assert architecture(custom_name(32, 2, 2, 1, mlp="swiglu", norm="rms", pos="sincos+rope", qk_norm=False,
                                    time_embed="fourier", head_depth=2, head_hidden=64, head_heads=4)) == arch
    base = "custom:hidden=32,depth=2,heads=2,patch=1"
    for spec, why in ((f"{base},head_depth=2,head_hidden=64", "needs all of head_depth, head_hidden, head_heads"),
                      (f"{base},head_depth=2,head_hidden=64,head_heads=3", "not divisible by head_heads 3"),
                      (f"{base},pos=rope,head_depth=1,head_hidden=24,head_heads=4", "the DDT head:"),
                      (f"{base},time=gauss", "time=gauss is none of sinusoid|fourier")):
        with pytest.raises(ModelSpecError) as e:
            architecture(spec)
        assert why in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_dimension_shift_is_rae_s():
    assert dimension_shift((768, 16, 16)) == math.sqrt(196_608 / 4096)  # RAE's 6.93 (DINOv2-B at 256 px)
    assert dimension_shift((4, 32, 32)) == 1.0  # the base: SD-VAE at 256 px
    assert dimension_shift((32, 16, 16)) == math.sqrt(2)
