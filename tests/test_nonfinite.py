"""Non-finite latents are never written: an autoencoder whose fp16 output overflows gives
counted skips, and `ditdata verify` reports NaN/inf already in a store."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from cliutil import ditdata as cli
from PIL import Image
from storeutil import schema, write_store
from tiny import fetch_tree, real_images

from ditdata.autoencoders import taef2
from ditdata.store import BACKEND_CLASSES, open_store

# every shard format of the store's table: a new backend is tested too
BACKENDS = list(BACKEND_CLASSES)


def overflowing_taef2(folder: Path, probe: np.ndarray) -> Path:
    """A TAEF2-shaped autoencoder with random weights, no biases and no pool branch, so
    the encoder is positively homogeneous: a black image gives exactly 0 and a photo gives
    values scaled to about 1e6, which overflow fp16 (max 65504) when stored."""
    torch.manual_seed(0)
    model = taef2.TAEF2()
    with torch.no_grad():
        for name, p in model.encoder.named_parameters():
            if name.endswith("bias") or ".pool.3." in name:
                p.zero_()
        x = torch.from_numpy(probe).permute(2, 0, 1)[None].float() / 255
        peak = model.encoder(x).abs().max().item()
        assert peak > 0
        model.encoder[14].weight.mul_(1e6 / peak)
    folder.mkdir(parents=True)
    torch.save(model.encoder.state_dict(), folder / taef2.ENCODER_FILE)
    torch.save(model.decoder.state_dict(), folder / taef2.DECODER_FILE)
    return folder


def test_fp16_overflow_is_skipped_and_counted(tmp_path):
    photos = {k: np.ascontiguousarray(v[:64, :64]) for k, v in real_images().items()}
    tree = tmp_path / "tree"
    for name in ("bright", "dark"):
        (tree / name).mkdir(parents=True)
    for i, arr in enumerate(photos.values()):
        Image.fromarray(arr).save(tree / "bright" / f"{i}.png")
        Image.fromarray(np.zeros_like(arr)).save(tree / "dark" / f"{i}.png")
    shards = fetch_tree(tree, tmp_path / "shards", samples_per_shard=4)  # shard 0 bright, 1 dark
    vae = overflowing_taef2(tmp_path / "vae", photos["astronaut"])

    r = cli("encode", shards, "--vae", vae, "--resolution", 64, "--out", tmp_path / "store",
            "--workers", 0, "--device", "cpu", "--flip")
    assert r.exit_code == 0, r.output
    assert "encoded 4 images" in r.output and "skipped: non-finite latent: 4" in r.output
    s = open_store(tmp_path / "store", verify=True)
    assert len(s) == 4 and s.shard("00000").num_samples == 0 and s.shard("00001").num_samples == 4
    rec = s.shard("00000").record["extra"]
    assert rec["skipped"] == {"non-finite latent": 4} and len(rec["skipped_keys"]) == 4
    latents = s.read("00001")["latent"]
    assert np.isfinite(latents.astype(np.float32)).all()
    assert cli("verify", tmp_path / "store").exit_code == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_reports_non_finite_values(tmp_path, backend, monkeypatch):
    import storeutil

    clean = storeutil.shard_data

    def poisoned(sch, index, n):  # a store written by something that did not check
        t, c = clean(sch, index, n)
        if index == 1:
            t["latent"][2, 0, 0, 0] = np.inf
            t["text_pooled"][4, 3] = np.nan
        return t, c

    monkeypatch.setattr(storeutil, "shard_data", poisoned)
    with np.errstate(invalid="ignore"):  # the manifest's channel stats see the inf too
        write_store(tmp_path / "s", schema("float16"), [5, 6], backend)
    r = cli("verify", tmp_path / "s")
    assert r.exit_code == 1
    assert "field 'latent' holds non-finite values (NaN/inf) in 1 sample(s), the first at row 2" in r.output
    assert "field 'text_pooled' holds non-finite values (NaN/inf) in 1 sample(s), the first at row 4" in r.output
    assert "2 fault(s) found" in r.output
