"""dittrain/inference/sample.py and `dittrain sample`: tiny stores (pixels, TAEF2, text), a fabricated
"trained" run (random DiT-T weights exported with export_weights), PNGs end to end."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from cliutil import dittrain, ok
from PIL import Image
from storeutil import SAMPLE_CLASSES, tiny_store
from tiny import nudged

from ditdata.store import open_store
from dittrain.config import SampleConfig
from dittrain.diffusion import DiffusionConfig
from dittrain.inference.open_run import SampleError, open_run_store
from dittrain.inference.sample import make_grid, output_paths, parse_classes, sample_images, write_training_grid
from dittrain.inference.weights import load_weights
from dittrain.model.dit import DiT
from dittrain.model.sizes import get_config
from dittrain.rundir import export_weights, save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def make_run(run_dir: Path, store_root: Path, *, model="DiT-T/4", objective="ddpm", seed=0,
             perturb=True, **model_kw) -> Path:
    """A run directory with ema.safetensors, as the trainer leaves it, for a DiT built from
    the store's manifest. perturb: the adaLN-Zero init outputs exactly zero whatever the
    class, so nudge the weights to make outputs depend on the conditioning."""
    store = open_store(store_root)
    c, h, _ = store.latent_shape
    cond = store.manifest["conditioning"]
    learn_sigma = objective == "ddpm"
    kw = dict(input_size=h, in_channels=c, learn_sigma=learn_sigma,
              num_classes=cond.get("num_classes") or 0 if cond["type"] == "class" else 0)
    kw |= model_kw
    torch.manual_seed(seed)
    dit = DiT(get_config(model, **kw))
    if perturb:
        nudged(dit, 0.02)
    config = {
        "train": {"model": {"model": model}, "diffusion": {"objective": objective}, "optim": {"seed": seed}},
        "model": asdict(dit.config),
        "diffusion": asdict(DiffusionConfig(objective=objective, learn_sigma=learn_sigma)),
        "store": {"path": str(store_root.resolve()), "identity": store.identity, "num_samples": len(store)},
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    export_weights(run_dir / "ema.safetensors", dit.state_dict(), config)
    return run_dir


def cli(*args):
    return dittrain("sample", *args)


def read_png(path) -> np.ndarray:
    with Image.open(path) as im:
        assert im.format == "PNG"
        return np.asarray(im.convert("RGB"))


def one_line_error(result, *needles):
    assert result.exit_code != 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("Error: "), result.output
    err = lines[-1]
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in err, err
    return err


# -----------------------------------------------------------------------------
# end to end


def test_sample_png_grid_and_singles(pixel_run, tmp_path):
    run, _ = pixel_run
    out = tmp_path / "grid.png"
    r = ok(cli("--ckpt", run, "--out", out, "--class", 1, "--class", "coffee", "--n", 6, "--steps", 4,
               "--cfg", 4.0, "--device", "cpu"))
    # NAME.png -> grid at NAME.png, singles in NAME/
    grid = read_png(out)
    # 6 samples, ceil(sqrt(6)) = 3 per row -> 2 rows x 3 cols of 16 px tiles, 2 px padding
    assert grid.shape == (2 * 18 + 2, 3 * 18 + 2, 3)
    singles = sorted((tmp_path / "grid").glob("*.png"))
    assert [p.name for p in singles] == [f"{i:04d}.png" for i in range(6)]
    tiles = [read_png(p) for p in singles]
    assert all(t.shape == (16, 16, 3) for t in tiles)
    # the singles are the grid's tiles, in order
    for i, t in enumerate(tiles):
        r0, c0 = divmod(i, 3)
        assert np.array_equal(grid[2 + r0 * 18: 2 + r0 * 18 + 16, 2 + c0 * 18: 2 + c0 * 18 + 16], t)
    index = json.loads((tmp_path / "grid" / "samples.json").read_text())
    assert [s["class"] for s in index["samples"]] == [1, 2, 1, 2, 1, 2]  # --class cycled over --n
    assert index["samples"][1]["class_name"] == "coffee"
    assert index["seed"] == 0 and index["steps"] == 4 and index["sampler"] == "ddpm"
    assert str(out) in r.output and str(tmp_path / "grid") in r.output  # says where files went


def test_deterministic_for_a_seed(pixel_run, tmp_path):
    run, _ = pixel_run
    outs = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        r = cli("--ckpt", run, "--out", tmp_path / name, "--n", 4, "--steps", 3, "--seed", seed,
                "--device", "cpu")
        assert r.exit_code == 0, r.output
        outs[name] = read_png(tmp_path / name / "grid.png")
        labels = [s["class"] for s in json.loads((tmp_path / name / "samples" / "samples.json").read_text())["samples"]]
        outs[name + "labels"] = labels
    assert np.array_equal(outs["a"], outs["b"]) and outs["alabels"] == outs["blabels"]
    assert not np.array_equal(outs["a"], outs["c"])
    # DIR -> DIR/grid.png + DIR/samples/NNNN.png
    assert sorted(p.name for p in (tmp_path / "a" / "samples").glob("*.png")) == [f"{i:04d}.png" for i in range(4)]


def test_batch_size_does_not_change_deterministic_samplers(pixel_run):
    run, store_root = pixel_run
    weights, config = load_weights(run)
    store, note = open_run_store(config)
    assert note is None
    kw = dict(labels=[0, 1, 2, 0, 1], device="cpu")
    ddim = SampleConfig(steps=3, sampler="ddim", seed=7)
    a = sample_images(weights, config, store, replace(ddim, batch_size=5), **kw)
    b = sample_images(weights, config, store, replace(ddim, batch_size=2), **kw)
    assert a.dtype == np.uint8 and a.shape == (5, 16, 16, 3)
    assert np.abs(a.astype(int) - b.astype(int)).max() <= 1  # same noise, per-batch float rounding
    # the trainer's path: the EMA module itself, left in the mode it was in
    model = DiT(get_config(config["train"]["model"]["model"], **{k: config["model"][k] for k in (
        "input_size", "in_channels", "num_classes", "learn_sigma")}))
    model.load_state_dict(weights)
    model.train()
    c = sample_images(model, config, store, replace(ddim, batch_size=5), **kw)
    assert model.training and np.array_equal(a, c)
    # the class matters: same seed and noise, other labels
    d = sample_images(weights, config, store, ddim, **{**kw, "labels": [1, 2, 0, 1, 2]})
    assert not np.array_equal(a, d)


def test_training_grid_from_the_ema_module(pixel_run, tmp_path):
    run, _ = pixel_run
    weights, config = load_weights(run)
    store, _ = open_run_store(config)
    ema = DiT(get_config(config["train"]["model"]["model"], **{k: config["model"][k] for k in (
        "input_size", "in_channels", "num_classes", "learn_sigma")}))
    ema.load_state_dict(weights)
    a = write_training_grid(ema, config, store, tmp_path / "step_1.png", SampleConfig(n=5, steps=2), device="cpu")
    b = write_training_grid(ema, config, store, tmp_path / "step_2.png", SampleConfig(n=5, steps=2), device="cpu")
    assert read_png(a).shape == (2 * 18 + 2, 3 * 18 + 2, 3)  # 5 samples, 3 per row
    assert np.array_equal(read_png(a), read_png(b))  # same conditions and noise at every step


def test_row_per_class_layout(pixel_run, tmp_path):
    run, _ = pixel_run
    r = cli("--ckpt", run, "--out", tmp_path / "demo", "--classes", "all", "--n-per-class", 2,
            "--steps", 2, "--device", "cpu")
    assert r.exit_code == 0, r.output
    grid = read_png(tmp_path / "demo" / "grid.png")
    assert grid.shape == (3 * 18 + 2, 2 * 18 + 2, 3)  # rows = classes, columns = samples per class
    for c in range(3):
        files = sorted((tmp_path / "demo" / "samples" / str(c)).glob("*.png"))
        assert [p.name for p in files] == ["0000.png", "0001.png"]
        for j, p in enumerate(files):  # sample j of class c is tile (row c, column j)
            tile = grid[2 + c * 18: 2 + c * 18 + 16, 2 + j * 18: 2 + j * 18 + 16]
            assert np.array_equal(read_png(p), tile)
    # a subset of classes in the given order, with --per-class-dir in the flat layout too
    r = cli("--ckpt", run, "--out", tmp_path / "sub.png", "--class", "2,0", "--n", 4, "--per-class-dir",
            "--steps", 2, "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert sorted(p.relative_to(tmp_path / "sub").as_posix() for p in (tmp_path / "sub").rglob("*.png")) == [
        "0/0000.png", "0/0001.png", "2/0000.png", "2/0001.png"]


def test_checkpoint_pt_and_unconditional_model(tmp_path):
    store = tiny_store(tmp_path / "store", conditioning={"type": "none"})
    run = make_run(tmp_path / "run", store, objective="flow")
    weights, config = load_weights(run)
    # a run with only a checkpoint (no export yet): its EMA weights are used
    only_ckpt = tmp_path / "run2"
    save_checkpoint(only_ckpt, 10, {"ema": weights, "config": config, "step": 10})
    r = cli("--ckpt", only_ckpt, "--out", tmp_path / "u.png", "--n", 3, "--steps", 3,
            "--sampler", "heun", "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert read_png(tmp_path / "u.png").shape == (2 * 18 + 2, 2 * 18 + 2, 3)  # 3 samples, 2 per row
    one_line_error(cli("--ckpt", run, "--out", tmp_path / "x.png", "--class", 1), "--class", "unconditional")
    one_line_error(cli("--ckpt", run, "--out", tmp_path / "x.png", "--sampler", "ddpm"),
                   "sampler 'ddpm'", "flow")


# -----------------------------------------------------------------------------
# errors: one line each


def test_missing_store_says_pass_latents(pixel_run, tmp_path):
    run, store = pixel_run
    moved = tmp_path / "moved_store"
    shutil.copytree(store, moved)
    weights, config = load_weights(run)
    config["store"]["path"] = str(tmp_path / "gone")
    lost = tmp_path / "lost_run"
    lost.mkdir()
    export_weights(lost / "ema.safetensors", weights, config)
    one_line_error(cli("--ckpt", lost, "--out", tmp_path / "o.png", "--steps", 2), "is not there",
                   "--latents")
    # --latents points at the moved copy: same manifest, same identity, no note
    r = cli("--ckpt", lost, "--out", tmp_path / "o.png", "--latents", moved, "--n", 2, "--steps", 2,
            "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert "note:" not in r.output
    # a directory that is not a store
    (tmp_path / "empty").mkdir()
    one_line_error(cli("--ckpt", lost, "--out", tmp_path / "o.png", "--latents", tmp_path / "empty"),
                   "manifest.json")


def test_wrong_store_refused_unless_compatible(pixel_run, tmp_path):
    run, _ = pixel_run
    # another store of the same shape and classes (other data): a note, then samples
    other = tiny_store(tmp_path / "other", seed=5, n=4)
    r = cli("--ckpt", run, "--out", tmp_path / "o.png", "--latents", other, "--n", 2, "--steps", 2,
            "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert "note:" in r.output and "not the store this run was trained on" in r.output
    # other latent shape
    small = tiny_store(tmp_path / "small", shape=(3, 8, 8))
    one_line_error(cli("--ckpt", run, "--out", tmp_path / "o.png", "--latents", small),
                   "incompatible", "3x8x8", "3x16x16")
    # other number of classes
    five = tiny_store(tmp_path / "five", conditioning={"type": "class", "num_classes": 5,
                                                             "class_names": list("abcde")})
    one_line_error(cli("--ckpt", run, "--out", tmp_path / "o.png", "--latents", five),
                   "incompatible", "5 classes")


def test_bad_arguments_are_one_line(pixel_run, tmp_path):
    run, _ = pixel_run
    one_line_error(cli("--ckpt", run, "--out", tmp_path / "o.png", "--class", 3), "class 3", "0..2")
    one_line_error(cli("--ckpt", run, "--out", tmp_path / "o.png", "--class", "dog"), "unknown class 'dog'",
                   "astronaut")
    one_line_error(cli("--ckpt", run, "--out", tmp_path / "o.png", "--prompt", "a cat"), "--prompt",
                   "class-conditional")
    one_line_error(cli("--ckpt", run, "--out", tmp_path / "o.jpg"), "PNG")
    one_line_error(cli("--ckpt", run, "--out", tmp_path / "o.png", "--sampler", "euler"), "euler", "ddpm")
    one_line_error(cli("--ckpt", run, "--out", tmp_path / "o.png", "--n", 4, "--n-per-class", 2), "either")
    one_line_error(cli("--ckpt", run, "--out", tmp_path / "o.png", "--steps", 1), "at least 2 steps")
    one_line_error(cli("--ckpt", run, "--out", tmp_path / "o.png", "--steps", 1001), "1..1000")
    not_run = tmp_path / "not_a_run"
    not_run.mkdir()
    one_line_error(cli("--ckpt", not_run, "--out", tmp_path / "o.png"), "no ema.safetensors")


def test_make_grid_and_helpers(tmp_path):
    imgs = np.stack([np.full((4, 5, 3), 10 * i, np.uint8) for i in range(5)])
    g = make_grid(imgs, nrow=2, padding=1)
    assert g.shape == (3 * 5 + 1, 2 * 6 + 1, 3)
    assert (g[1:5, 7:12] == 10).all() and (g[11:15, 1:6] == 40).all() and (g[11:15, 7:12] == 0).all()
    assert make_grid(imgs[:1], nrow=8).shape == (8, 9, 3)
    assert output_paths(tmp_path / "a.png") == (tmp_path / "a.png", tmp_path / "a")
    assert output_paths(tmp_path / "d") == (tmp_path / "d" / "grid.png", tmp_path / "d" / "samples")
    assert parse_classes(["all"], 3) == [0, 1, 2]
    assert parse_classes(["2,Chelsea", "0"], 3, SAMPLE_CLASSES) == [2, 1, 0]
    with pytest.raises(SampleError, match="out of range"):
        parse_classes(["-1"], 3)


# -----------------------------------------------------------------------------
# real autoencoder and text conditioning


def test_taef2_store_end_to_end(taef2_dir, tmp_path):
    from ditdata.autoencoders.kinds import load_autoencoder

    info = load_autoencoder(str(taef2_dir)).info  # 32 channels, /8
    store = tiny_store(tmp_path / "store", shape=(32, 4, 4), vae=info, n=3)
    run = make_run(tmp_path / "run", store, model="DiT-T/2")
    r = cli("--ckpt", run, "--out", tmp_path / "t", "--n", 2, "--steps", 2, "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert read_png(tmp_path / "t" / "grid.png").shape == (32 + 4, 2 * 34 + 2, 3)
    assert read_png(tmp_path / "t" / "samples" / "0001.png").shape == (32, 32, 3)
    # the autoencoder's recorded folder is gone: --vae says where it is now
    moved = tmp_path / "taef2_copy"
    shutil.copytree(taef2_dir, moved, ignore=shutil.ignore_patterns("*.md", "LICENSE"))
    m = json.loads((store / "manifest.json").read_text())
    m["vae"]["id"] = str(tmp_path / "nowhere")
    (store / "manifest.json").write_text(json.dumps(m))
    r = cli("--ckpt", run, "--out", tmp_path / "v.png", "--n", 1, "--steps", 2, "--device", "cpu",
            "--vae", moved)
    assert r.exit_code == 0, r.output


def test_text_model_with_prompts(tmp_path, monkeypatch):
    from test_clip import tiny_clip_conditioning  # skips the test without open_clip

    conditioning, weights = tiny_clip_conditioning(tmp_path, name="tiny-clip-sample", text_width=24)
    store = tiny_store(tmp_path / "store", conditioning=conditioning, text={"pooled": 32, "tokens": (77, 24)})
    run = make_run(tmp_path / "run", store, text_pooled_dim=32, text_token_dim=24)
    r = cli("--ckpt", run, "--out", tmp_path / "t", "--prompt", "a red fox", "--prompt", "a cat",
            "--n-per-class", 2, "--steps", 2, "--cfg", 3.0, "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert read_png(tmp_path / "t" / "grid.png").shape == (2 * 18 + 2, 2 * 18 + 2, 3)
    index = json.loads((tmp_path / "t" / "samples" / "samples.json").read_text())
    assert [s["prompt"] for s in index["samples"]] == ["a red fox"] * 2 + ["a cat"] * 2
    assert sorted(p.relative_to(tmp_path / "t" / "samples").as_posix()
                  for p in (tmp_path / "t" / "samples").rglob("*.png")) == [
        "0/0000.png", "0/0001.png", "1/0000.png", "1/0001.png"]
    # the prompt matters (pooled embedding and cross-attention): same seed, other prompt
    w, config = load_weights(run)
    st = open_store(store)
    a, b = (sample_images(w, config, st, SampleConfig(steps=2, seed=0), prompts=[p], device="cpu")
            for p in ("a red fox", "a cat"))
    assert not np.array_equal(a, b)
    one_line_error(cli("--ckpt", run, "--out", tmp_path / "x.png", "--steps", 2), "--prompt")
    # the trainer's grid takes the store's own caption embeddings: no text encoder needed
    model = DiT(get_config("DiT-T/4", **{k: config["model"][k] for k in (
        "input_size", "in_channels", "num_classes", "learn_sigma", "text_pooled_dim", "text_token_dim")}))
    model.load_state_dict(w)
    g = write_training_grid(model, config, st, tmp_path / "train.png", SampleConfig(n=4, steps=2), device="cpu")
    assert read_png(g).shape == (2 * 18 + 2, 2 * 18 + 2, 3)
    one_line_error(cli("--ckpt", run, "--out", tmp_path / "x.png", "--class", 1), "--class", "text")
    # the text encoder's weights are gone: one line naming --text-pretrained
    weights.rename(tmp_path / "elsewhere.pt")
    one_line_error(cli("--ckpt", run, "--out", tmp_path / "x.png", "--prompt", "a", "--steps", 2,
                       "--device", "cpu"), "text encoder", "--text-pretrained")
    r = cli("--ckpt", run, "--out", tmp_path / "y.png", "--prompt", "a", "--n", 1, "--steps", 2,
            "--device", "cpu", "--text-pretrained", tmp_path / "elsewhere.pt")
    assert r.exit_code == 0, r.output


def test_the_command_draws_with_the_engine_it_is_given(pixel_run, tmp_path):
    """sample_to_files takes its engine from the command (--engine): it opens the run through
    it, gets the network for the plan's device from it, and records what it says of itself."""
    from dittrain.config import SampleConfig
    from dittrain.inference.open_run import TorchEngine
    from dittrain.inference.sample import sample_to_files

    class Counting(TorchEngine):
        def network(self, device):
            asked.append(device)
            return super().network(device)

        def describe(self):
            return "engine: counting"

        def record(self):
            return {"engine": "counting"}

    run, _ = pixel_run
    asked, lines = [], []
    out = sample_to_files(Counting(run), tmp_path / "g.png", n=2, settings=SampleConfig(steps=2), device="cpu",
                          log=lines.append)
    assert asked == [torch.device("cpu")] and "engine: counting" in lines and len(out["files"]) == 2
    index = json.loads((tmp_path / "g" / "samples.json").read_text())
    assert index["engine"] == "counting" and index["ckpt"] == str(Path(run).resolve())
