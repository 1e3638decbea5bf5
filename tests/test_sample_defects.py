"""Issue 24's sampling defects, on tiny runs (test_sample.make_run over a 16 px pixels store):
an int8 export samples with --npz (its weights digest works on torchao tensors, and is the
same on every load, so a job resumes), and sampling that goes non-finite stops in one line
with nothing written (the command, --npz chunks, serve), absurd guidance scales refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from cliutil import dittrain, ok
from test_sample import cli, one_line_error

import dittrain.inference.eval_samples as npz_api
from ditdata.common.files import state_dict_sha256 as weights_digest
from ditdata.store import open_store
from dittrain.config import SampleConfig
from dittrain.inference.eval_samples import JOB_NAME
from dittrain.inference.open_run import SampleError
from dittrain.inference.sample import plan_samples
from dittrain.inference.weights import load_weights

pytestmark = pytest.mark.usefixtures("one_thread")
NPZ = ["--n", 4, "--chunk-size", 2, "--steps", 2, "--batch-size", 2, "--seed", 3, "--device", "cpu"]


# -----------------------------------------------------------------------------
# 1. an int8 export samples with --npz


@pytest.fixture(scope="module")
def int8_export(pixel_run, tmp_path_factory):
    pytest.importorskip("torchao")
    run, _ = pixel_run
    f = tmp_path_factory.mktemp("int8") / "dit_int8.pt"
    ok(dittrain("export", "--ckpt", run, "--format", "int8", "--out", f))
    return f


def test_int8_weights_digest_is_stable_and_fp32_unchanged(pixel_run, int8_export):
    w8, _ = load_weights(int8_export)
    assert type(w8["blocks.0.attn.qkv.weight"]).__module__.startswith("torchao")
    digest = weights_digest(w8)
    assert digest == weights_digest(load_weights(int8_export)[0])  # every load: the same
    # the int8 data matters: another value in one weight, another digest
    changed = dict(w8)
    q = w8["blocks.0.attn.qkv.weight"]
    inner = {a: getattr(q, a).clone() for a in q.__tensor_flatten__()[0]}
    inner["qdata"].view(-1)[0] += 1
    changed["blocks.0.attn.qkv.weight"] = type(q).__tensor_unflatten__(inner, q.__tensor_flatten__()[1],
                                                                        q.shape, q.stride())
    assert weights_digest(changed) != digest
    # plain tensors are digested as before (names, dtypes, shapes, bytes): jobs of fp32 runs resume
    import hashlib

    w32, _ = load_weights(pixel_run[0])
    h = hashlib.sha256()
    for name in sorted(w32):
        t = w32[name].detach().cpu().contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    assert weights_digest(w32) == h.hexdigest()


def test_int8_export_samples_to_npz_and_resumes(int8_export, tmp_path, monkeypatch):
    out = tmp_path / "out.npz"
    ok(cli("--ckpt", int8_export, "--npz", out, *NPZ), "npz: ")
    with np.load(out) as z:
        assert z["arr_0"].shape == (4, 16, 16, 3) and z["arr_0"].dtype == np.uint8 and z["arr_1"].shape == (4,)
    reference = out.read_bytes()

    # a job stopped after drawing (before the file): the parts stay; the same command resumes them
    again = tmp_path / "again.npz"

    def stop(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(npz_api, "_assemble", stop)
    cli("--ckpt", int8_export, "--npz", again, *NPZ)
    parts = tmp_path / "again.npz.parts"
    assert (parts / JOB_NAME).is_file() and len(list(parts.glob("[0-9]*.npy"))) == 2 and not again.exists()
    assert json.loads((parts / JOB_NAME).read_text())["weights_sha256"] == weights_digest(load_weights(int8_export)[0])
    monkeypatch.undo()
    ok(cli("--ckpt", int8_export, "--npz", again, *NPZ), "2 of 2 chunks done")
    assert again.read_bytes() == reference and not parts.exists()


# -----------------------------------------------------------------------------
# 2. non-finite samples stop in one line, nothing written; absurd guidance refused


@pytest.fixture(scope="module")
def nan_class_run(pixel_run, tmp_path_factory):
    """The pixel run with class 2's embedding set to NaN: samples of class 2 go NaN, the
    others stay finite (every op of the DiT is per sample)."""
    from dittrain.rundir import export_weights

    weights, config = load_weights(pixel_run[0])
    weights = dict(weights)
    table = weights["y_embedder.embedding_table.weight"].clone()
    table[2] = float("nan")
    weights["y_embedder.embedding_table.weight"] = table
    run = tmp_path_factory.mktemp("nan") / "run"
    run.mkdir()
    export_weights(run / "ema.safetensors", weights, config)
    return run


def test_absurd_cfg_is_refused_up_front(pixel_run, tmp_path):
    run, store = pixel_run
    for flags in (["--out", tmp_path / "g.png"], ["--npz", tmp_path / "s.npz"]):
        # the command line refuses it (click's range), before anything loads
        one_line_error(cli("--ckpt", run, *flags, "--cfg", "1e308", "--n", 2, "--steps", 2, "--device", "cpu"),
                       "--cfg", "1e+308", "-100.0<=x<=100.0")
    assert list(tmp_path.iterdir()) == []  # nothing written, no parts folder
    # the bound: 100 and -100 plan, just beyond does not; unconditional models ignore the scale
    config = load_weights(run)[1]
    opened = open_store(store)
    for scale in (100.0, -100.0, 1.0):
        plan_samples(config, opened, SampleConfig(cfg_scale=scale), device="cpu", n=1)
    with pytest.raises(SampleError, match="out of range"):
        plan_samples(config, opened, SampleConfig(cfg_scale=100.5), device="cpu", n=1)


def test_nan_samples_stop_in_one_line_and_write_nothing(nan_class_run, tmp_path):
    out = tmp_path / "grid.png"
    r = cli("--ckpt", nan_class_run, "--out", out, "--class", "0,2", "--n", 2, "--steps", 2, "--cfg", 3.0,
            "--seed", 7, "--device", "cpu")
    one_line_error(r, "NaN/inf", "sample 1, class 2", "seed 7", "cfg 3", "nothing was written")
    assert not out.exists() and not (tmp_path / "grid").exists()
    # the finite class samples as before
    ok(cli("--ckpt", nan_class_run, "--out", out, "--class", "0", "--n", 2, "--steps", 2, "--device", "cpu"))
    assert len(list((tmp_path / "grid").glob("*.png"))) == 2


def test_nan_npz_chunk_is_not_written(nan_class_run, tmp_path):
    out = tmp_path / "s.npz"
    r = cli("--ckpt", nan_class_run, "--npz", out, *NPZ, "--class", "0,0,2,2")
    err = one_line_error(r, "NaN/inf", "class 2", "seed 3, chunk 1", "chunk 1 was not written")
    assert "2 samples (the first: 2)" in err
    parts = tmp_path / "s.npz.parts"
    kept = sorted(p.name for p in parts.iterdir() if not p.name.startswith("."))  # not the lock
    assert kept == ["000000.npy", JOB_NAME] and not out.exists()


def test_serve_nan_samples_and_absurd_cfg_are_messages(nan_class_run):
    from dittrain.config import ServeConfig
    from dittrain.inference.serve import Request, Server

    server = Server(nan_class_run, ServeConfig(device="cpu"), log=lambda line: None)
    out = server.generate(Request(choice="2", n=2, steps=2, cfg_scale=3.0, seed=5))
    assert not out.ok and out.command == "" and out.seed == 5
    assert "NaN/inf" in out.message and "class 2" in out.message and "no images are shown" in out.message
    assert "\n" not in out.message
    out = server.generate(Request(choice="0", n=2, steps=2, cfg_scale=1e308, seed=5))
    assert not out.ok and "CFG scale must be in -100..100" in out.message, out.message
    assert server.generate(Request(choice="0", n=2, steps=2, cfg_scale=3.0, seed=5)).ok
