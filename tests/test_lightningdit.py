"""LightningDiT as its reference builds it (hustvl/LightningDiT, commit 2725fed42a14898744433809949834e26957bcdd:
models/lightningdit.py, models/pos_embed.py, configs/*.yaml): the rotary position embedding against the
reference's convention written out by hand (EVA-02's 2-D rotation at dim = head_dim / 2, tokens in the
patch embedding's order, q and k of every head after the QK-norm); the presets' blocks (the sin-cos table
added AND q, k rotated; no QK-norm, as in the released configs); --qk-norm / --no-qk-norm over a model's own,
both ways; and a run made when the presets were pos=rope with QK-norm, which still resumes, samples and
exports as it trained."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from cliutil import dittrain, ok, run_args
from storeutil import make_store
from test_sample import read_png

from dittrain.inference.weights import load_weights
from dittrain.model.dit import DiT
from dittrain.model.layers import apply_rope, rope_table, sincos_pos_embed_2d
from dittrain.model.parts import POSITIONS
from dittrain.model.sizes import CONFIGS, LIGHTNING, get_config

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- the rotation


def reference_rope(head_dim: int, side: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (side * side, head_dim), by the reference's convention, element by element.

    LightningDiT builds VisionRotaryEmbeddingFast(dim=head_dim // 2, pt_seq_len=side): per axis the
    frequencies 1 / theta^(2k / dim), k < dim / 2, each repeated for the two channels of a pair (its
    "(n r), r = 2" layout: channels 2k and 2k + 1 share frequency k); the first axis' dim channels,
    then the second's (broadcat on the last dim of (side, 1, dim) and (1, side, dim)), flattened first
    index major: the row of timm's PatchEmbed token order (row * side + col) turns the first half,
    the column the second. Positions are arange(side) / side * side, the integers."""
    dim = head_dim // 2
    cos, sin = torch.empty(side * side, head_dim), torch.empty(side * side, head_dim)
    for token in range(side * side):
        row, col = divmod(token, side)
        for c in range(head_dim):
            pos = row if c < dim else col
            k = (c % dim) // 2  # the pair's frequency
            angle = pos * theta ** (-2 * k / dim)
            cos[token, c], sin[token, c] = math.cos(angle), math.sin(angle)
    return cos, sin


def reference_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, rotate_half as EVA's: each adjacent pair (x0, x1) -> (-x1, x0)."""
    out = torch.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos[..., 0::2] - x[..., 1::2] * sin[..., 0::2]
    out[..., 1::2] = x[..., 1::2] * cos[..., 1::2] + x[..., 0::2] * sin[..., 1::2]
    return out


@pytest.mark.parametrize("head_dim, side", [(72, 4), (64, 5), (16, 16)])  # XL's and B's heads; 16x16: XL/1 at 256 px
def test_rope_is_the_references_rotation(head_dim, side):
    cos, sin = rope_table(head_dim, side)
    want_cos, want_sin = reference_rope(head_dim, side)
    # the reference computes its angles in float32: up to ~1e-6 away from these at the grid's far end
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=2e-5)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=2e-5)
    q = torch.randn(2, 3, side * side, head_dim, generator=torch.Generator().manual_seed(0))  # (N, heads, T, hd)
    torch.testing.assert_close(apply_rope(q, (cos, sin)), reference_rotate(q, want_cos, want_sin), rtol=0, atol=1e-4)


def test_attention_rotates_q_and_k_of_every_head_after_the_qk_norm():
    """LightningDiT's Attention: qkv (with bias) -> per head q_norm(q), k_norm(k) -> rope(q), rope(k) ->
    softmax(q k^T / sqrt(head_dim)) v -> proj; one table for every head."""
    from dittrain.model.dit import Attention

    torch.manual_seed(0)
    D, heads, side = 64, 4, 4
    attn = Attention(D, heads, qk_norm=True).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    x = torch.randn(2, side * side, D)
    cos, sin = reference_rope(D // heads, side)
    with torch.no_grad():
        q, k, v = (attn.qkv(x).reshape(2, side * side, 3, heads, D // heads).permute(2, 0, 3, 1, 4))

        def rms(h, w):
            return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w

        q = reference_rotate(rms(q, attn.q_norm.weight), cos, sin)
        k = reference_rotate(rms(k, attn.k_norm.weight), cos, sin)
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D // heads), dim=-1) @ v
        want = attn.proj(a.transpose(1, 2).reshape(2, side * side, D))
        torch.testing.assert_close(attn(x, rope=rope_table(D // heads, side)), want, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- the presets


@pytest.mark.parametrize("name, size, patch", [("LightningDiT-B/1", "B", 1), ("LightningDiT-B/2", "B", 2),
                                               ("LightningDiT-XL/1", "XL", 1), ("LightningDiT-XL/2", "XL", 2)])
def test_the_presets_are_the_released_configs(name, size, patch):
    """configs/lightningdit_xl_vavae_f16d32.yaml: use_swiglu, use_rmsnorm, use_rope true, use_qknorm false;
    the forward adds the frozen 2-D sin-cos pos_embed whatever use_rope says; LightningDiT_B_* / XL_* are
    DiT's B and XL (depth 12 / 28, hidden 768 / 1152, heads 12 / 16); SwiGLU of int(2/3 * 4D)."""
    cfg = get_config(name, input_size=16, in_channels=32, num_classes=1000, learn_sigma=False)
    depth, hidden, heads = {"B": (12, 768, 12), "XL": (28, 1152, 16)}[size]
    assert (cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.patch_size) == (depth, hidden, heads, patch)
    assert (cfg.mlp, cfg.norm, cfg.pos, cfg.qk_norm) == ("swiglu", "rms", "sincos+rope", False)
    assert cfg.mlp_hidden == int(2 / 3 * 4 * hidden)
    position = POSITIONS[cfg.pos]
    assert position.table is not None and position.rotary is not None  # both, in one part
    with torch.device("meta"):
        sd = DiT(cfg).state_dict()
    assert sd["pos_embed"].shape == (1, (16 // patch) ** 2, hidden)
    assert not any("q_norm" in k or "k_norm" in k for k in sd)
    assert sd["blocks.0.attn.qkv.bias"].shape == (3 * hidden,)  # qkv_bias=True


def test_the_table_of_the_presets_is_the_references():
    """The pos_embed a sincos+rope model holds is get_2d_sincos_pos_embed's (MAE's, as the reference copies
    it): grid = meshgrid(w, h), the first half of the channels from grid[0] (the column), each half
    [sin, cos] of pos / 10000^(i / (D/4)); and the model adds it to the patch tokens."""
    D, side = 32, 4
    w, h = np.meshgrid(np.arange(side, dtype=np.float32), np.arange(side, dtype=np.float32))
    omega = 1.0 / 10000 ** (np.arange(D // 4, dtype=np.float64) / (D / 4))

    def half(pos):
        out = pos.reshape(-1)[:, None] * omega[None]
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    want = np.concatenate([half(w), half(h)], axis=1)
    torch.manual_seed(0)
    model = DiT(get_config("custom:hidden=32,depth=1,heads=2,patch=2,pos=sincos+rope", input_size=2 * side,
                           in_channels=3, num_classes=3)).eval()
    np.testing.assert_allclose(model.pos_embed[0].numpy(), want, atol=1e-6)
    np.testing.assert_allclose(sincos_pos_embed_2d(D, side).numpy(), want, atol=1e-6)
    # x_embedder(x) + pos_embed goes into the blocks: take the table away and the output moves
    x, t, y = torch.randn(2, 3, 2 * side, 2 * side), torch.tensor([10.0, 500.0]), torch.tensor([0, 2])
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
        out = model(x, t, y)
        model.pos_embed.zero_()
        assert not torch.allclose(model(x, t, y), out, atol=1e-4)


# ----------------------------------------------------------------------------- --qk-norm / --no-qk-norm


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("lightning") / "store", n=24)


TINY = "custom:hidden=32,depth=2,heads=2,patch=2,mlp=swiglu,norm=rms,pos=sincos+rope"


@pytest.mark.parametrize("spec, flag, want", [
    (TINY, None, False), (TINY, "--qk-norm", True), (TINY + ",qk_norm=1", None, True),
    (TINY + ",qk_norm=1", "--no-qk-norm", False), (TINY + ",qk_norm=1", "--qk-norm", True),
])
def test_qk_norm_flags_override_the_model_both_ways(store, tmp_path, spec, flag, want):
    ok(dittrain(*run_args(store, tmp_path / "r", "--max-steps", 1, *([flag] if flag else []), model=spec)))
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["model"]["qk_norm"] is want
    assert config["train"]["model"]["qk_norm"] is {None: None, "--qk-norm": True, "--no-qk-norm": False}[flag]
    weights, _ = load_weights(tmp_path / "r")
    assert ("blocks.0.attn.q_norm.weight" in weights) is want


@pytest.mark.parametrize("qk_norm, want", [(None, False), (True, True), (False, False)])
def test_qk_norm_flags_over_a_preset(store, qk_norm, want):
    """The presets are too big to train here: the model config a run of one would get."""
    from ditdata.store import open_store
    from dittrain.config import TrainConfig
    from dittrain.train.setup import model_config_for

    cfg = TrainConfig.from_flat(model="LightningDiT-B/2", qk_norm=qk_norm, objective="flow")
    model = model_config_for(cfg, open_store(store))
    assert model.qk_norm is want and model.pos == "sincos+rope"


# ----------------------------------------------------------------------------- runs made with the old presets

SIZE = dict(hidden_size=32, depth=2, num_heads=2, patch_size=2)
OLD = dict(SIZE, mlp="swiglu", norm="rms", pos="rope", qk_norm=True)  # the LightningDiT presets until now
SAMPLE = ["--n", 3, "--class", "0,1,2", "--steps", 2, "--device", "cpu", "--seed", 1]


def _samples(out) -> list[np.ndarray]:
    return [read_png(p) for p in sorted((out / "samples").glob("*.png"))]


def test_a_run_of_the_old_presets_resumes_samples_and_exports_as_it_trained(store, tmp_path, monkeypatch):
    """LightningDiT-B/2 at a tiny size: trained while the name meant pos=rope with QK-norm (the registry
    entry as it was), then the name takes today's blocks (sincos+rope, no QK-norm). The run's record holds
    its resolved model: it samples the same pixels, resumes to the loss a straight run had, and exports;
    a new run of the name builds today's blocks."""
    name = "LightningDiT-B/2"
    monkeypatch.setitem(CONFIGS, name, OLD)
    common = ["--ema", 0, "--lr", 1e-2, "--objective", "flow"]
    ok(dittrain(*run_args(store, tmp_path / "straight", "--max-steps", 3, *common, model=name)))
    ok(dittrain(*run_args(store, tmp_path / "run", "--max-steps", 2, *common, model=name)))
    ok(dittrain("sample", "--ckpt", tmp_path / "run", "--out", tmp_path / "before", *SAMPLE))

    monkeypatch.setitem(CONFIGS, name, {**SIZE, **LIGHTNING})  # what the name means now
    ok(dittrain("sample", "--ckpt", tmp_path / "run", "--out", tmp_path / "after", *SAMPLE))
    before, after = _samples(tmp_path / "before"), _samples(tmp_path / "after")
    assert len(before) == 3 and all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))

    ok(dittrain("run", "--resume", "--out", tmp_path / "run", "--max-steps", 3), "finished at step 3")
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert {k: config["model"][k] for k in OLD} == OLD
    weights, _ = load_weights(tmp_path / "run")
    assert "pos_embed" not in weights and "blocks.0.attn.q_norm.weight" in weights

    def losses(run):
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    assert losses(tmp_path / "run") == losses(tmp_path / "straight")  # step 3 as if never stopped
    ok(dittrain("export", "--ckpt", tmp_path / "run", "--format", "fp16", "--out", tmp_path / "dit.safetensors"))
    ok(dittrain("sample", "--ckpt", tmp_path / "dit.safetensors", "--out", tmp_path / "exported", *SAMPLE))
    assert len(_samples(tmp_path / "exported")) == 3

    ok(dittrain(*run_args(store, tmp_path / "new", "--max-steps", 1, *common, model=name)))
    new = json.loads((tmp_path / "new" / "config.json").read_text())["model"]
    assert (new["pos"], new["qk_norm"]) == ("sincos+rope", False)
    weights, _ = load_weights(tmp_path / "new")
    assert "pos_embed" in weights and "blocks.0.attn.q_norm.weight" not in weights
