"""A bucketed store (ditdata.store.buckets): per-bucket plain stores under a top manifest
written last; open_store opens it, the top reads no samples, identity covers every bucket."""

from __future__ import annotations

import json

import numpy as np
import pytest
from storeutil import CREATED_AT, bucketed_store, make_store

from ditdata.common import files
from ditdata.store import Bucket, BucketedStore, StoreError, StoreWriter, finalize_buckets, identity, open_store
from ditdata.store.reader import Store

SIZES = {(16, 16): 5, (24, 12): 7, (12, 24): 3}


@pytest.fixture(scope="module")
def store_root(tmp_path_factory):
    return bucketed_store(tmp_path_factory.mktemp("b") / "store", SIZES, shards=2, area=16, step=4)


def test_opens_with_its_buckets(store_root):
    store = open_store(store_root)
    assert isinstance(store, BucketedStore)
    assert [b.name for b in store.buckets] == ["12x24", "16x16", "24x12"]
    b = store.buckets[0]
    assert isinstance(b, Bucket) and b.size == (12, 24) and b.latent_shape == (3, 24, 12) and b.num_samples == 3
    assert b.store.latent_shape == (3, 24, 12) and len(b.store.shards) == 2 and b.store.buckets == ()
    assert store.num_samples == len(store) == 15 and store.shards == []
    assert store.latent_shape == (3, 16, 16)  # the square bucket's
    assert store.schema.tensors["latent"].shape == (3, 16, 16) and store.schema.flip
    assert store.conditioning.kind == "class" and store.conditioning.num_classes == 3
    m = store.manifest
    assert m["buckets"]["area"] == 16 and m["buckets"]["step"] == 4 and m["buckets"]["cropped_beyond_step"] == 0
    assert {e["name"]: e["num_samples"] for e in m["buckets"]["list"]} == {"16x16": 5, "24x12": 7, "12x24": 3}
    assert {e["name"]: e["identity"] for e in m["buckets"]["list"]} == {b.name: b.store.identity for b in store.buckets}
    keys = [k for b in store.buckets for s in b.store.shards for k in b.store.read(s, ["key"])["key"]]
    assert len(keys) == len(set(keys)) == 15


def test_stats_pool_every_bucket(store_root):
    store = open_store(store_root)
    x = np.concatenate([b.store.read(s, ["latent"])["latent"].astype(np.float64).transpose(1, 0, 2, 3).reshape(3, -1)
                        for b in store.buckets for s in b.store.shards], axis=1)
    st = store.manifest["stats"]
    assert st["count"] == x.shape[1]
    np.testing.assert_allclose(st["mean"], x.mean(1), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(st["std"], x.std(1), rtol=1e-6)


def test_top_store_reads_no_samples(store_root):
    store = open_store(store_root)
    for read in (lambda: store.read(0), lambda: store.sample(0), lambda: store.shard(0)):
        with pytest.raises(StoreError, match="is a bucketed store: read its buckets"):
            read()
    with pytest.raises(StoreError, match="a bucketed store"):
        Store(store_root)  # a reader that knows plain stores only (a remote store) refuses it in one line


def test_most_populated_bucket_without_square(tmp_path):
    store = open_store(bucketed_store(tmp_path / "s", {(8, 4): 2, (4, 8): 5}))
    assert store.latent_shape == (3, 8, 4) and store.manifest["buckets"]["area"] == 5
    assert store.manifest["buckets"]["step"] == 4


def test_text_conditioning_per_bucket(tmp_path):
    store = open_store(bucketed_store(tmp_path / "s", {(8, 8): 2, (8, 4): 3}, text={"pooled": 16, "tokens": (5, 16)}))
    assert store.conditioning.kind == "text" and set(store.empty_caption()) == {"text_pooled", "text_tokens", "text_mask"}
    row = store.bucket("8x4").store.read(0, ["text_tokens", "caption"])
    assert row["text_tokens"].shape == (3, 5, 16) and row["caption"][0] == "8x4 caption 0"


def test_identity_covers_every_bucket(tmp_path):
    a = open_store(bucketed_store(tmp_path / "a", SIZES))
    b = open_store(bucketed_store(tmp_path / "b", SIZES))
    c = open_store(bucketed_store(tmp_path / "c", SIZES, seed=1))  # other latents, same counts
    assert identity(a.manifest) == identity(b.manifest) == a.identity
    assert c.identity != a.identity


def test_a_changed_bucket_is_refused(tmp_path):
    root = bucketed_store(tmp_path / "s", SIZES)
    bucket = open_store(root).bucket("16x16").store
    w = StoreWriter(bucket.root, schema=bucket.schema, info={k: bucket.manifest[k] for k in ("vae", "image",
                                                                                            "conditioning")})
    t = {f: bucket.read(0, [f])[f] for f in bucket.schema.tensors}
    w.write_shard("extra", t, {"key": [f"x{i}" for i in range(5)], "label": [0] * 5})
    w.finalize(created_at=CREATED_AT)  # the bucket changed; the top manifest not rewritten yet
    with pytest.raises(StoreError, match="16x16 is not the one .* lists"):
        open_store(root)
    info = json.loads(json.dumps({k: open_store(bucket.root).manifest[k] for k in ("vae", "image", "conditioning")}))
    m = finalize_buckets(root, info, area=16, step=4, created_at=CREATED_AT)
    assert m["num_samples"] == 20 and open_store(root).bucket("16x16").num_samples == 10


def test_finalize_refuses_mixed_or_unfinished_buckets(tmp_path):
    root = bucketed_store(tmp_path / "s", {(8, 8): 2})
    info = {k: open_store(root).manifest[k] for k in ("vae", "image", "conditioning")}
    before = (root / "manifest.json").read_bytes()
    (root / "buckets" / "8x4" / "shards").mkdir(parents=True)  # a bucket whose encode has not finished
    with pytest.raises(StoreError, match="8x4.*manifest.json: missing"):
        finalize_buckets(root, info, area=8, step=4)
    (root / "buckets" / "8x4" / "shards").rmdir()
    (root / "buckets" / "8x4").rmdir()
    with pytest.raises(StoreError, match="other settings \\(image differ\\)"):
        finalize_buckets(root, {**info, "image": {"resolution": 9}}, area=8, step=4)
    (root / "buckets" / "wide").mkdir()
    with pytest.raises(StoreError, match="not a bucket name"):
        finalize_buckets(root, info, area=8, step=4)
    assert (root / "manifest.json").read_bytes() == before  # nothing written by a refusal


@pytest.mark.parametrize("damage,what", [
    (lambda b: b.update(step=0), "area, step"),
    (lambda b: b["list"][0].update(name="8x9"), "buckets.list #0"),
    (lambda b: b["list"][1].update(name=b["list"][0]["name"], size=b["list"][0]["size"]), "buckets.list #1"),
    (lambda b: b["list"][0].update(path="../elsewhere"), "buckets.list #0"),
    (lambda b: b["list"][0].update(num_samples=99), "but the buckets hold"),
    (lambda b: b.update(list=[]), "not empty"),
])
def test_damaged_buckets_section_is_one_line(tmp_path, damage, what):
    root = bucketed_store(tmp_path / "s", SIZES)
    m = files.read_json(root / "manifest.json")
    damage(m["buckets"])
    files.write_json_atomic(root / "manifest.json", m)
    with pytest.raises(StoreError, match=what) as e:
        open_store(root)
    assert "\n" not in str(e.value)


def test_verify_checks_every_bucket(tmp_path):
    root = bucketed_store(tmp_path / "s", SIZES)
    assert open_store(root, verify=True).verify() == []
    victim = max((p for p in (root / "buckets" / "24x12" / "shards").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    faults = open_store(root).verify()
    assert len(faults) == 1 and "24x12" in faults[0] and "checksum" in faults[0]


def test_plain_store_has_no_buckets(tmp_path):
    store = open_store(make_store(tmp_path / "plain"))
    assert type(store) is Store and store.buckets == () and "buckets" not in store.manifest
