"""The CLIs run in-process (click's CliRunner, arguments passed through str) for tests, what
their results must say (ok, one_error_line; raises_one_line for a raised error), the
`dittrain run` command line the tests train a store with, `dittrain` as a child process
(to kill one and resume it) or a child Python that imports these helpers (child_env), a
command in one process and under torchrun on 2 ranks (on_one_and_two_ranks; the checkpoints
compared with assert_close_checkpoints), and a local HTTP server for the commands to read from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from click.testing import CliRunner, Result


def ditdata(*args, **invoke) -> Result:
    from ditdata.cli import main

    return CliRunner().invoke(main, [str(a) for a in args], **invoke)


def dittrain(*args, **invoke) -> Result:
    from dittrain.cli import main

    return CliRunner().invoke(main, [str(a) for a in args], **invoke)


def run_args(store: Path, out: Path, *extra, model: str = "DiT-T/4") -> list[str]:
    """`run` on `store` into `out`: batches of 8, a loss line every step, no sample grids,
    on the CPU with seed 3; `extra` appended (as strings)."""
    return ["run", "--latents", str(store), "--out", str(out), "--model", model, "--batch-size", "8",
            "--log-every", "1", "--sample-every", "0", "--device", "cpu", "--seed", "3", *map(str, extra)]


def assert_has(text: str, *needles: str) -> None:
    """Each of `needles` is in `text` (the text is the failure message)."""
    for needle in needles:
        assert needle in text, text


def ok(result: Result, *needles: str) -> Result:
    """`result` of a command that succeeded (exit code 0), each of `needles` in its output."""
    assert result.exit_code == 0, result.output
    assert_has(result.output, *needles)
    return result


def raises_one_line(error: type[BaseException], call) -> str:
    """The message of the `error` that call() raises: one line (no newline)."""
    import pytest

    with pytest.raises(error) as e:
        call()
    message = str(e.value)
    assert "\n" not in message, message
    return message


def one_error_line(output: str) -> str:
    """The output of a failed command is exactly one `Error:` line (notes aside) and no
    traceback: that line."""
    lines = [ln for ln in output.splitlines() if ln.strip() and not ln.startswith("note: ")]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in output, output
    return lines[0]


def kill_when(proc, ready, *, timeout: float, too_late: str, poll: float = 0.02) -> None:
    """SIGKILL `proc` as soon as `ready()` holds (it must still be running then), and reap it."""
    import signal
    import time

    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, too_late
        assert time.time() < deadline, f"not ready after {timeout} s"
        time.sleep(poll)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


BIN = Path(sys.executable).parent  # the venv's console scripts
TESTS = Path(__file__).resolve().parent


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child Python that imports the tests' helpers (storeutil, ...):
    os.environ with `extra` set and this folder first on PYTHONPATH."""
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}


def spawn(args: list) -> subprocess.Popen:
    """`dittrain ARGS` (as strings) as a child process on one OpenMP thread, stdout and stderr
    piped as text."""
    return subprocess.Popen([str(BIN / "dittrain"), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def losses(out: Path) -> list[tuple[int, float]]:
    """(step, loss) of every line of run `out`'s metrics.jsonl."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows]


def resume_after_sigkill(store: Path, root: Path, common: list, *, steps: int, half: int) -> str:
    """`run_args(store, OUT, *common)` twice: OUT=root/straight to the end, and OUT=root/killed
    SIGKILLed as soon as its step-`half` checkpoint exists, then resumed to the end with
    `--resume --out OUT` alone (the settings come from the run's config.json).
    Both end with status 0, the resume starts at step `half`, and both runs log the same loss at
    every step 1..steps. Returns the straight run's stderr."""
    from dittrain.rundir import latest_checkpoint

    straight = spawn(run_args(store, root / "straight", *common))
    killed = spawn(run_args(store, root / "killed", *common))
    ckpt = root / "killed" / "checkpoints" / f"step_{half:08d}.pt"
    kill_when(killed, ckpt.exists, timeout=300, too_late="the run ended before the kill", poll=0.01)
    _, straight_err = straight.communicate(timeout=600)
    assert straight.returncode == 0, straight_err[-2000:]
    assert latest_checkpoint(root / "killed") == ckpt, "the kill landed after the run ended"

    # the run's own record is enough: `--resume --out RUN` alone (dittrain.train.resume)
    resumed = spawn(["run", "--resume", "--out", root / "killed"])
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-2000:]
    assert f"resuming at step {half}" in err
    a, b = losses(root / "straight"), losses(root / "killed")
    assert [s for s, _ in a] == list(range(1, steps + 1)) == [s for s, _ in b]
    assert a == b  # identical losses at every step, before and after the kill
    return straight_err


def stop_once_set_up(proc: subprocess.Popen, out: Path, stop, *, settle: float, timeout: float,
                     wait: float) -> str:
    """Once run `out` has its config.json (written when setup is done, before the loop; `proc`
    must still be running, at most `timeout` s) and `settle` more seconds have passed, `stop()`
    (a signal to the run); `proc`'s stderr when it has ended (at most `wait` s). `proc` is
    killed if it is still running after that, or when anything here fails."""
    import time

    try:
        deadline = time.time() + timeout
        while not (out / "config.json").exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() < deadline, f"no config.json after {timeout} s"
            time.sleep(0.05)
        time.sleep(settle)
        stop()
        return proc.communicate(timeout=wait)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def torchrun_or_skip() -> Path:
    """The venv's torchrun; the test is skipped where it is not installed."""
    import pytest

    if not (BIN / "torchrun").exists():
        pytest.skip("torchrun not installed")
    return BIN / "torchrun"


def on_one_and_two_ranks(cli: str, one: list, two: list, *, timeout: float = 600) -> subprocess.CompletedProcess:
    """`CLI ONE` (cli: ditdata or dittrain) in one process and `CLI TWO` under torchrun with 2
    ranks on this machine (--standalone), both on one OpenMP thread (torchrun's count: CPU
    kernels round differently with another) and at most `timeout` s: both must succeed.
    The torchrun run (its output as text)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    single = subprocess.run([str(BIN / cli), *map(str, one)], capture_output=True, text=True, env=env,
                            timeout=timeout)
    assert single.returncode == 0, single.stderr[-2000:]
    multi = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "-m", f"{cli}.cli",
                            *map(str, two)], capture_output=True, text=True, env=env, timeout=timeout)
    assert multi.returncode == 0, multi.stderr[-3000:]
    return multi


RANKS_PAIR_UP = """
x = torch.ones(3) * (rank + 1)  # the next collective pairs up on both ranks
dist.all_reduce(x)
print(f"rank {rank}: next {x.tolist()}")
dist.barrier()
dist.destroy_process_group()
# torch 2.14 can abort at interpreter exit after this point (about 1 run in 15 on 2 busy cores,
# after the group is destroyed): what is tested is done, so skip the teardown
sys.stdout.flush()
import os; os._exit(0)
"""


def script_on_two_ranks(script: str, *args, tmp: Path, timeout: float = 300) -> str:
    """A python `script` (it has set up a gloo group with `rank`, `sys`, `torch` and `dist` in
    scope) under torchrun with 2 ranks, then an all-reduce whose result each rank prints
    (`rank R: next [3.0, 3.0, 3.0]` where both ranks reach it); the run must succeed. Its
    stdout. Skipped where torchrun is not installed."""
    torchrun = torchrun_or_skip()
    path = tmp / "two_ranks.py"
    path.write_text(script + RANKS_PAIR_UP)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", str(path), *map(str, args)],
                       capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def one_and_two_ranks(store: Path, root: Path, common: list, *, timeout: float = 600) -> None:
    """`dittrain run_args(store, root/"one", *common)` in one process and the same into
    root/"two" under torchrun with 2 ranks (on_one_and_two_ranks): both must succeed."""
    on_one_and_two_ranks("dittrain", run_args(store, root / "one", *common), run_args(store, root / "two", *common),
                         timeout=timeout)


def assert_close_checkpoints(a: Path, b: Path, parts=("model",), *, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """The latest checkpoints of runs `a` and `b`: each of `parts` ("model", "ema", "projector")
    close, tensor for tensor, within rtol and atol (the order of float reductions)."""
    import torch

    from dittrain.rundir import latest_checkpoint, load_checkpoint

    ca, cb = (load_checkpoint(latest_checkpoint(run)) for run in (a, b))
    for part in parts:
        for k in ca[part]:
            torch.testing.assert_close(ca[part][k], cb[part][k], rtol=rtol, atol=atol)


def assert_same_state(a: dict, b: dict) -> None:
    """Two checkpoints' model and EMA weights and optimizer state: equal, tensor for tensor."""
    import torch

    for part in ("model", "ema"):
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


@contextmanager
def http_server(handler) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 (a free port) answering with `handler` (a request handler
    class, or a functools.partial of one) from threads of this process; yields its base URL,
    "http://127.0.0.1:PORT", and shuts it down after the block."""
    import http.server
    import threading

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a child process to take)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loaded_after(code: str, modules) -> list[str]:
    """Which of `modules` a fresh interpreter has imported once it has run `code` (what an
    import or a command loads)."""
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in {tuple(modules)!r} if m in sys.modules))"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
