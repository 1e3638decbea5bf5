"""Checkpoints: one checkpointer over every stateful part of a run, written atomically.

    RUN/checkpoints/step_00001000.pt   model, EMA, optimizer, scaler, LR schedule, loader,
                                       RNG states, step, resolved config, store identity
    RUN/ema.safetensors                the EMA weights alone, with the config in its metadata
                                       (what `dittrain sample` and other tools load)

A checkpoint is written to a hidden temporary name, synced, renamed, and its directory
synced (ditdata.store.files), so a file under its final name is always complete and
survives a power cut; the last `keep` are kept. A write that fails (disk full, file-size
limit) removes its temporary, keeps the previous files and raises a one-line
CheckpointError. Loading uses torch.load(weights_only=True) or safetensors, never
arbitrary pickle: everything saved is tensors and plain Python data.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ditdata.store.files import atomic_file, atomic_path, error_reason

CHECKPOINTS = "checkpoints"
EMA_EXPORT = "ema.safetensors"
_NAME = re.compile(r"^step_(\d{8,})\.pt$")


class CheckpointError(Exception):
    """A checkpoint is missing, truncated, or belongs to another run or store."""


def _write_failed(path: Path, what: str, previous: Path | None, e: Exception) -> CheckpointError:
    kept = f"the previous {previous.name} is intact" if previous else "nothing was published"
    return CheckpointError(f"{path}: could not write {what} ({error_reason(e)}); {kept}")


def checkpoint_path(run_dir, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step_{step:08d}.pt"


def list_checkpoints(run_dir) -> list[Path]:
    d = Path(run_dir) / CHECKPOINTS
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(run_dir, step: int, state: dict, *, keep: int = 3) -> Path:
    """Write state atomically as checkpoints/step_N.pt and delete all but the last `keep`."""
    final = checkpoint_path(run_dir, step)
    previous = latest_checkpoint(run_dir)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        # Through a Python file object, so a failed write keeps its OSError (torch's zip
        # writer otherwise reports only "unexpected pos ...") for the message.
        with atomic_file(final, "wb") as f:
            torch.save(state, f)
    except Exception as e:  # torch raises RuntimeError from its zip writer, not OSError
        raise _write_failed(final, "the checkpoint", previous, e) from e
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return final


def load_checkpoint(path, map_location="cpu") -> dict:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated zip, foreign pickle, ...: one clear line
        raise CheckpointError(
            f"{path}: unreadable checkpoint ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
            "it may be truncated: delete it to resume from the previous one"
        ) from e


def export_weights(path, state_dict: dict, config: dict) -> Path:
    """Save weights as safetensors with the run config (JSON) in the metadata."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    previous = path if path.is_file() else None
    try:
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={"dittrain_config": json.dumps(config)})
    except Exception as e:  # safetensors raises its own SafetensorError on a full disk
        raise _write_failed(path, "the EMA weights", previous, e) from e
    return path


def load_weights(path) -> tuple[dict, dict]:
    """(state_dict, run config) from an EMA export (.safetensors), a checkpoint (.pt, its
    EMA weights) or a run directory (its ema.safetensors, else its latest checkpoint)."""
    path = Path(path)
    if path.is_dir():
        if (path / EMA_EXPORT).is_file():
            path = path / EMA_EXPORT
        else:
            latest = latest_checkpoint(path)
            if latest is None:
                raise CheckpointError(f"{path}: no {EMA_EXPORT} and no checkpoints/step_*.pt")
            path = latest
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                state = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:
            raise CheckpointError(f"{path}: unreadable safetensors ({type(e).__name__}: {e})") from e
        if "dittrain_config" not in meta:
            raise CheckpointError(f"{path}: no dittrain_config in its metadata; not a dittrain export")
        return state, json.loads(meta["dittrain_config"])
    ckpt = load_checkpoint(path)
    if "ema" not in ckpt or "config" not in ckpt:
        raise CheckpointError(f"{path}: not a dittrain checkpoint (no 'ema'/'config')")
    return ckpt["ema"], ckpt["config"]
