"""Loaders over a latent store: infinite, seeded, exactly resumable batches for the trainer.

    from dittrain.data import LoaderConfig, build_loader     # LoaderConfig: dittrain.config's
    loader = build_loader(store, LoaderConfig(workers=8), batch_size=64, seed=0, rank=rank, world_size=world,
                          device="cuda")
    log(loader.kind, loader.reason)        # which loader was chosen, and why
    batch = next(loader)                   # {"x": (B, C, h, w) float32, "y": (B,) int64, ...}
    feat = targets(batch)                  # with a feature set: the REPA targets, float32 (B, T, D)
    state = loader.state_dict()            # ints and strings: torch.save / weights_only safe
    ...
    loader = build_loader(...); loader.load_state_dict(state)   # the next batches are identical
    loader.close()                         # stops the streaming worker processes

Two loaders, one contract (and a third for a store of aspect-ratio buckets):

ResidentLoader   the whole store (this rank's part of it) held in memory in its stored dtype
                 (fp16/bf16), in RAM or on the GPU; a batch is one index_select.
StreamingLoader  for stores larger than memory: worker processes read WINDOWS of whole
                 shards in bulk, shuffle each window in memory and cut it into batches that
                 travel through shared-memory slots; the main process puts them back into
                 the canonical order, pins them and copies them to the GPU ahead of the step.
BucketedLoader   a bucketed store (ditdata encode --buckets), held in memory: every batch from
                 one bucket, an epoch each bucket's samples cut into batches (the last partial
                 one padded or dropped), all in one seeded order (bucketed.py's docstring).

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

HELD-OUT ROWS. `exclude` (build_loader's, every loader's) names store rows that are never
yielded: the resident loaders never hold them (the rank partition is drawn over the rows kept, the
same partition as before when nothing is excluded), the streaming loader reads its windows whole
and drops them as it fills the window, so an epoch is every kept sample once.

STATE. `state_dict()` = {"kind", "batches", "epoch", "offset", "seed", "batch_size", "rank",
"world_size", "split", "num_samples", ...}. The position is a function of `batches` alone, so the
state saved by rank 0 resumes every rank exactly (each recomputes its own epoch and offset).
A streaming resume skips the windows already consumed without reading them; the current
window is read again (a shuffle needs all of it) and its consumed part is skipped.

`loader.wait_seconds` is the cumulative time the consumer spent inside `next(loader)`.

THE MODULES. base.py: the loader interface (what a batch is made of, the seeded streams, the
errors, _Stream and _Loader). resident.py: ResidentLoader. streaming.py: StreamingLoader, its
plan, windows, workers and shared-memory slots. budget.py: the memory available (RAM, a
container's limit, a GPU), choose_loader, and the streaming loader's memory budget.
bucketed.py: BucketedLoader. latent_norm.py: --latent-norm, what the model sees of the latents
and its inverse (the training step and the samplers both use it). mixture.py: MixtureLoader,
several stores mixed (`--latents A --latents B:0.3`), each read by its own loader, and
build_mixture. build_loader is here.
"""

from __future__ import annotations

from dittrain.config import LoaderConfig

from .base import LoaderError, LoaderStateError, _open, targets
from .bucketed import REMAINDERS, BucketedLoader
from .budget import (
    AUTO_MAX_PREFETCH,
    AUTO_MAX_WINDOW,
    AUTO_MIN_PREFETCH,
    LOADER_MEMORY_CAP,
    LOADER_MEMORY_FRACTION,
    READ_PIECE_BYTES,
    RESIDENT_MAX_FRACTION,
    WORKER_OVERHEAD,
    StreamingMemory,
    available_memory,
    choose_bucketed,
    choose_loader,
    choose_mixture,
    gpu_memory,
    loader_budget,
    parse_memory,
    plan_streaming_memory,
)
from .mixture import MixtureLoader, build_mixture
from .resident import ResidentLoader
from .streaming import StreamingLoader

__all__ = [
    "BucketedLoader", "LoaderConfig", "LoaderError", "LoaderStateError", "REMAINDERS", "ResidentLoader", "StreamingLoader", "available_memory",
    "build_loader", "build_mixture", "choose_bucketed", "choose_loader", "choose_mixture", "MixtureLoader", "gpu_memory", "loader_budget", "parse_memory", "targets",
    # the streaming loader's memory plan and the budget's settings (budget.py)
    "StreamingMemory", "plan_streaming_memory", "RESIDENT_MAX_FRACTION", "LOADER_MEMORY_FRACTION",
    "LOADER_MEMORY_CAP", "AUTO_MAX_WINDOW", "AUTO_MAX_PREFETCH", "AUTO_MIN_PREFETCH",
    "WORKER_OVERHEAD", "READ_PIECE_BYTES",
]

_DEFAULTS = LoaderConfig()


def build_loader(store, settings: LoaderConfig = _DEFAULTS, *, batch_size: int, seed: int = 0, rank: int = 0,
                 world_size: int = 1, device="cpu", local_world_size: int | None = None, exclude=None):
    """A ResidentLoader, StreamingLoader or BucketedLoader over `store` (a Store or its path).

    settings: how the store is read (dittrain.config.LoaderConfig: kind auto | resident |
    streaming, where a resident store lives, the streaming workers, window, prefetch and
    memory budget, how ranks split the data, a bucketed store's remainder). The rest are
    facts of the run: batch_size is per rank (the micro-batch one forward pass sees), seed
    decides the order, rank / world_size / local_world_size place this process (None: torchrun's
    LOCAL_WORLD_SIZE), device is where batches go. The choice and its reason are in
    loader.kind and loader.reason. A bucketed store (ditdata encode --buckets) gets a
    BucketedLoader whatever settings.kind says but streaming (refused: LoaderError). exclude: rows of
    the store never yielded, by any loader kind (a held-out validation split, dittrain.train.validation;
    a bucketed store's rows count its buckets one after the other, bucketed.py).
    """
    s = settings
    store = _open(store)
    if store.buckets:  # aspect-ratio buckets: held in memory, a batch from one bucket (bucketed.py)
        reason = choose_bucketed(store, kind=s.kind, world_size=world_size, resident_device=s.resident_device,
                                 local_world_size=local_world_size)
        return BucketedLoader(store, batch_size=batch_size, seed=seed, rank=rank, world_size=world_size,
                              device=device, resident_device=s.resident_device, with_index=s.with_index,
                              reason=reason, remainder=s.remainder, exclude=exclude)
    kind, rdev, reason = choose_loader(store, kind=s.kind, rank=rank, world_size=world_size,
                                       resident_device=s.resident_device, memory_fraction=s.memory_fraction,
                                       local_world_size=local_world_size, split=s.split)
    common = dict(batch_size=batch_size, seed=seed, rank=rank, world_size=world_size, device=device,
                  with_index=s.with_index, reason=reason, split=s.split, exclude=exclude)
    if kind == "resident":
        return ResidentLoader(store, resident_device=rdev, **common)
    return StreamingLoader(store, workers=s.workers, shuffle_window=s.shuffle_window, prefetch=s.prefetch,
                           memory=s.memory, local_world_size=local_world_size, **common)
