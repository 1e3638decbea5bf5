"""dittrain.data: the streaming loader's memory budget (--loader-memory) sizes its window and
prefetch depth, keeps its measured peak under the budget, refuses settings that cannot fit,
and leaves the data order a function of the resolved settings (resume keeps the window)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from cliutil import dittrain as cli
from cliutil import raises_one_line, run_args
from storeutil import LABELLED, latent_data, make_store, schema, write_store

import dittrain.data as data
from ditdata.store import open_store
from dittrain.data import LoaderConfig, LoaderError, LoaderStateError, StreamingLoader, loader_budget, parse_memory
from dittrain.rundir import latest_checkpoint, load_checkpoint

MiB, GiB = 2**20, 2**30
SHARD = 1000  # samples of 4x32x32 fp16 with flips: 16 MiB a shard
SHARDS = 6


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget") / "s"
    write_store(root, schema(shape=(4, 32, 32), flip=True, text=False, columns=LABELLED), [SHARD] * SHARDS,
                data=latent_data(0))
    return open_store(root)


def fake_ram(monkeypatch, nbytes) -> None:
    monkeypatch.setattr(data.budget, "available_memory", lambda: (nbytes, "test figure"))


def test_parse_memory():
    assert parse_memory("auto") is None and parse_memory(None) is None
    assert parse_memory("2GiB") == parse_memory("2G") == parse_memory("2g") == 2 * GiB
    assert parse_memory("512MiB") == parse_memory("512 mib") == 512 * MiB
    assert parse_memory("1.5GiB") == 3 * GiB // 2
    assert parse_memory("2GB") == 2 * 10**9  # decimal, as disks count
    assert parse_memory("123456") == parse_memory(123456) == 123456
    for bad in ("lots", "-1GiB", "0", "2 GiBs", "GiB", ""):
        with pytest.raises(ValueError, match="loader memory"):
            parse_memory(bad)


def test_auto_budget_is_a_capped_share_of_ram(monkeypatch):
    fake_ram(monkeypatch, 8 * GiB)
    assert loader_budget("auto")[0] == 2 * GiB  # 25%
    assert loader_budget("auto", world_size=4, local_world_size=4)[0] == GiB // 2  # split over local ranks
    fake_ram(monkeypatch, 100 * GiB)
    nbytes, how = loader_budget("auto")
    assert nbytes == data.LOADER_MEMORY_CAP and "cap" in how
    assert loader_budget("3GiB") == (3 * GiB, "--loader-memory 3GiB")  # explicit: RAM plays no part
    monkeypatch.setattr(data.budget, "available_memory", lambda: (None, "unknown"))
    assert loader_budget("auto")[0] == data.LOADER_MEMORY_CAP


def test_a_smaller_budget_gives_smaller_windows_and_prefetch(store):
    big = StreamingLoader(store, batch_size=64, workers=2, memory="4GiB")
    assert (big.shuffle_window, big.prefetch) == (data.AUTO_MAX_WINDOW, data.AUTO_MAX_PREFETCH)
    one = data.plan_streaming_memory(big.spec, [SHARD] * SHARDS, big._piece, workers=2, window=1, prefetch=2,
                                     slot_bytes=big._slot_bytes, batch_size=64)
    small = StreamingLoader(store, batch_size=64, workers=2, memory=one.estimate + MiB)
    assert small.shuffle_window == 1 and small.prefetch == 2
    assert small.memory_estimate <= one.estimate + MiB < big.memory_estimate
    # the startup line (loader.reason) says what was chosen and how it compares with the budget
    assert "window 1, prefetch 2, memory ~" in small.reason and "of budget" in small.reason


def _private(pid: int) -> int:
    """Private (unshared) bytes of a process: what it allocated or copied after the fork."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        fields = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ln.rstrip().endswith("kB")}
    return fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)


def _measured_peak(loader: StreamingLoader, batches: int) -> int:
    """Peak of the sum of the workers' private memory while `batches` are drawn (sampled every
    ms), plus the shared-memory slots (allocated once, in the main process)."""
    next(loader)
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], sum(_private(p.pid) for p in loader._procs))
            except OSError:
                pass
            time.sleep(0.001)

    t = threading.Thread(target=sample)
    t.start()
    try:
        for _ in range(batches):
            next(loader)
    finally:
        stop.set()
        t.join()
    return peak[0] + loader.workers * loader.prefetch * loader._slot_bytes


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs /proc smaps_rollup")
@pytest.mark.parametrize("budget", ["300MiB", "480MiB"])
def test_measured_peak_stays_under_the_budget(store, budget):
    """The workers' measured memory stays under the budget and under the estimate, across
    window and epoch boundaries (1.5 epochs). A worker that held its old window while reading the next
    one (as it once did) would go over the estimate of the 4-shard windows."""
    with StreamingLoader(store, batch_size=64, workers=2, memory=budget) as loader:
        peak = _measured_peak(loader, 3 * SHARD * SHARDS // 2 // 64)
        assert peak <= parse_memory(budget), (peak / MiB, loader.reason)
        assert peak <= loader.memory_estimate, (peak / MiB, loader.reason)
        # and the figure is real: it sees the windows (at least one shard per worker)
        assert peak >= 2 * SHARD * data.base._Spec(store).resident_bytes
        # the loader's own measurement (the end-of-run line) agrees with the sampled one: each
        # worker reads its private memory once per window, at the end of the window's read
        own = loader.measured_memory()
        slots = loader.workers * loader.prefetch * loader._slot_bytes
        assert own["slots"] == slots and own["measured"] == own["workers"] + slots
        assert own["measured"] <= own["estimate"] <= loader.memory_estimate, (own, loader.reason)
        assert 0.8 * (peak - slots) <= own["workers"] <= 1.25 * (peak - slots), (own, peak)
        line = loader.describe_measured()
        assert line.startswith("streaming loader memory: measured peak ~") and "against the estimate ~" in line


def test_nothing_is_measured_without_worker_processes(store):
    """workers=0 reads in the main process, whose memory is not the loader's alone: no figure."""
    with StreamingLoader(store, batch_size=64, workers=0, memory="300MiB") as loader:
        next(loader)
        assert loader.measured_memory() is None and loader.describe_measured() is None


def test_an_impossible_budget_is_refused_in_one_line(store):
    msg = raises_one_line(LoaderError, lambda: StreamingLoader(store, batch_size=64, workers=4, memory="100MiB"))
    assert "4 workers" in msg and "100.0 MiB" in msg and "--loader-memory" in msg
    # an explicit window is kept and checked, not lowered: both figures are named
    with pytest.raises(LoaderError) as e:
        StreamingLoader(store, batch_size=64, workers=2, shuffle_window=4, memory="300MiB")
    msg = str(e.value)
    assert "shuffle window 4 with 2 workers" in msg and "300.0 MiB" in msg and "needs ~" in msg
    with pytest.raises(LoaderError):  # build_loader refuses it the same way
        data.build_loader(store, LoaderConfig(kind="streaming", workers=2, shuffle_window=4, memory="300MiB"),
                          batch_size=64)


def _batches(loader, n):
    with loader:
        return [next(loader) for _ in range(n)]


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_same_resolved_settings_give_the_same_batches(store):
    """The order is a function of the resolved window, whatever sized it (budget or flag) and
    whatever the prefetch depth or number of workers."""
    sized = StreamingLoader(store, batch_size=64, workers=2, memory="300MiB", with_index=True)
    w = sized.shuffle_window
    assert w < data.AUTO_MAX_WINDOW  # the budget did size it
    n = SHARD * w // 64 + 3  # across a window boundary
    a = _batches(sized, n)
    _same(a, _batches(StreamingLoader(store, batch_size=64, workers=1, shuffle_window=w, prefetch=1,
                                      with_index=True), n))
    other = _batches(StreamingLoader(store, batch_size=64, workers=0, shuffle_window=w + 1, with_index=True), n)
    assert not all(torch.equal(x["index"], y["index"]) for x, y in zip(a, other, strict=True))


def test_resume_across_a_budget_change(store):
    """A state saved with one budget resumes exactly under another when the saved window is
    passed on (what `dittrain run --resume` does); a loader that sized its own window anew is
    refused by load_state_dict, and a budget that cannot hold the saved window by LoaderError."""
    first = StreamingLoader(store, batch_size=64, workers=0, memory="4GiB")
    with first:
        for _ in range(40):
            next(first)
        state = first.state_dict()
        expected = [next(first) for _ in range(5)]
    assert state["shuffle_window"] == 4
    cheap = data.plan_streaming_memory(first.spec, [SHARD] * SHARDS, first._piece, workers=0, window=2,
                                       prefetch=1, slot_bytes=first._slot_bytes, batch_size=64).estimate
    resized = StreamingLoader(store, batch_size=64, workers=0, memory=cheap)
    assert resized.shuffle_window == 2
    with pytest.raises(LoaderStateError, match="shuffle_window 4 vs 2"):
        resized.load_state_dict(state)
    with pytest.raises(LoaderError, match="shuffle window 4"):
        StreamingLoader(store, batch_size=64, workers=0, shuffle_window=4, memory=cheap)
    kept = StreamingLoader(store, batch_size=64, workers=2, shuffle_window=state["shuffle_window"], memory="1GiB")
    kept.load_state_dict(state)
    _same(expected, _batches(kept, 5))


@pytest.mark.usefixtures("one_thread")
def test_run_resume_keeps_the_saved_window(tmp_path):
    """dittrain run: a window sized by a tight --loader-memory is kept by --resume under the
    default budget (which would size a larger one), and the startup line shows the memory."""
    src = make_store(tmp_path / "s")  # 3 shards of 16 samples
    probe = StreamingLoader(src, batch_size=8, workers=0, shuffle_window=1)
    tight = str(probe.memory_estimate + 64)  # bytes: one shard fits, two do not
    common = ["--loader", "streaming", "--workers", "0", "--save-every", "2", "--loader-memory"]
    r = cli(*run_args(src, tmp_path / "r", "--max-steps", 2, *common, tight))
    assert r.exit_code == 0, r.output
    assert "window 1, prefetch " in r.output and f"budget --loader-memory {tight}" in r.output
    r = cli(*run_args(src, tmp_path / "r", "--max-steps", 4, *common, "auto", "--resume"))
    assert r.exit_code == 0, r.output
    assert "resuming at step 2" in r.output and "window 1," in r.output
    ckpt = load_checkpoint(latest_checkpoint(tmp_path / "r"))
    assert ckpt["ranks"][0]["loader"]["shuffle_window"] == 1


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs /proc smaps_rollup")
@pytest.mark.usefixtures("one_thread")
def test_a_run_ends_with_the_measured_loader_memory(tmp_path):
    """The startup line gives the estimate; the end of the run gives what the workers measured."""
    src = make_store(tmp_path / "s")
    r = cli(*run_args(src, tmp_path / "r", "--max-steps", 3, "--loader", "streaming", "--workers", "1"))
    assert r.exit_code == 0, r.output
    assert "memory ~" in r.output  # the estimate, at the start
    end = [ln for ln in r.output.splitlines() if "streaming loader memory: measured peak ~" in ln]
    assert len(end) == 1 and "against the estimate ~" in end[0], r.output
