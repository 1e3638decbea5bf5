"""`dittrain run --config FILE.toml`, `--print-config`, and resuming from the run's own record
(dittrain.train.resume): the file's values under the command line's, one-line errors naming the
key and the file, safe changes applied and recorded, learned ones refused unless allowed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cliutil import ditdata, losses, one_error_line, run_args
from cliutil import dittrain as cli

from dittrain.rundir import latest_checkpoint, load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def _toml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _record(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())


def test_print_config_round_trips_to_the_same_run(store, tmp_path):
    """--print-config -> --config gives the same config.json as the flags did."""
    flags = run_args(store, tmp_path / "a", "--max-steps", 2, "--lr", "3e-4", "--ema", "0.5",
                     "--precision", "fp32", "--grad-checkpointing", "2", "--logger", "jsonl")
    printed = cli(*flags, "--print-config")
    assert printed.exit_code == 0, printed.output
    assert "[optim]" in printed.output and "lr = 0.0003" in printed.output and "precision = \"fp32\"" in printed.output
    assert not (tmp_path / "a").exists()  # printing runs nothing
    assert cli(*flags).exit_code == 0
    text = printed.output.replace(str(tmp_path / "a"), str(tmp_path / "b"))
    r = cli("run", "--config", _toml(tmp_path / "run.toml", text))
    assert r.exit_code == 0, r.output
    a, b = _record(tmp_path / "a"), _record(tmp_path / "b")
    a["train"]["checkpointing"]["out"] = b["train"]["checkpointing"]["out"]
    assert a == b
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


def test_command_line_wins_over_the_file(store, tmp_path):
    conf = _toml(tmp_path / "run.toml", f"""
[data]
latents = "{store}"
[model]
model = "DiT-T/4"
[optim]
batch-size = 8
max-steps = 2
lr = 0.01
seed = 3
[checkpointing]
out = "{tmp_path / 'r'}"
[logging]
sample-every = 0
logger = "jsonl"
[performance]
device = "cpu"
""")
    r = cli("run", "--config", conf, "--lr", "2e-4", "--print-config")
    assert r.exit_code == 0, r.output
    assert "lr = 0.0002" in r.output and "batch-size = 8" in r.output and "max-steps = 2" in r.output
    r = cli("run", "--config", conf, "--max-steps", "1")
    assert r.exit_code == 0, r.output
    rec = _record(tmp_path / "r")["train"]
    assert rec["optim"]["lr"] == 0.01 and rec["optim"]["max_steps"] == 1 and rec["optim"]["batch_size"] == 8


@pytest.mark.parametrize("command, text, needles", [
    ("run", "[optim]\nlearning-rate = 1e-4\n", ["[optim] learning-rate", "unknown key"]),
    ("run", "[optim]\nbatchsize = 8\n", ["did you mean batch-size"]),
    ("run", "[data]\nlr = 1e-4\n", ["[data] lr", "belongs in the [optim] table"]),
    ("run", "lr = 1e-4\n", ["lr", "belongs in the [optim] table"]),
    ("run", "[optimiser]\nlr = 1e-4\n", ["[optimiser]", "unknown table"]),
    ("run", "[optim]\nbatch-size = \"big\"\n", ["[optim] batch-size", "takes an integer"]),
    ("run", "[optim]\nmax-steps = 1.5\n", ["[optim] max-steps", "takes an integer"]),
    ("run", "[optim]\nlr = true\n", ["[optim] lr", "takes a number"]),
    ("run", "[optim]\nema = 2.0\n", ["[optim] ema"]),
    ("run", "[performance]\ntf32 = \"yes\"\n", ["[performance] tf32", "true or false"]),
    ("run", "[performance]\nprecision = \"fp8\"\n", ["[performance] precision", "fp8"]),
    ("run", "[config]\nallow-changes = true\n", ["allow-changes", "command-line flag only"]),
    ("run", "[optim\n", ["not valid TOML"]),
    # the data side: top-level keys
    ("encode", "vae = \"pixels\"\nresoluton = 16\n", ["resoluton", "did you mean resolution"]),
    ("encode", "batch-size = \"4\"\n", ["batch-size", "takes an integer"]),
    ("encode", "flip = 1\n", ["flip", "true or false"]),
    ("encode", "backend = \"lmdb\"\n", ["backend", "lmdb"]),
    ("encode", "[encode]\nvae = \"pixels\"\n", ["[encode]", "top-level keys"]),
])
def test_a_bad_file_is_one_line_naming_the_key_and_the_file(store, tmp_path, command, text, needles):
    conf = _toml(tmp_path / "bad.toml", text)
    if command == "run":
        r = cli(*run_args(store, tmp_path / "r"), "--config", conf)
    else:
        (tmp_path / "shards").mkdir()
        r = ditdata("encode", tmp_path / "shards", "-o", tmp_path / "r", "--config", conf)
    assert r.exit_code == 2, r.output
    line = one_error_line(r.output)
    for needle in [str(conf), *needles]:
        assert needle in line, line
    assert not (tmp_path / "r").exists()  # refused before anything ran


def test_a_missing_config_file(store, tmp_path):
    r = cli(*run_args(store, tmp_path / "r"), "--config", tmp_path / "nope.toml")
    assert r.exit_code == 2 and "nope.toml" in one_error_line(r.output)


def _start(store, out: Path, *extra) -> None:
    r = cli(*run_args(store, out, "--max-steps", 3, "--save-every", 3, "--lr", "1e-3", "--logger", "jsonl", *extra))
    assert r.exit_code == 0, r.output


def test_resume_alone_continues_with_the_record(store, tmp_path):
    _start(store, tmp_path / "r", "--ema", "0.5", "--grad-clip", "0.5")
    r = cli("run", "--resume", "--out", tmp_path / "r", "--max-steps", 5)
    assert r.exit_code == 0, r.output
    rec = _record(tmp_path / "r")
    assert rec["train"]["optim"]["lr"] == 1e-3 and rec["train"]["optim"]["ema"] == 0.5
    assert rec["train"]["optim"]["grad_clip"] == 0.5 and rec["train"]["optim"]["max_steps"] == 5
    (entry,) = rec["history"]
    assert entry["step"] == 3 and entry["changes"] == {"--max-steps": {"from": 3, "to": 5}} and entry["learned"] == []
    assert [s for s, _ in losses(tmp_path / "r")] == [1, 2, 3, 4, 5]
    # a second resume adds to the history
    assert cli("run", "--resume", "--out", tmp_path / "r", "--max-steps", 6, "--log-every", 2).exit_code == 0
    assert [e["step"] for e in _record(tmp_path / "r")["history"]] == [3, 5]


@pytest.mark.parametrize("flag, value", [("--lr", "3e-3"), ("--ema", "0.9"), ("--grad-clip", "2"),
                                         ("--batch-size", "4"), ("--class-dropout", "0.3"), ("--precision", "bf16"),
                                         ("--warmup-steps", "2")])
def test_a_learned_change_is_refused_with_the_differences(store, tmp_path, flag, value):
    _start(store, tmp_path / "r")
    before = (tmp_path / "r" / "config.json").read_text()
    r = cli("run", "--resume", "--out", tmp_path / "r", "--max-steps", 6, flag, value)
    assert r.exit_code == 1, r.output
    line = one_error_line(r.output)
    assert flag in line and "changes what is learned" in line and "--allow-changes" in line, line
    assert "--max-steps" not in line  # a safe change is not a difference to refuse
    assert (tmp_path / "r" / "config.json").read_text() == before
    assert load_checkpoint(latest_checkpoint(tmp_path / "r"))["step"] == 3


def test_a_fixed_setting_cannot_change_even_when_allowed(store, tmp_path):
    _start(store, tmp_path / "r")
    r = cli("run", "--resume", "--out", tmp_path / "r", "--model", "DiT-S/4", "--allow-changes")
    assert r.exit_code == 1
    line = one_error_line(r.output)
    assert "--model" in line and "cannot change on a resume" in line and "--init-from" in line


def test_max_steps_of_a_cosine_schedule_is_learned(store, tmp_path):
    _start(store, tmp_path / "r", "--lr-schedule", "cosine")
    r = cli("run", "--resume", "--out", tmp_path / "r", "--max-steps", 6)
    assert r.exit_code == 1 and "--max-steps 3 -> 6" in one_error_line(r.output)


def test_an_allowed_change_is_applied_and_recorded(store, tmp_path):
    _start(store, tmp_path / "r")
    r = cli("run", "--resume", "--out", tmp_path / "r", "--max-steps", 5, "--lr", "3e-3", "--batch-size", "4",
            "--allow-changes")
    assert r.exit_code == 0, r.output
    rec = _record(tmp_path / "r")
    assert rec["train"]["optim"]["lr"] == 3e-3 and rec["train"]["optim"]["batch_size"] == 4
    (entry,) = rec["history"]
    assert entry["changes"]["--lr"] == {"from": 1e-3, "to": 3e-3}
    assert entry["learned"] == ["--batch-size", "--lr"]
    ckpt = load_checkpoint(latest_checkpoint(tmp_path / "r"))
    assert ckpt["step"] == 5 and ckpt["config"]["history"] == rec["history"]
    # the new lr is what the optimizer used, not the checkpoint's old one
    assert all(g["lr"] == pytest.approx(3e-3) for g in ckpt["optimizer"]["param_groups"])
    # the loader went on after the 3 x 8 samples drawn: 6 batches of 4, then 2 more steps
    assert ckpt["ranks"][0]["loader"]["batches"] == 3 * 8 // 4 + 2


def test_resume_without_a_record_needs_latents(tmp_path):
    r = cli("run", "--resume", "--out", tmp_path / "new")
    assert r.exit_code == 2 and "--latents" in one_error_line(r.output)


def test_resumed_weights_match_an_unbroken_run_bit_for_bit(store, tmp_path):
    """3 steps, then `--resume --out` alone (+ the safe --max-steps): the same weights as 5 straight."""
    _start(store, tmp_path / "r")
    assert cli("run", "--resume", "--out", tmp_path / "r", "--max-steps", 5).exit_code == 0
    r = cli(*run_args(store, tmp_path / "s", "--max-steps", 5, "--save-every", 3, "--lr", "1e-3", "--logger", "jsonl"))
    assert r.exit_code == 0, r.output
    a, b = (load_checkpoint(latest_checkpoint(tmp_path / d)) for d in ("r", "s"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(a["ema"][k], b["ema"][k]) for k in a["ema"])


def test_print_config_needs_no_out_but_a_run_does(store, tmp_path):
    r = cli("run", "--latents", store, "--model", "DiT-T/4", "--print-config")
    assert r.exit_code == 0 and 'model = "DiT-T/4"' in r.output and 'out = ""' in r.output
    r = cli("run", "--latents", store)
    assert r.exit_code == 2 and "Missing option '--out'" in one_error_line(r.output)


def test_resume_from_another_directory_finds_the_store(store, tmp_path, monkeypatch):
    import shutil

    shutil.copytree(store, tmp_path / "store")
    monkeypatch.chdir(tmp_path)
    assert cli(*run_args(Path("store"), Path("r"), "--max-steps", 2, "--logger", "jsonl")).exit_code == 0
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    r = cli("run", "--resume", "--out", tmp_path / "r", "--max-steps", 3)
    assert r.exit_code == 0, r.output
    assert _record(tmp_path / "r")["train"]["data"]["latents"] == str((tmp_path / "store").resolve())


def test_a_resumed_loader_says_it_is_the_checkpoints(store, tmp_path):
    _start(store, tmp_path / "r")  # --loader auto: resident here
    r = cli("run", "--resume", "--out", tmp_path / "r", "--max-steps", 4)
    assert r.exit_code == 0, r.output
    assert "loader resident (resident: the checkpoint's, so its data order continues;" in r.output
    assert "requested" not in r.output.split("loader resident", 1)[1].split("global batch")[0]
