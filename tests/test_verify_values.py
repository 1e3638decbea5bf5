"""Values a store or feature set must not hold: int8 quantization refuses NaN and inf (it
would store them as 0), and `ditdata verify` reports NaN/inf of feature sets as faults and
tokens that are exactly zero in every dimension as warnings."""

from __future__ import annotations

import numpy as np
import pytest
from cliutil import ditdata as cli
from cliutil import raises_one_line
from storeutil import LABELLED, add_features, bucketed_store, make_store, schema, tiny_data, write_store

from ditdata.store import StoreError, open_features, open_store, quantize


@pytest.mark.parametrize("bad, counts", [(np.nan, "1 NaN and 0 inf"), (np.inf, "0 NaN and 1 inf"),
                                         (-np.inf, "0 NaN and 1 inf")])
def test_quantize_refuses_non_finite_values(bad, counts):
    x = np.random.default_rng(0).standard_normal((2, 4, 8)).astype(np.float32)
    x[1, 2, 3] = bad
    message = raises_one_line(StoreError, lambda: quantize(x))
    assert f"{counts} value(s) of 64" in message and "int8 cannot store them" in message
    x[1, 2, 3] = 0.5  # the same tokens, finite: quantized as always
    q, scale = quantize(x)
    assert q.dtype == np.int8 and np.isfinite(scale).all() and scale[1, 2] == np.float32(np.abs(x[1, 2]).max() / 127)


# ------------------------------------------------------------------ ditdata verify


def _feature_set(monkeypatch, root, dtype: str, tamper) -> str:
    """A store (3 shards of 8, keys SHARD-i) with feature set "f" (16 tokens x 8 dims of
    `dtype`, with flips) written by FeatureWriter, tamper(tensors) applied to shard 00001's
    features first; the path of that feature shard."""
    import storeutil

    clean = storeutil.feature_data

    def tampered(store, name, *args, **kw):
        t, c = clean(store, name, *args, **kw)
        if name == "00001":
            tamper(t)
        return t, c

    monkeypatch.setattr(storeutil, "feature_data", tampered)
    make_store(root, n=24, shards=3)
    add_features(root, "f", tokens=16, dims=8, dtype=dtype)
    return str(open_features(open_store(root), "f").shard("00001").path)


def _warnings(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ln.startswith("WARNING ")]


def _passes_with(root) -> tuple[list[str], str]:
    """`ditdata verify ROOT` exits 0: its WARNING lines and its output."""
    r = cli("verify", root, "-q")
    assert r.exit_code == 0, r.output
    return _warnings(r.output), r.output


@pytest.mark.parametrize(("dtype", "field", "row"), [("float16", "feat", 3), ("int8", "feat_scale", 2)])
def test_a_stored_nan_in_a_feature_set_is_a_fault(tmp_path, monkeypatch, dtype, field, row):
    """A NaN in a float16 feature set's values, or in an int8 set's per-token scale: a FAULT line naming
    the feature shard's file, the field, the row and its key; exit 1."""
    def nan(t):  # one value: feat (token 5, dim 2) or feat_scale (token 7)
        t[field][(row, 5, 2) if field == "feat" else (row, 7)] = np.nan

    path = _feature_set(monkeypatch, tmp_path / "s", dtype, nan)
    r = cli("verify", tmp_path / "s", "-q")
    assert r.exit_code == 1, r.output
    assert (f"FAULT {path}: field '{field}' holds non-finite values (NaN/inf) in 1 sample(s), the first at row "
            f"{row} (key '1-{row}')") in r.output
    assert "1 fault(s) found" in r.output and not _warnings(r.output)


def test_int8_features_all_zero_are_a_warning(tmp_path, monkeypatch):
    def zero(t):  # what an encoder's NaN became before quantize() refused it: codes 0, scale 1
        t["feat"][:] = 0
        t["feat_scale"][:] = 1
        t["feat_flip"][4, 9] = 0  # one token of the flips, whatever its scale

    path = _feature_set(monkeypatch, tmp_path / "s", "int8", zero)
    warnings, output = _passes_with(tmp_path / "s")
    assert warnings == [
        f"WARNING {path}: field 'feat': 128 of 128 tokens are exactly zero in every dimension, the first in row 0 "
        "(key '1-0') (an encoder that gave NaN stored as zeros?)",
        f"WARNING {path}: field 'feat_flip': 1 of 128 tokens are exactly zero in every dimension, the first in "
        "row 4 (key '1-4') (an encoder that gave NaN stored as zeros?)"]
    assert output.strip().endswith("OK (24 samples verified; feature sets f; 2 warning(s))")


def _zeroed(data, kind: str):
    """`data` (a storeutil generator) with latent positions of shard 1 zeroed: 3 whole
    positions (every channel) and one in all channels but one (not a zero token)."""
    def zeroed(sch, index, n):
        t, c = data(sch, index, n)
        if index == 1:
            x = t["latent" if kind == "sample" else "mean"]
            x[1, :, 2, 3] = 0
            x[4, :, 0, :2] = 0
            x[2, 1:, 5, 5] = 0
            if kind == "mean_std":
                t["std"][:, :, 7, 7] = 0  # std has no tokens: not counted
        return t, c

    return zeroed


@pytest.mark.parametrize(("kind", "bucketed"), [("sample", False), ("mean_std", False), ("sample", True)])
def test_zero_latent_positions_are_a_warning(tmp_path, monkeypatch, kind, bucketed):
    """3 latent positions of shard 1 zero in every channel: one WARNING naming the shard, the field and the
    count (of a plain store, or of the bucket that holds them), exit 0."""
    if bucketed:
        import storeutil

        clean = storeutil.bucket_data
        monkeypatch.setattr(storeutil, "bucket_data", lambda seed, name: _zeroed(clean(seed, name), "sample")
                            if name == "32x16" else clean(seed, name))
        bucketed_store(tmp_path / "s", {(16, 16): 5, (32, 16): 10}, shards=2)  # latents (3, 16, 32)
        shard, tokens, key = open_store(tmp_path / "s").bucket("32x16").store.shard(1), 2560, "32x16/1-1"
    else:
        sch = schema(shape=(4, 8, 8), kind=kind, flip=True, text=False, columns=LABELLED)
        write_store(tmp_path / "s", sch, [6, 6], data=_zeroed(tiny_data(0), kind))
        shard, tokens, key = open_store(tmp_path / "s").shard(1), 384, "k1"
    field = "latent" if kind == "sample" else "mean"
    warnings, output = _passes_with(tmp_path / "s")
    assert warnings == [
        f"WARNING {shard.path}: field {field!r}: 3 of {tokens} tokens are exactly zero in every dimension, the "
        f"first in row 1 (key {key!r}) (an encoder that gave NaN stored as zeros?)"]
    assert output.strip().endswith("; 1 warning(s))")


@pytest.mark.parametrize("dtype", ["int8", "float16"])
def test_a_clean_store_and_feature_set_warn_of_nothing(tmp_path, dtype):
    make_store(tmp_path / "s", n=24, shards=3)
    add_features(tmp_path / "s", "f", dtype=dtype)
    r = cli("verify", tmp_path / "s", "-q")
    assert r.exit_code == 0 and "WARNING" not in r.output, r.output
    assert r.output.strip().endswith("OK (24 samples verified; feature sets f)")
    warnings: list[str] = []
    assert open_store(tmp_path / "s", features="f").verify(warnings=warnings) == [] and warnings == []
