"""dittrain.data with a feature set: batch["feat"] (and "feat_scale") hold the REPA targets of
each row's sample and chosen flip variant as stored, on the loader's device, and targets(batch)
dequantizes them; the data stream is the one
without the feature set; resume is exact; the memory figures count the targets."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import storeutil as su
import torch

from ditdata.store import FeatureSchema, FeatureWriter, dequantize, open_store
from dittrain.data import LoaderError, ResidentLoader, StreamingLoader, choose_loader, plan_streaming_memory
from dittrain.data import targets as data_targets

SIZES, B = su.LOADER_SIZES, su.LOADER_BATCH  # 54 samples, an empty shard on purpose; batches of 8
N = sum(SIZES)
TOKENS, DIMS = 16, 32  # int8: 576 bytes a variant, about twice a latent of 4x8x8 fp16
SETS = {"int8": "f8", "float16": "f16"}
make = partial(su.new_loader, seed=5)  # make(store, kind, workers=0, **kw): storeutil.new_loader


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """Stores (sample latents, mean/std) with flips, each with an int8 and an fp16 feature set."""
    base = tmp_path_factory.mktemp("featured")
    out = {}
    for name, kind in [("sample", "sample"), ("meanstd", "mean_std")]:
        root = base / name
        su.write_store(root, su.schema("float16", kind=kind), SIZES, chunk_samples=4)
        for dtype, set_name in SETS.items():
            su.add_features(root, set_name, tokens=TOKENS, dims=DIMS, dtype=dtype)
        out[name] = root
    return out


def targets(root, set_name) -> dict[bool, torch.Tensor]:
    """{flipped: (N, T, D) float32}: every sample's dequantized target of either variant,
    in global index order, as the store's own reader and dequantize() give them."""
    fs = open_store(root, features=set_name)
    parts = [fs.read(s, [f for f in fs.schema.tensors if f.startswith("feat")]) for s in fs.shards]
    cat = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return {flip: torch.from_numpy(dequantize(cat[f"feat{suffix}"], cat.get(f"feat{suffix}_scale")))
            for flip, suffix in [(False, ""), (True, "_flip")]}


# -- the targets are those of the row's sample and variant ------------------------------
@pytest.mark.parametrize("kind,workers", su.LOADERS)
@pytest.mark.parametrize("dtype", list(SETS))
def test_targets_follow_each_rows_sample_and_flip(roots, kind, workers, dtype):
    want = targets(roots["sample"], SETS[dtype])
    assert not torch.equal(want[False], want[True])  # the mirrored grid: a wrong variant shows
    flips = []
    with make(open_store(roots["sample"], features=SETS[dtype]), kind, workers) as loader:
        for batch in su.take(loader, 2 * N // B + 1):  # past an epoch end
            feat, idx, flip = data_targets(batch), batch["index"], batch["flip"]
            assert feat.dtype == torch.float32 and feat.shape == (B, TOKENS, DIMS)
            assert batch["feat"].dtype == (torch.int8 if dtype == "int8" else torch.float16)
            assert ("feat_scale" in batch) == (dtype == "int8")
            for row in range(B):
                assert torch.equal(feat[row], want[bool(flip[row])][idx[row]]), (row, int(idx[row]))
            flips += flip.tolist()
    assert any(flips) and not all(flips)


@pytest.mark.parametrize("kind,workers", su.LOADERS)
@pytest.mark.parametrize("name", ["sample", "meanstd"])
def test_the_stream_is_the_one_without_targets(roots, kind, workers, name):
    """No randomness is drawn for the targets: x (fresh draws included), y, index and flip
    are bit-identical with and without the feature set."""
    with make(open_store(roots[name]), kind, workers) as plain, \
            make(open_store(roots[name], features="f8"), kind, workers) as featured:
        for a, b in zip(su.take(plain, 10), su.take(featured, 10), strict=True):
            assert "feat" not in a and set(b) == set(a) | {"feat", "feat_scale"}
            assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind,workers", su.LOADERS)
def test_exact_resume_with_targets(roots, kind, workers):
    store = open_store(roots["meanstd"], features="f8")
    # batch 7 straddles epochs 0 and 1 (54 = 6 * 8 + 6)
    straight, again, _ = su.resumed(partial(make, store, kind, workers), 14, 7)
    for want, got in zip(straight, again, strict=True):
        assert want.keys() == got.keys() and "feat" in got
        assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("kind,workers", [("resident", 0), ("streaming", 0)])
def test_split_batch_carries_the_targets(roots, kind, workers):
    store = open_store(roots["sample"], features="f16")
    whole, halves = su.batch_split(partial(make, store, kind, workers), 4)
    for w, a, b in zip(whole, *halves, strict=True):
        assert torch.equal(w["feat"], torch.cat([a["feat"], b["feat"]]))


def test_feature_set_without_flipped_twins_is_refused(tmp_path):
    root = tmp_path / "s"
    su.write_store(root, su.schema("float16"), [6, 4])
    store = open_store(root)
    w = FeatureWriter(store, "noflip", schema=FeatureSchema.build(TOKENS, DIMS, "int8", False),
                      info={"encoder": {"name": "test"}, "storage": {"dtype": "int8"}})
    for s in store.shards:
        tensors, columns = su.feature_data(store, s.name, TOKENS, DIMS, "int8")
        w.write_shard(s.name, {k: v for k, v in tensors.items() if "flip" not in k}, columns)
    w.finalize()
    with pytest.raises(LoaderError, match="no feat_flip.*rerun `ditdata features`"):
        ResidentLoader(open_store(root, features="noflip"), batch_size=B)


# -- memory: held in the stored dtype, and counted ---------------------------------------
@pytest.mark.parametrize("dtype", list(SETS))
def test_resident_holds_the_stored_dtype_and_counts_it(roots, dtype):
    plain = ResidentLoader(open_store(roots["sample"]), batch_size=B)
    featured = ResidentLoader(open_store(roots["sample"], features=SETS[dtype]), batch_size=B)
    held = featured._block.picked
    assert held["feat"].dtype == (torch.int8 if dtype == "int8" else torch.float16)
    assert held["feat"].shape == (N, 2, TOKENS, DIMS)
    per_variant = TOKENS * DIMS * (1 if dtype == "int8" else 2) + (4 * TOKENS if dtype == "int8" else 0)
    assert featured.spec.target_bytes == 2 * per_variant
    assert featured.spec.resident_bytes == plain.spec.resident_bytes + 2 * per_variant
    assert featured.nbytes == plain.nbytes + N * 2 * per_variant
    _, _, reason = choose_loader(featured.store, kind="resident")
    assert "of it REPA targets" in reason


def test_streaming_budget_counts_the_targets(roots):
    """A window that fits the budget without the targets is refused with them; left to the
    budget, window and prefetch are sized with them; the startup line says what they take."""
    plain_store, featured_store = open_store(roots["sample"]), open_store(roots["sample"], features="f8")
    plain = StreamingLoader(plain_store, batch_size=B, workers=2, shuffle_window=4)
    featured = StreamingLoader(featured_store, batch_size=B, workers=2, shuffle_window=4)
    assert featured.memory_estimate > plain.memory_estimate
    assert featured.memory_plan.targets > 0 and plain.memory_plan.targets == 0
    budget = plain.memory_estimate + 1024
    assert StreamingLoader(plain_store, batch_size=B, workers=2, shuffle_window=4, memory=budget).shuffle_window == 4
    with pytest.raises(LoaderError, match=r"shuffle window 4 .*REPA targets, 1.1 KiB/sample\).*--shuffle-window"):
        StreamingLoader(featured_store, batch_size=B, workers=2, shuffle_window=4, memory=budget)
    two = StreamingLoader(featured_store, batch_size=B, workers=2, shuffle_window=2).memory_estimate
    sized = StreamingLoader(featured_store, batch_size=B, workers=2, memory=two)
    assert sized.memory_estimate <= two and (sized.shuffle_window, sized.prefetch) != (4, 4)
    fitted = StreamingLoader(featured_store, batch_size=B, workers=2, memory=featured.memory_estimate)
    assert fitted.shuffle_window == 4
    assert "window 4, prefetch 4, memory ~" in fitted.reason and "targets 1.1 KiB/sample, ~" in fitted.reason
    assert "targets" not in plain.reason


def test_target_share_of_the_estimate(roots):
    """The targets' share is what the estimate grows by when a store gains its feature set."""
    plain, featured = (StreamingLoader(s, batch_size=B, workers=2, shuffle_window=2)
                       for s in (open_store(roots["sample"]), open_store(roots["sample"], features="f8")))
    grows = featured.memory_estimate - plain.memory_estimate
    share = featured.memory_plan.targets
    # the slots round to 64 bytes per field, the rest is exact; the read piece is whole shards here
    assert abs(grows - share) <= 64 * 2 * 2 * 4, (grows, share)
    assert plan_streaming_memory(featured.spec, [20, 13], None, workers=0, window=1, prefetch=1,
                                 slot_bytes=featured._slot_bytes, batch_size=B).targets > 0


# -- on a GPU: the same targets, dequantized there ---------------------------------------
@su.each_cuda_loader
def test_cuda_targets_equal_cpu_targets(roots, kind, workers, on_cuda):
    store = open_store(roots["meanstd"], features="f8")
    with make(store, kind, workers) as cpu, make(store, kind, workers, **on_cuda) as gpu:
        for want, got in zip(su.take(cpu, 9), su.take(gpu, 9), strict=True):
            assert got["feat"].is_cuda and data_targets(got).dtype == torch.float32
            assert torch.equal(data_targets(want), data_targets(got).cpu()) and torch.equal(want["index"], got["index"].cpu())
