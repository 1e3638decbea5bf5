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
from test_sample import cli

import dittrain.npz as npz_api
from dittrain.npz import JOB_NAME, weights_digest
from dittrain.weights import load_weights

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
