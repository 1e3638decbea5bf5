"""Loaders over a latent store: infinite, seeded, exactly resumable batches for the trainer.

    from dittrain.data import build_loader
    loader = build_loader(store, batch_size=64, seed=0, rank=rank, world_size=world, device="cuda")
    log(loader.kind, loader.reason)        # which loader was chosen, and why
    batch = next(loader)                   # {"x": (B, C, h, w) float32, "y": (B,) int64, ...}
    state = loader.state_dict()            # ints and strings: torch.save / weights_only safe
    ...
    loader = build_loader(...); loader.load_state_dict(state)   # the next batches are identical
    loader.close()                         # stops the streaming worker processes

Two loaders, one contract:

ResidentLoader   the whole store (this rank's part of it) held in memory in its stored dtype
                 (fp16/bf16), in RAM or on the GPU; a batch is one index_select.
StreamingLoader  for stores larger than memory: worker processes read WINDOWS of whole
                 shards in bulk, shuffle each window in memory and cut it into batches that
                 travel through shared-memory slots; the main process puts them back into
                 the canonical order, pins them and copies them to the GPU ahead of the step.

THE SAMPLE STREAM. Each rank's loader yields an infinite stream of samples: epoch 0's order,
then epoch 1's, and so on. A batch is the next `batch_size` samples of that stream, so the
last batch of an epoch is completed with the first samples of the next epoch. Nothing is
dropped or repeated: every sample of the rank's part appears exactly once per epoch, and every
batch is full. The same holds for the remainder of a streaming window (< batch_size samples
left when the window runs out): the batch is completed with the head of the NEXT window
(which another worker may have read), never padded, dropped or shortened.

    resident   epoch e = a permutation of this rank's part, seeded by (seed, rank, e)
    streaming  epoch e = the store's shards (the UNITS) in an order seeded by (seed, e), the
               same on every rank; rank r takes units r, r+W, r+2W, ... of that order; they
               form windows of `shuffle_window` units, and window w's samples are permuted
               by a permutation seeded by (seed, rank, e, w). A window is a pure function of
               (seed, rank, e, w); worker i of n produces windows i, i+n, ... and the result
               does not depend on the number of workers (workers=0 reads in-process).

DDP. split="part" (the default): rank r of W sees a disjoint part of the store and the parts
cover it, each rank with its own order. Resident: a fixed seeded random partition of the
samples (sizes differ by at most one; memory per rank is 1/W of the store). Streaming: in
each epoch a different disjoint set of shards (when a store has fewer shards than ranks, the
shards are split into W row ranges); a rank's epoch length then depends on its shards, so
use many more shards than ranks. split="batch": rank r gets rows [r*B, (r+1)*B) of the batch
that ONE process would get with batch_size B*W, flips and fresh draws included, so W ranks
see exactly the data of one process (for exact single- vs multi-process comparisons); each
rank then holds (resident) or reads (streaming) the whole store. Every iterator is
infinite: ranks never hang at an epoch end.

PER-SAMPLE RANDOMNESS. Where the store keeps a flipped variant, each sample's variant is a
fair coin drawn with the epoch's (window's) order, so it changes between epochs. Where the
store keeps mean and std, x = mean + std * eps with eps drawn on `device` from a generator
seeded by (seed, rank, epoch, offset) of the batch: fresh every epoch, identical at resume
(on the same device type: CPU and CUDA generators differ).

STATE. `state_dict()` = {"kind", "batches", "epoch", "offset", "seed", "batch_size", "rank",
"world_size", "split", "num_samples", ...}. The position is a function of `batches` alone, so the
state saved by rank 0 resumes every rank exactly (each recomputes its own epoch and offset).
A streaming resume skips the windows already consumed without reading them; the current
window is read again (a shuffle needs all of it) and its consumed part is skipped.

`loader.wait_seconds` is the cumulative time the consumer spent inside `next(loader)`.
"""

from __future__ import annotations

import gc
import math
import multiprocessing
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ditdata.common.errors import UserError
from ditdata.common.sizes import parse_size
from ditdata.store import BFLOAT16, TEXT_FIELDS, Store, open_store

__all__ = [
    "LoaderError", "LoaderStateError", "ResidentLoader", "StreamingLoader", "available_memory",
    "build_loader", "choose_loader", "gpu_memory", "loader_budget", "parse_memory",
]

_TORCH_DTYPES = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "bool": torch.bool, "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64,
}
# Tags that keep the seeded streams of different purposes independent.
_PART, _EPOCH, _UNITS, _WINDOW, _EPS = 1, 2, 3, 4, 5


def _rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(k) for k in key])))


def _seed64(*key: int) -> int:
    return int(np.random.SeedSequence([int(k) for k in key]).generate_state(1, np.uint64)[0])


def _as_torch(arr: np.ndarray) -> torch.Tensor:
    if arr.dtype == BFLOAT16:
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(arr))


def _open(store) -> Store:
    return store if isinstance(store, Store) else open_store(store if isinstance(store, str) else Path(store))


# ---------------------------------------------------------------------------------------
# What a batch is made of
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Field:
    name: str  # its name in the batch
    source: str | None  # the store field or column it comes from
    dtype: torch.dtype  # as held in memory (the stored dtype)
    shape: tuple[int, ...]  # per sample

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class _Spec:
    """The store fields a loader reads and how they become a batch.

    Latents are held as one block (n, V, P, C, h, w): V variants (1, or 2 with the flipped
    twin), P parts (1: a frozen sample; 2: mean and std). Choosing a variant is then picking
    row i * V + v of the (n * V, P * C * h * w) view: one index_select per batch.
    """

    def __init__(self, store: Store):
        schema = store.schema
        self.stored = schema.latent_kind()  # "sample" | "mean_std"
        parts = ["latent"] if self.stored == "sample" else ["mean", "std"]
        flipped = [f"{p}_flip" for p in parts]
        self.variants = [parts] + ([flipped] if all(f in schema.tensors for f in flipped) else [])
        specs = [schema.tensors[f] for v in self.variants for f in v]
        if len({s.shape for s in specs}) != 1:
            raise ValueError(f"{store.root}: latent fields differ in shape: {[s.shape for s in specs]}")
        dtypes = {s.dtype for s in specs}
        self.lat_dtype = _TORCH_DTYPES[dtypes.pop()] if len(dtypes) == 1 else torch.float32
        self.lat_shape = tuple(specs[0].shape)
        self.V, self.P = len(self.variants), len(parts)
        self.extras: list[_Field] = []
        if store.conditioning.kind == "class" and "label" in schema.columns:
            self.extras.append(_Field("y", "label", torch.int64, ()))
        for name in TEXT_FIELDS:
            if name in schema.tensors:
                t = schema.tensors[name]
                self.extras.append(_Field(name, name, _TORCH_DTYPES[t.dtype], tuple(t.shape)))
        self.read_fields = [f for v in self.variants for f in v] + [e.source for e in self.extras]
        # what one chunk of a batch carries (the variant already chosen)
        self.chunk_fields = [
            _Field("lat", None, self.lat_dtype, (self.P, *self.lat_shape)), *self.extras,
            _Field("index", None, torch.int64, ()), _Field("flip", None, torch.bool, ()),
        ]

    @property
    def resident_bytes(self) -> int:
        """Bytes per sample held by the resident loader."""
        lat = self.V * self.P * math.prod(self.lat_shape) * self.lat_dtype.itemsize
        return lat + sum(e.nbytes for e in self.extras) + 8


class _Block:
    """n samples in memory: lat (n, V, P, C, h, w), the extras, and global sample indices."""

    def __init__(self, spec: _Spec, n: int, device):
        self.spec, self.n = spec, n
        self.lat = torch.empty((n, spec.V, spec.P, *spec.lat_shape), dtype=spec.lat_dtype, device=device)
        self.extras = {e.name: torch.empty((n, *e.shape), dtype=e.dtype, device=device) for e in spec.extras}
        self.index = torch.empty(n, dtype=torch.int64, device=device)

    @property
    def flat(self) -> torch.Tensor:
        """(n * V, P * C * h * w): row i * V + v is variant v of sample i (2-D: the fastest gather)."""
        return self.lat.view(self.n * self.spec.V, -1)

    def fill(self, pos: int, data: dict, global_index: np.ndarray, local: np.ndarray | None = None):
        """Copy one store.read() result (rows `local` of it, or all) to [pos, pos + m)."""
        m = len(global_index)
        sl = slice(pos, pos + m)
        for v, names in enumerate(self.spec.variants):
            for p, name in enumerate(names):
                arr = data[name] if local is None else data[name][local]
                self.lat[sl, v, p].copy_(_as_torch(arr))
        for e in self.spec.extras:
            arr = data[e.source] if local is None else data[e.source][local]
            self.extras[e.name][sl].copy_(_as_torch(np.asarray(arr)))
        self.index[sl].copy_(torch.from_numpy(np.asarray(global_index, dtype=np.int64)))


# ---------------------------------------------------------------------------------------
# Choosing a loader
# ---------------------------------------------------------------------------------------
class LoaderError(UserError, ValueError):
    """The requested loader cannot work here (a resident store larger than the memory it
    would live in); the message is one line with the sizes and what to use instead."""


class LoaderStateError(UserError, ValueError):
    """A saved loader state that this loader cannot continue exactly (another kind, seed,
    batch size, world size, store size or window); the message lists what differs."""


# A resident loader asked for explicitly may use up to this fraction of the available
# memory, and is refused beyond it, at once rather than by the kernel's OOM killer part
# way through filling it. The rest is headroom for what the process needs besides the
# block (one shard read at a time while filling it, the model and optimizer, allocator
# slack) and for the estimate itself (MemAvailable counts page cache that the kernel may
# not hand back in time). `auto` keeps its stricter memory_fraction: it has a fallback.
RESIDENT_MAX_FRACTION = 0.9


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_available() -> int | None:
    """Room left under a container's memory limit (cgroup v2 or v1), if there is one."""
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            lim = Path(limit).read_text().strip()
            if lim == "max" or int(lim) >= 1 << 60:
                return None
            return max(0, int(lim) - int(Path(usage).read_text().strip()))
        except (OSError, ValueError):
            continue
    return None


def available_memory() -> tuple[int | None, str]:
    """(bytes of RAM available to new allocations, where that figure came from)."""
    avail, source = _meminfo_available(), "MemAvailable in /proc/meminfo"
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            source = "free physical pages (sysconf)"
        except (ValueError, OSError, AttributeError):
            return None, "unknown"
    cg = _cgroup_available()
    if cg is not None and cg < avail:
        avail, source = cg, "the container's cgroup memory limit"
    return avail, source


def gpu_memory(device) -> tuple[int | None, str]:
    """(free bytes on a CUDA device, where that figure came from); None without CUDA."""
    if not torch.cuda.is_available():
        return None, "CUDA is not available"
    device = torch.device(device)
    free, _ = torch.cuda.mem_get_info(device)
    return free, f"free memory of {device} (torch.cuda.mem_get_info)"


def _part_size(n: int, rank: int, world_size: int) -> int:
    return n // world_size + (1 if rank < n % world_size else 0)


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def choose_loader(store, *, kind: str = "auto", rank: int = 0, world_size: int = 1,
                  resident_device="cpu", memory_fraction: float = 0.5,
                  local_world_size: int | None = None, split: str = "part") -> tuple[str, str, str]:
    """(kind, resident_device, reason): "resident" when this rank's part of the store fits
    in under `memory_fraction` of the available memory (GPU memory for resident_device
    "cuda", else RAM shared by the `local_world_size` ranks of this machine), else "streaming".
    """
    store = _open(store)
    spec = _Spec(store)
    n = _part_size(len(store), rank, world_size) if split == "part" else len(store)
    need = n * spec.resident_bytes
    what = (f"this rank's part ({n:,} samples, {_gib(need)} as stored)" if split == "part"
            else f"the whole store for this rank (split='batch': {n:,} samples, {_gib(need)} as stored)")
    rdev = torch.device(resident_device)
    local = _local_ranks(local_world_size, world_size)
    if kind == "streaming":
        return kind, str(rdev), f"{kind}: requested (loader={kind!r}); {what}"
    if kind == "resident":
        fit = _check_resident_fits(rdev, need, local, what)
        return kind, str(rdev), f"{kind}: requested (loader={kind!r}); {what}{fit}"
    if kind != "auto":
        raise ValueError(f"unknown loader kind {kind!r}; use auto, resident or streaming")
    note = ""
    if rdev.type == "cuda":
        free, _ = gpu_memory(rdev)
        if free is not None and need <= memory_fraction * free:
            return "resident", str(rdev), (
                f"resident on {rdev}: {what} is {need / free:.0%} of the free GPU memory "
                f"({_gib(free)}; limit {memory_fraction:.0%})")
        note = f" (too large for {rdev}: {_gib(free)} free)" if free is not None else ""
    avail, source = available_memory()
    total = need * local
    share = f" x {local} ranks on this machine" if local > 1 else ""
    if avail is None:
        return "streaming", "cpu", f"streaming: available memory unknown; {what}{note}"
    frac = f"{total / avail:.0%} of the available memory ({_gib(avail)}, {source})"
    if total <= memory_fraction * avail:
        return "resident", "cpu", f"resident in RAM: {what}{share} is {frac}; limit {memory_fraction:.0%}{note}"
    return "streaming", "cpu", (
        f"streaming: {what}{share} is {frac}, over the {memory_fraction:.0%} limit for a resident store{note}")


def _local_ranks(local_world_size: int | None, world_size: int) -> int:
    """How many ranks share this machine's RAM (each holds its own resident part)."""
    local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(local, world_size))


def _check_resident_fits(rdev: torch.device, need: int, local: int, what: str) -> str:
    """Refuse (LoaderError) an explicitly requested resident loader that cannot fit where
    it would live: the GPU's free memory for resident_device "cuda" (one rank per GPU),
    else the RAM shared by the `local` ranks of this machine. Returns a note for the reason."""
    if rdev.type == "cuda":
        total, share, where = need, "", str(rdev)
        avail, source = gpu_memory(rdev)
    else:
        total, where = need * local, "RAM"
        share = f" x {local} ranks on this machine" if local > 1 else ""
        avail, source = available_memory()
    if avail is None:  # nothing to compare with: let it try, and say so
        return f"; available memory unknown ({source}), not checked"
    if total > RESIDENT_MAX_FRACTION * avail:
        raise LoaderError(
            f"loader 'resident' needs {_gib(total)} of {where} for {what}{share}, but only "
            f"{_gib(avail)} is available ({source}) and a resident store may use at most "
            f"{RESIDENT_MAX_FRACTION:.0%} of it; use --loader streaming (or --loader auto), "
            "which reads the store from disk in windows")
    return f"; {total / avail:.0%} of the available {_gib(avail)} of {where} ({source})"


# ---------------------------------------------------------------------------------------
# The streaming loader's memory budget
# ---------------------------------------------------------------------------------------
# memory="auto" is this share of the available RAM, split between the ranks of this machine
# (each runs its own loader), and at most LOADER_MEMORY_CAP. A quarter leaves the rest to
# what training needs besides the loader (model, optimizer, pinned staging, a resident eval
# set) and to the page cache, which serves the store's shards again in the next epoch. The
# cap: a window never grows past AUTO_MAX_WINDOW units, and 4 GiB already holds that window
# for 4 workers over shards of 10,000 4x32x32 fp16 latents with flips (4 x 4 x 160 MB + the
# rest); more budget would buy no better shuffle, only a higher peak.
LOADER_MEMORY_FRACTION = 0.25
LOADER_MEMORY_CAP = 4 * 2**30
# A window or prefetch depth sized by the budget is at most this (the fixed defaults before
# the budget existed): the budget lowers them where memory is short, never raises them.
AUTO_MAX_WINDOW = 4
AUTO_MAX_PREFETCH = 4
# A sized prefetch is at least this where it fits: one slot being filled while the main
# process copies out of the other keeps a worker busy (1 is still taken when 2 does not fit).
AUTO_MIN_PREFETCH = 2
# Private memory of one worker process beyond its window and piece: the copy-on-write pages
# of the parent that it touches after the fork, its imports (zarr, pyarrow), allocator and
# thread state. Measured here at 55-70 MiB of USS at the worker's peak (4x32x32 fp16 latents
# with flips, windows of 1-4 shards); tests/test_loader_budget.py holds the estimate to a
# measurement.
WORKER_OVERHEAD = 80 * 2**20
# A zarr shard is read in row pieces of about this many bytes, so that a worker holds its
# window plus one piece rather than plus a second copy of a whole shard. A wds shard is read
# whole: a row range of a tar is found by scanning it from the start.
READ_PIECE_BYTES = 32 * 2**20
# Per sample of a window besides its data: the permutation, the coin flips and the gather rows
# (int64 each).
_ORDER_BYTES = 24
# Per sample of a shard whose columns are read: the zarr backend caches the shard's parquet
# table (keys included) and the converted label column while the shard is being read.
_COLUMN_BYTES = 64
# Batches alive at once in the main process: the consumer's, the one being assembled, and the
# staged one (GPU lookahead) or the float32 temporaries of a mean/std draw.
_LIVE_BATCHES = 3

def parse_memory(value) -> int | None:
    """--loader-memory in bytes (ditdata.common.sizes: "2GiB", "512MiB", "1.5G", "2GB" decimal,
    bytes); None for "auto". Raises ValueError for anything else."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    return parse_size(value, "loader memory")


def loader_budget(memory="auto", *, world_size: int = 1, local_world_size: int | None = None
                  ) -> tuple[int, str]:
    """(bytes, how they were chosen) of the streaming loader's memory budget for `memory`:
    auto (LOADER_MEMORY_FRACTION of the available RAM over the ranks of this machine, at most
    LOADER_MEMORY_CAP) or an explicit size (see parse_memory)."""
    explicit = parse_memory(memory)
    if explicit is not None:
        return explicit, f"--loader-memory {memory}" if isinstance(memory, str) else f"memory={memory}"
    local = _local_ranks(local_world_size, world_size)
    avail, source = available_memory()
    if avail is None:
        return LOADER_MEMORY_CAP, f"auto: available memory unknown, the {_gib(LOADER_MEMORY_CAP)} cap"
    share = int(LOADER_MEMORY_FRACTION * avail / local)
    per = f" / {local} ranks" if local > 1 else ""
    if share >= LOADER_MEMORY_CAP:
        return LOADER_MEMORY_CAP, f"auto: the {_gib(LOADER_MEMORY_CAP)} cap ({LOADER_MEMORY_FRACTION:.0%} of {_gib(avail)} available{per} is more)"
    return share, f"auto: {LOADER_MEMORY_FRACTION:.0%} of {_gib(avail)} available{per} ({source})"


@dataclass(frozen=True)
class StreamingMemory:
    """The streaming loader's memory plan: its window and prefetch depth, the estimate of its
    own peak (bytes, and what it is made of), and the budget it was sized to (None: none)."""

    window: int
    prefetch: int
    estimate: int
    parts: dict
    budget: int | None = None
    source: str = ""

    def describe(self) -> str:
        made = ", ".join(f"{k} {_gib(v)}" for k, v in self.parts.items() if v)
        if self.budget is None:
            return f"memory ~{_gib(self.estimate)} ({made}; no budget)"
        return f"memory ~{_gib(self.estimate)} of budget {_gib(self.budget)} ({made}; budget {self.source})"


def _read_piece_rows(store: Store, spec: _Spec) -> int | None:
    """Rows per read of a shard (None: the whole shard at once, see READ_PIECE_BYTES)."""
    if store.manifest["backend"] == "wds":
        return None
    lat = spec.V * spec.P * math.prod(spec.lat_shape) * spec.lat_dtype.itemsize
    return max(1, READ_PIECE_BYTES // (lat + sum(e.nbytes for e in spec.extras)))


def _estimate(spec: _Spec, sizes: list[int], piece: int | None, *, workers: int, window: int,
              prefetch: int, slot_bytes: int, batch_size: int) -> dict[str, int]:
    """The streaming loader's own peak memory, by part (bytes): each reader's window (the
    largest `window` units of the store) and the piece of a shard being read into it, the
    shared-memory slots, the main process's batches and each worker process's overhead."""
    biggest = sorted(sizes, reverse=True)
    win = sum(biggest[:window]) * (spec.resident_bytes + _ORDER_BYTES)
    read = min(biggest[0], piece or biggest[0]) * (spec.resident_bytes - 8)
    read += biggest[0] * _COLUMN_BYTES if spec.extras else 0
    batch = batch_size * sum(math.prod(f.shape) * (4 if f.dtype.is_floating_point else f.dtype.itemsize)
                             for f in spec.chunk_fields)
    readers = max(1, workers)
    return {"windows": readers * (win + read), "slots": max(1, workers) * (prefetch if workers else 1) * slot_bytes,
            "batches": _LIVE_BATCHES * batch, "workers": workers * WORKER_OVERHEAD}


def plan_streaming_memory(spec: _Spec, sizes: list[int], piece: int | None, *, workers: int,
                          window: int | None, prefetch: int | None, slot_bytes: int, batch_size: int,
                          budget: int | None = None, source: str = "") -> StreamingMemory:
    """Window and prefetch depth for a budget, and the estimate of the loader's peak.

    Without a budget, window and prefetch are as given (None: AUTO_MAX_*). With one, a given
    window or prefetch is kept and checked, and one left None is sized: the largest window up
    to AUTO_MAX_WINDOW units that fits with AUTO_MIN_PREFETCH slots per worker (or 1), then
    the deepest prefetch up to AUTO_MAX_PREFETCH in what remains. Settings that cannot fit are
    refused (LoaderError, one line with both figures), never lowered behind the user's back:
    the window decides the data order, so a window that silently depended on the budget would
    change the order (and break an exact resume) without a word. The result is a function of
    (store, spec, workers, batch size, budget) only, so the same budget gives the same order.
    """
    def est(w, p):
        return _estimate(spec, sizes, piece, workers=workers, window=w, prefetch=p, slot_bytes=slot_bytes,
                         batch_size=batch_size)

    def plan(w, p):
        parts = est(w, p)
        return StreamingMemory(w, p, sum(parts.values()), parts, budget, source)

    units = len(sizes)
    if budget is None:
        return plan(window or AUTO_MAX_WINDOW, prefetch or AUTO_MAX_PREFETCH)
    fits = lambda w, p: sum(est(w, p).values()) <= budget  # noqa: E731
    floor_p = prefetch or (AUTO_MIN_PREFETCH if fits(window or 1, AUTO_MIN_PREFETCH) else 1)
    if window is None:
        top = min(AUTO_MAX_WINDOW, units)
        window = next((w for w in range(top, 0, -1) if fits(w, floor_p)), None)
        if window is None:
            need = sum(est(1, 1).values())
            raise LoaderError(
                f"streaming loader: even 1-shard windows with {workers} workers need ~{_gib(need)}, over the "
                f"loader memory budget of {_gib(budget)} ({source}); use fewer --workers or a larger "
                "--loader-memory")
    if prefetch is None:
        prefetch = next(p for p in range(AUTO_MAX_PREFETCH, 0, -1) if p <= floor_p or fits(window, p))
    result = plan(window, prefetch)
    if result.estimate > budget:
        raise LoaderError(
            f"streaming loader: shuffle window {window} with {workers} workers and prefetch {prefetch} needs "
            f"~{_gib(result.estimate)}, over the loader memory budget of {_gib(budget)} ({source}); use a "
            "smaller --shuffle-window or fewer --workers, or a larger --loader-memory")
    return result


def build_loader(store, *, batch_size: int, kind: str = "auto", seed: int = 0, rank: int = 0,
                 world_size: int = 1, device="cpu", resident_device="cpu", workers: int = 4,
                 shuffle_window: int | None = None, prefetch: int | None = None, with_index: bool = False,
                 memory_fraction: float = 0.5, local_world_size: int | None = None,
                 split: str = "part", memory=None):
    """A ResidentLoader or StreamingLoader over `store` (a Store or its path).

    batch_size is per rank (the micro-batch one forward pass sees). kind: auto | resident |
    streaming; the choice and its reason are in loader.kind and loader.reason. split: how
    ranks share the data, "part" or "batch" (see the module's docstring). memory: the
    streaming loader's budget (see StreamingLoader); shuffle_window/prefetch None: sized by it.
    """
    store = _open(store)
    kind, rdev, reason = choose_loader(store, kind=kind, rank=rank, world_size=world_size,
                                       resident_device=resident_device, memory_fraction=memory_fraction,
                                       local_world_size=local_world_size, split=split)
    common = dict(batch_size=batch_size, seed=seed, rank=rank, world_size=world_size, device=device,
                  with_index=with_index, reason=reason, split=split)
    if kind == "resident":
        return ResidentLoader(store, resident_device=rdev, **common)
    return StreamingLoader(store, workers=workers, shuffle_window=shuffle_window, prefetch=prefetch,
                           memory=memory, local_world_size=local_world_size, **common)


# ---------------------------------------------------------------------------------------
# The common part: iteration, timing, finishing a batch on the device, state
# ---------------------------------------------------------------------------------------
class _Loader:
    kind = ""

    def __init__(self, store: Store, *, batch_size: int, seed: int, rank: int, world_size: int,
                 device, with_index: bool, reason: str, split: str):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if split not in ("part", "batch"):
            raise ValueError(f"unknown split {split!r}; use 'part' or 'batch'")
        if len(store) < world_size:
            raise ValueError(f"{store.root}: {len(store)} samples cannot be split over {world_size} ranks")
        self.store = store
        self.spec = _Spec(store)
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.split = split
        # The stream this loader follows, as (rank, world size, batch size) of the stream: its
        # own part (rank, world_size, batch_size), or, for split="batch", the single-process
        # stream (0, 1, B*W). Of each batch of that stream it keeps the rows `_my_rows`.
        if split == "batch":
            self._stream_rank, self._stream_world, self._stream_batch = 0, 1, batch_size * world_size
            first = rank * batch_size
        else:
            self._stream_rank, self._stream_world, self._stream_batch = rank, world_size, batch_size
            first = 0
        self._my_rows = slice(first, first + batch_size)
        self.device = torch.device(device)
        self.with_index = with_index
        self.reason = reason or f"{self.kind}: requested"
        self.batches = 0  # batches handed to the consumer
        self.wait_seconds = 0.0  # cumulative time spent inside __next__
        self._staged = None  # the next batch, already on its way to the device
        self._lookahead = False
        self._gen = torch.Generator(device=self.device) if self.spec.P == 2 else None

    # -- iteration -------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        try:
            batch = self._staged if self._staged is not None else self._make(self.batches)
            self._staged = None
            self.batches += 1
            if self._lookahead:  # start the next batch's copy now, so it is there at the next step
                self._staged = self._make(self.batches)
            return batch
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def _make(self, k: int) -> dict:
        raise NotImplementedError

    def _position(self, k: int) -> tuple[int, int]:
        raise NotImplementedError

    @property
    def epoch(self) -> int:
        """The epoch of the next batch's first sample."""
        return self._position(self.batches)[0]

    def _finish(self, raw: dict, epoch: int, offset: int) -> dict:
        """Raw batch (stored dtypes, on the device) -> the trainer's batch."""
        lat = raw["lat"]
        if self.spec.P == 1:
            x = lat[:, 0].float()
        else:
            self._gen.manual_seed(_seed64(self.seed, _EPS, self._stream_rank, epoch, offset))
            mean, std = lat[:, 0].float(), lat[:, 1].float()
            eps = torch.randn((self._stream_batch, *mean.shape[1:]), generator=self._gen, device=mean.device,
                              dtype=torch.float32)
            x = torch.addcmul(mean, std, eps[self._my_rows])
        out = {"x": x}
        for e in self.spec.extras:
            t = raw[e.name]
            out[e.name] = t.float() if t.is_floating_point() else t
        if self.with_index:
            out["index"], out["flip"] = raw["index"], raw["flip"]
        return out

    def _to_device(self, raw: dict) -> dict:
        if self.device.type == "cpu":
            return raw
        return {k: v.to(self.device, non_blocking=True) for k, v in raw.items()}

    # -- state -----------------------------------------------------------------------
    def _identity(self) -> dict:
        return {"kind": self.kind, "seed": self.seed, "batch_size": self.batch_size,
                "world_size": self.world_size, "split": self.split, "num_samples": len(self.store)}

    def state_dict(self) -> dict:
        e, o = self._position(self.batches)
        return {**self._identity(), "batches": self.batches, "epoch": e, "offset": o, "rank": self.rank}

    def load_state_dict(self, state: dict, *, strict: bool = True) -> None:
        """Continue after state["batches"] batches. The state of any rank resumes every rank.

        strict: refuse a state made with another seed, batch size, world size, store size or
        window (the continuation would not be exact); strict=False takes the batch count only.
        """
        mine = self._identity()
        if state.get("kind") != self.kind:
            raise LoaderStateError(
                f"loader state is for a {state.get('kind')!r} loader, this one is {self.kind!r}; "
                f"build the loader with kind={state.get('kind')!r} to resume exactly")
        diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if diff and strict:
            raise LoaderStateError(
                "loader state does not match this loader (saved, now): "
                + ", ".join(f"{k} {a!r} vs {b!r}" for k, (a, b) in diff.items())
                + "; exact resume needs the same settings (strict=False continues approximately)")
        self._reset()
        self.batches = int(state["batches"])

    def _reset(self) -> None:
        self._staged = None

    # -- lifetime --------------------------------------------------------------------
    def close(self) -> None:
        self._reset()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"{type(self).__name__}(batch_size={self.batch_size}, rank={self.rank}/{self.world_size}, "
                f"device={self.device}, batches={self.batches}; {self.reason})")


# ---------------------------------------------------------------------------------------
# Resident
# ---------------------------------------------------------------------------------------
def _rank_part(n: int, seed: int, rank: int, world_size: int) -> np.ndarray:
    """The global indices this rank holds (sorted): a fixed seeded random split of [0, n)."""
    if world_size == 1:
        return np.arange(n, dtype=np.int64)
    perm = _rng(seed, _PART, world_size).permutation(n)
    return np.sort(perm[rank::world_size])


def _upload(arr: np.ndarray, device) -> torch.Tensor:
    """An index array onto the loader's device; to a GPU through pinned memory, so the copy
    does not make the host wait for the device (an epoch's order is made mid-run)."""
    t = torch.from_numpy(arr)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class ResidentLoader(_Loader):
    """This rank's part of the store held in memory (RAM, or the GPU with resident_device="cuda").

    Epoch e is a permutation of the part seeded by (seed, rank, e), with the flip variant of
    each sample drawn alongside; a batch is an index_select from the block, converted to
    float32 on `device`. State: the number of batches consumed (epoch, offset follow).
    """

    kind = "resident"

    def __init__(self, store, *, batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1,
                 device="cpu", resident_device="cpu", with_index: bool = False, reason: str = "",
                 split: str = "part"):
        store = _open(store)
        super().__init__(store, batch_size=batch_size, seed=seed, rank=rank, world_size=world_size,
                         device=device, with_index=with_index, reason=reason, split=split)
        self.resident_device = torch.device(resident_device)
        if self.resident_device.type == "cuda" and self.device.type != "cuda":
            raise ValueError("--resident-device cuda needs --device cuda (the store would live on the GPU)")
        if self.resident_device.type == "cuda":
            self.device = self.resident_device
        part = _rank_part(len(store), seed, self._stream_rank, self._stream_world)
        self.n = len(part)
        self._block = _Block(self.spec, self.n, self.resident_device)
        for shard in store.shards:
            a, b = np.searchsorted(part, [shard.offset, shard.offset + shard.num_samples])
            if a == b:
                continue
            data = store.read(shard, fields=self.spec.read_fields)
            local = None if b - a == shard.num_samples else part[a:b] - shard.offset
            self._block.fill(int(a), data, part[a:b], local)
        self._flat = self._block.flat
        self._epochs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Data kept in RAM but trained on the GPU: gather into pinned memory, copy ahead.
        self._lookahead = self.device.type == "cuda" and self.resident_device.type != "cuda"

    @property
    def nbytes(self) -> int:
        b = self._block
        return sum(t.numel() * t.element_size() for t in [b.lat, b.index, *b.extras.values()])

    @property
    def samples_per_epoch(self) -> int:
        return self.n

    def _position(self, k: int) -> tuple[int, int]:
        return divmod(k * self._stream_batch, self.n)

    def _epoch(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(order, rows) of epoch e: sample positions, and their rows i * V + variant."""
        if e not in self._epochs:
            rng = _rng(self.seed, _EPOCH, self._stream_rank, e)
            order = rng.permutation(self.n)
            rows = order * self.spec.V + rng.integers(0, 2, self.n) if self.spec.V == 2 else order
            dev = self.resident_device
            self._epochs[e] = (_upload(order, dev), _upload(rows, dev))
            for old in [k for k in self._epochs if k < e - 1]:
                del self._epochs[old]
        return self._epochs[e]

    def _make(self, k: int) -> dict:
        e, o = self._position(k)
        B, n = self._stream_batch, self.n
        if o + B <= n:
            order, rows = (t[o:o + B] for t in self._epoch(e))
        else:  # the batch runs into the next epoch(s)
            order_parts, row_parts = [], []
            epoch, offset, need = e, o, B  # where the next piece of the batch starts
            while need:
                take = min(need, n - offset)
                epoch_order, epoch_rows = self._epoch(epoch)
                order_parts.append(epoch_order[offset:offset + take])
                row_parts.append(epoch_rows[offset:offset + take])
                need, offset = need - take, offset + take
                if offset == n:
                    epoch, offset = epoch + 1, 0
            order, rows = torch.cat(order_parts), torch.cat(row_parts)
        if self.split == "batch":  # this rank's rows of the one-process batch
            order, rows = order[self._my_rows], rows[self._my_rows]
        pin = self._lookahead
        raw = {"lat": self._select(self._flat, rows, pin).view(-1, self.spec.P, *self.spec.lat_shape)}
        for name, t in self._block.extras.items():
            raw[name] = self._select(t, order, pin)
        if self.with_index:
            raw["index"] = self._select(self._block.index, order, pin)
            raw["flip"] = (rows % self.spec.V).bool()
        return self._finish(self._to_device(raw), e, o)

    @staticmethod
    def _select(t: torch.Tensor, idx: torch.Tensor, pin: bool) -> torch.Tensor:
        if not pin:
            return t.index_select(0, idx)
        out = torch.empty((len(idx), *t.shape[1:]), dtype=t.dtype, pin_memory=True)
        return torch.index_select(t, 0, idx, out=out)


# ---------------------------------------------------------------------------------------
# Streaming: the plan (pure functions of the seed), windows, chunks, workers
# ---------------------------------------------------------------------------------------
def _units(store: Store, world_size: int) -> list[tuple[int, int, int]]:
    """(shard index, start, stop) read as one piece: whole shards, or row ranges of them
    when the store has fewer non-empty shards than ranks."""
    shards = [(s.index, 0, s.num_samples) for s in store.shards if s.num_samples > 0]
    if len(shards) >= world_size:
        return shards
    pieces = [(i, n * r // world_size, n * (r + 1) // world_size)
              for i, _, n in shards for r in range(world_size)]
    return [p for p in pieces if p[2] > p[1]]


@dataclass(frozen=True)
class _Job:
    """One window of one epoch, to be cut into chunks [begin, end) of the epoch's stream."""

    epoch: int
    window: int
    units: tuple[int, ...]
    start: int  # epoch offset of the window's first sample
    begin: int  # first sample to emit (start, or later when resuming inside the window)
    end: int
    phase: int  # batches of this epoch begin at offsets = phase (mod batch_size)

    def cuts(self, batch_size: int):
        """(a, b): pieces of [begin, end) that never cross a batch boundary."""
        a = self.begin
        while a < self.end:
            b = min(self.end, a + ((self.phase - a) % batch_size or batch_size))
            yield a, b
            a = b


class _Plan:
    """Everything about the streaming order that is a pure function of the settings."""

    def __init__(self, store: Store, *, seed: int, rank: int, world_size: int, window: int,
                 batch_size: int):
        if window < 1:
            raise ValueError(f"shuffle_window must be >= 1, got {window}")
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.window, self.batch_size = window, batch_size
        self.units = _units(store, world_size)
        if len(self.units) < world_size:
            raise ValueError(f"{store.root}: too few samples to give each of {world_size} ranks a part")
        self.offsets = [store.shards[s].offset for s, _, _ in self.units]
        self.sizes = [b - a for _, a, b in self.units]
        self._memo = (0, 0, 0)  # (samples, epoch, offset): a known position
        self._windows: dict[int, tuple[tuple[int, ...], ...]] = {}

    def windows(self, epoch: int) -> tuple[tuple[int, ...], ...]:
        """This rank's windows in epoch e: groups of `window` units, in the epoch's order."""
        if epoch not in self._windows:
            order = _rng(self.seed, _UNITS, epoch).permutation(len(self.units))
            mine = [int(u) for u in order[self.rank::self.world_size]]
            if len(self._windows) >= 64:
                self._windows.clear()
            self._windows[epoch] = tuple(tuple(mine[i:i + self.window])
                                         for i in range(0, len(mine), self.window))
        return self._windows[epoch]

    def window_size(self, units) -> int:
        return sum(self.sizes[u] for u in units)

    def epoch_size(self, epoch: int) -> int:
        if self.world_size == 1:
            return sum(self.sizes)
        return sum(self.window_size(w) for w in self.windows(epoch))

    def window_order(self, epoch: int, w: int, n: int, flip: bool) -> tuple[np.ndarray, np.ndarray]:
        rng = _rng(self.seed, _WINDOW, self.rank, epoch, w)
        perm = rng.permutation(n)
        flips = rng.integers(0, 2, n) if flip else np.zeros(n, dtype=np.int64)
        return perm, flips

    def advance(self, epoch: int, offset: int, n: int) -> tuple[int, int]:
        offset += n
        while offset >= (size := self.epoch_size(epoch)):
            offset -= size
            epoch += 1
        return epoch, offset

    def position(self, samples: int) -> tuple[int, int]:
        """(epoch, offset) of the samples-th sample of this rank's stream."""
        s0, e, o = self._memo if self._memo[0] <= samples else (0, 0, 0)
        if self.world_size == 1:
            e, o = divmod(samples, self.epoch_size(0))
        else:
            e, o = self.advance(e, o, samples - s0)
        self._memo = (samples, e, o)
        return e, o

    def jobs(self, epoch: int, offset: int):
        """The windows from position (epoch, offset) on, forever; consumed ones skipped."""
        phase, first = offset % self.batch_size, True
        while True:
            start = 0
            for w, units in enumerate(self.windows(epoch)):
                end = start + self.window_size(units)
                begin = max(start, offset) if first else start
                if begin < end:
                    yield _Job(epoch, w, units, start, begin, end, phase)
                start = end
            phase, first, epoch = (phase - start) % self.batch_size, False, epoch + 1


def _read_window(store: Store, spec: _Spec, plan: _Plan, job: _Job, piece: int | None = None,
                 probe=None) -> _Block:
    """The job's units read into one block, `piece` rows per read (None: a unit at once).
    probe(): called once, at the reader's peak (the block filled, the last piece still held)."""
    block = _Block(spec, plan.window_size(job.units), "cpu")
    pos = 0
    for i, u in enumerate(job.units):
        s, lo, hi = plan.units[u]
        step = piece or hi - lo
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            data = store.read(s, fields=spec.read_fields, start=a, stop=b)
            first = plan.offsets[u] + a
            block.fill(pos, data, np.arange(first, first + b - a))
            if probe is not None and b == hi and i == len(job.units) - 1:
                probe()
            del data  # before the next piece is read
            pos += b - a
    return block


def _private_bytes() -> int | None:
    """This process's private (unshared) memory in bytes: what a forked worker allocated or
    copied since the fork. None where /proc/self/smaps_rollup cannot be read (not Linux).
    About 4 ms (the kernel walks every mapping), so it is read once per window."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return sum(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("Private_"))
    except (OSError, ValueError, IndexError):
        return None


def _job_chunks(store: Store, spec: _Spec, plan: _Plan, job: _Job, piece: int | None = None,
                probe=None):
    """Read the job's window, shuffle it; yield (a, m, last, gather) per chunk, where
    gather(out) writes the chunk's m samples into the views `out`."""
    block = _read_window(store, spec, plan, job, piece, probe)
    perm, flips = plan.window_order(job.epoch, job.window, block.n, spec.V == 2)
    perm_t, flips_t = torch.from_numpy(perm), torch.from_numpy(flips)
    rows_t = perm_t * spec.V + flips_t
    flat = block.flat
    for a, b in job.cuts(plan.batch_size):
        lo, hi = a - job.start, b - job.start
        m = b - a

        def gather(out, lo=lo, hi=hi, m=m):
            samples = perm_t[lo:hi]  # the chunk's samples, as rows of the block
            torch.index_select(flat, 0, rows_t[lo:hi], out=out["lat"][:m].view(m, -1))
            for name, t in block.extras.items():
                torch.index_select(t, 0, samples, out=out[name][:m])
            torch.index_select(block.index, 0, samples, out=out["index"][:m])
            out["flip"][:m].copy_(flips_t[lo:hi])

        yield a, m, b == job.end, gather


def _slot_layout(spec: _Spec, batch_size: int) -> tuple[list[tuple[_Field, int, int]], int]:
    """Where each field of a chunk lies in a slot of raw bytes (64-byte aligned)."""
    layout, off = [], 0
    for f in spec.chunk_fields:
        nbytes = batch_size * f.nbytes
        layout.append((f, off, nbytes))
        off += (nbytes + 63) // 64 * 64
    return layout, max(off, 64)


def _slot_views(buf: torch.Tensor, layout, batch_size: int) -> dict[str, torch.Tensor]:
    return {f.name: buf[off:off + nbytes].view(f.dtype).view(batch_size, *f.shape)
            for f, off, nbytes in layout}


def _return_large_frees() -> None:
    """Have glibc's malloc serve every allocation of 1 MiB or more by mmap, so that a freed
    window or shard piece goes back to the system at once. By default the threshold rises to
    the size of the largest block freed, after which windows and pieces come from the heap,
    whose freed parts are mostly kept: measured here, a worker then held about 1.5 windows'
    worth more than its window and piece. A no-op off glibc."""
    try:
        import ctypes

        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (fixing it also stops the rise)
    except (OSError, AttributeError):
        pass


def _worker_main(wid: int, nworkers: int, cfg: dict, slots: torch.Tensor, free_q, out_q,
                 stop, peaks: torch.Tensor) -> None:
    """A streaming worker: produce jobs wid, wid + nworkers, ... into free slots, in order.
    peaks[wid] (shared memory) keeps the largest private memory measured at a window's read."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    parent = multiprocessing.parent_process()  # to notice an orphaned worker
    try:
        torch.set_num_threads(1)
        _return_large_frees()
        store = open_store(**cfg["store"])
        spec = _Spec(store)
        plan = _Plan(store, seed=cfg["seed"], rank=cfg["rank"], world_size=cfg["world_size"],
                     window=cfg["window"], batch_size=cfg["batch_size"])
        layout, _ = _slot_layout(spec, plan.batch_size)
        views = [_slot_views(slots[s], layout, plan.batch_size) for s in range(len(slots))]

        def probe():
            if (now := _private_bytes()) is not None and now > peaks[wid]:
                peaks[wid] = now

        for j, job in enumerate(plan.jobs(cfg["epoch"], cfg["offset"])):
            if j % nworkers != wid:
                continue
            # gather holds the window (its closure); drop the last one before the next window
            # is read, or a worker holds two windows at once
            gather = None
            for a, m, last, gather in _job_chunks(store, spec, plan, job, cfg["piece"], probe):
                slot = None
                while slot is None:
                    if stop.is_set() or (parent is not None and not parent.is_alive()):
                        out_q.cancel_join_thread()  # exit now, even if the main process stopped reading
                        return
                    try:
                        slot = free_q.get(timeout=0.2)
                    except queue.Empty:
                        pass
                gather(views[slot])
                out_q.put(("chunk", j, job.epoch, a, m, last, slot))
    except Exception:
        out_q.put(("error", wid, traceback.format_exc()))


class StreamingLoader(_Loader):
    """Shards read in bulk by worker processes, shuffled in windows, batches in canonical order.

    workers: processes (0: read in this process, for debugging). shuffle_window: shards
    shuffled together (memory per worker is about one window). prefetch: batch slots per
    worker (shared memory), i.e. how far ahead each worker may run.

    memory: a budget for the loader's own peak memory (worker windows, the piece of a shard
    being read, shared-memory slots, the main process's batches, the workers' overhead):
    "auto" (see loader_budget), a size ("2GiB", "512MiB") or bytes; None: no budget.
    With a budget, shuffle_window/prefetch None are sized to fit it, and given ones that do
    not fit are REFUSED (LoaderError naming the need and the budget), not lowered: the window
    is the data order. `memory_plan` holds the sizing (estimate, budget, parts);
    `memory_estimate` the estimated peak in bytes; `reason` ends with both. Without a budget,
    None means 4 (AUTO_MAX_WINDOW, AUTO_MAX_PREFETCH: the defaults before the budget).
    """

    kind = "streaming"

    def __init__(self, store, *, batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1,
                 device="cpu", workers: int = 4, shuffle_window: int | None = None,
                 prefetch: int | None = None, with_index: bool = False, reason: str = "", split: str = "part",
                 mp_context: str | None = None, memory=None, local_world_size: int | None = None):
        store = _open(store)
        super().__init__(store, batch_size=batch_size, seed=seed, rank=rank, world_size=world_size,
                         device=device, with_index=with_index, reason=reason, split=split)
        self.workers = max(0, workers)
        self._layout, self._slot_bytes = _slot_layout(self.spec, self._stream_batch)
        self._piece = _read_piece_rows(store, self.spec)
        budget, source = (None, "") if memory is None else loader_budget(
            memory, world_size=world_size, local_world_size=local_world_size)
        if shuffle_window is not None and shuffle_window < 1:
            raise ValueError(f"shuffle_window must be >= 1, got {shuffle_window}")
        prefetch = None if prefetch is None else max(1, prefetch)
        self.memory_plan = plan_streaming_memory(
            self.spec, [b - a for _, a, b in _units(store, self._stream_world)], self._piece,
            workers=self.workers, window=shuffle_window, prefetch=prefetch, slot_bytes=self._slot_bytes,
            batch_size=self._stream_batch, budget=budget, source=source)
        self.shuffle_window, self.prefetch = self.memory_plan.window, self.memory_plan.prefetch
        self.plan = _Plan(store, seed=seed, rank=self._stream_rank, world_size=self._stream_world,
                          window=self.shuffle_window, batch_size=self._stream_batch)
        self.reason += f"; window {self.shuffle_window}, prefetch {self.prefetch}, {self.memory_plan.describe()}"
        self._ctx = torch.multiprocessing.get_context(
            mp_context or ("fork" if "fork" in torch.multiprocessing.get_all_start_methods() else None))
        self._pin = self.device.type == "cuda"
        self._lookahead = self.device.type == "cuda"
        self._running = False
        self._procs: list = []
        # each worker's largest private memory at a window's read, kept across restarts
        self._peaks = torch.zeros(max(1, self.workers), dtype=torch.int64).share_memory_()

    @property
    def memory_estimate(self) -> int:
        """The estimated peak of the loader's own memory, in bytes (see memory_plan)."""
        return self.memory_plan.estimate

    def measured_memory(self) -> dict | None:
        """What the workers measured of the loader's peak so far, in bytes: "workers" (the sum
        of each worker's largest private memory, read at the end of each window's read, where a
        worker peaks; an upper bound of what they held at once), "slots" (the shared memory,
        allocated once), "measured" (their sum) and "estimate" (the plan's figure for the same
        parts. None with workers=0 (the reading is the main process's own memory) or before
        a window was read, or off Linux."""
        if self.workers == 0 or not int(self._peaks.max()):
            return None
        parts = self.memory_plan.parts
        workers, slots = int(self._peaks.sum()), parts["slots"]
        return {"workers": workers, "slots": slots, "measured": workers + slots,
                "estimate": parts["windows"] + parts["workers"] + slots}

    def describe_measured(self) -> str | None:
        """The end-of-run line for measured_memory(); None where nothing was measured."""
        m = self.measured_memory()
        if m is None:
            return None
        return (f"streaming loader memory: measured peak ~{_gib(m['measured'])} (workers' private "
                f"{_gib(m['workers'])} + shared slots {_gib(m['slots'])}) against the estimate "
                f"~{_gib(m['estimate'])} for the same parts"
                + (f"; budget {_gib(self.memory_plan.budget)}" if self.memory_plan.budget else ""))

    @property
    def samples_per_epoch(self) -> int:
        """This rank's samples in the current epoch (constant unless world_size > 1)."""
        return self.plan.epoch_size(self.epoch)

    def _identity(self) -> dict:
        return {**super()._identity(), "shuffle_window": self.shuffle_window}

    def _position(self, k: int) -> tuple[int, int]:
        return self.plan.position(k * self._stream_batch)

    # -- producing -------------------------------------------------------------------
    def _start(self, k: int) -> None:
        self._cursor = self._position(k)  # where the next chunk must begin
        self._job = 0  # index of the job the next chunk belongs to, from this start
        e, o = self._cursor
        if self.workers == 0:
            self._jobs = self.plan.jobs(e, o)
            self._chunks = None
            self._local = _slot_views(torch.empty(self._slot_bytes, dtype=torch.uint8), self._layout,
                                      self._stream_batch)
        else:
            cfg = {"store": self.store.open_args(), "seed": self.seed, "rank": self._stream_rank,
                   "world_size": self._stream_world, "window": self.shuffle_window,
                   "batch_size": self._stream_batch, "epoch": e, "offset": o, "piece": self._piece}
            ctx = self._ctx
            self._stop = ctx.Event()
            # Objects of this process that exist at the fork are moved out of the collector's
            # reach in the workers: a worker's collections would otherwise touch (and so copy,
            # page by page) the whole inherited Python heap, ~50 MiB of private memory per
            # worker measured here. The parent's objects are put back after the forks.
            gc.freeze()
            self._procs, self._free, self._out, self._views = [], [], [], []
            for wid in range(self.workers):
                slots = torch.empty((self.prefetch, self._slot_bytes), dtype=torch.uint8).share_memory_()
                free, out = ctx.Queue(), ctx.Queue()
                for s in range(self.prefetch):
                    free.put(s)
                p = ctx.Process(target=_worker_main, name=f"dittrain-stream-{wid}", daemon=True,
                                args=(wid, self.workers, cfg, slots, free, out, self._stop, self._peaks))
                p.start()
                self._procs.append(p)
                self._free.append(free)
                self._out.append(out)
                self._views.append([_slot_views(slots[s], self._layout, self._stream_batch)
                                    for s in range(self.prefetch)])
            gc.unfreeze()
        self._running = True

    def _recv(self, wid: int):
        q, p = self._out[wid], self._procs[wid]
        while True:
            try:
                msg = q.get(timeout=1.0)
            except queue.Empty:
                if not p.is_alive():
                    self.close()
                    raise RuntimeError(
                        f"streaming loader worker {wid} exited unexpectedly (exit code {p.exitcode}); "
                        "out of memory? try fewer workers or a smaller shuffle_window") from None
                continue
            if msg[0] == "error":
                self.close()
                raise RuntimeError(f"streaming loader worker {msg[1]} failed:\n{msg[2]}")
            return msg

    def _next_chunk(self):
        """(epoch, a, m, views, release) of the next chunk in canonical order."""
        if self.workers == 0:
            while True:
                if self._chunks is None:
                    job = next(self._jobs)
                    self._chunks = (job.epoch, _job_chunks(self.store, self.spec, self.plan, job, self._piece))
                epoch, chunks = self._chunks
                nxt = next(chunks, None)
                if nxt is not None:
                    break
                self._chunks = None
            a, m, last, gather = nxt
            gather(self._local)
            if last:
                self._chunks = None
            return epoch, a, m, self._local, lambda: None
        wid = self._job % self.workers
        _, j, epoch, a, m, last, slot = self._recv(wid)
        if j != self._job:
            raise RuntimeError(f"streaming loader: worker {wid} sent window job {j}, expected {self._job}")
        if last:
            self._job += 1
        return epoch, a, m, self._views[wid][slot], lambda: self._free[wid].put(slot)

    def _make(self, k: int) -> dict:
        if not self._running:
            self._start(k)
        e0, o0 = self._cursor
        B = self._stream_batch
        # The host batch: pinned in the stored dtypes when bound for the GPU (half the bytes
        # over PCIe, converted there); on the CPU, straight into float32 (one pass).
        dst = {}
        for f in self.spec.chunk_fields:
            if self._pin:
                dst[f.name] = torch.empty((B, *f.shape), dtype=f.dtype, pin_memory=True)
            else:
                dt = torch.float32 if f.dtype.is_floating_point else f.dtype
                dst[f.name] = torch.empty((B, *f.shape), dtype=dt)
        filled = 0
        while filled < B:
            epoch, a, m, views, release = self._next_chunk()
            if (epoch, a) != self._cursor or filled + m > B:
                self.close()
                raise RuntimeError(f"streaming loader out of sequence: got chunk ({epoch}, {a}, {m}) "
                                   f"at {self._cursor} with {filled}/{B} filled")
            for name, t in dst.items():
                t[filled:filled + m].copy_(views[name][:m])
            release()  # the slot is free for the worker again
            filled += m
            self._cursor = self.plan.advance(epoch, a, m)
        if not self.with_index:
            del dst["index"], dst["flip"]
        if self.split == "batch":  # this rank's rows of the one-process batch
            dst = {k: v[self._my_rows] for k, v in dst.items()}
        return self._finish(self._to_device(dst), e0, o0)

    # -- lifetime --------------------------------------------------------------------
    def _reset(self) -> None:
        super()._reset()
        self._shutdown()

    def _shutdown(self) -> None:
        if not self._running:
            return
        self._running = False
        if self.workers == 0:
            self._jobs = self._chunks = None
            return
        self._stop.set()
        for p in self._procs:
            p.join(timeout=5)
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=2)
        for q in self._free + self._out:
            q.cancel_join_thread()
            q.close()
        self._procs, self._free, self._out, self._views = [], [], [], []

    def close(self) -> None:
        """Stop the worker processes (a later next() starts them again where it left off)."""
        self._reset()

    def __del__(self):
        try:
            self._shutdown()
        except Exception:
            pass
