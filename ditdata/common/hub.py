"""The local Hugging Face hub cache: the one place ditdata looks for hub models (the
autoencoders of ditdata/vae.py, the CLIP weights of ditdata/clip.py), and the command that
fills it on a machine with internet (download_command). Nothing here downloads."""

from __future__ import annotations

import os
import shlex
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


def download_command(repo_id: str, *files: str, include: str | None = None, revision: str | None = None) -> str:
    """The shell command that puts `repo_id` (all of it, the named files, or those matching
    the `include` glob) into the hub cache: `hf download`, the CLI that huggingface_hub
    installs (it replaced `huggingface-cli`, which current releases no longer ship)."""
    args = ["hf", "download", repo_id, *files]
    if include:
        args += ["--include", include]
    if revision:
        args += ["--revision", revision]
    return shlex.join(args)
