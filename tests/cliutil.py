"""The CLIs run in-process (click's CliRunner, arguments passed through str) for tests,
and the `dittrain run` command line the tests train a store with."""

from __future__ import annotations

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
