"""`dittrain runs`: a table of run directories, and their loss curves in one PNG.

What a run directory holds (dittrain.train.loop) and what is read from it:

    config.json      {"train": {"model", "max_steps", ...}, "store": {"path", ...}, ...}
    metrics.jsonl    one record a line: training records {"step", "loss", "images_per_s",
                     "data_wait_frac", ...}; evaluation records {"step", "fid", ...} (no "loss");
                     validation records {"step", "val_loss", "val_loss_t<T>", ...}
    checkpoints/     step_N.pt: the status (finished once one is at max_steps)

Nothing is written to the runs. A line of metrics.jsonl that does not parse (torn by a
crash mid-write) or lacks a step is skipped and counted; a directory without config.json
is reported as not a run. RunsError (one line) when none of the directories is a run.

    summaries = [summarize(d) for d in dirs]      RunSummary: the row, the loss curve, notes
    print(format_table(summaries))
    plot_losses(summaries, "loss.png")            log-scale loss, EMA-smoothed over faint raw; val dashed
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ditdata.common.errors import UserError
from ditdata.common.extras import require
from ditdata.common.files import read_json
from dittrain.config import TrainConfig

LAST_RECORDS = 5  # images/s and data wait: the mean over the last this many training records
SMOOTHING = 0.9  # the EMA weight of the plotted curves (TensorBoard's slider; debiased)


class RunsError(UserError):
    """No run among the directories, or nothing to plot; the message is one line."""


@dataclass
class RunSummary:
    """One row of the table. `run` is False for a directory that is not a run (then only
    `name` and `status` mean anything)."""

    name: str
    run: bool = True
    model: str | None = None  # with its --route and how that counts, for a routed run
    store: str | None = None
    step: int | None = None  # the last training record's step
    max_steps: int | None = None
    loss: float | None = None  # the last training record's loss
    images_per_s: float | None = None
    data_wait: float | None = None  # fraction of the time spent waiting for data
    best_fid: float | None = None
    best_fid_step: int | None = None
    checkpoint_step: int | None = None
    status: str = ""  # finished | has checkpoint (step N) | no checkpoint | empty | not a run (...)
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) of every training record
    val_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, val_loss) of every validation record
    skipped_lines: int = 0


def read_metrics(path: Path) -> tuple[list[dict], int]:
    """(the records of metrics.jsonl by step, the last of each step kept; lines skipped).
    A missing file has no records."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return [], 0
    records, skipped = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) or isinstance(rec["step"], bool):
            skipped += 1
            continue
        records.append(rec)
    return records, skipped


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _mean(values) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def summarize(path) -> RunSummary:
    """The row of one directory (never raises for what is in it)."""
    path = Path(path)
    name = str(path)
    if not path.is_dir():
        return RunSummary(name, run=False, status="not a run (no such directory)")
    try:
        config = read_json(path / "config.json")
    except FileNotFoundError:
        return RunSummary(name, run=False, status="not a run (no config.json)")
    except (OSError, ValueError) as e:
        return RunSummary(name, run=False, status=f"not a run (config.json unreadable: {type(e).__name__})")
    if not isinstance(config, dict) or not isinstance(config.get("train"), dict):
        return RunSummary(name, run=False, status="not a run (config.json is not a dittrain run config)")
    train, store = TrainConfig.from_record(config["train"]), config.get("store") or {}
    model = train.model.model
    if train.routing.route:  # and how its numbers count (a run recorded before TREAD's counting: half-open)
        model = f"{model}, route {train.routing.route} ({train.routing.route_convention})"
    s = RunSummary(name, model=model, max_steps=train.optim.max_steps,
                   store=Path(store["path"]).name if store.get("path") else None)

    records, s.skipped_lines = read_metrics(path / "metrics.jsonl")
    by_step: dict[int, dict] = {}
    evals: list[tuple[float, int]] = []
    val: dict[int, float] = {}
    for rec in records:
        if "loss" in rec:
            by_step[rec["step"]] = rec  # a step logged twice (an old resume): the later record
        if (v := _number(rec.get("val_loss"))) is not None:  # --val-fraction / --val-latents
            val[rec["step"]] = v
        fid = _number(rec.get("fid"))
        if fid is not None and math.isfinite(fid):
            evals.append((fid, rec["step"]))
    training = [by_step[k] for k in sorted(by_step)]
    s.curve = [(r["step"], loss) for r in training if (loss := _number(r["loss"])) is not None]
    s.val_curve = sorted(val.items())
    if training:
        s.step, s.loss = training[-1]["step"], _number(training[-1]["loss"])
        last = training[-LAST_RECORDS:]
        s.images_per_s = _mean(_number(r.get("images_per_s")) for r in last)
        s.data_wait = _mean(_number(r.get("data_wait_frac")) for r in last)
    if evals:
        s.best_fid, s.best_fid_step = min(evals)

    from dittrain.rundir import list_checkpoints

    checkpoints = list_checkpoints(path)
    if checkpoints:
        s.checkpoint_step = int(checkpoints[-1].stem.split("_")[1])
    if s.checkpoint_step is not None and isinstance(s.max_steps, int) and s.checkpoint_step >= s.max_steps:
        s.status = "finished"
    elif s.checkpoint_step is not None:
        s.status = f"has checkpoint (step {s.checkpoint_step})"
    elif training or evals:
        s.status = "no checkpoint"
    else:
        s.status = "empty"
    return s


def summarize_all(dirs) -> list[RunSummary]:
    """The rows of `dirs`, in order; RunsError when none is a run."""
    rows = [summarize(d) for d in dirs]
    if not any(r.run for r in rows):
        raise RunsError(f"none of {', '.join(r.name for r in rows)} is a run directory (no config.json); "
                        "give the --out of `dittrain run`")
    return rows


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


COLUMNS = ("run", "model", "store", "steps", "loss", "val loss", "img/s", "wait", "best FID", "status")


def table_rows(rows: list[RunSummary]) -> list[list[str]]:
    out = []
    for r in rows:
        if not r.run:
            out.append([r.name, *["-"] * (len(COLUMNS) - 2), r.status])
            continue
        steps = f"{r.step or 0}/{'?' if r.max_steps is None else r.max_steps}"
        fid = "-" if r.best_fid is None else f"{r.best_fid:.2f} @{r.best_fid_step}"
        status = r.status + (f", {r.skipped_lines} unreadable metrics line(s)" if r.skipped_lines else "")
        val = "-" if not r.val_curve else f"{r.val_curve[-1][1]:.4f} @{r.val_curve[-1][0]}"  # the latest
        out.append([r.name, r.model or "-", r.store or "-", steps, _fmt(r.loss, ".4f"), val,
                    _fmt(r.images_per_s, ".1f"), _fmt(None if r.data_wait is None else 100 * r.data_wait, ".0f", "%"),
                    fid, status])
    return out


def format_table(rows: list[RunSummary]) -> str:
    """The rows as an aligned text table (numbers right-aligned)."""
    cells = [list(COLUMNS), *table_rows(rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    right = {"steps", "loss", "val loss", "img/s", "wait", "best FID"}
    lines = []
    for row in cells:
        parts = [c.rjust(w) if COLUMNS[i] in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def smooth(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Debiased exponential moving average (TensorBoard's smoothing)."""
    out, s = [], 0.0
    for k, v in enumerate(values, 1):
        s = weight * s + (1 - weight) * v
        out.append(s / (1 - weight**k))
    return out


def plot_losses(rows: list[RunSummary], out, *, weight: float = SMOOTHING) -> Path:
    """The loss curves of the runs in one PNG at `out`, written atomically: log-scale y,
    each run's raw records faint and their EMA in the same colour, a legend of run names; a run
    with a validation loss (--val-fraction, --val-latents) has it beside, dashed with markers in
    the same colour, unsmoothed (its numbers are not noisy: fixed t and noise).
    RunsError when no run has a positive loss to draw."""
    def positive(curve):
        return [(x, y) for x, y in curve if math.isfinite(y) and y > 0]

    curves = [(r.name, positive(r.curve), positive(r.val_curve)) for r in rows if r.run]
    curves = [(name, c, v) for name, c, v in curves if c or v]
    if not curves:
        raise RunsError("no run has training losses to plot (metrics.jsonl is missing or empty)")
    matplotlib = require("matplotlib", "--plot", "train", RunsError)
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    from ditdata.common.files import atomic_file

    out = Path(out)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    try:
        for i, (name, curve, val) in enumerate(curves):
            color = f"C{i % 10}"
            if curve:
                steps, losses = zip(*curve, strict=True)
                ax.plot(steps, losses, color=color, alpha=0.25, linewidth=1)
                ax.plot(steps, smooth(list(losses), weight), color=color, linewidth=2, label=name)
            if val:
                steps, losses = zip(*val, strict=True)
                ax.plot(steps, losses, color=color, linewidth=1.5, linestyle="--", marker="o", markersize=3,
                        label=f"{name} (val)")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss" + (", validation loss (dashed)" if any(v for _, _, v in curves) else ""))
        ax.set_title(f"loss (EMA {weight:g} over the raw records)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        with atomic_file(out, "wb") as f:
            fig.savefig(f, format="png")
    finally:
        plt.close(fig)
    return out


__all__ = ["RunSummary", "RunsError", "format_table", "plot_losses", "read_metrics", "smooth", "summarize",
           "summarize_all"]
