"""A held-out validation loss: the same numbers for the same weights, so a curve moves only
when the weights do, and two runs on the same store compare.

    --val-fraction F      F of the training store's rows held out: never in a training batch
                          (every loader kind skips them: dittrain.data's `exclude`)
    --val-latents STORE   or every row of a second store (same latent shape, conditioning and
                          autoencoder); the training store keeps all its rows
    --val-every N         every N steps, at the start of a fresh run (step 0) and at the last step

    val = build(run)                    None without either; a one-line TrainError for bad values
    val.exclude                         the training store's held-out rows (for the loaders), or None
    rec = val.evaluate(model, rank=, world=)   {"loss", "loss_t50", ..., "rows", "seconds"}
    validate(run, state, step, log)     the loop's hook: evaluate the live weights, log val/*

What is measured. For every validation row x0 and each of VAL_TIMESTEPS fixed t (the midpoints of
equal bins of the objective's range: ddpm timesteps 50, 150, ..., 950 of 1000; flow t = 0.05, ...,
0.95, unshifted: --t-shift changes how training draws t, not the noise level a curve is at), the
plain MSE of the training objective's target: eps for ddpm, the velocity eps - x0 for flow. It is
unweighted (no --loss-weighting) and without a learned variance's VLB term, so runs that differ in
those compare; it is the training loss' "mse" term (Diffusion.training_loss), at a fixed t instead
of a drawn one. val/loss is the mean over the t values (for ddpm an estimate of the mean over
uniform t; flow runs draw t logit-normally, so val/loss is not their training loss' expectation:
watch its trend, and the per-t curves val/loss_t<T>). Conditioning: the row's own label or caption,
never dropped.

Fixed noise. The split and every random number come from VAL_SEED, the validation's own seed, not
--seed: a row's noise (one eps per t, and for a mean/std store one posterior draw) is drawn from a
CPU generator seeded by (VAL_SEED, row), so it is the same at every evaluation, in every run on the
same store, on any device and with any --eval-batch-size, and the training's random streams are
untouched (a run with --val-latents trains exactly as one without). A flipped twin is never used.

The weights: the LIVE ones (state.model), not the EMA. The training loss is the live weights', so
train and val curves compare like with like; an EMA of 0.9999 averages the last ~10K steps, so its
val loss would trail the live one by thousands of steps (and sit near the initial weights' early
on), hiding the onset of overfitting; kohya's sd-scripts and SimpleTuner (after "Demystifying SD
fine-tuning") evaluate the network being trained too. The EMA's quality is what --eval-every's FID
measures.

The held-out rows are a seeded choice of round(F n) rows (at least one), stratified by bucket on a
bucketed store (round(F n_b) of each bucket, each keeping a row to train on). They are held in
memory as a resident loader holds rows (their latents, labels or captions), read once at the start;
the cost of an evaluation is rows x VAL_TIMESTEPS forward passes, shared out over the ranks
(bench/validation_cost.py).
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as torch_dist

from ditdata.common.devices import autocast
from dittrain.config import VAL_TIMESTEPS
from dittrain.data import ResidentLoader
from dittrain.data.base import kept_rows
from dittrain.data.latent_norm import LatentNorm
from dittrain.train.log import measure
from dittrain.train.setup import Run, TrainError
from dittrain.train.step import conditioning, empty_text_on

VAL_SEED = 20261205  # the split's and the noise's seed: the validation's own, the same for every run
_SPLIT, _NOISE = 1, 2  # tags of its two random streams


def _seeded(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(k) for k in key])))


def held_out(counts: list[int], fraction: float) -> list[np.ndarray]:
    """The rows held out of each part of a store (a plain store: one part; a bucketed one: each
    bucket, by the store's order), as sorted rows of that part: round(fraction x n) of each (a part
    keeps at least one row to train on), at least one in all, a seeded choice (VAL_SEED, part).
    ValueError when the store is too small to hold any row out."""
    picks = [min(int(round(fraction * n)), max(n - 1, 0)) for n in counts]
    if sum(picks) == 0:
        largest = int(np.argmax(counts)) if counts else 0
        if not counts or counts[largest] < 2:
            raise ValueError(f"{sum(counts)} rows: too few to hold any out and still train on each part")
        picks[largest] = 1
    return [np.sort(_seeded(VAL_SEED, _SPLIT, b).permutation(n)[:k]).astype(np.int64)
            for b, (n, k) in enumerate(zip(counts, picks, strict=True))]


def t_values(objective: str, num_timesteps: int = 1000, k: int = VAL_TIMESTEPS) -> list:
    """The fixed t of the validation loss: the midpoints of k equal bins of the objective's range
    (ddpm: integer timesteps of num_timesteps; flow: t in (0, 1))."""
    if objective == "flow":
        return [(j + 0.5) / k for j in range(k)]
    return [int((j + 0.5) * num_timesteps / k) for j in range(k)]


def t_label(t) -> str:
    """A t value as its key says it: val/loss_t50 (ddpm), val/loss_t0.05 (flow)."""
    return f"t{t}" if isinstance(t, int) else f"t{t:g}"


class _Part:
    """One store's (or bucket's) validation rows, held by a ResidentLoader that excludes every
    other row; `first` numbers its rows in the whole store (the noise's key)."""

    def __init__(self, store, rows: np.ndarray, first: int, batch: int, device):
        self.rows, self.first = rows, first
        self.batch = min(batch, len(rows))  # forwards of this many rows (a smaller set: one batch, unpadded)
        others = np.setdiff1d(np.arange(len(store), dtype=np.int64), rows, assume_unique=True)
        self.loader = ResidentLoader(store, batch_size=self.batch, device=device, exclude=others,
                                     reason="validation rows")
        self.shape = tuple(self.loader.spec.lat_shape)


class Validation:
    """The validation rows and how their loss is computed (the module's docstring)."""

    def __init__(self, run: Run, parts: list[_Part], *, exclude: np.ndarray | None, source: str, record: dict):
        self.run, self.parts, self.exclude, self.source = run, parts, exclude, source
        diffusion = run.diffusion
        self.objective = diffusion.config.objective
        self.t = t_values(self.objective, diffusion.config.num_timesteps)
        self.norm = LatentNorm.from_config(run.resolved)
        self.empty_text = empty_text_on(run.store, run.device)
        self.rows = sum(len(p.rows) for p in parts)
        self.record = {**record, "rows": self.rows, "t": self.t, "weights": "live", "loss": "mse", "seed": VAL_SEED}

    def describe(self) -> str:
        """The startup line's words."""
        t = self.t
        return (f"validation loss every {self.run.cfg.eval.val_every} steps: {self.rows} {self.source} x "
                f"{len(t)} fixed t ({t[0]}..{t[-1]}), fixed noise, the live weights' MSE")

    def _noise(self, part: _Part, lo: int, hi: int, extra: int) -> torch.Tensor:
        """(hi - lo, len(t) + extra, C, h, w): each row's eps per t (and its posterior draw), from a CPU
        generator seeded by (VAL_SEED, row in the store): the same numbers wherever and whenever."""
        g = torch.Generator()
        out = torch.empty((hi - lo, len(self.t) + extra, *part.shape))
        for i, row in enumerate(part.rows[lo:hi]):
            g.manual_seed(int(_seeded(VAL_SEED, _NOISE, part.first + int(row)).integers(2**63)))
            torch.randn(out.shape[1:], generator=g, out=out[i])
        return out

    @torch.no_grad()
    def evaluate(self, model, *, rank: int = 0, world: int = 1) -> dict:
        """The validation loss of `model`: {"loss", "loss_t<T>" per t, "rows", "seconds"}; each rank
        takes every world-th batch, the sums meet in one all-reduce (float64). A failure on any rank
        is raised on every rank, after that all-reduce: no rank is left waiting in it."""
        device = self.run.device
        t0 = time.perf_counter()
        sums = torch.zeros(len(self.t), dtype=torch.float64, device=device)
        count = torch.zeros((), dtype=torch.float64, device=device)
        failed = None
        try:
            self._sum(model, sums, count, rank, world)
        except Exception as e:  # every rank must still meet the all-reduce below (a rank-local OOM, say)
            if world == 1:
                raise
            failed = e
        if world > 1:
            both = torch.cat([sums, count.view(1), torch.ones(1, dtype=sums.dtype, device=device) * (failed is not None)])
            torch_dist.all_reduce(both)
            sums, count = both[:-2], both[-2]
            if both[-1] > 0:  # all ranks give up together, so their next collectives still pair up
                raise failed or RuntimeError(f"it failed on {int(both[-1])} other rank(s)")
        per_t = (sums / count).tolist()
        rec = {"loss": sum(per_t) / len(per_t)}
        rec |= {f"loss_{t_label(t)}": v for t, v in zip(self.t, per_t, strict=True)}
        return rec | {"rows": self.rows, "seconds": time.perf_counter() - t0}

    def _sum(self, model, sums: torch.Tensor, count: torch.Tensor, rank: int, world: int) -> None:
        """Adds this rank's share (every world-th batch) into sums (per t) and count, in place."""
        run, device = self.run, self.run.device
        k = 0
        for part in self.parts:
            loader, n, B = part.loader, len(part.rows), part.batch
            for lo in range(0, n, B):
                k += 1
                if (k - 1) % world != rank:
                    continue
                hi = min(n, lo + B)
                # a whole batch of B (the last one padded with its first rows, whose losses are not counted)
                order = torch.arange(lo, lo + B, device=loader.resident_device) % n
                batch, lat = loader.fixed_batch(order)
                mean_std = loader.spec.P == 2
                noise = self._noise(part, lo, hi, 1 if mean_std else 0)
                if hi - lo < B:
                    noise = torch.cat([noise, noise[:1].expand(B - (hi - lo), *noise.shape[1:])])
                noise = noise.to(device)
                if mean_std:  # one posterior draw per row, fixed: mean + std x its own eps
                    lat = lat.to(device).float()
                    batch["x"] = torch.addcmul(lat[:, 0], lat[:, 1], noise[:, -1])
                x0 = batch["x"] if self.norm is None else self.norm.normalize(batch["x"])
                kwargs = conditioning(batch, self.empty_text, run.cfg, torch.ones(B, device=device))
                for j, t in enumerate(self.t):
                    tt = torch.full((B,), t, device=device, dtype=torch.float32 if self.objective == "flow" else torch.long)
                    with autocast(device, run.amp_dtype):
                        mse = run.diffusion.training_loss(model, x0, kwargs, t=tt, noise=noise[:, j],
                                                          return_terms=True)["mse"]
                    sums[j] += mse[:hi - lo].double().sum()
                count += hi - lo


def build(run: Run) -> Validation | None:
    """The run's validation (--val-fraction or --val-latents), or None; a one-line TrainError for
    values that cannot work. Reads the validation rows into memory."""
    e = run.cfg.eval
    if not e.val_fraction and not e.val_latents:
        return None
    if e.val_fraction and e.val_latents:
        raise TrainError(f"--val-fraction {e.val_fraction:g} and --val-latents {e.val_latents}: give one (hold out "
                         "rows of --latents, or validate on another store)")
    if e.val_fraction and len(getattr(run, "stores", None) or ()) > 1:
        # a mixture's loaders read every store whole: a held-out share of one would be trained on
        raise TrainError(f"--val-fraction {e.val_fraction:g} holds out rows of one store, not of several --latents; "
                         "validate a mixture on another store: --val-latents STORE")
    if not 0 <= e.val_fraction < 1:
        raise TrainError(f"--val-fraction {e.val_fraction!r}: a share of the store's rows, 0 <= F < 1")
    B = run.cfg.eval.eval_batch_size
    if e.val_fraction:
        store = getattr(run.store, "base", run.store)  # the latents alone (not --repa's feature set)
        stores = [b.store for b in store.buckets] if store.buckets else [store]
        try:
            rows = held_out([len(s) for s in stores], e.val_fraction)
        except ValueError as err:
            raise TrainError(f"--val-fraction {e.val_fraction:g}: {err} ({e.val_fraction:g} of {len(store)})") from None
        firsts = np.cumsum([0] + [len(s) for s in stores])[:-1]
        exclude = np.concatenate([r + f for r, f in zip(rows, firsts, strict=True)])
        parts = [_Part(s, r, int(f), B, run.device) for s, r, f in zip(stores, rows, firsts, strict=True) if len(r)]
        source = f"held-out rows ({e.val_fraction:g} of {len(store)}, never trained on)"
        return Validation(run, parts, exclude=exclude, source=source,
                          record={"fraction": e.val_fraction, "held_out": int(len(exclude))})
    store = _val_store(run, e.val_latents)
    stores = [b.store for b in store.buckets] if store.buckets else [store]
    firsts = np.cumsum([0] + [len(s) for s in stores])[:-1]
    parts = [_Part(s, kept_rows(len(s), None), int(f), B, run.device)
             for s, f in zip(stores, firsts, strict=True) if len(s)]
    return Validation(run, parts, exclude=None, source=f"rows of {e.val_latents}",
                      record={"store": {"path": store.location, "identity": store.identity}})


def _val_store(run: Run, path: str):
    """--val-latents: the store, refused in one line when the model cannot read it or its latents
    are another autoencoder's (the loss would compare other numbers)."""
    from ditdata.common.errors import UserError
    from ditdata.store import open_store
    from dittrain.inference.open_run import store_mismatches

    d = run.cfg.data
    try:
        store = open_store(path, cache_dir=d.cache_dir or None, cache_limit=d.cache_limit)
    except UserError as err:
        raise TrainError(f"--val-latents {path}: {err}") from None
    problems = store_mismatches(store, run.model_cfg)
    if problems:
        raise TrainError(f"--val-latents {path}: does not fit the model of --latents: {'; '.join(problems)}")
    mine, theirs = (s.manifest.get("vae") or {} for s in (run.store, store))
    for key in ("name", "weights_sha256"):
        if mine.get(key) is not None and theirs.get(key) is not None and mine[key] != theirs[key]:
            raise TrainError(f"--val-latents {path}: encoded with another autoencoder ({key} {theirs[key]!r}, "
                             f"--latents: {mine[key]!r}); encode the validation images with the same --vae")
    return store


def validate(run: Run, state, step: int, log) -> None:
    """The loop's hook: the validation loss of the live weights at `step`, logged by rank 0 (val/*).
    A failure is a note, as an FID evaluation's: it never stops the run."""
    measure(run, step, log, "validation", "validating",
            lambda: run.validation.evaluate(state.model, rank=run.rank, world=run.world), log.validation)


__all__ = ["VAL_SEED", "Validation", "build", "held_out", "t_label", "t_values", "validate"]
