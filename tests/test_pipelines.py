"""pipelines/imagenet256.sh and pipelines/laion_t2i.sh: `--dry-run` prints the exact commands
(defaults, environment and flag overrides, skip and resume decisions), `--help` lists every
parameter, and each recipe runs end to end on a tiny stand-in: a class-folder tree of real
photos, and a LAION-style parquet of URLs served from 127.0.0.1, with tiny models."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import test_fetch
from PIL import Image
from test_clip import tiny_clip_files
from test_imageshards import encode
from tiny import class_tree

from ditdata.store import open_store

REPO = Path(__file__).resolve().parents[1]
IMAGENET = REPO / "pipelines" / "imagenet256.sh"
LAION = REPO / "pipelines" / "laion_t2i.sh"
COMMON = REPO / "pipelines" / "_common.sh"  # the recipes' shared helpers and parameter groups
VENV_BIN = REPO / ".venv" / "bin"

# the HTTP server and the real photos of the fetch tests
http_files = test_fetch.http_files
images = test_fetch.images


def params_of(script: Path) -> dict[str, str]:
    """{VARIABLE: --flag} of every `param`/`switch`/`list` line of a recipe, and of every
    parameter group of _common.sh (`run_params`, `train_params`, ...) it calls."""
    text = script.read_text()
    groups = dict(re.findall(r"^(\w+_params)\(\) \{\n(.*?)^\}", COMMON.read_text(), re.M | re.S))
    text += "".join(groups.get(name, "") for name in re.findall(r"^(\w+_params)\b", text, re.M))
    return dict(re.findall(r"^\s*(?:param|switch|list) (\w+) (--[\w-]+)", text, re.M))


def recipe_env(**overrides) -> dict:
    """The test's environment without the proxies, nor any of the recipes' own parameters
    (OUT, MODEL, ... could be set in a developer's shell), with the venv's CLIs first on PATH."""
    env = test_fetch._subprocess_env()
    for name in {**params_of(IMAGENET), **params_of(LAION)}:
        env.pop(name, None)
    for name in ("DRY_RUN", "DITDATA", "DITTRAIN", "TORCHRUN"):
        env.pop(name, None)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env |= {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
    env |= {k: str(v) for k, v in overrides.items()}
    return env


def recipe(script: Path, *args, env: dict | None = None, timeout: float = 60, cwd=None):
    return subprocess.run(["bash", str(script), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env or recipe_env(), cwd=cwd)


def commands(stdout: str) -> list[list[str]]:
    """The command lines of a recipe's output (everything that is not a '#' comment or blank)."""
    return [shlex.split(line) for line in stdout.splitlines() if line.strip() and not line.startswith("#")]


WORKERS = str(min(len(os.sched_getaffinity(0)), 8))  # the recipes' default --workers: CPU cores, at most 8


# ============================================================================ imagenet256: dry run


def imagenet_defaults(data: str, out: str = "imagenet256-out") -> list[list[str]]:
    return [
        ["ditdata", "fetch", data, "--out", f"{out}/shards", "--kind", "classes", "--samples-per-shard", "10000",
         "--processes", WORKERS],
        ["ditdata", "encode", f"{out}/shards", "--out", f"{out}/store", "--vae", "sd-vae-ft-ema", "--resolution",
         "256", "--flip", "--backend", "zarr", "--device", "auto", "--batch-size", "32", "--workers", WORKERS],
        ["dittrain", "run", "--latents", f"{out}/store", "--out", f"{out}/run", "--model", "DiT-XL/2",
         "--objective", "ddpm", "--learn-sigma", "--batch-size", "256", "--accumulation-steps", "1",
         "--grad-checkpointing", "none", "--lr", "1e-4", "--weight-decay", "0", "--lr-schedule", "constant",
         "--warmup-steps", "0", "--grad-clip", "0", "--ema", "0.9999", "--class-dropout", "0.1",
         "--max-steps", "400000", "--amp", "bf16", "--no-compile", "--loader", "auto", "--save-every", "5000",
         "--sample-every", "10000", "--log-every", "100", "--seed", "0", "--device", "auto"],
        ["dittrain", "sample", "--ckpt", f"{out}/run", "--out", f"{out}/run/final", "--classes",
         "207,360,387,974,88,979,417,279", "--n-per-class", "4", "--cfg", "4.0", "--steps", "250", "--seed", "0",
         "--device", "auto"],
    ]


def test_imagenet_dry_run_from_the_environment(tmp_path):
    """DRY_RUN=1 is --dry-run; without the data folder the command shows where it goes (the
    defaults with --imagenet: test_dry_run_defaults)."""
    r = recipe(IMAGENET, env=recipe_env(DRY_RUN=1), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert commands(r.stdout) == imagenet_defaults("<IMAGENET_DIR>")


def test_imagenet_dry_run_overrides(tmp_path):
    """Environment and flags (flags win); torchrun for NPROC > 1; the single-GPU variants."""
    env = recipe_env(IMAGENET_DIR="/env/train", OUT=tmp_path / "o", MODEL="DiT-B/2", GRAD_CKPT="every",
                     ACCUM=4, NPROC=2, WORKERS=3, FETCH_SIZE=288, EXTRA_TRAIN_ARGS="--warmup-steps 10 --qk-norm")
    r = recipe(IMAGENET, "--dry-run", "--model", "DiT-L/2", "--batch=128", "--steps", "1000", "--no-flip",
               "--vae", "taef2", "--resolution", "512", "--amp", "fp16", "--compile", "--device", "cuda:1",
               "--sample-classes", "1,2", "--cfg", "1.5", "--store", tmp_path / "s", env=env)
    assert r.returncode == 0, r.stderr
    fetch, enc, train, sample = commands(r.stdout)
    o = str(tmp_path / "o")
    assert fetch == ["ditdata", "fetch", "/env/train", "--out", f"{o}/shards", "--kind", "classes",
                     "--image-size", "288", "--samples-per-shard", "10000", "--processes", "3"]
    assert enc[:6] == ["torchrun", "--standalone", "--nproc_per_node", "2", "-m", "ditdata.cli"]
    assert enc[6:] == ["encode", f"{o}/shards", "--out", str(tmp_path / "s"), "--vae", "taef2", "--resolution",
                       "512", "--no-flip", "--backend", "zarr", "--device", "cuda:1", "--batch-size", "32",
                       "--workers", "3"]
    assert train[:6] == ["torchrun", "--standalone", "--nproc_per_node", "2", "-m", "dittrain.cli"]
    opts = dict(zip(train[7::2], train[8::2], strict=False))
    assert train[6] == "run"
    assert "--model DiT-L/2" in shlex.join(train) and "--batch-size 128 --accumulation-steps 4" in shlex.join(train)
    assert opts["--latents"] == str(tmp_path / "s") and opts["--out"] == f"{o}/run"
    assert "--grad-checkpointing every" in shlex.join(train) and "--max-steps 1000" in shlex.join(train)
    assert "--amp fp16 --compile" in shlex.join(train) and "--device cuda:1" in shlex.join(train)
    assert shlex.join(train).endswith("--warmup-steps 10 --qk-norm")
    assert "--resume" not in train
    assert sample[:2] == ["dittrain", "sample"] and "--classes 1,2" in shlex.join(sample)
    assert "--cfg 1.5" in shlex.join(sample) and f"--out {o}/run/final" in shlex.join(sample)


def test_imagenet_dry_run_skips_finished_stages_and_resumes(tmp_path):
    out = tmp_path / "o"
    (out / "shards").mkdir(parents=True)
    (out / "shards" / "dataset.json").write_text("{}")
    (out / "store").mkdir()
    (out / "store" / "manifest.json").write_text("{}")
    (out / "run" / "checkpoints").mkdir(parents=True)
    (out / "run" / "checkpoints" / "step_00000010.pt").write_bytes(b"")
    r = recipe(IMAGENET, "--dry-run", "--out", out)
    assert r.returncode == 0, r.stderr
    assert "# [fetch] skipped:" in r.stdout and "# [encode] skipped:" in r.stdout
    train, sample = commands(r.stdout)
    assert train[:2] == ["dittrain", "run"] and train[-1] == "--resume"
    assert sample[:2] == ["dittrain", "sample"]
    # --stages picks stages
    r = recipe(IMAGENET, "--dry-run", "--out", out, "--stages", "sample")
    assert [c[:2] for c in commands(r.stdout)] == [["dittrain", "sample"]]


def test_imagenet_fid_stage(tmp_path):
    """--stages fid: FID-50K samples (the paper's protocol; torchrun with NPROC > 1), then eval;
    not among the default stages, and it needs a reference."""
    out = tmp_path / "o"
    r = recipe(IMAGENET, "--dry-run", "--out", out, "--stages", "fid", "--fid-ref", "/refs/VIRTUAL.npz",
               "--inception", "/w/inception.pth")
    assert r.returncode == 0, r.stderr
    sample, ev = commands(r.stdout)
    assert sample == ["dittrain", "sample", "--ckpt", f"{out}/run", "--num-samples", "50000", "--npz",
                      f"{out}/run/fid/samples.npz", "--cfg", "1.5", "--steps", "250", "--seed", "0",
                      "--device", "auto"]
    assert ev == ["dittrain", "eval", "--samples", f"{out}/run/fid/samples.npz", "--ref", "/refs/VIRTUAL.npz",
                  "--inception", "/w/inception.pth", "--device", "auto", "--json", f"{out}/run/fid/fid.json"]
    r = recipe(IMAGENET, "--dry-run", "--out", out, "--stages", "fid", env=recipe_env(NPROC=2))
    assert commands(r.stdout)[0][:6] == ["torchrun", "--standalone", "--nproc_per_node", "2", "-m", "dittrain.cli"]
    r = recipe(IMAGENET, "--out", out, "--stages", "fid")  # not a dry run: the reference is required
    assert r.returncode != 0 and "--fid-ref REF" in r.stderr
    r = recipe(IMAGENET, "--dry-run", "--out", out)
    assert "# [fid]" not in r.stdout  # not a default stage


@pytest.mark.parametrize("script", [IMAGENET, LAION], ids=["imagenet256", "laion_t2i"])
def test_help_lists_every_parameter_and_bad_flags_fail(script, tmp_path):
    r = recipe(script, "--help")
    assert r.returncode == 0 and r.stdout.startswith("Usage:")
    params = params_of(script)
    assert len(params) > 30
    lines = {line.split()[0].rstrip(","): line for line in r.stdout.splitlines() if line.startswith("  --")}
    for name, flag in params.items():
        assert flag in lines, flag
        assert f"{flag} {name}" in lines[flag] or f"[{name}: " in lines[flag], lines[flag]
        assert "[default: " in lines[flag] or re.search(r"\[\w+: (on|off)\]", lines[flag]), lines[flag]
    assert "--dry-run" in lines
    r = recipe(script, "--no-such-thing", "1")
    assert r.returncode == 2 and "unknown option '--no-such-thing'" in r.stderr
    r = recipe(script, "--steps")
    assert r.returncode == 2 and "--steps needs a value" in r.stderr
    r = recipe(script, "--dry-run", "--stages", "fetch,trian")
    assert r.returncode == 2 and "unknown stage 'trian'" in r.stderr
    # a real run without the input says which flag is missing, before running anything
    r = recipe(script, "--out", tmp_path / "o", "--stages", "fetch")
    assert r.returncode == 2 and ("--imagenet DIR" in r.stderr or "--parquet FILE" in r.stderr), r.stderr
    assert not (tmp_path / "o").exists()


def test_clis_are_found_in_the_venv_or_given(tmp_path):
    """$DITDATA/$DITTRAIN win; else the CLIs on PATH; else the active venv; else this checkout's .venv."""
    r = recipe(IMAGENET, "--dry-run", "--out", "o", env=recipe_env(DITDATA="/opt/x/ditdata", DITTRAIN="/opt/x/dittrain"))
    assert [c[0] for c in commands(r.stdout)] == ["/opt/x/ditdata"] * 2 + ["/opt/x/dittrain"] * 2
    bare = recipe_env(PATH="/usr/bin:/bin")
    bare.pop("VIRTUAL_ENV", None)
    r = recipe(LAION, "--dry-run", "--out", "o", env=bare)
    assert r.returncode == 0, r.stderr
    assert {c[0] for c in commands(r.stdout)} == {str(VENV_BIN / "ditdata"), str(VENV_BIN / "dittrain")}
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name in ("ditdata", "dittrain", "torchrun"):
        (venv / "bin" / name).write_text("#!/bin/sh\n")
        (venv / "bin" / name).chmod(0o755)
    r = recipe(IMAGENET, "--dry-run", "--out", "o", "--nproc", 2, env=dict(bare, VIRTUAL_ENV=str(venv)))
    assert [c[0] for c in commands(r.stdout)] == [f"{venv}/bin/ditdata", f"{venv}/bin/torchrun",
                                                  f"{venv}/bin/torchrun", f"{venv}/bin/dittrain"]


# ============================================================================ laion_t2i: dry run


def laion_defaults(parquet: str, out: str = "laion-t2i-out") -> list[list[str]]:
    return [
        ["ditdata", "fetch", parquet, "--out", f"{out}/shards", "--kind", "urls", "--url-col", "URL",
         "--caption-col", "TEXT", "--image-size", "256", "--resize-mode", "center_crop", "--min-image-size", "256",
         "--max-aspect-ratio", "2", "--samples-per-shard", "10000", "--processes", WORKERS, "--threads", "64"],
        ["ditdata", "score", f"{out}/shards", "--clip", "ViT-B-32", "--pretrained", "laion2b_s34b_b79k",
         "--device", "auto", "--workers", WORKERS],
        ["ditdata", "filter", f"{out}/shards", "--min-clip-score", "0.28", "--out", f"{out}/selection.parquet"],
        ["ditdata", "encode", f"{out}/shards", "--out", f"{out}/store", "--select", f"{out}/selection.parquet",
         "--vae", "sd-vae-ft-ema", "--resolution", "256", "--no-flip", "--text-encoder", "ViT-B-32",
         "--text-pretrained", "laion2b_s34b_b79k", "--text-tokens", "--backend", "zarr", "--device", "auto",
         "--batch-size", "32", "--workers", WORKERS],
        ["dittrain", "run", "--latents", f"{out}/store", "--out", f"{out}/run", "--model", "DiT-B/2",
         "--objective", "ddpm", "--batch-size", "256", "--accumulation-steps", "1", "--grad-checkpointing", "none",
         "--lr", "1e-4", "--warmup-steps", "0", "--weight-decay", "0", "--grad-clip", "1.0", "--ema", "0.9999",
         "--caption-dropout", "0.1", "--no-qk-norm", "--max-steps", "400000", "--amp", "bf16", "--no-compile",
         "--loader", "auto", "--save-every", "5000", "--sample-every", "10000", "--log-every", "100", "--seed", "0",
         "--device", "auto"],
        ["dittrain", "sample", "--ckpt", f"{out}/run", "--out", f"{out}/run/final",
         "--prompt", "a photograph of a cat sitting on a sofa", "--prompt", "a red sports car on a mountain road",
         "--prompt", "a bowl of fruit on a wooden table", "--prompt", "a lighthouse on a cliff at sunset",
         "--n-per-class", "4", "--cfg", "4.0", "--steps", "250", "--seed", "0", "--device", "auto"],
    ]


@pytest.mark.parametrize(("script", "flag", "data", "defaults", "stages"), [
    (IMAGENET, "--imagenet", "/data/imagenet/train", imagenet_defaults, ("fetch", "encode", "train", "sample")),
    (LAION, "--parquet", "part-00000.parquet", laion_defaults,
     ("fetch", "score", "filter", "encode", "train", "sample")),
], ids=["imagenet256", "laion_t2i"])
def test_dry_run_defaults(script, flag, data, defaults, stages, tmp_path):
    r = recipe(script, "--dry-run", flag, data, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert commands(r.stdout) == defaults(data)
    for name in stages:
        assert f"# [{name}] " in r.stdout
    assert not list(tmp_path.iterdir())  # nothing was run nor created


def test_laion_dry_run_overrides(tmp_path):
    cfg = tmp_path / "my-clip.json"
    cfg.write_text("{}")
    env = recipe_env(LAION_PARQUET="/env/p.parquet", CLIP_CONFIG=cfg, MIN_CLIP_SCORE="0.3", VAE="sdxl-vae",
                     PROMPTS="env prompt one|env prompt two", KEEP_COLS="similarity,punsafe", NPROC=2,
                     EXTRA_FILTER_ARGS="--min-caption-length 5")
    r = recipe(LAION, "--dry-run", "--out", tmp_path / "o", "--clip-pretrained", "/w/clip.bin", "--model", "DiT-S/2",
               "--resolution", "512", "--no-text-tokens", "--url-col", "url", "--caption-col", "caption", env=env)
    assert r.returncode == 0, r.stderr
    fetch, score, filt, enc, train, sample = map(shlex.join, commands(r.stdout))
    o = tmp_path / "o"
    assert fetch.startswith(f"ditdata fetch /env/p.parquet --out {o}/shards --kind urls --url-col url "
                            "--caption-col caption --keep-col similarity --keep-col punsafe --image-size 512 ")
    assert "--min-image-size 512" in fetch
    assert score.startswith(f"ditdata score {o}/shards --clip my-clip --pretrained /w/clip.bin --clip-config {cfg} ")
    assert filt == f"ditdata filter {o}/shards --min-clip-score 0.3 --out {o}/selection.parquet --min-caption-length 5"
    assert enc.startswith("torchrun --standalone --nproc_per_node 2 -m ditdata.cli encode ")
    assert (f"--vae sdxl-vae --resolution 512 --no-flip --text-encoder my-clip --text-pretrained /w/clip.bin "
            f"--text-config {cfg} --no-text-tokens") in enc
    assert train.startswith("torchrun --standalone --nproc_per_node 2 -m dittrain.cli run ")
    assert "--model DiT-S/2" in train
    assert "--prompt 'env prompt one' --prompt 'env prompt two' --n-per-class 4" in sample
    # flags win over the environment: --top-fraction replaces the threshold, --prompt the prompts;
    # the text encoder can differ from the scorer
    r = recipe(LAION, "--dry-run", "--out", tmp_path / "o", "--top-fraction", "0.3", "--prompt", "a cat's hat",
               "--prompt", "x", "--text-encoder", "ViT-L-14", "--text-pretrained", "openai", "--text-config=",
               "--stages", "filter,encode,sample", env=env)
    assert r.returncode == 0, r.stderr
    filt, enc, sample = commands(r.stdout)
    assert filt[3:5] == ["--top-fraction", "0.3"] and "--min-clip-score" not in filt
    assert "--text-encoder ViT-L-14 --text-pretrained openai --text-tokens" in shlex.join(enc)
    assert [sample[i + 1] for i, a in enumerate(sample) if a == "--prompt"] == ["a cat's hat", "x"]


# ============================================================================ end to end


def stage_times(stdout: str) -> dict[str, str]:
    return dict(re.findall(r"^# \[(\w+)\] (?:took (\S+)|skipped)", stdout, re.M))


def check_grid(path: Path, rows: int, cols: int, size: int) -> None:
    """A grid of rows x cols size-px images with the same padding p around and between them."""
    with Image.open(path) as im:
        im.load()
        w, h = im.size
    pad = (w - cols * size) / (cols + 1)
    assert pad == int(pad) and pad >= 0 and h == rows * size + (rows + 1) * pad, (w, h)


def check_run(run: Path, steps: int, save_every: int) -> list[dict]:
    cfg = json.loads((run / "config.json").read_text())
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("step_*.pt"))
    assert ckpts[-1] == f"step_{steps:08d}.pt" and f"step_{save_every:08d}.pt" in ckpts
    assert (run / "ema.safetensors").stat().st_size > 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(math.isfinite(r["loss"]) for r in rows)
    with Image.open(run / "samples" / f"step_{steps:08d}.png") as im:
        assert im.size[0] > 0
    return cfg


def check_samples(final: Path, rows: int, cols: int, size: int, mode: str | None = None) -> list[dict]:
    """The final samples: final/grid.png of rows x cols (check_grid), each row's cols singles
    final/samples/ROW/NNNN.png of size x size px (and `mode`); the entries of samples.json."""
    check_grid(final / "grid.png", rows=rows, cols=cols, size=size)
    for row in range(rows):
        for i in range(cols):
            with Image.open(final / "samples" / str(row) / f"{i:04d}.png") as im:
                assert im.size == (size, size) and (mode is None or im.mode == mode)
    return json.loads((final / "samples" / "samples.json").read_text())["samples"]


def verify(store: Path) -> None:
    r = subprocess.run(["ditdata", "verify", str(store)], capture_output=True, text=True, env=recipe_env(),
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_imagenet256_end_to_end(tmp_path):
    """Class folders of real photos -> fetch -> encode (pixels at 16 px, with flips) ->
    DiT-T/4 -> samples; a rerun with more steps skips the finished stages and resumes
    training. (Pixels, not a tiny AutoencoderKL: importing diffusers costs ~10 s on 2 cores
    in each of encode, train and sample; the autoencoder paths are tested in test_encode.py
    and test_sample.py.)"""
    train_dir = class_tree(tmp_path / "train", per_class=4, size=40)
    out = tmp_path / "out"
    args = ["--imagenet", train_dir, "--out", out, "--vae", "pixels", "--resolution", 16, "--model", "DiT-T/4",
            "--batch", 8, "--device", "cpu", "--amp", "fp32", "--save-every", 2, "--sample-every", 4,
            "--workers", 1, "--samples-per-shard", 8, "--sample-classes", "all", "--sample-per-class", 2,
            "--sample-steps", 2, "--train-args", "--sample-steps 2 --log-every 1 --workers 0"]
    r = recipe(IMAGENET, *args, env=recipe_env(STEPS=4), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert set(stage_times(r.stdout)) == {"fetch", "encode", "train", "sample"}
    assert "# stage times: fetch " in r.stdout

    info = json.loads((out / "shards" / "dataset.json").read_text())
    assert (info["kind"], info["num_samples"], info["num_shards"]) == ("classes", 16, 2)
    assert info["class_names"] == ["astronaut", "chelsea", "coffee", "rocket"]

    verify(out / "store")
    store = open_store(out / "store")
    m = store.manifest
    assert len(store) == 16 and m["latent"]["shape"] == [3, 16, 16] and m["vae"]["name"] == "pixels"
    assert m["conditioning"]["num_classes"] == 4 and m["image"]["flip"] is True
    assert "latent_flip" in store.tensor_fields

    cfg = check_run(out / "run", steps=4, save_every=2)
    assert cfg["model"]["num_classes"] == 4 and cfg["model"]["learn_sigma"] is True
    assert cfg["train"]["optim"]["ema"] == 0.9999 and cfg["train"]["diffusion"]["class_dropout"] == 0.1
    assert cfg["train"]["optim"]["weight_decay"] == 0 and cfg["train"]["optim"]["batch_size"] == 8

    samples = check_samples(out / "run" / "final", rows=4, cols=2, size=16, mode="RGB")
    assert sorted(s["class"] for s in samples) == [0, 0, 1, 1, 2, 2, 3, 3]

    # rerun with more steps: fetch and encode skip, training resumes from step 4 to 6
    r = recipe(IMAGENET, *args, "--stages", "fetch,encode,train", "--steps", 6, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert stage_times(r.stdout)["fetch"] == "" and stage_times(r.stdout)["encode"] == ""
    (train_cmd,) = [c for c in commands(r.stdout) if c[0] in ("ditdata", "dittrain")]
    assert "--resume" in train_cmd and "resuming at step 4" in r.stderr
    check_run(out / "run", steps=6, save_every=2)


@pytest.mark.slow
def test_laion_t2i_end_to_end(tmp_path, http_files, images):
    """A LAION-style parquet of real photos served from 127.0.0.1 (plus a 404) -> fetch
    (img2dataset) -> score and text embeddings with a tiny open_clip model from a config
    JSON + weights file -> the top half -> encode (pixels, 16 px, token embeddings) ->
    a text DiT -> samples from two prompts."""
    base, files, _ = http_files
    rows = []
    for copy in range(2):
        for name, arr in images.items():
            files[f"/{copy}/{name}.jpg"] = encode(arr, "JPEG", quality=90)
            rows.append({"URL": f"{base}/{copy}/{name}.jpg", "TEXT": f"photo {copy} of a {name}",
                         "similarity": 0.3})
    rows.insert(5, {"URL": f"{base}/missing.jpg", "TEXT": "gone", "similarity": 0.1})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "laion.parquet")
    clip_cfg, clip_weights = tiny_clip_files(tmp_path / "clip")
    out = tmp_path / "out"
    r = recipe(LAION, "--parquet", tmp_path / "laion.parquet", "--out", out, "--keep-cols", "similarity",
               "--resolution", 16, "--samples-per-shard", 4, "--workers", 1, "--threads", 2,
               "--clip-config", clip_cfg, "--clip-pretrained", clip_weights, "--top-fraction", 0.5,
               "--vae", "pixels", "--model", "DiT-T/4", "--steps", 4, "--batch", 4, "--device", "cpu",
               "--amp", "fp32", "--save-every", 2, "--sample-every", 4, "--sample-per-prompt", 2,
               "--prompt", "a photo of a cat", "--prompt", "a rocket on the launch pad", "--sample-steps", 2,
               "--train-args", "--sample-steps 2 --log-every 1 --workers 0", timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert set(stage_times(r.stdout)) == {"fetch", "score", "filter", "encode", "train", "sample"}

    shards = out / "shards"
    info = json.loads((shards / "dataset.json").read_text())
    assert (info["kind"], info["num_samples"]) == ("urls", 14)
    assert info["summary"]["reasons"] == {"HTTP Error 404: Not Found": 1}
    score_files = sorted(shards.glob("*.clip.parquet"))
    assert len(score_files) == len(list(shards.glob("*.tar"))) == 4
    scores = pa.concat_tables([pq.read_table(p, columns=["key", "clip_score"]) for p in score_files]).to_pylist()
    assert len(scores) == 14 and all(s["clip_score"] is not None for s in scores)
    ranked = sorted(scores, key=lambda s: -s["clip_score"])
    expect_keys = {s["key"] for s in ranked[:7]}

    sel = pq.read_table(out / "selection.parquet").to_pylist()
    assert {s["key"] for s in sel} == expect_keys

    verify(out / "store")
    store = open_store(out / "store")
    m = store.manifest
    assert len(store) == 7 and m["latent"]["shape"] == [3, 16, 16]
    assert m["filter"]["top_fraction"] == 0.5 and m["filter"]["selection"] == str((out / "selection.parquet").resolve())
    text = m["conditioning"]["text"]
    assert m["conditioning"]["type"] == "text" and text["pooled_dim"] == 32 and text["tokens_shape"] == [77, 32]
    assert {"text_pooled", "text_tokens", "text_mask"} <= set(store.tensor_fields)
    stored = {}
    for shard in store.shards:
        cols = store.read(shard, ["key", "caption", "clip_score"])
        stored |= {k: (c, s) for k, c, s in zip(cols["key"], cols["caption"], cols["clip_score"], strict=True)}
    assert set(stored) == expect_keys
    by_key = {s["key"]: s["clip_score"] for s in scores}
    assert all(np.isclose(s, by_key[k]) and c.startswith("photo ") for k, (c, s) in stored.items())

    cfg = check_run(out / "run", steps=4, save_every=2)
    assert cfg["model"]["text_pooled_dim"] == 32 and cfg["model"]["text_token_dim"] == 32
    assert cfg["model"]["num_classes"] == 0 and cfg["train"]["diffusion"]["caption_dropout"] == 0.1

    samples = check_samples(out / "run" / "final", rows=2, cols=2, size=16)
    assert [s["prompt"] for s in samples] == ["a photo of a cat"] * 2 + ["a rocket on the launch pad"] * 2
