"""dittrain.train.checkpoint.RunState (every stateful part of a run in one object) and the loop's
handling of skipped steps; the typed store conditioning as the trainer reads it."""

from __future__ import annotations

import io
import json
import random
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from cliutil import spawn, stop_once_set_up
from storeutil import make_store, tiny_store

from ditdata.store import encode_array, open_store
from dittrain.cli import main as dittrain_cli
from dittrain.config import TrainConfig
from dittrain.data import LoaderConfig, LoaderStateError, build_loader
from dittrain.model.dit import DiT
from dittrain.model.sizes import get_config
from dittrain.rundir import latest_checkpoint, load_checkpoint
from dittrain.train.checkpoint import RunState
from dittrain.train.setup import model_config_for, text_token_count

BIN = Path(sys.executable).parent
FILE_KEYS = {"step", "model", "ema", "optimizer", "lr_schedule", "scaler", "ranks", "config", "nonfinite_total"}


def fresh_state(store: Path, *, init: int = 0, batch_size: int = 4, seed: int = 0) -> RunState:
    torch.manual_seed(init)  # the weights' initialisation
    cfg = get_config("DiT-T/4", input_size=8, in_channels=3, num_classes=3)
    model, ema = DiT(cfg), DiT(cfg).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    loader = build_loader(store, LoaderConfig(kind="resident"), batch_size=batch_size, seed=seed)
    return RunState(model=model, ema=ema, optimizer=opt, lr_schedule=sched,
                    scaler=torch.amp.GradScaler("cpu", enabled=False), loader=loader,
                    noise_gen=torch.Generator().manual_seed(seed), config={"run": "test"},
                    device=torch.device("cpu"))


def train_a_little(state: RunState, steps: int) -> None:
    for _ in range(steps):
        x = next(state.loader)["x"]
        noise = torch.randn(x.shape, generator=state.noise_gen)
        state.optimizer.zero_grad()
        out = state.model(x, torch.zeros(len(x), dtype=torch.long), y=torch.zeros(len(x), dtype=torch.long))
        (out[:, :3] - noise).square().mean().backward()
        state.optimizer.step()
        state.lr_schedule.step()
        state.step += 1
    state.nonfinite_total = 2
    np.random.rand(), random.random(), torch.rand(1)  # move the global generators too


def draws(state: RunState) -> dict:
    """What the run would draw next from every stateful source."""
    return {"batch": next(state.loader)["x"], "noise": torch.randn(3, generator=state.noise_gen),
            "numpy": np.random.rand(), "python": random.random(), "torch": torch.rand(1),
            "lr": state.lr_schedule.get_last_lr()}


def test_state_dict_is_the_checkpoint_file_and_round_trips(store):
    a = fresh_state(store)
    train_a_little(a, 3)
    ckpt = a.state_dict()
    assert ckpt.keys() == FILE_KEYS  # what dittrain.inference.sample, the tests and older runs read
    assert len(ckpt["ranks"]) == 1 and ckpt["ranks"][0].keys() == {"loader", "rng", "noise_gen"}
    assert ckpt["step"] == 3 and ckpt["nonfinite_total"] == 2 and ckpt["config"] == {"run": "test"}
    buf = io.BytesIO()
    torch.save(ckpt, buf)  # as save_checkpoint writes it, and read back as load_checkpoint does
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    weights, expected = {k: v.clone() for k, v in a.model.state_dict().items()}, draws(a)

    b = fresh_state(store, init=1)  # other weights, every part at its start
    b.load_state_dict(saved)  # (the process-wide generators too: back to where a saved them)
    assert (b.step, b.nonfinite_total) == (3, 2)
    for k, v in weights.items():
        assert torch.equal(v, b.model.state_dict()[k]), k
    got = draws(b)
    for k in expected:
        assert np.array_equal(np.asarray(expected[k]), np.asarray(got[k])), k


def test_a_checkpoint_without_a_counter_starts_it_at_zero(store):
    ckpt = fresh_state(store).state_dict()
    del ckpt["nonfinite_total"]  # checkpoints written before the counter existed
    state = fresh_state(store)
    state.nonfinite_total = 7
    state.load_state_dict(ckpt)
    assert state.nonfinite_total == 0


def test_another_batch_size_is_a_loader_state_error(store):
    ckpt = fresh_state(store, batch_size=4).state_dict()
    with pytest.raises(LoaderStateError, match="batch_size 4 vs 8"):
        fresh_state(store, batch_size=8).load_state_dict(ckpt)
    assert issubclass(LoaderStateError, ValueError)  # what callers of the loader caught before


def test_sigterm_during_nonfinite_steps_saves_and_exits(tmp_path):
    """Every sample NaN and a huge --max-nonfinite: no step ever completes, yet SIGTERM must
    stop the run with a checkpoint, and the progress bar must say why it does not move."""
    nan = make_store(tmp_path / "nan", nan_every=1)
    out = tmp_path / "r"
    args = ["run", "--latents", nan, "--out", out, "--model", "DiT-T/4", "--batch-size", 8, "--max-steps", 10,
            "--max-nonfinite", 10**9, "--sample-every", 0, "--device", "cpu", "--loader", "resident"]
    proc = spawn(args)
    # 2 s of skipped steps after setup (the bar redraws at most once a second), then SIGTERM;
    # without the stop check on skipped steps the run would never end
    err = stop_once_set_up(proc, out, lambda: proc.send_signal(signal.SIGTERM), settle=2.0, timeout=120, wait=60)
    assert proc.returncode == 75, err[-2000:]  # stopped, resumable
    assert "stopped by signal at step 0" in err
    assert "non-finite skipped" in err  # the bar's postfix
    ckpt = load_checkpoint(latest_checkpoint(out))
    assert ckpt["step"] == 0 and ckpt["nonfinite_total"] > 0
    assert ckpt["ranks"][0]["loader"]["batches"] == ckpt["nonfinite_total"]  # resume skips them too


def text_store(root: Path) -> Path:
    """A one-shard text store: 16-d pooled caption embeddings and 5 tokens of width 12."""
    empty = {"text_pooled": np.zeros(16, np.float16), "text_tokens": np.zeros((5, 12), np.float16),
             "text_mask": np.ones(5, bool)}
    text = {"model": "none", "pooled_dim": 16, "tokens_shape": [5, 12],
            "empty": {k: encode_array(v) for k, v in empty.items()}}
    return tiny_store(root, shape=(3, 8, 8), conditioning={"type": "text", "text": text},
                      text={"pooled": 16, "tokens": (5, 12)}, n=8)


def test_conditioning_as_the_trainer_reads_it(store, tmp_path):
    cls = open_store(store)
    cfg = model_config_for(TrainConfig.from_flat(model="DiT-T/4", grad_checkpointing="2"), cls)
    assert (cfg.num_classes, cfg.text_pooled_dim, cfg.text_token_dim) == (3, None, None)
    assert cfg.grad_checkpointing == 2 and text_token_count(cls) == 0
    txt = open_store(text_store(tmp_path / "text"))
    cfg = model_config_for(TrainConfig.from_flat(model="DiT-T/4"), txt)
    assert (cfg.num_classes, cfg.text_pooled_dim, cfg.text_token_dim) == (0, 16, 12)
    assert text_token_count(txt) == 5


def test_training_on_a_text_store(tmp_path):
    store = text_store(tmp_path / "text")
    r = CliRunner().invoke(dittrain_cli, [str(a) for a in (
        "run", "--latents", store, "--out", tmp_path / "r", "--model", "DiT-T/4", "--batch-size", 4,
        "--max-steps", 3, "--log-every", 1, "--sample-every", 0, "--device", "cpu", "--caption-dropout", 0.5)])
    assert r.exit_code == 0, r.output
    model = json.loads((tmp_path / "r" / "config.json").read_text())["model"]
    assert (model["num_classes"], model["text_pooled_dim"], model["text_token_dim"]) == (0, 16, 12)
    rows = [json.loads(ln) for ln in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in rows)
