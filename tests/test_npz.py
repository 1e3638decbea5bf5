"""dittrain/inference/eval_samples.py and `dittrain sample --npz`: the ADM evaluator's sample file, drawn in
chunks that survive a SIGKILL, shared over torchrun ranks, the same bytes either way; on a
fabricated run (the pixel_run fixture: test_sample.make_run) over a 16 px pixels store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from cliutil import dittrain, kill_when, ok, one_error_line
from storeutil import tiny_store
from test_sample import cli, make_run

from ditdata.store import encode_array, open_store
from dittrain.config import EvalSampleConfig
from dittrain.inference.eval_samples import JOB_NAME, chunk_seed, eval_settings, write_npz
from dittrain.inference.open_run import SampleError
from dittrain.inference.sample import balanced_labels, class_mode, pick_labels, plan_samples
from dittrain.inference.weights import load_weights

pytestmark = pytest.mark.usefixtures("one_thread")

# 24 samples in 12 chunks of 2: enough chunks that a kill lands mid-job
JOB = ["--n", 24, "--chunk-size", 2, "--steps", 12, "--batch-size", 2, "--seed", 5, "--device", "cpu"]


def child_env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def reference(pixel_run, tmp_path_factory):
    """The uninterrupted one-process npz of JOB."""
    run, _ = pixel_run
    out = tmp_path_factory.mktemp("ref") / "ref.npz"
    r = cli("--ckpt", run, "--npz", out, *JOB)
    assert r.exit_code == 0, r.output
    return out


def arrays(path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def test_the_adm_format(reference):
    z = arrays(reference)
    assert sorted(z) == ["arr_0", "arr_1"]
    assert z["arr_0"].dtype == np.uint8 and z["arr_0"].shape == (24, 16, 16, 3)
    assert z["arr_1"].dtype == np.int64 and z["arr_1"].shape == (24,)
    assert z["arr_1"].tolist() == pick_labels(24, 3, 5)  # random: the plain sampler's rule
    assert len({z["arr_0"][i].tobytes() for i in range(24)}) == 24
    assert not reference.with_name("ref.npz.parts").exists()  # the parts are gone
    # no temporaries; beside the file, the job's record (what decided the images)
    assert sorted(p.name for p in reference.parent.iterdir()) == ["ref.npz", "ref.npz.json"]
    record = json.loads(reference.with_name("ref.npz.json").read_text())
    assert {k: record[k] for k in ("n", "seed", "sampler", "steps", "cfg_scale", "cfg_interval", "time_shift",
                                   "chunk_size", "batch_size")} == {
        "n": 24, "seed": 5, "sampler": "ddpm", "steps": 12, "cfg_scale": 1.5, "cfg_interval": [0.0, 1.0],
        "time_shift": None, "chunk_size": 2, "batch_size": 2}
    # as the ADM evaluator reads it: the zip entry's .npy header, then raw rows
    with zipfile.ZipFile(reference) as zf, zf.open("arr_0.npy") as f:
        assert np.lib.format.read_magic(f) == (1, 0)
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        assert (shape, fortran, dtype) == ((24, 16, 16, 3), False, np.uint8)


def test_write_npz_streams_the_same_entries_as_np_savez(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (7, 4, 5, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, 7)
    chunks = []
    for i, (a, b) in enumerate(((0, 3), (3, 6), (6, 7))):
        chunks.append(tmp_path / f"{i:06d}.npy")
        np.save(chunks[-1], images[a:b])
    write_npz(tmp_path / "s.npz", chunks, images.shape, labels)
    np.savez(tmp_path / "ref.npz", images, labels)
    with zipfile.ZipFile(tmp_path / "s.npz") as ours, zipfile.ZipFile(tmp_path / "ref.npz") as theirs:
        assert ours.namelist() == theirs.namelist() == ["arr_0.npy", "arr_1.npy"]
        for name in ours.namelist():
            assert ours.read(name) == theirs.read(name)
    # a chunk that does not fit: one line, and nothing published
    np.save(chunks[1], images[3:6, :2])
    with pytest.raises(SampleError, match="delete it and rerun"):
        write_npz(tmp_path / "t.npz", chunks, images.shape, labels)
    assert not (tmp_path / "t.npz").exists() and not list(tmp_path.glob(".t.npz*"))


def test_killed_and_resumed_equals_uninterrupted(pixel_run, reference, tmp_path):
    run, _ = pixel_run
    out = tmp_path / "k.npz"
    parts = tmp_path / "k.npz.parts"
    args = [sys.executable, "-m", "dittrain.cli", "sample", "--ckpt", run, "--npz", out, *map(str, JOB)]
    proc = subprocess.Popen(list(map(str, args)), env=child_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    kill_when(proc, lambda: (parts / "000000.npy").exists(), timeout=120,
              too_late="the job finished before it could be killed")
    done = sorted(p.name for p in parts.glob("[0-9]*.npy"))
    assert 1 <= len(done) < 12 and not out.exists()
    assert json.loads((parts / JOB_NAME).read_text())["steps"] == 12
    for name in done:  # only whole chunks carry a chunk name
        assert np.load(parts / name).shape == (2, 16, 16, 3)
    # other settings: refused, naming the setting; the chunks are kept
    for extra, needle in ((["--steps", 6], "--steps"), (["--seed", 6], "--seed"),
                          (["--classes", "balanced"], "--classes"), (["--chunk-size", 4], "--chunk-size")):
        err = one_error_line(cli("--ckpt", run, "--npz", out, *JOB, *extra).output)
        key = needle.lstrip("-").replace("-", "_")
        assert f"{key} " in err and needle in err and "delete" in err and str(parts) in err, err
    assert sorted(p.name for p in parts.glob("[0-9]*.npy")) == done
    # the same command continues where it was and makes the same file
    r = cli("--ckpt", run, "--npz", out, *JOB)
    assert r.exit_code == 0, r.output
    assert f"{len(done)} of 12 chunks done" in r.output
    assert out.read_bytes() == reference.read_bytes()
    assert not parts.exists()


def test_torchrun_two_ranks_equal_one_process(pixel_run, reference, tmp_path):
    run, _ = pixel_run
    out = tmp_path / "t.npz"
    job = [str(a) if a != "--n" else "--num-samples" for a in JOB]  # torchrun's parser takes --n
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "dittrain.cli", "sample", "--ckpt", str(run), "--npz", str(out), *job],
                       env=child_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "over 2 ranks" in r.stdout
    a, b = arrays(out), arrays(reference)
    assert np.array_equal(a["arr_0"], b["arr_0"]) and np.array_equal(a["arr_1"], b["arr_1"])
    assert out.read_bytes() == reference.read_bytes()
    assert not (tmp_path / "t.npz.parts").exists()


def test_balanced_classes(pixel_run, tmp_path):
    run, store = pixel_run
    out = tmp_path / "b.npz"
    ok(cli("--ckpt", run, "--npz", out, "--n", 10, "--classes", "balanced", "--chunk-size", 4, "--steps", 2,
           "--seed", 1, "--device", "cpu", "--out", tmp_path / "preview.png"))
    labels = arrays(out)["arr_1"]
    assert sorted(np.bincount(labels, minlength=3).tolist()) == [3, 3, 4]  # 10 // 3, one class once more
    assert labels.tolist() == balanced_labels(10, 3, 1) and labels.tolist() != sorted(labels.tolist())
    assert (tmp_path / "preview.png").is_file()  # --out with --npz: a grid of the first samples
    for n, k in ((7, 3), (1000, 7), (5, 9)):
        counts = np.bincount(balanced_labels(n, k, 0), minlength=k)
        assert counts.max() - counts.min() <= 1 and counts.sum() == n
    # fewer samples than classes: which classes is drawn too, not the lowest indices
    assert sorted(balanced_labels(4, 1000, 0)) != [0, 1, 2, 3] and len(set(balanced_labels(4, 1000, 0))) == 4
    # the words are selection modes of plain sampling too
    _, config = load_weights(run)
    st = open_store(store)
    assert list(plan_samples(config, st, device="cpu", classes=["Random"], n=5).labels) == pick_labels(5, 3, 0)
    assert list(plan_samples(config, st, device="cpu", classes=["balanced"], n=6).labels) == balanced_labels(6, 3, 0)
    assert class_mode(["1", "2"]) is None
    with pytest.raises(SampleError, match="alone"):
        class_mode(["balanced,1"])
    with pytest.raises(SampleError, match="--n-per-class"):
        plan_samples(config, st, device="cpu", classes=["balanced"], n_per_class=2)
    r = cli("--ckpt", run, "--out", tmp_path / "g.png", "--classes", "balanced", "--n", 6, "--steps", 2,
            "--device", "cpu")
    assert r.exit_code == 0, r.output
    index = json.loads((tmp_path / "g" / "samples.json").read_text())
    assert sorted(s["class"] for s in index["samples"]) == [0, 0, 1, 1, 2, 2]


def test_fid_protocol_defaults(pixel_run, tmp_path):
    assert eval_settings("ddpm").steps == 250 and eval_settings("flow").steps == 50
    assert eval_settings("ddpm").cfg_scale == eval_settings("flow").cfg_scale == 1.5
    assert eval_settings("ddpm", steps=4, cfg_scale=2.0).steps == 4
    assert EvalSampleConfig().n == 50_000
    assert chunk_seed(0, 1) != chunk_seed(1, 0) and chunk_seed(3, 4) == chunk_seed(3, 4)
    r = dittrain("sample", "--help")
    assert r.exit_code == 0
    text = " ".join(r.output.split())
    assert "with --npz 250" in text and "with --npz 1.5" in text and "Default 50" in text and "4.0" in text
    assert "balanced" in text and "--num-samples" in text
    run, _ = pixel_run
    r = cli("--ckpt", run, "--npz", tmp_path / "d.npz", "--n", 2, "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert "250 steps, cfg 1.5" in r.output  # the FID protocol unless --steps / --cfg say


def test_unconditional_has_no_labels(tmp_path):
    store = tiny_store(tmp_path / "store", conditioning={"type": "none"})
    run = make_run(tmp_path / "run", store, objective="flow")
    r = cli("--ckpt", run, "--npz", tmp_path / "u.npz", "--n", 3, "--steps", 2, "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert "euler, 2 steps" in r.output
    z = arrays(tmp_path / "u.npz")
    assert list(z) == ["arr_0"] and z["arr_0"].shape == (3, 16, 16, 3)


def test_text_model_cycles_the_prompts(tmp_path, monkeypatch):
    import torch

    empty = {"text_pooled": encode_array(np.zeros(16, np.float16))}
    text = {"model": "stand-in", "pretrained": None, "encoder": "stand-in", "pooled_dim": 16, "tokens_shape": None,
            "empty": empty}
    store = tiny_store(tmp_path / "store", conditioning={"type": "text", "text": text},
                       text={"pooled": 16, "tokens": None})
    run = make_run(tmp_path / "run", store, text_pooled_dim=16)
    calls = []

    def embed(store, prompts, *, tokens, device="cpu", text_encoder=None, pretrained=None):
        calls.append(list(prompts))  # one embedding of its own per prompt
        return {"text_pooled": torch.stack([torch.full((16,), float(len(p))) for p in prompts])}

    monkeypatch.setattr("dittrain.inference.eval_samples.embed_prompts", embed)
    for name, prompts in (("a", ["x", "yy", "zzz"]), ("b", ["zzz", "yy", "x"])):
        r = cli("--ckpt", run, "--npz", tmp_path / f"{name}.npz", *[a for p in prompts for a in ("--prompt", p)],
                "--n", 5, "--chunk-size", 5, "--steps", 2, "--device", "cpu")
        assert r.exit_code == 0, r.output
    assert calls == [["x", "yy", "zzz"], ["zzz", "yy", "x"]]  # embedded once per job
    a, b = arrays(tmp_path / "a.npz"), arrays(tmp_path / "b.npz")
    assert a["arr_1"].tolist() == b["arr_1"].tolist() == [0, 1, 2, 0, 1]  # the prompt index of each sample
    assert np.array_equal(a["arr_0"][1], b["arr_0"][1])  # "yy" at index 1 in both: the same sample
    assert not np.array_equal(a["arr_0"][0], b["arr_0"][0])  # "x" against "zzz"


def test_bad_npz_calls_are_one_line(pixel_run, tmp_path):
    run, store = pixel_run
    small = ["--n", 2, "--steps", 2, "--device", "cpu"]
    assert "NAME.npz" in one_error_line(cli("--ckpt", run, "--npz", tmp_path / "s.np", *small).output)
    assert "inside the latent store" in one_error_line(cli("--ckpt", run, "--npz", store / "s.npz", *small).output)
    err = one_error_line(cli("--ckpt", run, "--npz", tmp_path / "s.npz", "--n-per-class", 2).output)
    assert "--n-per-class" in err
    assert "--out" in one_error_line(cli("--ckpt", run, "--steps", 2).output)
    assert "--npz only" in one_error_line(cli("--ckpt", run, "--out", tmp_path / "g.png", "--overwrite").output)
    # an existing file is kept unless --overwrite
    (tmp_path / "s.npz").write_bytes(b"old")
    err = one_error_line(cli("--ckpt", run, "--npz", tmp_path / "s.npz", *small).output)
    assert "exists already" in err and "--overwrite" in err
    assert (tmp_path / "s.npz").read_bytes() == b"old"
    r = cli("--ckpt", run, "--npz", tmp_path / "s.npz", *small, "--overwrite")
    assert r.exit_code == 0, r.output
    assert arrays(tmp_path / "s.npz")["arr_0"].shape == (2, 16, 16, 3)
