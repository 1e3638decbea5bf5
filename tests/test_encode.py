"""ditdata encode: real loading paths, real TAEF2 quality, resume after SIGKILL, torchrun."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from cliutil import ditdata, kill_when, on_one_and_two_ranks, torchrun_or_skip
from PIL import Image
from tiny import class_tree, fetch_tree, real_images, save_ldm, save_tiny_kl, tiny_ldm_kl

from ditdata.cli import main as ditdata_cli
from ditdata.clip import store_text_encoder
from ditdata.encode import EncodeConfig, encode
from ditdata.framing import center_crop, hflip
from ditdata.imageshards import folder as imageshards
from ditdata.store import BFLOAT16, open_store

BIN = Path(sys.executable).parent


def _cli(*args):
    return ditdata(*args, catch_exceptions=False)


def _encode(shards, out, **kw):
    kw.setdefault("workers", 0)
    kw.setdefault("progress", False)
    kw.setdefault("device", "cpu")
    return encode(EncodeConfig(shards=str(shards), out=str(out), **kw))


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """4 real photos x 2 crops as a class dataset, 2 samples per shard (4 shards)."""
    root = tmp_path_factory.mktemp("data")
    return fetch_tree(class_tree(root / "tree", per_class=2), root / "shards", samples_per_shard=2)


@pytest.fixture(scope="module")
def kl_dir(tmp_path_factory) -> Path:
    return save_tiny_kl(tmp_path_factory.mktemp("vae") / "tiny-kl", scaling_factor=0.5)


def test_tiny_kl_through_from_pretrained(shards, kl_dir, tmp_path):
    r = _encode(shards, tmp_path / "s", vae=str(kl_dir), resolution=32, flip=True, batch_size=3)
    assert r["encoded"] == 8 and r["shards_written"] == 4
    store = open_store(tmp_path / "s", verify=True)
    m = store.manifest
    assert m["latent"] == {"shape": [4, 16, 16], "dtype": "float16", "stored": "sample", "flip": True}
    assert m["vae"]["id"] == str(kl_dir.resolve()) and m["vae"]["scaling_factor"] == 0.5
    assert m["vae"]["latent_channels"] == 4 and m["vae"]["downsample"] == 2
    assert m["image"]["resolution"] == 32 and m["image"]["flip"] is True
    assert m["conditioning"]["type"] == "class"
    assert m["conditioning"]["class_names"] == sorted(real_images())
    assert [s["name"] for s in m["shards"]] == ["00000", "00001", "00002", "00003"]
    data = store.read(0)
    assert data["latent"].dtype == np.float16 and data["latent"].shape == (2, 4, 16, 16)
    assert list(data["label"]) == [0, 0] and not np.array_equal(data["latent"], data["latent_flip"])
    assert all(isinstance(k, str) for k in data["key"])
    stats = m["stats"]
    assert stats["count"] == 8 * 16 * 16 and len(stats["mean"]) == 4
    # a posterior sample differs from the mean, a mean+std store keeps both
    _encode(shards, tmp_path / "ms", vae=str(kl_dir), resolution=32, posterior="mean_std", dtype="bfloat16")
    ms = open_store(tmp_path / "ms")
    assert ms.manifest["latent"]["stored"] == "mean_std" and ms.manifest["latent"]["dtype"] == "bfloat16"
    got = ms.read(0)
    assert got["mean"].dtype == BFLOAT16 and (got["std"].astype(np.float32) > 0).all()
    assert not np.allclose(got["mean"].astype(np.float32), data["latent"].astype(np.float32), atol=1e-3)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return 10 * np.log10(255.0**2 / mse)


def test_taef2_real_photos_psnr_and_inspect_decode(taef2_dir, tmp_path):
    tree = tmp_path / "tree"
    for name in ("astronaut", "chelsea", "coffee"):
        (tree / name).mkdir(parents=True)
        Image.fromarray(real_images()[name]).save(tree / name / "0.png")
    shards_dir = fetch_tree(tree, tmp_path / "shards", samples_per_shard=3)
    _encode(shards_dir, tmp_path / "s", vae=str(taef2_dir), resolution=256, flip=True, batch_size=3)
    store = open_store(tmp_path / "s", verify=True)
    assert store.manifest["vae"]["name"] == "taef2" and store.latent_shape == (32, 32, 32)

    from ditdata.autoencoders.kinds import autoencoder_from_manifest

    ae = autoencoder_from_manifest(store.manifest["vae"])
    data = store.read(0)
    import torch

    crops = {s.key: center_crop(s.decode(), 256) for s in imageshards.iter_shard(imageshards.list_shards(shards_dir)[0])}
    figures = {}
    for i, key in enumerate(data["key"]):
        for field, ref in (("latent", crops[key]), ("latent_flip", hflip(crops[key]))):
            z = torch.from_numpy(data[field][i:i + 1].astype(np.float32))
            img = (ae.decode(z)[0].permute(1, 2, 0).numpy() * 255).round().clip(0, 255)
            figures[(key, field)] = _psnr(img, ref)
    # measured: 28.7-32.3 dB (astronaut is the hardest); a random TAEF2 scores < 15 dB
    assert all(v >= 28.0 for v in figures.values()), figures

    out = tmp_path / "peek"
    r = _cli("inspect", tmp_path / "s", "--decode", 3, "--out", out)
    assert r.exit_code == 0 and "decoded 3 samples" in r.output
    pngs = sorted(out.glob("*.png"))
    assert [p.stem for p in pngs] == sorted(data["key"])
    for key in data["key"]:
        assert _psnr(np.asarray(Image.open(out / f"{key}.png")), crops[key]) >= 28.0


def test_ldm_checkpoint_through_the_command(shards, tmp_path):
    """`--vae ldm:CHECKPOINT --vae-config CONFIG`: the stored posterior means are the diffusers
    model's of the same crops, and the manifest records the file's sha256, the architecture and
    that these unscaled latents want channel normalisation (no scale_factor in the config)."""
    import hashlib

    import torch

    model = tiny_ldm_kl(attention=True)
    ckpt, config = save_ldm(model, tmp_path / "vae" / "tokenizer.pt")
    r = _cli("encode", shards, "--vae", f"ldm:{ckpt}", "--vae-config", config, "--resolution", 32, "--out",
             tmp_path / "s", "--posterior", "mean_std", "--workers", 0, "--device", "cpu", "--quiet")
    assert r.exit_code == 0, r.output
    store = open_store(tmp_path / "s", verify=True)
    vae = store.manifest["vae"]
    assert vae["weights_sha256"] == {"tokenizer.pt": hashlib.sha256(ckpt.read_bytes()).hexdigest()}
    assert vae["ldm_config"]["ddconfig"]["attn_resolutions"] == [16] and vae["ldm_config"]["embed_dim"] == 4
    assert (vae["scaling_factor"], vae["shift_factor"], vae["latent_norm"]) == (1.0, 0.0, "channel")
    assert store.latent_shape == (4, 16, 16) and len(store.manifest["stats"]["mean"]) == 4
    data = store.read(0)
    crops = {s.key: center_crop(s.decode(), 32) for s in imageshards.iter_shard(imageshards.list_shards(shards)[0])}
    x = torch.stack([torch.from_numpy(np.asarray(crops[k])).permute(2, 0, 1) for k in data["key"]]).float() / 255
    with torch.no_grad():
        want = model.encode(x * 2 - 1).latent_dist.mean.numpy()
    np.testing.assert_allclose(data["mean"].astype(np.float32), want, rtol=2e-3, atol=2e-3)  # stored fp16
    assert "no published scaling" in _cli("inspect", tmp_path / "s").output
    r = ditdata("encode", shards, "--vae", "pixels", "--vae-config", config, "--out", tmp_path / "p")
    assert r.exit_code != 0 and "--vae-config" in r.output and "goes with --vae ldm:CHECKPOINT" in r.output


def test_missing_hub_vae_fails_fast(shards, tmp_path):
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    t = time.perf_counter()
    r = subprocess.run([BIN / "ditdata", "encode", shards, "--vae", "sd-vae-ft-ema", "--out", tmp_path / "s"],
                       capture_output=True, text=True, env=env, timeout=120)
    elapsed = time.perf_counter() - t
    assert r.returncode == 1
    assert "stabilityai/sd-vae-ft-ema" in r.stderr and "hf download" in r.stderr
    assert "Traceback" not in r.stderr
    assert elapsed < 10, f"took {elapsed:.1f}s: something is retrying the hub"
    assert not (tmp_path / "s" / "manifest.json").exists()


def test_bad_images_are_skipped_and_counted(kl_dir, tmp_path):
    shards_dir = tmp_path / "shards"
    shards_dir.mkdir()
    good = Image.fromarray(real_images()["coffee"])
    import io

    buf = io.BytesIO()
    good.save(buf, "PNG")
    with imageshards.ShardWriter(shards_dir, 0) as w:
        w.write("000000000", buf.getvalue(), "png", {"key": "000000000", "label": 0})
        w.write("000000001", b"not an image at all", "jpg", {"key": "000000001", "label": 0})
        w.write("000000002", buf.getvalue()[: len(buf.getvalue()) // 3], "png", {"key": "000000002", "label": 0})
    imageshards.write_shard_stats(shards_dir, 0, {"count": 3, "successes": 3})
    (shards_dir / "dataset.json").write_text(json.dumps({
        "format": "ditdata-images", "version": 1, "kind": "classes", "num_shards": 1,
        "num_samples": 3, "num_classes": 1, "class_names": ["coffee"]}))
    r = _encode(shards_dir, tmp_path / "s", vae=str(kl_dir), resolution=32)
    assert r["encoded"] == 1 and r["skipped"] == {"not an image": 1, "truncated image": 1}
    store = open_store(tmp_path / "s")
    assert len(store) == 1
    extra = store.shards[0].record["extra"]
    assert extra["skipped"] == {"not an image": 1, "truncated image": 1}
    assert extra["skipped_keys"] == ["000000001", "000000002"]


def test_refuses_other_settings_on_existing_store(shards, kl_dir, tmp_path):
    _encode(shards, tmp_path / "s", vae=str(kl_dir), resolution=32)
    r = CliRunner().invoke(ditdata_cli, ["encode", str(shards), "--vae", str(kl_dir), "--resolution", "64",
                                         "--out", str(tmp_path / "s"), "--device", "cpu", "--workers", "0"])
    assert r.exit_code == 1 and "different settings (fields, image differ)" in r.output


def _checksums(root: Path) -> dict:
    return {s.name: s.record["checksum"] for s in open_store(root, verify=True).shards}


def test_sigkill_then_rerun_equals_clean_run(kl_dir, tmp_path):
    tree = class_tree(tmp_path / "tree", per_class=6)
    shards_dir = fetch_tree(tree, tmp_path / "shards", samples_per_shard=1)  # 24 shards
    args = [BIN / "ditdata", "encode", shards_dir, "--vae", kl_dir, "--resolution", "64",
            "--device", "cpu", "--workers", "1", "--batch-size", "1"]
    proc = subprocess.Popen([*args, "--out", tmp_path / "s"], stderr=subprocess.DEVNULL)
    records = tmp_path / "s" / "shards"
    kill_when(proc, lambda: len(list(records.glob("*.json"))) >= 3, timeout=120,
              too_late="encode finished before it could be killed")
    done = len(list(records.glob("*.json")))
    assert 3 <= done < 24 and not (tmp_path / "s" / "manifest.json").exists()

    r = subprocess.run([*args, "--out", tmp_path / "s"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "already done" in r.stdout
    subprocess.run([*args, "--out", tmp_path / "clean"], check=True, capture_output=True)
    assert _checksums(tmp_path / "s") == _checksums(tmp_path / "clean")
    assert open_store(tmp_path / "s").verify() == []


def test_torchrun_two_ranks_equal_single_process(shards, kl_dir, tmp_path):
    torchrun_or_skip()
    common = ["--vae", kl_dir, "--resolution", "32", "--device", "cpu", "--workers", "0", "--flip"]
    # torchrun sets OMP_NUM_THREADS=1; CPU convolutions round differently with another thread
    # count, so the single-process run uses one thread too and the bytes must then match.
    on_one_and_two_ranks("ditdata", ["encode", shards, "--out", tmp_path / "single", *common],
                         ["encode", shards, "--out", tmp_path / "multi", *common], timeout=300)
    single, multi = open_store(tmp_path / "single"), open_store(tmp_path / "multi", verify=True)
    assert _checksums(tmp_path / "single") == _checksums(tmp_path / "multi")
    assert single.manifest["stats"] == multi.manifest["stats"]
    assert multi.manifest["num_samples"] == 8


def test_pixels_autoencoder_keeps_the_image(shards, tmp_path):
    _encode(shards, tmp_path / "s", vae="pixels", resolution=16, dtype="float16")
    store = open_store(tmp_path / "s")
    assert store.latent_shape == (3, 16, 16)
    data = store.read(0)
    first = next(imageshards.iter_shard(imageshards.list_shards(shards)[0]))
    ref = center_crop(first.decode(), 16).astype(np.float32) / 127.5 - 1
    np.testing.assert_allclose(data["latent"][0].astype(np.float32), ref.transpose(2, 0, 1), atol=2e-3)
    shutil.rmtree(tmp_path / "s")


def test_score_filter_encode_select_with_text(tmp_path):
    """End to end on captioned shards: score -> filter -> encode --select stores exactly the
    selected keys, their CLIP scores, text embeddings, and the filter in the manifest."""
    pytest.importorskip("open_clip")
    from test_clip import tiny_clip_files
    from test_score import caption_shards

    from ditdata.clip import load_clip
    from ditdata.imageshards.selections import load_selection

    config, weights = tiny_clip_files(tmp_path / "clip")
    shards_dir = caption_shards(tmp_path / "shards")
    clip = ["--clip", "tiny-clip", "--clip-config", config, "--pretrained", weights]
    assert _cli("score", shards_dir, *clip, "--device", "cpu").exit_code == 0
    r = _cli("filter", shards_dir, "--top-fraction", "0.5", "--out", tmp_path / "keep.parquet")
    assert r.exit_code == 0, r.output
    selection = load_selection(tmp_path / "keep.parquet")
    assert 0 < len(selection.keys) < 12

    r = _cli("encode", shards_dir, "--vae", "pixels", "--resolution", "16", "--out", tmp_path / "s",
             "--select", tmp_path / "keep.parquet", "--text-encoder", "tiny-clip", "--text-config", config,
             "--text-pretrained", weights, "--text-tokens", "--device", "cpu", "--workers", "0")
    assert r.exit_code == 0, r.output
    store = open_store(tmp_path / "s", verify=True)
    m = store.manifest
    keys = [k for i in range(len(store.shards)) for k in store.read(i, fields=["key"])["key"]]
    assert sorted(keys) == sorted(selection.keys)
    assert m["filter"]["top_fraction"] == 0.5 and m["filter"]["kept"] == len(selection.keys)
    text = m["conditioning"]["text"]
    assert m["conditioning"]["type"] == "text" and text["pooled_dim"] == 32
    assert text["tokens_shape"] == [77, 32] and set(store.empty_caption()) == {"text_pooled", "text_tokens", "text_mask"}

    clip_model = load_clip("tiny-clip", str(weights), config=str(config))
    data = store.read(0)
    want = clip_model.embed_text(list(data["caption"]), tokens=True)
    np.testing.assert_allclose(data["text_pooled"].astype(np.float32), want["text_pooled"].numpy(), atol=2e-3)
    assert np.array_equal(data["text_mask"], want["text_mask"].numpy())
    scores = pq_scores(shards_dir)
    for key, s in zip(data["key"], data["clip_score"], strict=True):
        assert s == pytest.approx(scores[key])
    # the store can rebuild its own text encoder (what `dittrain sample --prompt` uses)
    emb = store_text_encoder(store).embed_text([""])["text_pooled"].numpy()[0]
    np.testing.assert_allclose(store.empty_caption()["text_pooled"].astype(np.float32), emb, atol=2e-3)


def pq_scores(shards_dir: Path) -> dict:
    import pyarrow.parquet as pq

    out = {}
    for p in sorted(shards_dir.glob("*.clip.parquet")):
        t = pq.read_table(p, columns=["key", "clip_score"])
        out |= dict(zip(t.column("key").to_pylist(), t.column("clip_score").to_pylist(), strict=True))
    return out
