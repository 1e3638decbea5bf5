"""What the trainer's EMA grids show: --sample-classes and --sample-prompts (dittrain.train.log.watched,
dittrain.inference.sample.write_training_grid): the grid shows exactly those conditions, with the
same noise every grid, the setting is recorded, and a bad list or file is one line before anything is
written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cliutil import dittrain, one_error_line, run_args
from storeutil import SAMPLE_CLASSES, tiny_store

from ditdata.store import open_store
from dittrain.config import SampleConfig
from dittrain.inference.sample import write_training_grid
from dittrain.inference.weights import load_weights
from dittrain.model.dit import DiT
from dittrain.model.sizes import get_config


def read_png(path) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"))


def ema_grids(run: Path, store: Path):
    """draw(path, **condition): the grid that run's EMA draws at `path` for `condition` (labels= or
    text=) over `store` with the trainer's grid settings (2 steps, seed 3), read back as an image."""
    weights, config = load_weights(run)
    keys = ("input_size", "in_channels", "num_classes", "learn_sigma", "text_pooled_dim", "text_token_dim")
    model = DiT(get_config(config["train"]["model"]["model"], **{k: config["model"][k] for k in keys}))
    model.load_state_dict(weights)
    model.eval()
    st, settings = open_store(store), SampleConfig(steps=2, seed=3)

    def draw(path: Path, **condition) -> np.ndarray:
        return read_png(write_training_grid(model, config, st, path, settings, device="cpu", **condition))

    return draw


def trained(store: Path, out: Path, *extra) -> Path:
    # three steps at a large lr with the EMA the model itself: a fresh DiT ignores its condition (adaLN-Zero)
    args = run_args(store, out, "--max-steps", 3, "--sample-steps", 2, "--batch-size", 2, "--ema", 0, "--lr", 0.01,
                    *extra)
    args[args.index("--sample-every") + 1] = "3"  # one grid, at the end
    r = dittrain(*args)
    assert r.exit_code == 0, r.output
    return out


def test_sample_classes_are_what_the_grid_shows(tmp_path):
    store = tiny_store(tmp_path / "store", n=4)
    run = trained(store, tmp_path / "run", "--sample-classes", f"2,{SAMPLE_CLASSES[0]},2")
    record = json.loads((run / "config.json").read_text())
    assert record["train"]["logging"]["sample_classes"] == f"2,{SAMPLE_CLASSES[0]},2"
    shown = read_png(run / "samples" / "step_00000003.png")
    assert shown.shape == (2 * 18 + 2, 2 * 18 + 2, 3)  # 3 samples, 2 per row
    draw = ema_grids(run, store)
    assert np.array_equal(draw(tmp_path / "a.png", labels=[2, 0, 2]), shown)  # those classes, the seed's noise
    assert not np.array_equal(draw(tmp_path / "b.png", labels=[1, 0, 2]), shown)  # the class is what differs


@pytest.mark.parametrize("flags, needles", [
    (("--sample-classes", "7"), ("--sample-classes", "class 7 is out of range")),
    (("--sample-classes", "giraffe"), ("--sample-classes", "unknown class 'giraffe'")),
    (("--sample-classes", ","), ("names no class",)),
    (("--sample-prompts", "prompts.txt"), ("--sample-prompts", "class-conditioned", "--sample-classes")),
])
def test_a_bad_watch_list_is_one_line_and_nothing_is_written(tmp_path, monkeypatch, flags, needles):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.txt").write_text("a cat\n")
    store = tiny_store(tmp_path / "store", n=4)
    r = dittrain(*run_args(store, tmp_path / "run", "--max-steps", 1, *flags))
    line = one_error_line(r.output)
    for needle in needles:
        assert needle in line, line
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def text_store(tmp_path: Path) -> Path:
    from test_clip import tiny_clip_conditioning  # skips the test without open_clip

    conditioning, _ = tiny_clip_conditioning(tmp_path, name="tiny-clip-watch", text_width=24)
    return tiny_store(tmp_path / "store", conditioning=conditioning, text={"pooled": 32, "tokens": (77, 24)}, n=4)


def test_sample_prompts_are_embedded_once_and_shown(tmp_path, monkeypatch):
    store = text_store(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# what to watch\na red fox\n\n  a cat on a mat  \na lighthouse at dusk\n", encoding="utf-8")
    run = trained(store, tmp_path / "run", "--sample-prompts", prompts)
    assert json.loads((run / "config.json").read_text())["train"]["logging"]["sample_prompts"] == str(prompts)
    shown = read_png(run / "samples" / "step_00000003.png")
    assert shown.shape == (2 * 18 + 2, 2 * 18 + 2, 3)  # 3 prompts, 2 per row
    from dittrain.inference.sample import embed_prompts

    draw, st = ema_grids(run, store), open_store(store)
    for lines, same in ((["a red fox", "a cat on a mat", "a lighthouse at dusk"], True),
                        (["a red fox", "a dog on a mat", "a lighthouse at dusk"], False)):
        text = embed_prompts(st, lines, tokens=True)
        assert np.array_equal(draw(tmp_path / "g.png", text=text), shown) is same
    # a missing or empty file, or prompts on a text run given as classes: one line, before anything is written
    (tmp_path / "empty.txt").write_text("\n# nothing\n")
    for flags, needle in ((("--sample-prompts", tmp_path / "nowhere.txt"), "cannot read it"),
                          (("--sample-prompts", tmp_path / "empty.txt"), "no prompts in it"),
                          (("--sample-classes", "1"), "text-conditioned")):
        r = dittrain(*run_args(store, tmp_path / "bad", "--max-steps", 1, *flags))
        assert needle in one_error_line(r.output)
        assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())
    # the encoder's weights are gone: one line before training, naming how to say where they are
    Path(json.loads((store / "manifest.json").read_text())["conditioning"]["text"]["pretrained"]).rename(
        tmp_path / "elsewhere.pt")
    r = dittrain(*run_args(store, tmp_path / "bad", "--max-steps", 1, "--sample-prompts", prompts))
    assert "--text-pretrained" in one_error_line(r.output)
