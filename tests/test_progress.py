"""Progress in a file (ditdata.common.progress): with stderr not a terminal, the long commands
write plain lines (no `\\r` redraws) that say done/total, rate, ETA and, for training, the
loss and images/s at every --log-every step; quiet writes none; an error raised while a
terminal bar is drawn starts on a line of its own."""

from __future__ import annotations

import io
import os
import re
import subprocess

import pytest
from cliutil import BIN, ditdata, dittrain, run_args

from ditdata.common import progress
from ditdata.common.errors import UserError
from ditdata.common.progress import INTERVAL_ENV, Lines, progress_bar

TRAIN_LINE = re.compile(r"^train: (\d+)/(\d+) step \(\d+%\), .* step/s, elapsed [\d:]+(, ETA [\d:]+)?; loss ")
ENCODE_LINE = re.compile(r"^encode: (\d+)/(\d+) img \(\d+%\), .* img/s, elapsed [\d:]+")


def lines_of(text: str, pattern: re.Pattern) -> list[re.Match]:
    return [m for m in map(pattern.match, text.splitlines()) if m]


# ----------------------------------------------------------------------------- the reporter


def test_plain_lines_by_time_by_count_and_at_the_end():
    out = io.StringIO()
    bar = progress_bar(total=10, desc="encode", unit="img", interval=0, file=out, terminal=False)
    assert isinstance(bar, Lines)
    for _ in range(5):
        bar.update(2)
    bar.close()
    text = out.getvalue()
    assert "\r" not in text and [m.group(1) for m in lines_of(text, ENCODE_LINE)] == ["2", "4", "6", "8", "10"]
    assert "ETA" in text.splitlines()[0] and "ETA" not in text.splitlines()[-1]  # none once done

    out = io.StringIO()  # every N: one line per N units, no time-based ones, the postfix after
    bar = progress_bar(total=7, initial=1, desc="train", unit="step", every=3, file=out, terminal=False)
    for step in range(2, 8):
        bar.set_postfix_str(f"loss {step}")
        bar.update(1)
    bar.close()
    assert [ln.split(" step")[0] for ln in out.getvalue().splitlines()] == ["train: 3/7", "train: 6/7", "train: 7/7"]
    assert out.getvalue().splitlines()[0].endswith("; loss 3")

    out = io.StringIO()  # an iterable, a long interval: only the last line
    assert list(progress_bar(range(4), desc="verify", unit="shard", file=out, terminal=False, interval=60)) == [0, 1, 2, 3]
    assert out.getvalue().startswith("verify: 4/4 shard (100%), ") and out.getvalue().count("\n") == 1


def test_quiet_and_errors_write_no_progress_line():
    out = io.StringIO()
    bar = progress_bar(total=4, desc="q", enabled=False, interval=0, file=out, terminal=False)
    bar.update(4)
    bar.write("a note")  # notes still go out
    bar.close()
    assert bar.n == 4 and out.getvalue() == "a note\n"
    out = io.StringIO()
    with pytest.raises(KeyError), progress_bar(total=4, desc="e", interval=60, file=out, terminal=False) as bar:
        bar.update(1)
        raise KeyError("boom")
    assert out.getvalue() == ""  # the error is the last word


def test_terminal_gets_tqdm_and_the_interval_comes_from_the_environment(monkeypatch):
    from tqdm import tqdm

    bar = progress_bar(total=3, desc="t", file=io.StringIO(), terminal=True)
    assert isinstance(bar, tqdm)
    bar.close()
    monkeypatch.setenv(INTERVAL_ENV, "2.5")
    assert progress.line_interval() == 2.5
    monkeypatch.setenv(INTERVAL_ENV, "soon")
    with pytest.raises(UserError, match=INTERVAL_ENV):
        progress.line_interval()
    monkeypatch.delenv(INTERVAL_ENV)
    assert progress.line_interval() == progress.DEFAULT_INTERVAL


# ----------------------------------------------------------------------------- the commands


def test_train_writes_one_line_per_log_step(tmp_path):
    """`dittrain run` as a child process, stderr a pipe: a line at steps 2, 4 and 6 with the
    loss and images/s, and no carriage return anywhere."""
    from storeutil import make_store

    store = make_store(tmp_path / "store", n=24, shards=2)
    r = subprocess.run([BIN / "dittrain", *_train_args(store, tmp_path / "run")], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "\r" not in r.stderr
    found = lines_of(r.stderr, TRAIN_LINE)
    assert [(m.group(1), m.group(2)) for m in found] == [("2", "6"), ("4", "6"), ("6", "6")], r.stderr
    for m in found:
        assert re.search(r"loss \d+\.\d+ lr \S+ \d+ img/s wait \d+%", m.string), m.string
    assert found[0].group(3) and not found[-1].group(3)  # an ETA until the end


def _train_args(store, out, *extra) -> list[str]:
    return run_args(store, out, "--max-steps", 6, "--log-every", 2, *extra)


def test_train_quiet_writes_no_progress_line(tmp_path):
    from storeutil import make_store

    store = make_store(tmp_path / "store", n=24, shards=2)
    r = subprocess.run([BIN / "dittrain", *_train_args(store, tmp_path / "run", "-q")], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert not lines_of(r.stderr, TRAIN_LINE), r.stderr
    assert not any(ln.startswith("train:") for ln in r.stderr.splitlines()), r.stderr


@pytest.fixture
def shards(class_shards):
    return class_shards  # 4 shards of 2 real photos (40 px)


def _encode(shards, out, *extra):
    return ditdata("encode", shards, "--vae", "pixels", "--resolution", 16, "--out", out, "--batch-size", 1,
                   "--workers", 0, "--device", "cpu", *extra)


def test_encode_writes_plain_lines_and_quiet_none(shards, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(INTERVAL_ENV, "0")  # a line at every update
    r = _encode(shards, tmp_path / "s")
    assert r.exit_code == 0, r.output
    assert "\r" not in r.stderr
    found = lines_of(r.stderr, ENCODE_LINE)
    assert [int(m.group(1)) for m in found] == list(range(1, 9)) and {m.group(2) for m in found} == {"8"}

    from ditdata.encode import EncodeConfig, encode  # what -q/--quiet passes

    capsys.readouterr()
    encode(EncodeConfig(shards=str(shards), out=str(tmp_path / "q"), vae="pixels", resolution=16, batch_size=1,
                        workers=0, device="cpu", progress=False))
    assert "encode:" not in capsys.readouterr().err


def test_error_mid_bar_on_a_terminal_starts_its_own_line(shards, tmp_path, monkeypatch):
    """A tqdm bar is drawn (stderr made to look like a terminal) when the second batch fails:
    the bar is ended first, so `Error:` starts a line."""
    import ditdata.encode as encode_mod
    from ditdata.errors import DitdataError

    real, calls = encode_mod._encode_batch, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise DitdataError("the disk is on fire")
        return real(*args, **kwargs)

    monkeypatch.setattr(progress, "is_terminal", lambda stream=None: True)
    monkeypatch.setattr(encode_mod, "_encode_batch", failing)
    r = _encode(shards, tmp_path / "s")
    assert r.exit_code == 1
    assert "|" in r.stderr and "\r" in r.stderr  # tqdm drew
    assert [ln for ln in r.stderr.split("\n") if "Error" in ln] == ["Error: the disk is on fire"], repr(r.stderr)


@pytest.mark.parametrize("group,command", [("dittrain", "run"), ("dittrain", "sample"), ("dittrain", "eval"),
                                           ("ditdata", "verify"), ("ditdata", "encode"), ("ditdata", "score"),
                                           ("ditdata", "fetch")])
def test_long_commands_take_quiet(group, command):
    """-q/--quiet on every long command."""
    r = (dittrain if group == "dittrain" else ditdata)(command, "--help")
    assert r.exit_code == 0, r.output
    assert "-q, --quiet" in r.output
