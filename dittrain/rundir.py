"""A run directory's files, and the safe ways to write and read them: the format the trainer
writes (dittrain.train) and everything that opens a run reads (dittrain.inference).

    RUN/config.json                    the run's record (dittrain.train.resume)
    RUN/checkpoints/step_00001000.pt   RunState.state_dict() (dittrain.train.checkpoint): model,
                                       EMA, optimizer, scaler, LR schedule, loader and RNG states,
                                       step, resolved config ("projector": --repa's)
    RUN/ema.safetensors                the EMA weights alone, the run config in its metadata
    RUN/metrics.jsonl, RUN/samples/    the logs and EMA sample grids (dittrain.train.log)

A file is written to a hidden temporary name, synced, renamed, and its directory synced
(ditdata.common.files), so a file under its final name is always complete and survives a
power cut; the last `keep` checkpoints are kept. A write that fails (disk full, file-size
limit) removes its temporary, keeps the previous files and raises a one-line
CheckpointError. Reading uses torch.load(weights_only=True) or safetensors, never
arbitrary pickle: everything saved is tensors and plain Python data (an int8 export of
`dittrain export` also holds torchao's tensor subclasses: those, by name, are allowed).
"""

from __future__ import annotations

import importlib
import json
import re
import zipfile
from pathlib import Path

import torch

from ditdata.common.errors import UserError
from ditdata.common.extras import missing_extra
from ditdata.common.files import atomic_file, atomic_path, error_reason

CHECKPOINTS = "checkpoints"
EMA_EXPORT = "ema.safetensors"
INT8_FORMAT = "dittrain-int8"  # dittrain export --format int8: {"format", "config", "state_dict", "export"}
_NAME = re.compile(r"^step_(\d{8,})\.pt$")


class CheckpointError(UserError):
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


def load_checkpoint(path, map_location="cpu", *, mmap: bool = False) -> dict:
    """torch.load(weights_only=True) with one-line errors. mmap: map the tensors instead of
    reading them (a zip-format file; large weights cost nothing until used)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint")
    mmap = mmap and zipfile.is_zipfile(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # truncated zip, foreign pickle, ...: one clear line
        classes = _tensor_classes(path)
        if classes:  # an int8 export: torchao's tensor subclasses, allowed by name
            with torch.serialization.safe_globals(classes):
                return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        raise CheckpointError(
            f"{path}: unreadable checkpoint ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
            "it may be truncated: delete it to resume from the previous one"
        ) from e


def _tensor_classes(path: Path) -> list[type]:
    """The torchao tensor subclasses a file pickles (an int8 export, dittrain.inference.export), imported
    so torch.load(weights_only=True) may rebuild them: only torch.Tensor subclasses of torchao
    named in the file are allowed, nothing else. [] for any other file."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a zip, truncated: the caller reports the first error
        return []
    classes = []
    if names:
        from ditdata.autoencoders.kinds import quiet_third_party_imports

        quiet_third_party_imports()
    for name in names:
        module, _, attr = name.rpartition(".")
        if module.split(".")[0] != "torchao":
            return []  # something else is not allowed: refused as any foreign pickle
        try:
            cls = getattr(importlib.import_module(module), attr)
        except ImportError as e:
            raise missing_extra(f"{path}: loading an int8 export (torchao tensors)", "export", e,
                                CheckpointError) from e
        except AttributeError as e:
            raise CheckpointError(f"{path}: an int8 export made with another torchao (this one has no {name}); "
                                  "load it with the torchao version that wrote it, or export it again") from e
        if not (isinstance(cls, type) and issubclass(cls, torch.Tensor)):
            return []
        classes.append(cls)
    return classes


def export_weights(path, state_dict: dict, config: dict, *, metadata: dict[str, str] | None = None) -> Path:
    """Save weights as safetensors with the run config (JSON) in the metadata (and `metadata`'s
    extra string entries: dittrain.inference.export's fp16 files say what made them)."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    previous = path if path.is_file() else None
    try:
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={**(metadata or {}), "dittrain_config": json.dumps(config)})
    except Exception as e:  # safetensors raises its own SafetensorError on a full disk
        raise _write_failed(path, "the EMA weights", previous, e) from e
    return path
