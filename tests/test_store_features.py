"""Feature sets, the contract (ditdata/store/features.py): written row for row beside a
store's latents, resumable, checked against the store, quantized per token, read locally,
through FeaturedStore and over http."""

from __future__ import annotations

import functools
import http.server
import json
import shutil

import numpy as np
import pytest
from cliutil import http_server
from storeutil import CREATED_AT, add_features, feature_data, make_store

from ditdata.store import FeatureSchema, FeatureWriter, StoreError, dequantize, open_features, open_store, quantize
from ditdata.store.writer import StoreWriter


@pytest.fixture
def store(tmp_path):
    return make_store(tmp_path / "store", n=24, shards=3)


def test_quantize_is_symmetric_per_token_and_close():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 16, 768)).astype(np.float32) * rng.uniform(0.1, 30, (4, 16, 1)).astype(np.float32)
    x[0, 3] = 0.0  # an all-zero token: scale 1, codes 0
    q, scale = quantize(x)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (4, 16)
    assert np.abs(q).max() == 127 and q.min() >= -127
    assert scale[0, 3] == 1.0 and not q[0, 3].any()
    np.testing.assert_allclose(scale[1, 2], np.abs(x[1, 2]).max() / 127, rtol=1e-6)
    y = dequantize(q, scale)
    err = np.abs(y - x).max(axis=-1)
    assert (err <= scale / 2 * 1.0001).all()  # rounding: at most half a step per value
    nz = np.linalg.norm(x, axis=-1) > 0
    cos = (x * y).sum(-1)[nz] / (np.linalg.norm(x, axis=-1) * np.linalg.norm(y, axis=-1))[nz]
    assert cos.min() >= 0.999
    np.testing.assert_array_equal(dequantize(x.astype(np.float16), None), x.astype(np.float16).astype(np.float32))


def test_feature_set_beside_the_latents(store):
    before = open_store(store)
    identity, manifest_before = before.identity, json.loads((store / "manifest.json").read_text())
    path = add_features(store, "dino", tokens=16, dims=8, dtype="int8")
    after = open_store(store)
    assert after.identity == identity  # the latents did not change: neither does their identity
    m = json.loads((store / "manifest.json").read_text())
    assert {k: v for k, v in m.items() if k != "features"} == manifest_before
    entry = m["features"]["dino"]
    assert entry["path"] == "features/dino" and (entry["tokens"], entry["dims"], entry["dtype"]) == (16, 8, "int8")
    fs = open_features(after, "dino")
    assert fs.root == path and entry["identity"] == fs.identity and len(fs) == len(after)
    assert (fs.tokens, fs.dims, fs.grid, fs.flip) == (16, 8, (4, 4), True)
    assert fs.manifest["store"]["identity"] == identity and fs.bytes_per_sample() == 2 * (16 * 8 + 16 * 4)
    assert fs.verify() == [] and fs.pca() is None
    # row for row: each feature row belongs to the latent row with the same key
    featured = open_store(store, features="dino")
    assert featured.identity == identity and featured.open_args() == {"root": str(store), "features": "dino"}
    for shard in featured.shards:
        got = featured.read(shard, ["key", "latent", "feat", "feat_scale", "feat_flip", "feat_flip_scale"])
        np.testing.assert_array_equal(got["latent"], after.read(shard, ["latent"])["latent"])
        want, cols = feature_data(after, shard.name, 16, 8, "int8")
        assert cols["key"] == got["key"].tolist()
        for f in want:
            np.testing.assert_array_equal(got[f], want[f])
    one = featured.sample(5)
    assert one["feat"].shape == (16, 8) and one["latent"].shape == after.latent_shape
    assert open_store(**featured.open_args()).schema == featured.schema  # what a loader's worker opens


def test_fp16_without_flips(tmp_path):
    root = make_store(tmp_path / "s", n=12, shards=2, flip=False)
    add_features(root, "f", tokens=4, dims=6, dtype="float16")
    fs = open_features(open_store(root), "f")
    assert set(fs.schema.tensors) == {"feat"} and fs.schema.tensors["feat"].dtype == "float16"
    assert fs.read(0, ["feat"])["feat"].dtype == np.float16


def test_rows_must_match_the_store_shard(store):
    s = open_store(store)
    w = FeatureWriter(s, "f", schema=FeatureSchema.build(16, 8, "int8", True), info=_info())
    tensors, cols = feature_data(s, "00000", 16, 8, "int8")
    with pytest.raises(StoreError, match="rows do not match"):
        w.write_shard("00000", {k: v[::-1] for k, v in tensors.items()}, {"key": cols["key"][::-1]})
    with pytest.raises(StoreError, match="rows do not match"):
        w.write_shard("00000", {k: v[1:] for k, v in tensors.items()}, {"key": cols["key"][1:]})
    with pytest.raises(StoreError, match="no store shard named 'nope'"):
        w.write_shard("nope", tensors, cols)
    w.write_shard("00000", tensors, cols)
    with pytest.raises(StoreError, match="feature shards not finished: 00001, 00002"):
        w.finalize()
    assert not (store / "features" / "f" / "manifest.json").exists()
    assert "features" not in json.loads((store / "manifest.json").read_text())


def test_resume_writes_only_missing_shards_and_the_same_bytes(store, tmp_path):
    s = open_store(store)
    w = FeatureWriter(s, "f", schema=FeatureSchema.build(16, 8, "int8", True), info=_info())
    w.write_shard("00001", *feature_data(s, "00001", 16, 8, "int8"))
    mtime = (store / "features/f/shards/00001.json").stat().st_mtime_ns
    # a killed writer's debris, and a fresh writer that finishes the job
    (store / "features/f/shards/.00002.zarr.tmp-dead").mkdir()
    add_features(store, "f")
    assert (store / "features/f/shards/00001.json").stat().st_mtime_ns == mtime
    assert not list((store / "features/f/shards").glob(".*"))
    twin = make_store(tmp_path / "twin", n=24, shards=3)
    add_features(twin, "f")
    assert _digests(store / "features/f") == _digests(twin / "features/f")
    # other settings while finished shards exist: refused, as for a store
    with pytest.raises(StoreError, match="different settings"):
        FeatureWriter(open_store(store), "f", schema=FeatureSchema.build(16, 8, "float16", True), info=_info())


def test_a_rewritten_store_shard_makes_its_features_stale(store):
    add_features(store, "f")
    # the store gains a shard (encode appends): its identity changes, the set no longer covers it
    from storeutil import LABELLED, latent_data, pixels_info, schema

    w = StoreWriter(store, schema=schema(shape=(3, 8, 8), flip=True, text=False, columns=LABELLED),
                    info=pixels_info(8, __import__("storeutil").class_conditioning(["a", "b", "c"])))
    w.write_shard("00003", *latent_data(7)(w.schema, 3, 8))
    w.finalize(created_at=CREATED_AT)
    grown = open_store(store)
    assert "features" not in grown.manifest  # a new manifest: its feature sets must be brought up to date
    fw = FeatureWriter(grown, "f", schema=FeatureSchema.build(16, 8, "int8", True), info=_info())
    assert [fw.done(n) for n in ("00000", "00001", "00002", "00003")] == [True, True, True, False]
    with pytest.raises(StoreError, match="no feature set 'f'"):
        open_store(store, features="f")
    add_features(store, "f")
    assert len(open_store(store, features="f")) == 32


def test_a_set_for_another_store_is_refused(store, tmp_path):
    add_features(store, "f")
    other = make_store(tmp_path / "other", n=24, shards=3, seed=5)
    # copy the feature set and its entry into a store with other latents (other keys' values)
    shutil.copytree(store / "features", other / "features")
    m = json.loads((other / "manifest.json").read_text())
    m["features"] = json.loads((store / "manifest.json").read_text())["features"]
    (other / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError, match="computed for another version of the store"):
        open_store(other, features="f")


def test_damaged_feature_manifest_is_named(store):
    add_features(store, "f")
    p = store / "features/f/manifest.json"
    m = json.loads(p.read_text())
    m["fields"]["tensors"]["feat_scale"]["dtype"] = "float16"
    p.write_text(json.dumps(m))
    with pytest.raises(StoreError, match=r"features/f/manifest.json: invalid fields: feat_scale"):
        open_store(store, features="f")
    del m["encoder"]
    p.write_text(json.dumps(m))
    with pytest.raises(StoreError, match=r"missing keys \['encoder'\]"):
        open_store(store, features="f")


def test_verify_finds_a_corrupt_feature_chunk(store):
    add_features(store, "f")
    chunk = next(p for p in (store / "features/f/shards/00001.zarr/feat/c").rglob("*") if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))
    faults = open_features(open_store(store), "f").verify()
    assert len(faults) == 1 and "00001.zarr/feat" in faults[0] and "checksum mismatch" in faults[0]


def test_names_are_checked(store):
    s = open_store(store)
    for bad in ("", "../x", ".hidden", "a/b", "x" * 65):
        with pytest.raises(StoreError, match="feature set name"):
            FeatureWriter(s, bad, schema=FeatureSchema.build(4, 4, "int8", True), info=_info())


def test_schema_rules():
    with pytest.raises(ValueError, match="feat_scale"):
        FeatureSchema(tensors={"feat": FeatureSchema.build(4, 4, "int8", False).tensors["feat"]},
                      columns={"key": "string"})
    with pytest.raises(ValueError, match="exactly one column"):
        FeatureSchema(tensors=dict(FeatureSchema.build(4, 4, "float16", False).tensors),
                      columns={"key": "string", "label": "int64"})
    s = FeatureSchema.build(9, 5, "int8", True)
    assert FeatureSchema.from_json(s.to_json()) == s and (s.tokens, s.dims, s.flip) == (9, 5, True)


class _Files(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_feature_set_read_over_http(store, tmp_path):
    pytest.importorskip("fsspec")
    pytest.importorskip("aiohttp")
    add_features(store, "f")
    www = tmp_path / "www"
    shutil.copytree(store, www / "s")
    with http_server(functools.partial(_Files, directory=str(www))) as base:
        remote = open_store(f"{base}/s", features="f", cache_dir=tmp_path / "cache")
        local = open_store(store, features="f")
        assert remote.identity == local.identity and remote.feature_set.identity == local.feature_set.identity
        for shard in local.shards:
            a, b = local.read(shard), remote.read(shard.index)
            assert a.keys() == b.keys()
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])
        # a loader's worker reopens it from its open_args (the mirror, same identities)
        again = open_store(**remote.open_args())
        assert again.feature_set.identity == local.feature_set.identity
        np.testing.assert_array_equal(again.read(2, ["feat"])["feat"], local.read(2, ["feat"])["feat"])


def _info() -> dict:
    from storeutil import FEATURE_INFO

    return FEATURE_INFO


def _digests(root) -> dict:
    from ditdata.common.files import sha256_file

    return {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "manifest.json"}
