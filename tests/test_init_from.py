"""`dittrain run --init-from`: fine-tuning from a run's EMA, a checkpoint or a plain state dict;
fresh optimizer, step and schedule; the label embedder re-initialised for another class count;
other shapes refused; a resume ignores it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cliutil import dittrain as cli
from cliutil import one_error_line, run_args
from storeutil import LABELLED, class_conditioning, latent_data, pixels_info, schema, write_store

import dittrain.train.loop as train_mod
from ditdata.common.files import sha256_file
from dittrain.inference.weights import LABEL_TABLE, load_weights
from dittrain.model.dit import DiT
from dittrain.model.sizes import get_config
from dittrain.rundir import latest_checkpoint, load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")
TUNE = ("--lr", "1e-3", "--ema", "1.0")  # decay 1: the EMA keeps the weights it started from


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def ema_of(run: Path) -> dict:
    return load_weights(run)[0]


def train(*args) -> str:
    r = cli(*args)
    assert r.exit_code == 0, r.output
    return r.output


@pytest.fixture(scope="module")
def source(store, tmp_path_factory) -> Path:
    """Run A: 3 steps with EMA decay 0.5, so its EMA differs from its model (and from the
    weights a fresh run starts with)."""
    out = tmp_path_factory.mktemp("a") / "A"
    train(*run_args(store, out, "--max-steps", 3, "--save-every", 3, "--lr", "1e-3", "--ema", "0.5"))
    ckpt = load_checkpoint(latest_checkpoint(out))
    assert any(not torch.equal(ckpt["model"][k], ckpt["ema"][k]) for k in ckpt["ema"])
    return out


@pytest.fixture
def reference_losses(one_thread, store, source, tmp_path_factory) -> list[float]:
    """The losses of a run whose model and EMA are built holding A's EMA weights by the
    trainer itself (DiT patched in dittrain.train.loop): what --init-from must reproduce, computed
    by the same loop on the same batches, noise and timesteps, with no --init-from code (and
    on one thread, as the runs it is compared with)."""
    weights = ema_of(source)
    real = train_mod.DiT

    def holding_a(cfg):
        model = real(cfg)
        model.load_state_dict(weights)
        return model

    out = tmp_path_factory.mktemp("ref") / "R"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_mod, "DiT", holding_a)
        train(*run_args(store, out, "--max-steps", 2, *TUNE))
    return losses(out)


def test_init_from_a_run_reproduces_its_ema_loss(store, source, reference_losses, tmp_path):
    out = tmp_path / "B"
    log = train(*run_args(store, out, "--max-steps", 2, *TUNE, "--init-from", source))
    assert f"initialised from {source}" in log
    assert losses(out) == reference_losses  # step 1: A's EMA on B's first batch; step 2: the same update
    fresh = tmp_path / "C"
    train(*run_args(store, fresh, "--max-steps", 2, *TUNE))
    assert losses(fresh)[0] != reference_losses[0]  # the check can fail: a fresh model's loss differs
    # model AND EMA start from A's EMA (decay 1 keeps it); optimizer, step and schedule start fresh
    a_ema, b = ema_of(source), load_checkpoint(latest_checkpoint(out))
    assert all(torch.equal(b["ema"][k], a_ema[k]) for k in a_ema)
    assert any(not torch.equal(b["model"][k], a_ema[k]) for k in a_ema)  # it trained
    assert b["step"] == 2 and b["lr_schedule"]["last_epoch"] == 2
    assert [s["step"] for s in b["optimizer"]["state"].values()] == [2.0] * len(b["optimizer"]["state"])
    # recorded: the option and what it read
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["model"]["init_from"] == str(source)
    init = config["init"]
    assert init["file"] == str((source / "ema.safetensors").resolve()) and init["kind"] == "export"
    assert init["sha256"] == sha256_file(source / "ema.safetensors") and init["model"] == "DiT-T/4"
    assert init["label_embedder"] == "loaded" and b["config"]["init"] == init


def test_checkpoint_and_plain_sources(store, source, reference_losses, tmp_path):
    # a checkpoint .pt: its EMA; a plain state dict (from a DDP-wrapped model): prefixes stripped
    plain = tmp_path / "plain.pt"
    torch.save({f"module.{k}": v for k, v in ema_of(source).items()}, plain)
    for name, src in (("ckpt", latest_checkpoint(source)), ("plain", plain)):
        out = tmp_path / name
        train(*run_args(store, out, "--max-steps", 1, *TUNE, "--init-from", src))
        assert losses(out) == reference_losses[:1], name
        init = json.loads((out / "config.json").read_text())["init"]
        assert init["kind"] == ("checkpoint" if name == "ckpt" else "plain")
        assert init["step"] == (3 if name == "ckpt" else None) and init["sha256"] == sha256_file(src)


def test_another_class_count_reinitialises_the_label_embedder(source, tmp_path):
    five = tmp_path / "five"
    write_store(five, schema(shape=(3, 8, 8), flip=False, text=False, columns=LABELLED), [16],
                info=pixels_info(8, class_conditioning(list("abcde"))), data=latent_data(1))
    out = tmp_path / "D"
    log = train(*run_args(five, out, "--max-steps", 1, "--lr", "0", "--ema", "1.0", "--init-from", source))
    assert "note: --init-from" in log and "has 3 classes, this run 5" in log
    a_ema, d_ema = ema_of(source), ema_of(out)
    assert d_ema[LABEL_TABLE].shape == (6, 192) and a_ema[LABEL_TABLE].shape == (4, 192)
    assert all(torch.equal(d_ema[k], a_ema[k]) for k in a_ema if k != LABEL_TABLE)
    assert json.loads((out / "config.json").read_text())["init"]["label_embedder"] == "fresh"


def test_other_shapes_are_refused(store, source, tmp_path):
    # a hidden size of 256 where the run's DiT-T/4 has 192
    torch.manual_seed(0)
    wide = tmp_path / "wide.pt"
    torch.save(DiT(get_config("DiT-T/4", input_size=8, in_channels=3, num_classes=3, hidden_size=256)).state_dict(),
               wide)
    out = tmp_path / "E"
    line = one_error_line(cli(*run_args(store, out, "--max-steps", 1, "--init-from", wide)).output)
    assert "pos_embed is (1, 4, 256) in the weights but (1, 4, 192) in the model" in line
    assert not (out / "config.json").exists() and latest_checkpoint(out) is None  # nothing written
    # another depth: DiT-S/4 (12 blocks, hidden 384) from A (6 blocks, hidden 192)
    line = one_error_line(cli(*run_args(store, out, "--max-steps", 1, "--init-from", source,
                                        model="DiT-S/4")).output)
    assert "(1, 4, 192) in the weights but (1, 4, 384)" in line and "missing 60 key(s) (blocks.6." in line
    # a missing source, and one that is no weights at all
    line = one_error_line(cli(*run_args(store, out, "--init-from", tmp_path / "nothing.pt")).output)
    assert "no such file" in line
    torch.save({"steps": 3}, tmp_path / "junk.pt")
    line = one_error_line(cli(*run_args(store, out, "--init-from", tmp_path / "junk.pt")).output)
    assert "state dict of tensors" in line


def test_resume_ignores_init_from(store, source, tmp_path):
    out = tmp_path / "F"
    train(*run_args(store, out, "--max-steps", 2, "--save-every", 2))
    log = train(*run_args(store, out, "--max-steps", 3, "--resume", "--init-from", source))
    assert "resuming at step 2" in log and f"--init-from {source} is ignored" in log
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["model"]["init_from"] == "" and "init" not in config
    # a run that started from A keeps that record across resumes
    tuned = tmp_path / "G"
    train(*run_args(store, tuned, "--max-steps", 1, "--save-every", 1, "--init-from", source))
    train(*run_args(store, tuned, "--max-steps", 2, "--resume"))
    config = json.loads((tuned / "config.json").read_text())
    assert config["train"]["model"]["init_from"] == str(source) and config["init"]["kind"] == "export"
    # --resume without a checkpoint yet is a fresh start: --init-from applies
    fresh = tmp_path / "H"
    log = train(*run_args(store, fresh, "--max-steps", 1, "--resume", "--init-from", source))
    assert f"initialised from {source}" in log
