"""pipelines/imagenet256.sh and pipelines/laion_t2i.sh: `--dry-run` prints the exact commands
(each stage's --config file, the environment and flag overrides, skip and resume decisions),
`--help` lists every parameter with its default from the settings files, the shipped settings
files are valid for their commands, a stopped training says how to continue, and each recipe
runs end to end on a tiny stand-in: a class-folder tree of real photos, and a LAION-style
parquet of URLs served from 127.0.0.1, with tiny models."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import subprocess
import time
import tomllib
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
CONFIGS = REPO / "pipelines" / "configs"  # each recipe's settings files, one per stage
# the command that reads each stage's settings file
STAGE_COMMANDS = {"fetch": ["ditdata", "fetch"], "score": ["ditdata", "score"], "encode": ["ditdata", "encode"],
                  "train": ["dittrain", "run"], "sample": ["dittrain", "sample"], "fid": ["dittrain", "sample"]}
VENV_BIN = REPO / ".venv" / "bin"

# the HTTP server and the real photos of the fetch tests
http_files = test_fetch.http_files
images = test_fetch.images


def _recipe_text(script: Path) -> str:
    """A recipe with the parameter groups of _common.sh (`run_params`, `train_params`, ...) it calls."""
    text = script.read_text()
    groups = dict(re.findall(r"^(\w+_params)\(\) \{\n(.*?)^\}", COMMON.read_text(), re.M | re.S))
    return text + "".join(groups.get(name, "") for name in re.findall(r"^(\w+_params)\b", text, re.M))


def params_of(script: Path) -> dict[str, str]:
    """{VARIABLE: --flag} of every `param`/`switch`/`list`/`setting` line of a recipe, its
    `config STAGE` lines (STAGE_CONFIG: --STAGE-config), and the parameter groups it calls."""
    text = _recipe_text(script)
    found = dict(re.findall(r"^\s*(?:param|switch|list|setting(?: switch| list)?) (\w+) (--[\w-]+)", text, re.M))
    found |= {f"{stage.upper()}_CONFIG": f"--{stage}-config" for stage in re.findall(r"^config (\w+)", text, re.M)}
    return found


def settings_of(script: Path) -> dict[str, tuple[str, str, str]]:
    """{VARIABLE: (kind, first stage, file key)} of every `setting` of a recipe."""
    found = {}
    for kind, name, stages, cmd in re.findall(r"^\s*setting(?: (switch|list))? (\w+) --[\w-]+ ([\w,]+) (--[\w=-]+)",
                                              _recipe_text(script), re.M):
        found[name] = (kind or "value", stages.split(",")[0], cmd.split("=")[-1].lstrip("-"))
    return found


def recipe_env(**overrides) -> dict:
    """The test's environment without the proxies, nor any of the recipes' own parameters
    (OUT, MODEL, ... could be set in a developer's shell), with the venv's CLIs first on PATH."""
    env = test_fetch._subprocess_env()
    for name in {**params_of(IMAGENET), **params_of(LAION)}:
        env.pop(name, None)
    for name in ("DRY_RUN", "DITDATA", "DITTRAIN", "TORCHRUN", "AMP"):
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
    """Each command: its settings file, the paths and the machine; nothing else (the paper's
    settings are in the files: test_shipped_settings_are_the_papers)."""
    c = CONFIGS / "imagenet256"
    return [
        ["ditdata", "fetch", data, "--config", f"{c}/fetch.toml", "--out", f"{out}/shards", "--processes", WORKERS],
        ["ditdata", "encode", f"{out}/shards", "--config", f"{c}/encode.toml", "--out", f"{out}/store",
         "--workers", WORKERS],
        ["dittrain", "run", "--config", f"{c}/train.toml", "--latents", f"{out}/store", "--out", f"{out}/run"],
        ["dittrain", "sample", "--config", f"{c}/sample.toml", "--ckpt", f"{out}/run", "--out", f"{out}/run/final"],
    ]


def test_imagenet_dry_run_from_the_environment(tmp_path):
    """DRY_RUN=1 is --dry-run; without the data folder the command shows where it goes (the
    defaults with --imagenet: test_dry_run_defaults)."""
    r = recipe(IMAGENET, env=recipe_env(DRY_RUN=1), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert commands(r.stdout) == imagenet_defaults("<IMAGENET_DIR>")


def test_imagenet_dry_run_overrides(tmp_path):
    """Environment and flags (flags win) become the commands' flags after --config, in the
    order the recipe declares them; torchrun for NPROC > 1; the single-GPU variants; --amp is
    --precision's older name."""
    env = recipe_env(IMAGENET_DIR="/env/train", OUT=tmp_path / "o", MODEL="DiT-B/2", GRAD_CKPT="every",
                     ACCUM=4, NPROC=2, WORKERS=3, FETCH_SIZE=288, EXTRA_TRAIN_ARGS="--warmup-steps 10 --qk-norm")
    r = recipe(IMAGENET, "--dry-run", "--model", "DiT-L/2", "--batch=128", "--steps", "1000", "--no-flip",
               "--vae", "taef2", "--resolution", "512", "--amp", "fp16", "--compile", "blocks", "--device", "cuda:1",
               "--sample-classes", "1,2", "--cfg", "1.5", "--store", tmp_path / "s", env=env)
    assert r.returncode == 0, r.stderr
    fetch, enc, train, sample = commands(r.stdout)
    o, s, c = str(tmp_path / "o"), str(tmp_path / "s"), CONFIGS / "imagenet256"
    assert fetch == ["ditdata", "fetch", "/env/train", "--config", f"{c}/fetch.toml", "--out", f"{o}/shards",
                     "--processes", "3", "--image-size", "288"]
    assert enc[:6] == ["torchrun", "--standalone", "--nproc_per_node", "2", "-m", "ditdata.cli"]
    assert enc[6:] == ["encode", f"{o}/shards", "--config", f"{c}/encode.toml", "--out", s, "--device", "cuda:1",
                       "--workers", "3", "--vae", "taef2", "--resolution", "512", "--no-flip"]
    assert train[:6] == ["torchrun", "--standalone", "--nproc_per_node", "2", "-m", "dittrain.cli"]
    assert train[6:] == ["run", "--config", f"{c}/train.toml", "--latents", s, "--out", f"{o}/run", "--device", "cuda:1",
                         "--model", "DiT-L/2", "--batch-size", "128", "--accumulation-steps", "4",
                         "--grad-checkpointing", "every", "--max-steps", "1000", "--precision", "fp16",
                         "--compile", "blocks", "--warmup-steps", "10", "--qk-norm"]
    assert sample == ["dittrain", "sample", "--config", f"{c}/sample.toml", "--ckpt", f"{o}/run", "--out",
                      f"{o}/run/final", "--device", "cuda:1", "--classes", "1,2", "--cfg", "1.5"]
    # the old name's variable too (AMP); PRECISION and the flags win over it
    r = recipe(IMAGENET, "--dry-run", "--out", "o", "--stages", "train", env=recipe_env(AMP="fp16"))
    assert commands(r.stdout)[0][-2:] == ["--precision", "fp16"]
    r = recipe(IMAGENET, "--dry-run", "--out", "o", "--stages", "train", env=recipe_env(AMP="fp16", PRECISION="fp32"))
    assert commands(r.stdout)[0][-2:] == ["--precision", "fp32"]
    # a seed set once is the seed of every stage that takes one
    r = recipe(IMAGENET, "--dry-run", "--out", "o", "--seed", 7, "--stages", "train,sample,fid")
    assert [c[c.index("--seed") + 1] for c in commands(r.stdout)[:3]] == ["7", "7", "7"]


def test_a_recipe_flag_wins_over_its_settings_file(tmp_path):
    """The printed train command, run with --print-config: the recipe's flags over train.toml,
    the file's values for the rest; a user's own --train-config replaces the recipe's file."""
    r = recipe(IMAGENET, "--dry-run", "--out", tmp_path / "o", "--lr", "3e-4", "--model", "DiT-S/2",
               "--stages", "train")
    (train,) = commands(r.stdout)
    assert train[train.index("--config") + 1] == str(CONFIGS / "imagenet256" / "train.toml")
    assert shlex.join(train).endswith("--model DiT-S/2 --lr 3e-4")
    printed = subprocess.run([*train, "--print-config"], capture_output=True, text=True, env=recipe_env(), timeout=60)
    assert printed.returncode == 0, printed.stderr
    cfg = tomllib.loads(printed.stdout)
    assert cfg["optim"]["lr"] == 3e-4 and cfg["model"]["model"] == "DiT-S/2"  # the flags
    assert cfg["optim"]["ema"] == 0.9999 and cfg["performance"]["precision"] == "bf16"  # the file
    assert cfg["data"]["latents"] == str(tmp_path / "o" / "store") and cfg["checkpointing"]["out"] == str(tmp_path / "o" / "run")

    mine = tmp_path / "mine.toml"
    mine.write_text('[model]\nmodel = "DiT-B/4"\n\n[optim]\nlr = 2e-4\n')
    r = recipe(IMAGENET, "--dry-run", "--out", tmp_path / "o", "--train-config", mine, "--stages", "train")
    (train,) = commands(r.stdout)
    assert train[2:4] == ["--config", str(mine)] and "--lr" not in train
    assert "# [train] DiT-B/4 on " in r.stdout  # the header reads the file in use
    r = recipe(IMAGENET, "--train-config", mine, "--help")
    assert re.search(r"--lr LR .*\[mine\.toml: 2e-4\]", r.stdout) and "[mine.toml: not set]" in r.stdout


def test_shipped_settings_files_are_valid_for_their_commands(tmp_path):
    """Every pipelines/configs/RECIPE/STAGE.toml is read by its command's --config (checked
    before anything runs, so `--config FILE --help` exits 0 only for a valid file); train.toml
    also resolves with --print-config. recipes/ holds one file per paper with a table per command,
    read through each command in tests/test_recipes.py."""
    files = sorted(p for p in CONFIGS.glob("*/*.toml") if p.parent.name != "recipes")
    assert {p.parent.name for p in files} == {"imagenet256", "laion_t2i", "demo"}
    assert sorted(p.stem for p in (CONFIGS / "recipes").glob("*.toml")) == ["dit_xl2", "dit_xl2_tread",
                                                                           "lightningdit_xl1_vavae", "rae_ditdh_xl",
                                                                           "sit_xl2_repa"]
    for path in files:
        assert path.stem in STAGE_COMMANDS, path
        r = subprocess.run([*STAGE_COMMANDS[path.stem], "--config", str(path), "--help"], capture_output=True,
                           text=True, env=recipe_env(), timeout=60)
        assert r.returncode == 0, f"{path}: {r.stderr}"
        if path.stem == "train":
            r = subprocess.run(["dittrain", "run", "--config", str(path), "--latents", str(tmp_path / "s"), "--out",
                                str(tmp_path / "r"), "--print-config"], capture_output=True, text=True,
                               env=recipe_env(), timeout=60)
            assert r.returncode == 0, f"{path}: {r.stderr}"
            assert tomllib.loads(r.stdout)["checkpointing"]["out"] == str(tmp_path / "r")
    # the check itself: a wrong key fails
    bad = tmp_path / "encode.toml"
    bad.write_text('vae = "pixels"\nresolutoin = 16\n')
    r = subprocess.run(["ditdata", "encode", "--config", str(bad), "--help"], capture_output=True, text=True,
                       env=recipe_env(), timeout=60)
    assert r.returncode == 2 and "resolutoin: unknown key" in r.stderr


def test_shipped_settings_are_the_papers(tmp_path):
    """imagenet256's train.toml is the DiT paper's: AdamW lr 1e-4 constant, no weight decay,
    batch 256, EMA 0.9999, class dropout 0.1, ddpm (learned sigma: its default), 400k steps,
    no gradient clipping, bf16; the final grid with CFG 4.0 and 250 steps, FID-50K with 1.5."""
    r = subprocess.run(["dittrain", "run", "--config", str(CONFIGS / "imagenet256" / "train.toml"), "--latents", "s",
                        "--out", "r", "--print-config"], capture_output=True, text=True, env=recipe_env(), timeout=60)
    cfg = tomllib.loads(r.stdout)
    assert cfg["model"]["model"] == "DiT-XL/2" and "learn-sigma" not in cfg["model"]  # None: on for ddpm
    assert cfg["diffusion"]["objective"] == "ddpm" and cfg["diffusion"]["class-dropout"] == 0.1
    o = cfg["optim"]
    assert (o["optimizer"], o["lr"], o["lr-schedule"], o["warmup-steps"], o["weight-decay"]) == ("adamw", 1e-4,
                                                                                                  "constant", 0, 0)
    assert (o["batch-size"], o["ema"], o["max-steps"], o["grad-clip"]) == (256, 0.9999, 400000, 0)
    assert cfg["performance"]["precision"] == "bf16"
    sample = tomllib.loads((CONFIGS / "imagenet256" / "sample.toml").read_text())
    fid = tomllib.loads((CONFIGS / "imagenet256" / "fid.toml").read_text())
    assert (sample["cfg"], sample["steps"], fid["n"], fid["cfg"], fid["steps"]) == (4.0, 250, 50000, 1.5, 250)
    encode = tomllib.loads((CONFIGS / "imagenet256" / "encode.toml").read_text())
    assert (encode["vae"], encode["resolution"], encode["flip"]) == ("sd-vae-ft-ema", 256, True)


def test_a_bad_settings_file_fails_before_anything_runs(tmp_path):
    """A real run reads each wanted stage's file with its command first: a typo in train.toml
    fails at once, not after hours of fetch and encode."""
    bad = tmp_path / "train.toml"
    bad.write_text("[optim]\nlr = 1e-4\nema-decay = 0.999\n")
    r = recipe(IMAGENET, "--imagenet", tmp_path / "none", "--out", tmp_path / "o", "--train-config", bad)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "ema-decay: unknown key" in r.stderr and f"--train-config {bad}" in r.stderr
    assert not (tmp_path / "o").exists() and "# [fetch]" not in r.stdout
    r = recipe(IMAGENET, "--out", tmp_path / "o", "--stages", "fetch", "--train-config", bad)  # not a wanted stage
    assert r.returncode == 2 and "--imagenet DIR" in r.stderr


def _fake_trainer(path: Path, body: str) -> Path:
    """A stand-in `dittrain`: `--help` (the settings check) passes, `run` does `body`."""
    path.write_text(f'#!/bin/bash\ncase " $* " in *" --help "*) exit 0 ;; esac\n{body}\n')
    path.chmod(0o755)
    return path


def test_a_stopped_training_says_how_to_continue(tmp_path):
    """dittrain run's exit status 75 (stopped by a signal, after a checkpoint) is not a failure:
    the recipe says to rerun and exits 75; any other status is FAILED."""
    fake = _fake_trainer(tmp_path / "dittrain", 'echo "resume with: dittrain run --resume --out X" >&2; exit 75')
    r = recipe(IMAGENET, "--out", tmp_path / "o", "--stages", "train", env=recipe_env(DITTRAIN=fake))
    assert r.returncode == 75, r.stderr
    assert "# [train] stopped by a signal (checkpoint saved); rerun the same command to continue" in r.stderr
    assert "FAILED" not in r.stderr
    fake = _fake_trainer(tmp_path / "dittrain", "exit 3")
    r = recipe(IMAGENET, "--out", tmp_path / "o", "--stages", "train", env=recipe_env(DITTRAIN=fake))
    assert r.returncode == 3 and "# [train] FAILED (exit 3)" in r.stderr


def test_a_signal_to_the_whole_job_stops_training_and_the_recipe_says_so(tmp_path):
    """SIGTERM to the recipe's process group (Slurm, timeout): the trainer saves and exits 75,
    and the recipe outlives it to say how to continue (without its trap, bash died first)."""
    started = tmp_path / "started"
    fake = _fake_trainer(tmp_path / "dittrain", f"trap 'exit 75' TERM\ntouch {started}\n"
                                                "while :; do sleep 0.1; done")
    p = subprocess.Popen(["bash", str(IMAGENET), "--out", str(tmp_path / "o"), "--stages", "train"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=recipe_env(DITTRAIN=fake), start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not started.exists() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.05)
        assert started.exists(), p.communicate(timeout=10)
        os.killpg(p.pid, signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 75, out + err
    assert "stopped by a signal (checkpoint saved); rerun the same command to continue" in err


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
    assert train[:2] == ["dittrain", "run"] and train[-1] == "--resume"  # the same command, + --resume
    assert train[:-1] == imagenet_defaults("x", str(out))[2]
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
    assert sample == ["dittrain", "sample", "--config", str(CONFIGS / "imagenet256" / "fid.toml"), "--ckpt",
                      f"{out}/run", "--npz", f"{out}/run/fid/samples.npz"]
    assert ev == ["dittrain", "eval", "--samples", f"{out}/run/fid/samples.npz", "--ref", "/refs/VIRTUAL.npz",
                  "--inception", "/w/inception.pth", "--json", f"{out}/run/fid/fid.json"]
    assert "# [fid] FID-50000 of " in r.stdout  # fid.toml's
    r = recipe(IMAGENET, "--dry-run", "--out", out, "--stages", "fid", "--fid-n", 100, "--fid-cfg", 2, "--device", "cpu")
    sample, ev = commands(r.stdout)
    # --num-samples, not --n: torchrun's own parser would take --n
    assert shlex.join(sample).endswith(f"--npz {out}/run/fid/samples.npz --device cpu --num-samples 100 --cfg 2")
    assert ev[-4:] == ["--device", "cpu", "--json", f"{out}/run/fid/fid.json"]
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
        assert f"{flag} {name}" in lines[flag] or re.search(rf"\[{name}[:;] ", lines[flag]), lines[flag]
        assert re.search(r"\[(default|[\w.]+\.toml): ", lines[flag]) or re.search(r"\[\w+(; [\w.]+\.toml)?: (on|off)\]",
                                                                               lines[flag]), lines[flag]
    # a setting's default is the value in its stage's settings file
    settings = settings_of(script)
    assert len(settings) > 20
    for name, (kind, stage, key) in settings.items():
        flat = {k: v for table in tomllib.loads((CONFIGS / script.stem / f"{stage}.toml").read_text()).items()
                for k, v in (table[1].items() if isinstance(table[1], dict) else [table])}
        shown = re.search(rf"\[(?:{name}; )?{stage}\.toml: (.*)\]$", lines[params[name]]).group(1)
        if key not in flat:
            assert shown == "not set", (name, shown)
        elif kind == "switch":
            assert shown == ("on" if flat[key] else "off"), (name, shown)
        elif isinstance(flat[key], list):
            assert shown == "|".join(map(str, flat[key])), (name, shown)
        elif isinstance(flat[key], int | float):
            assert float(shown) == flat[key], (name, shown)
        else:
            assert shown == flat[key], (name, shown)
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
    c = CONFIGS / "laion_t2i"
    return [
        ["ditdata", "fetch", parquet, "--config", f"{c}/fetch.toml", "--out", f"{out}/shards", "--processes", WORKERS],
        ["ditdata", "score", f"{out}/shards", "--config", f"{c}/score.toml", "--threads", WORKERS],
        ["ditdata", "filter", f"{out}/shards", "--min-clip-score", "0.28", "--out", f"{out}/selection.parquet"],
        ["ditdata", "encode", f"{out}/shards", "--config", f"{c}/encode.toml", "--out", f"{out}/store", "--select",
         f"{out}/selection.parquet", "--workers", WORKERS],
        ["dittrain", "run", "--config", f"{c}/train.toml", "--latents", f"{out}/store", "--out", f"{out}/run"],
        ["dittrain", "sample", "--config", f"{c}/sample.toml", "--ckpt", f"{out}/run", "--out", f"{out}/run/final"],
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
    o, c = tmp_path / "o", CONFIGS / "laion_t2i"
    assert fetch == (f"ditdata fetch /env/p.parquet --config {c}/fetch.toml --out {o}/shards --keep-col similarity "
                     f"--keep-col punsafe --processes {WORKERS} --url-col url --caption-col caption --image-size 512 "
                     "--min-image-size 512")  # --resolution is fetch's sizes too
    # a custom scorer is named after its config file; its model, weights and config embed the captions
    assert score == (f"ditdata score {o}/shards --config {c}/score.toml --threads {WORKERS} --clip-config {cfg} "
                     "--clip my-clip --pretrained /w/clip.bin")
    assert filt == f"ditdata filter {o}/shards --min-clip-score 0.3 --out {o}/selection.parquet --min-caption-length 5"
    assert enc == ("torchrun --standalone --nproc_per_node 2 -m ditdata.cli encode "
                   f"{o}/shards --config {c}/encode.toml --out {o}/store --select {o}/selection.parquet "
                   f"--workers {WORKERS} --resolution 512 --vae sdxl-vae --text-encoder my-clip "
                   f"--text-pretrained /w/clip.bin --text-config {cfg} --no-text-tokens")
    assert train == ("torchrun --standalone --nproc_per_node 2 -m dittrain.cli run "
                     f"--config {c}/train.toml --latents {o}/store --out {o}/run --model DiT-S/2")
    assert sample.endswith(f"--config {c}/sample.toml --ckpt {o}/run --out {o}/run/final "
                           "--prompt 'env prompt one' --prompt 'env prompt two'")
    # flags win over the environment: --top-fraction replaces the threshold, --prompt the prompts;
    # the text encoder can differ from the scorer
    r = recipe(LAION, "--dry-run", "--out", tmp_path / "o", "--top-fraction", "0.3", "--prompt", "a cat's hat",
               "--prompt", "x", "--text-encoder", "ViT-L-14", "--text-pretrained", "openai", "--text-config=",
               "--stages", "filter,encode,sample", env=env)
    assert r.returncode == 0, r.stderr
    filt, enc, sample = commands(r.stdout)
    assert filt[3:5] == ["--top-fraction", "0.3"] and "--min-clip-score" not in filt
    assert shlex.join(enc).endswith("--text-encoder ViT-L-14 --text-pretrained openai")  # --text-config=: none
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
            "--batch", 8, "--device", "cpu", "--precision", "fp32", "--save-every", 2, "--sample-every", 4,
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
    # the rerun is the same command + --resume, so a changed learned setting is refused, not ignored
    r = recipe(IMAGENET, *args, "--stages", "train", "--steps", 8, "--lr", "3e-4", timeout=120)
    assert r.returncode != 0 and "--lr 0.0001 -> 0.0003" in r.stderr, r.stderr[-2000:]
    assert "# [train] FAILED" in r.stderr


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
               "--precision", "fp32", "--save-every", 2, "--sample-every", 4, "--sample-per-prompt", 2,
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
