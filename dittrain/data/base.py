"""The loader interface both loaders share: what a batch is made of, the seeded streams, the
errors, _Stream (iteration, timing, resume, closing: a MixtureLoader's too) and _Loader
(finishing a batch on the device, state).

A batch is read from the store's fields as a _Spec says: the latents as one block
(n, V, P, C, h, w) of V variants (the flipped twin) and P parts (a frozen sample, or mean and
std), in their stored dtype, the conditioning extras beside them, and the fields held per
variant whose row i * V + v is picked with the latent's: the per-token scales (n, V, h, w) of
int8 latents, and, for a store opened with a feature set (ditdata.store.FeaturedStore), the
REPA targets (n, V, T, D) in their stored dtype (with the int8 scales (n, V, T)). Both int8
kinds travel as stored and are dequantized on the training device. A _Loader subclass makes raw batches (`_make`) and
says where batch k starts (`_position`); the rest (the trainer's float32 batch, fresh draws
from mean/std, state_dict/load_state_dict, the lookahead copy to the GPU) is here.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ditdata.common.errors import UserError
from ditdata.store import BFLOAT16, LATENT_SCALES, TEXT_FIELDS, Store, open_store
from ditdata.store.captions import MIX_FIELDS
from ditdata.store.schema import TEXT_LENGTH, ragged_rows

_TORCH_DTYPES = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8, "int32": torch.int32, "int64": torch.int64,
}
# Tags that keep the seeded streams of different purposes independent.
_PART, _EPOCH, _UNITS, _WINDOW, _EPS = 1, 2, 3, 4, 5


def _rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(k) for k in key])))


def _order_and_rows(rng: np.random.Generator, n: int, V: int) -> tuple[np.ndarray, np.ndarray]:
    """An epoch's sample order (n,), a permutation drawn from rng, and each sample's row
    i * V + variant: where a flipped twin is stored (V == 2) its coin is drawn with the order."""
    order = rng.permutation(n)
    return order, (order * V + rng.integers(0, 2, n) if V == 2 else order)


def _epoch_cached(epochs: dict, e: int, make) -> tuple:
    """epochs[e], made by make(e) when missing; the epochs before e - 1 are dropped (a batch
    spans at most two epochs, and resume asks for any)."""
    if e not in epochs:
        epochs[e] = make(e)
        for old in [x for x in epochs if x < e - 1]:
            del epochs[old]
    return epochs[e]


def _seed64(*key: int) -> int:
    return int(np.random.SeedSequence([int(k) for k in key]).generate_state(1, np.uint64)[0])


def _as_torch(arr: np.ndarray) -> torch.Tensor:
    if arr.dtype == BFLOAT16:
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(arr))


def _open(store) -> Store:
    return store if isinstance(store, Store) else open_store(store if isinstance(store, str) else Path(store))


def excluded_rows(exclude, n: int) -> np.ndarray | None:
    """`exclude` (rows of a store of n, any order) as the loaders hold it: sorted, unique, int64;
    None when there is none. ValueError for a row outside [0, n)."""
    if exclude is None:
        return None
    rows = np.unique(np.asarray(exclude, dtype=np.int64))
    if not len(rows):
        return None
    if rows[0] < 0 or rows[-1] >= n:
        raise ValueError(f"excluded rows must lie in [0, {n}); got {int(rows[0])}..{int(rows[-1])}")
    return rows


def kept_rows(n: int, exclude: np.ndarray | None) -> np.ndarray:
    """The rows [0, n) without `exclude` (excluded_rows'), ascending."""
    rows = np.arange(n, dtype=np.int64)
    return rows if exclude is None else np.setdiff1d(rows, exclude, assume_unique=True)


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

    @property
    def cpu_dtype(self) -> torch.dtype:
        """Its dtype in a batch assembled on the CPU for the CPU: float32 for floats and for the
        latents (int8 codes converted in the copy out of the slot, then scaled in place by
        _finish: one pass over the batch), the REPA targets ("feat") as stored
        (dittrain.data.targets dequantizes them in the step)."""
        if self.name == "lat" or (self.dtype.is_floating_point and self.name != "feat"):
            return torch.float32
        return self.dtype


class _Spec:
    """The store fields a loader reads and how they become a batch.

    Latents are held as one block (n, V, P, C, h, w): V variants (1, or 2 with the flipped
    twin), P parts (1: a frozen sample; 2: mean and std). Choosing a variant is then picking
    row i * V + v of the (n * V, P * C * h * w) view: one index_select per batch. The fields
    held per variant beside them (`picked`: int8 latents' scales, REPA targets) are picked by
    the same rows.
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
        self.ragged_text = "text_tokens" in schema.ragged  # unpadded text tokens (_RaggedText)
        self.text = _RaggedText(store) if self.ragged_text else None
        for name in (*TEXT_FIELDS, *MIX_FIELDS):  # (MIX_FIELDS: a store read with caption sets joined)
            if name in schema.tensors:
                t = schema.tensors[name]
                self.extras.append(_Field(name, name, _TORCH_DTYPES[t.dtype], tuple(t.shape)))
        # the fields picked with the latent's row, and {their name: their store field in each variant}
        self.picked: list[_Field] = []
        self.picked_sources: dict[str, list[str]] = {}
        if self.lat_dtype == torch.int8:  # int8 latents (one frozen sample each): their scales (h, w)
            self.picked.append(_Field("lat_scale", None, torch.float32, self.lat_shape[1:]))
            self.picked_sources["lat_scale"] = [LATENT_SCALES[v[0]] for v in self.variants]
        feat_variants, self.target_fields = self._targets(store)
        for i, f in enumerate(self.target_fields):
            self.picked.append(f)
            self.picked_sources[f.name] = [names[i] for names in feat_variants]
        self.read_fields = ([f for v in self.variants for f in v] + [e.source for e in self.extras]
                            + [f for names in self.picked_sources.values() for f in names]
                            + (self.text.read_fields if self.text else []))
        # what one chunk of a batch carries (the variant already chosen); unpadded text tokens
        # travel packed, (m, L_chunk, W) at the start of room for (m, L_max, W) (streaming.py)
        self.chunk_fields = [
            _Field("lat", None, self.lat_dtype, (self.P, *self.lat_shape)), *self.extras, *self.picked,
            _Field("index", None, torch.int64, ()), _Field("flip", None, torch.bool, ()),
            *(self.text.chunk_fields if self.text else []),
        ]

    def _targets(self, store: Store) -> tuple[list[list[str]], list[_Field]]:
        """The feature set's fields per variant ([["feat", "feat_scale"], ["feat_flip", ...]])
        and the chunk fields they become ("feat", and "feat_scale" for int8); none without
        `feat` in the schema. Variant v of the targets must be the image of latent variant v."""
        tensors = store.schema.tensors
        if "feat" not in tensors:
            return [], []
        feat = tensors["feat"]
        names = ["feat"] + (["feat_scale"] if "feat_scale" in tensors else [])
        variants = [names]
        if self.V == 2:
            flipped = [n.replace("feat", "feat_flip") for n in names]
            if not all(f in tensors for f in flipped):
                raise LoaderError(
                    f"{store.location}: the store's latents have flipped twins but its feature set "
                    f"{getattr(store, 'features_name', '')!r} has no feat_flip, so a flipped sample would get "
                    "the unflipped image's targets; rerun `ditdata features` on this store")
            variants.append(flipped)
        fields = [_Field("feat", None, _TORCH_DTYPES[feat.dtype], tuple(feat.shape))]
        if len(names) == 2:
            fields.append(_Field("feat_scale", None, torch.float32, tuple(tensors["feat_scale"].shape)))
        return variants, fields

    @property
    def target_bytes(self) -> int:
        """Bytes per sample of the REPA targets as held (every variant, scales included)."""
        return self.V * sum(f.nbytes for f in self.target_fields)

    @property
    def resident_bytes(self) -> int:
        """Bytes per sample held by the resident loader (int8 scales and targets included;
        unpadded text tokens at the store's mean caption length)."""
        lat = self.V * self.P * math.prod(self.lat_shape) * self.lat_dtype.itemsize
        text = self.text.bytes_per_sample if self.text else 0
        return lat + sum(e.nbytes for e in self.extras) + self.V * sum(f.nbytes for f in self.picked) + 8 + text

    @property
    def text_bytes(self) -> int:
        """Bytes per sample of the unpadded text tokens as held (0 without them): a block holds
        them twice for a moment while its pieces are joined (_Block.seal)."""
        return self.text.bytes_per_sample if self.text else 0


class _RaggedText:
    """Unpadded text tokens (ditdata.store.schema's ragged fields) in a loader: held as one pool
    of tokens per block (every sample's, one after the other, and a zero row for the padding),
    each sample's start and length; a batch gathers (B, L_batch, W) with L_batch its longest
    caption, and its mask (True = a real token). int8 tokens travel with their per-token float32
    scales and are dequantized on the training device, as latents are."""

    def __init__(self, store: Store):
        schema = store.schema
        spec = schema.ragged["text_tokens"]
        self.length_field = spec.length
        self.width = spec.shape[0]
        self.dtype = _TORCH_DTYPES[spec.dtype]
        self.int8 = spec.dtype == "int8"
        shape = (store.conditioning.tokens_shape or (None,))[0]
        stats = (store.manifest.get("ragged") or {}).get(spec.length) or {}
        self.max_len = int(shape or stats.get("max") or 1)
        self.mean_len = float(stats.get("mean") or self.max_len)
        self.token_bytes = self.width * self.dtype.itemsize + (4 if self.int8 else 0)
        self.read_fields = ["text_tokens", *(["text_tokens_scale"] if self.int8 else []), spec.length]
        self.chunk_fields = [_Field("text_tokens", None, self.dtype, (self.max_len, self.width)),
                             *([_Field("text_tokens_scale", None, torch.float32, (self.max_len,))] if self.int8 else []),
                             _Field(TEXT_LENGTH, None, torch.int64, ())]

    @property
    def bytes_per_sample(self) -> int:
        return int(math.ceil(self.mean_len * self.token_bytes)) + 16  # + its start and length


def text_mask(lengths: torch.Tensor, L: int) -> torch.Tensor:
    """(n, L) bool: True for the first lengths[i] positions of row i."""
    return torch.arange(L, device=lengths.device)[None, :] < lengths[:, None]


def finish_text(raw: dict, out: dict) -> None:
    """The trainer's text fields from a raw batch's unpadded ones (text_tokens (T, W) of all its
    captions, one after the other, text_mask (B, L) with L the longest): text_tokens (B, L, W)
    float32, zero at padding (int8: codes x their token's scale, ditdata.store.dequantize's
    product), padded here, on the training device, and text_mask."""
    mask = raw["text_mask"]
    flat = raw["text_tokens"].float()
    if "text_tokens_scale" in raw:
        flat.mul_(raw["text_tokens_scale"].unsqueeze(-1))
    x = torch.zeros((*mask.shape, flat.shape[-1]), dtype=torch.float32, device=flat.device)
    x[mask] = flat
    out["text_tokens"], out["text_mask"] = x, mask


class _Block:
    """n samples in memory: lat (n, V, P, C, h, w), the extras, the picked fields (n, V, ...)
    and global sample indices."""

    def __init__(self, spec: _Spec, n: int, device):
        self.spec, self.n = spec, n
        self.lat = torch.empty((n, spec.V, spec.P, *spec.lat_shape), dtype=spec.lat_dtype, device=device)
        self.extras = {e.name: torch.empty((n, *e.shape), dtype=e.dtype, device=device) for e in spec.extras}
        self.index = torch.empty(n, dtype=torch.int64, device=device)
        # {"lat_scale": (n, V, h, w), "feat": (n, V, T, D), "feat_scale": (n, V, T)}, picked like lat
        self.picked = {f.name: torch.empty((n, spec.V, *f.shape), dtype=f.dtype, device=device)
                       for f in spec.picked}
        self.device = device
        if spec.text is not None:  # unpadded text tokens: pieces until seal() joins them into one pool
            self.text_parts: list = []
            self.text_lengths = torch.zeros(n, dtype=torch.int64, device=device)
            self.text_pool: dict[str, torch.Tensor] = {}
            self.text_starts = None

    @property
    def flat(self) -> torch.Tensor:
        """(n * V, P * C * h * w): row i * V + v is variant v of sample i (2-D: the fastest gather)."""
        return self.lat.view(self.n * self.spec.V, -1)

    @property
    def flat_picked(self) -> dict[str, torch.Tensor]:
        """{name: (n * V, per-sample numel)}: row i * V + v as in `flat`, so the rows that
        pick the latents pick the same variant's scales and targets."""
        return {k: t.view(self.n * self.spec.V, -1) for k, t in self.picked.items()}

    def tensors(self) -> list[torch.Tensor]:
        text = [*self.text_pool.values(), self.text_lengths, self.text_starts] if self.spec.text else []
        return [self.lat, self.index, *self.extras.values(), *self.picked.values(),
                *(t for t in text if t is not None)]

    def seal(self) -> None:
        """Join the text pieces into one pool per field (tokens, int8 scales), each with a zero
        row at the end that padding positions point at; the samples' starts follow the lengths."""
        if self.spec.text is None:
            return
        parts = sorted(self.text_parts, key=lambda p: p[0])
        for name in parts[0][1] if parts else self.spec.text.read_fields[:-1]:
            pieces = [p[1][name] for p in parts]
            shape = pieces[0].shape[1:] if pieces else ((self.spec.text.width,) if name == "text_tokens" else ())
            zero = torch.zeros((1, *shape), dtype=pieces[0].dtype if pieces else self.spec.text.dtype)
            self.text_pool[name] = torch.cat([*pieces, zero]).to(self.device)
            del pieces
        self.text_parts = []
        starts = torch.zeros_like(self.text_lengths)
        starts[1:] = torch.cumsum(self.text_lengths, 0)[:-1]
        self.text_starts = starts

    def gather_text(self, order: torch.Tensor, out: dict | None = None, m: int | None = None) -> dict:
        """Samples `order`'s tokens, unpadded and one after the other, (sum of their lengths, W) in
        the stored dtype (int8: their scales too), and their lengths (B,). With `out` (a slot's views),
        written at the start of its text fields' memory (room for m x L_max tokens) instead."""
        lengths = self.text_lengths.index_select(0, order)
        starts = self.text_starts.index_select(0, order)
        total = int(lengths.sum())
        # token i of the result is token (i - its sample's first result row) of its sample
        first = torch.cumsum(lengths, 0) - lengths
        idx = torch.repeat_interleave(starts - first, lengths, output_size=total) + torch.arange(
            total, device=lengths.device)
        res = {TEXT_LENGTH: lengths}
        for name, pool in self.text_pool.items():
            if out is None:
                res[name] = pool.index_select(0, idx)
            else:
                n = total * math.prod(pool.shape[1:])
                torch.index_select(pool, 0, idx, out=out[name].view(-1)[:n].view(total, *pool.shape[1:]))
        if out is not None:
            out[TEXT_LENGTH][:m].copy_(lengths)
        return res

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
        for field, names in self.spec.picked_sources.items():
            for v, name in enumerate(names):
                arr = data[name] if local is None else data[name][local]
                self.picked[field][sl, v].copy_(_as_torch(arr))
        self.index[sl].copy_(torch.from_numpy(np.asarray(global_index, dtype=np.int64)))
        if self.spec.text is not None:
            lengths = np.asarray(data[self.spec.text.length_field], dtype=np.int64)
            names = self.spec.text.read_fields[:-1]
            flat = {k: data[k] for k in names}
            if local is not None:
                flat = {k: ragged_rows(v, lengths, local) for k, v in flat.items()}
                lengths = lengths[local]
            self.text_parts.append((pos, {k: _as_torch(v) for k, v in flat.items()}))
            self.text_lengths[sl].copy_(torch.from_numpy(lengths))



def targets(batch: dict) -> torch.Tensor:
    """A batch's REPA targets as float32 (B, T, D), on the batch's device: feat * feat_scale
    for int8 (ditdata.store.dequantize, bit for bit), feat for fp16."""
    feat = batch["feat"].float()
    return feat * batch["feat_scale"].unsqueeze(-1) if "feat_scale" in batch else feat


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------
class LoaderError(UserError, ValueError):
    """The requested loader cannot work here (a resident store larger than the memory it
    would live in); the message is one line with the sizes and what to use instead."""


class LoaderStateError(UserError, ValueError):
    """A saved loader state that this loader cannot continue exactly (another kind, seed,
    batch size, world size, store size or window); the message lists what differs."""



# ---------------------------------------------------------------------------------------
# The common part: iteration, timing, finishing a batch on the device, state
# ---------------------------------------------------------------------------------------
class _Stream:
    """What every loader is as a stream of batches, a MixtureLoader too: an iterator whose time inside
    next() adds up in wait_seconds, a resume by the batch count alone, a context manager that closes it.
    A subclass sets batches and wait_seconds, and has _take (the next batch, counted), _identity (what
    an exact resume needs the same), _reset and close."""

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        try:
            return self._take()
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def _take(self) -> dict:
        raise NotImplementedError

    def _resume(self, state: dict, strict: bool, this: str, same: str) -> None:
        """Continue after state["batches"] batches; strict: refuse a state whose identity differs, the
        message naming `this` loader and the `same` things an exact resume needs."""
        diff = {k: (state.get(k), v) for k, v in self._identity().items() if state.get(k) != v}
        if diff and strict:
            raise LoaderStateError(
                f"loader state does not match {this} (saved, now): "
                + ", ".join(f"{k} {a!r} vs {b!r}" for k, (a, b) in diff.items())
                + f"; exact resume needs the same {same} (strict=False continues approximately)")
        self._reset()
        self.batches = int(state["batches"])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Loader(_Stream):
    kind = ""

    def __init__(self, store: Store, *, batch_size: int, seed: int, rank: int, world_size: int,
                 device, with_index: bool, reason: str, split: str, exclude=None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if split not in ("part", "batch"):
            raise ValueError(f"unknown split {split!r}; use 'part' or 'batch'")
        # rows never yielded (a held-out validation split, dittrain.train.validation): sorted, or None
        self.exclude = excluded_rows(exclude, len(store))
        trained = len(store) - (0 if self.exclude is None else len(self.exclude))
        if trained < world_size:
            raise ValueError(f"{store.root}: {trained} samples cannot be split over {world_size} ranks")
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
    def _take(self) -> dict:
        batch = self._staged if self._staged is not None else self._make(self.batches)
        self._staged = None
        self.batches += 1
        if self._lookahead:  # start the next batch's copy now, so it is there at the next step
            self._staged = self._make(self.batches)
        return batch

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
            if "lat_scale" in raw:  # int8 codes x their token's scale (ditdata.store.dequantize, bit for bit)
                x.mul_(raw["lat_scale"].unsqueeze(1))
        else:
            self._gen.manual_seed(_seed64(self.seed, _EPS, self._stream_rank, epoch, offset))
            mean, std = lat[:, 0].float(), lat[:, 1].float()
            eps = torch.randn((self._stream_batch, *mean.shape[1:]), generator=self._gen, device=mean.device,
                              dtype=torch.float32)
            x = torch.addcmul(mean, std, eps[self._my_rows])
        out = {"x": x}
        if "feat" in raw:
            # As stored (int8 and its per-token scale, or fp16): a ViT-B target is 193 KiB in
            # int8 but 768 KiB in float32, and making that float32 batch on the host costs more
            # than all the rest of the loader (measured: bench/feature_loader.py). targets()
            # dequantizes where they are used, on the training device.
            out["feat"] = raw["feat"]
            if "feat_scale" in raw:
                out["feat_scale"] = raw["feat_scale"]
        for e in self.spec.extras:
            t = raw[e.name]
            out[e.name] = t.float() if t.is_floating_point() else t
        if self.spec.text is not None:
            finish_text(raw, out)
        if self.with_index:
            out["index"], out["flip"] = raw["index"], raw["flip"]
        return out

    def _to_device(self, raw: dict) -> dict:
        if self.device.type == "cpu":
            return raw
        return {k: v.to(self.device, non_blocking=True) for k, v in raw.items()}

    # -- state -----------------------------------------------------------------------
    def _identity(self) -> dict:
        ident = {"kind": self.kind, "seed": self.seed, "batch_size": self.batch_size,
                 "world_size": self.world_size, "split": self.split, "num_samples": len(self.store)}
        if self.exclude is not None:  # only then: the states saved before exclusions existed still match
            ident["excluded"] = len(self.exclude)
        return ident

    def state_dict(self) -> dict:
        e, o = self._position(self.batches)
        return {**self._identity(), "batches": self.batches, "epoch": e, "offset": o, "rank": self.rank}

    def load_state_dict(self, state: dict, *, strict: bool = True) -> None:
        """Continue after state["batches"] batches. The state of any rank resumes every rank.

        strict: refuse a state made with another seed, batch size, world size, store size or
        window (the continuation would not be exact); strict=False takes the batch count only.
        """
        if state.get("kind") != self.kind:
            raise LoaderStateError(
                f"loader state is for a {state.get('kind')!r} loader, this one is {self.kind!r}; "
                f"build the loader with kind={state.get('kind')!r} to resume exactly")
        self._resume(state, strict, "this loader", "settings")

    def _reset(self) -> None:
        self._staged = None

    # -- lifetime --------------------------------------------------------------------
    def close(self) -> None:
        self._reset()

    def __repr__(self):
        return (f"{type(self).__name__}(batch_size={self.batch_size}, rank={self.rank}/{self.world_size}, "
                f"device={self.device}, batches={self.batches}; {self.reason})")

