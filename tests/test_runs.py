"""dittrain/train/runs.py and `dittrain runs`: the table of run directories and the loss plot, on two
real tiny runs (plus evaluation records as report.Log.evaluation writes them, a torn line, a lost
checkpoint) and directories that are not runs."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from cliutil import dittrain, one_error_line, run_args
from PIL import Image
from storeutil import make_store

from dittrain.train.runs import format_table, smooth, summarize, summarize_all

pytestmark = pytest.mark.usefixtures("one_thread")


def evaluation(step: int, fid: float) -> dict:
    """A record as the trainer's report.Log.evaluation writes it (no "loss")."""
    return {"step": step, "fid": fid, "sfid": fid + 1, "inception_score": 1.5, "precision": 0.5, "recall": 0.5,
            "eval_n": 6, "eval_seconds": 1.0}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    a, b = (root := tmp_path_factory.mktemp("runs")) / "a", root / "b"
    store = make_store(root / "store-a", n=24)
    for out, steps in ((a, 3), (b, 4)):
        r = dittrain(*run_args(store, out, "--max-steps", steps, "--save-every", 2, "--keep", 2))
        assert r.exit_code == 0, r.output
    with open(a / "metrics.jsonl", "a") as f:  # two evaluations of run a
        for rec in (evaluation(2, 80.5), evaluation(3, 42.25)):
            f.write(json.dumps(rec) + "\n")
    # run b: killed after logging step 4 but before its checkpoint landed, mid-way through a line
    (b / "checkpoints" / "step_00000004.pt").unlink()
    with open(b / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 0.')
    return root, a, b


def records(run) -> list[dict]:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return [r for r in out if "loss" in r]


def test_summary_of_two_runs(runs):
    _, a, b = runs
    sa, sb = summarize_all([a, b])
    assert (sa.model, sa.store, sa.step, sa.max_steps, sa.status) == ("DiT-T/4", "store-a", 3, 3, "finished")
    assert sa.loss == records(a)[-1]["loss"] and (sa.best_fid, sa.best_fid_step) == (42.25, 3)
    assert sa.images_per_s == pytest.approx(sum(r["images_per_s"] for r in records(a)) / 3)
    assert sa.skipped_lines == 0 and [s for s, _ in sa.curve] == [1, 2, 3]
    assert (sb.step, sb.max_steps, sb.best_fid, sb.skipped_lines) == (4, 4, None, 1)
    assert sb.loss == records(b)[-1]["loss"] and sb.status == "has checkpoint (step 2)"


def test_runs_command_table_and_plot(runs, tmp_path):
    root, a, b = runs
    (root / "not-a-run").mkdir(exist_ok=True)
    plot = tmp_path / "loss.png"
    r = dittrain("runs", a, b, root / "not-a-run", "--plot", plot)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].split()[:5] == ["run", "model", "store", "steps", "loss"]
    row_a = next(line for line in lines if line.startswith(str(a) + " "))
    row_b = next(line for line in lines if line.startswith(str(b) + " "))
    assert " 3/3 " in row_a and f"{records(a)[-1]['loss']:.4f}" in row_a and "42.25 @3" in row_a
    assert row_a.rstrip().endswith("finished")
    assert " 4/4 " in row_b and f"{records(b)[-1]['loss']:.4f}" in row_b
    assert "has checkpoint (step 2), 1 unreadable metrics line(s)" in row_b
    assert any(line.startswith(str(root / "not-a-run")) and "not a run (no config.json)" in line for line in lines)
    assert lines[-1] == f"wrote {plot}"
    with Image.open(plot) as im:
        assert im.format == "PNG" and im.size == (800, 500)
        assert len(np.unique(np.asarray(im.convert("RGB")).reshape(-1, 3), axis=0)) > 10  # drawn
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png"]  # no temporary left


def test_empty_run_and_no_run(runs, tmp_path):
    _, a, _ = runs
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(a / "config.json", empty / "config.json")  # started, nothing logged yet
    s = summarize(empty)
    assert s.run and s.status == "empty" and s.step is None and s.loss is None
    assert "0/3" in format_table([s])
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text("{not json")
    assert summarize(tmp_path / "junk").status.startswith("not a run (config.json unreadable")
    line = one_error_line(dittrain("runs", tmp_path / "junk", tmp_path / "nowhere").output)
    assert "is a run directory" in line and "nowhere" in line
    # nothing to plot: the table is printed, then a one-line error
    r = dittrain("runs", empty, "--plot", tmp_path / "x.png")
    assert r.exit_code != 0 and r.output.splitlines()[-1].startswith("Error: no run has training losses")
    assert not (tmp_path / "x.png").exists()
    line = one_error_line(dittrain("runs", a, "--plot", tmp_path / "no" / "x.png").output)
    assert "its folder does not exist" in line


def test_smoothing_is_a_debiased_ema():
    assert smooth([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    assert smooth([1.0, 3.0], 0.5) == pytest.approx([1.0, (0.25 + 1.5) / 0.75])
