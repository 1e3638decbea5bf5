"""MixtureLoader: several latent stores mixed into one seeded stream of batches
(`dittrain run --latents A --latents B:0.3`), each store read by its own resident or streaming
loader (chosen together, so they share the memory: budget.choose_mixture).

    R_i       store i's repeats, "PATH:R" (default 1): kohya's num_repeats, any positive number
    k_i       its batches per epoch of the mixture: round(R_i x N_i / (W x B)), at least 1 (N_i
              its samples, W the ranks the stores are split over, 1 for split="batch"; B the batch
              of the stream); it gives k_i x B samples an epoch
    epoch e   K = k_0 + k_1 + ... batches; which store each takes is a permutation of k_0 zeros,
              k_1 ones, ..., seeded by (seed, rank, e): a store's batches spread over the epoch in
              proportion to its share
    store i   its loader's own infinite stream of batches (its epochs, order, flips and fresh
              draws, seeded by (seed, i)): R_i = 3 runs through it three times per mixture epoch,
              each time in a new order; R_i = 0.3 takes the next 30% of it, so every sample comes
              within about 1 / 0.3 epochs, and each sample of B is drawn 0.3 times as often as
              each of A
    batch k   batch k mod K of epoch k div K: the NEXT batch of its store's loader, handed on as it
              is (no copy: measured, a copy per batch would halve a resident loader's rate,
              bench/mixed_loader.py)

Every batch is from one store, as kohya's sd-scripts mixes datasets (read in kohya-ss/sd-scripts'
library/train_util.py: DatasetGroup is a ConcatDataset whose items are whole bucket batches of one
dataset, each image registered num_repeats times per epoch); the repeats are per-sample weights, and store i's share of an epoch is
k_i / K (the startup line, describe_mixture). The mixture is a pure function of (seed, rank, the
stores' sizes and repeats, the batch size), and store i's batch count after mixture batch k is the
count of i among the first k, so the state is the batch count alone and a resume is exact, as the
loaders' contract says (dittrain.data). One store is never a mixture: build_loader, as before.

DDP: split="part", each rank's stores are its parts of them (each store's loader split as one
store's is), its own mixture order seeded by its rank; split="batch", every rank makes the
one-process batch of B x W and keeps its rows. The conditioning must agree (check_stores), so every
store's batch has the same fields. With with_index, "index" is the sample's row in its own store
and "store" which store (its --latents position).
"""

from __future__ import annotations

import numpy as np
import torch

from ditdata.store import Store
from dittrain.config import LoaderConfig

from .base import LoaderError, LoaderStateError, _epoch_cached, _open, _rng, _Stream
from .budget import choose_mixture
from .latent_norm import latent_record
from .resident import ResidentLoader
from .streaming import StreamingLoader

# Tags of this module's seeded streams (base.py's are 1..5, bucketed.py's 6 and 7)
_MIX_EPOCH, _MIX_STORE = 8, 9


def store_seed(seed: int, i: int) -> int:
    """The seed of store i's own loader in a mixture: independent streams, even for one store given twice."""
    return int(np.random.SeedSequence([int(seed), _MIX_STORE, int(i)]).generate_state(1, np.uint32)[0]) >> 1


def per_epoch(sizes: list[int], repeats: list[float], batch: int, ranks: int = 1) -> list[int]:
    """k_i: each store's batches in one mixture epoch of one rank (the module's docstring)."""
    return [max(1, round(r * n / (ranks * batch))) for n, r in zip(sizes, repeats, strict=True)]


class MixtureLoader(_Stream):
    """One stream of batches from several stores' loaders (the module's docstring). parts: the stores'
    loaders, made with the stream's rank, world size and batch size (build_mixture makes them)."""

    kind = "mixture"

    def __init__(self, parts: list, repeats: list[float], *, batch_size: int, seed: int = 0, rank: int = 0,
                 world_size: int = 1, split: str = "part", names: list[str] | None = None, reason: str = ""):
        if len(parts) < 2:
            raise ValueError("a mixture needs at least two stores")
        self.parts, self.repeats = list(parts), [float(r) for r in repeats]
        self.names = list(names or [p.store.location for p in parts])
        self.batch_size, self.seed, self.rank, self.world_size, self.split = batch_size, seed, rank, world_size, split
        if split == "batch":  # every rank makes the one-process batch and keeps its rows
            self._stream_rank, self._stream_batch = 0, batch_size * world_size
            self._my_rows: slice | None = slice(rank * batch_size, (rank + 1) * batch_size)
        else:
            self._stream_rank, self._stream_batch, self._my_rows = rank, batch_size, None
        for p in self.parts:
            if p.batch_size != self._stream_batch:
                raise ValueError(f"a mixture's stores need loaders of batch {self._stream_batch}, got {p.batch_size}")
        self.sizes = [len(p.store) for p in self.parts]
        self.per_epoch = per_epoch(self.sizes, self.repeats, self._stream_batch, world_size if split == "part" else 1)
        self.batches_per_epoch = sum(self.per_epoch)
        self.samples_per_epoch = self.batches_per_epoch * self._stream_batch
        self.device = self.parts[0].device
        self.reason = reason or f"{len(parts)} stores mixed"
        self.batches = 0  # batches handed to the consumer
        self.wait_seconds = 0.0  # cumulative time spent inside __next__
        self._epochs: dict[int, np.ndarray] = {}
        self._reset()

    # -- the plan --------------------------------------------------------------------
    def _which(self, e: int) -> np.ndarray:
        """Epoch e: the store of each of its K batches."""
        def make(e):
            stores = np.repeat(np.arange(len(self.parts), dtype=np.int16), self.per_epoch)
            return _rng(self.seed, _MIX_EPOCH, self._stream_rank, e).permutation(stores)

        return _epoch_cached(self._epochs, e, make)

    def _position(self, k: int) -> tuple[int, int]:
        """(store, which of its loader's batches) of mixture batch k."""
        e, j = divmod(k, self.batches_per_epoch)
        which = self._which(e)
        i = int(which[j])
        return i, e * self.per_epoch[i] + int(np.count_nonzero(which[:j] == i))

    @property
    def epoch(self) -> int:
        """The mixture epoch of the next batch."""
        return self.batches // self.batches_per_epoch

    def store_of(self, k: int) -> int:
        """The store (its --latents position) batch k comes from."""
        return self._position(k)[0]

    def describe_mixture(self) -> str:
        """The startup line's words: what each store gives per epoch (of this rank)."""
        B, K = self._stream_batch, self.batches_per_epoch
        rows = [f"{name} ({n:,} samples x{r:g}: {k:,} batches = {k * B:,} samples, {k / K:.0%})"
                for name, n, r, k in zip(self.names, self.sizes, self.repeats, self.per_epoch, strict=True)]
        per = " per rank" if self.split == "part" and self.world_size > 1 else ""
        return (f"{len(self.parts)} stores, {K:,} batches of {B} ({self.samples_per_epoch:,} samples) per epoch{per}, "
                "each batch from one store: " + ", ".join(rows))

    # -- iteration -------------------------------------------------------------------
    def _take(self) -> dict:
        batch = self._make(self.batches)
        self.batches += 1
        return batch

    def _make(self, k: int) -> dict:
        i, j = self._position(k)
        part = self.parts[i]
        if part.batches != j:  # a resume, or a jump: that store's loader continues from its batch j
            part.load_state_dict({**part.state_dict(), "batches": j})
        batch = next(part)
        if part.with_index:
            batch["store"] = torch.full((len(batch["x"]),), i, dtype=torch.int64, device=batch["x"].device)
        if self._my_rows is not None:  # this rank's rows of the one-process batch
            batch = {name: t[self._my_rows] for name, t in batch.items()}
        return batch

    # -- state -----------------------------------------------------------------------
    def _identity(self) -> dict:
        stores = []
        for p, n, r in zip(self.parts, self.sizes, self.repeats, strict=True):
            entry = {"kind": p.kind, "num_samples": n, "repeats": r}
            if p.kind == "streaming":
                entry["shuffle_window"] = p.shuffle_window
            stores.append(entry)
        return {"kind": self.kind, "seed": self.seed, "batch_size": self.batch_size, "world_size": self.world_size,
                "split": self.split, "num_batches": self.batches_per_epoch, "stores": stores}

    def state_dict(self) -> dict:
        e, j = divmod(self.batches, self.batches_per_epoch)
        return {**self._identity(), "batches": self.batches, "epoch": e, "offset": j * self._stream_batch,
                "rank": self.rank}

    def load_state_dict(self, state: dict, *, strict: bool = True) -> None:
        """Continue after state["batches"] batches (any rank's state resumes every rank). strict: refuse a
        state of other stores, repeats, seed, batch size or world size; strict=False takes the batch count only."""
        if state.get("kind") != self.kind:
            raise LoaderStateError(f"loader state is for a {state.get('kind')!r} loader, this one is a mixture of "
                                   f"{len(self.parts)} stores; resume with the stores it was saved with")
        self._resume(state, strict, "this mixture", "stores, repeats and settings")

    def _reset(self) -> None:
        pass  # the stores' loaders keep their own positions; _make moves one that is elsewhere

    # -- memory and lifetime ---------------------------------------------------------
    def describe_measured(self) -> str | None:
        """The streaming stores' end-of-run memory lines, each named."""
        lines = [f"{name}: {line}" for name, p in zip(self.names, self.parts, strict=True)
                 if (f := getattr(p, "describe_measured", None)) is not None and (line := f()) is not None]
        return "; ".join(lines) or None

    def close(self) -> None:
        for p in self.parts:
            p.close()

    def __repr__(self):
        return (f"MixtureLoader({len(self.parts)} stores, batch_size={self.batch_size}, "
                f"rank={self.rank}/{self.world_size}, batches={self.batches}; {self.reason})")


# ---------------------------------------------------------------------------------------
# What may be mixed, and building the mixture
# ---------------------------------------------------------------------------------------
def _vae_key(store: Store) -> dict:
    """What makes two stores' latents the same space: the autoencoder and its scaling."""
    vae = store.manifest.get("vae") or {}
    keys = ("id", "name", "revision", "weights_sha256", "scaling_factor", "shift_factor", "latent_channels",
            "downsample", "latent_norm")
    return {k: vae.get(k) for k in keys}


def _text_key(store: Store) -> dict:
    """What makes two stores' caption embeddings the same: the text encoder and its widths."""
    text = store.conditioning.text or {}
    return {k: v for k, v in text.items() if k not in ("empty", "caption_set", "max_length_seen")}


def check_stores(stores: list[Store], names: list[str]) -> None:
    """Refuse (LoaderError, one line naming the store that differs from the first) stores that cannot be mixed:
    another latent shape, autoencoder (its latents another space, or another scaling, so --latent-norm and
    sampling would treat them wrongly), conditioning (class count and names, text encoder and widths) or a
    bucketed store (its batches are one bucket each)."""
    first, name0 = stores[0], names[0]
    for store, name in zip(stores, names, strict=True):
        if store.buckets:
            raise LoaderError(f"--latents {name}: a bucketed store (aspect-ratio buckets) cannot be mixed; "
                              "mix plain stores, or train on it alone")
    for store, name in zip(stores[1:], names[1:], strict=True):
        differs = None
        if tuple(store.latent_shape) != tuple(first.latent_shape):
            differs = f"latent shape {'x'.join(map(str, store.latent_shape))}, not {'x'.join(map(str, first.latent_shape))}"
        elif _vae_key(store) != _vae_key(first):
            a, b = _vae_key(first), _vae_key(store)
            k = next(k for k in a if a[k] != b[k])
            differs = f"autoencoder {k} {b[k]!r}, not {a[k]!r} (another latent space or scaling)"
        else:
            a, b = first.conditioning, store.conditioning
            if a.kind != b.kind:
                differs = f"conditioning {b.kind}, not {a.kind}"
            elif a.num_classes != b.num_classes:
                differs = f"{b.num_classes} classes, not {a.num_classes}"
            elif a.class_names and b.class_names and a.class_names != b.class_names:
                differs = "other class names (the same label would mean another class)"
            elif a.pooled_dim != b.pooled_dim or (a.tokens_shape or (0, 0))[-1] != (b.tokens_shape or (0, 0))[-1]:
                differs = (f"text embeddings pooled {b.pooled_dim} / tokens {b.tokens_shape}, not pooled "
                           f"{a.pooled_dim} / tokens {a.tokens_shape}")
            elif a.kind == "text" and _text_key(store) != _text_key(first):
                differs = "another text encoder (its embeddings are another space)"
        if differs is not None:
            raise LoaderError(f"--latents {name}: cannot be mixed with {name0}: {differs}")


def build_mixture(stores, repeats: list[float], settings: LoaderConfig = LoaderConfig(), *, batch_size: int,
                  seed: int = 0, rank: int = 0, world_size: int = 1, device="cpu",
                  local_world_size: int | None = None, names: list[str] | None = None,
                  saved: dict | None = None) -> MixtureLoader:
    """A MixtureLoader over `stores` (Stores or paths) with each store's repeats. settings: as build_loader's
    (kind applies to the stores together, budget.choose_mixture; each streaming store runs settings.workers
    processes, and the streaming stores share the memory budget). saved: a checkpoint's mixture state, whose loader kinds and windows are kept (the data
    order continues; --shuffle-window, when given in settings, wins for the window)."""
    stores = [_open(s) for s in stores]
    names = list(names or [s.location for s in stores])
    check_stores(stores, names)
    s = settings
    if s.split not in ("part", "batch"):
        raise ValueError(f"unknown split {s.split!r}; use 'part' or 'batch'")
    # the stream the stores' loaders follow: this rank's part, or the one-process batch (split="batch")
    srank, sworld, sbatch = (rank, world_size, batch_size) if s.split == "part" else (0, 1, batch_size * world_size)
    saved_stores = (saved or {}).get("stores") or []
    kinds = [e.get("kind") for e in saved_stores] if len(saved_stores) == len(stores) else None
    choices, why = choose_mixture(stores, kind=s.kind, rank=rank, world_size=world_size,
                                  resident_device=s.resident_device, memory_fraction=s.memory_fraction,
                                  local_world_size=local_world_size, split=s.split, memory=s.memory, kinds=kinds)
    # Each streaming store runs --workers processes of its own: a store's loader is only as fast as its
    # workers, and with the workers shared out (1 each of 2) the mixture read at 69% of one store's rate,
    # with them all at 110% (bench/mixed_loader.py). A worker whose slots are full sleeps, so idle ones cost
    # no CPU, and their memory is inside the budget the streaming stores share (choose_mixture).
    workers = s.workers
    parts = []
    try:
        for i, (store, (kind, rdev, budget)) in enumerate(zip(stores, choices, strict=True)):
            common = dict(batch_size=sbatch, seed=store_seed(seed, i), rank=srank, world_size=sworld, device=device,
                          with_index=s.with_index, reason=kind, split="part")
            if kind == "resident":
                parts.append(ResidentLoader(store, resident_device=rdev, **common))
            else:
                window = s.shuffle_window or (saved_stores[i].get("shuffle_window") if kinds else None)
                parts.append(StreamingLoader(store, workers=workers, shuffle_window=window, prefetch=s.prefetch,
                                             memory=budget, local_world_size=local_world_size, **common))
    except BaseException:
        for p in parts:
            p.close()
        raise
    held = ", ".join(f"{n} {p.kind}" for n, p in zip(names, parts, strict=True))
    return MixtureLoader(parts, repeats, batch_size=batch_size, seed=seed, rank=rank, world_size=world_size,
                         split=s.split, names=names, reason=f"{len(parts)} stores mixed: {held}; {why}")


def check_resume(saved: dict, resolved: dict) -> str | None:
    """Why a checkpoint's mixed stores (its config's "store" record) are not this run's, as one line's words,
    or None: one store then and now (checked as before mixtures), or the same stores in the same order (by identity; where they are may change), whatever their repeats
    (another R is a learned change, which dittrain.train.resume lets through with --allow-changes)."""
    def ids(record):
        mixture = record.get("mixture")
        return [m["identity"] for m in mixture] if mixture else [record.get("identity")]

    if not (saved.get("store") or {}).get("mixture") and not (resolved.get("store") or {}).get("mixture"):
        return None  # one store then and now: the run's own check (made with another latent store)
    old, new = ids(saved.get("store") or {}), ids(resolved.get("store") or {})
    if old == new:
        return None
    if len(old) != len(new):
        return (f"it was trained on {len(old)} store(s), this run names {len(new)}; the stores of a run cannot "
                "change on a resume")
    i = next(i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b)
    return f"store {i + 1} of its --latents is another store ({old[i][:19]}... then, {new[i][:19]}... now)"


def pooled_latent_record(stores: list[Store], norm: str) -> dict:
    """The run config's "latents" section of a mixture (dittrain.data.latent_norm.latent_record's): with
    channel, the per-channel mean and std of all the stores' latents together, pooled from each store's
    recorded statistics by their counts (not by the repeats: the statistics say what the latents are, and a
    resume that changes the repeats keeps them); none as one store's."""
    records = [latent_record(s, norm) for s in stores]  # each store's own checks (one line naming its manifest)
    if records[0]["norm"] != "channel":
        return records[0]
    counts = np.array([r["stats_count"] for r in records], dtype=np.float64)
    w = counts / counts.sum()
    means = np.array([r["mean"] for r in records], dtype=np.float64)
    stds = np.array([r["std"] for r in records], dtype=np.float64)
    mean = w @ means
    var = w @ (stds**2 + means**2) - mean**2  # the law of total variance over the stores
    return {"norm": "channel", "mean": [float(v) for v in mean], "std": [float(v) for v in np.sqrt(np.maximum(var, 0))],
            "stats_count": int(counts.sum())}


def mixture_record(stores: list[Store], repeats: list[float]) -> list[dict]:
    """The run record's "store" "mixture" entry: each store where it was found, its identity, size, repeats."""
    return [{"path": s.location, "identity": s.identity, "num_samples": len(s), "repeats": float(r)}
            for s, r in zip(stores, repeats, strict=True)]


__all__ = ["MixtureLoader", "build_mixture", "check_resume", "check_stores", "mixture_record", "per_epoch",
           "pooled_latent_record", "store_seed"]
