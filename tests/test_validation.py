"""--val-fraction / --val-latents (dittrain.train.validation): held-out rows never in a training batch
(every loader kind), the same val numbers for the same weights (two evaluations, another batch size, a
resume), per-t keys in every logger's record, a second store, one-line errors, a config file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import storeutil as su
from cliutil import assert_has, ok, one_error_line, run_args
from cliutil import dittrain as cli

from dittrain.config import VAL_TIMESTEPS, LoaderConfig, TrainConfig
from dittrain.data import build_loader
from dittrain.train.validation import held_out, t_label, t_values

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "custom:hidden=32,depth=2,heads=2,patch=2"
HELD = [0, 3, 7, 8, 20, 21, 22, 23, 24, 30, 53]  # of LOADER_SIZES' 54 rows: a whole shard (20..24) among them


@pytest.fixture(scope="module")
def loader_store(tmp_path_factory) -> Path:
    """LOADER_SIZES' shards (an empty one on purpose) of 3x4x4 latents with flips, labels a, b, c."""
    root = tmp_path_factory.mktemp("loader") / "s"
    su.write_store(root, su.schema(shape=(3, 4, 4), flip=True, text=False, columns=su.LABELLED), su.LOADER_SIZES,
                   info=su.pixels_info(4, su.class_conditioning(["a", "b", "c"])), data=su.latent_data(0))
    return root


@pytest.mark.parametrize("kind, workers", [("resident", 0), ("streaming", 0), ("streaming", 2)])
def test_held_out_rows_are_never_in_a_training_batch(loader_store, kind, workers):
    kept = sorted(set(range(54)) - set(HELD))
    with su.new_loader(loader_store, kind, workers, seed=1, exclude=HELD) as loader:
        seen = [int(i) for batch in su.take(loader, 12) for i in batch["index"]]
    assert not set(seen) & set(HELD)
    assert sorted(seen[:len(kept)]) == kept  # an epoch is every kept row once
    # and the order still resumes exactly
    straight, split, state = su.resumed(lambda: su.new_loader(loader_store, kind, workers, seed=1, exclude=HELD), 9, 4,
                                        keep=lambda b: b["index"].tolist())
    assert straight == split and state["excluded"] == len(HELD)


def test_two_ranks_share_the_kept_rows(loader_store):
    parts = []
    for rank in range(2):
        with su.new_loader(loader_store, "resident", seed=1, exclude=HELD, rank=rank, world_size=2) as loader:
            parts.append({int(i) for b in su.take(loader, 3) for i in b["index"]})
    assert not parts[0] & parts[1] and parts[0] | parts[1] == set(range(54)) - set(HELD)


def test_a_bucketed_store_skips_its_held_out_rows(tmp_path):
    store = su.bucketed_store(tmp_path / "b", {(8, 8): 10, (8, 4): 7})  # buckets by name: 8x4 (rows 0..6), 8x8 (7..16)
    loader = build_loader(store, LoaderConfig(with_index=True), batch_size=4, exclude=[0, 1, 12])
    seen = {(loader.bucket_of(k), int(i)) for k in range(12) for i in next(loader)["index"]}
    assert seen == {(0, i) for i in range(2, 7)} | {(1, i) for i in range(10) if i != 5}


def test_the_split_is_seeded_stratified_and_refuses_too_few_rows():
    a, again = held_out([100, 7, 40], 0.1), held_out([100, 7, 40], 0.1)
    assert [len(r) for r in a] == [10, 1, 4] and all(np.array_equal(x, y) for x, y in zip(a, again, strict=True))
    assert [len(r) for r in held_out([3, 1], 0.01)] == [1, 0]  # at least one row, every part keeps one to train on
    with pytest.raises(ValueError, match="too few"):
        held_out([1], 0.5)
    assert t_values("ddpm") == [50, 150, 250, 350, 450, 550, 650, 750, 850, 950]
    assert [t_label(t) for t in t_values("flow")][:2] == ["t0.05", "t0.15"] and len(t_values("flow")) == VAL_TIMESTEPS


def _records(out: Path, key: str) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if key in r}


def test_val_loss_is_logged_per_t_and_the_same_after_a_resume(tmp_path):
    store = su.make_store(tmp_path / "s")
    args = ["--model", MODEL, "--val-fraction", "0.25", "--val-every", "2", "--save-every", "2", "--lr", "1e-3",
            "--logger", "jsonl,tensorboard"]
    ok(cli(*run_args(store, tmp_path / "straight", "--max-steps", "4", *args)))
    ok(cli(*run_args(store, tmp_path / "two", "--max-steps", "2", *args)))
    ok(cli("run", "--resume", "--out", tmp_path / "two", "--max-steps", "4"), "finished at step 4")
    straight, two = _records(tmp_path / "straight", "val_loss"), _records(tmp_path / "two", "val_loss")
    assert sorted(straight) == [0, 2, 4] == sorted(two)
    keys = {f"val_loss_{t_label(t)}" for t in t_values("ddpm")}
    for step in straight:
        assert keys <= straight[step].keys()
        assert {k: straight[step][k] for k in ("val_loss", *keys)} == {k: two[step][k] for k in ("val_loss", *keys)}
    assert straight[4]["val_loss"] != straight[0]["val_loss"]  # the weights moved
    record = json.loads((tmp_path / "straight" / "config.json").read_text())
    assert record["train"]["eval"]["val_fraction"] == 0.25
    assert record["validation"] | {"t": None} == {"fraction": 0.25, "held_out": 12, "rows": 12, "t": None,
                                                   "weights": "live", "loss": "mse", "seed": record["validation"]["seed"]}
    # TensorBoard has the per-t curves
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "straight" / "tensorboard"))
    events.Reload()
    assert {"val/loss", "val/loss_t50", "val/loss_t950"} <= set(events.Tags()["scalars"])
    # the split is fixed, how often it is measured is not
    bad = cli("run", "--resume", "--out", tmp_path / "two", "--max-steps", "6", "--val-fraction", "0.5")
    assert "--val-fraction" in one_error_line(bad.output)
    ok(cli("run", "--resume", "--out", tmp_path / "two", "--max-steps", "5", "--val-every", "5"), "finished at step 5")
    from dittrain.train.runs import plot_losses, summarize

    summary = summarize(tmp_path / "two")
    assert [s for s, _ in summary.val_curve] == [0, 2, 4, 5]
    from dittrain.train.runs import format_table

    header, row = format_table([summary]).splitlines()
    assert "val loss" in header and f"{summary.val_curve[-1][1]:.4f} @5" in row  # the latest, where it was taken
    assert plot_losses([summary], tmp_path / "loss.png").stat().st_size > 0


def _captioned(sch, index: int, n: int) -> tuple[dict, dict]:
    tensors, columns = su.shard_data(sch, index, n)
    return tensors, {k: columns[k] for k in su.CAPTIONED}


def _mean_std_text_store(root: Path) -> Path:
    """Posterior mean and std (a fresh draw per step in training), flips, pooled and token text embeddings."""
    su.write_store(root, su.schema(kind="mean_std", shape=(3, 8, 8), text={"pooled": 16, "tokens": (5, 16)},
                                   columns=su.CAPTIONED),
                   [10, 10], info=su.pixels_info(8, su.text_conditioning(16, (5, 16))), data=_captioned)
    return root


@pytest.mark.parametrize("kind", ["class", "mean_std_text"])
def test_two_evaluations_of_the_same_weights_agree_whatever_the_batch(tmp_path, kind):
    import torch

    from dittrain.model.dit import DiT
    from dittrain.train.setup import setup
    from dittrain.train.validation import build

    store = su.make_store(tmp_path / "s", flip=False) if kind == "class" else _mean_std_text_store(tmp_path / "s")
    results = []
    for batch in (64, 3):
        cfg = TrainConfig.from_flat(latents=str(store), model=MODEL, val_fraction=0.25, eval_batch_size=batch,
                                    device="cpu", out=str(tmp_path / "r"))
        run = setup(cfg)
        val = build(run)
        torch.manual_seed(0)
        model = DiT(run.model_cfg)
        results += [val.evaluate(model), val.evaluate(model)]
    first = {k: v for k, v in results[0].items() if k != "seconds"}
    for rec in results[1:]:
        assert rec.keys() == results[0].keys()
        for k, v in first.items():
            assert rec[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    assert {k: v for k, v in results[1].items() if k != "seconds"} == first  # the same batch: bit for bit


def test_a_second_store_validates_and_training_is_untouched(tmp_path):
    store, other = su.make_store(tmp_path / "s"), su.make_store(tmp_path / "v", n=12, shards=1, seed=5)
    common = ["--model", MODEL, "--max-steps", "3", "--lr", "1e-3", "--logger", "jsonl"]
    ok(cli(*run_args(store, tmp_path / "plain", *common)))
    r = ok(cli(*run_args(store, tmp_path / "val", *common, "--val-latents", other, "--val-every", "2")))
    assert_has(r.output, f"12 rows of {other}")
    def training(out):
        return {step: (r["loss"], r["grad_norm"]) for step, r in _records(out, "loss").items()}

    assert training(tmp_path / "plain") == training(tmp_path / "val")  # the same training, bit for bit
    assert sorted(_records(tmp_path / "val", "val_loss")) == [0, 2, 3]
    record = json.loads((tmp_path / "val" / "config.json").read_text())["validation"]
    assert record["rows"] == 12 and record["store"]["path"] == str(other.resolve())


def test_bad_values_are_one_line(tmp_path):
    store = su.make_store(tmp_path / "s", n=6, shards=1)
    other = su.make_store(tmp_path / "o", n=6, shards=1, shape=(3, 16, 16))
    cases = [
        (["--val-fraction", "1.5"], "--val-fraction"),
        (["--val-fraction", "0.1", "--val-latents", other], "give one"),
        (["--val-latents", tmp_path / "nowhere"], "--val-latents"),
        (["--val-latents", other], "does not fit the model"),
        (["--val-every", "0"], "--val-every"),
    ]
    for extra, needle in cases:
        r = cli(*run_args(store, tmp_path / "r", "--model", MODEL, "--max-steps", "1", *extra))
        assert r.exit_code != 0 and needle in one_error_line(r.output), r.output
        assert not (tmp_path / "r").exists()  # refused before anything is written


def test_a_config_file_and_dotted_flags_set_it(tmp_path):
    (tmp_path / "run.toml").write_text("[eval]\nval_fraction = 0.2\nval_every = 7\n")
    r = ok(cli("run", "--config", tmp_path / "run.toml", "--eval.val-every", "9", "--print-config"))
    assert_has(r.output, "val-fraction = 0.2", "val-every = 9")
    r = ok(cli("run", "--eval.val_latents", "elsewhere", "--print-config"))
    assert_has(r.output, 'val-latents = "elsewhere"')


def test_a_bucketed_flow_run_validates_every_bucket(tmp_path):
    store = su.bucketed_store(tmp_path / "b", {(8, 8): 12, (8, 4): 8})
    r = ok(cli(*run_args(store, tmp_path / "r", "--model", MODEL, "--objective", "flow", "--max-steps", "2",
                         "--val-fraction", "0.25", "--val-every", "2", "--logger", "jsonl")))
    assert_has(r.output, "5 held-out rows")  # 3 of 8x8's 12 and 2 of 8x4's 8
    recs = _records(tmp_path / "r", "val_loss")
    assert sorted(recs) == [0, 2]
    assert {f"val_loss_{t_label(t)}" for t in t_values("flow")} <= recs[2].keys() and "val_loss_t0.05" in recs[2]


def test_two_ranks_share_the_evaluation_and_log_what_one_process_does(tmp_path):
    """12 held-out rows in batches of 4 over 2 ranks (rank 0 takes batches 1 and 3, rank 1 batch 2): the
    all-reduced val loss rank 0 logs is one process's, at the start (the same weights) and after 2 steps."""
    from cliutil import one_and_two_ranks, torchrun_or_skip

    torchrun_or_skip()
    store = su.make_store(tmp_path / "s")
    one_and_two_ranks(store, tmp_path, ["--model", MODEL, "--val-fraction", "0.25", "--val-every", "2",
                                        "--eval-batch-size", "4", "--max-steps", "2", "--lr", "1e-3",
                                        "--loader", "resident"])
    one, two = _records(tmp_path / "one", "val_loss"), _records(tmp_path / "two", "val_loss")
    assert sorted(one) == sorted(two) == [0, 2]
    keys = ["val_loss", *(f"val_loss_{t_label(t)}" for t in t_values("ddpm"))]
    for k in keys:  # the same weights: only the float64 sums' order differs
        assert two[0][k] == pytest.approx(one[0][k], rel=1e-7), k
    for k in keys:  # after 2 steps: Adam's first updates (about lr x sign(g)) carry DDP's rounding of g
        assert two[2][k] == pytest.approx(one[2][k], rel=1e-3), k
    assert one[2]["val_loss"] != one[0]["val_loss"]


FAILING_RANK = """
import sys, torch, torch.distributed as dist
from dittrain.config import TrainConfig
from dittrain.model.dit import DiT
from dittrain.train.setup import setup
from dittrain.train.validation import build
dist.init_process_group("gloo")
rank = dist.get_rank()
run = setup(TrainConfig.from_flat(latents=sys.argv[1], model=sys.argv[2], val_fraction=0.25, eval_batch_size=4,
                                  device="cpu", out=sys.argv[3]))
val = build(run)
if rank == 1:  # a rank-local failure (an OOM on one card, say)
    def boom(*a, **k):
        raise MemoryError("out of memory on rank 1")
    val._sum = boom
torch.manual_seed(0)
try:
    val.evaluate(DiT(run.model_cfg), rank=rank, world=2)
    print(f"rank {rank}: no error")
except Exception as e:
    print(f"rank {rank}: {type(e).__name__}: {e}")
"""


def test_a_failure_on_one_rank_is_raised_on_every_rank(tmp_path):
    """Rank 1's validation fails: both ranks raise (neither waits in the other's all-reduce) and the
    next collective still pairs up, so the run's note is printed on each and training goes on."""
    from cliutil import script_on_two_ranks

    stdout = script_on_two_ranks(FAILING_RANK, su.make_store(tmp_path / "s"), MODEL, tmp_path / "r", tmp=tmp_path)
    assert "rank 1: MemoryError: out of memory on rank 1" in stdout
    assert "rank 0: RuntimeError: it failed on 1 other rank(s)" in stdout
    assert "rank 0: next [3.0, 3.0, 3.0]" in stdout and "rank 1: next [3.0, 3.0, 3.0]" in stdout
