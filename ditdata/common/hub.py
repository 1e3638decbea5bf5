"""The local Hugging Face hub cache: the one place ditdata looks for hub models (the
autoencoders of ditdata/autoencoders/kinds.py, the feature encoders of ditdata/features/encoders.py, the CLIP
weights of ditdata/clip.py), the command that fills it on a machine with internet
(download_command) and the one wording of "not in the cache" (not_cached_message); and what a
save_pretrained folder holds: its weight files (saved_weights, required_weights) and its model
type (saved_model_type). Nothing here downloads."""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from ditdata.common.cache import xdg_cache_home
from ditdata.common.errors import UserError
from ditdata.common.files import read_json


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


def not_cached_message(subject: str, cache: Path, command: str, detail: str, instead: str) -> str:
    """`subject` (the model, as its loader names it) is not in the hub cache `cache`: what to run
    where there is internet (`command`) and the local alternative (`instead`, e.g. "a local
    diffusers directory (--vae DIR)"); `detail` (why the lookup failed) is shown when given."""
    return (f"{subject} is not in the local Hugging Face cache {cache}{' (' + detail + ')' if detail else ''} "
            f"and nothing is downloaded here: on a machine with internet run `{command}` and copy "
            "~/.cache/huggingface to this machine, or point HF_HOME / HF_HUB_CACHE at such a cache, "
            f"or pass {instead}")


@dataclass(frozen=True)
class HubPreset:
    """A named model of a loader's registry (captioners, feature encoders add their own fields):
    the name a command takes and the hub repository it is fetched from."""

    name: str
    repo_id: str


# a hub repository id as the loaders take one: org/name
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def model_source(name, kind: str, presets, error: type[Exception] = UserError) -> tuple[str, str]:
    """(where it comes from, NAME stripped) of a model NAME as the loaders of captioners and
    feature encoders take it, tried in this order: "python" (python:MODULE:FUNCTION), "preset"
    (a key of `presets`), "directory" (an existing one), "hub" (org/name, not a path that
    exists). Anything else is `error` "unknown KIND 'NAME'" listing what it could have been."""
    from ditdata.common.usercode import PYTHON_PREFIX

    s = str(name).strip()
    if s.startswith(PYTHON_PREFIX):
        return "python", s
    if s in presets:
        return "preset", s
    if Path(s).expanduser().is_dir():
        return "directory", s
    if HUB_ID.fullmatch(s) and ".." not in s and not Path(s).exists():
        return "hub", s
    raise error(f"unknown {kind} {s!r}: not a preset ({', '.join(presets)}), not an existing directory, not a hub "
                "id (org/name), not python:MODULE:FUNCTION")


def cached_snapshot(repo_id: str, kind: str, name: str, extra: str, instead: str,
                    error: type[Exception] = UserError) -> Path:
    """The snapshot folder of hub repository `repo_id` in the local cache, one that holds
    config.json: never a download (nothing can be fetched at run time here). Otherwise `error`
    naming the model ("KIND 'NAME' = REPO", or "KIND REPO" for a bare hub id), the `hf download`
    command to run where there is internet, and `instead`, the local alternative; `extra`: the
    extra that brings huggingface_hub."""
    from ditdata.common.extras import require

    cache = hub_cache_dir()
    hub = require("huggingface_hub", f"{kind} {name} ({repo_id})", extra, error)
    subject = f"{kind} '{name}' = {repo_id}" if name != repo_id else f"{kind} {repo_id}"
    try:
        snap = Path(hub.snapshot_download(repo_id, cache_dir=str(cache), local_files_only=True))
    except Exception as e:  # not cached (or offline): never a download, never a retry
        raise error(not_cached_message(subject, cache, download_command(repo_id), type(e).__name__, instead)) from e
    if not (snap / "config.json").is_file():
        raise error(not_cached_message(subject, cache, download_command(repo_id),
                                       f"snapshot {snap.name} has no config.json", instead))
    return snap


def saved_weights(model_dir: Path, names: tuple[str, ...]) -> tuple[list[str], bool] | None:
    """The weight files that from_pretrained (transformers or diffusers) loads from `model_dir`,
    relative to it, and whether they are safetensors: the first of `names` found whole or
    sharded (NAME.index.json lists the shards), so list the .safetensors name first, as both
    libraries prefer it. None when there are none: the caller says what it expected."""
    for single in names:
        safe = single.endswith(".safetensors")
        if (model_dir / single).is_file():
            return [single], safe
        index = model_dir / f"{single}.index.json"
        if index.is_file():
            return sorted(set(read_json(index)["weight_map"].values())), safe
    return None


# the weight files transformers' from_pretrained loads, safetensors first (saved_weights)
TRANSFORMERS_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
SAVED_DIR_HOLDS = "a directory saved with transformers' save_pretrained holds config.json and model.safetensors"


def required_weights(model_dir: Path, names: tuple[str, ...] = TRANSFORMERS_WEIGHTS, holds: str = SAVED_DIR_HOLDS,
                     error: type[Exception] = UserError) -> tuple[list[str], bool]:
    """saved_weights, or `error` "MODEL_DIR: no NAME or NAME weights (HOLDS)", `holds` saying
    what such a folder holds (a loader that also needs e.g. a tokenizer says so)."""
    weights = saved_weights(model_dir, names)
    if weights is None:
        raise error(f"{model_dir}: no {' or '.join(names)} weights ({holds})")
    return weights


def saved_model_type(model_dir: Path, types, subject: str, tail: str = "", error: type[Exception] = UserError) -> str:
    """config.json's model_type in the transformers folder `model_dir` when it is one of `types`,
    else `error` "SUBJECT: MODEL_DIR holds model_type 'x' (or: no readable config.json); expected
    a transformers model of type A or B saved with save_pretrained" and `tail`."""
    try:
        kind = read_json(model_dir / "config.json").get("model_type")
    except (OSError, ValueError, AttributeError):
        kind = None
    if kind not in types:
        found = f"model_type {kind!r}" if kind else "no readable config.json"
        raise error(f"{subject}: {model_dir} holds {found}; expected a transformers model of type "
                    f"{' or '.join(types)} saved with save_pretrained{tail}")
    return kind
