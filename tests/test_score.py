"""`ditdata score`: per-shard CLIP score parquet files, equal to open_clip, resumable."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from cliutil import ditdata as run_cli
from cliutil import ok
from PIL import Image

open_clip = pytest.importorskip("open_clip")
torch = pytest.importorskip("torch")

from test_clip import tiny_clip_files  # noqa: E402

from ditdata.config import ScoreConfig  # noqa: E402
from ditdata.errors import DitdataError  # noqa: E402
from ditdata.imageshards import folder as imageshards  # noqa: E402
from ditdata.imageshards.scores import read_score_meta, score_path  # noqa: E402
from ditdata.scoring import score as score_mod  # noqa: E402
from ditdata.scoring.score import score  # noqa: E402


def jpeg(arr, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def make_shards(folder: Path, shards: list[list[dict]]) -> Path:
    """An image-shard folder as `ditdata fetch` leaves it: NNNNN.tar, NNNNN_stats.json,
    dataset.json. Each sample: key, image (bytes), caption (str or None), meta."""
    folder.mkdir(parents=True, exist_ok=True)
    n = 0
    for i, samples in enumerate(shards):
        with imageshards.ShardWriter(folder, i) as w:
            for s in samples:
                meta = {"key": s["key"], "caption": s.get("caption"), **s.get("meta", {})}
                w.write(s["key"], s["image"], "jpg", meta, s.get("caption"))
        imageshards.write_shard_stats(folder, i, {"count": len(samples), "successes": len(samples),
                                                  "status_dict": {"success": len(samples)}})
        n += len(samples)
    imageshards.write_json_atomic(folder / imageshards.DATASET_INFO, {
        "format": imageshards.FORMAT, "version": imageshards.VERSION, "kind": "captions",
        "num_shards": len(shards), "num_samples": n,
    })
    return folder


def caption_shards(folder: Path) -> Path:
    """Two shards of real photos (crops of scikit-image pictures) with captions, one
    sample without caption, one with a blank caption and one broken JPEG."""
    from skimage import data

    pics = {"astronaut": data.astronaut(), "cat": data.chelsea(), "coffee cup": data.coffee(),
            "rocket": data.rocket()}
    samples = []
    for j, (name, arr) in enumerate(pics.items()):
        for c in range(3):
            crop = arr[c * 20:, c * 30:][:200, :260]
            samples.append({"key": f"{len(samples):09d}", "image": jpeg(crop), "caption": f"a photo of a {name} {c}",
                            "meta": {"original_width": 1000 + j, "original_height": 800}})
    samples[3]["caption"] = None
    samples[7]["caption"] = "   "
    samples[9]["image"] = samples[9]["image"][:300]  # cut inside the header: "corrupt image"
    return make_shards(folder, [samples[:7], samples[7:]])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_clip_files(tmp_path_factory.mktemp("clip"))


def read_all(folder: Path):
    rows = []
    for tar in imageshards.list_shards(folder):
        rows += pq.read_table(score_path(tar)).to_pylist()
    return rows


def test_scores_equal_open_clip_and_are_deterministic(tiny, tmp_path):
    config, weights = tiny
    a = caption_shards(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    r = run_cli("score", a, "--clip-config", config, "--pretrained", weights, "--device", "cpu",
                "--batch-size", 4, "--threads", 2, "--quiet")
    ok(r, "12 samples in 2 shards", "no caption:        2", "undecodable image: 1 (null score): corrupt image 1")
    rows = read_all(a)
    assert [x["key"] for x in rows] == [f"{i:09d}" for i in range(12)]
    assert {x["model"] for x in rows} == {"tiny-clip"}
    assert {x["pretrained"] for x in rows} == {str(weights.resolve())}

    # direct computation with open_clip
    model, _, preprocess = open_clip.create_model_and_transforms("tiny-clip", pretrained=str(weights))
    model.eval()
    tok = open_clip.get_tokenizer("tiny-clip")
    samples = [s for tar in imageshards.list_shards(a) for s in imageshards.iter_shard(tar)]
    for s, row in zip(samples, rows, strict=True):
        cap = (s.caption or "").strip()
        if s.key == "000000009":
            with pytest.raises(imageshards.BadImageError) as e:
                s.decode()
            assert row["clip_score"] is None and row["status"] == e.value.reason == "corrupt image"
            assert row["width"] is None
            continue
        img = s.decode()
        assert (row["width"], row["height"]) == img.size
        assert row["original_width"] >= 1000 and row["original_height"] == 800
        if not cap:
            assert row["clip_score"] is None and row["status"] == "no caption" and row["caption_length"] is None
            continue
        with torch.no_grad():
            fi = model.encode_image(preprocess(img)[None], normalize=True)
            ft = model.encode_text(tok([cap]), normalize=True)
        assert row["status"] == "ok" and row["caption_length"] == len(cap)
        assert row["clip_score"] == pytest.approx(float((fi * ft).sum()), abs=1e-6)

    # deterministic: a second run on a copy gives the same numbers
    summary = score(ScoreConfig(b, clip_config=str(config), pretrained=str(weights), device="cpu", batch_size=4,
                                workers=2, progress=False))
    assert summary["scored"] == 9 and summary["counts"]["no caption"] == 2
    assert [x["clip_score"] for x in read_all(b)] == [x["clip_score"] for x in rows]
    meta = read_score_meta(score_path(b / "00000.tar"))
    assert meta["num_samples"] == 7 and meta["weights_sha256"] == summary["weights_sha256"]


def test_resume_skips_finished_and_redoes_broken(tiny, tmp_path, monkeypatch):
    config, weights = tiny
    d = caption_shards(tmp_path / "s")
    kw = dict(clip_config=str(config), pretrained=str(weights), device="cpu", batch_size=8, workers=0, progress=False)
    first = score(ScoreConfig(d, **kw))
    assert first["scored_shards"] == 2
    before = read_all(d)

    calls = []
    real = score_mod.score_shard
    monkeypatch.setattr(score_mod, "score_shard", lambda clip, tar, **k: calls.append(Path(tar).name) or real(clip, tar, **k))
    again = score(ScoreConfig(d, **kw))
    assert calls == [] and again["skipped_shards"] == 2 and again["samples"] == 12

    # a killed run: a temporary left behind, and a score file cut short (not trusted)
    p = score_path(d / "00001.tar")
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    stale_tmp = d / ".00000.clip.parquet.tmp-1-deadbeef"
    stale_tmp.write_bytes(b"partial")
    assert read_score_meta(p) is None
    third = score(ScoreConfig(d, **kw))
    assert calls == ["00001.tar"] and third["skipped_shards"] == 1
    assert not stale_tmp.exists()
    assert read_all(d) == before


def test_other_weights_refused_unless_overwrite(tiny, tmp_path):
    config, weights = tiny
    _, weights2 = tiny_clip_files(tmp_path / "w2", seed=1)
    d = caption_shards(tmp_path / "s")
    kw = dict(clip_config=str(config), device="cpu", batch_size=8, workers=0, progress=False)
    score(ScoreConfig(d, pretrained=str(weights), **kw))
    with pytest.raises(DitdataError, match="already scored with tiny-clip .*--overwrite"):
        score(ScoreConfig(d, pretrained=str(weights2), **kw))
    r = run_cli("score", d, "--clip-config", config, "--pretrained", weights2, "-q")
    assert r.exit_code == 1 and "--overwrite" in r.output and r.output.count("\n") == 1
    s = score(ScoreConfig(d, pretrained=str(weights2), overwrite=True, **kw))
    assert s["scored_shards"] == 2
    assert {x["pretrained"] for x in read_all(d)} == {str(weights2.resolve())}


def test_refusals(tiny, tmp_path, monkeypatch):
    config, weights = tiny
    d = caption_shards(tmp_path / "s")
    os.remove(d / "dataset.json")
    (d / ".fetch_state").write_text("{}")  # an unfinished `ditdata fetch` (not another tool's tars)
    with pytest.raises(DitdataError, match="dataset.json is missing"):
        score(ScoreConfig(d, clip_config=str(config), pretrained=str(weights), progress=False))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    d2 = caption_shards(tmp_path / "s2")
    r = run_cli("score", d2, "--clip", "ViT-B-32", "--pretrained", "laion2b_s34b_b79k")
    assert r.exit_code == 1
    assert "Error: CLIP weights for ViT-B-32 / laion2b_s34b_b79k are not available offline" in r.output
    assert not list(d2.glob("*.clip.parquet"))


def test_score_then_filter(tiny, tmp_path):
    from ditdata.imageshards.selections import load_selection

    config, weights = tiny
    d = caption_shards(tmp_path / "s")
    score(ScoreConfig(d, clip_config=str(config), pretrained=str(weights), device="cpu", workers=2, progress=False))
    rows = read_all(d)
    scores = sorted((x["clip_score"] for x in rows if x["clip_score"] is not None), reverse=True)
    t = scores[4]  # --top-fraction 0.5 of 9 scored samples: k = 5
    r = run_cli("filter", d, "--top-fraction", 0.5, "--out", tmp_path / "keep.parquet")
    assert r.exit_code == 0, r.output
    sel = load_selection(tmp_path / "keep.parquet")
    assert sel.keys == {x["key"] for x in rows if x["clip_score"] is not None and x["clip_score"] >= t}
    assert len(sel) == 5
    assert sel.rule["clip_model"] == "tiny-clip" and sel.rule["threshold"] == t
    assert sel.rule["clip_pretrained"] == str(weights.resolve())
