"""Representation autoencoders (RAE, Zheng et al. 2025) as an autoencoder kind: a tiny random
diffusers AutoencoderRAE (a tiny random Dinov2WithRegisters inside) saved with save_pretrained,
through `ditdata encode`, `ditdata inspect --decode`, a training run and `dittrain sample`; the
stored latents are AutoencoderRAE.encode's and the decodes AutoencoderRAE.decode's."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cliutil import ditdata, dittrain, one_error_line, run_args
from tiny import save_tiny_kl, save_tiny_rae, tiny_rae

from ditdata.autoencoders.kinds import PRESETS, autoencoder_from_manifest, load_autoencoder
from ditdata.framing import center_crop, hflip
from ditdata.imageshards import folder as imageshards
from ditdata.store import open_store, values

pytest.importorskip("diffusers")
BIN = Path(sys.executable).parent
WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def rae_dir(tmp_path_factory) -> Path:
    return save_tiny_rae(tmp_path_factory.mktemp("rae") / "tiny-rae")


@pytest.fixture(scope="module")
def rae_store(class_shards, rae_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("store") / "s"
    r = ditdata("encode", class_shards, "--vae", f"rae:{rae_dir}", "--resolution", 32, "--flip", "--out", out,
                "--workers", 0, "--device", "cpu", "--quiet")
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def rae_int8_store(class_shards, rae_dir, tmp_path_factory) -> Path:
    """The same images, latents stored int8 with a float32 scale per token (--dtype int8)."""
    out = tmp_path_factory.mktemp("store8") / "s"
    r = ditdata("encode", class_shards, "--vae", f"rae:{rae_dir}", "--resolution", 32, "--flip", "--dtype", "int8",
                "--out", out, "--workers", 0, "--device", "cpu", "--quiet")
    assert r.exit_code == 0, r.output
    return out


def _pixels(crops) -> torch.Tensor:
    return torch.stack([torch.from_numpy(np.asarray(c)).permute(2, 0, 1) for c in crops]).float() / 255


def test_encode_stores_what_autoencoder_rae_encode_returns(class_shards, rae_dir, rae_store):
    store = open_store(rae_store, verify=True)
    vae = store.manifest["vae"]
    assert vae["kind"] == "autoencoder_rae" and store.latent_shape == (64, 4, 4)
    assert vae["weights_sha256"] == {WEIGHTS: hashlib.sha256((rae_dir / WEIGHTS).read_bytes()).hexdigest()}
    assert vae["rae"] == {"encoder_type": "dinov2", "encoder_patch_size": 14, "encoder_input_size": 56,
                          "image_size": 32, "grid": 4}
    assert (vae["scaling_factor"], vae["shift_factor"], vae["input_range"], vae["downsample"]) == (1.0, 0.0, "[0,1]", 8)
    model = tiny_rae()  # the same seed: the same weights as the saved folder
    data = store.read(0)
    first = imageshards.list_shards(class_shards)[0]
    crops = {s.key: center_crop(s.decode(), 32) for s in imageshards.iter_shard(first)}
    with torch.no_grad():
        want = model.encode(_pixels([crops[k] for k in data["key"]])).latent.numpy()
        flipped = model.encode(_pixels([hflip(crops[k]) for k in data["key"]])).latent.numpy()
    assert not np.allclose(want, flipped, atol=1e-2)  # the flip is a different latent, not a copy
    np.testing.assert_allclose(data["latent"].astype(np.float32), want, rtol=2e-3, atol=2e-3)  # stored fp16
    np.testing.assert_allclose(data["latent_flip"].astype(np.float32), flipped, rtol=2e-3, atol=2e-3)


def test_int8_latents_are_autoencoder_rae_encode_within_half_a_step(class_shards, rae_store, rae_int8_store, tmp_path):
    """--dtype int8: each stored token (the C channels at a position) is AutoencoderRAE.encode's
    within half its scale (the rounding; float32 on both sides up to 1e-5), the scale is the token's
    max |x| / 127, and the decoder's output from int8 latents is close to its output from fp16 ones:
    PSNR >= 55 dB (measured 61.4-63.0 dB on this tiny random RAE's shards; bench/int8_latents.py: 68.3 dB
    on a random rae-dinov2-b, 64.3 dB on TAEF2's real weights, bench/RESULTS.md)."""
    store = open_store(rae_int8_store, verify=True)
    assert store.manifest["latent"]["dtype"] == "int8" and store.manifest["latent"]["int8"]["scale"] == "latent_scale"
    assert store.schema.tensors["latent_scale"].shape == (4, 4)
    model = tiny_rae()
    data = store.read(0)
    first = imageshards.list_shards(class_shards)[0]
    crops = {s.key: center_crop(s.decode(), 32) for s in imageshards.iter_shard(first)}
    for field, view in (("latent", lambda c: c), ("latent_flip", hflip)):
        with torch.no_grad():
            want = model.encode(_pixels([view(crops[k]) for k in data["key"]])).latent.numpy()
        scale = data[f"{field}_scale"]
        np.testing.assert_allclose(scale, np.abs(want).max(axis=1) / 127, rtol=1e-4)
        err = np.abs(values(data, field) - want)
        assert (err <= scale[:, None] / 2 + 1e-5).all(), err.max()
    ae = autoencoder_from_manifest(store.manifest["vae"], strict=True)
    fp16 = open_store(rae_store).read(0)
    images8 = ae.decode(torch.from_numpy(values(data, "latent")))
    images16 = ae.decode(torch.from_numpy(values(fp16, "latent")))
    mse = float(((images8 - images16) ** 2).mean())
    assert 10 * np.log10(1 / mse) >= 55
    # inspect --decode draws the dequantized latents
    r = ditdata("inspect", rae_int8_store, "--decode", 2, "--out", tmp_path / "peek")
    assert r.exit_code == 0 and len(list((tmp_path / "peek").glob("*.png"))) == 2, r.output
    # int8 holds one latent per image: mean and std are refused in one line, nothing written
    r = ditdata("encode", class_shards, "--vae", f"rae:{rae_int8_store}", "--dtype", "int8", "--posterior", "mean_std",
                "--out", tmp_path / "ms")
    assert r.exit_code != 0 and "--dtype int8 stores one latent per image" in one_error_line(r.output)
    assert not (tmp_path / "ms").exists()


def test_decode_is_autoencoder_rae_decode_and_inspect_draws_it(rae_store, tmp_path):
    store = open_store(rae_store)
    ae = autoencoder_from_manifest(store.manifest["vae"], strict=True)  # found at the recorded folder
    z = torch.from_numpy(store.read(0)["latent"].astype(np.float32))
    with torch.no_grad():
        want = tiny_rae().decode(z).sample.clamp(0, 1)
    torch.testing.assert_close(ae.decode(z), want)
    r = ditdata("inspect", rae_store, "--decode", 2, "--out", tmp_path / "peek")
    assert r.exit_code == 0 and "decoded 2 samples" in r.output, r.output
    assert len(list((tmp_path / "peek").glob("*.png"))) == 2


def test_a_run_on_rae_latents_trains_and_samples_through_the_rae_decoder(rae_store, tmp_path):
    run = tmp_path / "run"
    r = dittrain(*run_args(rae_store, run, "--max-steps", 2, "--objective", "flow",
                           model="custom:hidden=64,depth=2,heads=2,patch=1"))
    assert r.exit_code == 0, r.output
    r = dittrain("sample", "--ckpt", run, "--out", tmp_path / "grid.png", "--n", 2, "--steps", 2, "--device", "cpu")
    assert r.exit_code == 0, r.output
    from PIL import Image

    tiles = sorted((tmp_path / "grid").glob("*.png"))
    assert len(tiles) == 2 and all(np.asarray(Image.open(p)).shape == (32, 32, 3) for p in tiles)


def test_sizes_an_rae_cannot_take_are_one_line(class_shards, rae_dir, tmp_path):
    r = ditdata("encode", class_shards, "--vae", f"rae:{rae_dir}", "--resolution", 64, "--out", tmp_path / "a",
                "--workers", 0, "--device", "cpu")
    assert r.exit_code != 0 and "takes 32x32 images only" in one_error_line(r.output), r.output
    r = ditdata("encode", class_shards, "--vae", f"rae:{rae_dir}", "--buckets", "32:8", "--out", tmp_path / "b",
                "--workers", 0, "--device", "cpu")
    assert r.exit_code != 0 and "--buckets: autoencoder" in one_error_line(r.output), r.output
    assert "squashed to the same token grid" in one_error_line(r.output)
    assert not (tmp_path / "a" / "manifest.json").exists() and not (tmp_path / "b" / "manifest.json").exists()


def test_folders_that_are_not_an_rae_are_one_line(class_shards, tmp_path):
    kl = save_tiny_kl(tmp_path / "kl")
    for spec, needle in ((f"rae:{kl}", "is not a diffusers AutoencoderRAE folder (a AutoencoderKL config)"),
                         (f"rae:{tmp_path / 'none'}", "is not a directory"),
                         (f"rae:{tmp_path}", "no readable config.json")):
        r = ditdata("encode", class_shards, "--vae", spec, "--out", tmp_path / "s")
        assert r.exit_code != 0 and needle in one_error_line(r.output), (spec, r.output)
    assert load_autoencoder(str(save_tiny_rae(tmp_path / "plain"))).kind == "autoencoder_rae"  # a plain folder too


def test_presets_and_a_cached_hub_id(class_shards, tmp_path, monkeypatch):
    names = {n: p.repo_id for n, p in PRESETS.items() if p.kind == "autoencoder_rae"}
    assert names == {"rae-dinov2-b": "nyu-visionx/RAE-dinov2-wReg-base-ViTXL-n08",
                     "rae-dinov2-b-512": "nyu-visionx/RAE-dinov2-wReg-base-ViTXL-n08-i512",
                     "rae-dinov2-s": "nyu-visionx/RAE-dinov2-wReg-small-ViTXL-n08",
                     "rae-dinov2-l": "nyu-visionx/RAE-dinov2-wReg-large-ViTXL-n08",
                     "rae-siglip2-b": "nyu-visionx/RAE-siglip2-base-p16-i256-ViTXL-n08",
                     "rae-mae-b": "nyu-visionx/RAE-mae-base-p16-ViTXL-n08"}
    assert {n: PRESETS[n].latent_channels for n in names} == {"rae-dinov2-b": 768, "rae-dinov2-b-512": 768,
                                                               "rae-dinov2-s": 384, "rae-dinov2-l": 1024,
                                                               "rae-siglip2-b": 768, "rae-mae-b": 768}
    # offline and not cached: fails at once with the download command, nothing written
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    r = subprocess.run([BIN / "ditdata", "encode", class_shards, "--vae", "rae-dinov2-b", "--out", tmp_path / "s"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "hf download nyu-visionx/RAE-dinov2-wReg-base-ViTXL-n08" in r.stderr
    # a cached snapshot of an RAE repo: by preset name and by hub id, its commit recorded
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--nyu-visionx--RAE-dinov2-wReg-small-ViTXL-n08"
    save_tiny_rae(repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for spec in ("rae-dinov2-s", "nyu-visionx/RAE-dinov2-wReg-small-ViTXL-n08"):
        ae = load_autoencoder(spec)
        assert (ae.kind, ae.info["id"], ae.info["revision"], ae.name) == (
            "autoencoder_rae", "nyu-visionx/RAE-dinov2-wReg-small-ViTXL-n08", rev, spec)
        again = autoencoder_from_manifest(json.loads(json.dumps(ae.info)), strict=True)
        assert again.info["revision"] == rev


# A DiT^DH (RAE's DiT with a DDT head; tests/test_ddt.py holds the model itself) at tiny widths: the trunk
# LightningDiT's blocks, Gaussian Fourier time features, a head of one block at twice the width
DDT = ("custom:hidden=32,depth=2,heads=2,patch=1,mlp=swiglu,norm=rms,pos=sincos+rope,time=fourier,"
       "head_depth=1,head_hidden=64,head_heads=4")


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_a_dit_dh_run_resumes_exactly_after_sigkill_and_samples_through_the_rae_decoder(rae_store, rae_int8_store,
                                                                                       tmp_path, dtype):
    """RAE's recipe on RAE latents: flow, t as the model's input (--flow-time-scale 1), --t-shift auto =
    sqrt(64 x 4 x 4 / 4096) for this store (RAE's 6.93 at 768 x 16 x 16); SIGKILLed at step 20 and resumed,
    the same loss at every step; then sampled and decoded by the RAE decoder of the manifest. On the
    float16 store and on the int8 one (codes and scales streamed, dequantized in the step)."""
    from cliutil import resume_after_sigkill

    rae_store = rae_int8_store if dtype == "int8" else rae_store
    common = ["--model", DDT, "--objective", "flow", "--t-shift", "auto", "--flow-time-scale", 1, "--max-steps", 40,
              "--save-every", 20, "--lr", "1e-3", "--ema", "0.9", "--adam-betas", "0.9,0.95"]
    err = resume_after_sigkill(rae_store, tmp_path, common, steps=40, half=20)
    assert "--t-shift auto: sqrt(64 x 4 x 4 / 4096) = 0.5000" in err, err
    record = json.loads((tmp_path / "killed" / "config.json").read_text())
    assert record["diffusion"]["t_shift"] == 0.5 == record["train"]["diffusion"]["t_shift"]  # recorded, the number
    assert record["model"]["head_depth"] == 1 and record["model"]["time_embed"] == "fourier"
    out = tmp_path / "samples.npz"
    r = dittrain("sample", "--ckpt", tmp_path / "killed", "--npz", out, "--n", 2, "--steps", 2, "--device", "cpu",
                 "--chunk-size", 2)
    assert r.exit_code == 0, r.output
    with np.load(out) as npz:
        assert npz["arr_0"].shape == (2, 32, 32, 3) and npz["arr_0"].dtype == np.uint8  # decoded RGB


def test_a_dit_dh_takes_token_routing_and_ddpm_refuses_t_shift_auto(rae_store, tmp_path):
    r = dittrain(*run_args(rae_store, tmp_path / "routed", "--max-steps", 2, "--objective", "flow",
                           "--flow-time-scale", 1, "--route", "0.5:0:1", model=DDT))
    assert r.exit_code == 0, r.output
    r = dittrain(*run_args(rae_store, tmp_path / "ddpm", "--max-steps", 2, "--t-shift", "auto", model=DDT))
    assert r.exit_code != 0 and "--t-shift auto is a flow option" in one_error_line(r.output)
    # a latent grid the model cannot take: 4 x 4 tokens do not split into patches of 3
    r = dittrain(*run_args(rae_store, tmp_path / "p3", "--max-steps", 2, "--objective", "flow",
                           model=DDT.replace("patch=1", "patch=3")))
    assert r.exit_code != 0 and "does not fit latents 64x4x4" in one_error_line(r.output)


def test_a_dit_dh_exports_to_onnx_fp16_and_int8_refuses_diffusers_and_serves(rae_store, tmp_path):
    """onnx (checked against torch by the export itself), fp16 and int8 carry a DiT^DH: they hold whatever
    state dict and graph the model has; a diffusers DiTPipeline has no DDT head, so that format is refused."""
    pytest.importorskip("onnxruntime")
    run = tmp_path / "run"
    r = dittrain(*run_args(rae_store, run, "--max-steps", 2, "--objective", "flow", "--flow-time-scale", 1, model=DDT))
    assert r.exit_code == 0, r.output
    r = dittrain("export", "--ckpt", run, "--format", "onnx", "--out", tmp_path / "d.onnx")
    assert r.exit_code == 0 and "max abs diff" in r.output, r.output
    for fmt, name in (("fp16", "d.safetensors"), ("int8", "d.pt")):
        r = dittrain("export", "--ckpt", run, "--format", fmt, "--out", tmp_path / name)
        assert r.exit_code == 0 and (tmp_path / name).is_file(), r.output
    r = dittrain("export", "--ckpt", run, "--format", "diffusers", "--out", tmp_path / "pipe")
    assert r.exit_code != 0 and "it is a DiT^DH (a DDT head after the trunk)" in one_error_line(r.output)
    assert not (tmp_path / "pipe").exists()

    # serve: the page's generate() decodes through the RAE decoder, and gives the images of the command it shows
    import shlex

    from dittrain.config import ServeConfig
    from dittrain.inference.serve import Request, Server

    server = Server(run, ServeConfig(device="cpu", batch_size=2, max_images=4), log=lambda line: None)
    shown = server.generate(Request(choice="1", n=2, steps=3, seed=5))
    assert shown.ok and shown.images.shape == (2, 32, 32, 3), shown.message
    args = shlex.split(shown.command)
    args[args.index("--out") + 1] = str(tmp_path / "shown.png")
    assert dittrain(*args[1:]).exit_code == 0
    from PIL import Image

    singles = [np.asarray(Image.open(p)) for p in sorted((tmp_path / "shown").glob("*.png"))]
    assert len(singles) == 2 and all(np.array_equal(a, b) for a, b in zip(shown.images, singles, strict=True))
