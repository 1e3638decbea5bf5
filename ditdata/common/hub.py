"""The local Hugging Face hub cache: the one place ditdata looks for hub models (the
autoencoders of ditdata/vae.py, the CLIP weights of ditdata/clip.py). Nothing here
downloads."""

from __future__ import annotations

import os
from pathlib import Path

from ditdata.common.cache import xdg_cache_home


def hub_cache_dir() -> Path:
    """The hub cache folder as huggingface_hub resolves it, read from the environment at
    call time (its constants are frozen when it is imported): $HF_HUB_CACHE, else
    $HUGGINGFACE_HUB_CACHE (the older name), else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return _expand(os.environ[var])
    home = os.environ.get("HF_HOME")
    if not home:
        home = str(xdg_cache_home() / "huggingface")
    return _expand(home) / "hub"


def _expand(path: str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(path)))
