"""The autoencoder registry: local diffusers directories and a fake Hugging Face cache
(tiny random AutoencoderKL through the real from_pretrained path), fast failure for
missing models, pixels, TAEF2 resolution and rebuilding from a manifest entry."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny import tiny_kl

from ditdata.errors import DitdataError
from ditdata.vae import PRESETS, Autoencoder, autoencoder_from_manifest, load_autoencoder

diffusers = pytest.importorskip("diffusers")

INFO_KEYS = {"name", "id", "subfolder", "revision", "weights_sha256", "scaling_factor",
             "shift_factor", "latent_channels", "downsample", "input_range", "kind"}
REV = "0123456789abcdef0123456789abcdef01234567"
WEIGHTS = "diffusion_pytorch_model.safetensors"


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _save(model, path: Path) -> Path:
    model.save_pretrained(str(path))
    return path


def _fake_hub(cache: Path, repo_id: str, model, subfolder: str | None = None) -> Path:
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / REV
    _save(model, snap / subfolder if subfolder else snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REV)
    return snap


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    return cache


def _images(n=2, size=32):
    torch.manual_seed(1)
    return torch.rand(n, 3, size, size)


def test_importing_vae_is_cheap():
    code = "import sys, ditdata.vae; assert 'torch' not in sys.modules and 'diffusers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_presets_table():
    assert PRESETS["sd-vae-ft-ema"].repo_id == "stabilityai/sd-vae-ft-ema"
    assert PRESETS["sd-vae-ft-mse"].scaling_factor == 0.18215
    assert PRESETS["sdxl-vae"].scaling_factor == 0.13025
    flux = PRESETS["flux-vae"]
    assert (flux.repo_id, flux.subfolder, flux.latent_channels) == ("black-forest-labs/FLUX.1-schnell", "vae", 16)
    assert (flux.scaling_factor, flux.shift_factor) == (0.3611, 0.1159)
    assert PRESETS["taef2"].latent_channels == 32 and PRESETS["taef2"].input_range == "[0,1]"
    assert PRESETS["pixels"].downsample == 1


def test_local_diffusers_dir(tmp_path):
    model = tiny_kl(scaling_factor=0.25, shift_factor=0.125)
    d = _save(model, tmp_path / "kl")
    ae = load_autoencoder(str(d))
    assert isinstance(ae, Autoencoder) and type(ae.module).__name__ == "AutoencoderKL"
    assert set(ae.info) == INFO_KEYS
    assert ae.info["id"] == str(d.resolve()) and ae.info["revision"] is None
    assert ae.info["weights_sha256"] == {WEIGHTS: _sha(d / WEIGHTS)}
    assert (ae.scaling_factor, ae.shift_factor) == (0.25, 0.125)  # from config.json
    assert (ae.latent_channels, ae.downsample, ae.info["input_range"], ae.kind) == (4, 2, "[-1,1]", "autoencoder_kl")
    assert not ae.deterministic and ae.latent_shape(32, 48) == (4, 16, 24)
    json.dumps(ae.info)  # goes into a JSON manifest as is

    x = _images()
    z, std = ae.encode(x)
    assert z.shape == std.shape == (2, 4, 16, 16) and z.dtype == torch.float32
    assert (std > 0).all()
    with torch.no_grad():  # the scaling convention, checked against the raw module
        dist = model.eval().encode(x * 2 - 1).latent_dist
    torch.testing.assert_close(z, (dist.mean - 0.125) * 0.25)
    torch.testing.assert_close(std, dist.std * 0.25)
    y = ae.decode(z)
    assert y.shape == x.shape and y.min() >= 0 and y.max() <= 1
    with torch.no_grad():
        want = ((model.decode(dist.mean).sample + 1) / 2).clamp(0, 1)
    torch.testing.assert_close(y, want)
    assert ae.decode(z.half()).dtype == torch.float32  # stored fp16 latents decode too

    # a diffusers pipeline directory: its vae/ subfolder is used
    pipe = tmp_path / "pipe"
    _save(model, pipe / "vae")
    assert load_autoencoder(str(pipe)).info["id"] == str((pipe / "vae").resolve())

    with pytest.raises(DitdataError, match="multiple of 2"):
        ae.encode(torch.rand(1, 3, 31, 32))


def test_hub_id_from_fake_cache_records_revision(empty_cache):
    _fake_hub(empty_cache, "org/tiny-vae", tiny_kl())
    ae = load_autoencoder("org/tiny-vae")
    assert ae.info["id"] == "org/tiny-vae" and ae.info["name"] == "org/tiny-vae"
    assert ae.info["revision"] == REV and ae.info["subfolder"] is None
    assert ae.scaling_factor == 0.18215 and ae.shift_factor == 0.0


def test_flux_preset_from_fake_cache_uses_preset_factors_and_subfolder(empty_cache):
    snap = _fake_hub(empty_cache, "black-forest-labs/FLUX.1-schnell", tiny_kl(16), subfolder="vae")
    ae = load_autoencoder("flux-vae")
    assert ae.info["name"] == "flux-vae" and ae.info["id"] == "black-forest-labs/FLUX.1-schnell"
    assert (ae.info["subfolder"], ae.info["revision"]) == ("vae", REV)
    assert (ae.scaling_factor, ae.shift_factor, ae.latent_channels) == (0.3611, 0.1159, 16)
    assert ae.info["weights_sha256"] == {WEIGHTS: _sha(snap / "vae" / WEIGHTS)}

    z, _ = ae.encode(_images(1))
    back = autoencoder_from_manifest(json.loads(json.dumps(ae.info)))
    assert back.info == ae.info
    torch.testing.assert_close(back.decode(z), ae.decode(z))

    # the recorded commit is not cached but another is: used, with a warning
    with pytest.warns(UserWarning, match="not cached"):
        other = autoencoder_from_manifest(dict(ae.info, revision="f" * 40))
    assert other.info["revision"] == REV


def test_missing_preset_fails_fast_with_instructions(empty_cache):
    t0 = time.monotonic()
    with pytest.raises(DitdataError) as err:
        load_autoencoder("sd-vae-ft-ema")
    assert time.monotonic() - t0 < 10
    msg = str(err.value)
    # the command that current huggingface_hub installs (`hf`; `huggingface-cli` is gone)
    assert "`hf download stabilityai/sd-vae-ft-ema`" in msg and "huggingface-cli" not in msg
    assert "HF_HOME" in msg and "\n" not in msg
    with pytest.raises(DitdataError) as err:  # a preset in a subfolder downloads only that folder
        load_autoencoder("flux-vae")
    assert "`hf download black-forest-labs/FLUX.1-schnell --include 'vae/*'`" in str(err.value)
    with pytest.raises(DitdataError, match="org/not-cached"):
        load_autoencoder("org/not-cached")
    with pytest.raises(DitdataError, match="unknown autoencoder"):
        load_autoencoder("no-such-preset")


def test_unrecognised_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "UNet2DModel"}))
    with pytest.raises(DitdataError, match="UNet2DModel"):
        load_autoencoder(str(tmp_path))


def test_pixels_round_trip():
    ae = load_autoencoder("pixels")
    assert ae.info["weights_sha256"] is None and ae.deterministic
    x = _images(size=24)
    z, std = ae.encode(x)
    assert std is None and z.shape == x.shape and z.min() >= -1 and z.max() <= 1
    torch.testing.assert_close(z, x * 2 - 1)
    torch.testing.assert_close(ae.decode(z), x)
    assert autoencoder_from_manifest(ae.info).info == ae.info


def test_from_manifest_trusts_manifest_factors_and_checks_weights(tmp_path):
    d = _save(tiny_kl(), tmp_path / "kl")
    ae = load_autoencoder(str(d))
    z, _ = ae.encode(_images())

    back = autoencoder_from_manifest(json.loads(json.dumps(ae.info)))
    assert back.info == ae.info
    torch.testing.assert_close(back.decode(z), ae.decode(z))

    entry = dict(ae.info, scaling_factor=0.5, shift_factor=0.25)
    rebuilt = autoencoder_from_manifest(entry)
    assert (rebuilt.scaling_factor, rebuilt.shift_factor) == (0.5, 0.25)
    raw_mean = z / ae.scaling_factor  # shift 0 in the config
    z_manifest = (raw_mean - 0.25) * 0.5  # the same latents under the manifest's factors
    torch.testing.assert_close(rebuilt.decode(z_manifest), ae.decode(z), atol=1e-5, rtol=1e-5)

    entry = dict(ae.info, weights_sha256={WEIGHTS: "0" * 64})
    with pytest.warns(UserWarning, match="differ"):
        autoencoder_from_manifest(entry)
    with pytest.raises(DitdataError, match="differ"):
        autoencoder_from_manifest(entry, strict=True)
    with pytest.raises(DitdataError, match="latent_channels"):
        autoencoder_from_manifest(dict(ae.info, latent_channels=16))
    with pytest.raises(DitdataError, match="not on this machine"):
        autoencoder_from_manifest(dict(ae.info, id=str(tmp_path / "gone")))
    # an explicit source (--vae DIR) wins over the recorded id
    assert autoencoder_from_manifest(dict(ae.info, id=str(tmp_path / "gone")), source=str(d)).info == ae.info


def test_taef2_dir_and_preset(taef2_dir, monkeypatch, tmp_path):
    ae = load_autoencoder(str(taef2_dir))
    assert ae.kind == "taef2" and ae.deterministic and set(ae.info) == INFO_KEYS
    assert ae.info["id"] == str(taef2_dir.resolve())
    assert ae.info["weights_sha256"] == {
        "taef2_encoder.pth": "10a4e1021e89d7551eaf161352da8dbd0b1aa83872ae28b150c1df1ce2f147b6",
        "taef2_decoder.pth": "0a44a31e1ae59eb9dbf9359d24942fd3ef5928162c1800d97a28c61d51be0ab5",
    }
    assert (ae.scaling_factor, ae.shift_factor, ae.latent_channels, ae.info["input_range"]) == (1.0, 0.0, 32, "[0,1]")
    x = _images(1, 64)
    z, std = ae.encode(x)
    assert std is None and z.shape == (1, 32, 8, 8)
    y = ae.decode(z)
    assert y.shape == x.shape and y.min() >= 0 and y.max() <= 1

    monkeypatch.delenv("DITKIT_TAEF2", raising=False)
    with pytest.raises(DitdataError, match="DITKIT_TAEF2"):
        load_autoencoder("taef2")
    monkeypatch.setenv("DITKIT_TAEF2", str(taef2_dir))
    assert load_autoencoder("taef2").info == ae.info

    # the recorded directory is gone on this machine: found again through DITKIT_TAEF2
    entry = dict(ae.info, id=str(tmp_path / "moved"))
    back = autoencoder_from_manifest(entry)
    torch.testing.assert_close(back.decode(z), y)


def test_presets_need_no_torch_and_every_kind_has_an_adapter():
    code = ("import sys, ditdata.presets, ditdata.vae; assert 'torch' not in sys.modules; "
            "assert {p.kind for p in ditdata.presets.PRESETS.values()} == set(ditdata.vae.KINDS)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_new_kind_is_one_adapter(monkeypatch):
    """KINDS is the extension point: an adapter (here: latents are twice the pixels) is all
    Autoencoder and autoencoder_from_manifest need; scaling and value range stay theirs."""
    from ditdata import vae

    class Doubling(vae.AutoencoderKind):
        name = "doubling"
        has_weights = False

        def encode(self, module, x):
            return x * 2, None

        def decode(self, module, latents):
            return latents / 2

        def from_manifest(self, entry, device, dtype):
            return vae.Autoencoder(None, entry).to(device, dtype)

    monkeypatch.setitem(vae.KINDS, "doubling", Doubling())
    entry = dict(load_autoencoder("pixels").info, name="doubling", kind="doubling", scaling_factor=0.5)
    ae = autoencoder_from_manifest(entry, source="pixels")  # a kind without weights ignores --vae
    assert ae.kind == "doubling" and ae.deterministic
    x = _images(size=8)
    z, std = ae.encode(x)
    assert std is None
    torch.testing.assert_close(z, (x * 2 - 1) * 2 * 0.5)
    torch.testing.assert_close(ae.decode(z), x)
    with pytest.raises(DitdataError, match="unknown autoencoder kind 'gone'"):
        autoencoder_from_manifest(dict(entry, kind="gone"))
