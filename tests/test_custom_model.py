"""Custom model sizes (`--model custom:hidden=D,depth=N,heads=H,patch=p[,mlp_ratio=r]`): the
spec parses in dittrain.model, counts the parameters its closed form says, trains, is
recorded in the run config, samples from the run and from a plain state dict."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from cliutil import dittrain, one_error_line, raises_one_line, run_args
from storeutil import make_store
from test_sample import read_png

from dittrain.checkpoint import latest_checkpoint
from dittrain.model import DiT
from dittrain.sizes import describe, num_params
from dittrain.specs import ModelSpecError, architecture, custom_name, get_config
from dittrain.weights import load_weights

pytestmark = pytest.mark.usefixtures("one_thread")

SEED = "custom:hidden=512,depth=8,heads=8,patch=2"  # the seed's text-to-image DiT
TINY = "custom:hidden=32,depth=2,heads=2,patch=2"


def closed_form_params(hidden, depth, patch, channels, classes, *, mlp_ratio=4.0, learn_sigma=True,
                       freq=256, pooled=None, tokens=None) -> int:
    """Trainable parameters of a DiT, layer by layer (weights + biases; the frozen pos_embed
    left out as the paper does). The heads split D: they add nothing."""
    D, p, C = hidden, patch, channels
    M = int(D * mlp_ratio)
    out = 2 * C if learn_sigma else C
    total = D * C * p * p + D  # patch embedding: a p x p stride-p convolution C -> D
    total += (freq * D + D) + (D * D + D)  # timestep MLP: sinusoidal features -> D -> D
    if classes:
        total += (classes + 1) * D  # label table, with the null class of guidance
    if pooled:
        total += (pooled * D + D) + (D * D + D)  # pooled text MLP
    if tokens:
        total += (tokens * D + D) + (D * D + D)  # text token MLP
    block = (D * 6 * D + 6 * D)  # adaLN-Zero: c -> shift, scale, gate for attention and MLP
    block += (D * 3 * D + 3 * D) + (D * D + D)  # qkv and the output projection
    block += (D * M + M) + (M * D + D)  # MLP
    if tokens:
        block += 2 * D  # norm_cross (affine)
        block += (D * D + D) + (D * 2 * D + 2 * D) + (D * D + D)  # cross-attention q, kv, proj
    total += depth * block
    total += (D * 2 * D + 2 * D) + (D * p * p * out + p * p * out)  # final adaLN and linear
    return total


# -----------------------------------------------------------------------------
# the spec


def test_spec_grammar():
    arch = architecture("custom:hidden=512,depth=8,heads=8,patch=2")
    assert arch == dict(hidden_size=512, depth=8, num_heads=8, patch_size=2)
    assert architecture(" custom:heads=4, hidden=64 ,patch=4,depth=3,mlp_ratio=2.5".strip())["mlp_ratio"] == 2.5
    cfg = get_config(SEED, input_size=32)
    assert (cfg.hidden_size, cfg.depth, cfg.num_heads, cfg.patch_size, cfg.mlp_ratio) == (512, 8, 8, 2, 4.0)
    assert get_config("DiT-B/2") == get_config("custom:hidden=768,depth=12,heads=12,patch=2")
    assert custom_name(512, 8, 8, 2) == SEED
    assert architecture(custom_name(64, 3, 4, 4, 2.5)) == architecture("custom:hidden=64,depth=3,heads=4,patch=4,"
                                                                      "mlp_ratio=2.5")


@pytest.mark.parametrize("spec, needle", [
    ("custom:hidden=512,depth=8,heads=8", "missing patch"),
    ("custom:hidden=512,depth=8,heads=8,patch=2,width=3", "unknown key 'width'"),
    ("custom:hidden=512,depth=8,heads=7,patch=2", "hidden 512 is not divisible by heads 7"),
    ("custom:hidden=6,depth=1,heads=1,patch=2", "not a multiple of 4"),
    ("custom:hidden=512,depth=0,heads=8,patch=2", "depth=0 is not a positive integer"),
    ("custom:hidden=512,depth=8,heads=8,patch=2.5", "patch=2.5 is not a positive integer"),
    ("custom:hidden=512,depth=8,heads=8,patch=2,mlp_ratio=nan", "mlp_ratio=nan is not a positive number"),
    ("custom:hidden=512,hidden=256,depth=8,heads=8,patch=2", "hidden is given twice"),
    ("custom:hidden512,depth=8,heads=8,patch=2", "'hidden512' is not key=value"),
    ("custom:", "is not key=value"),
])
def test_bad_specs_are_one_line_errors(spec, needle):
    message = raises_one_line(ModelSpecError, lambda: get_config(spec))
    assert needle in message
    assert "valid keys: hidden, depth, heads, patch" in message and "mlp_ratio" in message
    with pytest.raises(KeyError, match="custom:hidden=H,depth=D,heads=N,patch=P"):
        get_config("DiT-Q/2")


# -----------------------------------------------------------------------------
# counting


@pytest.mark.parametrize("spec, kw", [
    (TINY, dict(input_size=8, in_channels=3, num_classes=3)),
    ("custom:hidden=96,depth=3,heads=4,patch=4,mlp_ratio=2.5", dict(input_size=16, num_classes=0, learn_sigma=False)),
    ("custom:hidden=64,depth=2,heads=8,patch=2", dict(input_size=8, num_classes=0, text_pooled_dim=24,
                                                      text_token_dim=16)),
])
def test_parameter_count_is_the_closed_form(spec, kw):
    cfg = get_config(spec, **kw)
    want = closed_form_params(cfg.hidden_size, cfg.depth, cfg.patch_size, cfg.in_channels, cfg.num_classes,
                              mlp_ratio=cfg.mlp_ratio, learn_sigma=cfg.learn_sigma, pooled=cfg.text_pooled_dim,
                              tokens=cfg.text_token_dim)
    assert num_params(cfg) == want
    assert DiT(cfg).num_params() == want  # a real model, not only the meta count
    assert describe(spec, **kw)["params"] == want


def test_the_seed_size_is_not_100m_parameters():
    """The seed's "~100 M" text-to-image DiT (hidden 512, depth 8, 8 heads, patch 2 on 4x32x32
    latents): the DiT itself is 39.3 M class-conditional (1000 classes) and 48.5 M with a
    CLIP-L-width (768) text embedding, pooled and cross-attended; it is ~100 M only with the
    text encoder counted (CLIP ViT-B/16's text tower is ~63 M)."""
    classes = get_config(SEED, input_size=32, in_channels=4, num_classes=1000)
    assert num_params(classes) == closed_form_params(512, 8, 2, 4, 1000) == 39_267_360
    text = get_config(SEED, input_size=32, in_channels=4, num_classes=0, text_pooled_dim=768, text_token_dim=768)
    assert num_params(text) == closed_form_params(512, 8, 2, 4, 0, pooled=768, tokens=768) == 48_480_800
    assert describe(SEED, input_size=32)["gflops"] == pytest.approx(7.0, abs=0.01)


def test_models_command_shows_custom_rows():
    r = dittrain("models", "--model", SEED, "--model", "custom:hidden=96,depth=3,heads=4,patch=4,mlp_ratio=2.5")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert any(line.startswith("DiT-XL/2 ") for line in lines)  # the named sizes are still there
    row = next(line for line in lines if line.startswith(SEED + " "))
    assert row.split()[1:] == ["8", "512", "8", "256", "39.3M", "7.00"]
    assert any(line.startswith("custom:hidden=96,depth=3,heads=4,patch=4,mlp_ratio=2.5 ") for line in lines)
    line = one_error_line(dittrain("models", "--model", "custom:hidden=512,depth=8,heads=8").output)
    assert "missing patch" in line and "valid keys" in line
    line = one_error_line(dittrain("models", "--model", "custom:hidden=64,depth=2,heads=2,patch=3").output)
    assert "patch 3 does not split the 32x32 latent" in line


# -----------------------------------------------------------------------------
# training and sampling


@pytest.fixture(scope="module")
def custom_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("custom")
    store = make_store(root / "store", n=24)
    # --ema 0: the EMA is the model, so two steps at lr 1e-2 leave the adaLN-Zero init and the
    # samples depend on the weights
    r = dittrain(*run_args(store, root / "run", "--max-steps", 2, "--ema", 0, "--lr", 1e-2, model=TINY))
    assert r.exit_code == 0, r.output
    return root / "run", store


def test_a_custom_run_trains_and_records_its_spec(custom_run):
    run, _ = custom_run
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["model"]["model"] == TINY
    m = config["model"]
    assert (m["hidden_size"], m["depth"], m["num_heads"], m["patch_size"], m["in_channels"]) == (32, 2, 2, 2, 3)
    assert latest_checkpoint(run).name == "step_00000002.pt"
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(np.isfinite(losses))


def singles(out) -> list[np.ndarray]:
    return [read_png(p) for p in sorted((out / "samples").glob("*.png"))]


def test_custom_run_samples_from_the_run_and_a_plain_state_dict(custom_run, tmp_path):
    run, _ = custom_run
    args = ["--n", 3, "--class", "0,1,2", "--steps", 2, "--device", "cpu"]
    for name in ("a", "b"):
        r = dittrain("sample", "--ckpt", run, "--out", tmp_path / name, *args)
        assert r.exit_code == 0, r.output
    a, b = singles(tmp_path / "a"), singles(tmp_path / "b")
    assert len(a) == 3 and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))

    weights, _ = load_weights(run)
    torch.save(weights, tmp_path / "plain.pt")
    # no named size has hidden 32 and depth 2: the error spells out the spec to complete
    line = one_error_line(dittrain("sample", "--ckpt", tmp_path / "plain.pt", "--vae", "pixels",
                                   "--out", tmp_path / "x", *args).output)
    assert "--model custom:hidden=32,depth=2,heads=?,patch=2" in line and "--model NAME" in line
    r = dittrain("sample", "--ckpt", tmp_path / "plain.pt", "--vae", "pixels", "--model", TINY,
                 "--out", tmp_path / "c", *args)
    assert r.exit_code == 0, r.output
    assert f"{TINY} inferred from its shapes" in r.output
    assert all(np.array_equal(x, y) for x, y in zip(a, singles(tmp_path / "c"), strict=True))

    # a spec that is not the weights' shapes, and one that does not parse
    line = one_error_line(dittrain("sample", "--ckpt", tmp_path / "plain.pt", "--vae", "pixels", "--model",
                                   "custom:hidden=64,depth=2,heads=2,patch=2", "--out", tmp_path / "x").output)
    assert "does not fit" in line and "hidden 32, depth 2, patch 2" in line
    line = one_error_line(dittrain("sample", "--ckpt", tmp_path / "plain.pt", "--vae", "pixels", "--model",
                                   "custom:hidden=32,depth=2", "--out", tmp_path / "x").output)
    assert "missing heads, patch" in line


def test_custom_run_exports(custom_run, tmp_path):
    """export (and serve, eval: they load through the same model_config) build the model from
    the recorded DiTConfig, not from the name."""
    run, _ = custom_run
    r = dittrain("export", "--ckpt", run, "--format", "fp16", "--out", tmp_path / "dit-fp16.safetensors")
    assert r.exit_code == 0, r.output
    assert TINY in r.output
    r = dittrain("sample", "--ckpt", tmp_path / "dit-fp16.safetensors", "--n", 2, "--steps", 2, "--device", "cpu",
                 "--out", tmp_path / "fp16")
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("spec, needle", [
    ("custom:hidden=30,depth=2,heads=4,patch=2", "hidden 30 is not divisible by heads 4"),
    ("custom:hidden=32,depth=2,heads=2,patch=2,size=3", "unknown key 'size'"),
    ("custom:hidden=32,depth=2,heads=2,patch=3", "does not fit latents 3x8x8"),
])
def test_bad_specs_on_the_run_command(custom_run, tmp_path, spec, needle):
    _, store = custom_run
    line = one_error_line(dittrain(*run_args(store, tmp_path / "r", "--max-steps", 1, model=spec)).output)
    assert needle in line
    assert not (tmp_path / "r").exists()  # refused before anything is written
