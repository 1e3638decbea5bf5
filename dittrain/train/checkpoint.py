"""Checkpoints: one object over every stateful part of a run (RunState), and the background
writer that saves it without holding up the step.

What a checkpoint holds is RunState.state_dict() and a resume is RunState.load_state_dict()
(torchtitan's idea: the stateful parts listed once, each with state_dict/load_state_dict).
The files themselves (RUN/checkpoints/step_N.pt, RUN/ema.safetensors), their atomic writes
and their safe reads are dittrain.rundir's. CheckpointWriter makes the same writes from a
background thread after a host copy of the state (`dittrain run --async-save`, the default),
so the step does not wait for the disk.
"""

from __future__ import annotations

import copy
import random
import threading
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dittrain.rundir import EMA_EXPORT, CheckpointError, checkpoint_path, export_weights, save_checkpoint

# --------------------------------------------------------------------------- what a checkpoint holds


class RunState:
    """Every stateful part of a run, in one place: a checkpoint is `state_dict()`, a resume
    is `load_state_dict(checkpoint)`. A new stateful part is one entry in `_shared` (one
    copy, rank 0's: DDP keeps the replicas equal) or `_per_rank` (each rank's own, gathered
    into "ranks"); a new counter is an attribute named in COUNTERS. The file:

        {"step", "nonfinite_total", "model", "ema", "optimizer", "lr_schedule", "scaler",
         ["projector",] "ranks": [{"loader", "rng", "noise_gen"} of rank r, ...], "config"}

    (a --lora run's "model" and "ema": the adapter's tensors alone, dittrain.model.lora.adapter_state;
    "config": the resolved run config, checked before a resume, never loaded; "projector":
    one of term_modules, the modules of the loss terms on (dittrain.train.losses), each under its
    entry's state_key, here --repa's: trained and restored, never exported).
    """

    COUNTERS = ("step", "nonfinite_total")  # plain ints; one a checkpoint lacks starts at 0

    def __init__(self, *, model, ema, optimizer, lr_schedule, scaler, loader, noise_gen: torch.Generator,
                 config: dict, device: torch.device, rank: int = 0, world: int = 1,
                 term_modules: dict | None = None, adapter_only: bool = False):
        self.model, self.ema, self.optimizer, self.lr_schedule = model, ema, optimizer, lr_schedule
        self.adapter_only = adapter_only  # --lora: "model" and "ema" hold the adapter alone (the base is frozen)
        self.term_modules = term_modules or {}  # {state_key: module}: train beside the model, not in the EMA
        self.scaler, self.loader, self.noise_gen = scaler, loader, noise_gen
        self.config, self.device, self.rank, self.world = config, device, rank, world
        self.step = 0  # optimizer steps taken
        self.nonfinite_total = 0  # steps skipped for a NaN/inf loss

    def _shared(self) -> dict:
        model, ema = (_Adapter(self.model), _Adapter(self.ema)) if self.adapter_only else (self.model, self.ema)
        parts = {"model": model, "ema": ema, "optimizer": self.optimizer,
                 "lr_schedule": self.lr_schedule, "scaler": self.scaler}
        return {**parts, **self.term_modules}

    def _per_rank(self) -> dict:
        return {"loader": self.loader, "rng": _GlobalRNG(self.device),
                "noise_gen": _GeneratorState(self.noise_gen)}

    def state_dict(self) -> dict:
        """The checkpoint. With several ranks every rank must call it (it gathers each
        rank's part); only rank 0's result is complete."""
        mine = {k: part.state_dict() for k, part in self._per_rank().items()}
        ranks = [mine]  # every rank's, in rank order
        if self.world > 1:
            ranks = [None] * self.world
            dist.all_gather_object(ranks, mine)
        return {**{k: getattr(self, k) for k in self.COUNTERS},
                **{k: part.state_dict() for k, part in self._shared().items()},
                "ranks": ranks, "config": self.config}

    def load_state_dict(self, state: dict, *, exact_order: bool = True) -> None:
        """Restore every part from a checkpoint (this rank's entry of "ranks"). A loader
        made with other settings raises dittrain.data.LoaderStateError, unless exact_order is
        False (a resume that changes the batch, seed or window on purpose): the loader then
        goes on after as many samples as it had drawn, in its new order."""
        for k, part in self._shared().items():
            if k == "scaler" and not state[k] and self.scaler.is_enabled():
                continue  # saved without fp16 (an empty scaler state): a new fp16 run starts its scale afresh
            part.load_state_dict(state[k])
        mine = state["ranks"][self.rank]
        for k, part in self._per_rank().items():
            if k == "loader" and not exact_order:
                saved = mine[k]
                drawn = int(saved["batches"]) * int(saved.get("batch_size") or self.loader.batch_size)
                self.loader.load_state_dict({**saved, "batches": drawn // self.loader.batch_size}, strict=False)
            else:
                part.load_state_dict(mine[k])
        for k in self.COUNTERS:
            setattr(self, k, state.get(k, 0))


class _Adapter:
    """A --lora model as a stateful part: its adapter's tensors alone (dittrain.model.lora), so a
    checkpoint holds no copy of the frozen base, which the run's "init" record rebuilds."""

    def __init__(self, model):
        self.model = model

    def state_dict(self) -> dict:
        from dittrain.model.lora import adapter_state

        return adapter_state(self.model)

    def load_state_dict(self, state: dict) -> None:
        from dittrain.model.lora import load_adapter

        load_adapter(self.model, state)


class _GlobalRNG:
    """The process-wide generators (Python's, NumPy's, torch's and the device's CUDA one)
    as one stateful part."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict:
        np_state = np.random.get_state(legacy=False)
        np_state["state"] = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in np_state["state"].items()}
        state = {"python": random.getstate(), "numpy": np_state, "torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict) -> None:
        random.setstate(_tuples(state["python"]))
        np_state = dict(state["numpy"])
        np_state["state"] = {k: (np.array(v, dtype=np.uint64) if isinstance(v, list) else v)
                             for k, v in np_state["state"].items()}
        np.random.set_state(np_state)
        torch.set_rng_state(state["torch"])
        if self.device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)


def _tuples(x):
    """random.setstate wants tuples; a checkpoint may hand back lists."""
    return tuple(_tuples(v) for v in x) if isinstance(x, list | tuple) else x


class _GeneratorState:
    """A torch.Generator as a stateful part (its get_state / set_state)."""

    def __init__(self, gen: torch.Generator):
        self.gen = gen

    def state_dict(self) -> torch.Tensor:
        return self.gen.get_state()

    def load_state_dict(self, state: torch.Tensor) -> None:
        self.gen.set_state(state)


# --------------------------------------------------------------------------- background writes


class CheckpointWriter:
    """Checkpoint saves off the training step (issue 17): `submit` copies the state to host
    memory and returns; a background thread writes it (save_checkpoint: the same atomic
    publish and keep-N pruning) and the EMA export (export_weights).

    The copy is what makes this safe: the step after a submit mutates parameters, optimizer
    state and counters IN PLACE, so the thread must never read live tensors. CPU tensors are
    cloned; CUDA tensors are copied with non_blocking into pinned host buffers that are kept
    for the next save (re-pinning an XL/2 state, ~11 GB, every save would cost seconds): the
    copy is queued on the current stream, so the step's later kernels cannot overwrite a
    tensor before it is copied, and the thread waits for the copy before it writes.

    Memory: a CPU state's clones double its host memory only while its write lives (they are
    dropped once written); the pinned buffers of a CUDA state hold one host copy of it until
    close().

    One write is in flight at most: a submit (or wait) first joins the previous write and
    re-raises its failure, the CheckpointError the synchronous save would have raised (so a
    failed write stops the run at the next save or at the end, never silently). Writes are
    made in submit order, so pruning and `latest_checkpoint` see what a synchronous run would.
    A process killed mid-write leaves only a hidden temporary (the atomic publish): the
    previous checkpoint stays the latest and loadable.
    """

    def __init__(self):
        self._thread = None
        self._error: BaseException | None = None
        self._pinned: dict[tuple, torch.Tensor] = {}  # CUDA: reusable host buffers by place in the state

    def submit(self, run_dir, step: int, state: dict, *, keep: int = 3, ema_state: dict | None = None,
               config: dict | None = None) -> Path:
        """Copy `state` (and `ema_state`, exported to RUN/ema.safetensors with `config`) to the
        host, start writing it, and return the checkpoint's path (complete after wait())."""
        self.wait()
        memo, devices = {}, set()
        host = self._host(state, ("state",), memo, devices)
        ema = self._host(ema_state, ("ema",), memo, devices) if ema_state is not None else None
        copied = [_record(d) for d in devices]  # done when every copy queued on that stream is
        # Not a daemon: an interpreter that exits (an error elsewhere) still finishes the file.
        self._thread = threading.Thread(target=self._write, name=f"checkpoint-{step}",
                                        args=(Path(run_dir), step, host, keep, ema, config, copied))
        self._thread.start()
        return checkpoint_path(run_dir, step)

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk; re-raise its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> BaseException | None:
        """Wait for the write in flight and free the pinned buffers; returns (does not raise)
        a failure not yet reported, for a caller already handling another error."""
        try:
            self.wait()
        except BaseException as e:  # noqa: BLE001 - handed back to the caller
            return e
        finally:
            self._pinned.clear()
        return None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _write(self, run_dir: Path, step: int, state: dict, keep: int, ema: dict | None, config,
               copied: list) -> None:
        try:
            for event in copied:  # the device-to-host copies submit queued
                event.synchronize()
            save_checkpoint(run_dir, step, state, keep=keep)
            if ema is not None:
                export_weights(run_dir / EMA_EXPORT, ema, config or {})
        except CheckpointError as e:
            self._error = e
        except BaseException as e:  # noqa: BLE001 - a bug or an odd OSError (pruning): still one line, and raised
            self._error = CheckpointError(f"{checkpoint_path(run_dir, step)}: background checkpoint write "
                                          f"failed ({type(e).__name__}: {e})")
            self._error.__cause__ = e
        # the host copies die with this frame (state, ema): a CPU state's memory is released here

    def _host(self, x, where: tuple, memo: dict, devices: set):
        """x with every tensor copied to host memory and every container rebuilt (a loader's
        state may hold lists it keeps appending to). A tensor seen twice (the EMA weights in the
        checkpoint and in the export, tied weights) is copied once, as torch.save keeps sharing."""
        if isinstance(x, torch.Tensor):
            if id(x) not in memo:
                memo[id(x)] = self._copy(x.detach(), where, devices)
            return memo[id(x)]
        if isinstance(x, dict):
            out = copy.copy(x)  # keeps the type and attributes (a state_dict's OrderedDict _metadata)
            for k in out:
                out[k] = self._host(x[k], (*where, k), memo, devices)
            return out
        if type(x) in (list, tuple):
            return type(x)(self._host(v, (*where, i), memo, devices) for i, v in enumerate(x))
        return copy.deepcopy(x)  # ints, strings, arrays: small, and never shared with the live run

    def _copy(self, t: torch.Tensor, where: tuple, devices: set) -> torch.Tensor:
        if t.device.type != "cuda":
            return t.clone()  # the step after a submit updates CPU tensors too (Adam's step counts)
        buf = self._pinned.get(where)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._pinned[where] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)  # queued on the current stream, before the next step's kernels
        devices.add(t.device)
        return buf


def _record(device: torch.device) -> torch.cuda.Event:
    """An event on `device`'s current stream: complete once everything queued before it is."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
