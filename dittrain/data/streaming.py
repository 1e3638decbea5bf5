"""StreamingLoader: for stores larger than memory. Worker processes read windows of whole
shards in bulk, shuffle each window in memory and cut it into batches that travel through
shared-memory slots; the main process puts them back into the canonical order.

    _Plan           the order: a pure function of (seed, rank, epoch, window), see the package
                    docstring; _Job is one window of one epoch
    _read_window,   read a window (in pieces of a shard where the backend has random access)
    _job_chunks     and cut it into chunks that never cross a batch boundary
    _slot_layout    where a chunk's fields lie in a shared-memory slot of raw bytes
    _worker_main    a worker process's entry point (a spawned worker finds it by module path,
                    so this module imports cleanly on its own): windows wid, wid + n, ... into
                    its free slots
    StreamingLoader the main process's side: starts the workers, takes chunks in order
                    (workers=0: reads in this process), assembles batches, keeps the state

Its memory (window, prefetch, the estimate of its peak) is planned in budget.py.
"""

from __future__ import annotations

import gc
import math
import multiprocessing
import queue
import signal
import traceback
from contextlib import suppress
from dataclasses import dataclass

import numpy as np
import torch

from ditdata.store import Store, open_store

from .base import _UNITS, _WINDOW, TEXT_LENGTH, _Block, _Field, _Loader, _open, _rng, _Spec, text_mask
from .budget import _gib, _read_piece_rows, loader_budget, plan_streaming_memory


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
                 batch_size: int, exclude: np.ndarray | None = None):
        if window < 1:
            raise ValueError(f"shuffle_window must be >= 1, got {window}")
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.window, self.batch_size = window, batch_size
        self.exclude = exclude  # rows never yielded (sorted; base.excluded_rows), or None
        units = _units(store, world_size)
        offsets = [store.shards[s].offset for s, _, _ in units]
        # a unit's size is the rows it yields: its rows less the excluded ones; a unit left empty is dropped
        sizes = [b - a - self._excluded_in(o + a, o + b) for (_, a, b), o in zip(units, offsets, strict=True)]
        keep = [i for i, n in enumerate(sizes) if n > 0]
        self.units = [units[i] for i in keep]
        if len(self.units) < world_size:
            raise ValueError(f"{store.root}: too few samples to give each of {world_size} ranks a part")
        self.offsets = [offsets[i] for i in keep]
        self.sizes = [sizes[i] for i in keep]
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

    def _excluded_in(self, lo: int, hi: int) -> int:
        """How many excluded rows lie in [lo, hi)."""
        if self.exclude is None:
            return 0
        return int(np.searchsorted(self.exclude, hi) - np.searchsorted(self.exclude, lo))

    def kept(self, first: int, n: int) -> np.ndarray | None:
        """Of the rows first..first+n-1, the positions (0..n-1) not excluded; None when all are kept."""
        if not self._excluded_in(first, first + n):
            return None
        ex = self.exclude[np.searchsorted(self.exclude, first):np.searchsorted(self.exclude, first + n)]
        mask = np.ones(n, dtype=bool)
        mask[ex - first] = False
        return np.flatnonzero(mask)

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
            rows = np.arange(first, first + b - a)
            local = plan.kept(first, b - a)  # None: every row of the piece (nothing excluded in it)
            if local is None:
                block.fill(pos, data, rows)
            elif len(local):
                block.fill(pos, data, rows[local], local)
            if probe is not None and b == hi and i == len(job.units) - 1:
                probe()
            del data  # before the next piece is read
            pos += b - a if local is None else len(local)
    block.seal()
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
    flat, picked = block.flat, block.flat_picked
    for a, b in job.cuts(plan.batch_size):
        lo, hi = a - job.start, b - job.start
        m = b - a

        def gather(out, lo=lo, hi=hi, m=m):
            samples = perm_t[lo:hi]  # the chunk's samples, as rows of the block
            torch.index_select(flat, 0, rows_t[lo:hi], out=out["lat"][:m].view(m, -1))
            for name, t in picked.items():  # the latent's rows: the same variant's scales and targets
                torch.index_select(t, 0, rows_t[lo:hi], out=out[name][:m].view(m, -1))
            for name, t in block.extras.items():
                torch.index_select(t, 0, samples, out=out[name][:m])
            torch.index_select(block.index, 0, samples, out=out["index"][:m])
            out["flip"][:m].copy_(flips_t[lo:hi])
            if block.spec.text is not None:  # packed (m, L_chunk, W) at the start of the slot's room
                block.gather_text(samples, out, m)

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
                     window=cfg["window"], batch_size=cfg["batch_size"], exclude=cfg["exclude"])
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


# ---------------------------------------------------------------------------------------
# The loader: workers started and stopped, chunks taken in order, batches assembled
# ---------------------------------------------------------------------------------------
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
                 mp_context: str | None = None, memory=None, local_world_size: int | None = None, exclude=None):
        store = _open(store)
        super().__init__(store, batch_size=batch_size, seed=seed, rank=rank, world_size=world_size,
                         device=device, with_index=with_index, reason=reason, split=split, exclude=exclude)
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
                          window=self.shuffle_window, batch_size=self._stream_batch, exclude=self.exclude)
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
                   "batch_size": self._stream_batch, "epoch": e, "offset": o, "piece": self._piece,
                   "exclude": self.exclude}
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
        # over PCIe, converted there); on the CPU, straight into float32 (one pass), except
        # the REPA targets, which stay as stored (targets() converts them where they are used).
        dst, text = {}, self.spec.text
        pieces = []  # unpadded text: (row, m, {field: (m, L_chunk, ...)}) of each chunk
        for f in self.spec.chunk_fields:
            if text is not None and f in text.chunk_fields:
                continue
            if self._pin:
                dst[f.name] = torch.empty((B, *f.shape), dtype=f.dtype, pin_memory=True)
            else:
                dst[f.name] = torch.empty((B, *f.shape), dtype=f.cpu_dtype)
        filled = 0
        while filled < B:
            epoch, a, m, views, release = self._next_chunk()
            if (epoch, a) != self._cursor or filled + m > B:
                self.close()
                raise RuntimeError(f"streaming loader out of sequence: got chunk ({epoch}, {a}, {m}) "
                                   f"at {self._cursor} with {filled}/{B} filled")
            for name, t in dst.items():
                t[filled:filled + m].copy_(views[name][:m])
            if text is not None:
                pieces.append((filled, m, self._text_piece(views, m, whole=m == B)))
            release()  # the slot is free for the worker again
            filled += m
            self._cursor = self.plan.advance(epoch, a, m)
        if not self.with_index:
            del dst["index"], dst["flip"]
        batch_rows = self._my_rows if self.split == "batch" else None
        if batch_rows is not None:  # this rank's rows of the one-process batch
            dst = {k: v[batch_rows] for k, v in dst.items()}
        if text is not None:  # unpadded; padded to the batch's longest caption on the device (_finish)
            joined = self._join_text(pieces)
            dst |= self._text_batch(joined, int(joined[TEXT_LENGTH].max()), batch_rows)
        return self._finish(self._to_device(dst), e0, o0)

    def _text_piece(self, views: dict, m: int, whole: bool) -> dict:
        """A chunk's unpadded text fields out of its slot (its tokens one after the other, their
        lengths) in the stored dtype, copied (pinned when bound for the GPU and the chunk is the
        whole batch, else joined with the batch's other chunks by _join_text)."""
        lengths = views[TEXT_LENGTH][:m].clone()
        total = int(lengths.sum())
        out = {TEXT_LENGTH: lengths}
        for f in self.spec.text.chunk_fields:
            if f.name == TEXT_LENGTH:
                continue
            shape = (total, *f.shape[1:])
            src = views[f.name].view(-1)[:math.prod(shape)].view(shape)
            out[f.name] = torch.empty(shape, dtype=f.dtype, pin_memory=self._pin and whole).copy_(src)
        return out

    def _join_text(self, pieces: list) -> dict:
        """The batch's text fields: every caption's tokens one after the other and their lengths."""
        if len(pieces) == 1:
            return dict(pieces[0][2])
        return {name: torch.cat([p[2][name] for p in pieces]) for name in pieces[0][2]}

    def _text_batch(self, t: dict, L: int, rows: slice | None) -> dict:
        """raw's text fields: the unpadded tokens (of `rows` of the batch, split="batch") and the
        (n, L) mask, L the whole batch's longest caption (the same on every rank)."""
        lengths = t.pop(TEXT_LENGTH)
        if rows is not None:
            off = torch.cumsum(lengths, 0) - lengths
            lo = int(off[rows.start]) if rows.start < len(lengths) else int(lengths.sum())
            hi = lo + int(lengths[rows].sum())
            t, lengths = {k: v[lo:hi] for k, v in t.items()}, lengths[rows]
        return t | {"text_mask": text_mask(lengths, L)}

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
        with suppress(Exception):
            self._shutdown()
