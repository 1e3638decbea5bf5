"""Aspect-ratio buckets: the bucket list of AREA:STEP, the nearest bucket, and
`ditdata encode --buckets` on real photos resized to banners, portraits and squares
(pixels autoencoder: a latent is the cropped image, so the crop can be checked pixel by
pixel), its manifest and histogram, resume after SIGKILL, and the one-line refusals."""

from __future__ import annotations

import math
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from cliutil import BIN, ditdata, kill_when, one_error_line
from PIL import Image
from tiny import fetch_tree, sample_photos

from ditdata.framing import BucketSpecError, bucket_sizes, crop_pixels, nearest, parse_spec
from ditdata.store import open_store

SPECS = [(256, 16), (256, 32), (512, 32), (1024, 64), (64, 8), (48, 8), (32, 4)]


# ------------------------------------------------------------------------------ geometry

@pytest.mark.parametrize("area,step", SPECS)
def test_bucket_list_properties(area, step):
    sizes = bucket_sizes(area, step)
    assert len(set(sizes)) == len(sizes) and (area, area) in sizes
    assert all(w % step == 0 and h % step == 0 for w, h in sizes)
    assert all(0.75 * area * area <= w * h <= area * area for w, h in sizes)  # about AREA^2, never above
    ratios = [w / h for w, h in sizes]
    assert ratios == sorted(ratios) and ratios[0] == 0.5 and ratios[-1] == 2.0  # both ends on these grids
    assert set(sizes) == {(h, w) for w, h in sizes}  # portraits mirror banners
    # a staircase: neighbours differ in one side, by STEP
    for (w1, h1), (w2, h2) in zip(sizes, sizes[1:], strict=False):
        assert (w1 == w2 and h1 - h2 == step) or (h1 == h2 and w2 - w1 == step), ((w1, h1), (w2, h2))


@pytest.mark.parametrize("area,step", SPECS)
def test_nearest_bucket_crops_at_most_step(area, step):
    """Over ratios 1:2 to 2:1 (large images, as photos are), the nearest bucket in log ratio
    crops at most STEP pixels; beyond them the extreme bucket crops more."""
    sizes = bucket_sizes(area, step)
    worst = 0
    for r in np.exp(np.linspace(math.log(0.5), math.log(2.0), 801)):
        size = (3000, round(3000 / r))
        b = nearest(size, sizes)
        assert abs(math.log(b[0] / b[1]) - math.log(size[0] / size[1])) == pytest.approx(
            min(abs(math.log(w / h) - math.log(size[0] / size[1])) for w, h in sizes))
        worst = max(worst, crop_pixels(size, b))
    assert 0 < worst <= step
    assert nearest((4000, 1000), sizes) == sizes[-1] and crop_pixels((4000, 1000), sizes[-1]) > step
    assert nearest((1000, 4000), sizes) == sizes[0]
    assert all(nearest(s, sizes) == s and crop_pixels(s, s) == 0 for s in sizes)


def test_spec_parsing_and_refusals():
    assert parse_spec("256", factor=8) == parse_spec("256:16", factor=8)  # STEP: factor x patch 2
    assert parse_spec("512:32", factor=8).step == 32
    for text, factor, needle in [("abc", 8, "expected AREA or AREA:STEP"), ("256:x", 8, "expected AREA"),
                                 ("250:16", 8, "AREA 250 must be a positive multiple of STEP 16, e.g. 240 or 256"),
                                 ("256:12", 8, "STEP 12 must be a positive multiple of the autoencoder's"),
                                 ("256:0", 8, "STEP 0"), ("0:16", 8, "AREA 0"), ("-32:16", 8, "AREA -32")]:
        with pytest.raises(BucketSpecError, match=needle) as e:
            parse_spec(text, factor)
        assert f"--buckets {text}:" in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------ encode

AREA, STEP = 32, 4
# Sources small enough that the cover crop resizes once (no halving): the oracle below is
# then PIL's BICUBIC resize to cover the bucket and the central crop.
SHAPES = [(60, 30), (30, 60), (40, 40), (48, 36), (30, 54), (56, 36)]
EXTREME = (64, 16)  # 4:1, beyond the widest bucket: cropped by more than STEP


def _tree(root: Path) -> Path:
    for name, arr in sample_photos().items():
        (root / name).mkdir(parents=True)
        img = Image.fromarray(arr)
        for i, size in enumerate(SHAPES + ([EXTREME] if name == "astronaut" else [])):
            img.resize(size, Image.Resampling.BICUBIC).save(root / name / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> tuple[Path, Path]:
    """(image tree, its shards): 6 photos x 6 shapes + one 4:1 banner, 7 per shard."""
    root = tmp_path_factory.mktemp("photos")
    tree = _tree(root / "tree")
    return tree, fetch_tree(tree, root / "shards", samples_per_shard=7)


def _encode(shards, out, *extra):
    return ditdata("encode", shards, "--vae", "pixels", "--out", out, "--device", "cpu", "--workers", "0",
                   "--quiet", *map(str, extra))


@pytest.fixture(scope="module")
def bucketed(photos, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("enc") / "store"
    r = _encode(photos[1], out, "--buckets", f"{AREA}:{STEP}", "--flip", "--batch-size", "2")
    assert r.exit_code == 0, r.output
    assert "37 samples" in r.output and "1 images cropped by more than 4 px" in r.output
    return out


def _oracle(src: Image.Image, bucket) -> np.ndarray:
    """The source resized (BICUBIC, aspect kept) to cover the bucket, centrally cropped."""
    w, h = src.size
    s = max(bucket[0] / w, bucket[1] / h)
    big = np.asarray(src.resize((max(bucket[0], round(w * s)), max(bucket[1], round(h * s))),
                                Image.Resampling.BICUBIC).convert("RGB"))
    top, left = (big.shape[0] - bucket[1]) // 2, (big.shape[1] - bucket[0]) // 2
    return big[top:top + bucket[1], left:left + bucket[0]]


def test_every_image_in_its_nearest_bucket_cropped_at_most_step(bucketed, photos):
    tree = photos[0]
    store = open_store(bucketed, verify=True)
    sizes = bucket_sizes(AREA, STEP)
    seen = 0
    for b in store.buckets:
        assert b.store.latent_shape == (3, b.size[1], b.size[0]) == b.latent_shape
        for shard in b.store.shards:
            d = b.store.read(shard)
            for i, source in enumerate(d["source"]):
                src = Image.open(tree / source)
                assert (d["original_width"][i], d["original_height"][i]) == src.size
                ratio = math.log(src.size[0] / src.size[1])
                assert b.size == min(sizes, key=lambda s: abs(math.log(s[0] / s[1]) - ratio))
                want = _oracle(src, b.size)
                excess = max(round(src.size[0] * max(b.size[0] / src.size[0], b.size[1] / src.size[1])) - b.size[0],
                             round(src.size[1] * max(b.size[0] / src.size[0], b.size[1] / src.size[1])) - b.size[1])
                assert d["crop"][i] == excess and (excess <= STEP) == (src.size != EXTREME)
                got = ((d["latent"][i].astype(np.float32) + 1) * 127.5).transpose(1, 2, 0)
                np.testing.assert_allclose(got, want, atol=0.6)  # fp16 of [-1, 1]: within a grey level
                np.testing.assert_array_equal(d["latent_flip"][i], d["latent"][i][..., ::-1])
                seen += 1
    assert seen == store.num_samples == 37


def test_manifest_and_histogram_count_the_buckets(bucketed, photos):
    sizes = bucket_sizes(AREA, STEP)
    want = Counter()
    for p in photos[0].rglob("*.png"):
        w, h = Image.open(p).size
        want[min(sizes, key=lambda s: abs(math.log(s[0] / s[1]) - math.log(w / h)))] += 1
    store = open_store(bucketed)
    m = store.manifest
    assert {tuple(e["size"]): e["num_samples"] for e in m["buckets"]["list"]} == dict(want)
    assert m["buckets"]["area"] == AREA and m["buckets"]["step"] == STEP and m["buckets"]["cropped_beyond_step"] == 1
    assert m["num_samples"] == 37 and m["shards"] == [] and m["image"]["buckets"] == {"area": AREA, "step": STEP}
    assert m["latent"]["shape"] == [3, AREA, AREA] and m["conditioning"]["type"] == "class"
    # one input shard -> at most one shard per bucket, named after it
    inputs = sorted(p.name[:-4] for p in photos[1].glob("*.tar"))
    for b in store.buckets:
        names = [s.name for s in b.store.shards]
        assert names == sorted(set(names)) and set(names) <= set(inputs)
    out = ditdata("inspect", bucketed).output
    assert f"samples:      37 in {len(want)} buckets" in out and "1 images cropped by more than 4 px" in out
    top = max(want.values())
    for (w, h), n in want.items():
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(f"{w}x{h} "))
        assert line.split()[1:5] == ["(3,", f"{h},", f"{w})", str(n)] and f"{100 * n / 37:.1f}%" in line
        assert line.count("#") == round(30 * n / top)
    assert ditdata("verify", bucketed, "--quiet").output.strip().endswith("OK (37 samples verified)")


def test_plain_store_unchanged(photos, tmp_path):
    r = _encode(photos[1], tmp_path / "plain", "--resolution", "32")
    assert r.exit_code == 0, r.output
    store = open_store(tmp_path / "plain")
    assert store.buckets == () and "buckets" not in store.manifest and len(store.shards) == 6
    assert "crop" not in store.schema.columns and store.manifest["image"]["crop"] == "center"
    out = ditdata("inspect", tmp_path / "plain").output
    assert "samples:      37 in 6 shards" in out and "buckets" not in out


def test_int8_buckets_hold_each_buckets_latents_and_train(photos, bucketed, tmp_path):
    """--buckets with --dtype int8: every bucket's latents as int8 codes with scales of its own
    grid (h, w), within half a step of the float16 bucket's (and its float16 rounding), flips too;
    a run trains on them through the bucketed loader."""
    from cliutil import dittrain, run_args

    from ditdata.store import values

    r = _encode(photos[1], tmp_path / "s8", "--buckets", f"{AREA}:{STEP}", "--flip", "--batch-size", "2",
                "--dtype", "int8")
    assert r.exit_code == 0, r.output
    int8, fp16 = open_store(tmp_path / "s8", verify=True), open_store(bucketed)
    assert [b.name for b in int8.buckets] == [b.name for b in fp16.buckets]
    for b8, b16 in zip(int8.buckets, fp16.buckets, strict=True):
        c, h, w = b8.store.latent_shape
        assert b8.store.schema.tensors["latent_flip_scale"].shape == (h, w)
        for shard in b8.store.shards:
            got, want = b8.store.read(shard.name), b16.store.read(shard.name)
            assert list(got["key"]) == list(want["key"])
            for field in ("latent", "latent_flip"):
                step = got[f"{field}_scale"][:, None]
                assert (np.abs(values(got, field) - values(want, field)) <= step / 2 + 1e-3).all()
    r = dittrain(*run_args(tmp_path / "s8", tmp_path / "run", "--max-steps", 2, "--batch-size", 4))
    assert r.exit_code == 0 and "finished at step 2" in r.output, r.output


def _bucket_checksums(root: Path) -> dict:
    store = open_store(root, verify=True)
    return {(b.name, s.name): s.record["checksum"] for b in store.buckets for s in b.store.shards}


def test_sigkill_then_rerun_equals_clean_run(photos, bucketed, tmp_path):
    """A run killed part-way leaves no top manifest; the rerun skips the finished input
    shards, discards what the killed one left of the others, and ends with the bytes of a
    clean run (the module's store, made with the same options)."""
    args = [BIN / "ditdata", "encode", photos[1], "--vae", "pixels", "--buckets", f"{AREA}:{STEP}", "--flip",
            "--batch-size", "2", "--device", "cpu", "--workers", "0", "--out", tmp_path / "s"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    inputs = tmp_path / "s" / "inputs"
    kill_when(proc, lambda: len(list(inputs.glob("0000[0-9].json"))) >= 1, timeout=120, poll=0.005,
              too_late="encode finished before it could be killed")
    assert not (tmp_path / "s" / "manifest.json").exists()
    # As a kill between a bucket shard and its input's record leaves them: bucket shards of an
    # unfinished input (samples written twice, were they kept), in its own bucket and in one it
    # does not go to (an input that changed since).
    done = {p.stem for p in inputs.glob("*.json")}
    victim = next(n for n in ("00005", "00004", "00003") if n not in done)
    clean = open_store(bucketed).buckets
    own = next(b for b in clean if any(s.name == victim for s in b.store.shards))
    other = next(b for b in clean if all(s.name != victim for s in b.store.shards))
    for b in (own, other):
        dest = tmp_path / "s" / "buckets" / b.name
        shutil.copytree(own.store.root / "shards", dest / "shards", dirs_exist_ok=True,
                        ignore=lambda d, names: [n for n in names if d.endswith("shards") and not n.startswith(victim)])
        shutil.copy(b.store.root / "config.json", dest)
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"({len(done)} already done)" in r.stdout
    assert _bucket_checksums(tmp_path / "s") == _bucket_checksums(bucketed)
    assert open_store(tmp_path / "s").manifest["buckets"] == open_store(bucketed).manifest["buckets"]
    assert not list((tmp_path / "s" / "buckets" / other.name / "shards").glob(f"{victim}*"))


def test_refusals_are_one_line(photos, bucketed, tmp_path):
    shards = photos[1]
    for spec, needle in [("33:4", "--buckets 33:4: AREA 33 must be a positive multiple of STEP 4"),
                         ("32:0", "STEP 0 must be a positive multiple"), ("big", "expected AREA or AREA:STEP")]:
        line = one_error_line(_encode(shards, tmp_path / "x", "--buckets", spec).output)
        assert needle in line
    (tmp_path / "bad.toml").write_text("buckets = 33\n")  # settable from --config, checked the same
    assert "--buckets 33:" in one_error_line(_encode(shards, tmp_path / "x", "--config", tmp_path / "bad.toml").output)
    assert not (tmp_path / "x" / "manifest.json").exists()
    assert _encode(shards, tmp_path / "p", "--resolution", "16").exit_code == 0
    assert "is a plain latent store" in one_error_line(_encode(shards, tmp_path / "p", "--buckets", "32").output)
    line = one_error_line(_encode(shards, tmp_path / "b", "--features", "dinov2-vits14", "--buckets", "32").output)
    assert "--buckets with --features is not supported" in line
    line = one_error_line(ditdata("features", bucketed, "--encoder", "dinov2-vits14").output)
    assert "a bucketed store (encode --buckets); feature sets of bucketed stores are not supported" in line


def test_config_file_and_other_buckets_refused(photos, tmp_path):
    (tmp_path / "c.toml").write_text('buckets = "16:4"\n')
    assert _encode(photos[1], tmp_path / "s", "--config", tmp_path / "c.toml").exit_code == 0
    store = open_store(tmp_path / "s")
    assert (store.area, store.step) == (16, 4) and store.num_samples == 37
    line = one_error_line(_encode(photos[1], tmp_path / "s", "--buckets", "32:4").output)
    assert "which --buckets 32:4 does not make" in line
    assert "is a bucketed latent store" in one_error_line(_encode(photos[1], tmp_path / "s").output)
