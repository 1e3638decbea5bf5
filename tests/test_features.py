"""ditdata features and encode --features: representation targets in the latent store.

A tiny random DINOv2 (transformers' own Dinov2Config, saved with save_pretrained) goes
through the real loader by path; python:MODULE:FUNCTION encoders are written to tmp. The
stores are made from the real photos of conftest's class_shards with `encode --vae pixels`.
"""

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
import torch
from cliutil import ditdata, dittrain, kill_when, ok, on_one_and_two_ranks, one_error_line, run_args, torchrun_or_skip

from ditdata.common.files import state_dict_sha256
from ditdata.encode import EncodeConfig, encode
from ditdata.features import FeaturesConfig, compute_features, default_feature_set_name
from ditdata.features.encoders import IMAGENET_MEAN, IMAGENET_STD, load_encoder
from ditdata.framing import center_crop
from ditdata.imageshards import folder as imageshards
from ditdata.store import dequantize, open_store
from ditdata.store.features import open_features

BIN = Path(sys.executable).parent
RES = 64  # store resolution: the tiny DINOv2 (patch 4) then sees (64 // 16) * 4 = 16 px, 4x4 tokens
WIDTH = 32


POS_GRID = 6  # the tiny DINOv2's position grid (24 px / patch 4), resampled to the 4x4 token grid at load


def save_tiny_dinov2(path: Path, *, registers: int = 0, seed: int = 0) -> Path:
    """A random DINOv2 (hidden 32, 2 layers, 2 heads, patch 4; positions for 24 px, a 6x6 grid, as
    the real ones are for 518 px and run at 224) saved with save_pretrained."""
    import transformers

    kw = dict(hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
              patch_size=4, image_size=4 * POS_GRID)
    torch.manual_seed(seed)
    if registers:
        model = transformers.Dinov2WithRegistersModel(transformers.Dinov2WithRegistersConfig(
            num_register_tokens=registers, **kw))
    else:
        model = transformers.Dinov2Model(transformers.Dinov2Config(**kw))
    transformers.utils.logging.disable_progress_bar()
    model.eval().save_pretrained(str(path))
    return path


PY_ENCODER = '''
import time
import torch

class Patches(torch.nn.Module):
    """8x8 patches of the image, linearly mapped to 12 dims: (N, 16, 12) at 32 px."""
    resolution = 32
    grid = (4, 4)

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.proj = torch.nn.Parameter(torch.randn(3 * 64, 12, generator=g))

    def forward(self, x):
        n = x.shape[0]
        p = x.unfold(2, 8, 8).unfold(3, 8, 8)  # (N, 3, 4, 4, 8, 8)
        p = p.permute(0, 2, 3, 1, 4, 5).reshape(n, 16, 3 * 64)
        return p @ self.proj

class Slow(Patches):
    calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > 13:  # after the probe and the calibration (12 images): slow enough to be killed mid-way
            time.sleep(0.2)
        return super().forward(x)

def make():
    return Patches()

make_slow = Slow  # any callable that returns the module will do, a class too
'''


@pytest.fixture(scope="module")
def dino(tmp_path_factory) -> Path:
    return save_tiny_dinov2(tmp_path_factory.mktemp("dino") / "tiny-dinov2")


@pytest.fixture(scope="module")
def py_encoder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pyenc") / "patch_encoder.py"
    path.write_text(PY_ENCODER)
    return path


def _encode(shards, out, **kw) -> dict:
    kw = {"vae": "pixels", "resolution": RES, "workers": 0, "progress": False, "device": "cpu", **kw}
    return encode(EncodeConfig(shards=str(shards), out=str(out), **kw))


def _features(store, encoder, **kw) -> dict:
    kw = {"workers": 0, "progress": False, "device": "cpu", "batch_size": 3, **kw}
    return compute_features(FeaturesConfig(store=str(store), encoder=str(encoder), **kw))


def _copy(store: Path, to: Path) -> Path:
    shutil.copytree(store, to)
    return to


def _crops(shards: Path) -> dict[str, np.ndarray]:
    return {s.key: center_crop(s.decode(), RES) for t in imageshards.list_shards(shards)
            for s in imageshards.iter_shard(t)}


def _reference(model_dir: Path, images: np.ndarray, *, resize: str = "reference") -> np.ndarray:
    """The tiny DINOv2's patch tokens of (B, N, N, 3) uint8 images, computed here from scratch.

    reference: as REPA (sihyun-yu/REPA@67f7145): utils.py load_encoders resamples the position
    embeddings once to the token grid (timm's resample_abs_pos_embed: bicubic, antialiased, the
    class token kept); train.py preprocess_raw_image takes x / 255, normalises with the ImageNet
    mean and std, then F.interpolate(..., mode='bicubic'): no antialias, no clamp; the tokens are
    x_norm_patchtokens, the patch tokens after the final norm. antialias: ditkit's earlier rule
    (antialiased, clamped resize, then the normalisation; transformers interpolates the positions)."""
    import torch.nn.functional as F
    import transformers

    model = transformers.Dinov2Model.from_pretrained(str(model_dir)).eval()
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    x = torch.as_tensor(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 255
    if resize == "reference":
        pos = model.embeddings.position_embeddings.data  # (1, 1 + 6*6, 32)
        grid = pos[:, 1:].reshape(1, POS_GRID, POS_GRID, WIDTH).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(4, 4), mode="bicubic", align_corners=False, antialias=True)
        model.embeddings.position_embeddings.data = torch.cat([pos[:, :1], grid.flatten(2).transpose(1, 2)], 1)
        x = F.interpolate((x - mean) / std, size=(16, 16), mode="bicubic", align_corners=False)
    else:
        x = F.interpolate(x, size=(16, 16), mode="bicubic", antialias=True, align_corners=False).clamp(0, 1)
        x = (x - mean) / std
    with torch.no_grad():
        return model(pixel_values=x).last_hidden_state[:, 1:].numpy()


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in ("manifest.json",)}


# --------------------------------------------------------------------------- the feature set


def test_a_feature_set_beside_the_latents(flip_store, class_shards, dino, tmp_path):
    store = _copy(flip_store, tmp_path / "s")
    before = open_store(store)
    latents = _files(store / "shards")
    r = _features(store, dino, out_name="dino", dtype="fp16")
    assert r["written"] == 4 and r["already"] == 0 and r["manifest"]["num_samples"] == 8
    after = open_store(store, verify=True)
    assert after.identity == before.identity and _files(store / "shards") == latents
    fs = open_features(after, "dino", verify=True)
    assert fs.verify() == []
    enc = fs.encoder
    assert enc["id"] == enc["name"] == str(dino.resolve()) and enc["kind"] == "dinov2"
    assert (enc["resolution"], enc["patch"], enc["grid"], enc["tokens"], enc["dim"]) == (16, 4, [4, 4], 16, WIDTH)
    assert list(enc["weights_sha256"]) == ["model.safetensors"] and enc["library"] == "transformers"
    assert enc["library_version"] and enc["dropped_tokens"] == 1
    assert enc["resize"] == "bicubic, not antialiased, not clamped (REPA's preprocess_raw_image)"
    assert enc["position_embeddings"].startswith(f"{POS_GRID}x{POS_GRID} resampled to 4x4 once at load")
    assert fs.storage["dtype"] == "float16" and fs.storage["pca"] is None and fs.flip
    assert fs.storage["cosine_to_fp32"] > 0.9999
    # rows: the store's keys in its order; feat_flip is the encoder's output of the mirror image
    crops = _crops(class_shards)
    for shard in after.shards:
        keys = after.read(shard, ["key"])["key"].tolist()
        got = fs.read(shard.name)
        assert got["key"].tolist() == keys
        imgs = np.stack([crops[k] for k in keys])
        np.testing.assert_allclose(got["feat"].astype(np.float32), _reference(dino, imgs), atol=2e-3, rtol=2e-3)
        np.testing.assert_allclose(got["feat_flip"].astype(np.float32), _reference(dino, imgs[:, :, ::-1]),
                                   atol=2e-3, rtol=2e-3)
        assert not np.allclose(got["feat"], got["feat_flip"], atol=1e-2)
    featured = open_store(store, features="dino")
    assert featured.identity == before.identity and "feat_flip" in featured.read(0)


def test_the_preprocessing_is_repas_and_antialias_is_the_earlier_rule(dino):
    """REPA's train.py preprocess_raw_image ('dinov2'): x / 255, Normalize(ImageNet), then
    F.interpolate(x, 224 * (resolution // 256), mode='bicubic'); at REPA's own ratio, 256 -> 224."""
    import torch.nn.functional as F

    from ditdata.config import FEATURE_RESOLUTION_RULE

    assert FEATURE_RESOLUTION_RULE == "(store resolution // 16) * patch"  # 256 // 16 * 14 = 224 * (256 // 256)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, 3, 256, 256), generator=g, dtype=torch.uint8).float() / 255
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    ref = load_encoder(str(dino), 256, resolution=224)
    got = ref.preprocess(x.clone())
    want = F.interpolate((x - mean) / std, size=(224, 224), mode="bicubic", align_corners=False)
    assert got.shape == (2, 3, 224, 224)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    # not clamped: bicubic overshoots the normalised image of [0, 1] (noise has edges everywhere)
    lo, hi = (0 - mean) / std, (1 - mean) / std
    assert (got < lo - 0.05).any() and (got > hi + 0.05).any()
    old = load_encoder(str(dino), 256, resolution=224, resize="antialias").preprocess(x.clone())
    earlier = (F.interpolate(x, size=(224, 224), mode="bicubic", antialias=True, align_corners=False)
               .clamp(0, 1) - mean) / std
    torch.testing.assert_close(old, earlier, atol=1e-6, rtol=0)
    assert (old - got).abs().max() > 0.1  # the two rules differ where it shows
    # at the encoder's own size nothing is resized, either way
    same = torch.rand(1, 3, 224, 224, generator=g)
    torch.testing.assert_close(ref.preprocess(same.clone()), (same - mean) / std)


def test_position_embeddings_are_resampled_as_repa_does(tmp_path):
    """REPA's utils.py load_encoders: timm.layers.pos_embed.resample_abs_pos_embed(pos_embed,
    [16, 16]) once at load (its defaults: bicubic, antialiased, the class token kept), for the
    plain and the register DINOv2s; "antialias" leaves transformers' own per-call interpolation."""
    import transformers

    timm_pos = pytest.importorskip("timm.layers.pos_embed")
    for registers in (0, 4):
        path = save_tiny_dinov2(tmp_path / f"d{registers}", registers=registers)
        cls = transformers.Dinov2WithRegistersModel if registers else transformers.Dinov2Model
        pretrained = cls.from_pretrained(str(path)).embeddings.position_embeddings.data
        assert pretrained.shape == (1, 1 + POS_GRID ** 2, WIDTH)
        enc = load_encoder(str(path), RES)
        pos = enc.net.model.embeddings.position_embeddings.data
        want = timm_pos.resample_abs_pos_embed(pretrained, [4, 4], num_prefix_tokens=1)
        assert pos.shape == (1, 17, WIDTH)
        torch.testing.assert_close(pos, want, atol=1e-6, rtol=0)
        x = torch.rand(2, 3, RES, RES, generator=torch.Generator().manual_seed(registers))
        with torch.no_grad():
            ours = enc(x)
            model = cls.from_pretrained(str(path)).eval()
            model.embeddings.position_embeddings.data = want
            by_hand = model(pixel_values=enc.preprocess(x.clone())).last_hidden_state[:, 1 + registers:]
            plain = cls.from_pretrained(str(path)).eval()(pixel_values=enc.preprocess(x.clone()))
        torch.testing.assert_close(ours, by_hand, atol=1e-5, rtol=1e-5)
        if not registers:  # transformers' Dinov2Model interpolates without antialias: other tokens
            assert (ours - plain.last_hidden_state[:, 1:]).abs().max() > 1e-3
        old = load_encoder(str(path), RES, resize="antialias")
        assert "position_embeddings" not in old.info
        assert old.net.model.embeddings.position_embeddings.shape == pretrained.shape


def test_the_tokens_are_after_the_final_norm(dino):
    """REPA aligns to DINOv2's x_norm_patchtokens: norm(x) without the class (and register)
    tokens. transformers' last_hidden_state is layernorm(the last block's output)."""
    enc = load_encoder(str(dino), RES)
    model = enc.net.model
    x = enc.preprocess(torch.rand(2, 3, RES, RES, generator=torch.Generator().manual_seed(3)))
    with torch.no_grad():
        out = model(pixel_values=x, output_hidden_states=True)
        normed = model.layernorm(out.hidden_states[-1])[:, 1:]
        torch.testing.assert_close(enc.net(x), normed, atol=1e-6, rtol=0)
        assert (out.hidden_states[-1][:, 1:] - normed).abs().max() > 0.1


def _half_written(made: Path, into: Path, name: str, keep: int) -> None:
    """Feature set `name` of store `into` as a killed run of the one in `made` left it: its
    config and its first `keep` finished shards, no manifest (the stores are copies of one)."""
    src, dst = made / "features" / name, into / "features" / name
    (dst / "shards").mkdir(parents=True)
    shutil.copy2(src / "config.json", dst / "config.json")
    for shard in sorted((src / "shards").glob("*.json"))[:keep]:
        for part in src.joinpath("shards").glob(shard.stem + ".*"):
            (shutil.copytree if part.is_dir() else shutil.copy2)(part, dst / "shards" / part.name)


def test_a_set_begun_with_the_earlier_resize_is_finished_with_it_never_mixed(flip_store, class_shards, dino,
                                                                              tmp_path):
    whole = _copy(flip_store, tmp_path / "whole")
    args = ["--encoder", dino, "--out-name", "d", "--features-dtype", "fp16", "--device", "cpu", "--workers", 0,
            "--batch-size", 3, "-q"]
    ok(ditdata("features", whole, *args, "--features-resize", "antialias"))
    fs = open_features(open_store(whole), "d")
    # what every set made before the choice records, byte for byte (a resume compares records)
    assert fs.encoder["resize"] == "bicubic, antialiased, clamped to [0, 1]"
    assert "position_embeddings" not in fs.encoder
    assert fs.manifest["provenance"]["features"]["resize"] == "antialias"
    s, crops = open_store(whole), _crops(class_shards)
    keys = s.read(0, ["key"])["key"].tolist()
    imgs = np.stack([crops[k] for k in keys])
    got = fs.read(s.shards[0].name)["feat"].astype(np.float32)
    np.testing.assert_allclose(got, _reference(dino, imgs, resize="antialias"), atol=2e-3, rtol=2e-3)
    assert np.abs(got - _reference(dino, imgs)).max() > 0.05  # the two rules give other targets
    # a run killed after 2 of its 4 shards: the default (reference) refuses to mix, naming the way on
    half = _copy(flip_store, tmp_path / "half")
    _half_written(whole, half, "d", keep=2)
    line = one_error_line(ditdata("features", half, *args).output)
    assert "begun with --features-resize antialias" in line and "finish it with --features-resize antialias" in line
    assert len(list((half / "features" / "d" / "shards").glob("*.json"))) == 2
    # encode --features says the same, before any work
    store = tmp_path / "enc"
    _encode(class_shards, store, flip=True)
    _half_written(whole, store, "d", keep=2)
    r = ditdata("encode", class_shards, "--out", store, "--vae", "pixels", "--resolution", RES, "--flip",
                "--features", dino, "--features-out-name", "d", "--features-dtype", "fp16", "--batch-size", 3,
                "--workers", 0, "--device", "cpu", "-q")
    assert "finish it with --features-resize antialias" in one_error_line(r.output)
    # finished with its own rule: the bytes of the uninterrupted run
    ok(ditdata("features", half, *args, "--features-resize", "antialias"), "(2 already done)")
    a, b = _files(whole / "features"), _files(half / "features")
    assert a == b and len(a) > 4


def test_int8_is_close_to_fp32_and_the_default(flip_store, dino, tmp_path):
    store = _copy(flip_store, tmp_path / "s")
    _features(store, dino)  # default name: the directory's name; default dtype: int8
    name = default_feature_set_name(str(dino))
    assert name == "tiny-dinov2"
    fs = open_features(open_store(store), name)
    assert fs.schema.tensors["feat"].dtype == "int8" and "feat_flip_scale" in fs.schema.tensors
    assert fs.storage["cosine_to_fp32"] >= 0.999 and fs.storage["rounding_cosine"] >= 0.999
    s = open_store(store)
    data = fs.read(s.shards[0].name)
    keys = s.read(0, ["key"])["key"].tolist()
    ref = load_encoder(str(dino), RES)
    crops = _crops(Path(s.manifest["provenance"]["shards_dir"]))
    x = torch.as_tensor(np.stack([crops[k] for k in keys])).permute(0, 3, 1, 2).float() / 255
    with torch.no_grad():
        want = ref(x).numpy()
    got = dequantize(data["feat"], data["feat_scale"])
    cos = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.min() >= 0.999


def test_pca_is_recorded_and_reconstructs(flip_store, dino, tmp_path):
    from ditdata.features.pca import reconstruct

    store = _copy(flip_store, tmp_path / "s")
    _features(store, dino, out_name="pca", dims=8, dtype="fp16")
    fs = open_features(open_store(store), "pca")
    p = fs.pca()
    assert fs.dims == 8 and p["components"].shape == (8, WIDTH) and p["mean"].shape == (WIDTH,)
    assert p["fit_samples"] == 8 and p["fit_tokens"] == 8 * 16 and 0 < p["explained_variance"] < 1
    np.testing.assert_allclose(p["components"] @ p["components"].T, np.eye(8), atol=1e-5)
    # the stored 8 dims reconstruct the encoder's tokens as well as the explained variance says
    s = open_store(store)
    crops = _crops(Path(s.manifest["provenance"]["shards_dir"]))
    feats, want = [], []
    enc = load_encoder(str(dino), RES)
    for shard in s.shards:
        keys = s.read(shard, ["key"])["key"].tolist()
        x = torch.as_tensor(np.stack([crops[k] for k in keys])).permute(0, 3, 1, 2).float() / 255
        with torch.no_grad():
            want.append(enc(x).numpy())
        feats.append(fs.read(shard.name, ["feat"])["feat"].astype(np.float32))
    want, rec = np.concatenate(want), reconstruct(np.concatenate(feats), p)
    centred = want - want.reshape(-1, WIDTH).mean(0)
    kept = 1 - ((rec - want) ** 2).sum() / (centred ** 2).sum()
    assert abs(kept - p["explained_variance"]) < 0.02
    assert 0.5 < fs.storage["cosine_to_fp32"] < 1


def test_a_pca_set_trains_repa_against_the_rebuilt_tokens(flip_store, dino, tmp_path):
    """`ditdata features --features-dims 8`, then `dittrain run --repa`: the projector maps to the
    encoder's 32 dims and the run records that it rebuilds them; the cosine the set records is
    that of the rebuilt tokens to the fp32 ones, i.e. of what is aligned."""
    from dittrain.rundir import latest_checkpoint, load_checkpoint

    store = _copy(flip_store, tmp_path / "s")
    _features(store, dino, out_name="pca", dims=8, dtype="fp16")
    fs = open_features(open_store(store), "pca")
    r = dittrain(*run_args(store, tmp_path / "r", "--max-steps", 1, "--batch-size", 4, "--repa", "pca",
                           "--repa-depth", 1, "--repa-projector-dim", 16, "--repa-min-cosine", 0, "--logger", "jsonl"))
    assert r.exit_code == 0, r.output
    assert f"8 dims float16, rebuilt to the encoder's {WIDTH} dims from its PCA" in r.output
    assert tuple(load_checkpoint(latest_checkpoint(tmp_path / "r"))["projector"]["4.weight"].shape) == (WIDTH, 16)
    record = json.loads((tmp_path / "r" / "config.json").read_text())["store"]["features"]
    assert (record["targets"], record["target_dims"]) == ("reconstructed", WIDTH)
    # the recorded cosine, by hand: the first samples' stored coordinates rebuilt vs the fp32 tokens
    s, p = open_store(store), fs.pca()
    crops, enc = _crops(Path(s.manifest["provenance"]["shards_dir"])), load_encoder(str(dino), RES)
    got, want = [], []
    for shard in s.shards:
        keys = s.read(shard, ["key"])["key"].tolist()
        with torch.no_grad():
            want.append(enc(torch.as_tensor(np.stack([crops[k] for k in keys])).permute(0, 3, 1, 2).float() / 255))
        got.append(fs.read(shard.name, ["feat"])["feat"].astype(np.float64) @ p["components"] + p["mean"])
    a, b = np.concatenate(got).reshape(-1, WIDTH), torch.cat(want).numpy().reshape(-1, WIDTH)
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert fs.storage["cosine_to_fp32"] == pytest.approx(cos.mean(), abs=1e-3)


def test_inspect_and_verify_cover_feature_sets(flip_store, dino, tmp_path):
    store = _copy(flip_store, tmp_path / "s")
    plain = ok(ditdata("inspect", store)).output
    assert "features:" not in plain
    assert ok(ditdata("verify", store, "-q")).output.strip().endswith("OK (8 samples verified)")
    _features(store, dino, out_name="d8", dims=8)
    out = ok(ditdata("inspect", store)).output
    line = next(ln for ln in out.splitlines() if ln.startswith("features:"))
    assert "d8: " in line and "16 x 8 int8" in line and f"PCA {WIDTH} -> 8" in line and "% of the variance" in line
    assert "8 rows" in line and f"{2 * (16 * 8 + 16 * 4)} bytes/sample" in line
    assert "feature sets d8" in ok(ditdata("verify", store, "-q")).output
    # a corrupted feature file is found, naming it
    chunk = next(p for p in sorted((store / "features" / "d8" / "shards" / "00000.zarr" / "feat" / "c").rglob("*"))
                 if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    r = ditdata("verify", store, "-q")
    assert r.exit_code == 1 and "checksum mismatch" in r.output and "features/d8" in r.output, r.output


def test_python_encoder_and_its_digest(flip_store, py_encoder, tmp_path):
    store = _copy(flip_store, tmp_path / "s")
    r = ok(ditdata("features", store, "--encoder", f"python:{py_encoder}:make", "--workers", 0, "-q",
                   "--device", "cpu"))
    assert "feature set make (" in r.output and "16 tokens x 12 int8" in r.output and "with flips" in r.output
    fs = open_features(open_store(store), "make")
    enc = fs.encoder
    assert (enc["resolution"], enc["grid"], enc["patch"], enc["dim"], enc["kind"]) == (32, [4, 4], 8, 12, "python")
    import importlib.util

    spec = importlib.util.spec_from_file_location("pe", py_encoder)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert enc["weights_sha256"] == {"state_dict": state_dict_sha256(mod.make().state_dict())}
    assert fs.verify() == []


def test_a_killed_run_resumes_to_the_same_bytes(tmp_path, py_encoder):
    from tiny import class_tree, fetch_tree

    shards = fetch_tree(class_tree(tmp_path / "tree", per_class=3, size=40), tmp_path / "shards",
                        samples_per_shard=1)  # 12 shards
    _encode(shards, tmp_path / "a", flip=True)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    args = [BIN / "ditdata", "features", "--encoder", f"python:{py_encoder}:make_slow", "--device", "cpu",
            "--workers", "1", "--batch-size", "1", "--out-name", "f"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    clean = subprocess.Popen([*args[:2], tmp_path / "b", *args[2:]], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=env)  # the uninterrupted run, meanwhile
    proc = subprocess.Popen([*args[:2], tmp_path / "a", *args[2:]], stderr=subprocess.DEVNULL, env=env)
    records = tmp_path / "a" / "features" / "f" / "shards"
    kill_when(proc, lambda: len(list(records.glob("*.json"))) >= 3, timeout=120,
              too_late="features finished before it could be killed")
    assert len(list(records.glob("*.json"))) < 12 and not (records.parent / "manifest.json").exists()
    r = subprocess.run([*args[:2], tmp_path / "a", *args[2:]], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "already done" in r.stdout and "(0 already done)" not in r.stdout
    assert clean.wait(timeout=120) == 0
    a, b = _files(tmp_path / "a" / "features"), _files(tmp_path / "b" / "features")
    assert a == b and len(a) > 12
    m = [json.loads((tmp_path / d / "features" / "f" / "manifest.json").read_text()) for d in "ab"]
    assert [{k: v for k, v in x.items() if k != "provenance"} for x in m][0] == \
        [{k: v for k, v in x.items() if k != "provenance"} for x in m][1]


def test_encode_with_features_equals_features_afterwards(class_shards, dino, tmp_path):
    r = _encode(class_shards, tmp_path / "in", flip=True, batch_size=3, features=str(dino),
                features_out_name="dino", features_dtype="fp16")
    assert r["features"]["written"] == 4 and r["features"]["manifest"]["num_samples"] == 8
    _encode(class_shards, tmp_path / "after", flip=True, batch_size=3)
    _features(tmp_path / "after", dino, out_name="dino", dtype="fp16", batch_size=3)
    a, b = open_store(tmp_path / "in", features="dino"), open_store(tmp_path / "after", features="dino")
    assert a.identity == b.identity and a.feature_set.identity == b.feature_set.identity
    for s in a.shards:
        x, y = a.read(s), b.read(s)
        assert x["key"].tolist() == y["key"].tolist()
        np.testing.assert_array_equal(x["feat"], y["feat"])
        np.testing.assert_array_equal(x["feat_flip"], y["feat_flip"])
    # a rerun finds everything done; the CLI's line names the feature set
    out = ok(ditdata("encode", class_shards, "--out", tmp_path / "in", "--vae", "pixels", "--resolution", RES,
                     "--flip", "--features", dino, "--features-out-name", "dino", "--features-dtype", "fp16",
                     "--batch-size", 3, "--workers", 0, "--device", "cpu", "-q")).output
    assert "feature set dino" in out and "this run wrote 0 shards (4 already done)" in out


@pytest.mark.parametrize("backend", ["zarr", "wds"])
def test_encode_features_drops_the_rows_encode_drops(class_shards, py_encoder, tmp_path, monkeypatch, backend):
    import ditdata.encode as enc_mod

    real = enc_mod._finite_rows

    def drop_first(arrays):  # as if the first sample of every batch had a non-finite latent
        ok_rows = real(arrays)
        ok_rows[0] = False
        return ok_rows

    monkeypatch.setattr(enc_mod, "_finite_rows", drop_first)
    _encode(class_shards, tmp_path / "s", features=f"python:{py_encoder}:make", features_out_name="p",
            backend=backend)
    s = open_store(tmp_path / "s", features="p")
    assert len(s) == 4
    for shard in s.shards:
        data = s.read(shard)
        assert data["key"].tolist() == s.base.read(shard, ["key"])["key"].tolist() and len(data["feat"]) == 1
    assert s.verify() == []


# --------------------------------------------------------------------------- failures


def test_a_hub_model_not_in_the_cache_fails_fast(flip_store, tmp_path):
    store = _copy(flip_store, tmp_path / "s")
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    t = time.perf_counter()
    r = subprocess.run([BIN / "ditdata", "features", store, "--encoder", "dinov2-vits14"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and time.perf_counter() - t < 30
    line = one_error_line(r.stderr)
    assert "facebook/dinov2-small" in line and "hf download facebook/dinov2-small" in line
    assert not (store / "features").exists()


def test_register_tokens_are_dropped(flip_store, tmp_path):
    reg = save_tiny_dinov2(tmp_path / "reg", registers=4)
    enc = load_encoder(str(reg), RES)
    assert enc.info["dropped_tokens"] == 5 and enc.info["kind"] == "dinov2_with_registers"
    with torch.no_grad():
        assert tuple(enc(torch.rand(2, 3, RES, RES)).shape) == (2, 16, WIDTH)


@pytest.mark.parametrize("args, needle", [
    (["--encoder", "no-such-encoder"], "unknown feature encoder 'no-such-encoder'"),
    (["--encoder", "DINO", "--features-resolution", "18"], "not a multiple of"),
    (["--encoder", "DINO", "--features-dims", "33"], "has 32 dims"),
    (["--encoder", "python:nope"], "python:MODULE:FUNCTION"),
    (["--encoder", "python:no_such_module_here:f"], "cannot import no_such_module_here"),
    (["--encoder", "DINO", "--out-name", "bad name"], "feature set name"),
    (["--encoder", "DINO", "--shards", "MISSING"], "no such directory"),
])
def test_cli_errors_are_one_line(flip_store, dino, tmp_path, args, needle):
    store = _copy(flip_store, tmp_path / "s")
    args = [str(dino) if a == "DINO" else str(tmp_path / "missing") if a == "MISSING" else a for a in args]
    r = ditdata("features", store, *args, "--device", "cpu", "--workers", 0, "-q")
    assert r.exit_code != 0
    assert needle in one_error_line(r.output)


def test_rows_that_do_not_match_the_image_shards(flip_store, class_shards, dino, tmp_path):
    store = _copy(flip_store, tmp_path / "s")
    other = tmp_path / "other"
    shutil.copytree(class_shards, other)
    first = imageshards.list_shards(other)[0]
    import tarfile

    with tarfile.open(first) as t:
        members = [(m, t.extractfile(m).read()) for m in t.getmembers()]
    with tarfile.open(first, "w") as t:  # the same tar with its first sample renamed
        import io

        for m, data in members:
            m.name = m.name.replace(members[0][0].name.split(".")[0], "renamed", 1)
            t.addfile(m, io.BytesIO(data))
    r = ditdata("features", store, "--encoder", dino, "--shards", other, "--device", "cpu", "--workers", 0, "-q")
    assert "rows do not match" in one_error_line(r.output)


def test_encode_features_options_need_features(class_shards, tmp_path):
    r = ditdata("encode", class_shards, "--out", tmp_path / "s", "--vae", "pixels", "--features-dims", 8)
    assert "need --features" in one_error_line(r.output)


def test_one_writer_per_store(flip_store, py_encoder, tmp_path):
    from ditdata.common.lock import DirLock

    store = _copy(flip_store, tmp_path / "s")
    with DirLock(store, "ditdata encode"):
        r = ditdata("features", store, "--encoder", f"python:{py_encoder}:make", "--device", "cpu", "-q")
    assert "ditdata encode" in one_error_line(r.output)
    assert not (store / "features").exists()


def test_options_from_a_config_file(flip_store, py_encoder, tmp_path):
    store = _copy(flip_store, tmp_path / "s")
    cfg = tmp_path / "features.toml"
    cfg.write_text(f'encoder = "python:{py_encoder}:make"\nout-name = "from-file"\nfeatures-dtype = "fp16"\n'
                   'workers = 0\ndevice = "cpu"\n')
    ok(ditdata("features", store, "--config", cfg, "--batch-size", 2, "-q"), "feature set from-file")
    fs = open_features(open_store(store), "from-file")
    assert fs.schema.tensors["feat"].dtype == "float16"
    assert fs.manifest["provenance"]["features"]["batch_size"] == 2


def test_a_note_when_int8_loses_more_than_it_should():
    from ditdata.features.targets import storage_notes

    assert storage_notes({"dtype": "int8", "rounding_cosine": 0.9999}) == []
    (note,) = storage_notes({"dtype": "int8", "rounding_cosine": 0.99})
    assert "0.99000" in note and "--features-dtype fp16" in note
    assert storage_notes({"dtype": "float16", "rounding_cosine": 0.9}) == []


@pytest.mark.slow
def test_torchrun_two_ranks_equal_one_process(flip_store, py_encoder, tmp_path):
    torchrun_or_skip()
    one, two = _copy(flip_store, tmp_path / "one"), _copy(flip_store, tmp_path / "two")
    common = ["--encoder", f"python:{py_encoder}:make", "--device", "cpu", "--workers", "0", "--out-name", "f",
              "--batch-size", "1"]
    r = on_one_and_two_ranks("ditdata", ["features", one, *common], ["features", two, *common], timeout=300)
    assert r.stdout.count("feature set f (") == 1  # rank 0's line only
    assert _files(one / "features") == _files(two / "features")
    assert open_features(open_store(two), "f").verify() == []
