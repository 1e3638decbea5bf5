"""dittrain/inference/export.py, dittrain/inference/onnx.py and `dittrain export` / `dittrain sample --engine onnx`:
tiny runs (DiT-T/4 on 4x8x8 latents of a tiny diffusers AutoencoderKL, random weights) exported
to every format, loaded back the way users load them, and compared with the fp32 PyTorch model.

Bounds: ONNX forward within 1e-4 of PyTorch (measured ~1e-6), ONNX sampling gives the torch
path's PNGs within 1/255 (measured: equal); the diffusers transformer equals ours within 1e-5
after match_dit_timesteps (measured 0); fp16 and int8 samples stay within a few levels of the
fp32 ones (fp16: max 2/255, int8: mean under 2/255, max 16/255).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from cliutil import dittrain, ok, one_error_line
from storeutil import tiny_store
from test_sample import make_run, read_png
from tiny import save_tiny_kl

from dittrain.diffusion import DiffusionConfig
from dittrain.inference.open_run import load_for_sampling, load_model
from dittrain.inference.weights import load_weights
from dittrain.model.dit import DiT
from dittrain.model.sizes import get_config
from dittrain.rundir import export_weights

pytestmark = pytest.mark.usefixtures("one_thread")
SAMPLE = ["--class", "0,1,2", "--n", 3, "--steps", 4, "--cfg", 3.0, "--device", "cpu", "--seed", 5]


@pytest.fixture(scope="module")
def kl_run(tmp_path_factory):
    """A class-conditional ddpm run (3 named classes, learned sigma) on a store encoded with a
    tiny diffusers AutoencoderKL (scaling 0.5, /2: 16 px images)."""
    from ditdata.autoencoders.kinds import load_autoencoder

    root = tmp_path_factory.mktemp("export")
    kl = save_tiny_kl(root / "tiny-kl", scaling_factor=0.5)
    store = tiny_store(root / "store", shape=(4, 8, 8), vae=load_autoencoder(str(kl)).info)
    return make_run(root / "run", store), store


@pytest.fixture(scope="module")
def torch_samples(kl_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("torch-samples") / "t"
    r = dittrain("sample", "--ckpt", kl_run[0], "--out", out, *SAMPLE)
    assert r.exit_code == 0, r.output
    return singles(out)


def singles(out) -> list[np.ndarray]:
    return [read_png(p).astype(int) for p in sorted((Path(out) / "samples").glob("*.png"))]


def export(*args):
    return dittrain("export", *args)


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> int:
    assert len(a) == len(b) > 0
    return max(int(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


# -----------------------------------------------------------------------------
# onnx


def test_onnx_export_checks_and_samples_like_torch(kl_run, torch_samples, tmp_path):
    import onnxruntime as ort

    run, _ = kl_run
    f = tmp_path / "dit.onnx"
    r = ok(export("--ckpt", run, "--format", "onnx", "--out", f))
    m = re.search(r"max abs diff (\S+) at batch 2, (\S+) at batch 3 \(tolerance 1e-04", r.output)
    assert m, r.output
    assert all(float(v) <= 1e-4 for v in m.groups())  # measured ~5e-7
    assert (f"trtexec --onnx={f} --minShapes=x:1x4x8x8,t:1,y:1 --optShapes=x:64x4x8x8,t:64,y:64 "
            f"--maxShapes=x:128x4x8x8,t:128,y:128 --fp16") in r.output
    assert re.search(rf"wrote {re.escape(str(f))} \(\d+\.\d MB\)", r.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dit.onnx"]  # one file, no temporaries
    # the file: dynamic batch, the run config in its metadata
    session = ort.InferenceSession(str(f), providers=["CPUExecutionProvider"])
    assert [(i.name, i.shape) for i in session.get_inputs()] == [
        ("x", ["batch", 4, 8, 8]), ("t", ["batch"]), ("y", ["batch"])]
    meta = session.get_modelmeta().custom_metadata_map
    assert json.loads(meta["dittrain_config"])["model"] == load_weights(run)[1]["model"]
    assert json.loads(meta["dittrain_export"])["inputs"] == ["x", "t", "y"]
    out = session.run(None, {"x": np.zeros((5, 4, 8, 8), np.float32), "t": np.full(5, 10.0, np.float32),
                             "y": np.arange(5) % 4})[0]
    assert out.shape == (5, 8, 8, 8)

    # sampling through onnxruntime: the config from the file (no --ckpt), the same PNGs
    r = dittrain("sample", "--engine", "onnx", "--onnx", f, "--out", tmp_path / "o", *SAMPLE)
    assert r.exit_code == 0, r.output
    assert "engine: onnxruntime" in r.output
    assert max_diff(singles(tmp_path / "o"), torch_samples) <= 1  # measured 0
    index = json.loads((tmp_path / "o" / "samples" / "samples.json").read_text())
    assert index["engine"] == "onnx" and index["ckpt"] is None
    # with --ckpt the run's config is used and must be the file's model
    r = dittrain("sample", "--engine", "onnx", "--onnx", f, "--ckpt", run, "--out", tmp_path / "c", *SAMPLE)
    assert r.exit_code == 0, r.output
    assert max_diff(singles(tmp_path / "c"), torch_samples) <= 1
    assert "--onnx" in one_error_line(dittrain("sample", "--engine", "onnx", "--out", tmp_path / "x", *SAMPLE).output)
    line = one_error_line(dittrain("sample", "--engine", "onnx", "--onnx", f, "--out", tmp_path / "x", "--npz",
                                   tmp_path / "x.npz").output)
    assert "--npz" in line


def test_onnx_text_model_and_the_onnx_network(tmp_path, monkeypatch):
    """A text model's inputs (pooled, tokens of any length, a mask with an empty caption)
    through the exporter's check, then OnnxDiT against the DiT on another batch. Written as
    a model past 2 GB is (the threshold lowered): FILE.onnx + FILE.onnx.data."""
    import dittrain.inference.onnx
    from dittrain.inference.onnx import OnnxDiT, export_onnx, random_inputs

    monkeypatch.setattr(dittrain.inference.onnx, "EXTERNAL_DATA_BYTES", 0)

    torch.manual_seed(0)
    dit = DiT(get_config("DiT-T/4", input_size=8, in_channels=4, num_classes=0, text_pooled_dim=16,
                         text_token_dim=12, learn_sigma=False))
    with torch.no_grad():
        for p in dit.parameters():
            p.add_(0.02 * torch.randn_like(p))
    dit.eval()
    config = {"train": {"model": "DiT-T/4"}, "model": asdict(dit.config),
              "diffusion": asdict(DiffusionConfig(objective="flow", learn_sigma=False))}
    lines = []
    files = export_onnx(dit, config, tmp_path / "t.onnx", {"format": "onnx"}, tokens=5, log=lines.append)
    assert files == [tmp_path / "t.onnx.data", tmp_path / "t.onnx"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.onnx", "t.onnx.data"]
    assert 4 * (tmp_path / "t.onnx").stat().st_size < (tmp_path / "t.onnx.data").stat().st_size  # the weights
    text = "\n".join(lines)
    assert "weights pass 2 GB" in text
    assert "x, t, text_pooled, text_tokens, text_mask -> out" in text
    assert "text_pooled:1x16,text_tokens:1x5x12,text_mask:1x5" in text
    net = OnnxDiT(tmp_path / "t.onnx")
    assert net.config == dit.config and net.run_config == config
    inputs = random_inputs(dit.config, 4, torch.Generator().manual_seed(9), tokens=11)
    with torch.no_grad():
        assert (net(**inputs) - dit(**inputs)).abs().max() <= 1e-4
    with pytest.raises(ValueError, match="takes text_pooled"):
        net(inputs["x"], inputs["t"])


# -----------------------------------------------------------------------------
# diffusers


def test_diffusers_pipeline_reloads_offline_matches_and_samples(kl_run, tmp_path):
    from diffusers import DiTPipeline

    from dittrain.inference.export import match_dit_timesteps
    from dittrain.inference.onnx import random_inputs

    run, store = kl_run
    d = tmp_path / "pipe"
    r = ok(export("--ckpt", run, "--format", "diffusers", "--out", d),
           "max abs diff 0.0e+00 after match_dit_timesteps(pipe)", "class table has 1001 rows")
    for part in ("transformer/", "vae/", "scheduler/", "model_index.json"):
        assert re.search(rf"  {part}  \d+\.\d (MB|kB)", r.output), r.output
    pipe = DiTPipeline.from_pretrained(str(d), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.labels == {"astronaut": 0, "chelsea": 1, "coffee": 2}  # id2label, the store's names
    s = pipe.scheduler.config
    assert (type(pipe.scheduler).__name__, s.beta_schedule, s.prediction_type, s.clip_sample,
            s.num_train_timesteps, s.beta_start, s.beta_end) == ("DDIMScheduler", "linear", "epsilon", False,
                                                                 1000, 1e-4, 0.02)
    assert pipe.vae.config.scaling_factor == 0.5
    # the transformer against our DiT on the same inputs; our null class 3 is diffusers' 1000
    weights, config = load_weights(run)
    dit = load_model(weights, config)
    inputs = random_inputs(dit.config, 4, torch.Generator().manual_seed(0))
    inputs["y"] = torch.tensor([0, 1, 2, 3])
    y = torch.tensor([0, 1, 2, 1000])

    def diff():
        with torch.no_grad():
            ours = dit(**inputs)
            theirs = pipe.transformer(inputs["x"], timestep=inputs["t"], class_labels=y).sample
        return float((ours - theirs).abs().max())

    assert diff() > 1e-3  # as loaded: downscale_freq_shift=1, which no config key changes
    assert match_dit_timesteps(pipe) == dit.config.depth
    assert diff() <= 1e-5  # measured 0
    # the pipeline samples, with guidance (the null class 1000 is a row of the padded table)
    for scale in (4.0, 1.0):
        images = pipe(class_labels=[0, 2], guidance_scale=scale, num_inference_steps=3,
                      generator=torch.manual_seed(0), output_type="np").images
        assert images.shape == (2, 16, 16, 3) and np.isfinite(images).all()


# -----------------------------------------------------------------------------
# fp16 and int8


def test_fp16_and_int8_load_and_sample_close_to_fp32(kl_run, torch_samples, tmp_path):
    run, _ = kl_run
    fp32 = (run / "ema.safetensors").stat().st_size
    outs = {}
    for fmt, name, ratio in (("fp16", "dit.safetensors", (0.45, 0.55)), ("int8", "dit.pt", (0.2, 0.4))):
        f = tmp_path / name
        r = export("--ckpt", run, "--format", fmt, "--out", f)
        assert r.exit_code == 0, r.output
        assert "loads as `dittrain sample --ckpt` loads it" in r.output and f"wrote {f} (" in r.output
        assert ratio[0] < f.stat().st_size / fp32 < ratio[1]
        r = dittrain("sample", "--ckpt", f, "--out", tmp_path / fmt, *SAMPLE)
        assert r.exit_code == 0, r.output
        outs[fmt] = singles(tmp_path / fmt)
    assert max_diff(outs["fp16"], torch_samples) <= 2  # measured 1
    int8 = np.abs(np.stack(outs["int8"]) - np.stack(torch_samples))
    assert int8.mean() < 2 and int8.max() <= 16  # measured mean ~0.1, max 1-2

    # how the loaders see them: fp16 cast to float32; int8 torchao tensors in the linears
    _, config, _, _ = load_for_sampling(tmp_path / "dit.safetensors")
    w, _ = load_weights(tmp_path / "dit.safetensors")
    assert w["blocks.0.attn.qkv.weight"].dtype == torch.float16 and config == load_weights(run)[1]
    assert load_model(w, config).blocks[0].attn.qkv.weight.dtype == torch.float32
    w, config = load_weights(tmp_path / "dit.pt")
    net = load_model(w, config)
    assert type(net.blocks[0].attn.qkv.weight).__module__.startswith("torchao")
    assert net.pos_embed.dtype == torch.float32 and type(net.pos_embed) is torch.nn.Parameter
    # a fresh process, torchao not imported yet: torch.load(weights_only=True) with torchao's
    # classes allowed by name (no pickle beyond them)
    code = ("import sys; from dittrain.inference.weights import load_weights; assert 'torchao' not in sys.modules; "
            f"w, c = load_weights({str(tmp_path / 'dit.pt')!r}); print(type(w['blocks.0.mlp.fc1.weight']).__name__)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.split()[-1] == "Int8Tensor", p.stderr[-2000:]
    # an int8 export is for sampling: not a source of another export
    line = one_error_line(export("--ckpt", tmp_path / "dit.pt", "--format", "fp16", "--out", tmp_path / "x.safetensors").output)
    assert "is an int8 export" in line
    # --overwrite replaces
    r = export("--ckpt", run, "--format", "fp16", "--out", tmp_path / "dit.safetensors", "--overwrite")
    assert r.exit_code == 0, r.output


# -----------------------------------------------------------------------------
# refusals: one line, nothing written


def _run_dir(root: Path, dit: DiT, objective: str = "ddpm") -> Path:
    config = {"train": {"model": "DiT-T/4", "objective": objective}, "model": asdict(dit.config),
              "diffusion": asdict(DiffusionConfig(objective=objective, learn_sigma=dit.config.learn_sigma))}
    root.mkdir(parents=True)
    export_weights(root / "ema.safetensors", dit.state_dict(), config)
    return root


def test_refused_exports_say_why_in_one_line(kl_run, tmp_path, monkeypatch):
    run, store = kl_run
    text = _run_dir(tmp_path / "text", DiT(get_config("DiT-T/4", input_size=8, in_channels=4, num_classes=0,
                                                      text_pooled_dim=16, text_token_dim=16)))
    flow = _run_dir(tmp_path / "flow", DiT(get_config("DiT-T/4", input_size=8, in_channels=4, num_classes=3,
                                                      learn_sigma=False)), objective="flow")
    swiglu = _run_dir(tmp_path / "swiglu", DiT(get_config("DiT-T/4", input_size=8, in_channels=4, num_classes=3,
                                                          mlp="swiglu", norm="rms")))
    pixels = make_run(tmp_path / "pixels-run", tiny_store(tmp_path / "pixels-store"))
    cases = [
        ((text, "diffusers", "p"), ["text-conditioned", "no diffusers pipeline matches it"]),
        ((swiglu, "diffusers", "p"), ["LightningDiT's (mlp=swiglu, norm=rms)", "no diffusers pipeline has these blocks"]),
        ((flow, "diffusers", "p"), ["objective is flow", "DiTPipeline samples DDPM"]),
        ((pixels, "diffusers", "p"), ["autoencoder is 'pixels'", "AutoencoderKL"]),
        ((run, "tflite", "p"), ["Invalid value for '--format'"]),
        ((run, "fp16", "x.pt"), ["name it NAME.safetensors"]),
        ((run, "onnx", Path(store) / "dit.onnx"), ["inside the latent store"]),
    ]
    for (ckpt, fmt, out), needles in cases:
        out = tmp_path / out
        line = one_error_line(export("--ckpt", ckpt, "--format", fmt, "--out", out).output)
        assert all(n in line for n in needles), line
        assert not out.exists()
    # an existing output without --overwrite
    (tmp_path / "taken.pt").write_bytes(b"mine")
    line = one_error_line(export("--ckpt", run, "--format", "int8", "--out", tmp_path / "taken.pt").output)
    assert "exists already; pass --overwrite" in line and (tmp_path / "taken.pt").read_bytes() == b"mine"
    # a missing extra
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    line = one_error_line(export("--ckpt", run, "--format", "onnx", "--out", tmp_path / "m.onnx").output)
    assert "needs onnxruntime" in line and "pip install 'ditkit[export]'" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flow", "pixels-run", "pixels-store", "swiglu", "taken.pt",
                                                          "text"]
