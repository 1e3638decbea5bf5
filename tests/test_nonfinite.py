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
from ditdata.imageshards import folder as imageshards
from ditdata.store import BACKEND_CLASSES, open_store, quantize, values

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


def _inf_and_nan(t):  # values a store written by something that did not check may hold
    t["latent"][2, 0, 0, 0] = np.inf
    t["text_pooled"][4, 3] = np.nan


def _bad_scales(t):  # an int8 latent's scale NaN, a flipped one's negative
    t["latent_scale"][2, 3, 3] = np.nan
    t["latent_flip_scale"][4, 0, 1] = -t["latent_flip_scale"][4, 0, 1]


POISONS = {
    "float16": (_inf_and_nan, ["field 'latent' holds non-finite values (NaN/inf) in 1 sample(s), the first at row 2",
                               "field 'text_pooled' holds non-finite values (NaN/inf) in 1 sample(s), the first at row 4"]),
    "int8": (_bad_scales, ["field 'latent_scale' holds non-finite values (NaN/inf) in 1 sample(s), the first at row 2",
                           "field 'latent_flip_scale' holds int8 scales that are not > 0 in 1 sample(s), the first at "
                           "row 4"]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(POISONS))
def test_verify_reports_non_finite_values_and_bad_int8_scales(tmp_path, backend, dtype, monkeypatch):
    import storeutil

    clean = storeutil.shard_data
    poison, faults = POISONS[dtype]

    def poisoned(sch, index, n):
        t, c = clean(sch, index, n)
        if index == 1:
            poison(t)
        return t, c

    monkeypatch.setattr(storeutil, "shard_data", poisoned)
    with np.errstate(invalid="ignore"):  # the manifest's channel stats see the inf too
        write_store(tmp_path / "s", schema(dtype), [5, 6], backend)
    r = cli("verify", tmp_path / "s")
    assert r.exit_code == 1
    assert all(fault in r.output for fault in faults), r.output
    assert "2 fault(s) found" in r.output


def test_int8_latents_hold_what_fp16_overflows_and_leave_out_what_is_not_finite(tmp_path):
    """--dtype int8: the per-token float32 scale stores the overflowing autoencoder's ~1e6 latents
    that float16 cannot (every sample kept, each within half a step of the float32 encode); a
    sample that is not finite in float32 is left out and counted before quantization, as ever."""
    photos = {k: np.ascontiguousarray(v[:64, :64]) for k, v in real_images().items()}
    (tmp_path / "tree" / "bright").mkdir(parents=True)
    for i, arr in enumerate(photos.values()):
        Image.fromarray(arr).save(tmp_path / "tree" / "bright" / f"{i}.png")
    shards = fetch_tree(tmp_path / "tree", tmp_path / "shards", samples_per_shard=4)
    vae = overflowing_taef2(tmp_path / "vae", photos["astronaut"])
    r = cli("encode", shards, "--vae", vae, "--resolution", 64, "--out", tmp_path / "store", "--dtype", "int8",
            "--workers", 0, "--device", "cpu")
    assert r.exit_code == 0 and "skipped: none" in r.output, r.output
    s = open_store(tmp_path / "store", verify=True)
    data = s.read("00000")
    z = values(data, "latent")
    assert len(s) == 4 and np.abs(z).max() > 65504  # beyond float16
    from ditdata.autoencoders import load_autoencoder

    images = {m.key: np.asarray(m.decode()) for m in imageshards.iter_shard(imageshards.list_shards(shards)[0])}
    with torch.no_grad():
        x = torch.stack([torch.from_numpy(images[k]).permute(2, 0, 1) for k in data["key"]]).float() / 255
        want = load_autoencoder(str(vae)).encode(x)[0].numpy()
    assert (np.abs(z - want) <= data["latent_scale"][:, None] / 2 * (1 + 1e-3)).all()  # and float32 rounding

    from ditdata.encode import _ShardOut

    out = _ShardOut(0, "00000", int8=True)
    lat = np.random.default_rng(0).standard_normal((3, 4, 2, 2)).astype(np.float32)
    lat[1, 2, 0, 1] = np.nan
    assert out.add({"latent": lat.copy()}, {"key": ["a", "b", "c"]}) == 2
    assert out.nonfinite_keys == ["b"] and out.columns["key"] == ["a", "c"]
    q, scale = out.tensors["latent"][0], out.tensors["latent_scale"][0]
    assert q.dtype == np.int8 and np.array_equal(q, quantize(lat[[0, 2]], axis=1)[0])
    assert np.array_equal(scale, quantize(lat[[0, 2]], axis=1)[1])
