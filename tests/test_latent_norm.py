"""--latent-norm channel: the model sees standardised latents (the store's recorded
per-channel stats), the run config records them, and sampling undoes them before decoding.
--latent-norm auto (the default): channel on a store whose autoencoder publishes no scaling
factor (an LDM checkpoint without scale_factor, as VA-VAE), none otherwise, said at the start
and recorded resolved."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from cliutil import ditdata, one_error_line, run_args
from cliutil import dittrain as cli
from storeutil import LABELLED, class_conditioning, pixels_info, schema, write_store
from tiny import save_ldm, tiny_ldm_kl

from dittrain.config import SampleConfig
from dittrain.data.latent_norm import LatentNorm, LatentNormError, latent_record
from dittrain.diffusion import Diffusion
from dittrain.inference.weights import load_weights

# per-channel offsets and scales of a store that is NOT standardised (pixels autoencoder: [-1, 1])
OFFSET = np.array([0.5, -0.4, 0.1], dtype=np.float32)
SCALE = np.array([0.1, 0.25, 0.05], dtype=np.float32)


def skewed_data(seed: int = 0):
    rng = np.random.default_rng(seed)

    def data(sch, index: int, n: int):
        x = OFFSET[:, None, None] + SCALE[:, None, None] * rng.standard_normal((n, 3, 8, 8)).astype(np.float32)
        tensors = {"latent": x.astype(np.float16), "latent_flip": x[..., ::-1].astype(np.float16)}
        return tensors, {"key": [f"{index}-{i}" for i in range(n)], "label": (np.arange(n) % 3).tolist()}

    return data


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("skewed") / "s"
    write_store(root, schema(shape=(3, 8, 8), flip=True, text=False, columns=LABELLED), [32, 32],
                info=pixels_info(8, class_conditioning(["a", "b", "c"])), data=skewed_data())
    return root


@pytest.fixture(scope="module")
def run_dir(store, tmp_path_factory) -> tuple[Path, list[torch.Tensor]]:
    """A 3-step ddpm run with --latent-norm channel, and the x0 batches the diffusion loss saw."""
    seen = []
    original = Diffusion.training_loss

    def spy(self, model, x0, *args, **kwargs):
        seen.append(x0.detach().clone())
        return original(self, model, x0, *args, **kwargs)

    out = tmp_path_factory.mktemp("run") / "r"
    mp = pytest.MonkeyPatch()
    mp.setattr(Diffusion, "training_loss", spy)
    try:
        r = cli(*run_args(store, out, "--max-steps", 3, "--batch-size", 32, "--latent-norm", "channel"))
    finally:
        mp.undo()
    assert r.exit_code == 0, r.output
    return out, seen


def test_store_records_the_channel_stats(store):
    from ditdata.store import open_store

    stats = open_store(store).manifest["stats"]
    assert np.allclose(stats["mean"], OFFSET, atol=0.03) and np.allclose(stats["std"], SCALE, rtol=0.1)


def test_normalize_uses_the_store_stats_and_inverts(store):
    from ditdata.store import open_store

    s = open_store(store)
    rec = latent_record(s, "channel")
    x = torch.from_numpy(s.read(0, ["latent"])["latent"].astype(np.float32))
    norm = LatentNorm(rec)
    y = norm.normalize(x)
    assert torch.allclose(y.mean(dim=(0, 2, 3)), torch.zeros(3), atol=0.2)
    assert torch.allclose(y.std(dim=(0, 2, 3)), torch.ones(3), atol=0.15)
    mean, std = torch.tensor(rec["mean"]).view(1, 3, 1, 1), torch.tensor(rec["std"]).view(1, 3, 1, 1)
    assert torch.allclose(y, (x - mean) / std, atol=1e-5)
    assert torch.allclose(norm.denormalize(y), x, atol=1e-5)
    assert LatentNorm({"norm": "none"}).normalize(x) is x and latent_record(s, "none") == {"norm": "none"}


def test_the_model_sees_standardised_latents(run_dir, store):
    out, seen = run_dir
    x = torch.cat(seen)  # every batch of the run (both shards, flips included)
    assert torch.allclose(x.mean(dim=(0, 2, 3)), torch.zeros(3), atol=0.1)
    assert torch.allclose(x.std(dim=(0, 2, 3)), torch.ones(3), atol=0.1)
    cfg = json.loads((out / "config.json").read_text())
    from ditdata.store import open_store

    stats = open_store(store).manifest["stats"]
    assert cfg["latents"]["norm"] == "channel" and cfg["train"]["data"]["latent_norm"] == "channel"
    assert cfg["latents"]["mean"] == stats["mean"] and cfg["latents"]["std"] == stats["std"]


def test_sampling_undoes_the_normalisation_before_decoding(run_dir, store, monkeypatch):
    """run_plan (under every sampling path) decodes mean_c + std_c * z; with the sampler
    returning z = 0, the pixels autoencoder shows each channel's store mean."""
    from ditdata.store import open_store
    from dittrain.inference.sample import sample_images

    out, _ = run_dir
    weights, config = load_weights(out)  # the EMA export carries the run config, latents included
    assert config["latents"]["norm"] == "channel"
    monkeypatch.setattr(Diffusion, "sample", lambda self, model, shape, **kw: torch.zeros(shape))
    images = sample_images(weights, config, open_store(store), SampleConfig(n=2, steps=2), device="cpu")
    want = np.round((np.asarray(config["latents"]["mean"]) + 1) / 2 * 255)
    assert np.abs(images.reshape(-1, 3).astype(float) - want).max() <= 1
    plain = dict(config, latents={"norm": "none"})
    grey = sample_images(weights, plain, open_store(store), SampleConfig(n=2, steps=2), device="cpu")
    assert np.abs(grey.astype(float) - 127.5).max() <= 1  # without the inverse: z = 0 decodes to mid grey


def test_resume_keeps_the_latent_norm(run_dir, store, tmp_path):
    out, _ = run_dir
    r = cli(*run_args(store, out, "--max-steps", 4, "--batch-size", 32, "--resume", "--latent-norm", "none"))
    assert r.exit_code == 1 and "--latent-norm 'channel' -> 'none' cannot change" in one_error_line(r.output)


def test_diffusers_export_refuses_it(run_dir):
    from dittrain.inference.export import diffusers_refusal

    _, config = load_weights(run_dir[0])
    assert "--latent-norm channel" in diffusers_refusal(config)


def test_store_without_stats_is_refused_at_start(store, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(store, bare)
    m = json.loads((bare / "manifest.json").read_text())
    m["stats"] = {"field": "latent", "count": 0, "mean": [], "std": []}
    (bare / "manifest.json").write_text(json.dumps(m))
    r = cli(*run_args(bare, tmp_path / "r", "--max-steps", 1, "--latent-norm", "channel"))
    assert r.exit_code == 1 and "no per-channel latent mean/std" in one_error_line(r.output)
    assert not (tmp_path / "r" / "config.json").exists()
    from ditdata.store import open_store

    with pytest.raises(LatentNormError):
        latent_record(open_store(bare), "channel")


# --------------------------------------------------------------------------- auto


@pytest.fixture(scope="module")
def ldm_run(class_shards, tmp_path_factory):
    """(run, store, checkpoint): `ditdata encode` with a tiny LDM checkpoint whose config has no
    scale_factor (as VA-VAE's; --config file keys), at 16 px (latents 4x8x8), and a 2-step run
    on it with the default --latent-norm (auto)."""
    root = tmp_path_factory.mktemp("ldm")
    ckpt, config = save_ldm(tiny_ldm_kl(attention=True), root / "vae" / "tiny-vavae.pt")
    (root / "encode.toml").write_text(f'vae = "ldm:{ckpt}"\nvae-config = "{config}"\nresolution = 16\n'
                                      'workers = 0\ndevice = "cpu"\n')
    r = ditdata("encode", class_shards, "--config", root / "encode.toml", "--out", root / "store", "--quiet")
    assert r.exit_code == 0, r.output
    r = cli(*run_args(root / "store", root / "run", "--max-steps", 2))
    assert r.exit_code == 0, r.output
    return root / "run", root / "store", ckpt, r.output


def test_auto_standardises_a_store_without_published_scaling_and_says_so(ldm_run):
    run, store, ckpt, output = ldm_run
    assert (f"latent norm channel (auto: the store's autoencoder ldm:{ckpt} has no published scaling factor)"
            in output)
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["train"]["data"]["latent_norm"] == "channel" and cfg["latents"]["norm"] == "channel"  # never auto
    from ditdata.store import open_store

    assert cfg["latents"]["mean"] == open_store(store).manifest["stats"]["mean"]
    # a resume that says auto again continues as recorded (no change, nothing refused)
    r = cli(*run_args(store, run, "--max-steps", 3, "--resume", "--latent-norm", "auto"))
    assert r.exit_code == 0, r.output
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["train"]["data"]["latent_norm"] == "channel"
    assert [list(h["changes"]) for h in cfg["history"]] == [["--max-steps"]]


def test_sampling_decodes_through_the_ldm_checkpoint(ldm_run, monkeypatch, tmp_path):
    """`dittrain sample` of the run opens the store's LDM autoencoder (the recorded file and
    config) and decodes mean_c + std_c * z: with the sampler returning z = 0, each sample is the
    decode of the store's channel means."""
    from PIL import Image

    from ditdata.autoencoders.kinds import load_autoencoder
    from ditdata.store import open_store

    run, store, ckpt, _ = ldm_run
    monkeypatch.setattr(Diffusion, "sample", lambda self, model, shape, **kw: torch.zeros(shape))
    r = cli("sample", "--ckpt", run, "--out", tmp_path / "s", "--n", 2, "--steps", 2, "--device", "cpu")
    assert r.exit_code == 0, r.output
    stats = open_store(store).manifest["stats"]
    ae = load_autoencoder(f"ldm:{ckpt}", vae_config=open_store(store).manifest["vae"]["ldm_config"])
    want = ae.decode(torch.tensor(stats["mean"]).view(1, 4, 1, 1).expand(1, 4, 8, 8))[0]
    want = (want.permute(1, 2, 0).numpy() * 255).round()
    got = np.asarray(Image.open(tmp_path / "s" / "samples" / "0001.png").convert("RGB")).astype(float)
    assert got.shape == (16, 16, 3) and np.abs(got - want).max() <= 1


def test_auto_keeps_a_scaled_store_as_it_is(store, tmp_path):
    r = cli(*run_args(store, tmp_path / "r", "--max-steps", 1))
    assert r.exit_code == 0, r.output
    assert "latent norm none (auto: the store's autoencoder pixels scales its latents by 1.0)" in r.output
    cfg = json.loads((tmp_path / "r" / "config.json").read_text())
    assert cfg["train"]["data"]["latent_norm"] == "none" and cfg["latents"] == {"norm": "none"}
