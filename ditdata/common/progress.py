"""Progress of long commands on stderr: a tqdm bar on a terminal, plain lines in a file.

    bar = progress_bar(total=1200, desc="encode", unit="img", enabled=not quiet)
    for batch in batches:
        ...
        bar.update(len(batch))           # also: bar.set_postfix_str("loss 0.12"), bar.write("a note")
    bar.close()                          # or `with progress_bar(...) as bar:`, or progress_bar(iterable)

On a terminal (stderr.isatty(); `is_terminal`) the bar is tqdm's. Anywhere else (Slurm,
nohup, CI, a pipe) `\\r` redraws would fill the log with one endless line, so the bar is
`Lines`, with the same surface, which writes one plain line

    encode: 384/1200 img (32%), 12.8 img/s, elapsed 00:30, ETA 01:04

every DITKIT_PROGRESS_INTERVAL seconds (default 30; 0: at every update), every `every` units
when given (the trainer: one line per --log-every steps, and no time-based lines), when the
total is reached, and at close when it moved since the last line (not when the block ends
on an error: the error is the last word). The rate of a line is that since the line before;
the last line's, that of the whole run. `enabled=False` (-q/--quiet) draws nothing either way.

`Batches` gathers samples for a model that runs on batches (a stage's per-shard loop) and
advances a bar by each batch it runs.

`end_open_bars` closes the tqdm bars still drawn, so that the error line of a failed command
(ditdata.common.cli) starts at column 0 instead of after a bar. tqdm is imported only when
a bar is made.
"""

from __future__ import annotations

import math
import os
import sys
import time

from ditdata.common.errors import UserError

INTERVAL_ENV = "DITKIT_PROGRESS_INTERVAL"
DEFAULT_INTERVAL = 30.0  # seconds between two plain lines


def is_terminal(stream=None) -> bool:
    """Whether `stream` (default sys.stderr) is a terminal, where tqdm's bars belong."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def line_interval() -> float:
    """Seconds between two plain progress lines: $DITKIT_PROGRESS_INTERVAL, else 30."""
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    if not raw:
        return DEFAULT_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also nan
        raise UserError(f"{INTERVAL_ENV}={raw!r}: expected seconds between progress lines (a number >= 0)")
    return value


def progress_bar(iterable=None, *, total: int | None = None, desc: str = "", unit: str = "it",
                 enabled: bool = True, initial: int = 0, every: int | None = None,
                 interval: float | None = None, terminal: bool | None = None, file=None, **tqdm_kwargs):
    """A tqdm bar on a terminal, else `Lines` (module docstring); both offer update(n),
    set_postfix_str(s), set_postfix(**kw), refresh(), write(s), close(), `n`, iteration over
    `iterable` and the with-statement. every: a plain line each time n passes a multiple of
    it (interval then defaults to none: no time-based lines). interval: seconds between plain
    lines (default line_interval()). terminal: the choice, instead of is_terminal(file).
    tqdm_kwargs (leave, mininterval, smoothing, ...) go to tqdm only."""
    file = sys.stderr if file is None else file
    if terminal is None:
        terminal = is_terminal(file)
    if terminal:
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc or None, unit=unit, initial=initial, disable=not enabled,
                    file=file, dynamic_ncols=True, **tqdm_kwargs)
    if interval is None:
        interval = math.inf if every else line_interval()
    return Lines(iterable, total=total, desc=desc, unit=unit, enabled=enabled, initial=initial, every=every,
                 interval=interval, file=file)


class Lines:
    """A progress bar as plain lines (module docstring): what a log file can read."""

    def __init__(self, iterable=None, *, total: int | None = None, desc: str = "", unit: str = "it",
                 enabled: bool = True, initial: int = 0, every: int | None = None,
                 interval: float = DEFAULT_INTERVAL, file=None):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit.strip() or "it"
        self.disable, self.every, self.interval = not enabled, every, interval
        self.file = sys.stderr if file is None else file
        self.n, self.postfix, self.closed = initial, "", False
        self._t0 = self._t_line = time.monotonic()
        self._n0 = self._n_line = initial

    def __enter__(self) -> Lines:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        self.closed = True  # after an error: no last line (the error says what happened)

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __len__(self) -> int:
        return self.total or 0

    def update(self, n: int = 1) -> None:
        """n more units done; a line when one is due."""
        self.n += n
        if self.disable or self.closed or not n:
            return
        now = time.monotonic()
        reached = self.total is not None and self.n >= self.total > self._n_line
        if (reached
                or (self.every and self.n // self.every > self._n_line // self.every)
                or now - self._t_line >= self.interval):
            self._line(now, final=reached)

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """Text after the figures of the next line."""
        self.postfix = str(s)

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def refresh(self) -> None:
        """Nothing to redraw: lines come when due."""

    def write(self, s: str, file=None, end: str = "\n") -> None:
        """A line of its own (what tqdm.write does beside a bar)."""
        out = self.file if file is None else file
        out.write(f"{s}{end}")
        out.flush()

    def close(self) -> None:
        """The last line, when the count moved since the line before."""
        if self.closed:
            return
        self.closed = True
        if not self.disable and self.n != self._n_line:
            self._line(time.monotonic(), final=True)

    def format_line(self, now: float, *, final: bool = False) -> str:
        """`desc: n/total unit (p%), rate, elapsed, ETA; postfix` (module docstring)."""
        from tqdm import tqdm

        elapsed = now - self._t0
        span, done = (elapsed, self.n - self._n0) if final else (now - self._t_line, self.n - self._n_line)
        rate = done / span if span > 0 else None
        count = f"{self.n} {self.unit}"
        if self.total:
            count = f"{self.n}/{self.total} {self.unit} ({100 * self.n / self.total:.0f}%)"
        parts = [count]
        if rate:
            parts.append(f"{tqdm.format_sizeof(rate)} {self.unit}/s" if rate >= 1
                         else f"{tqdm.format_sizeof(1 / rate)} s/{self.unit}")
        parts.append(f"elapsed {tqdm.format_interval(elapsed)}")
        if rate and self.total and self.n < self.total:
            parts.append(f"ETA {tqdm.format_interval((self.total - self.n) / rate)}")
        line = ", ".join(parts) + (f"; {self.postfix}" if self.postfix else "")
        return f"{self.desc}: {line}" if self.desc else line

    def _line(self, now: float, *, final: bool) -> None:
        self.write(self.format_line(now, final=final))
        self._t_line, self._n_line = now, self.n


def most_first(counts: dict) -> dict:
    """`counts` (what -> n) as the reports show them: most frequent first, ties by name."""
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def run_totals(counts: dict, new: int, seconds: float, per_s: str) -> dict:
    """The figures every end-of-run summary of a per-sample command carries: samples (all the
    complete ones), counts (status -> n, most_first), new_samples (this run's), seconds and
    this run's rate under the key `per_s` (None when nothing new was done)."""
    return {"samples": sum(counts.values()), "counts": most_first(counts), "new_samples": new, "seconds": seconds,
            per_s: new / seconds if new and seconds > 0 else None}


class Batches:
    """Samples gathered for a batched call: add(row, *inputs) queues one sample (`row`: its
    place in the caller's table, where the call's results go); when `size` are queued, and at
    flush(), run(rows, *columns) gets the rows and one list per input, then `progress` (a bar,
    or None) advances by the batch, so the bar counts what was run rather than what was read."""

    def __init__(self, size: int, run, progress=None):
        self.size, self.run, self.progress = size, run, progress
        self.rows: list = []
        self.columns: list[list] = []

    def add(self, row, *inputs) -> None:
        if not self.rows:
            self.columns = [[] for _ in inputs]
        self.rows.append(row)
        for column, x in zip(self.columns, inputs, strict=True):
            column.append(x)
        if len(self.rows) >= self.size:
            self.flush()

    def flush(self) -> None:
        """Run what is queued (nothing when nothing is)."""
        if self.rows:
            self.run(self.rows, *self.columns)
            if self.progress is not None:
                self.progress.update(len(self.rows))
            self.rows, self.columns = [], []


def end_open_bars() -> None:
    """Close every tqdm bar still drawn (each ends its line), so what is printed next starts
    at column 0. Nothing to do when tqdm was never imported."""
    tqdm_module = sys.modules.get("tqdm")
    bars = getattr(getattr(tqdm_module, "tqdm", None), "_instances", None)
    for bar in list(bars or ()):
        try:
            bar.close()
        except Exception:  # a bar whose stream is gone: nothing left to end
            pass


__all__ = ["Batches", "DEFAULT_INTERVAL", "INTERVAL_ENV", "Lines", "end_open_bars", "is_terminal", "line_interval",
           "progress_bar"]
