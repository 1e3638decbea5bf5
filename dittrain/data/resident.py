"""ResidentLoader: this rank's part of the store held in memory, a batch one index_select.

The part is a fixed seeded random split of the store (DDP, split="part"); epoch e is a
permutation of it seeded by (seed, rank, e), drawn with each sample's flip variant; the scales
of int8 latents and the REPA targets of a feature set (when the store has one) are held beside
the latents in their stored dtype and picked by the same rows.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import (
    _EPOCH,
    _PART,
    TEXT_LENGTH,
    _Block,
    _epoch_cached,
    _Loader,
    _open,
    _order_and_rows,
    _rng,
    kept_rows,
    text_mask,
)


def _rank_part(n: int, seed: int, rank: int, world_size: int, exclude: np.ndarray | None = None) -> np.ndarray:
    """The global indices this rank holds (sorted): a fixed seeded random split of [0, n) less the
    `exclude`d rows (with none, the split is the one before exclusions existed)."""
    keep = kept_rows(n, exclude)
    if world_size == 1:
        return keep
    perm = _rng(seed, _PART, world_size).permutation(len(keep))
    return np.sort(keep[perm[rank::world_size]])


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
    exclude: store rows it never holds nor yields (a held-out validation split).
    """

    kind = "resident"

    def __init__(self, store, *, batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1,
                 device="cpu", resident_device="cpu", with_index: bool = False, reason: str = "",
                 split: str = "part", exclude=None):
        store = _open(store)
        super().__init__(store, batch_size=batch_size, seed=seed, rank=rank, world_size=world_size,
                         device=device, with_index=with_index, reason=reason, split=split, exclude=exclude)
        self.resident_device = torch.device(resident_device)
        if self.resident_device.type == "cuda" and self.device.type != "cuda":
            raise ValueError("--resident-device cuda needs --device cuda (the store would live on the GPU)")
        if self.resident_device.type == "cuda":
            self.device = self.resident_device
        part = _rank_part(len(store), seed, self._stream_rank, self._stream_world, self.exclude)
        self.n = len(part)
        self._block = _Block(self.spec, self.n, self.resident_device)
        for shard in store.shards:
            a, b = np.searchsorted(part, [shard.offset, shard.offset + shard.num_samples])
            if a == b:
                continue
            data = store.read(shard, fields=self.spec.read_fields)
            local = None if b - a == shard.num_samples else part[a:b] - shard.offset
            self._block.fill(int(a), data, part[a:b], local)
        self._block.seal()
        self._flat = self._block.flat
        self._flat_picked = self._block.flat_picked
        self._epochs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Data kept in RAM but trained on the GPU: gather into pinned memory, copy ahead.
        self._lookahead = self.device.type == "cuda" and self.resident_device.type != "cuda"

    @property
    def nbytes(self) -> int:
        b = self._block
        return sum(t.numel() * t.element_size() for t in b.tensors())

    @property
    def samples_per_epoch(self) -> int:
        return self.n

    def _position(self, k: int) -> tuple[int, int]:
        return divmod(k * self._stream_batch, self.n)

    def _epoch(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(order, rows) of epoch e: sample positions, and their rows i * V + variant."""
        def make(e):
            order, rows = _order_and_rows(_rng(self.seed, _EPOCH, self._stream_rank, e), self.n, self.spec.V)
            return _upload(order, self.resident_device), _upload(rows, self.resident_device)

        return _epoch_cached(self._epochs, e, make)

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
        return self._finish(self.gather(order, rows), e, o)

    def gather(self, order: torch.Tensor, rows: torch.Tensor) -> dict:
        """The raw batch (stored dtypes, on the device) of block positions `order` with their
        variant rows `rows` (i * V + variant), both on the resident device: the latents and
        targets by `rows`, the extras (and index) by `order`. dittrain.data.bucketed holds
        one ResidentLoader per bucket and makes its batches through this too."""
        pin = self._lookahead
        raw = {"lat": self._select(self._flat, rows, pin).view(-1, self.spec.P, *self.spec.lat_shape)}
        for f in self.spec.picked:  # the same rows: the scales and targets of the latent's variant
            raw[f.name] = self._select(self._flat_picked[f.name], rows, pin).view(-1, *f.shape)
        for name, t in self._block.extras.items():
            raw[name] = self._select(t, order, pin)
        if self.spec.text is not None:  # unpadded tokens, padded to the batch's longest caption by _finish
            text = self._block.gather_text(order)
            raw["text_tokens"] = text["text_tokens"]
            if "text_tokens_scale" in text:
                raw["text_tokens_scale"] = text["text_tokens_scale"]
            lengths = text[TEXT_LENGTH]
            raw["text_mask"] = text_mask(lengths, int(lengths.max()) if len(lengths) else 0)
        if self.with_index:
            raw["index"] = self._select(self._block.index, order, pin)
            raw["flip"] = (rows % self.spec.V).bool()
        return self._to_device(raw)

    def fixed_batch(self, positions: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """(the trainer's batch of block positions `positions`, on the resident device, each sample's
        unflipped variant; their raw latents (n, P, C, h, w) as stored): a batch of no epoch, for a
        fixed set of rows (dittrain.train.validation, which draws a mean/std store's sample itself)."""
        raw = self.gather(positions, positions * self.spec.V)
        return self._finish(raw, 0, 0), raw["lat"]

    @staticmethod
    def _select(t: torch.Tensor, idx: torch.Tensor, pin: bool) -> torch.Tensor:
        if not pin:
            return t.index_select(0, idx)
        out = torch.empty((len(idx), *t.shape[1:]), dtype=t.dtype, pin_memory=True)
        return torch.index_select(t, 0, idx, out=out)

