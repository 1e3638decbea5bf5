"""The memory a loader may use: what is available (RAM, the memory limit of a container's or a
scheduler job's cgroup, a GPU), the choice between the resident and the streaming loader, and
the streaming loader's budget, which sizes its shuffle window and prefetch depth
(StreamingMemory, plan_streaming_memory). The stores of a mixture share that memory (choose_mixture).

Sizes in messages are MiB below 1 GiB and GiB above (_gib). The memory probes
(available_memory, gpu_memory) are called through this module's globals, so replacing them here
(or on the package, which forwards) fakes the machine.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ditdata.common import devices
from ditdata.common.bytesize import format_size, parse_size
from ditdata.common.dist import launch_env
from ditdata.store import Store
from dittrain.config import LoaderConfig

from .base import LoaderError, _open, _Spec

# ---------------------------------------------------------------------------------------
# The memory available, and choosing a loader
# ---------------------------------------------------------------------------------------
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


# Where the kernel says which cgroups this process is in, and where the cgroup filesystem is
# mounted. Module globals (read at each call) so that a test can point them at a fake tree.
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"
# cgroup v1 writes "no limit" as the largest page-aligned int64, not as a word.
_NO_LIMIT = 1 << 60
# (folder under the root, limit file, usage file, memory.stat keys of the reclaimable page
# cache) of cgroup v2 and of v1's memory controller. v1's total_inactive_file counts the
# children too (inactive_file, the fallback, only the cgroup's own pages).
_CGROUP_V2 = ("", "memory.max", "memory.current", ("inactive_file",))
_CGROUP_V1 = ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
              ("total_inactive_file", "inactive_file"))


def _read_int(path: Path) -> int | None:
    """An integer file's value; None for "max", garbage or a file that cannot be read."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _reclaimable(stat: Path, keys: tuple[str, ...]) -> int:
    """The inactive page cache in a cgroup's memory.stat (0 where unknown). It is charged to the
    cgroup, but the kernel drops it before it OOM-kills anything, so it is room, as MemAvailable
    counts it: a job whose earlier step read the store would otherwise look full."""
    try:
        fields = dict(line.split()[:2] for line in stat.read_text().splitlines() if len(line.split()) >= 2)
    except (OSError, UnicodeDecodeError):
        return 0
    for key in keys:
        try:
            return max(0, int(fields[key]))
        except (KeyError, ValueError):
            continue
    return 0


def _cgroup_room(root: Path, path: str, version: tuple) -> tuple[int, str] | None:
    """(bytes left under the tightest limit among `path` and its parents, which limit that was)."""
    folder, limit_file, usage_file, stat_keys = version
    # `path` and its parents up to the root, leaf first: /a/b -> /a/b, /a, /. A limit anywhere
    # above a cgroup binds it too (Slurm sets the job's on /slurm/uid_N/job_M, and the step runs
    # below it). A path that climbs out of the mount ("/../x": the process sits outside the
    # cgroup namespace's root) cannot be followed: only the root is read.
    parts = [p for p in path.split("/") if p]
    levels = ["/"] if ".." in parts else ["/" + "/".join(parts[:i]) for i in range(len(parts), -1, -1)]
    best = None
    for level in levels:
        where = root / folder / level.lstrip("/")
        limit = _read_int(where / limit_file)
        if limit is None or limit <= 0 or limit >= _NO_LIMIT:
            continue
        # An unreadable usage leaves the limit itself as the room: still an upper bound, and
        # tighter than ignoring a limit that is there.
        usage = _read_int(where / usage_file) or 0
        used = max(0, usage - _reclaimable(where / "memory.stat", stat_keys))
        room = max(0, limit - used)
        if best is None or room < best[0]:
            best = (room, f"the cgroup memory limit of {level} ({limit_file})")
    return best


def _cgroup_available(proc_cgroup: str | None = None, root: str | Path | None = None
                      ) -> tuple[int, str] | None:
    """(bytes left under this process's cgroup memory limit, which cgroup's limit that is), or
    None where no level has one. The cgroup is the one /proc/self/cgroup names, read under the
    cgroup root with its parents, so that a job scheduler's limit is found without a cgroup
    namespace too (Slurm: /sys/fs/cgroup/slurm/uid_1/job_5/memory.max), and a namespaced
    container's at the root. Both v2 and v1's memory controller are read (a hybrid machine
    mounts v2 without the memory controller); the tightest room wins."""
    # The cgroup v2 path and the v1 memory controller's path of this process, "/" for one not
    # named: /proc/self/cgroup holds `0::/path` (v2) and `N:memory:/path` (v1) lines. An
    # unreadable file leaves both "/", the mount's own files (a namespaced container's view).
    v2 = v1 = "/"
    try:
        text = Path(proc_cgroup or PROC_CGROUP).read_text()
    except (OSError, UnicodeDecodeError):
        text = ""
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, sep, path = rest.partition(":")
        if not sep or not path.startswith("/"):
            continue
        if hierarchy == "0" and not controllers:
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    root = Path(root or CGROUP_ROOT)
    found = [r for r in (_cgroup_room(root, v2, _CGROUP_V2), _cgroup_room(root, v1, _CGROUP_V1)) if r]
    return min(found, default=None)


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
    if cg is not None and cg[0] < avail:
        avail, source = cg
    return avail, source


def gpu_memory(device) -> tuple[int | None, str]:
    """(free bytes on a CUDA device, where that figure came from); None without CUDA."""
    memory = devices.gpu_memory(device)
    if memory is None:
        return None, "CUDA is not available"
    return memory[0], f"free memory of {torch.device(device)} (torch.cuda.mem_get_info)"


def _gib(b: float) -> str:
    """Memory as the loaders' messages give it: MiB below 1 GiB, else GiB."""
    return format_size(b, smallest="MiB")


def choose_loader(store, *, kind: str = "auto", rank: int = 0, world_size: int = 1,
                  resident_device="cpu", memory_fraction: float = LoaderConfig.memory_fraction,
                  local_world_size: int | None = None, split: str = "part") -> tuple[str, str, str]:
    """(kind, resident_device, reason): "resident" when this rank's part of the store fits
    in under `memory_fraction` of the available memory (GPU memory for resident_device
    "cuda", else RAM shared by the `local_world_size` ranks of this machine), else "streaming".
    """
    store = _open(store)
    spec = _Spec(store)
    # this rank's part: the first len % world_size ranks hold one sample more
    n = (len(store) // world_size + (1 if rank < len(store) % world_size else 0)) if split == "part" else len(store)
    need = n * (spec.resident_bytes + spec.text_bytes)  # unpadded text: its pieces and pool at once, while loading
    held = f"{_gib(need)} as stored" + (f", of it REPA targets {_gib(n * spec.target_bytes)}" if spec.target_bytes else "")
    what = (f"this rank's part ({n:,} samples, {held})" if split == "part"
            else f"the whole store for this rank (split='batch': {n:,} samples, {held})")
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


def choose_bucketed(store, *, kind: str = "auto", world_size: int = 1, resident_device="cpu",
                    local_world_size: int | None = None) -> str:
    """The reason of a bucketed store's loader (dittrain.data.bucketed): always resident, every
    rank holding the whole store (its buckets), refused (LoaderError) where that cannot fit, as an
    explicit resident loader is, and for kind "streaming" (not supported for buckets)."""
    if kind == "streaming":
        raise LoaderError(f"--loader streaming: {store.root} is a bucketed store (aspect-ratio buckets), which is "
                          "read into memory only; use --loader auto or resident")
    if kind not in ("auto", "resident", "bucketed"):
        raise ValueError(f"unknown loader kind {kind!r}; use auto, resident or streaming")
    need = sum(b.num_samples * _Spec(b.store).resident_bytes for b in store.buckets)
    what = f"its {len(store.buckets)} buckets ({len(store):,} samples, {_gib(need)} as stored)"
    fit = _check_resident_fits(torch.device(resident_device), need, _local_ranks(local_world_size, world_size), what)
    return (f"bucketed: resident (a bucketed store is held in memory; streaming one is not supported); "
            f"{what}{fit}; every batch from one bucket")


def choose_mixture(stores, *, kind: str = "auto", rank: int = 0, world_size: int = 1, resident_device="cpu",
                   memory_fraction: float = LoaderConfig.memory_fraction, local_world_size: int | None = None,
                   split: str = "part", memory=None, kinds: list[str] | None = None) -> tuple[list, str]:
    """choose_loader for the stores of a mixture (dittrain.data.mixture), which share one memory:
    ([(kind, resident_device, streaming budget) per store], reason). resident: every store held, refused
    (LoaderError) unless they fit TOGETHER; auto: the smallest stores resident while together they fit under
    memory_fraction of the memory (as one store does in choose_loader), the rest streaming; streaming: all
    streaming; kinds: given per store (a resume keeps its checkpoint's). The streaming stores share the loader
    budget (`memory`, as loader_budget reads it; None: no budget) in equal parts, so the mixture's readers
    together stay within what one store's would use."""
    stores = [_open(s) for s in stores]
    if kind not in ("auto", "resident", "streaming"):
        raise ValueError(f"unknown loader kind {kind!r}; use auto, resident or streaming")
    needs = []
    for store in stores:
        spec = _Spec(store)
        n = (len(store) // world_size + (1 if rank < len(store) % world_size else 0)) if split == "part" else len(store)
        needs.append(n * (spec.resident_bytes + spec.text_bytes))
    rdev, local = torch.device(resident_device), _local_ranks(local_world_size, world_size)
    what = f"the {len(stores)} stores for this rank ({_gib(sum(needs))} as stored)"
    if kinds is not None:
        resident = {i for i, k in enumerate(kinds) if k == "resident"}
        why = "the checkpoint's loaders, so the data order continues"
    elif kind == "resident":
        fit = _check_resident_fits(rdev, sum(needs), local, what)
        resident, why = set(range(len(stores))), f"requested (loader='resident'), {what}{fit}"
    elif kind == "streaming":
        resident, why = set(), "requested (loader='streaming')"
    else:
        if rdev.type == "cuda":
            (avail, source), per = gpu_memory(rdev), 1
        else:
            (avail, source), per = available_memory(), local
        resident, total = set(), 0
        for i in sorted(range(len(stores)), key=lambda i: needs[i]):  # the smallest first: the most stores held
            if avail is not None and (total + needs[i]) * per <= memory_fraction * avail:
                resident.add(i)
                total += needs[i]
        room = f"{_gib(avail)}, {source}" if avail is not None else "available memory unknown"
        why = (f"auto: {len(resident)} of {len(stores)} stores held, together {_gib(total * per)} of the memory "
               f"({room}; limit {memory_fraction:.0%})")
    streaming = [i for i in range(len(stores)) if i not in resident]
    budget = None
    if streaming and memory is not None:
        whole, source = loader_budget(memory, world_size=world_size, local_world_size=local_world_size)
        budget = max(1, whole // len(streaming))
        why += f"; {len(streaming)} streaming store(s) share the loader budget {_gib(whole)} ({source})"
    return [("resident", str(rdev), None) if i in resident else ("streaming", "cpu", budget)
            for i in range(len(stores))], why


def _local_ranks(local_world_size: int | None, world_size: int) -> int:
    """How many ranks share this machine's RAM (each holds its own resident part)."""
    local = local_world_size or launch_env().local_world_size
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
# A shard of a backend with random access (zarr) is read in row pieces of about this many
# bytes, so that a worker holds its window plus one piece rather than plus a second copy of a
# whole shard. Any other (wds) is read whole: a row range of a tar is found by scanning it
# from the start.
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
    """--loader-memory in bytes (ditdata.common.bytesize: "2GiB", "512MiB", "1.5G", "2GB" decimal,
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
    # REPA targets (a feature set): bytes per sample as held, and their share of `estimate`
    # (already inside the parts: windows, slots and batches each carry them)
    target_bytes: int = 0
    targets: int = 0

    def describe(self) -> str:
        made = ", ".join(f"{k} {_gib(v)}" for k, v in self.parts.items() if v)
        if self.target_bytes:
            made += (f"; targets {format_size(self.target_bytes, smallest='KiB')}/sample, "
                     f"~{_gib(self.targets)} of it")
        if self.budget is None:
            return f"memory ~{_gib(self.estimate)} ({made}; no budget)"
        return f"memory ~{_gib(self.estimate)} of budget {_gib(self.budget)} ({made}; budget {self.source})"


def _read_piece_rows(store: Store, spec: _Spec) -> int | None:
    """Rows per read of a shard (None: the whole shard at once, see READ_PIECE_BYTES)."""
    if not store.backend.random_access:
        return None
    # the targets count: they are read with the latents, and are often 10-50x their size
    return max(1, READ_PIECE_BYTES // (spec.resident_bytes - 8))


def _batch_bytes(fields) -> int:
    """Bytes per sample of a host batch of these chunk fields as the CPU path assembles them
    (_Field.cpu_dtype: floats and the latents, int8 ones too, as float32; the REPA targets
    ("feat") as stored, dequantized by dittrain.data.targets in the step)."""
    return sum(math.prod(f.shape) * f.cpu_dtype.itemsize for f in fields)


def _estimate(spec: _Spec, sizes: list[int], piece: int | None, *, workers: int, window: int,
              prefetch: int, slot_bytes: int, batch_size: int) -> dict[str, int]:
    """The streaming loader's own peak memory, by part (bytes): each reader's window (the
    largest `window` units of the store) and the piece of a shard being read into it, the
    shared-memory slots, the main process's batches and each worker process's overhead.
    The REPA targets are inside each (resident_bytes, the slot layout, the chunk fields), and so
    are unpadded text tokens: at the store's mean caption length in a window (twice while its
    pieces are joined: text_bytes), at the longest (L_max) in the slots and batches."""
    biggest = sorted(sizes, reverse=True)
    win = sum(biggest[:window]) * (spec.resident_bytes + spec.text_bytes + _ORDER_BYTES)
    read = min(biggest[0], piece or biggest[0]) * (spec.resident_bytes - 8)
    read += biggest[0] * _COLUMN_BYTES if spec.extras else 0
    readers = max(1, workers)
    return {"windows": readers * (win + read), "slots": _slots(workers, prefetch) * slot_bytes,
            "batches": _LIVE_BATCHES * batch_size * _batch_bytes(spec.chunk_fields),
            "workers": workers * WORKER_OVERHEAD}


def _slots(workers: int, prefetch: int) -> int:
    """Shared-memory slots (workers=0: the one in-process chunk buffer)."""
    return max(1, workers) * (prefetch if workers else 1)


def _target_share(spec: _Spec, sizes: list[int], piece: int | None, *, workers: int, window: int,
                  prefetch: int, batch_size: int) -> int:
    """The bytes of _estimate's figure that are the REPA targets: their share of each
    reader's window and piece, of the slots and of the batches (0 without a feature set)."""
    if not spec.target_fields:
        return 0
    biggest = sorted(sizes, reverse=True)
    held = sum(biggest[:window]) + min(biggest[0], piece or biggest[0])
    slot = batch_size * sum(f.nbytes for f in spec.target_fields)
    return (max(1, workers) * held * spec.target_bytes + _slots(workers, prefetch) * slot
            + _LIVE_BATCHES * batch_size * _batch_bytes(spec.target_fields))


def _of_targets(m: StreamingMemory) -> str:
    """What of a refused estimate the REPA targets are ("" without a feature set)."""
    if not m.target_bytes:
        return ""
    return f" (~{_gib(m.targets)} of it REPA targets, {format_size(m.target_bytes, smallest='KiB')}/sample)"


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
        share = _target_share(spec, sizes, piece, workers=workers, window=w, prefetch=p, batch_size=batch_size)
        return StreamingMemory(w, p, sum(parts.values()), parts, budget, source, spec.target_bytes, share)

    units = len(sizes)
    if budget is None:
        return plan(window or AUTO_MAX_WINDOW, prefetch or AUTO_MAX_PREFETCH)
    fits = lambda w, p: sum(est(w, p).values()) <= budget  # noqa: E731
    floor_p = prefetch or (AUTO_MIN_PREFETCH if fits(window or 1, AUTO_MIN_PREFETCH) else 1)
    if window is None:
        top = min(AUTO_MAX_WINDOW, units)
        window = next((w for w in range(top, 0, -1) if fits(w, floor_p)), None)
        if window is None:
            one = plan(1, 1)
            raise LoaderError(
                f"streaming loader: even 1-shard windows with {workers} workers need ~{_gib(one.estimate)}"
                f"{_of_targets(one)}, over the "
                f"loader memory budget of {_gib(budget)} ({source}); use fewer --workers or a larger "
                "--loader-memory")
    if prefetch is None:
        prefetch = next(p for p in range(AUTO_MAX_PREFETCH, 0, -1) if p <= floor_p or fits(window, p))
    result = plan(window, prefetch)
    if result.estimate > budget:
        raise LoaderError(
            f"streaming loader: shuffle window {window} with {workers} workers and prefetch {prefetch} needs "
            f"~{_gib(result.estimate)}{_of_targets(result)}, over the loader memory budget of {_gib(budget)} ({source}); use a "
            "smaller --shuffle-window or fewer --workers, or a larger --loader-memory")
    return result

