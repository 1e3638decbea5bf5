"""BucketedLoader: a store of aspect-ratio buckets (ditdata encode --buckets) held in memory,
every batch from ONE bucket, so a batch is one latent shape (B, C, h, w).

Each bucket's samples live in a ResidentLoader of that bucket's plain store (the block, the
flip variants, the extras, the index_select: resident.py's, reused). This module only plans
which samples make batch k:

    epoch e   each bucket b's samples in a permutation seeded by (seed, b, e), with each
              sample's flip variant drawn alongside, cut into batches of the stream's batch
              size; a bucket's last partial batch is dropped (remainder "drop") or filled with
              the first samples of the same permutation again, cycling when the bucket is
              smaller than a batch (remainder "pad", the default: every sample is seen every
              epoch, at the cost of at most B - 1 repeats per bucket and epoch). Then all the
              epoch's batches in one order seeded by (seed, e): a bucket's batches come in
              proportion to its samples, spread over the epoch.
    batch k   batch k mod E of epoch k div E, E = the batches per epoch (fixed by the bucket
              counts, the batch size and the remainder rule), so the state is the batch count
              alone and a resume is exact, as the loaders' contract says (dittrain.data).

Unlike the plain loaders' stream, epochs do not run into each other: a batch never mixes
buckets. Per-sample randomness is the plain loaders': a flip coin per sample and epoch, fresh
eps for mean/std stores seeded by (seed, rank, epoch, offset of the batch in the epoch), and
the trainer's CFG dropout and text embeddings, which travel with each sample.

DDP: every rank follows the same batch order (the same bucket at every step) and takes its
own disjoint rows [r*B, (r+1)*B) of the one-process batch of B*W samples (the plain loaders'
split="batch"), so W ranks see exactly what one process with B*W would; each rank holds the
whole store. Streaming a bucketed store is not supported (build_loader refuses it in one line).
With index (with_index=True), "index" is the sample's index within its bucket's store.

exclude (rows never yielded: a held-out validation split) numbers the samples of every bucket one
after the other, the buckets in the store's order (by name): row i of bucket b is sum(n_<b) + i.
"""

from __future__ import annotations

import numpy as np
import torch

from dittrain.config import BUCKET_REMAINDERS as REMAINDERS  # pad (the default) | drop

from .base import LoaderError, _epoch_cached, _Loader, _open, _order_and_rows, _rng
from .resident import ResidentLoader, _upload

# Tags of this module's seeded streams (base.py's are 1..5)
_BUCKET_EPOCH, _BATCH_ORDER = 6, 7


class BucketedLoader(_Loader):
    """Batches of one bucket each, from a bucketed store held in memory (see the module's
    docstring). remainder: "pad" or "drop" (a bucket's last partial batch)."""

    kind = "bucketed"

    def __init__(self, store, *, batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1,
                 device="cpu", resident_device="cpu", with_index: bool = False, reason: str = "",
                 remainder: str = REMAINDERS[0], exclude=None):
        store = _open(store)
        if not store.buckets:
            raise ValueError(f"{store.root}: not a bucketed store (ditdata encode --buckets)")
        if remainder not in REMAINDERS:
            raise ValueError(f"unknown bucket remainder {remainder!r}; use {' or '.join(REMAINDERS)}")
        # one stream for all ranks, each keeping its rows (split="batch"): the same bucket everywhere
        super().__init__(store, batch_size=batch_size, seed=seed, rank=rank, world_size=world_size,
                         device=device, with_index=with_index, reason=reason,
                         split="batch" if world_size > 1 else "part", exclude=exclude)
        self.remainder = remainder
        self.buckets = tuple(store.buckets)
        starts = np.cumsum([0] + [b.num_samples for b in self.buckets])
        held = self.exclude if self.exclude is not None else np.zeros(0, dtype=np.int64)
        # each bucket's excluded rows, as rows of its own store
        local = [held[(held >= a) & (held < b)] - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
        self.parts = [ResidentLoader(b.store, batch_size=batch_size, device=device, resident_device=resident_device,
                                     with_index=with_index, reason=reason, exclude=x)
                      for b, x in zip(self.buckets, local, strict=True)]
        self.device = self.parts[0].device
        self._lookahead = self.parts[0]._lookahead
        self.resident_device = self.parts[0].resident_device
        B = self._stream_batch
        self.counts = [p.n for p in self.parts]
        # batches per epoch of each bucket
        self.bucket_batches = [-(-n // B) if remainder == "pad" else n // B for n in self.counts]
        self.batches_per_epoch = sum(self.bucket_batches)
        if self.batches_per_epoch == 0:
            raise LoaderError(
                f"{store.root}: no bucket holds a full batch of {B} (largest {max(self.counts)} samples), so "
                "--bucket-remainder drop leaves nothing to train on; use --bucket-remainder pad or a smaller --batch-size")
        self._epochs: dict[int, tuple] = {}

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def samples_per_epoch(self) -> int:
        """Samples (repeats included) of an epoch's batches."""
        return self.batches_per_epoch * self._stream_batch

    def describe_buckets(self) -> str:
        """The startup line's words: each bucket's size, latent shape, samples and batches per epoch."""
        parts = [f"{b.name} ({'x'.join(map(str, b.latent_shape))}, {n} samples, {k} batches)"
                 for b, n, k in zip(self.buckets, self.counts, self.bucket_batches, strict=True)]
        return (f"{len(self.buckets)} buckets, {self.batches_per_epoch} batches of {self._stream_batch} per epoch "
                f"(remainder {self.remainder}): " + ", ".join(parts))

    # -- the plan --------------------------------------------------------------------
    def _position(self, k: int) -> tuple[int, int]:
        """(epoch, offset of batch k's first sample in its epoch's batches)."""
        e, j = divmod(k, self.batches_per_epoch)
        return e, j * self._stream_batch

    def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray, list[torch.Tensor], list[torch.Tensor]]:
        """Epoch e: the bucket of each of its batches in order (E,), which of that bucket's
        batches each is (E,), and per bucket the block positions and variant rows of its
        batches, (batches_b * B,) each on the resident device."""
        return _epoch_cached(self._epochs, e, self._make_epoch)

    def _make_epoch(self, e: int) -> tuple:
        B, orders, rows = self._stream_batch, [], []
        for b, (part, n, k) in enumerate(zip(self.parts, self.counts, self.bucket_batches, strict=True)):
            order, row = _order_and_rows(_rng(self.seed, _BUCKET_EPOCH, b, e), n, part.spec.V)
            # drop: the first k*B; pad: cycled to k*B (np.resize repeats the array from its start)
            orders.append(_upload(np.resize(order, k * B), self.resident_device))
            rows.append(_upload(np.resize(row, k * B), self.resident_device))
        which = np.repeat(np.arange(len(self.parts)), self.bucket_batches)
        which = which[_rng(self.seed, _BATCH_ORDER, e).permutation(len(which))]
        nth = np.empty_like(which)  # batch j is bucket which[j]'s nth[j]-th batch of the epoch
        for b in range(len(self.parts)):
            at = which == b
            nth[at] = np.arange(np.count_nonzero(at))
        return which, nth, orders, rows

    def bucket_of(self, k: int) -> int:
        """The bucket (index into self.buckets) batch k comes from."""
        e, o = self._position(k)
        return int(self._epoch(e)[0][o // self._stream_batch])

    def _make(self, k: int) -> dict:
        e, o = self._position(k)
        which, nth, orders, rows = self._epoch(e)
        B = self._stream_batch
        b, i = int(which[o // B]), int(nth[o // B])  # bucket b's i-th batch of the epoch
        order, row = orders[b][i * B:(i + 1) * B], rows[b][i * B:(i + 1) * B]
        if self.split == "batch":  # this rank's rows of the one-process batch
            order, row = order[self._my_rows], row[self._my_rows]
        return self._finish(self.parts[b].gather(order, row), e, o)

    # -- state -----------------------------------------------------------------------
    def _identity(self) -> dict:
        return {**super()._identity(), "remainder": self.remainder,
                "buckets": [f"{b.name}:{n}" for b, n in zip(self.buckets, self.counts, strict=True)]}


__all__ = ["REMAINDERS", "BucketedLoader"]
