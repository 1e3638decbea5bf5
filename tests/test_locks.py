"""One writer per output: `dittrain run`, `ditdata encode` and `ditdata score` lock their
output directory with flock; a second writer exits at once naming the holder's pid; a
killed holder (SIGKILL, even with forked children alive) leaves no stale lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from cliutil import one_error_line, run_args
from storeutil import make_store

from ditdata.cli import main as ditdata_cli
from ditdata.common.lock import LOCK_FILE, DirectoryBusy, DirLock
from ditdata.store import open_store
from dittrain.cli import main as dittrain_cli
from dittrain.rundir import latest_checkpoint

BIN = Path(sys.executable).parent
ENV = dict(os.environ, OMP_NUM_THREADS="1")

# Runs a CLI in a child that stops itself (SIGSTOP) right after it has taken its lock, so
# the test can start a second writer while the first is certainly alive and holding it.
STOP_AFTER_LOCK = """
import os, signal, sys
from ditdata.common import lock
take = lock.DirLock.acquire
def acquire(self):
    held = take(self)
    os.kill(os.getpid(), signal.SIGSTOP)
    return held
lock.DirLock.acquire = acquire
from {module} import main
sys.argv = [{prog!r}] + sys.argv[1:]
main()
"""


def stopped_after_lock(module: str, *args) -> subprocess.Popen:
    code = STOP_AFTER_LOCK.format(module=module, prog=module.split(".")[0])
    proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.time() + 120
    while True:  # wait until it is stopped (state T in /proc)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return proc
        assert time.time() < deadline
        time.sleep(0.02)


def listing(d: Path) -> dict[str, tuple[int, int]]:
    return {p.relative_to(d).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(d.rglob("*")) if p.is_file()}


def settled_listing(d: Path, timeout: float = 10.0) -> dict[str, tuple[int, int]]:
    """The listing of a directory whose writer was just SIGSTOPped: a write(2) already in the
    kernel (the background checkpoint writer's, say) still completes, so wait until two
    listings 0.2 s apart agree."""
    deadline = time.time() + timeout
    last = listing(d)
    while time.time() < deadline:
        time.sleep(0.2)
        now = listing(d)
        if now == last:
            return now
        last = now
    raise AssertionError(f"{d} kept changing after SIGSTOP")


# ----------------------------------------------------------------------------- the lock


def test_second_holder_is_refused_with_the_pid(tmp_path):
    with DirLock(tmp_path / "out", "dittrain run"):
        holder = json.loads((tmp_path / "out" / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid() and holder["command"] == "dittrain run"
        with pytest.raises(DirectoryBusy, match=rf"in use by dittrain run \(pid {os.getpid()}, since "):
            DirLock(tmp_path / "out", "ditdata encode").acquire()
    DirLock(tmp_path / "out", "again").acquire().release()  # free once released


def test_a_failed_start_leaves_no_directory(tmp_path):
    lock = DirLock(tmp_path / "new", "dittrain run").acquire()
    lock.release()
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    DirLock(tmp_path / "kept", "x").acquire().release()
    assert (tmp_path / "kept").is_dir()  # it existed before: only the lock file may stay


def test_sigkill_releases_even_with_a_forked_child_alive(tmp_path):
    """The holder forks a long-lived child (as the streaming loader's workers are) and is
    SIGKILLed: the orphaned child must not keep the lock."""
    code = ("import os, sys, time\nfrom ditdata.common.lock import DirLock\n"
            f"DirLock({str(tmp_path / 'run')!r}, 'dittrain run').acquire()\n"
            "if os.fork() == 0:\n"
            # the child's own code runs only after the fork hooks did: then it says so
            "    print(os.getpid(), flush=True)\n    time.sleep(60)\n    os._exit(0)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    try:
        with pytest.raises(DirectoryBusy, match=f"pid {proc.pid}"):
            DirLock(tmp_path / "run", "probe").acquire()
        proc.kill()
        proc.wait()
        os.kill(child, 0)  # the child is still alive...
        DirLock(tmp_path / "run", "next run").acquire().release()  # ...and the lock is free
    finally:
        os.kill(child, signal.SIGKILL)


# ----------------------------------------------------------------------------- the commands


def test_two_runs_on_one_out(tmp_path):
    store = make_store(tmp_path / "store")
    out = tmp_path / "run"
    first = subprocess.Popen([str(BIN / "dittrain"), *run_args(store, out, "--max-steps", 100000,
                                                                  "--save-every", 3)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.time() + 300
    while latest_checkpoint(out) is None:
        assert first.poll() is None, first.communicate()[1][-2000:]
        assert time.time() < deadline
        time.sleep(0.05)
    first.send_signal(signal.SIGSTOP)  # alive, holding the lock, frozen for the checks
    try:
        before = settled_listing(out)
        for extra in ([], ["--resume"]):
            r = CliRunner().invoke(dittrain_cli, run_args(store, out, "--max-steps", 5, *extra))
            assert r.exit_code == 1
            line = one_error_line(r.output)
            assert f"{out} is in use by dittrain run (pid {first.pid}" in line
        assert listing(out) == before  # the refused runs wrote nothing
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    step = int(latest_checkpoint(out).stem.split("_")[1])
    r = subprocess.run([str(BIN / "dittrain"), *run_args(store, out, "--max-steps", step + 2, "--resume")],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resuming at step {step}" in r.stderr


@pytest.fixture
def shards(class_shards) -> Path:
    return class_shards


def test_two_encodes_on_one_store(shards, tmp_path):
    store = tmp_path / "store"
    args = ["encode", shards, "--vae", "pixels", "--resolution", 32, "--out", store, "--workers", 0,
            "--device", "cpu"]
    first = stopped_after_lock("ditdata.cli", *args)
    try:
        before = listing(store)
        r = CliRunner().invoke(ditdata_cli, [str(a) for a in args])
        line = one_error_line(r.output)
        assert r.exit_code == 1 and f"is in use by ditdata encode (pid {first.pid}" in line
        assert listing(store) == before
    finally:
        first.send_signal(signal.SIGCONT)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-2000:]
    assert len(open_store(store, verify=True)) == 8


def test_score_refuses_a_second_writer_on_the_folder(shards, tmp_path):
    pytest.importorskip("open_clip")
    from test_clip import tiny_clip_files

    config, weights = tiny_clip_files(tmp_path / "clip")
    args = ["score", shards, "--clip-config", config, "--pretrained", weights, "--device", "cpu", "-q"]
    first = stopped_after_lock("ditdata.cli", *args)
    try:
        r = CliRunner().invoke(ditdata_cli, [str(a) for a in args])
        assert r.exit_code == 1
        assert f"is in use by ditdata score (pid {first.pid}" in one_error_line(r.output)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    r = CliRunner().invoke(ditdata_cli, [str(a) for a in args])  # the kill left no stale lock
    assert r.exit_code == 0, r.output
