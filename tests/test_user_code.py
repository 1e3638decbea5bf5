"""Code and weights the user brings are hostile input (ditdata.common.usercode): a feature
encoder's exception is one line naming it, a non-finite output stops the command before
anything of the shard is stored (int8 and fp16 alike), nothing of the set is published and a
rerun after a fix resumes; a `grid` given as an int is a square grid; weights holding NaN
(a python: encoder, a model folder, an aesthetic predictor, an LDM checkpoint) are refused
when loaded. Every case runs through the command line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from cliutil import ditdata, ok, one_error_line
from PIL import Image
from test_features import PY_ENCODER, RES, _copy, _encode, save_tiny_dinov2
from tiny import fetch_tree

from ditdata.common.usercode import UserCodeError, check_output, check_weights, user_call
from ditdata.store import open_store
from ditdata.store.features import feature_sets

pytestmark = pytest.mark.usefixtures("one_thread")

ENCODERS = PY_ENCODER + '''
import os

class NaNs(Patches):
    def forward(self, x):
        return super().forward(x) * float("nan")

class MagentaIsNaN(Patches):
    """NaN for magenta images while POISON is set: the bug a user fixes between two runs."""
    def forward(self, x):
        y = super().forward(x)
        magenta = (x[:, 0].mean((1, 2)) > 0.9) & (x[:, 1].mean((1, 2)) < 0.1)
        if os.environ.get("POISON") == "1":
            y[magenta] = float("inf")
        return y

class Raises(Patches):
    def forward(self, x):
        if x.abs().sum() > 0:  # the loader's probe (a black image) passes
            raise RuntimeError("my encoder broke")
        return super().forward(x)

class IntGrid(Patches):
    grid = 4

class WordGrid(Patches):
    grid = "4x4"

class Integers(Patches):
    def forward(self, x):
        return super().forward(x).long()

class NaNWeights(Patches):
    def __init__(self):
        super().__init__()
        with torch.no_grad():
            self.proj[0, 0] = float("nan")

def broken():
    raise ValueError("no weights here")
'''


@pytest.fixture(scope="module")
def encoders(tmp_path_factory) -> Path:
    """test_features' patch encoders and the misbehaving ones above, as one .py file."""
    (path := tmp_path_factory.mktemp("enc") / "encoders.py").write_text(ENCODERS)
    return path


def features(store, spec, *extra):
    return ditdata("features", store, "--encoder", spec, "--device", "cpu", "--workers", 0, "-q",
                   "--out-name", "f", *extra)


def _published(store: Path) -> bool:
    return (store / "features" / "f" / "manifest.json").exists() or "f" in feature_sets(open_store(store))


# --------------------------------------------------------------------------- non-finite outputs


@pytest.mark.parametrize("dtype", ["int8", "fp16"])
def test_an_encoder_that_gives_nan_stops_naming_it_and_publishes_nothing(flip_store, encoders, tmp_path, dtype):
    store = _copy(flip_store, tmp_path / "s")
    first_key = open_store(store).read(0, ["key"])["key"][0]
    spec = f"python:{encoders}:NaNs"
    r = features(store, spec, "--features-dtype", dtype)
    assert r.exit_code == 1
    line = one_error_line(r.output)
    assert f"--encoder {spec}: gave non-finite feat values (NaN/inf)" in line, line
    assert f"of shard 00000, the first key {first_key!r}" in line and "not published" in line, line
    assert "please report" not in line
    assert not _published(store) and not list((store / "features" / "f" / "shards").glob("*"))


def test_a_late_nan_keeps_the_finished_shards_and_a_rerun_after_the_fix_resumes(encoders, tmp_path, monkeypatch):
    """70 samples (more than the 64 the calibration reads), the last two magenta: the pass writes
    the shards before theirs, stops at theirs, and resumes after the fix."""
    rng = np.random.default_rng(0)
    tree = tmp_path / "tree"
    for cls, n in (("a", 68), ("b", 2)):
        (tree / cls).mkdir(parents=True)
        for i in range(n):
            arr = (rng.integers(0, 256, (40, 40, 3)) if cls == "a" else np.full((40, 40, 3), (255, 0, 255)))
            Image.fromarray(arr.astype(np.uint8)).save(tree / cls / f"{i:03d}.png")
    shards = fetch_tree(tree, tmp_path / "shards", samples_per_shard=14)  # 5 shards; b's two in the last
    store = tmp_path / "store"
    _encode(shards, store)
    last = open_store(store).shards[-1]
    rows = open_store(store).read(last, ["key", "label"])
    magenta = [k for k, label in zip(rows["key"].tolist(), rows["label"].tolist(), strict=True) if label == 1]
    assert len(magenta) == 2
    spec = f"python:{encoders}:MagentaIsNaN"
    monkeypatch.setenv("POISON", "1")
    r = features(store, spec, "--batch-size", 7)
    line = one_error_line(r.output)
    assert r.exit_code == 1 and f"of shard {last.name}, the first key" in line, line
    assert "for 2 of 7 sample(s)" in line or "for 1 of 7 sample(s)" in line, line
    assert any(repr(k) in line for k in magenta), (line, magenta)
    records = sorted(p.stem for p in (store / "features" / "f" / "shards").glob("*.json"))
    assert records == [s.name for s in open_store(store).shards[:-1]] and not _published(store)

    monkeypatch.delenv("POISON")
    r = ok(features(store, spec, "--batch-size", 7), "4 already done")
    assert _published(store)
    ok(ditdata("verify", store, "-q"))


# --------------------------------------------------------------------------- failures inside user code


def test_an_encoder_that_raises_is_the_users_error(flip_store, encoders, tmp_path, monkeypatch):
    store = _copy(flip_store, tmp_path / "s")
    spec = f"python:{encoders}:Raises"
    r = features(store, spec)
    assert r.exit_code == 1
    line = one_error_line(r.output)
    assert line == f"Error: --encoder {spec}: its forward raised RuntimeError: my encoder broke", line
    monkeypatch.setenv("DITKIT_DEBUG", "1")  # the traceback: the encoder's own exception, chained
    r = features(store, spec)
    assert isinstance(r.exception, UserCodeError) and isinstance(r.exception.__cause__, RuntimeError)
    monkeypatch.delenv("DITKIT_DEBUG")
    r = features(store, f"python:{encoders}:broken")
    assert one_error_line(r.output) == f"Error: --encoder python:{encoders}:broken: broken() raised ValueError: " \
                                       "no weights here"


def test_encode_features_names_its_own_option(class_shards, encoders, tmp_path):
    spec = f"python:{encoders}:Raises"
    r = ditdata("encode", class_shards, "--out", tmp_path / "s", "--vae", "pixels", "--resolution", RES,
                "--workers", 0, "--device", "cpu", "-q", "--features", spec)
    assert one_error_line(r.output) == f"Error: --features {spec}: its forward raised RuntimeError: my encoder broke"


@pytest.mark.parametrize(("name", "says"), [
    ("WordGrid", "its `grid` attribute is '4x4'; give an int n (a square n x n grid) or a pair (h, w)"),
    ("Integers", "returned torch.int64 (1, 16, 12) for (1, 3, 32, 32); expected floating-point"),
    ("NaNWeights", "its weights hold non-finite values (NaN/inf) in 1 of 1 tensors, the first 'proj'"),
])
def test_unusable_encoders_are_refused_in_one_line(flip_store, encoders, tmp_path, name, says):
    store = _copy(flip_store, tmp_path / "s")
    r = features(store, f"python:{encoders}:{name}")
    assert r.exit_code == 1 and f"--encoder python:{encoders}:{name}: {says}" in one_error_line(r.output), r.output
    assert not (store / "features").exists() or not _published(store)


def test_an_int_grid_is_a_square_grid(flip_store, encoders, tmp_path):
    store = _copy(flip_store, tmp_path / "s")
    ok(features(store, f"python:{encoders}:IntGrid"))
    m = json.loads((store / "features" / "f" / "manifest.json").read_text())
    assert m["encoder"]["grid"] == [4, 4] and m["encoder"]["patch"] == 8


def test_a_model_folder_with_nan_weights_is_refused(flip_store, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = save_tiny_dinov2(tmp_path / "dino")
    sd = load_file(folder / "model.safetensors")
    name = sorted(sd)[3]
    sd[name] = sd[name].clone().fill_(float("inf"))
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    r = features(_copy(flip_store, tmp_path / "s"), folder)
    line = one_error_line(r.output)
    assert r.exit_code == 1 and "its weights hold non-finite values (NaN/inf) in 1 of" in line, line


# --------------------------------------------------------------------------- the other doors


def test_an_aesthetic_predictor_with_nan_weights_is_refused(tmp_path):
    from test_aesthetic import caption_shards, mlp_state_dict, score_args
    from test_clip import tiny_clip_files

    sd = mlp_state_dict([32, 16, 1])
    sd["layers.2.weight"][0, 3] = float("nan")
    torch.save(sd, tmp_path / "p.pth")
    r = ditdata(*score_args(caption_shards(tmp_path / "a"), tiny_clip_files(tmp_path / "clip"),
                            "--aesthetic", tmp_path / "p.pth"))
    line = one_error_line(r.output)
    assert r.exit_code == 1 and f"aesthetic predictor {(tmp_path / 'p.pth').resolve()}: its weights hold " \
        "non-finite values (NaN/inf) in 1 of 4 tensors, the first 'layers.2.weight'" in line, line


def test_an_ldm_checkpoint_with_nan_weights_is_refused(class_shards, tmp_path):
    from tiny import save_ldm, tiny_ldm_kl

    ckpt, config = save_ldm(tiny_ldm_kl(), tmp_path / "kl.pt")
    state = torch.load(ckpt, weights_only=True)
    weights = state.get("state_dict", state)
    weights[next(k for k in weights if k.endswith("encoder.conv_in.weight"))].fill_(float("nan"))
    torch.save(state, ckpt)
    r = ditdata("encode", class_shards, "--out", tmp_path / "s", "--vae", f"ldm:{ckpt}", "--vae-config", config,
                "--resolution", 32, "--workers", 0, "--device", "cpu", "-q")
    line = one_error_line(r.output)
    assert r.exit_code == 1 and f"autoencoder ldm:{ckpt}" in line and "its weights hold non-finite" in line, line
    assert "encoder.conv_in.weight" in line and not (tmp_path / "s" / "manifest.json").exists()


@pytest.mark.parametrize(("text", "says"), [
    ("[optim]\nlr = nan\n", "[optim] lr: nan is not a finite number"),
    ("[optim]\nbatch_size = 'many'\n", "[optim] batch_size: takes an integer, not 'many'"),
    ("[optim\n", "not valid TOML"),
    ("[repa]\nrepa_min_cosine = 2\n", "[repa] repa_min_cosine"),
])
def test_a_config_file_is_checked_like_the_command_line(tmp_path, text, says):
    from cliutil import dittrain

    (tmp_path / "c.toml").write_text(text)
    r = dittrain("run", "--config", tmp_path / "c.toml", "--latents", tmp_path, "--out", tmp_path / "r")
    assert r.exit_code == 2 and says in one_error_line(r.output), r.output


# --------------------------------------------------------------------------- the functions


def test_the_checks_themselves():
    x = np.zeros((3, 4, 2), np.float32)
    check_output(x, source="S", keys=["a", "b", "c"], shape=(4, 2))
    x[1, 2, 0] = np.nan
    with pytest.raises(UserCodeError, match=r"^S: gave non-finite feat values \(NaN/inf\) for 1 of 3 sample\(s\) "
                                            r"of shard 7, the first key 'b'; x$"):
        check_output(x, source="S", keys=["a", "b", "c"], shard="7", field="feat", then="; x")
    with pytest.raises(UserCodeError, match=r"returned of shape \(3, 4, 2\), expected \(3, 5, 2\)"):
        check_output(x, source="S", shape=(5, 2))
    with pytest.raises(UserCodeError, match="expected floating-point"):
        check_output(torch.zeros(2, 3, dtype=torch.long), source="S")
    with pytest.raises(UserCodeError, match="S: its forward raised KeyError: 'k'"):
        user_call("S", lambda: {}["k"])
    with pytest.raises(MemoryError):  # out of memory is not the user's code's fault
        user_call("S", lambda: (_ for _ in ()).throw(MemoryError()))
    check_weights({"w": torch.ones(2), "n": torch.tensor([1, 2])}, "S")
    with pytest.raises(UserCodeError, match="in 1 of 2 tensors, the first 'w'"):
        check_weights({"w": torch.tensor([1.0, float("-inf")]), "n": torch.tensor([1, 2])}, "S")
