"""The autoencoder registry: local diffusers directories and a fake Hugging Face cache
(tiny random AutoencoderKL through the real from_pretrained path), LDM-format checkpoints
(ldm:FILE + an LDM config, the vavae-f16d32 preset; made in the tests from a tiny diffusers
model of the architecture), fast failure for missing models, pixels, TAEF2 resolution and
rebuilding from a manifest entry."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cliutil import raises_one_line
from tiny import ldm_state_dict, save_ldm, tiny_kl, tiny_ldm_kl

from ditdata.autoencoders.kinds import PRESETS, Autoencoder, autoencoder_from_manifest, load_autoencoder
from ditdata.errors import DitdataError

diffusers = pytest.importorskip("diffusers")

INFO_KEYS = {"name", "id", "subfolder", "revision", "weights_sha256", "scaling_factor",
             "shift_factor", "latent_channels", "downsample", "input_range", "kind", "latent_norm", "ldm_config"}
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
    code = "import sys, ditdata.autoencoders.kinds; assert 'torch' not in sys.modules and 'diffusers' not in sys.modules"
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
    code = ("import sys, ditdata.autoencoders.presets, ditdata.autoencoders.kinds; assert 'torch' not in sys.modules; "
            "assert {p.kind for p in ditdata.autoencoders.presets.PRESETS.values()} == set(ditdata.autoencoders.kinds.KINDS)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_new_kind_is_one_adapter(monkeypatch):
    """KINDS is the extension point: an adapter (here: latents are twice the pixels) is all
    Autoencoder and autoencoder_from_manifest need; scaling and value range stay theirs."""
    from ditdata.autoencoders import kinds as vae

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


# --------------------------------------------------------------------------- LDM-format checkpoints

VAVAE_FILE = "vavae-imagenet256-f16d32-dinov2.pt"
# what VA-VAE's checkpoint holds besides the autoencoder: its loss networks and its DINOv2 teacher
NOT_THE_AUTOENCODER = {"loss.discriminator.main.0.weight": torch.ones(2, 3), "loss.logvar": torch.zeros(()),
                       "foundation_model.model.blocks.0.attn.qkv.weight": torch.ones(6, 2),
                       "linear_proj.weight": torch.ones(2, 4)}


@pytest.fixture(scope="module")
def vavae_like(tmp_path_factory):
    """(model, checkpoint, config): a tiny AutoencoderKL with attention inside its lowest level
    (VA-VAE's layout), saved as VA-VAE ships: a torch .pt, the weights under "state_dict" beside
    loss and teacher tensors, and an autoencoder LDM config without scale_factor."""
    model = tiny_ldm_kl(attention=True)
    ckpt, config = save_ldm(model, tmp_path_factory.mktemp("vavae") / VAVAE_FILE, extra=NOT_THE_AUTOENCODER)
    return model, ckpt, config


def _same_as(ae, model, scale: float = 1.0):
    """ae encodes and decodes exactly as the diffusers `model` does (on the same weights)."""
    x = _images()
    z, std = ae.encode(x)
    with torch.no_grad():
        dist = model.encode(x * 2 - 1).latent_dist
        want = ((model.decode(dist.mean).sample + 1) / 2).clamp(0, 1)
    torch.testing.assert_close(z, dist.mean * scale, rtol=0, atol=0)
    torch.testing.assert_close(std, dist.std * scale, rtol=0, atol=0)
    torch.testing.assert_close(ae.decode(z), want, rtol=0, atol=1e-6)
    return z


def test_ldm_checkpoint_with_attention_in_a_level_equals_its_diffusers_model(vavae_like, tmp_path):
    model, ckpt, config = vavae_like
    ae = load_autoencoder(f"ldm:{ckpt}", vae_config=str(config))
    assert ae.module.config.down_block_types[-1] == "AttnDownEncoderBlock2D"  # the level's attention is there
    z = _same_as(ae, model)
    info = json.loads(json.dumps(ae.info))  # the manifest entry, as stored
    assert set(info) == INFO_KEYS and info["kind"] == "autoencoder_kl"
    assert info["weights_sha256"] == {VAVAE_FILE: _sha(ckpt)} and info["id"] == str(ckpt)
    # no published scaling: stored unscaled, and the store asks for channel normalisation
    assert (ae.scaling_factor, ae.shift_factor, info["latent_norm"]) == (1.0, 0.0, "channel")
    assert info["ldm_config"] == {"embed_dim": 4, "ddconfig": {
        "double_z": True, "z_channels": 4, "resolution": 32, "in_channels": 3, "out_ch": 3, "ch": 32,
        "ch_mult": [1, 2], "num_res_blocks": 1, "attn_resolutions": [16]}}  # the architecture only
    assert (ae.latent_channels, ae.downsample) == (4, 2)

    back = autoencoder_from_manifest(info)  # decoding a store: the recorded file and config
    assert back.info == ae.info
    torch.testing.assert_close(back.decode(z), ae.decode(z), rtol=0, atol=0)
    # moved: the recorded config travels with the manifest, --vae ldm:FILE says where the file is
    moved = tmp_path / "elsewhere.pt"
    moved.write_bytes(ckpt.read_bytes())
    gone = dict(info, id=str(tmp_path / "gone.pt"), name="ldm:" + str(tmp_path / "gone.pt"))
    assert "not on this machine" in raises_one_line(DitdataError, lambda: autoencoder_from_manifest(gone))
    with pytest.warns(UserWarning, match="differ"):  # recorded as another file name: its sha256 differs
        again = autoencoder_from_manifest(gone, source=f"ldm:{moved}")
    torch.testing.assert_close(again.decode(z), ae.decode(z), rtol=0, atol=0)


def test_ldm_checkpoint_of_a_whole_pipeline_equals_diffusers_from_single_file(tmp_path):
    """A Stable Diffusion style file (.safetensors, keys under first_stage_model., the config's
    scale_factor beside first_stage_config): the same module as diffusers' own
    AutoencoderKL.from_single_file, offline, and scaled by the published factor."""
    model = tiny_ldm_kl()
    ckpt, config = save_ldm(model, tmp_path / "sd.safetensors", prefix="first_stage_model.",
                            extra={"model.diffusion_model.out.0.weight": torch.ones(3)}, sd_layout=True,
                            scale_factor=0.25)
    ae = load_autoencoder(f"ldm:{ckpt}", vae_config=config)
    _same_as(ae, model, scale=0.25)
    assert (ae.scaling_factor, ae.info["latent_norm"], ae.info["ldm_config"]["scale_factor"]) == (0.25, "none", 0.25)
    theirs = diffusers.AutoencoderKL.from_single_file(str(ckpt), original_config=str(config), local_files_only=True)
    ours = ae.module.state_dict()
    assert ours.keys() == theirs.state_dict().keys()
    assert all(torch.equal(v, ours[k]) for k, v in theirs.state_dict().items())


def test_bad_ldm_input_is_one_line(vavae_like, tmp_path):
    import yaml

    _, ckpt, config = vavae_like
    spec = f"ldm:{ckpt}"

    def load(vae, cfg=config):
        return raises_one_line(DitdataError, lambda: load_autoencoder(vae, vae_config=cfg))

    def with_config(edit) -> Path:
        raw = yaml.safe_load(config.read_text())
        edit(raw["model"]["params"])
        path = tmp_path / f"c{len(list(tmp_path.iterdir()))}.yaml"
        path.write_text(yaml.safe_dump(raw))
        return path

    assert "no such checkpoint file" in load(f"ldm:{tmp_path / 'missing.pt'}")
    assert "needs its LDM config: --vae-config" in load(spec, None)
    assert "goes with --vae ldm:CHECKPOINT" in load("pixels")
    assert f"--vae ldm:{ckpt} --vae-config" in load(str(ckpt), None)  # a bare file: how to give it
    (tmp_path / "broken.yaml").write_text("model: [unclosed\n  params: {")
    assert "not readable as YAML" in load(spec, tmp_path / "broken.yaml")
    assert "cannot read the LDM config" in load(spec, tmp_path / "absent.yaml")
    (tmp_path / "other.yaml").write_text("model:\n  params:\n    lr: 1\n")
    assert "no ddconfig and embed_dim" in load(spec, tmp_path / "other.yaml")
    narrower = with_config(lambda p: p["ddconfig"].update(ch_mult=[1, 1]))
    msg = load(spec, narrower)
    assert "does not fit its LDM config" in msg and "of another shape" in msg and "--vae-config" in msg
    no_attention = with_config(lambda p: p["ddconfig"].update(attn_resolutions=[]))
    assert "unexpected weights (e.g. encoder.down.1.attn.0" in load(spec, no_attention)
    wider = with_config(lambda p: p.update(embed_dim=8))
    assert "embed_dim 8 != ddconfig z_channels 4" in load(spec, wider)
    linear = with_config(lambda p: p["ddconfig"].update(attn_type="linear"))
    assert "attn_type: 'linear' is not supported" in load(spec, linear)
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    assert "cannot read the checkpoint" in load(f"ldm:{tmp_path / 'notes.pt'}")
    torch.save({"state_dict": {"net.weight": torch.ones(2)}}, tmp_path / "unet.pt")
    assert "no KL autoencoder weights" in load(f"ldm:{tmp_path / 'unet.pt'}")


def test_vavae_preset_is_va_vaes_architecture():
    """The shipped config builds VA-VAE's network: five levels /16, 32 channels, about 70 M
    parameters, and attention inside the 16 px level only: its LDM weight names are those of
    VA-VAE's checkpoint (encoder.down.4.attn.0-1, decoder.up.4.attn.0-2)."""
    from ditdata.autoencoders.ldm import diffusers_config, read_config

    p = PRESETS["vavae-f16d32"]
    assert (p.repo_id, p.filename, p.env) == ("hustvl/vavae-imagenet256-f16d32-dinov2", VAVAE_FILE, "DITKIT_VAVAE")
    assert (p.kind, p.scaling_factor, p.shift_factor, p.latent_channels, p.downsample) == ("autoencoder_kl", 1.0, 0.0, 32, 16)
    cfg = read_config(p.ldm_config)
    assert "scale_factor" not in cfg  # no published scaling factor
    # a config in the layout VA-VAE's yaml has (its training keys beside the architecture) reads the same
    published = {"ckpt_path": "vavae.pt", "model": {"target": "ldm.models.autoencoder.AutoencoderKL", "params": {
        "monitor": "val/rec_loss", "embed_dim": 32, "use_vf": "dinov2", "reverse_proj": True,
        "lossconfig": {"target": "ldm.modules.losses.LPIPSWithDiscriminator", "params": {"vf_weight": 0.1}},
        "ddconfig": {"double_z": True, "z_channels": 32, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                     "ch_mult": [1, 1, 2, 2, 4], "num_res_blocks": 2, "attn_resolutions": [16], "dropout": 0.0}}}}
    assert read_config(published) == cfg
    with torch.device("meta"):
        model = diffusers.AutoencoderKL.from_config(diffusers_config(cfg, {}))
    assert list(model.config.block_out_channels) == [128, 128, 256, 256, 512] and model.config.latent_channels == 32
    names = ldm_state_dict(model)
    assert 69e6 < sum(v.numel() for v in names.values()) < 71e6
    assert sorted({".".join(k.split(".")[:5]) for k in names if ".attn." in k}) == [
        "decoder.up.4.attn.0", "decoder.up.4.attn.1", "decoder.up.4.attn.2", "encoder.down.4.attn.0",
        "encoder.down.4.attn.1"]


def test_vavae_preset_fails_fast_offline_with_the_download_command(empty_cache, monkeypatch):
    monkeypatch.delenv("DITKIT_VAVAE", raising=False)
    t0 = time.monotonic()
    msg = raises_one_line(DitdataError, lambda: load_autoencoder("vavae-f16d32"))
    assert time.monotonic() - t0 < 10
    assert f"`hf download hustvl/vavae-imagenet256-f16d32-dinov2 {VAVAE_FILE}`" in msg
    assert "DITKIT_VAVAE" in msg and "HF_HOME" in msg


def test_vavae_preset_found_in_env_dir_hub_cache_and_again_from_a_manifest(vavae_like, empty_cache, monkeypatch,
                                                                          tmp_path):
    """The preset's search, with the tiny checkpoint standing in for VA-VAE's (the preset's
    config swapped for the tiny model's): $DITKIT_VAVAE (a directory or the file), --vae DIR,
    the hub cache at a recorded commit; a store's entry whose file moved finds it again so."""
    import dataclasses

    from ditdata.autoencoders import ldm

    model, ckpt, config = vavae_like
    tiny = ldm.read_config(config)
    monkeypatch.setitem(PRESETS, "vavae-f16d32", dataclasses.replace(PRESETS["vavae-f16d32"], ldm_config=tiny))
    monkeypatch.setenv("DITKIT_VAVAE", str(ckpt.parent))
    ae = load_autoencoder("vavae-f16d32")
    _same_as(ae, model)
    assert (ae.info["name"], ae.info["id"], ae.info["latent_norm"]) == ("vavae-f16d32", str(ckpt), "channel")
    monkeypatch.setenv("DITKIT_VAVAE", str(ckpt))
    assert load_autoencoder("vavae-f16d32").info == ae.info
    assert load_autoencoder(str(ckpt.parent)).info == ae.info  # --vae DIR holding the file
    monkeypatch.setenv("DITKIT_VAVAE", str(tmp_path))
    assert "holding it" in raises_one_line(DitdataError, lambda: load_autoencoder("vavae-f16d32"))

    monkeypatch.delenv("DITKIT_VAVAE")
    snap = empty_cache / "models--hustvl--vavae-imagenet256-f16d32-dinov2" / "snapshots" / REV
    snap.mkdir(parents=True)
    (snap / VAVAE_FILE).write_bytes(ckpt.read_bytes())
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text(REV)
    hub = load_autoencoder("vavae-f16d32")
    assert (hub.info["id"], hub.info["revision"]) == ("hustvl/vavae-imagenet256-f16d32-dinov2", REV)
    assert hub.info["weights_sha256"] == ae.info["weights_sha256"]
    assert autoencoder_from_manifest(json.loads(json.dumps(hub.info))).info == hub.info
    # a store made from a local copy that is gone: the preset's search finds the cached one
    moved = dict(ae.info, id=str(tmp_path / "gone" / VAVAE_FILE))
    torch.testing.assert_close(autoencoder_from_manifest(moved).decode(torch.zeros(1, 4, 2, 2)),
                               ae.decode(torch.zeros(1, 4, 2, 2)), rtol=0, atol=0)
