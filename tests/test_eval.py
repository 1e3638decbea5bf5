"""dittrain/eval/ and `dittrain eval`: ADM's FID / sFID / IS / precision-recall on a randomly
initialised Inception loaded through the real loading path, with real photos.

Costs on this CPU: ~0.1 s per image through the network and ~10 s per 2048 x 2048 scipy
sqrtm (every FID / sFID of dittrain.eval pays one), so the sets are small (24 crops of
64 px), features are computed once per module, and only three FIDs go through sqrtm: the
self-FID and the command's FID and sFID. The independent formula below (`direct_fid`, an
eigenvalue form of the same trace, a few times cheaper) checks those and measures the
noise ladder."""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from cliutil import dittrain, one_error_line, raises_one_line
from PIL import Image
from tiny import random_crops, save_random_inception

from dittrain import eval as ev

N = 24  # images per set


@pytest.fixture(scope="module")
def inception_file(tmp_path_factory) -> Path:
    return save_random_inception(tmp_path_factory.mktemp("inception") / ev.INCEPTION_FILES[0])


@pytest.fixture(scope="module")
def inception(inception_file):
    return ev.load_inception(inception_file, device="cpu")


@pytest.fixture(scope="module")
def sets():
    """Two sets of random crops of the same photographs (so their manifolds overlap)."""
    return random_crops(N, 64, seed=1), random_crops(N, 64, seed=2)


@pytest.fixture(scope="module")
def feats(sets, inception):
    a, b = sets
    return ev.image_features(a, inception, batch_size=8), ev.image_features(b, inception, batch_size=8)


# ----------------------------------------------------------------------------- independent formulas


def direct_fid(x: np.ndarray, y: np.ndarray) -> float:
    """FID of two feature sets without sqrtm: tr sqrt(S1 S2) = sum sqrt(eig(S1^1/2 S2 S1^1/2))."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    m1, m2 = x.mean(0), y.mean(0)
    c1 = (x - m1).T @ (x - m1) / (len(x) - 1)
    c2 = (y - m2).T @ (y - m2) / (len(y) - 1)
    w, v = np.linalg.eigh(c1)
    root = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    lam = np.clip(np.linalg.eigvalsh(root @ c2 @ root), 0, None)
    return float(((m1 - m2) ** 2).sum() + np.trace(c1) + np.trace(c2) - 2 * np.sqrt(lam).sum())


def direct_is(logits: np.ndarray, split: int) -> float:
    scores = []
    for i in range(0, len(logits), split):
        z = logits[i:i + split].astype(np.float64)
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        marginal = p.mean(0)
        scores.append(np.exp(np.mean([np.sum(q * np.log(q / marginal)) for q in p])))
    return float(np.mean(scores))


def direct_pr(ref: np.ndarray, samples: np.ndarray, k: int = 3) -> tuple[float, float]:
    """Brute force: the whole distance matrices at once, in float64."""
    def d2(a, b):
        return ((a[:, None, :].astype(np.float64) - b[None, :, :]) ** 2).sum(-1)

    r_rad = np.sort(d2(ref, ref), axis=1)[:, k]
    s_rad = np.sort(d2(samples, samples), axis=1)[:, k]
    sr = d2(samples, ref)
    precision = np.mean([(sr[i] <= r_rad).any() for i in range(len(samples))])
    recall = np.mean([(sr[:, j] <= s_rad).any() for j in range(len(ref))])
    return float(precision), float(recall)


def save_folder(images: np.ndarray, root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i, im in enumerate(images):
        Image.fromarray(im).save(root / f"{i:04d}.png")
    return root


# ----------------------------------------------------------------------------- metrics


def test_features_are_usable(sets, feats, inception):
    fa, _ = feats
    assert fa["pool"].shape == (N, ev.POOL_DIM) and fa["spatial"].shape == (N, ev.SPATIAL_DIM)
    assert fa["logits"].shape == (N, ev.LOGITS_DIM)
    for v in fa.values():  # not the near-constant features of the default init
        assert np.isfinite(v).all() and v.std(axis=0).mean() > 1e-3
    a, _ = sets
    nchw = torch.from_numpy(a[:2]).permute(0, 3, 1, 2)  # the other layout the API takes
    for k, v in inception.features(nchw).items():
        np.testing.assert_allclose(v, fa[k][:2], rtol=1e-4, atol=1e-5)


def test_fid_is_zero_on_itself_and_rises_with_noise(sets, feats, inception):
    a, _ = sets
    fa, _ = feats
    mu, sigma = ev.feature_stats(fa["pool"])
    scale = float((fa["pool"].astype(np.float64) ** 2).sum(1).mean())  # mean squared feature norm
    assert abs(ev.fid(mu, sigma, mu, sigma)) < 1e-6 * scale
    rng = np.random.default_rng(0)
    values = []
    for std in (8, 32, 96):
        noisy = np.clip(a[:12] + rng.normal(0, std, a[:12].shape), 0, 255).astype(np.uint8)
        values.append(direct_fid(fa["pool"][:12], ev.image_features(noisy, inception)["pool"]))
    assert 0 < values[0] < values[1] < values[2], values


def test_inception_score_and_precision_recall_match_direct(feats):
    fa, fb = feats
    assert ev.inception_score(fa["logits"]) == pytest.approx(direct_is(fa["logits"], 5000), rel=1e-9)
    assert ev.inception_score(fa["logits"], split_size=7) == pytest.approx(direct_is(fa["logits"], 7), rel=1e-9)
    want = direct_pr(fa["pool"], fb["pool"])
    assert ev.precision_recall(fa["pool"], fb["pool"]) == pytest.approx(want, abs=1e-9)
    assert ev.precision_recall(fa["pool"], fb["pool"], block=5) == pytest.approx(want, abs=1e-9)  # blocked
    assert 0 < want[0] < 1 or 0 < want[1] < 1  # a non-trivial case
    assert ev.precision_recall(fa["pool"], fa["pool"]) == (1.0, 1.0)
    radii = ev.manifold_radii(fa["pool"], block=5)
    full = np.sort(((fa["pool"][:, None].astype(np.float64) - fa["pool"][None]) ** 2).sum(-1), axis=1)[:, 3]
    np.testing.assert_allclose(radii, full, rtol=1e-4)


def test_fid_refuses_mismatched_statistics():
    with pytest.raises(ev.EvalError, match="do not match"):
        ev.fid(np.zeros(3), np.eye(3), np.zeros(4), np.eye(4))


# ----------------------------------------------------------------------------- the command


def test_cli_matches_direct_computation_and_caches_the_reference(tmp_path, sets, feats, inception_file,
                                                                 inception):
    a, b = sets
    fa, fb = feats
    ref = save_folder(a, tmp_path / "ref")
    samples = tmp_path / "samples.npz"
    np.savez(samples, arr_0=b, arr_1=np.arange(N))  # ADM's format, labels ignored
    out = tmp_path / "metrics.json"
    r = dittrain("eval", "--samples", samples, "--ref", ref, "--inception", inception_file, "--json", out,
                 "--device", "cpu", "--batch-size", 10)
    assert r.exit_code == 0, r.output
    for word in ("FID", "sFID", "Inception Score", "Precision", "Recall"):
        assert word in r.output
    m = json.loads(out.read_text())
    assert m["fid"] == pytest.approx(direct_fid(fb["pool"], fa["pool"]), rel=1e-4)
    assert m["sfid"] == pytest.approx(direct_fid(fb["spatial"], fa["spatial"]), rel=1e-4)
    assert m["inception_score"] == pytest.approx(direct_is(fb["logits"], 5000), rel=1e-4)
    assert (m["precision"], m["recall"]) == pytest.approx(direct_pr(fa["pool"], fb["pool"]), abs=1e-9)
    assert m["n_samples"] == N and m["n_ref"] == N
    prov = m["provenance"]
    assert prov["inception_sha256"] == inception.sha256 and prov["ref_digest"].startswith("listing-sha256:")
    assert not prov["ref_cached"] and Path(prov["ref_cache"]).parent == ref
    assert Path(prov["ref_cache"]).name.startswith(".ditkit-stats-")

    # The second time the reference comes from the cache the command wrote: no network on it.
    seen = inception.images_seen
    stats = ev.reference_stats(ref, inception, resolution=64)
    assert inception.images_seen == seen and stats.cached and stats.cache == prov["ref_cache"]
    np.testing.assert_allclose(stats.mu, fa["pool"].astype(np.float64).mean(0), rtol=1e-4, atol=1e-6)
    assert stats.pool.shape == (N, ev.POOL_DIM) and stats.radii.shape == (N,)
    # Without precision/recall the same cache serves too; another resolution is another key.
    assert ev.reference_stats(ref, inception, resolution=64, with_pr=False).cached
    assert inception.images_seen == seen
    assert ev.cache_key("x", 64, "s", True) != ev.cache_key("x", 32, "s", True)


def test_read_only_reference_caches_in_the_cache_dir(tmp_path, sets, inception, monkeypatch):
    from ditdata.common import files

    a, _ = sets
    ref = tmp_path / "ref.npz"
    np.savez(ref, arr_0=a[:6])
    cache_dir = tmp_path / "cache"
    real = files.atomic_file

    def read_only(final, *args, **kw):
        if Path(final).parent == tmp_path:
            raise PermissionError(13, "Permission denied", str(final))
        return real(final, *args, **kw)

    monkeypatch.setattr(files, "atomic_file", read_only)
    notes = []
    first = ev.reference_stats(ref, inception, cache_dir=cache_dir, log=notes.append)
    assert Path(first.cache).parent == cache_dir and any("Permission denied" in n for n in notes)
    seen = inception.images_seen
    again = ev.reference_stats(ref, inception, cache_dir=cache_dir)
    assert again.cached and inception.images_seen == seen
    np.testing.assert_array_equal(again.sigma, first.sigma)


# ----------------------------------------------------------------------------- reference formats


def test_npz_and_image_shard_references(tmp_path, sets, feats, inception, class_shards):
    from ditdata.framing import center_crop
    from ditdata.imageshards import folder as imageshards

    a, _ = sets
    fa, _ = feats
    ref = tmp_path / "ref.npz"
    np.savez_compressed(ref, arr_0=a[:10])  # compressed members are streamed as well
    stats = ev.reference_stats(ref, inception, batch_size=4)
    assert stats.n == 10 and not stats.precomputed and Path(stats.cache).name.startswith("ref.npz.ditkit-stats-")
    np.testing.assert_allclose(stats.mu, fa["pool"][:10].astype(np.float64).mean(0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(stats.sigma_s, np.cov(fa["spatial"][:10], rowvar=False), rtol=1e-3, atol=1e-7)

    # Image shards: decoded by ditdata's reader and centre-cropped by the encoder's rule.
    with pytest.raises(ev.EvalError, match="needs a resolution"):
        ev.reference_stats(class_shards, inception)
    crops = np.stack([center_crop(s.decode(), 32) for tar in imageshards.read_folder(class_shards).shards
                      for s in imageshards.iter_shard(tar)])
    shard_stats = ev.reference_stats(class_shards, inception, resolution=32, cache_dir=tmp_path / "c")
    assert shard_stats.n == len(crops) == 8
    np.testing.assert_allclose(shard_stats.pool, ev.image_features(crops, inception)["pool"], rtol=1e-4, atol=1e-5)


def test_adm_reference_batch_uses_its_statistics(tmp_path, sets, feats, inception):
    a, _ = sets
    fa, fb = feats
    given = {"mu": fb["pool"].mean(0), "sigma": np.cov(fb["pool"], rowvar=False),
             "mu_s": fb["spatial"].mean(0), "sigma_s": np.cov(fb["spatial"], rowvar=False)}
    ref = tmp_path / "VIRTUAL_tiny_labeled.npz"
    np.savez(ref, arr_0=a[:8], **given)
    seen = inception.images_seen
    stats = ev.reference_stats(ref, inception, with_pr=False)
    assert inception.images_seen == seen and stats.precomputed and stats.n == 8  # nothing ran
    for k, v in given.items():
        np.testing.assert_array_equal(getattr(stats, k), v)
    stats = ev.reference_stats(ref, inception)  # the images only for precision/recall
    assert inception.images_seen == seen + 8 and stats.precomputed
    np.testing.assert_array_equal(stats.sigma, given["sigma"])
    np.testing.assert_allclose(stats.pool, fa["pool"][:8], rtol=1e-4, atol=1e-5)
    np.savez(ref, arr_0=a[:8], mu=given["mu"], sigma=given["sigma"][:5])
    with pytest.raises(ev.EvalError, match="sigma has shape"):
        ev.reference_stats(ref, inception, with_pr=False)


# ----------------------------------------------------------------------------- failures


def test_missing_inception_fails_fast_and_says_where_it_goes(tmp_path, monkeypatch):
    from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.delenv(ev.INCEPTION_ENV, raising=False)
    np.savez(tmp_path / "s.npz", arr_0=np.zeros((2, 8, 8, 3), np.uint8))
    t = time.time()
    r = dittrain("eval", "--samples", tmp_path / "s.npz", "--ref", tmp_path / "s.npz", "--device", "cpu")
    assert time.time() - t < 5 and r.exit_code == 1
    line = one_error_line(r.output)
    assert ev.INCEPTION_FILES[0] in line and URL_INCEPTION_V3 in line and str(tmp_path / "torch" / "hub") in line
    r = dittrain("eval", "--samples", tmp_path / "s.npz", "--ref", tmp_path / "s.npz", "--inception",
                 tmp_path / "nope.pth")
    assert str(tmp_path / "nope.pth") in one_error_line(r.output)
    # The hub cache under either library's name is found.
    hub = tmp_path / "torch" / "hub" / "checkpoints"
    hub.mkdir(parents=True)
    (hub / ev.INCEPTION_FILES[1]).write_bytes(b"")
    assert ev.find_inception() == hub / ev.INCEPTION_FILES[1]


class NotWeights:
    pass


def test_inception_file_that_is_not_a_state_dict_is_refused(tmp_path, inception_file):
    bad = tmp_path / "pickle.pth"
    torch.save({"weights": NotWeights()}, bad)
    samples = tmp_path / "s.npz"
    np.savez(samples, arr_0=np.zeros((2, 8, 8, 3), np.uint8))
    r = dittrain("eval", "--samples", samples, "--ref", samples, "--inception", bad, "--device", "cpu")
    assert "not a plain tensor state dict" in one_error_line(r.output)
    (tmp_path / "old.pth").write_bytes(pickle.dumps({"weights": NotWeights()}, protocol=2))  # a bare pickle
    with pytest.raises(ev.EvalError, match="not a plain tensor state dict"):
        ev.load_inception(tmp_path / "old.pth")
    torch.save([torch.zeros(2)], tmp_path / "list.pth")
    with pytest.raises(ev.EvalError, match="not an Inception state dict"):
        ev.load_inception(tmp_path / "list.pth")
    sd = torch.load(inception_file, weights_only=True)
    sd["fc.weight"] = sd["fc.weight"][:10]
    sd.pop("Mixed_7c.branch_pool.conv.weight")
    torch.save(sd, tmp_path / "wrong.pth")
    msg = raises_one_line(ev.EvalError, lambda: ev.load_inception(tmp_path / "wrong.pth"))
    assert "1 missing keys (e.g. Mixed_7c.branch_pool.conv.weight)" in msg
    assert "fc.weight (10, 2048) (expected (1008, 2048))" in msg


def test_bad_inputs(tmp_path, sets, inception):
    a, _ = sets
    folder = save_folder(a[:3], tmp_path / "samples")
    (folder / "0001b.png").write_bytes(b"not a png")  # skipped and counted
    (folder / "sub").mkdir()
    Image.fromarray(a[3]).save(folder / "sub" / "x.jpg")  # recursive
    src = ev.open_source(folder)
    assert src.count == 5 and len(ev.source_features(src, inception)["pool"]) == 4 and src.skipped == 1
    assert "0001b.png" in src.skipped_examples[0]
    Image.fromarray(a[0][:40]).save(folder / "0002b.png")  # 64x40 among 64x64
    with pytest.raises(ev.EvalError, match=r"0002b\.png: 64x40 but .*0000\.png is 64x64"):
        ev.source_features(ev.open_source(folder), inception)
    np.savez(tmp_path / "f.npz", arr_0=np.zeros((2, 8, 8, 3), np.float32))
    (tmp_path / "t.npz").write_text("text")
    for path, why in (("f.npz", "must be uint8 images"), ("t.npz", "not an .npz file")):
        r = dittrain("eval", "--samples", tmp_path / path, "--ref", tmp_path / path, "--inception",
                     tmp_path / "missing.pth")
        assert why in one_error_line(r.output)  # the inputs are checked before the network
        with pytest.raises(ev.EvalError, match=why):
            ev.image_features(tmp_path / path, inception)


def test_help_says_where_the_weights_go():
    from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3

    r = dittrain("eval", "--help")
    assert r.exit_code == 0
    text = " ".join(r.output.split())
    assert URL_INCEPTION_V3 in text and "hub/checkpoints" in text and ev.INCEPTION_FILES[0] in text
    for metric in ("FID", "sFID", "IS", "Precision", "Recall"):
        assert metric in text
