"""Custom model sizes (`--model custom:hidden=D,depth=N,heads=H,patch=p[,mlp_ratio=r]` and the
block choices `,mlp=swiglu,norm=rms,pos=rope,qk_norm=1`): the spec parses in dittrain.model.sizes,
counts the parameters its closed form says, trains, is recorded in the run config, samples from
the run and from a plain state dict. The LightningDiT presets count as their closed form, and a
tiny LightningDiT-like run goes through every path that loads a run: sample (and --npz, what
eval reads), serve, export fp16 / int8 / onnx; diffusers refuses it with the reason."""

from __future__ import annotations

import json
import re
from dataclasses import asdict

import numpy as np
import pytest
import torch
from cliutil import dittrain, ok, one_error_line, raises_one_line, run_args
from storeutil import make_store
from test_sample import read_png

from dittrain.inference.open_run import model_config
from dittrain.inference.weights import load_weights
from dittrain.model.dit import DiT, describe, num_params
from dittrain.model.sizes import CONFIGS, LIGHTNING, DiTConfig, ModelSpecError, architecture, custom_name, get_config
from dittrain.rundir import latest_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

SEED = "custom:hidden=512,depth=8,heads=8,patch=2"  # the seed's text-to-image DiT
TINY = "custom:hidden=32,depth=2,heads=2,patch=2"
# LightningDiT's blocks at a tiny size: SwiGLU (H' = 2 * 256 // 3 = 170), RMSNorm, RoPE, QK-norm
LIGHT = "custom:hidden=64,depth=2,heads=2,patch=2,mlp=swiglu,norm=rms,pos=rope,qk_norm=1"


def closed_form_params(hidden, depth, patch, channels, classes, *, mlp_ratio=4.0, learn_sigma=True,
                       freq=256, pooled=None, tokens=None, mlp="gelu", norm="layer", qk_norm=False,
                       heads=None) -> int:
    """Trainable parameters of a DiT, layer by layer (weights + biases; the frozen pos_embed
    left out as the paper does; RoPE has none). The heads split D: they add nothing, but for
    QK-norm's two head_dim weights per attention. SwiGLU: fc1 D -> 2H', fc2 H' -> D with
    H' = floor(2M / 3); RMSNorm: a weight of D per norm (block: 2, final layer: 1)."""
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
    if mlp == "swiglu":
        H = 2 * M // 3
        block += (D * 2 * H + 2 * H) + (H * D + D)  # fc1 (W1 and W3), fc2 (W2)
    else:
        block += (D * M + M) + (M * D + D)  # MLP
    qk = 2 * (D // heads) if qk_norm else 0  # q_norm and k_norm, over each head's dims
    block += qk
    if norm == "rms":
        block += 2 * D  # norm1, norm2
        total += D  # norm_final
    if tokens:
        block += 2 * D  # norm_cross (affine)
        block += (D * D + D) + (D * 2 * D + 2 * D) + (D * D + D) + qk  # cross-attention q, kv, proj (QK-norm)
    total += depth * block
    total += (D * 2 * D + 2 * D) + (D * p * p * out + p * p * out)  # final adaLN and linear
    return total


def closed_form_of(cfg) -> int:
    return closed_form_params(cfg.hidden_size, cfg.depth, cfg.patch_size, cfg.in_channels, cfg.num_classes,
                              mlp_ratio=cfg.mlp_ratio, learn_sigma=cfg.learn_sigma, pooled=cfg.text_pooled_dim,
                              tokens=cfg.text_token_dim, mlp=cfg.mlp, norm=cfg.norm, qk_norm=cfg.qk_norm,
                              heads=cfg.num_heads)


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


def test_block_choices_in_the_spec():
    assert architecture(LIGHT) == dict(hidden_size=64, depth=2, num_heads=2, patch_size=2, mlp="swiglu", norm="rms",
                                       pos="rope", qk_norm=True)
    assert architecture(TINY + ",mlp=gelu,pos=sincos,qk_norm=0") == dict(
        hidden_size=32, depth=2, num_heads=2, patch_size=2, mlp="gelu", pos="sincos", qk_norm=False)
    assert get_config("LightningDiT-B/2") == get_config(
        "custom:hidden=768,depth=12,heads=12,patch=2,mlp=swiglu,norm=rms,pos=sincos+rope")
    assert architecture("custom:hidden=768,depth=12,heads=12,patch=2,mlp=swiglu,norm=rms,pos=sincos+rope") == dict(
        CONFIGS["DiT-B/2"], **{k: v for k, v in LIGHTNING.items() if k != "qk_norm"})
    assert get_config("custom:hidden=64,depth=2,heads=2,patch=2,norm=rms").norm == "rms"
    # custom_name spells the choices that are not DiT's, in a fixed order, and round-trips
    assert custom_name(64, 2, 2, 2, qk_norm=True, pos="rope", norm="rms", mlp="swiglu") == LIGHT
    assert custom_name(32, 2, 2, 2, mlp="gelu", norm="layer", pos="sincos", qk_norm=False) == TINY
    assert custom_name(64, 2, 2, 2, 3.0, pos="rope") == "custom:hidden=64,depth=2,heads=2,patch=2,mlp_ratio=3,pos=rope"
    # a record without the block fields (written before they existed) loads with DiT's blocks
    old = {k: v for k, v in asdict(DiTConfig()).items() if k not in ("mlp", "norm", "pos")}
    assert model_config({"model": old}) == DiTConfig()


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
    ("custom:hidden=64,depth=2,heads=2,patch=2,mlp=relu", "mlp=relu is none of gelu|swiglu"),
    ("custom:hidden=64,depth=2,heads=2,patch=2,norm=batch", "norm=batch is none of layer|rms"),
    ("custom:hidden=64,depth=2,heads=2,patch=2,pos=alibi", "pos=alibi is none of sincos|rope"),
    ("custom:hidden=64,depth=2,heads=2,patch=2,qk_norm=yes", "qk_norm=yes is none of 0|1"),
    ("custom:hidden=24,depth=2,heads=4,patch=2,pos=rope", "pos=rope needs a head dim (hidden / heads = 6) that is a "
                                                           "multiple of 4"),
])
def test_bad_specs_are_one_line_errors(spec, needle):
    message = raises_one_line(ModelSpecError, lambda: get_config(spec))
    assert needle in message
    assert "valid keys: hidden, depth, heads, patch" in message and "mlp_ratio" in message
    assert "mlp (gelu|swiglu), norm (layer|rms), pos (sincos|rope|sincos+rope), qk_norm (0|1)" in message
    with pytest.raises(KeyError, match="custom:hidden=H,depth=D,heads=N,patch=P"):
        get_config("DiT-Q/2")


# -----------------------------------------------------------------------------
# counting


@pytest.mark.parametrize("spec, kw", [
    (TINY, dict(input_size=8, in_channels=3, num_classes=3)),
    ("custom:hidden=96,depth=3,heads=4,patch=4,mlp_ratio=2.5", dict(input_size=16, num_classes=0, learn_sigma=False)),
    ("custom:hidden=64,depth=2,heads=8,patch=2", dict(input_size=8, num_classes=0, text_pooled_dim=24,
                                                      text_token_dim=16)),
    (LIGHT, dict(input_size=8, in_channels=3, num_classes=3)),
    (LIGHT.replace("heads=2", "heads=4") + ",mlp_ratio=2.5", dict(input_size=8, num_classes=0, text_pooled_dim=24,
                                                                 text_token_dim=16, learn_sigma=False)),
    ("custom:hidden=96,depth=2,heads=3,patch=2,mlp=swiglu", dict(input_size=8, num_classes=5)),  # 3 does not divide M
])
def test_parameter_count_is_the_closed_form(spec, kw):
    cfg = get_config(spec, **kw)
    want = closed_form_of(cfg)
    assert num_params(cfg) == want
    model = DiT(cfg)  # a real model, not only the meta count
    assert model.num_params() == want
    frozen = 0 if cfg.pos == "rope" else cfg.num_tokens * cfg.hidden_size  # pos_embed, or nothing with RoPE
    assert model.num_params(trainable_only=False) == want + frozen
    assert describe(spec, **kw)["params"] == want


VAVAE = dict(input_size=16, in_channels=32, num_classes=1000, learn_sigma=False)  # LightningDiT's latents at 256 px


@pytest.mark.parametrize("name", ["LightningDiT-B/1", "LightningDiT-B/2", "LightningDiT-XL/1", "LightningDiT-XL/2"])
def test_lightning_presets_are_the_closed_form(name):
    cfg = get_config(name, **VAVAE)
    assert (cfg.mlp, cfg.norm, cfg.pos, cfg.qk_norm) == ("swiglu", "rms", "sincos+rope", False)
    assert num_params(cfg) == closed_form_of(cfg) == describe(name, **VAVAE)["params"]


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


def test_models_command_lists_the_lightning_presets():
    """On LightningDiT's VA-VAE latents (256 px, /16, 32 channels, no learned sigma): its sizes
    with parameters and GFLOPs (published: 675 M parameters for LightningDiT-XL)."""
    r = ok(dittrain("models", "--downsample", 16, "--channels", 32, "--no-learn-sigma", "--model", LIGHT))
    rows = {line.split()[0]: line.split()[1:] for line in r.output.splitlines()[2:]}
    assert rows["LightningDiT-XL/1"] == ["28", "1152", "16", "256", "675.0M", "118.63"]
    assert rows["LightningDiT-B/1"] == ["12", "768", "12", "256", "130.4M", "23.01"]
    assert rows["LightningDiT-XL/2"][3] == "64" and "DiT-XL/2" in rows and LIGHT in rows


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


# -----------------------------------------------------------------------------
# a LightningDiT-like run through every path that loads a run


@pytest.fixture(scope="module")
def lightning_run(custom_run, tmp_path_factory):
    """LIGHT trained 2 steps on the custom run's store; --ema 0 and lr 1e-2 as there, so the
    samples depend on the weights. Without --qk-norm: the spec's qk_norm=1 stays."""
    _, store = custom_run
    run = tmp_path_factory.mktemp("lightning") / "run"
    ok(dittrain(*run_args(store, run, "--max-steps", 2, "--ema", 0, "--lr", 1e-2, model=LIGHT)))
    return run


SAMPLE = ["--n", 3, "--class", "0,1,2", "--steps", 2, "--device", "cpu", "--seed", 1]


def test_a_lightning_run_trains_samples_and_serves(lightning_run, tmp_path):
    config = json.loads((lightning_run / "config.json").read_text())
    assert config["train"]["model"]["model"] == LIGHT
    m = config["model"]
    assert (m["mlp"], m["norm"], m["pos"], m["qk_norm"]) == ("swiglu", "rms", "rope", True)
    weights, _ = load_weights(lightning_run)
    assert "pos_embed" not in weights and weights["blocks.1.mlp.fc1.weight"].shape == (340, 64)
    losses = [json.loads(line)["loss"] for line in (lightning_run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(np.isfinite(losses))

    ok(dittrain("sample", "--ckpt", lightning_run, "--out", tmp_path / "a", *SAMPLE))
    a = singles(tmp_path / "a")
    assert len(a) == 3 and len({x.tobytes() for x in a}) == 3  # three classes, three images
    # --npz (the samples `dittrain eval` reads)
    ok(dittrain("sample", "--ckpt", lightning_run, "--npz", tmp_path / "s.npz", "--n", 4, "--steps", 2,
                "--device", "cpu"))
    with np.load(tmp_path / "s.npz") as npz:
        assert npz["arr_0"].shape == (4, 8, 8, 3)
    # a plain state dict of a RoPE model does not tell its input size: one line that says so
    torch.save(weights, tmp_path / "plain.pt")
    line = one_error_line(dittrain("sample", "--ckpt", tmp_path / "plain.pt", "--vae", "pixels", "--out",
                                   tmp_path / "x", *SAMPLE).output)
    assert "without pos_embed, a RoPE model" in line and "EMA export" in line
    pytest.importorskip("gradio")
    from dittrain.config import ServeConfig
    from dittrain.inference.serve import Request, Server

    served = Server(lightning_run, ServeConfig(device="cpu", batch_size=3, max_images=3), log=lambda line: None)
    out = served.generate(Request(choice="1", n=2, steps=2, cfg_scale=2.0, seed=0))
    assert out.ok, out.message
    assert out.images.shape == (2, 8, 8, 3)


def test_a_lightning_run_exports_but_not_to_diffusers(lightning_run, tmp_path):
    ok(dittrain("sample", "--ckpt", lightning_run, "--out", tmp_path / "t", *SAMPLE))
    torch_samples = singles(tmp_path / "t")
    # the forward of the file, loaded back, within the format's rounding of the fp32 one (measured: fp16
    # 3.5e-4, int8 1.5e-3 on outputs up to 0.96); the pixels store shows x0 itself, which 2 ddpm steps
    # from t = 999 get from eps scaled by 1 / sqrt(alpha_bar) ~ 160: a few levels (measured max 5)
    for fmt, name, bound in (("fp16", "dit.safetensors", 2e-3), ("int8", "dit.pt", 1e-2)):
        r = ok(dittrain("export", "--ckpt", lightning_run, "--format", fmt, "--out", tmp_path / name),
               "loads as `dittrain sample --ckpt` loads it")
        diff, scale = re.search(r"differs from fp32 by at most (\S+) \(outputs up to (\S+)\)", r.output).groups()
        assert float(diff) <= bound * max(1.0, float(scale)), r.output
        ok(dittrain("sample", "--ckpt", tmp_path / name, "--out", tmp_path / fmt, *SAMPLE))
        levels = np.abs(np.stack(singles(tmp_path / fmt)).astype(int) - np.stack(torch_samples))
        assert levels.mean() < 2 and levels.max() <= 16
    r = ok(dittrain("export", "--ckpt", lightning_run, "--format", "onnx", "--out", tmp_path / "dit.onnx"))
    diffs = re.search(r"max abs diff (\S+) at batch 2, (\S+) at batch 3 \(tolerance 1e-04", r.output)
    assert diffs and all(float(d) <= 1e-4 for d in diffs.groups()), r.output  # onnxruntime vs PyTorch
    ok(dittrain("sample", "--engine", "onnx", "--onnx", tmp_path / "dit.onnx", "--out", tmp_path / "o", *SAMPLE))
    assert max(int(np.abs(x.astype(int) - y).max()) for x, y in zip(singles(tmp_path / "o"), torch_samples,
                                                                       strict=True)) <= 1
    line = one_error_line(dittrain("export", "--ckpt", lightning_run, "--format", "diffusers", "--out",
                                   tmp_path / "pipe").output)
    assert "mlp=swiglu, norm=rms, pos=rope" in line and "no diffusers pipeline has these blocks" in line
    assert not (tmp_path / "pipe").exists()
