"""A block part that exists only in this test (issue 33): a squared-ReLU MLP without biases
(Primer, So et al. 2021), with a width rule of its own (H = M // 2 of the GELU width M) and two
matmuls per token, registered in dittrain.model.parts.MLPS and nothing else. Through the normal
paths it is a custom spec's `mlp=relu2`, a DiT that trains, the parameters its width rule gives,
the multiply-adds its matmul count gives (as torch counts them), `dittrain plan`'s one-line
refusal (the measured table has no row for it), a plain state dict read back as it; unregistered,
the name is unknown again."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from cliutil import dittrain, one_error_line, raises_one_line

from dittrain.inference.weights import WeightsError, infer_model
from dittrain.model.dit import DiT, num_params
from dittrain.model.parts import MLPS, MlpPart, spec_choices
from dittrain.model.sizes import DiTConfig, ModelSpecError, architecture, custom_name, flops_per_forward, get_config
from dittrain.plan.footprint import FootprintError, Setting, footprint
from dittrain.plan.throughput import recompute_flops

pytestmark = pytest.mark.usefixtures("one_thread")

D, DEPTH, SIDE = 64, 2, 8  # 16 tokens of width 64 (patch 2 of 8x8 latents)
SPEC = f"custom:hidden={D},depth={DEPTH},heads=4,patch=2,mlp=relu2"
DATA = dict(input_size=SIDE, in_channels=4, num_classes=10)


class ReLU2Mlp(nn.Module):
    """fc2(relu(fc1 x)^2), D -> H -> D, no biases."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)).square())


TOY = MlpPart("relu2", ReLU2Mlp, width=lambda m: m // 2, matmuls=2)


@pytest.fixture
def toy():
    MLPS.register(TOY)
    yield TOY
    MLPS.unregister(TOY.name)


def test_a_registered_mlp_is_built_and_trains(toy):
    cfg = get_config(SPEC, **DATA)
    assert cfg.mlp == "relu2" and cfg.mlp_hidden == 4 * D // 2  # its width rule of M = 4D
    torch.manual_seed(0)
    model = DiT(cfg).train()
    assert all(isinstance(block.mlp, ReLU2Mlp) for block in model.blocks)
    with torch.no_grad():  # leave adaLN-Zero's zero gates, so the MLP's output reaches the loss
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(std=0.05)
    x, t, y = torch.randn(3, 4, SIDE, SIDE), torch.tensor([1.0, 500.0, 999.0]), torch.tensor([0, 3, 9])
    out = model(x, t, y)
    assert out.shape == (3, 8, SIDE, SIDE)
    out.square().mean().backward()
    grad = model.blocks[0].mlp.fc1.weight.grad
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_its_parameters_and_flops_follow_its_entry(toy):
    from torch.utils.flop_counter import FlopCounterMode

    cfg, gelu = get_config(SPEC, **DATA), get_config(SPEC.replace(",mlp=relu2", ""), **DATA)
    M, H, T = 4 * D, 4 * D // 2, cfg.num_tokens
    # per block: the GELU MLP's 2DM weights and M + D biases, against the toy's 2DH weights
    assert num_params(cfg) == num_params(gelu) - DEPTH * (2 * D * M + M + D) + DEPTH * 2 * D * H
    # multiply-adds: its matmuls of D x H per token, in every block; what torch counts (FLOPs = 2 x)
    assert flops_per_forward(cfg) == flops_per_forward(gelu) + DEPTH * T * D * (toy.matmuls * H - 2 * M)
    with torch.device("meta"):
        model = DiT(cfg).eval()
        with FlopCounterMode(display=False) as counted:
            model(torch.empty(1, 4, SIDE, SIDE), torch.ones(1), torch.zeros(1, dtype=torch.long))
    assert counted.get_total_flops() == 2 * flops_per_forward(cfg)
    assert recompute_flops(cfg, "mlp") == DEPTH * T * toy.matmuls * D * H  # --grad-checkpointing mlp


def test_the_spec_the_help_and_the_weights_name_it(toy):
    assert architecture(SPEC)["mlp"] == "relu2"
    assert custom_name(D, DEPTH, 4, 2, mlp="relu2") == SPEC
    assert ",mlp=gelu|swiglu|relu2," in spec_choices()
    message = raises_one_line(ModelSpecError, lambda: get_config(SPEC.replace("relu2", "relu3")))
    assert "mlp=relu3 is none of gelu|swiglu|relu2" in message and "mlp (gelu|swiglu|relu2)" in message
    # a plain state dict of it: its shapes (no biases) are no other part's
    state = DiT(get_config(SPEC, **DATA)).state_dict()
    assert infer_model(state, SPEC)[1] == get_config(SPEC, **DATA, learn_sigma=True)
    assert "--model custom:hidden=64,depth=2,heads=?,patch=2,mlp=relu2" in raises_one_line(
        WeightsError, lambda: infer_model(state))


def test_plan_refuses_it_in_one_line_for_want_of_measured_rows(toy):
    with pytest.raises(FootprintError, match=r"relu2,layer,sincos,noqk/fp32/fused"):
        footprint(Setting(get_config(SPEC, **DATA)))
    r = dittrain("plan", "--model", SPEC, "--latent-shape", f"4x{SIDE}x{SIDE}", "--classes", 10)
    assert r.exit_code != 0
    line = one_error_line(r.output)
    assert "no measured activation memory for relu2,layer,sincos,noqk blocks" in line, line
    assert "bench/activation_memory.py --table" in line, line


def test_unregistered_its_name_is_unknown_again():
    assert "relu2" not in MLPS
    MLPS.register(TOY)
    try:
        with pytest.raises(ValueError, match="registered already"):
            MLPS.register(TOY)
        get_config(SPEC, **DATA)
    finally:
        assert MLPS.unregister("relu2") is TOY
    assert tuple(MLPS) == ("gelu", "swiglu")
    assert "mlp=relu2 is none of gelu|swiglu" in raises_one_line(ModelSpecError, lambda: get_config(SPEC))
    with pytest.raises(AssertionError, match="mlp must be one of gelu, swiglu"):
        DiTConfig(mlp="relu2")
