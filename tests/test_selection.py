"""`ditdata filter` and the selection API: exact rules on a hand-made score table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from cliutil import ok

from ditdata.cli import main
from ditdata.config import FilterConfig
from ditdata.errors import DitdataError
from ditdata.imageshards import folder as imageshards
from ditdata.imageshards.scores import FORMAT, VERSION, score_path, write_scores
from ditdata.imageshards.selections import load_selection
from ditdata.scoring.filter import apply_rule, filter_shards, histogram, resolve_threshold, top_fraction_count

# key: (clip_score, status, stored w, h, original w, h, caption length)
TABLE = [
    {
        "k00": (0.30, "ok", 256, 256, 640, 480, 20),
        "k01": (0.25, "ok", 256, 256, 512, 512, 12),
        "k02": (None, "no caption", 256, 256, 800, 600, None),
        "k03": (0.28, "ok", 256, 256, 300, 900, 30),   # aspect 3
        "k04": (0.28, "ok", 256, 256, 200, 150, 8),    # small
    },
    {
        "k10": (0.35, "ok", 256, 256, None, None, 3),  # size unknown at source: stored 256x256
        "k11": (None, "truncated image", None, None, 1024, 768, 40),
        "k12": (0.10, "ok", 256, 256, 1024, 1024, 50),
        "k13": (0.2799, "ok", 256, 256, 1024, 1024, 50),
    },
]


def make_scored(folder: Path, table=TABLE, *, model="ViT-B-32", pretrained="laion2b_s34b_b79k", sha="ab" * 32):
    """A finished image-shard folder whose score files hold exactly `table`."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, rows in enumerate(table):
        with imageshards.ShardWriter(folder, i) as w:
            for key in rows:
                w.write(key, b"not decoded by filter", "jpg", {"key": key})
        imageshards.write_shard_stats(folder, i, {"count": len(rows), "successes": len(rows)})
        cols = {c: [] for c in ("key", "clip_score", "model", "pretrained", "status", "width", "height",
                                "original_width", "original_height", "caption_length")}
        for key, (s, st, w_, h_, ow, oh, cl) in rows.items():
            for c, v in zip(cols, (key, s, model, pretrained, st, w_, h_, ow, oh, cl), strict=True):
                cols[c].append(v)
        tar = imageshards.shard_path(folder, i)
        write_scores(score_path(tar), cols, {
            "format": FORMAT, "version": VERSION, "shard": tar.name, "shard_bytes": tar.stat().st_size,
            "num_samples": len(rows), "model": model, "pretrained": pretrained, "weights_sha256": sha,
        })
    imageshards.write_json_atomic(folder / imageshards.DATASET_INFO, {
        "format": imageshards.FORMAT, "version": imageshards.VERSION, "kind": "urls",
        "num_shards": len(table), "num_samples": sum(len(r) for r in table)})
    return folder


@pytest.fixture
def scored(tmp_path):
    return make_scored(tmp_path / "shards")


def kept(folder, out, **rule):
    sel, _ = filter_shards(FilterConfig(folder, out, **rule))
    return sorted(sel.keys)


def test_threshold_rule(scored, tmp_path):
    out = tmp_path / "sel.parquet"
    assert kept(scored, out, min_clip_score=0.28) == ["k00", "k03", "k04", "k10"]  # 0.28 itself is kept
    assert kept(scored, out, min_clip_score=0.2799) == ["k00", "k03", "k04", "k10", "k13"]
    assert kept(scored, out, min_clip_score=-1.0) == ["k00", "k01", "k03", "k04", "k10", "k12", "k13"]  # never nulls
    with pytest.raises(DitdataError, match="no sample passes"):
        filter_shards(FilterConfig(scored, out, min_clip_score=0.9))


def test_top_fraction_rule_and_ties(scored, tmp_path):
    out = tmp_path / "sel.parquet"
    # 7 scored samples: 0.35 0.30 0.28 0.28 0.2799 0.25 0.10 (nulls are not counted in n)
    assert kept(scored, out, top_fraction=1 / 7) == ["k10"]                 # k = 1
    assert kept(scored, out, top_fraction=0.25) == ["k00", "k10"]           # k = ceil(1.75) = 2
    # k = ceil(0.4 * 7) = 3 -> threshold 0.28, shared by k03 and k04: both kept (4 > 3)
    sel, summary = filter_shards(FilterConfig(scored, out, top_fraction=0.4))
    assert sorted(sel.keys) == ["k00", "k03", "k04", "k10"]
    assert sel.rule["threshold"] == 0.28 and sel.rule["kept"] == 4
    assert sel.rule["scored"] == 7 and sel.rule["total"] == 9
    assert kept(scored, out, top_fraction=0.5) == ["k00", "k03", "k04", "k10"]  # k = 4 (0.28 is 3rd/4th)
    assert kept(scored, out, top_fraction=0.6) == ["k00", "k03", "k04", "k10", "k13"]  # k = 5
    assert kept(scored, out, top_fraction=1.0) == ["k00", "k01", "k03", "k04", "k10", "k12", "k13"]


def test_top_fraction_count_is_exact():
    assert top_fraction_count(0.3, 10) == 3      # 0.3 * 10 == 3.0000000000000004 in floats
    assert top_fraction_count(0.7, 10) == 7      # 7.000000000000001
    assert top_fraction_count(0.3, 11) == 4
    assert top_fraction_count(1e-9, 5) == 1
    assert top_fraction_count(1.0, 5) == 5
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(DitdataError):
            top_fraction_count(bad, 5)
    s = [0.5, np.nan, 0.1, 0.5, 0.3]
    assert resolve_threshold(s, top_fraction=0.25) == 0.5
    assert resolve_threshold(s, top_fraction=0.75) == 0.3
    assert resolve_threshold(s, min_clip_score=0.2) == 0.2
    assert resolve_threshold(s) is None
    with pytest.raises(DitdataError, match="no sample has a CLIP score"):
        resolve_threshold([np.nan], top_fraction=0.5)


def test_size_aspect_and_caption_constraints(scored, tmp_path):
    out = tmp_path / "sel.json"
    base = dict(min_clip_score=0.0)
    everyone = ["k00", "k01", "k03", "k04", "k10", "k12", "k13"]
    assert kept(scored, out, **base) == everyone
    # sizes are the source's (original_*) when recorded: k04 is 200x150, k03 300x900; k10 falls back to 256
    assert kept(scored, out, **base, min_width=256) == ["k00", "k01", "k03", "k10", "k12", "k13"]
    assert kept(scored, out, **base, min_width=257) == ["k00", "k01", "k03", "k12", "k13"]
    assert kept(scored, out, **base, min_height=481) == ["k01", "k03", "k12", "k13"]
    assert kept(scored, out, **base, max_aspect_ratio=2) == ["k00", "k01", "k04", "k10", "k12", "k13"]
    assert kept(scored, out, **base, max_aspect_ratio=3) == everyone
    assert kept(scored, out, **base, min_caption_length=12) == ["k00", "k01", "k03", "k12", "k13"]
    sel, summary = filter_shards(FilterConfig(scored, out, min_clip_score=0.28, min_width=256, max_aspect_ratio=2,
                                              min_caption_length=4))
    assert sorted(sel.keys) == ["k00"]
    assert summary["drops"] == {
        "score below threshold": 3, "no score: no caption": 1, "no score: undecodable image": 1,
        "width < 256": 1, "aspect ratio > 2": 1, "caption shorter than 4": 1}
    r = sel.rule
    assert (r["min_width"], r["min_height"], r["max_aspect_ratio"], r["min_caption_length"]) == (256, None, 2.0, 4)
    assert (r["kept"], r["total"]) == (1, 9)


def test_apply_rule_unknowns_fail():
    nan = np.nan
    cols = {"clip_score": [0.5, 0.5, nan], "width": [nan, 100, 100], "height": [nan, 100, 100],
            "caption_length": [nan, 10, nan], "status": ["ok", "ok", "no caption"]}
    keep, drops = apply_rule(cols, threshold=0.1, min_width=10, max_aspect_ratio=1.5)
    assert keep.tolist() == [False, True, False]
    keep, _ = apply_rule(cols, min_caption_length=0)  # no score rule: nulls may pass other rules
    assert keep.tolist() == [True, True, True]
    keep, _ = apply_rule(cols, min_caption_length=1)
    assert keep.tolist() == [False, True, False]


@pytest.mark.parametrize("name", ["sel.parquet", "sel.json", "deeper/sel.bin"])
def test_selection_file_roundtrip(scored, tmp_path, name):
    out = tmp_path / name
    sel, _ = filter_shards(FilterConfig(scored, out, top_fraction=0.4))
    back = load_selection(out)
    assert back.keys == {"k00", "k03", "k04", "k10"}
    assert "k03" in back and "k01" not in back and len(back) == 4
    assert back.shards == {"00000.tar": ["k00", "k03", "k04"], "00001.tar": ["k10"]}
    assert back.rule == sel.rule
    json.dumps(back.rule)  # goes into the store manifest as is
    assert back.rule["clip_model"] == "ViT-B-32" and back.rule["clip_pretrained"] == "laion2b_s34b_b79k"
    assert back.rule["top_fraction"] == 0.4 and back.rule["min_clip_score"] is None
    assert not [p for p in out.parent.iterdir() if imageshards.is_tmp(p)]


def test_load_selection_errors(tmp_path):
    with pytest.raises(DitdataError, match="selection file not found"):
        load_selection(tmp_path / "nope.parquet")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DitdataError, match="not a valid selection"):
        load_selection(bad)
    bad.write_text(json.dumps({"format": "something-else", "shards": {}}))
    with pytest.raises(DitdataError, match="not a ditdata-selection"):
        load_selection(bad)
    bad.write_bytes(b"PAR1 but not parquet")
    with pytest.raises(DitdataError, match="not a valid selection"):
        load_selection(bad)


def test_filter_refuses_unscored_mixed_and_stale(tmp_path):
    d = make_scored(tmp_path / "a")
    score_path(d / "00001.tar").unlink()
    with pytest.raises(DitdataError, match="1 of 2 shards have no complete CLIP scores .*ditdata score"):
        filter_shards(FilterConfig(d, tmp_path / "s.parquet", min_clip_score=0.2))
    d = make_scored(tmp_path / "b")
    one = make_scored(tmp_path / "c", model="ViT-L-14", pretrained="datacomp_xl_s13b_b90k")
    (d / "00001.clip.parquet").write_bytes((one / "00001.clip.parquet").read_bytes())
    with pytest.raises(DitdataError, match="different CLIP models"):
        filter_shards(FilterConfig(d, tmp_path / "s.parquet", min_clip_score=0.2))
    d = make_scored(tmp_path / "d")
    with open(d / "00000.tar", "ab") as f:  # the shard changed after scoring
        f.write(b"\0" * 512)
    with pytest.raises(DitdataError, match="rerun `ditdata score`"):
        filter_shards(FilterConfig(d, tmp_path / "s.parquet", min_clip_score=0.2))


def test_cli_filter(scored, tmp_path):
    out = tmp_path / "keep.parquet"
    ok(CliRunner().invoke(main, ["filter", str(scored), "--top-fraction", "0.4", "--min-width", "200",
                                 "--out", str(out)]),
       "kept 4 / 9 samples (44.4%)", "top 40% of 7 scored -> threshold 0.2800", "<- threshold")
    assert load_selection(out).keys == {"k00", "k03", "k04", "k10"}
    for args, says in ((["--min-clip-score", "0.2", "--top-fraction", "0.3"], "at most one of"),
                       (["--min-aesthetic", "5", "--top-aesthetic-fraction", "0.3"], "at most one of"),
                       ([], "give a rule")):
        r = CliRunner().invoke(main, ["filter", str(scored), *args, "--out", str(out)])
        assert r.exit_code == 2 and says in r.output
    r = CliRunner().invoke(main, ["filter", str(scored), "--top-fraction", "1.5", "--out", str(out)])
    assert r.exit_code == 2
    r = CliRunner().invoke(main, ["filter", str(tmp_path), "--min-clip-score", "0.2", "--out", str(out)])
    assert r.exit_code == 1 and "dataset.json is missing" in r.output


def test_histogram_text():
    scores = [0.1, 0.12, 0.2, 0.25, 0.3, np.nan, 0.31]
    keep = [s >= 0.25 for s in np.nan_to_num(scores)]
    text = histogram(scores, keep, 0.25)
    lines = text.splitlines()
    assert "count" in lines[0] and "kept" in lines[0]
    assert sum(int(line.split(")")[1].split()[0]) for line in lines[1:]) == 6  # NaN left out
    assert sum("<- threshold" in line for line in lines) == 1
    assert histogram([np.nan]) == "  (no scores)"
