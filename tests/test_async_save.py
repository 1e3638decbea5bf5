"""Checkpoint saves off the training step (issue 17): dittrain.train.checkpoint.CheckpointWriter
and `dittrain run --async-save` (the default) / --no-async-save.

What must hold: the file is what a synchronous save writes; the step after a submit may
change every tensor without changing what is written; a failed background write is the
same one-line CheckpointError, raised at the next save or at the end; a kill mid-write
leaves the previous checkpoint the latest and loadable; SIGTERM still saves and exits 0.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
from cliutil import child_env, raises_one_line, run_args
from cliutil import dittrain as cli

import dittrain.train.checkpoint as checkpoint
from ditdata.common import files
from dittrain.data import LoaderConfig, build_loader
from dittrain.inference.weights import load_weights
from dittrain.model.dit import DiT
from dittrain.model.sizes import get_config
from dittrain.rundir import CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from dittrain.train.checkpoint import CheckpointWriter, RunState

pytestmark = pytest.mark.usefixtures("one_thread")


def trained_state(store: Path, steps: int = 2) -> RunState:
    """A RunState a couple of AdamW steps in: every kind of part a checkpoint holds."""
    torch.manual_seed(0)
    cfg = get_config("DiT-T/4", input_size=8, in_channels=3, num_classes=3)
    model, ema = DiT(cfg), DiT(cfg).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = RunState(model=model, ema=ema, optimizer=opt,
                     lr_schedule=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                     scaler=torch.amp.GradScaler("cpu", enabled=False),
                     loader=build_loader(store, LoaderConfig(kind="resident"), batch_size=4, seed=0),
                     noise_gen=torch.Generator().manual_seed(0), config={"run": "test"},
                     device=torch.device("cpu"))
    for _ in range(steps):
        step(state)
    return state


def step(state: RunState) -> None:
    """One training step: changes weights, Adam moments and step counts in place."""
    x = next(state.loader)["x"]
    state.optimizer.zero_grad()
    zeros = torch.zeros(len(x), dtype=torch.long)
    state.model(x, zeros, y=zeros).square().mean().backward()
    state.optimizer.step()
    with torch.no_grad():
        torch._foreach_lerp_(list(state.ema.parameters()), list(state.model.parameters()), 0.5)
    state.step += 1


def tensors(x, prefix=()) -> dict:
    """Every tensor of a nested state by its place in it."""
    if isinstance(x, torch.Tensor):
        return {prefix: x}
    if isinstance(x, dict):
        return {k: v for key, val in x.items() for k, v in tensors(val, (*prefix, key)).items()}
    if isinstance(x, list | tuple):
        return {k: v for i, val in enumerate(x) for k, v in tensors(val, (*prefix, i)).items()}
    return {}


def assert_tensor_equal(a: dict, b: dict) -> None:
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


def test_async_file_is_byte_identical_to_the_synchronous_one(store, tmp_path):
    state = trained_state(store)
    sync = save_checkpoint(tmp_path / "sync", state.step, state.state_dict(), keep=3)
    writer = CheckpointWriter()
    ckpt = state.state_dict()
    path = writer.submit(tmp_path / "async", state.step, ckpt, keep=3, ema_state=ckpt["ema"], config={"x": 1})
    writer.wait()
    assert path.read_bytes() == sync.read_bytes()
    weights, config = load_weights(tmp_path / "async" / "ema.safetensors")
    assert config == {"x": 1} and weights.keys() == state.ema.state_dict().keys()
    assert_tensor_equal(weights, dict(state.ema.state_dict()))


def test_the_next_step_cannot_change_what_is_written(store, tmp_path, monkeypatch):
    """The write is held until the model, EMA, optimizer and loader have moved on."""
    state = trained_state(store)
    before = load_checkpoint(save_checkpoint(tmp_path / "expected", state.step, state.state_dict()))
    go, real = threading.Event(), checkpoint.save_checkpoint

    def held(*a, **kw):
        assert go.wait(30)
        return real(*a, **kw)

    monkeypatch.setattr(checkpoint, "save_checkpoint", held)
    writer = CheckpointWriter()
    writer.submit(tmp_path / "run", state.step, state.state_dict())
    assert writer.busy
    for _ in range(2):
        step(state)  # in place: parameters, exp_avg, Adam's CPU step counts, the loader's position
    with torch.no_grad():
        for p in state.model.parameters():
            p.fill_(7.0)
    go.set()
    writer.wait()
    saved = load_checkpoint(latest_checkpoint(tmp_path / "run"))
    assert saved["step"] == before["step"] == 2
    assert_tensor_equal(saved, before)
    assert saved["ranks"][0]["loader"] == before["ranks"][0]["loader"]


def test_host_copies_are_released_after_the_write(store, tmp_path, monkeypatch):
    state = trained_state(store)
    seen, real = [], checkpoint.save_checkpoint

    def spy(run_dir, step, host, **kw):
        seen.extend(weakref.ref(t) for t in tensors(host).values())
        return real(run_dir, step, host, **kw)

    monkeypatch.setattr(checkpoint, "save_checkpoint", spy)
    writer = CheckpointWriter()
    ckpt = state.state_dict()
    writer.submit(tmp_path, state.step, ckpt, ema_state=ckpt["ema"])
    del ckpt
    writer.wait()
    gc.collect()
    assert seen and all(r() is None for r in seen)  # the clones died with their write


def enospc_on_call(monkeypatch, n: int) -> None:
    """The n-th torch.save (and every later one) fails as on a full disk."""
    real, calls = torch.save, []

    def save(obj, f, *a, **kw):
        calls.append(1)
        if len(calls) >= n:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", save)


def test_a_background_failure_is_the_synchronous_checkpoint_error(tmp_path, monkeypatch):
    writer = CheckpointWriter()
    writer.submit(tmp_path, 1, {"w": torch.zeros(3)})
    writer.wait()
    enospc_on_call(monkeypatch, 1)
    writer.submit(tmp_path, 2, {"w": torch.ones(3)})  # returns: the failure is in the thread
    msg = raises_one_line(CheckpointError, writer.wait)
    assert "step_00000002.pt" in msg and "No space left on device" in msg
    assert "step_00000001.pt is intact" in msg
    writer.submit(tmp_path, 3, {"w": torch.ones(3)})  # not waited for: the next submit raises it
    with pytest.raises(CheckpointError, match="step_00000003.pt"):
        writer.submit(tmp_path, 4, {"w": torch.ones(3)})
    writer.submit(tmp_path, 5, {"w": torch.ones(3)})
    assert isinstance(writer.close(), CheckpointError)  # close hands it back instead of raising
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001.pt"]
    assert not [p for p in tmp_path.rglob("*") if files.is_tmp(p)]


def test_a_failed_background_write_stops_the_run_at_the_next_save(store, tmp_path, monkeypatch):
    enospc_on_call(monkeypatch, 2)  # the save at step 4 fails; the run learns of it at step 6
    out = tmp_path / "r"
    r = cli(*run_args(store, out, "--max-steps", 8, "--save-every", 2))
    assert r.exit_code == 1
    errors = re.findall(r"Error: [^\r\n]*", r.output)
    assert len(errors) == 1 and "Traceback" not in r.output, r.output
    line = errors[0]
    assert "step_00000004.pt: could not write the checkpoint" in line and "step_00000002.pt is intact" in line
    assert [p.name for p in list_checkpoints(out)] == ["step_00000002.pt"]
    assert load_checkpoint(latest_checkpoint(out))["step"] == 2


def test_async_and_sync_runs_write_the_same_checkpoints(store, tmp_path, monkeypatch):
    args = ["--max-steps", 4, "--save-every", 2, "--keep", 1]
    assert cli(*run_args(store, tmp_path / "async", *args)).exit_code == 0
    monkeypatch.setattr(CheckpointWriter, "submit", lambda *a, **kw: pytest.fail("--no-async-save submitted"))
    r = cli(*run_args(store, tmp_path / "sync", *args, "--no-async-save"))
    assert r.exit_code == 0, r.output
    a, b = (load_checkpoint(latest_checkpoint(tmp_path / d)) for d in ("async", "sync"))
    assert [p.name for p in list_checkpoints(tmp_path / "async")] == ["step_00000004.pt"]  # --keep 1
    assert a["step"] == b["step"] == 4
    assert a["config"]["train"]["checkpointing"]["async_save"] and not b["config"]["train"]["checkpointing"]["async_save"]
    a["config"] = b["config"] = None  # the one difference: the flag itself
    assert_tensor_equal(a, b)
    assert a["ranks"][0]["loader"] == b["ranks"][0]["loader"]
    assert_tensor_equal(*(load_weights(tmp_path / d)[0] for d in ("async", "sync")))


# A `dittrain run` whose HOLD_AT-th torch.save writes a few bytes and hangs (a write in progress).
SLOW_RUN = textwrap.dedent("""
    import os, sys, time
    import torch
    real, calls = torch.save, []
    def save(obj, f, *a, **kw):
        calls.append(1)
        if len(calls) == int(os.environ.get("HOLD_AT", "0")):
            f.write(b"PK partial"); f.flush()
            print("writing", flush=True)
            time.sleep(300)
        return real(obj, f, *a, **kw)
    torch.save = save
    from dittrain.cli import main
    main(sys.argv[1:])
""")


def slow_run(args: list, **env) -> subprocess.Popen:
    env = child_env(**{"OMP_NUM_THREADS": "1", **{k: str(v) for k, v in env.items()}})
    return subprocess.Popen([sys.executable, "-c", SLOW_RUN, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def test_kill_during_a_background_write_keeps_the_previous_checkpoint(store, tmp_path):
    out = tmp_path / "r"
    proc = slow_run(run_args(store, out, "--max-steps", 4, "--save-every", 2), HOLD_AT=2)
    try:
        assert proc.stdout.readline().strip() == "writing", proc.stderr.read()[-2000:]
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    assert [p.name for p in list_checkpoints(out)] == ["step_00000002.pt"]  # nothing half-written published
    partial = [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".step_00000004.pt")]
    assert partial and all(files.is_tmp(p) for p in partial)  # the write that was cut: hidden
    assert load_checkpoint(latest_checkpoint(out))["step"] == 2
    assert load_weights(out)[0]
    r = cli(*run_args(store, out, "--max-steps", 4, "--save-every", 2, "--resume"))
    assert r.exit_code == 0, r.output
    assert "resuming at step 2" in r.output and load_checkpoint(latest_checkpoint(out))["step"] == 4


def test_sigterm_waits_for_the_write_and_exits_75(store, tmp_path, monkeypatch):
    """In-process (no interpreter start): SIGTERM to this process while the run trains; the
    run's handler takes it, the stop save's write is slow, and the run still ends with it on disk."""
    real = torch.save

    def slow(*a, **kw):
        time.sleep(1.0)
        return real(*a, **kw)

    monkeypatch.setattr(torch, "save", slow)
    # a SIGTERM that lands after the run restored the handler must not end pytest
    old = signal.signal(signal.SIGTERM, lambda *a: None)
    out, metrics = tmp_path / "r", tmp_path / "r" / "metrics.jsonl"

    def terminate():
        deadline = time.time() + 60
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3) and time.time() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate, daemon=True).start()
    try:
        r = cli(*run_args(store, out, "--max-steps", 100000, "--save-every", 100000))
    finally:
        signal.signal(signal.SIGTERM, old)
    assert r.exit_code == 75, r.output  # stopped, resumable (dittrain.train.loop.STOPPED_STATUS)
    assert "stopped by signal" in r.output
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert load_checkpoint(latest_checkpoint(out))["step"] == last >= 3
    assert (out / "ema.safetensors").is_file()
