"""dittrain/inference/weights.py: plain state dicts (facebookresearch/DiT's layout), the model their
shapes imply, and `dittrain sample --ckpt FILE.pt --vae ...` without a latent store."""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import asdict, replace

import numpy as np
import pytest
import torch
from cliutil import dittrain, one_error_line
from storeutil import tiny_store
from test_model import official_dit_shapes
from test_sample import make_run, read_png
from tiny import save_tiny_kl

from dittrain.diffusion import DiffusionConfig
from dittrain.inference.open_run import SampleError, load_for_sampling
from dittrain.inference.sample import plan_samples, run_plan
from dittrain.inference.weights import (
    StandInStore,
    WeightsError,
    infer_model,
    infer_run_config,
    load_weights,
    mismatch,
    read_weights,
    strip_prefixes,
)
from dittrain.model.dit import DiT
from dittrain.model.sizes import get_config

pytestmark = pytest.mark.usefixtures("one_thread")


def meta_state(shapes: dict) -> dict:
    """Shapes only: inference never needs the values (XL/2 is 675 M floats)."""
    return {k: torch.empty(s, device="meta") for k, s in shapes.items()}


def meta_model_state(name: str, **overrides) -> dict:
    with torch.device("meta"):
        return DiT(get_config(name, **overrides)).state_dict()


# -----------------------------------------------------------------------------
# inference from shapes


@pytest.mark.parametrize("input_size", [32, 64])  # DiT-XL-2-256x256.pt and DiT-XL-2-512x512.pt
def test_official_xl2_layout_is_inferred(input_size):
    state = meta_state(official_dit_shapes(depth=28, hidden=1152, patch=2, input_size=input_size))
    config = infer_run_config(state)
    assert config["train"]["model"]["model"] == "DiT-XL/2" and config["train"]["diffusion"]["objective"] == "ddpm"
    m = config["model"]
    assert (m["input_size"], m["in_channels"], m["num_classes"], m["learn_sigma"]) == (input_size, 4, 1000, True)
    assert (m["hidden_size"], m["depth"], m["num_heads"], m["patch_size"], m["mlp_ratio"]) == (1152, 28, 16, 2, 4.0)
    assert m == asdict(get_config("DiT-XL/2", input_size=input_size))  # the paper's model, field for field
    # DiT's diffusion: ddpm, 1000 steps, linear betas 1e-4..0.02 = DiffusionConfig's defaults
    assert config["diffusion"] == asdict(DiffusionConfig())
    assert (config["diffusion"]["num_timesteps"], config["diffusion"]["beta_start"],
            config["diffusion"]["beta_end"]) == (1000, 1e-4, 0.02)
    assert "store" not in config  # a plain file records none


@pytest.mark.parametrize("name, overrides", [
    ("DiT-T/4", dict(input_size=8, in_channels=3, num_classes=3, learn_sigma=False)),
    ("DiT-S/2", dict(input_size=16, num_classes=0, qk_norm=True, text_pooled_dim=32, text_token_dim=24)),
    ("DiT-B/8", dict(input_size=32, in_channels=16, num_classes=7, frequency_embedding_size=128, mlp_ratio=2.0)),
])
def test_every_field_the_shapes_hold_is_read(name, overrides):
    cfg = get_config(name, **overrides)
    got_name, got = infer_model(meta_model_state(name, **overrides))
    assert got_name == name and got == cfg


@pytest.mark.parametrize("blocks, spelled", [
    (dict(mlp="swiglu"), ",mlp=swiglu"), (dict(norm="rms"), ",norm=rms"),
    (dict(mlp="swiglu", norm="rms", qk_norm=True), ",mlp=swiglu,norm=rms,qk_norm=1"),
    (dict(mlp="swiglu", mlp_ratio=2.5), ",mlp_ratio=2.5,mlp=swiglu"),  # H' 160: GELU widths 240 or 241
])
def test_swiglu_and_rmsnorm_are_read_from_the_shapes(blocks, spelled):
    """SwiGLU: fc1 twice fc2's width (of the two GELU widths that give its H', the ratio that
    reads shorter); RMSNorm: norm1 has a weight. No named size has them with sin-cos positions,
    so the heads come from --model, whose blocks must be the shapes'."""
    overrides = dict(input_size=16, in_channels=4, num_classes=10, hidden_size=96, depth=2, num_heads=4, **blocks)
    state = meta_model_state("DiT-T/2", **overrides)
    spec = f"custom:hidden=96,depth=2,heads=?,patch=2{spelled}"
    with pytest.raises(WeightsError, match=re.escape(f"--model {spec} with the heads")):
        infer_model(state)
    assert infer_model(state, spec.replace("?", "4")) == (spec.replace("?", "4"), get_config("DiT-T/2", **overrides))
    for other in ("DiT-T/2", "custom:hidden=96,depth=2,heads=4,patch=2,mlp=swiglu,norm=rms,pos=rope"):
        with pytest.raises(WeightsError, match=re.escape(f"--model {other} (hidden") + r".*\) does not fit"):
            infer_model(state, other)


def test_a_rope_model_plain_state_dict_is_refused():
    state = meta_model_state("LightningDiT-B/2", input_size=16, pos="rope")  # what the presets were: no table
    with pytest.raises(WeightsError, match="without pos_embed, a RoPE model .* its run directory, checkpoint or EMA "
                                           "export"):
        infer_model(state, "custom:hidden=768,depth=12,heads=12,patch=2,mlp=swiglu,norm=rms,pos=rope")


def test_a_lightningdit_plain_state_dict_reads_as_the_preset():
    """The presets' sincos+rope has DiT's pos_embed: its input size is in the shapes. The rotation is not:
    the named size with these blocks says it (LightningDiT-B), and --model may say sin-cos alone (the same
    shapes) but not RoPE alone (no table)."""
    state = meta_model_state("LightningDiT-B/2", input_size=16)
    assert infer_model(state) == ("LightningDiT-B/2", get_config("LightningDiT-B/2", input_size=16))
    plain = "custom:hidden=768,depth=12,heads=12,patch=2,mlp=swiglu,norm=rms"
    assert infer_model(state, plain)[1].pos == "sincos"
    with pytest.raises(WeightsError, match=re.escape(f"--model {plain},pos=rope (hidden") + r".*\) does not fit"):
        infer_model(state, plain + ",pos=rope")


def test_heads_come_from_the_named_size_or_model():
    # hidden 192 and depth 6 are DiT-T's (4 heads), even with a patch the registry does not list
    state = meta_model_state("DiT-T/4", input_size=16)
    assert infer_model(state)[1].num_heads == 4
    unknown = meta_state(official_dit_shapes(depth=2, hidden=64, patch=2, num_classes=10, input_size=8))
    with pytest.raises(WeightsError, match=r"hidden 64 and depth 2.*--model NAME"):
        infer_model(unknown)
    xl = meta_state(official_dit_shapes(depth=28, hidden=1152, patch=2))
    assert infer_model(xl, "DiT-XL/2")[0] == "DiT-XL/2"
    with pytest.raises(WeightsError, match=r"--model DiT-L/2 \(hidden 1024, depth 24, patch 2\) does not fit .*"
                                           r"hidden 1152, depth 28, patch 2"):
        infer_model(xl, "DiT-L/2")
    with pytest.raises(WeightsError, match="unknown"):
        infer_model(xl, "DiT-XXL/2")


def test_what_is_not_a_dit_is_refused():
    with pytest.raises(WeightsError, match="not a DiT state dict.*x_embedder"):
        infer_model({"conv.weight": torch.empty(3, 3, device="meta")})
    shapes = official_dit_shapes(depth=28, hidden=1152, patch=2)
    extra = meta_state({**shapes, "blocks.0.attn.q_bias": (1152,)})
    with pytest.raises(WeightsError, match=r"unexpected 1 key\(s\) \(blocks.0.attn.q_bias\)"):
        infer_model(extra)
    odd = meta_state({**shapes, "final_layer.linear.weight": (5, 1152)})
    with pytest.raises(WeightsError, match="final_layer.linear has 5 outputs"):
        infer_model(odd)


def test_mismatch_names_keys_and_shapes():
    own = meta_model_state("DiT-T/4", input_size=8, in_channels=3, num_classes=3)
    assert mismatch(dict(own), own) is None
    fewer = {k: v for k, v in own.items() if not k.startswith("blocks.5.")}
    assert mismatch(fewer, own).startswith("missing 10 key(s) (blocks.5.")
    wider = meta_model_state("DiT-T/4", input_size=8, in_channels=3, num_classes=3, hidden_size=256)
    assert mismatch(wider, own) == "pos_embed is (1, 4, 256) in the weights but (1, 4, 192) in the model"
    deeper = meta_model_state("DiT-S/4", input_size=8, in_channels=3, num_classes=3)  # hidden 384, depth 12
    assert mismatch(deeper, own).startswith("pos_embed is (1, 4, 384) in the weights but (1, 4, 192) in the "
                                            "model; unexpected 60 key(s) (blocks.6.")


# -----------------------------------------------------------------------------
# reading files


def test_plain_files_in_their_forms(tmp_path):
    shapes = official_dit_shapes(depth=2, hidden=64, patch=2, num_classes=10, input_size=8)
    sd = {k: torch.full(s, 1.0) for k, s in shapes.items()}
    ema = {k: torch.full(s, 2.0) for k, s in shapes.items()}
    forms = {
        "plain.pt": (sd, 1.0),
        "wrapped.pt": ({"model": sd, "ema": ema}, 2.0),  # the EMA when there is one
        "model_only.pt": ({"model": sd}, 1.0),
        # DiT's own training checkpoints also hold the argparse arguments
        "dit_train.pt": ({"model": sd, "ema": ema, "opt": {}, "args": argparse.Namespace(model="DiT-XL/2")}, 2.0),
        "compiled.pt": ({f"_orig_mod.{k}": v for k, v in sd.items()}, 1.0),
        "ddp.pt": ({f"module._orig_mod.{k}": v for k, v in sd.items()}, 1.0),
    }
    for name, (obj, value) in forms.items():
        torch.save(obj, tmp_path / name)
        w = read_weights(tmp_path / name)
        assert w.plain and w.kind == "plain" and w.file == tmp_path / name, name
        assert set(w.state) == set(shapes) and w.state["pos_embed"].eq(value).all(), name
    torch.save({"a": 1, "b": "x"}, tmp_path / "junk.pt")
    with pytest.raises(WeightsError, match="state dict of tensors"):
        read_weights(tmp_path / "junk.pt")
    assert strip_prefixes({}) == {}


def test_dittrain_sources_keep_their_config(tmp_path):
    store = tiny_store(tmp_path / "store")
    run = make_run(tmp_path / "run", store)
    w = read_weights(run)
    assert w.kind == "export" and not w.plain and w.config["train"]["model"]["model"] == "DiT-T/4"
    weights, config = load_weights(run)
    assert w.state.keys() == weights.keys()


# -----------------------------------------------------------------------------
# sampling a plain file


@pytest.fixture(scope="module")
def kl_run(tmp_path_factory):
    """A store encoded with a tiny diffusers autoencoder (4 channels, /2), a run on it and
    the run's EMA weights saved as a plain state dict."""
    from ditdata.autoencoders.kinds import load_autoencoder

    root = tmp_path_factory.mktemp("kl")
    kl = save_tiny_kl(root / "tiny-kl", scaling_factor=0.5)
    store = tiny_store(root / "store", shape=(4, 8, 8), vae=load_autoencoder(str(kl)).info)
    run = make_run(root / "run", store)
    plain = root / "plain.pt"
    torch.save(load_weights(run)[0], plain)
    return run, store, kl, plain


def singles(out) -> list[np.ndarray]:
    return [read_png(p) for p in sorted((out / "samples").glob("*.png"))]


def test_plain_file_samples_what_its_run_samples(kl_run, tmp_path):
    run, store, kl, plain = kl_run
    args = ["--n", 4, "--class", "0,2", "--steps", 3, "--cfg", 2.0, "--device", "cpu"]
    a = dittrain("sample", "--ckpt", run, "--out", tmp_path / "a", *args)
    assert a.exit_code == 0, a.output
    b = dittrain("sample", "--ckpt", plain, "--vae", kl, "--out", tmp_path / "b", *args)
    assert b.exit_code == 0, b.output
    assert "note: plain.pt is a plain state dict: DiT-T/4 inferred" in b.output
    assert "16x16 px images" in b.output  # 8x8 latents, downsample 2
    sa, sb = singles(tmp_path / "a"), singles(tmp_path / "b")
    assert len(sa) == len(sb) == 4 and all(x.shape == (16, 16, 3) for x in sb)
    assert all(np.array_equal(x, y) for x, y in zip(sa, sb, strict=True))
    assert len({x.tobytes() for x in sb}) > 1  # not trivially equal
    # the inferred config is the run's own
    _, config, st, _ = load_for_sampling(plain, vae=str(kl))
    assert config["model"] == load_weights(run)[1]["model"] and isinstance(st, StandInStore)
    # --latents instead of --vae: the store's autoencoder, after the compatibility check
    c = dittrain("sample", "--ckpt", plain, "--latents", store, "--out", tmp_path / "c", *args)
    assert c.exit_code == 0, c.output
    assert "autoencoder and class names are used" in c.output
    assert all(np.array_equal(x, y) for x, y in zip(sa, singles(tmp_path / "c"), strict=True))


def test_stand_in_store_serves_the_api(kl_run):
    _, _, kl, plain = kl_run
    weights, config, store, note = load_for_sampling(plain, vae=str(kl))
    assert store.latent_shape == (4, 8, 8) and store.conditioning.kind == "class"
    assert store.conditioning.num_classes == 3 and store.conditioning.class_names is None
    assert store.identity is None and len(store) == 0 and store.empty_caption() == {}
    assert store.resolution == 16 and store.manifest["vae"]["downsample"] == 2
    plan = plan_samples(config, store, device="cpu", classes=["1"], n=2)
    assert plan.labels == (1, 1) and plan.records[0]["class_name"] is None
    from dittrain.inference.open_run import load_model

    with pytest.raises(SampleError, match="class 3 is out of range"):
        plan_samples(config, store, device="cpu", classes=["3"])
    images = run_plan(load_model(weights, config), replace(plan), store)
    assert images.shape == (2, 16, 16, 3)


def test_plain_file_needs_vae_or_latents(kl_run, tmp_path):
    _, _, _, plain = kl_run
    line = one_error_line(dittrain("sample", "--ckpt", plain, "--out", tmp_path / "x.png").output)
    assert "plain state dict" in line and "--vae" in line and "--latents" in line
    # an autoencoder whose latents are not the model's: pixels are 3 channels, the model takes 4
    line = one_error_line(dittrain("sample", "--ckpt", plain, "--vae", "pixels", "--out", tmp_path / "x.png").output)
    assert "3-channel latents" in line and "takes 4" in line
    # --model names a plain file's model, not a run's
    run = kl_run[0]
    line = one_error_line(dittrain("sample", "--ckpt", run, "--model", "DiT-S/4", "--out", tmp_path / "x.png").output)
    assert "--model DiT-S/4" in line and "DiT-T/4" in line


def test_missing_hub_vae_fails_fast_with_ditdata_message(kl_run, tmp_path, monkeypatch):
    _, _, _, plain = kl_run
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))  # HF_HUB_OFFLINE=1 (conftest)
    t = time.monotonic()
    r = dittrain("sample", "--ckpt", plain, "--vae", "sd-vae-ft-ema", "--out", tmp_path / "x.png", "--device", "cpu")
    line = one_error_line(r.output)
    assert time.monotonic() - t < 30
    assert "stabilityai/sd-vae-ft-ema" in line and "not in the local Hugging Face cache" in line
    assert "nothing is downloaded here" in line


def test_text_plain_file_needs_a_store(tmp_path):
    torch.manual_seed(0)
    dit = DiT(get_config("DiT-T/4", input_size=8, num_classes=0, text_pooled_dim=16, text_token_dim=16))
    torch.save(dit.state_dict(), tmp_path / "t2i.pt")
    line = one_error_line(dittrain("sample", "--ckpt", tmp_path / "t2i.pt", "--vae", "pixels",
                                   "--out", tmp_path / "x.png").output)
    assert "text-conditioned" in line and "--latents" in line


def test_unknown_size_on_the_command_line(tmp_path):
    shapes = official_dit_shapes(depth=2, hidden=64, patch=2, num_classes=10, input_size=8)
    torch.save({k: torch.zeros(s) for k, s in shapes.items()}, tmp_path / "odd.pt")
    line = one_error_line(dittrain("sample", "--ckpt", tmp_path / "odd.pt", "--vae", "pixels",
                                   "--out", tmp_path / "x.png").output)
    assert "hidden 64 and depth 2" in line and "--model NAME" in line
