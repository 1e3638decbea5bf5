"""`ditdata dedup` on planted near-duplicates (shipped photos and their resized, JPEG
re-encoded and flipped copies), scored by `ditdata score --save-embeddings --aesthetic`,
and its selection composed with `ditdata filter` both ways.

A random-weight CLIP cannot tell these photos apart (distinct photos reach cosine 0.94-0.997
with the tiny model of test_clip), so the image tower is replaced here by an embedding that
can: the 4x4 average colour thumbnail of the model's own preprocessed pixels, made flip
invariant (x + its mirror) and centred (distinct photos here: at most 0.79; copies: >= 0.999).
Everything else is the real path: open_clip loaded from a file, the text tower, the CLIP
score, the stored float16 embeddings, faiss, the groups and the selection file."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from cliutil import ditdata as run_cli
from cliutil import ok
from PIL import Image

torch = pytest.importorskip("torch")
open_clip = pytest.importorskip("open_clip")
pytest.importorskip("faiss")

from test_aesthetic import mlp_state_dict  # noqa: E402
from test_clip import TINY_CFG  # noqa: E402
from test_score import make_shards  # noqa: E402

from ditdata.common.errors import UserError  # noqa: E402
from ditdata.imageshards import folder as imageshards  # noqa: E402
from ditdata.imageshards.scores import score_path  # noqa: E402
from ditdata.imageshards.selections import load_selection  # noqa: E402
from ditdata.scoring.dedup import groups_of, keep_one, neighbour_pairs  # noqa: E402

DIM = 48  # 3 colours x 4 x 4


def thumb_embedding(self, pixels):
    """ClipModel.embed_pixels' stand-in (module docstring): (B, 3, H, W) -> (B, 48) unit rows."""
    import torch.nn.functional as F

    x = F.adaptive_avg_pool2d(pixels.float(), 4)
    x = (x + x.flip(-1)).flatten(1)
    return F.normalize(x - x.mean(1, keepdim=True), dim=-1).cpu()


def jpeg(img: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def photos() -> list[tuple[str, Image.Image]]:
    from skimage import data
    from sklearn.datasets import load_sample_images

    arrays = {"astronaut": data.astronaut(), "cat": data.chelsea(), "coffee": data.coffee(), "rocket": data.rocket(),
              "cameraman": np.stack([data.camera()] * 3, -1)}
    china, flower = load_sample_images().images
    arrays.update(china=china, flower=flower)
    out = []
    for name, a in arrays.items():
        img = Image.fromarray(a)
        out.append((name, img.resize((img.width * 192 // img.height, 192))))
    return out


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A scored folder of 7 distinct photos, 3 copies (half size, JPEG quality 25, mirrored) of
    each of the first 4, and one caption-less copy; returns (folder, {original key: copy keys},
    distinct keys, caption-less key, predictor file)."""
    from ditdata.clip import ClipModel, register_config

    root = tmp_path_factory.mktemp("dedup")
    config = root / "dedup-clip.json"
    config.write_text(json.dumps(dict(TINY_CFG, embed_dim=DIM)))
    register_config(config)
    torch.manual_seed(0)
    weights = root / "dedup-clip.pt"
    torch.save(open_clip.create_model("dedup-clip").state_dict(), weights)
    predictor = root / "aesthetic48.pth"
    torch.save(mlp_state_dict([DIM, 16, 4, 1], seed=2), predictor)

    samples, groups, distinct = [], {}, []
    for i, (name, img) in enumerate(photos()):
        key = f"p{i}-{name}"
        samples.append({"key": key, "image": jpeg(img), "caption": f"a photo of {name}"})
        if i >= 4:
            distinct.append(key)
            continue
        copies = {"half": jpeg(img.resize((img.width // 2, img.height // 2))), "q25": jpeg(img, 25),
                  "flip": jpeg(img.transpose(Image.Transpose.FLIP_LEFT_RIGHT))}
        groups[key] = [f"c{i}-{how}" for how in copies]
        samples += [{"key": f"c{i}-{how}", "image": b, "caption": f"{name}, {how} copy {'!' * j}"}
                    for j, (how, b) in enumerate(copies.items())]
    samples.append({"key": "c0-nocaption", "image": jpeg(photos()[0][1], 50), "caption": None})
    order = np.random.default_rng(0).permutation(len(samples))  # groups across both shards
    samples = [samples[i] for i in order]
    folder = make_shards(root / "shards", [samples[:10], samples[10:]])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ClipModel, "embed_pixels", thumb_embedding)
        ok(run_cli("score", folder, "--clip-config", config, "--pretrained", weights, "--device", "cpu",
                   "--threads", 0, "--quiet", "--save-embeddings", "--aesthetic", predictor))
    return folder, groups, distinct, "c0-nocaption", predictor


def scores(folder) -> dict[str, dict]:
    rows = {}
    for tar in imageshards.list_shards(folder):
        rows.update({r["key"]: r for r in pq.read_table(score_path(tar)).to_pylist()})
    return rows


def best(keys, rows) -> str:
    return min(keys, key=lambda k: (-rows[k]["clip_score"], k))


@pytest.mark.parametrize("search", ["--exact", "--approximate"])
def test_planted_groups_found_and_distinct_images_kept(planted, tmp_path, search):
    folder, groups, distinct, nocap, _ = planted
    out = tmp_path / "dedup.parquet"
    r = ok(run_cli("dedup", folder, "--out", out, search, "--quiet"),
           "cosine >= 0.95: 4 groups holding 16 images; removed 12", "1 without an embedding")
    sel = load_selection(out)
    rows = scores(folder)
    for orig, copies in groups.items():
        members = [orig, *copies]
        assert sel.keys & set(members) == {best(members, rows)}  # one per group: the highest CLIP score
    assert set(distinct) <= sel.keys and nocap not in sel.keys
    assert len(sel) == len(groups) + len(distinct)
    dd = sel.rule["dedup"]
    assert dd["group_sizes"] == {"4": 4} and dd["search"]["kind"] == search[2:].replace("approximate", "ivf")
    grid = Image.open(tmp_path / "dedup.groups.png")
    assert grid.height == 4 * (112 + 8 + 14) and grid.width == 4 * (112 + 8)
    assert "grid of the 4 largest groups" in r.output


def test_filter_composes_aesthetic_clip_score_and_dedup(planted, tmp_path):
    folder, groups, _, _, predictor = planted
    rows = scores(folder)
    scored = {k: r for k, r in rows.items() if r["clip_score"] is not None}
    clip_cut = float(np.median([r["clip_score"] for r in scored.values()]))
    aes_cut = float(np.median([r["aesthetic"] for r in scored.values()]))
    dedup = tmp_path / "dedup.parquet"
    ok(run_cli("dedup", folder, "--out", dedup, "--quiet", "--grid", ""))
    deduped = load_selection(dedup).keys
    assert not (tmp_path / "dedup.groups.png").exists()

    # filter after dedup: every rule holds, among the dedup selection's samples only
    out = tmp_path / "keep.parquet"
    r = ok(run_cli("filter", folder, "--min-clip-score", clip_cut, "--min-aesthetic", aes_cut,
                   "--select", dedup, "--out", out), "aesthetic >= ", "among: the 7 samples of")
    expect = {k for k in deduped if scored[k]["clip_score"] >= clip_cut and scored[k]["aesthetic"] >= aes_cut}
    assert load_selection(out).keys == expect and 0 < len(expect) < len(deduped)
    assert "aesthetic below threshold" in r.output and "not in the --select selection" in r.output
    rule = load_selection(out).rule
    assert rule["aesthetic"]["file"] == str(predictor) and rule["select"]["rule"]["dedup"]["groups"] == 4

    # a top fraction among the dedup selection's 7: ceil(0.5 * 7) = 4 by aesthetic
    ok(run_cli("filter", folder, "--top-aesthetic-fraction", 0.5, "--select", dedup, "--out", out))
    top = sorted(deduped, key=lambda k: -scored[k]["aesthetic"])[:4]
    assert load_selection(out).keys == set(top)

    # dedup after filter: one per group among the filtered samples, the best of those kept
    ok(run_cli("filter", folder, "--min-aesthetic", aes_cut, "--out", out))
    passed = load_selection(out).keys
    ok(run_cli("dedup", folder, "--select", out, "--out", dedup, "--quiet"))
    expect = set(passed)
    for orig, copies in groups.items():
        members = [k for k in (orig, *copies) if k in passed]
        expect -= set(members) - {best(members, rows)} if members else set()
    assert load_selection(dedup).keys == expect


def test_dedup_needs_saved_embeddings(tmp_path):
    from test_selection import make_scored

    folder = make_scored(tmp_path / "d")  # score files without the embedding column
    r = run_cli("dedup", folder, "--out", tmp_path / "s.parquet")
    assert r.exit_code == 1
    line = r.output.strip()
    assert "\n" not in line and "scored without --save-embeddings" in line and "rerun `ditdata score" in line, line
    r = run_cli("filter", folder, "--min-aesthetic", 5, "--out", tmp_path / "s.parquet")
    assert r.exit_code == 1 and "scored without --aesthetic FILE" in r.output


def test_groups_chain_and_ties_go_to_the_smallest_key():
    labels = groups_of(6, np.array([0, 1, 4]), np.array([1, 2, 5]))  # 0~1~2 chain, 3 alone, 4~5
    assert labels.tolist() == [0, 0, 0, 3, 4, 4]
    keep = keep_one(labels, np.array([0.2, 0.3, 0.3, np.nan, np.nan, np.nan]), ["a", "c", "b", "d", "f", "e"])
    assert keep.tolist() == [False, False, True, True, False, True]


def test_tiny_sets_search_both_ways():
    emb = np.eye(3, 8, dtype=np.float16)
    emb[1] = emb[0]  # rows 0 and 1 identical
    for exact in (True, False):
        a, b, cos, plan = neighbour_pairs(emb, 0.95, exact=exact)
        assert (a.tolist(), b.tolist(), plan["kind"]) == ([0], [1], "exact" if exact else "ivf")
        assert cos.tolist() == [1.0]


def test_without_faiss_the_extra_is_named(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "faiss", None)
    with pytest.raises(UserError, match=r"needs the dedup extra.*pip install 'ditkit\[dedup\]'"):
        neighbour_pairs(np.ones((2, 4), np.float16), 0.95)
