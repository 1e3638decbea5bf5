"""dittrain.data: the resident and streaming loaders over a latent store."""

from __future__ import annotations

import shutil
from functools import partial

import numpy as np
import pytest
import torch
from storeutil import (
    INFO,
    LOADER_BATCH,
    LOADER_SIZES,
    LOADERS,
    batch_split,
    each_cuda_loader,
    new_loader,
    resumed,
    schema,
    shard_data,
    take,
    write_store,
)

import dittrain.data as data
from ditdata.store import open_store, values
from dittrain.data import LoaderConfig, ResidentLoader, StreamingLoader, build_loader, choose_loader

SIZES, B = LOADER_SIZES, LOADER_BATCH  # 54 samples, an empty shard on purpose; batches of 8
N = sum(SIZES)
make = partial(new_loader, seed=3)  # make(store, kind, workers=0, **kw): storeutil.new_loader


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Open stores of SIZES by name: fp16, bf16, int8 (with per-token scales) and fp16 mean/std
    latents with flips (zarr), fp16 latents without flips (wds)."""
    root = tmp_path_factory.mktemp("stores")
    kinds = {"fp16": (schema("float16"), "zarr"), "bf16": (schema("bfloat16"), "zarr"), "int8": (schema("int8"), "zarr"),
             "meanstd": (schema("float16", kind="mean_std"), "zarr"), "wds": (schema("float16", flip=False), "wds")}
    for name, (sch, backend) in kinds.items():
        write_store(root / name, sch, SIZES, backend, chunk_samples=4)
    return {name: open_store(root / name) for name in kinds}


def stream(batches, key="index"):
    return torch.cat([b[key] for b in batches])


def all_data(store):
    """The whole store as numpy arrays in global index order."""
    parts = [store.read(s) for s in store.shards]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def f32(arr):
    return torch.from_numpy(np.asarray(arr).astype(np.float32))


# -- every sample once per epoch; ranks disjoint and covering --------------------------
@pytest.mark.parametrize("kind,workers", LOADERS)
def test_each_sample_once_per_epoch(stores, kind, workers):
    with make(stores["fp16"], kind, workers) as loader:
        idx = stream(take(loader, 3 * N // B + 1))  # a bit over three epochs
    epochs = [idx[e * N:(e + 1) * N].sort().values.tolist() for e in range(3)]
    assert all(e == list(range(N)) for e in epochs)
    assert not torch.equal(idx[:N], idx[N:2 * N])  # a fresh order each epoch


@pytest.mark.parametrize("kind,workers", LOADERS)
def test_batch_larger_than_an_epoch(stores, kind, workers):
    with make(stores["fp16"], kind, workers, batch_size=64) as loader:
        idx = stream(take(loader, 3))
    assert all(idx[e * N:(e + 1) * N].sort().values.tolist() == list(range(N)) for e in range(3))


@pytest.mark.parametrize("kind,workers", [("resident", 0), ("streaming", 0)])
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_disjoint_and_cover(stores, kind, workers, world_size):
    for epoch in range(2):
        seen = []
        for rank in range(world_size):
            loader = make(stores["fp16"], kind, workers, rank=rank, world_size=world_size)
            sizes = [loader.samples_per_epoch]
            idx = stream(take(loader, 2 * N // B + 2))
            if kind == "streaming":  # a rank's epoch length depends on its shards that epoch
                sizes = [loader.plan.epoch_size(e) for e in range(2)]
            else:
                sizes = sizes * 2
            start = sum(sizes[:epoch])
            part = idx[start:start + sizes[epoch]].tolist()
            assert len(set(part)) == len(part)
            seen += part
        assert sorted(seen) == list(range(N))


@pytest.mark.parametrize("kind,workers", LOADERS)
def test_split_batch_is_one_process_sliced(stores, kind, workers):
    """split="batch": W ranks together get exactly what one process gets with batch B * W
    (fresh draws included), and rank 0's state resumes rank 1."""
    store = stores["meanstd"]
    want, got = batch_split(partial(make, store, kind, workers), 9)
    for w, g0, g1 in zip(want, *got, strict=True):
        assert all(torch.equal(w[k], torch.cat([g0[k], g1[k]])) for k in w)
    with make(store, kind, workers, rank=0, world_size=2, split="batch") as r0:
        take(r0, 4)
        state = r0.state_dict()
    with make(store, kind, workers, rank=1, world_size=2, split="batch") as r1:
        r1.load_state_dict(state)
        rest = take(r1, 5)
    assert all(torch.equal(a["x"], b["x"]) for a, b in zip(got[1][4:], rest, strict=True))


def test_deterministic_and_seeded(stores):
    a = stream(take(make(stores["fp16"], "resident"), 5))
    b = stream(take(make(stores["fp16"], "resident"), 5))
    c = stream(take(make(stores["fp16"], "resident", seed=4), 5))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_workers_do_not_change_the_sequence(stores):
    with make(stores["fp16"], "streaming", 0) as a, make(stores["fp16"], "streaming", 2) as b:
        for x, y in zip(take(a, 15), take(b, 15), strict=True):
            assert all(torch.equal(x[k], y[k]) for k in x)


# -- values carried with their samples ---------------------------------------------------
@pytest.mark.parametrize("kind,workers", LOADERS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "int8"])
def test_values_match_the_store(stores, kind, workers, dtype):
    """int8: x is the dequantized latent (ditdata.store.values: codes x the token's scale)
    to the bit, each variant with its own scales."""
    store = stores[dtype]
    ref = all_data(store)
    with make(store, kind, workers) as loader:
        batches = take(loader, 2 * N // B)
    b0 = batches[0]
    assert b0["x"].dtype == torch.float32 and b0["x"].shape == (B, 4, 8, 8)
    assert b0["y"].dtype == torch.int64 and b0["text_mask"].dtype == torch.bool
    assert b0["text_pooled"].dtype == torch.float32 and b0["text_tokens"].shape == (B, 5, 16)
    # by value: every x is exactly one stored latent of its sample, in the chosen variant
    lat, lat_flip = f32(values(ref, "latent")), f32(values(ref, "latent_flip"))
    for b in batches:
        i, fl = b["index"], b["flip"]
        want = torch.where(fl[:, None, None, None], lat_flip[i], lat[i])
        assert torch.equal(b["x"], want)
        assert torch.equal(b["y"], torch.from_numpy(ref["label"])[i])
        assert torch.equal(b["text_pooled"], f32(ref["text_pooled"])[i])
        assert torch.equal(b["text_tokens"], f32(ref["text_tokens"])[i])
        assert torch.equal(b["text_mask"], torch.from_numpy(ref["text_mask"])[i])
    # and by key: one sample's x is its stored latent
    i, fl = int(batches[0]["index"][0]), bool(batches[0]["flip"][0])
    sample = store.sample(i)
    assert sample["key"] == ref["key"][i]
    field = "latent_flip" if fl else "latent"
    one = {k: np.asarray(v)[None] for k, v in sample.items() if k.startswith(field)}  # a read() of one sample
    assert torch.equal(batches[0]["x"][0], f32(values(one, field)[0]))
    # flip variants: both appear, and a sample gets both over a few epochs
    flips = stream(batches, "flip")
    assert 0.25 < flips.float().mean() < 0.75
    idx = stream(batches, "index")
    both = {int(j) for j in idx[flips]} & {int(j) for j in idx[~flips]}
    assert len(both) > N // 8


def test_without_index_and_flip(stores):
    """The default batch has only x and the conditioning; a store without flips never flips."""
    store = stores["wds"]
    ref = f32(all_data(store)["latent"])
    with make(store, "streaming", 2, with_index=False) as loader:
        b = next(loader)
    assert set(b) == {"x", "y", "text_pooled", "text_tokens", "text_mask"}
    rows = {tuple(r.flatten().tolist()): j for j, r in enumerate(ref)}
    assert all(tuple(r.flatten().tolist()) in rows for r in b["x"])


@pytest.mark.parametrize("kind,workers", LOADERS)
def test_fresh_draws_from_mean_and_std(stores, kind, workers):
    store = stores["meanstd"]
    ref = all_data(store)
    with make(store, kind, workers) as loader:
        batches = take(loader, 2 * N // B + 1)
    mean, std = f32(ref["mean"]), f32(ref["std"])
    mean_f, std_f = f32(ref["mean_flip"]), f32(ref["std_flip"])
    pos = 0
    for b in batches:
        e, o = divmod(pos, N)  # one rank: the epoch length is N for both loaders
        g = torch.Generator().manual_seed(data.base._seed64(3, data.base._EPS, 0, e, o))
        eps = torch.randn(b["x"].shape, generator=g)
        i, fl = b["index"], b["flip"][:, None, None, None]
        m, s = torch.where(fl, mean_f[i], mean[i]), torch.where(fl, std_f[i], std[i])
        assert torch.equal(b["x"], torch.addcmul(m, s, eps))
        pos += B
    # the same sample in two epochs: two different draws
    x = torch.cat([b["x"] for b in batches])
    idx, flips = stream(batches), stream(batches, "flip")
    j = int(idx[0])
    later = [k for k in range(N, len(idx)) if int(idx[k]) == j and flips[k] == flips[0]]
    for k in later:
        assert not torch.equal(x[0], x[k])
    z = (x - torch.where(flips[:, None, None, None], mean_f[idx], mean[idx])) / \
        torch.where(flips[:, None, None, None], std_f[idx], std[idx])
    assert abs(float(z.mean())) < 0.1 and abs(float(z.std()) - 1) < 0.1


def test_text_store_has_no_labels(tmp_path):
    info = {**INFO, "conditioning": {"type": "text", "text": {}}}
    write_store(tmp_path / "t", schema("float16", flip=False), [6, 6], info=info)
    b = next(ResidentLoader(open_store(tmp_path / "t"), batch_size=4))
    assert set(b) == {"x", "text_pooled", "text_tokens", "text_mask"}


# -- exact resume ------------------------------------------------------------------------
@pytest.mark.parametrize("kind,workers", LOADERS)
@pytest.mark.parametrize("split", [6, 7])  # batch 6 straddles epochs 0 and 1 (54 = 6 * 8 + 6)
@pytest.mark.parametrize("name", ["fp16", "meanstd", "int8"])
def test_exact_resume(stores, kind, workers, split, name):
    straight, again, state = resumed(partial(make, stores[name], kind, workers), 14, split)
    assert state["batches"] == split and state["epoch"] == split * B // N
    for want, got in zip(straight, again, strict=True):
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want)


def test_resume_in_place_and_across_ranks(stores):
    """load_state_dict on a running streaming loader restarts its workers; rank 0's state
    resumes rank 1 exactly (each rank derives its own position from the batch count)."""
    store = stores["fp16"]
    with make(store, "streaming", 2, rank=1, world_size=2) as straight:
        want = take(straight, 12)
    with make(store, "streaming", 2, rank=0, world_size=2) as r0:
        take(r0, 5)
        state = r0.state_dict()
    with make(store, "streaming", 2, rank=1, world_size=2) as r1:
        take(r1, 9)  # elsewhere; then rewind to rank 0's checkpoint
        r1.load_state_dict(state)
        got = take(r1, 7)
    assert all(torch.equal(w["x"], g["x"]) for w, g in zip(want[5:], got, strict=True))


def test_resume_skips_consumed_windows(stores, monkeypatch):
    store = stores["fp16"]
    loader = make(store, "streaming", 0)
    take(loader, 10)
    state = loader.state_dict()
    reads = []
    fresh = make(open_store(store.root), "streaming", 0)
    monkeypatch.setattr(fresh.store, "read", lambda s, **kw: reads.append(s) or store.read(s, **kw))
    fresh.load_state_dict(state)
    next(fresh)
    assert len(reads) <= 2  # one window (shuffle_window=2 units), not the epoch's earlier ones


def test_state_mismatch_is_refused(stores):
    state = make(stores["fp16"], "resident").state_dict()
    with pytest.raises(ValueError, match="streaming"):
        make(stores["fp16"], "streaming").load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size"):
        make(stores["fp16"], "resident", batch_size=4).load_state_dict(state)
    loose = make(stores["fp16"], "resident", batch_size=4)
    loose.load_state_dict(state, strict=False)
    assert loose.batches == 0 and set(state) >= {"epoch", "offset", "seed", "world_size"}


# -- choice, timing, lifetime ------------------------------------------------------------
def test_build_loader_auto(stores, monkeypatch):
    store = stores["fp16"]
    monkeypatch.setattr(data.budget, "available_memory", lambda: (10**12, "test"))
    loader = build_loader(store, batch_size=B)
    assert loader.kind == "resident" and isinstance(loader, ResidentLoader)
    assert "resident in RAM" in loader.reason and "limit 50%" in loader.reason
    need = N * data.base._Spec(store).resident_bytes
    monkeypatch.setattr(data.budget, "available_memory", lambda: (int(need * 1.5), "test"))
    loader = build_loader(store, LoaderConfig(workers=0), batch_size=B)
    assert loader.kind == "streaming" and isinstance(loader, StreamingLoader)
    assert "over the 50% limit" in loader.reason
    # the ranks of one machine share its memory
    monkeypatch.setattr(data.budget, "available_memory", lambda: (int(need * 1.5), "test"))
    assert choose_loader(store, world_size=2, local_world_size=1)[0] == "resident"
    kind, _, reason = choose_loader(store, world_size=2, local_world_size=2)
    assert kind == "streaming" and "x 2 ranks" in reason
    kind, _, reason = choose_loader(store, world_size=2, local_world_size=1, split="batch")
    assert kind == "streaming" and "whole store" in reason  # every rank holds all of it
    assert build_loader(store, LoaderConfig(kind="resident"), batch_size=B).reason.startswith("resident: requested")
    with pytest.raises(ValueError, match="unknown loader kind"):
        build_loader(store, LoaderConfig(kind="mmap"), batch_size=B)


def test_loader_settings_default_as_the_runs_data_section():
    """DataSection takes its loader defaults from LoaderConfig (dittrain run fills one from the other), but
    for the memory budget: the library's loaders have none unless asked."""
    from dittrain.config import DataSection

    d, s = DataSection(), LoaderConfig()
    assert (s.kind, s.resident_device, s.workers, s.remainder) == (d.loader, d.resident_device, d.workers,
                                                                    d.bucket_remainder)
    assert s.shuffle_window is None and d.shuffle_window == 0  # both: sized by the budget
    assert s.memory is None and d.loader_memory == "auto"


def test_available_memory_is_real():
    avail, source = data.available_memory()
    assert avail is None or avail > 0
    assert isinstance(source, str)


def test_wait_seconds_and_close(stores):
    loader = make(stores["fp16"], "streaming", 2)
    assert loader.wait_seconds == 0
    take(loader, 3)
    procs = list(loader._procs)
    assert loader.wait_seconds > 0 and all(p.is_alive() for p in procs)
    loader.close()
    assert not any(p.is_alive() for p in procs)
    assert loader.batches == 3  # close keeps the position; next() restarts the workers
    assert next(loader)["x"].shape == (B, 4, 8, 8)
    loader.close()


def test_worker_failure_is_reported(tmp_path):
    write_store(tmp_path / "s", schema("float16"), [10, 10])
    store = open_store(tmp_path / "s")
    loader = StreamingLoader(store, batch_size=4, workers=2, shuffle_window=1)
    shutil.rmtree(store.shards[1].path)
    with pytest.raises(RuntimeError, match="worker .* failed"):
        take(loader, 10)
    loader.close()


def test_bad_arguments(stores):
    with pytest.raises(ValueError, match="rank"):
        make(stores["fp16"], "resident", rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        make(stores["fp16"], "resident", batch_size=0)
    with pytest.raises(ValueError, match="cuda"):
        ResidentLoader(stores["fp16"], batch_size=4, resident_device="cuda")


def test_shard_data_is_what_the_store_holds(stores):
    """Guard for the by-value checks above: the fixture is storeutil's deterministic data."""
    tensors, _ = shard_data(schema("float16"), 0, SIZES[0])
    assert np.array_equal(all_data(stores["fp16"])["latent"][:SIZES[0]], tensors["latent"])


# -- CUDA (skipped without a GPU): pinned copies, lookahead, GPU-resident, device eps -----
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@each_cuda_loader
def test_cuda_batches_equal_cpu_batches(stores, kind, workers, on_cuda):
    with make(stores["fp16"], kind, workers) as cpu, make(stores["fp16"], kind, workers, **on_cuda) as gpu:
        for want, got in zip(take(cpu, 15), take(gpu, 15), strict=True):
            assert got["x"].is_cuda and got["x"].dtype == torch.float32
            assert all(torch.equal(want[k], got[k].cpu()) for k in want)


@each_cuda_loader
def test_cuda_exact_resume_with_fresh_draws(stores, kind, workers, on_cuda):
    new = partial(make, stores["meanstd"], kind, workers, **on_cuda)
    straight, again, _ = resumed(new, 12, 7, keep=lambda b: b["x"].cpu())
    assert all(torch.equal(w, g) for w, g in zip(straight, again, strict=True))
    assert not torch.equal(straight[0], straight[7])


@cuda
def test_auto_resident_on_gpu(stores):
    loader = build_loader(stores["fp16"], LoaderConfig(resident_device="cuda"), batch_size=B, device="cuda")
    assert loader.kind == "resident" and loader.resident_device.type == "cuda"
    assert "free GPU memory" in loader.reason
    assert next(loader)["x"].is_cuda


@pytest.mark.parametrize(("given", "want"), [(None, "1"), ("0", "0")])
def test_dittrain_puts_large_cpu_tensors_on_huge_pages_unless_told_otherwise(given, want):
    """The dittrain command sets torch's THP_MEM_ALLOC_ENABLE=1 before torch is imported (host
    batches of wide latents on transparent huge pages: bench/latent_loader.py); a user's own value wins."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | (
        {"THP_MEM_ALLOC_ENABLE": given} if given else {})
    code = ("import os, sys, dittrain.cli; assert 'torch' not in sys.modules; "
            "print(os.environ['THP_MEM_ALLOC_ENABLE'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == want, out.stderr
