"""Shared test fixtures: paths to offline assets, small real images, a fabricated run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# ../shared beside the checkout holds the real TAEF2 weights; CI clones may not have it.
SHARED = Path(os.environ.get("DITKIT_SHARED", REPO.parent / "shared"))
TAEF2_DIR = SHARED / "models" / "taef2"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    # Nothing may reach a model hub in tests: a missing model must fail fast, not retry.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("NO_ALBUMENTATIONS_UPDATE", "1")


@pytest.fixture(scope="module")
def class_shards(tmp_path_factory) -> Path:
    """Image shards of a class dataset: 4 real photos x 2 crops of 40 px, 2 samples per shard
    (4 shards). Module-scoped: copy it before damaging it."""
    from tiny import class_tree, fetch_tree

    root = tmp_path_factory.mktemp("class-shards")
    return fetch_tree(class_tree(root / "tree", per_class=2, size=40), root / "shards", samples_per_shard=2)


@pytest.fixture(scope="module")
def flip_store(class_shards, tmp_path_factory) -> Path:
    """A 64 px pixels store with flips of the class shards (8 samples in 4 shards), for feature sets
    (tests/test_features.py, tests/test_user_code.py). Module-scoped: copy it before changing it."""
    from ditdata.encode import EncodeConfig, encode

    out = tmp_path_factory.mktemp("flip") / "store"
    encode(EncodeConfig(shards=str(class_shards), out=str(out), vae="pixels", resolution=64, flip=True, workers=0,
                        progress=False, device="cpu"))
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A class-conditioned pixels store to train on: storeutil.make_store's defaults (48
    latents of 3x8x8 in 3 shards, classes a, b, c). Module-scoped: tests read it, never
    change it; a module's own `store` fixture replaces this one."""
    from storeutil import make_store

    return make_store(tmp_path_factory.mktemp("store") / "s")


@pytest.fixture(scope="module")
def pixel_run(tmp_path_factory) -> tuple[Path, Path]:
    """(run, store): a fabricated "trained" run (test_sample.make_run) over a one-shard 16 px
    pixels store (storeutil.tiny_store: 6 latents, classes astronaut, chelsea, coffee).
    Module-scoped: tests read it, never change it."""
    from storeutil import tiny_store
    from test_sample import make_run

    root = tmp_path_factory.mktemp("pix")
    store = tiny_store(root / "store")
    return make_run(root / "run", store), store


@pytest.fixture
def taef2_dir() -> Path:
    if not (TAEF2_DIR / "taef2_encoder.pth").is_file():
        pytest.skip(f"TAEF2 weights not found in {TAEF2_DIR} (set DITKIT_SHARED)")
    return TAEF2_DIR


@pytest.fixture
def one_thread(monkeypatch):
    """Torch on one thread, and OMP_NUM_THREADS=1 for child processes: tiny models and
    matmuls on a loaded 2-core machine run much faster (and the same) without threads."""
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
