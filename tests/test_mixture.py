"""Several latent stores mixed (dittrain.data.mixture, `dittrain run --latents A --latents B:R`): the
mixture's counts per epoch, its exact resume (as the loaders' own resume tests), DDP ranks, the checks
that name the store that differs, the shared memory budget, and the run: config.json, resume rules,
config files; one --latents stays exactly as before."""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest
import torch
from cliutil import dittrain, run_args
from storeutil import (
    INFO,
    LOADERS,
    batch_split,
    bucketed_store,
    class_conditioning,
    latent_data,
    make_store,
    pixels_info,
    resumed,
    schema,
    take,
    write_store,
)

import dittrain.data as data
from dittrain import config
from dittrain.config import LoaderConfig
from dittrain.data import LoaderError, build_mixture
from dittrain.data.mixture import per_epoch, pooled_latent_record
from dittrain.rundir import latest_checkpoint, load_checkpoint
from dittrain.train import resume

B = 8
REPEATS = [1.0, 0.5]  # a: 30 samples once per epoch; b: 12 samples, half of them per epoch (6)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Two class-conditioned pixels stores of 3x8x8 latents: a (30 in 3 shards), b (12 in 2 shards)."""
    root = tmp_path_factory.mktemp("mix")
    return make_store(root / "a", n=30, shards=3, seed=1), make_store(root / "b", n=12, shards=2, seed=2)


def mixture(stores, kind="resident", workers=0, *, repeats=REPEATS, batch_size=B, **kw):
    settings = LoaderConfig(kind=kind, workers=workers, shuffle_window=1, with_index=True, split=kw.pop("split", "part"))
    return build_mixture(list(stores), repeats, settings, batch_size=batch_size, seed=kw.pop("seed", 3), **kw)


def pairs(batches) -> list[tuple[int, int]]:
    """(store, row in it) of every sample of the batches, in order."""
    return [(int(s), int(i)) for b in batches for s, i in zip(b["store"], b["index"], strict=True)]


@pytest.mark.parametrize("kind,workers", LOADERS)
def test_each_store_gives_its_share_and_resumes_exactly(two, kind, workers):
    """Batches of 6: an epoch is 5 batches of a (its 30 samples once) and 1 of b (half of its 12), in a
    seeded order, every batch one store's next batch; every sample of b within two epochs; a mixture
    stopped at batch 7 (inside epoch 1) and resumed gives the same next batches."""
    assert per_epoch([30, 12], REPEATS, 6) == [5, 1]
    straight, again, state = resumed(partial(mixture, two, kind, workers, batch_size=6), 12, 7)
    assert state["batches"] == 7 and state["kind"] == "mixture" and (state["epoch"], state["offset"]) == (1, 6)
    for want, got in zip(straight, again, strict=True):
        assert want.keys() == got.keys() == {"x", "y", "index", "flip", "store"}
        assert all(torch.equal(want[k], got[k]) for k in want)
    assert all(len(set(b["store"].tolist())) == 1 for b in straight)  # one store per batch
    seen = pairs(straight)
    for e in range(2):
        epoch = seen[e * 36:(e + 1) * 36]
        assert sorted(i for s, i in epoch if s == 0) == list(range(30))  # a: every sample once
        assert sum(1 for s, _ in epoch if s == 1) == 6
    assert sorted(i for s, i in seen if s == 1) == list(range(12))  # b: all of it in two epochs
    # each batch is its store's own loader's next batch (x, flips and all)
    with mixture(two, kind, workers, batch_size=6) as fresh:
        for i, own in enumerate(fresh.parts):
            mine = [b for b in straight if int(b["store"][0]) == i]
            assert all(torch.equal(b["x"], o["x"]) for b, o in zip(mine, take(own, len(mine)), strict=True))


def test_ranks_resume_each_other_and_split_batch_is_one_process(two):
    """split='part': rank 0's state resumes rank 1 exactly; split='batch': the two ranks' rows are
    the one-process batch of 2B."""
    with mixture(two, rank=1, world_size=2) as straight:
        want = take(straight, 7)
    with mixture(two, rank=0, world_size=2) as r0:
        take(r0, 3)
        state = r0.state_dict()
    with mixture(two, rank=1, world_size=2) as r1:
        r1.load_state_dict(state)
        got = take(r1, 4)
    assert all(torch.equal(w["x"], g["x"]) for w, g in zip(want[3:], got, strict=True))
    whole, (h0, h1) = batch_split(partial(mixture, two), 5, B)
    for w, a, b in zip(whole, h0, h1, strict=True):
        assert all(torch.equal(w[k], torch.cat([a[k], b[k]])) for k in w)


def test_a_state_of_other_repeats_is_refused_or_continued_approximately(two):
    with mixture(two) as m:
        take(m, 3)
        state = m.state_dict()
    other = mixture(two, repeats=[1.0, 2.0])
    with pytest.raises(data.LoaderStateError, match="repeats"):
        other.load_state_dict(state)
    other.load_state_dict(state, strict=False)
    assert other.batches == 3 and next(other)["x"].shape == (B, 3, 8, 8)


def test_stores_that_cannot_be_mixed_are_named_in_one_line(two, tmp_path):
    a, _ = two
    wide = make_store(tmp_path / "wide", n=6, shards=1, shape=(3, 16, 16))
    four = tmp_path / "four"
    write_store(four, schema(shape=(3, 8, 8), flip=False, text=False, columns={"key": "string", "label": "int64"}),
                [6], info=pixels_info(8, class_conditioning(["a", "b", "c", "d"])), data=latent_data(5))
    other_vae = tmp_path / "vae"
    write_store(other_vae, schema(shape=(3, 8, 8), flip=False, text=False, columns={"key": "string", "label": "int64"}),
                [6], info={**INFO, "vae": {**INFO["vae"], "latent_channels": 3},
                           "conditioning": class_conditioning(["a", "b", "c"])}, data=latent_data(6))
    buckets = bucketed_store(tmp_path / "buckets", {(16, 16): 4})
    for bad, words in ((wide, "latent shape 3x16x16, not 3x8x8"), (four, "4 classes, not 3"),
                       (other_vae, "autoencoder"), (buckets, "bucketed store")):
        with pytest.raises(LoaderError, match=words) as e:
            mixture([a, bad])
        assert str(bad) in str(e.value) and "\n" not in str(e.value)


def test_the_stores_share_the_memory(two, monkeypatch):
    """auto holds the smallest stores while they fit TOGETHER, streams the rest; an explicit resident
    mixture that does not fit together is refused; streaming stores split the memory budget."""
    a, b = (data.base._open(s) for s in two)
    need = [len(s) * data.base._Spec(s).resident_bytes for s in (a, b)]
    monkeypatch.setattr(data.budget, "available_memory", lambda: (int(sum(need) / 1.05), "fake"))  # b alone fits
    choices, why = data.choose_mixture([a, b])
    assert [c[0] for c in choices] == ["streaming", "resident"] and "1 of 2 stores held" in why
    with pytest.raises(LoaderError, match="loader 'resident' needs"):
        data.choose_mixture([a, b], kind="resident")
    choices, why = data.choose_mixture([a, b], kind="streaming", memory="64MiB")
    assert [c[2] for c in choices] == [32 * 2**20] * 2 and "share the loader budget" in why


def test_latent_stats_pool_over_the_stores(two):
    stores = [data.base._open(s) for s in two]
    pooled = pooled_latent_record(stores, "channel")  # by each store's count, whatever the repeats
    counts = [s.manifest["stats"]["count"] for s in stores]
    means = np.array([s.manifest["stats"]["mean"] for s in stores])
    stds = np.array([s.manifest["stats"]["std"] for s in stores])
    assert pooled["stats_count"] == sum(counts)
    w = np.array(counts) / sum(counts)
    mean = w @ means
    np.testing.assert_allclose(pooled["mean"], mean)
    np.testing.assert_allclose(pooled["std"], np.sqrt(w @ (stds**2 + means**2) - mean**2))
    assert pooled_latent_record(stores, "none") == {"norm": "none"}


def test_latents_parse_and_resume_rules():
    assert config.latent_sources(["a", "s3://b/x:0.3", "http://h:80/s", "c:2"]) == [
        ("a", None), ("s3://b/x", 0.3), ("http://h:80/s", None), ("c", 2.0)]
    for bad in ("b:0", "b:-1", "b:nan", "b:inf"):
        with pytest.raises(ValueError, match="positive number"):
            config.latent_sources(["a", bad])
    assert config.latents_value(("a",)) == "a" and config.latents_value(()) == "" and config.latents_value(
        ("a", "b:2")) == ["a", "b:2"]
    rec = config.TrainConfig.from_flat(latents=["a", "b:0.3"])
    assert resume.kind("latents", rec, ["/x/a", "/x/b:0.3"]) == "safe"  # moved stores
    assert resume.kind("latents", rec, ["a", "b:0.5"]) == "learned"  # other repeats
    assert resume.kind("latents", config.TrainConfig.from_flat(latents="a"), "/moved/a") == "safe"


def test_a_mixed_run_records_resumes_exactly_and_keeps_its_stores(two, tmp_path):
    """From the command line and from a config file: config.json records the list and each store's
    identity and repeats; 2 + resume + 2 steps equal 4 straight; a bare --resume finds the stores; other
    repeats are a learned change; another list of stores is refused; one store records its plain string."""
    a, b = two
    common = ["--max-steps", 4, "--save-every", 2, "--loader", "resident", "--lr", "1e-3"]
    r = dittrain(*run_args(a, tmp_path / "straight", "--latents", f"{b}:0.5", *common))
    assert r.exit_code == 0, r.output
    assert "mixture: 2 stores, 5 batches of 8 (40 samples) per epoch" in r.output and "x0.5: 1 batches = 8" in r.output
    record = json.loads((tmp_path / "straight" / "config.json").read_text())
    assert record["train"]["data"]["latents"] == [str(a), f"{b}:0.5"]
    assert [(m["path"], m["repeats"]) for m in record["store"]["mixture"]] == [(str(a), 1.0), (str(b), 0.5)]
    assert record["store"]["path"] == str(a)  # the run's store: what sampling opens
    cfg_file = tmp_path / "run.toml"
    cfg_file.write_text(f'[data]\nlatents = ["{a}", "{b}:0.5"]\n')
    args = run_args(a, tmp_path / "half", "--max-steps", 2, *common[2:])
    r = dittrain(*args[:1], *args[3:], "--config", cfg_file)  # the stores from the file alone
    assert r.exit_code == 0, r.output
    r = dittrain("run", "--resume", "--out", tmp_path / "half", "--max-steps", 4)
    assert r.exit_code == 0, r.output
    want, got = (load_checkpoint(latest_checkpoint(tmp_path / d)) for d in ("straight", "half"))
    assert all(torch.equal(want["model"][k], got["model"][k]) for k in want["model"])
    r = dittrain("run", "--resume", "--out", tmp_path / "half", "--max-steps", 6, "--latents", a, "--latents", f"{b}:2")
    assert r.exit_code == 1 and "changes what is learned: --latents" in r.output
    r = dittrain("run", "--resume", "--out", tmp_path / "half", "--max-steps", 6, "--latents", b, "--latents", f"{a}:0.5")
    assert r.exit_code == 1 and "store 1 of its --latents is another store" in r.output
    r = dittrain("run", "--resume", "--out", tmp_path / "half", "--max-steps", 6, "--latents", a)
    assert r.exit_code == 1 and "trained on 2 store(s), this run names 1" in r.output
    r = dittrain(*run_args(a, tmp_path / "one", "--max-steps", 1, "--loader", "resident"))
    assert r.exit_code == 0, r.output
    record = json.loads((tmp_path / "one" / "config.json").read_text())
    assert record["train"]["data"]["latents"] == str(a) and "mixture" not in record["store"]
