"""ditkit's own cache base: $XDG_CACHE_HOME/ditkit, else ~/.cache/ditkit (read at call time)."""

from __future__ import annotations

import os
from pathlib import Path


def xdg_cache_home() -> Path:
    """$XDG_CACHE_HOME, else ~/.cache: the base of every cache the tools keep."""
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"))


def cache_dir(*parts: str) -> Path:
    """A folder under ditkit's cache, e.g. cache_dir("stores") for stores at URLs."""
    return xdg_cache_home().joinpath("ditkit", *parts)
