"""Several captions per image (issue 37): `ditdata encode --captions alt,SET,...` embeds every set
(ditdata.store.captions), and `dittrain run --caption-mix` draws one per sample per step
(dittrain.train.captionmix), with a tiny random T5 (tests/textenc_util.py) and a tiny CLIP.

- each set of a two-set store holds exactly what a store of that set alone holds (tokens, lengths,
  captions, CLIP scores), zarr fp16 and wds int8; verify, inspect; the joined view of the loaders;
- a set missing from some shard stops the encode before any work, in one line naming it;
- a run killed and encoded again gives a clean run's bytes;
- fixed proportions come out as given over many draws; SANA's CLIP-score rule picks what its
  reference code (NVlabs/Sana's weighted_sample_clipscore, written out below) picks for the same
  uniform draws; the step keeps each sample's chosen tokens;
- a run with --caption-mix resumed after SIGKILL logs an uninterrupted run's losses, records the mix,
  and refuses another mix on resume; an unknown set is one line.
"""

from __future__ import annotations

import bisect
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cliutil import ditdata, dittrain, kill_when, losses, one_error_line, resume_after_sigkill, run_args
from textenc_util import encode_with, save_text_encoder

from ditdata.imageshards import captionsets as cs
from ditdata.imageshards import folder as imageshards
from ditdata.imageshards.scores import read_scores
from ditdata.store import open_store
from ditdata.store.captions import LENGTHS, SCORES, caption_sets
from ditdata.store.schema import ragged_rows
from dittrain.data import ResidentLoader
from dittrain.train.captionmix import CaptionMix, CaptionMixError, Rule, parse

BIN = Path(sys.executable).parent
RECAP = ["a cat sleeping on a red mat in a house", "a dog", None, "many people in a busy city street",
         "a blue house", "a photo of the cat", "a red dog on the street with many people"]


def write_set(tar: Path, name: str, captions) -> None:
    """Caption set `name` of image shard `tar`, its captions cycled from `captions`."""
    keys = [s.key for s in imageshards.iter_shard(tar)]
    caps = [captions[i % len(captions)] for i in range(len(keys))]
    rows = {"key": keys, "caption": caps, "status": ["ok" if c else "empty" for c in caps],
            "tokens": [len((c or "").split()) for c in caps]}
    cs.write_caption_set(cs.caption_set_path(tar, name), rows,
                         {"format": cs.FORMAT, "version": cs.VERSION, "set": name, "shard": tar.name,
                          "shard_bytes": tar.stat().st_size, "num_samples": len(keys)})


def score_sets(d: Path, clip, names) -> None:
    from ditdata.config import ScoreConfig
    from ditdata.scoring.score import score

    config, weights = clip
    for name in names:
        score(ScoreConfig(str(d), clip_config=str(config), pretrained=str(weights), device="cpu", batch_size=4,
                          workers=0, progress=False, captions=name))


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    return save_text_encoder(tmp_path_factory.mktemp("t5") / "t5", "t5")


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    from test_clip import tiny_clip_files

    return tiny_clip_files(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="module")
def scored(tmp_path_factory, clip):
    """Two image shards (test_score's photos) with a second caption set, recap; both sets CLIP-scored."""
    from test_score import caption_shards

    d = caption_shards(tmp_path_factory.mktemp("mix") / "shards")
    for tar in imageshards.list_shards(d):
        write_set(tar, "recap", RECAP)
    score_sets(d, clip, ("alt", "recap"))
    return d


@pytest.fixture(scope="module")
def two_sets(scored, t5, tmp_path_factory):
    """A T5 store of alt and recap, both scored (zarr, fp16)."""
    out = tmp_path_factory.mktemp("store") / "s"
    encode_with(scored, out, t5, captions="alt,recap")
    return out


# ------------------------------------------------------------------------------------------- encode


@pytest.mark.parametrize("backend,dtype", [("zarr", "float16"), ("wds", "int8")])
def test_each_set_holds_what_a_store_of_it_alone_holds(scored, t5, tmp_path, backend, dtype):
    kw = dict(backend=backend, text_dtype=dtype)
    encode_with(scored, tmp_path / "both", t5, captions="alt,recap", **kw)
    encode_with(scored, tmp_path / "alt", t5, captions="alt", **kw)
    encode_with(scored, tmp_path / "recap", t5, captions="recap", **kw)
    both = open_store(tmp_path / "both", verify=True)
    assert both.verify() == []
    alone = {n: open_store(tmp_path / n) for n in ("alt", "recap")}
    scale = ["text_tokens_scale"] if dtype == "int8" else []
    for shard in both.shards:
        data = both.read(shard)
        for name, suffix in (("alt", ""), ("recap", ".recap")):
            ref = alone[name].read(shard.name)
            for f in ["text_tokens", "text_length", *scale, "caption", "clip_score"]:
                got = data[f + suffix]
                if f == "clip_score":
                    np.testing.assert_array_equal(got, ref[f])  # NaN where the caption has no score
                else:
                    assert np.array_equal(got, ref[f]), (name, f)
        # each set's scores are its score files' (NNNNN.clip.parquet, NNNNN.clip.recap.parquet)
        for name, column in (("alt", "clip_score"), ("recap", "clip_score.recap")):
            table, _ = read_scores(scored, captions=name)
            want = dict(zip(table.column("key").to_pylist(), table.column("clip_score").to_pylist(), strict=True))
            got = [None if np.isnan(v) else v for v in data[column]]
            assert got == [want[k] for k in data["key"]]
    text = both.manifest["conditioning"]["text"]
    assert text["caption_set"] == "alt" and [s["name"] for s in text["caption_sets"]] == ["alt", "recap"]
    recap = caption_sets(both)[1]
    assert (recap.tokens, recap.length, recap.caption, recap.clip_score) == (
        "text_tokens.recap", "text_length.recap", "caption.recap", "clip_score.recap")
    assert recap.scale == ("text_tokens_scale.recap" if dtype == "int8" else None)
    assert recap.clip["weights_sha256"] and recap.scored_shards == 2
    assert both.manifest["ragged"]["text_length.recap"] == alone["recap"].manifest["ragged"]["text_length"]
    r = ditdata("verify", tmp_path / "both")
    assert r.exit_code == 0, r.output
    r = ditdata("inspect", tmp_path / "both")
    assert r.exit_code == 0 and "caption sets: 2 per image" in r.output and "text_tokens.recap" in r.output


def test_the_joined_view_holds_each_sets_tokens_one_after_the_other(two_sets):
    """What --caption-mix hands the loaders: per sample recap's tokens, then alt's; each set's length
    and CLIP score (NaN: none) beside them; the same store (identity) otherwise."""
    store = open_store(two_sets)
    view = open_store(two_sets, captions=["recap", "alt"])
    assert view.identity == store.identity and len(view) == len(store)
    for shard in store.shards:
        data = store.read(shard)
        stop = min(6, shard.num_samples)
        joined = view.read(shard, start=1, stop=stop)
        rows = np.arange(1, stop)
        recap = ragged_rows(data["text_tokens.recap"], data["text_length.recap"], rows)
        alt = ragged_rows(data["text_tokens"], data["text_length"], rows)
        want, a, b = [], 0, 0
        for i in rows:
            n, m = data["text_length.recap"][i], data["text_length"][i]
            want += [recap[a:a + n], alt[b:b + m]]
            a, b = a + n, b + m
        assert np.array_equal(joined["text_tokens"], np.concatenate(want))
        assert joined[LENGTHS].tolist() == np.stack([data["text_length.recap"], data["text_length"]], 1)[rows].tolist()
        assert joined["text_length"].tolist() == joined[LENGTHS].sum(1).tolist()
        scores = np.stack([data["clip_score.recap"], data["clip_score"]], 1)[rows].astype(np.float32)
        np.testing.assert_array_equal(joined[SCORES], scores)
        assert list(joined["caption"]) == list(data["caption"][rows])
    with pytest.raises(Exception, match="no caption set nope"):
        open_store(two_sets, captions=["alt", "nope"])


def test_a_missing_caption_set_stops_encode_before_any_work_in_one_line(scored, t5, tmp_path):
    d = tmp_path / "shards"
    shutil.copytree(scored, d)
    tars = imageshards.list_shards(d)
    write_set(tars[0], "other", RECAP)  # on the first shard only
    r = ditdata("encode", d, "--out", tmp_path / "s", "--vae", "pixels", "--resolution", "16", "--device", "cpu",
                "--workers", "0", "--text-encoder", t5, "--captions", "alt,recap,other,more")
    assert r.exit_code != 0
    line = one_error_line(r.output)
    assert "'other' for 1 of 2 shards (00001.tar)" in line and "'more' for 2 of 2 shards" in line, line
    assert "'recap'" not in line and "ditdata caption" in line
    assert not (tmp_path / "s" / "shards").exists() or not any((tmp_path / "s" / "shards").iterdir())
    r = ditdata("encode", d, "--out", tmp_path / "s2", "--vae", "pixels", "--resolution", "16", "--text-encoder",
                t5, "--captions", "alt,recap,alt")
    assert r.exit_code != 0 and "alt named twice" in one_error_line(r.output)


def test_killed_encode_of_two_sets_resumes_to_a_clean_runs_bytes(t5, clip, tmp_path):
    from test_score import jpeg, make_shards
    from tiny import real_images

    images = list(real_images().values())
    samples = [{"key": f"{i:06d}", "image": jpeg(images[i % 4][i:, :][:96, :96]),
                "caption": f"a photo of the cat {i}"} for i in range(24)]
    d = make_shards(tmp_path / "shards", [samples[i:i + 2] for i in range(0, 24, 2)])  # 12 shards
    for tar in imageshards.list_shards(d):
        write_set(tar, "recap", RECAP)
    score_sets(d, clip, ("recap",))
    args = [BIN / "ditdata", "encode", d, "--vae", "pixels", "--resolution", "16", "--device", "cpu", "--workers",
            "1", "--batch-size", "1", "--text-encoder", t5, "--captions", "recap,alt", "--text-dtype", "int8",
            "--backend", "wds"]
    proc = subprocess.Popen([*args, "--out", tmp_path / "s"], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    records = tmp_path / "s" / "shards"
    kill_when(proc, lambda: len(list(records.glob("*.json"))) >= 3, timeout=120,
              too_late="encode finished before it could be killed")
    assert 3 <= len(list(records.glob("*.json"))) < 12 and not (tmp_path / "s" / "manifest.json").exists()
    r = subprocess.run([*args, "--out", tmp_path / "s"], capture_output=True, text=True)
    assert r.returncode == 0 and "already done" in r.stdout, r.stderr
    subprocess.run([*args, "--out", tmp_path / "clean"], check=True, capture_output=True)
    killed, clean = open_store(tmp_path / "s", verify=True), open_store(tmp_path / "clean")
    assert [s.record["checksum"] for s in killed.shards] == [s.record["checksum"] for s in clean.shards]
    assert killed.identity == clean.identity and killed.verify() == []
    assert [s.name for s in caption_sets(killed)] == ["recap", "alt"]


# ------------------------------------------------------------------------------------------- the draws


def test_fixed_proportions_over_many_draws():
    mix = CaptionMix(parse("alt=0.2,recap=0.8,none=0"), ["alt", "recap", "none"], seed=7, record={})
    scores = torch.full((512, 3), float("nan"))
    counts = torch.zeros(3)
    for k in range(200):  # 102,400 draws
        counts += torch.bincount(mix.choose(mix.uniforms(k, 512, "cpu"), scores), minlength=3)
    share = counts / counts.sum()
    assert abs(share[0] - 0.2) < 0.005 and abs(share[1] - 0.8) < 0.005 and share[2] == 0
    # seeded by (seed, batch index): the same draw again, another batch index or seed draws otherwise
    assert torch.equal(mix.uniforms(3, 16, "cpu"), mix.uniforms(3, 16, "cpu"))
    assert not torch.equal(mix.uniforms(3, 16, "cpu"), mix.uniforms(4, 16, "cpu"))
    other = CaptionMix(parse("alt=0.2,recap=0.8,none=0"), ["alt", "recap", "none"], seed=8, record={})
    assert not torch.equal(mix.uniforms(3, 16, "cpu"), other.uniforms(3, 16, "cpu"))


def sana_weighted_sample_clipscore(scores: list, labels: list, u: float, clip_thr: float, temperature: float,
                                   default: str) -> str:
    """NVlabs/Sana @ aa1b69a, diffusion/data/datasets/sana_data.py, SanaWebDataset.weighted_sample_clipscore,
    written out with the caption types in `labels` order, their scores (None: no score for this image) and
    random.random() replaced by `u` (random.choices: bisect(cum_weights, random() * total, 0, n - 1))."""
    cand, weights, fallback, best = [], [], None, float("-inf")
    for label, score in zip(labels, scores, strict=True):
        if score is None:
            continue
        if score >= clip_thr:
            cand.append(label)
            weights.append(score)
        if score > best:
            best, fallback = score, label
    if not cand and fallback:
        return fallback
    if not cand:
        return default
    adjusted = np.array(weights, dtype=np.float64) ** (1.0 / max(temperature, 0.01))
    normalized = adjusted / np.sum(adjusted)
    cum = list(np.cumsum(normalized))
    return cand[bisect.bisect(cum, u * cum[-1], 0, len(cand) - 1)]


@pytest.mark.parametrize("temperature,threshold", [(0.1, 0.25), (1.0, 0.0), (0.5, 0.3)])
def test_the_clip_score_rule_picks_what_sanas_code_picks(temperature, threshold):
    labels = ["alt", "recap", "florence"]
    mix = CaptionMix(Rule(None, temperature, threshold), labels, seed=0, record={})
    gen = np.random.default_rng(1)
    scores = gen.uniform(0.15, 0.4, (4000, 3)).astype(np.float32)
    scores[gen.random((4000, 3)) < 0.2] = np.nan  # no score for that caption (no caption, undecodable image)
    scores[:50] = np.nan  # no score at all: the first set
    scores[50:100, 1] = scores[50:100, 2] = scores[50:100, 0]  # ties: the first of equal ones
    u = mix.uniforms(0, 4000, "cpu")
    got = mix.choose(u, torch.from_numpy(scores)).tolist()
    want = [labels.index(sana_weighted_sample_clipscore(
        [None if np.isnan(v) else float(v) for v in row], labels, float(x), threshold, temperature, labels[0]))
        for row, x in zip(scores, u.tolist(), strict=True)]
    assert got == want
    assert set(got[:50]) == {0}


def test_the_clip_score_rule_draws_in_its_formulas_proportions():
    """score ** (1/T) over the sets scoring >= the threshold; a set below it is never drawn."""
    mix = CaptionMix(Rule(None, 0.1, 0.25), ["a", "b", "c"], seed=0, record={})
    row = torch.tensor([[0.30, 0.27, 0.24]])
    picks = torch.cat([mix.choose(mix.uniforms(k, 1000, "cpu"), row.expand(1000, 3)) for k in range(40)])
    share = torch.bincount(picks, minlength=3).float() / len(picks)
    p = torch.tensor([0.30, 0.27]) ** 10
    assert share[2] == 0 and abs(share[0] - p[0] / p.sum()) < 0.01
    # nothing scores the threshold: the best-scored set, whatever the draw
    low = torch.tensor([[0.20, 0.22, float("nan")]]).expand(100, 3)
    assert mix.choose(mix.uniforms(0, 100, "cpu"), low).tolist() == [1] * 100


def test_the_step_keeps_each_samples_chosen_tokens(two_sets):
    """pick: each row's tokens are its drawn set's (the view holds recap's then alt's), padded to the
    longest chosen caption; the joined fields are gone."""
    store = open_store(two_sets)
    truth = {}
    for shard in store.shards:
        data = store.read(shard)
        for i in range(shard.num_samples):
            truth[shard.offset + i] = [ragged_rows(data[f], data[n], [i]).astype(np.float32) for f, n in (
                ("text_tokens.recap", "text_length.recap"), ("text_tokens", "text_length"))]
    mix = CaptionMix(parse("recap=0.5,alt=0.5"), ["recap", "alt"], seed=0, record={})
    loader = ResidentLoader(mix.view(store), batch_size=4, with_index=True, seed=2)
    seen = set()
    for k in range(8):
        batch = mix.pick(next(loader), k, 8, slice(4, 8))  # rank 1 of 2: rows 4..7 of the global micro-batch
        choice = mix.choose(mix.uniforms(k, 8, "cpu")[4:], torch.zeros(4, 2))
        assert LENGTHS not in batch and SCORES not in batch
        lengths = batch["text_mask"].sum(1)
        assert batch["text_tokens"].shape[1] == int(lengths.max())
        for r, i in enumerate(batch["index"].tolist()):
            want = torch.from_numpy(truth[i][int(choice[r])])
            assert int(lengths[r]) == len(want) and torch.equal(batch["text_tokens"][r, :len(want)], want)
            assert (batch["text_tokens"][r, len(want):] == 0).all()
            seen.add(int(choice[r]))
    assert seen == {0, 1}


def test_parse_refuses_what_it_cannot_read():
    assert parse("") is None and parse("clip-score") == Rule(None, 0.1, 0.25)
    assert parse("clip-score:temperature=0.5,threshold=0.2") == Rule(None, 0.5, 0.2)
    assert parse(" alt=1, recap=3 ").weights == {"alt": 1.0, "recap": 3.0}
    for bad in ("alt", "alt=x", "alt=-1", "alt=0", "alt=1,alt=2", "clip-score:t=1", "clip-score:temperature=0",
                "clip-score:threshold=-0.1", "alt=inf"):
        with pytest.raises(CaptionMixError):
            parse(bad)


# ------------------------------------------------------------------------------------------- training


def test_a_run_with_a_caption_mix_resumes_to_the_same_draws(two_sets, tmp_path):
    """SIGKILL at step 14 and --resume: every step's loss as an uninterrupted run's (the losses depend on
    the captions drawn); config.json records the mix; another mix on resume is refused; a set the store
    lacks, or a mix on a store without caption sets, is one line."""
    resume_after_sigkill(two_sets, tmp_path, ["--max-steps", 30, "--save-every", 14, "--batch-size", 4,
                                              "--caption-mix", "clip-score:temperature=0.5,threshold=0.1",
                                              "--caption-dropout", 0.1], steps=30, half=14)
    cfg = json.loads((tmp_path / "killed" / "config.json").read_text())
    assert cfg["train"]["data"]["caption_mix"] == "clip-score:temperature=0.5,threshold=0.1"
    mix = cfg["store"]["caption_mix"]
    assert mix["rule"] == "clip-score" and mix["sets"] == ["alt", "recap"] and mix["temperature"] == 0.5
    r = dittrain("run", "--resume", "--out", tmp_path / "killed", "--caption-mix", "alt=1", "--max-steps", 31)
    assert r.exit_code != 0 and "--allow-changes" in r.output and "caption_mix" in r.output.replace("-", "_"), r.output
    r = dittrain(*run_args(two_sets, tmp_path / "bad", "--max-steps", 2, "--caption-mix", "alt=1,nope=1"))
    assert r.exit_code != 0
    assert "no caption set nope; it holds alt, recap" in one_error_line(r.output)


def test_the_draw_decides_the_loss(two_sets, tmp_path):
    """alt only and recap only train on different text (the mix reaches the model); recap=1 is not
    the default run (the store's first set, alt), alt=1 is."""
    def first_losses(out, *extra):
        r = dittrain(*run_args(two_sets, out, "--max-steps", 3, "--batch-size", 4, "--log-every", 1,
                               "--caption-dropout", 0, *extra))
        assert r.exit_code == 0, r.output
        return [loss for _, loss in losses(out)]

    plain = first_losses(tmp_path / "plain")
    assert first_losses(tmp_path / "alt", "--caption-mix", "alt=1") == plain
    assert first_losses(tmp_path / "recap", "--caption-mix", "recap=1") != plain
