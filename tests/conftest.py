"""Shared test fixtures: paths to offline assets and small real images."""

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


@pytest.fixture
def taef2_dir() -> Path:
    if not (TAEF2_DIR / "taef2_encoder.pth").is_file():
        pytest.skip(f"TAEF2 weights not found in {TAEF2_DIR} (set DITKIT_SHARED)")
    return TAEF2_DIR
