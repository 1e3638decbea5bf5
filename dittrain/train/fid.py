"""FID during training: `dittrain run --eval-every N` measures the EMA model against a reference.

The sampling side of the trainer's evaluation lives here, next to the trainer; the metrics
library (dittrain.eval) knows nothing of sampling. torch and the sampler are imported inside
the calls that need them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from ditdata.common.errors import UserError, described
from dittrain.config import EvalSection, format_cfg_interval, parse_cfg_interval
from dittrain.eval import (
    FEATURES,
    EvalError,
    Inception,
    RefStats,
    compute_metrics,
    find_inception,
    image_features,
    load_inception,
    open_source,
    reference_stats,
)


class TrainingEval:
    """`dittrain run --eval-every N`: FID-n (and sFID, IS) of the EMA model against a reference.

    Made at the start of a run on every rank, so a missing Inception file or reference fails
    before the first step; the network (and, on rank 0, the reference statistics, cached
    beside the reference: see reference_stats) load at the first evaluation. Each evaluation
    samples the same n images' classes (balanced, from the seed) and noise: chunk i (the
    `batch_size` samples from i * batch_size) is drawn with seed + i, by rank i % world, so
    the figure does not depend on the number of ranks, and every rank shares the work (the
    others would otherwise wait for rank 0 at their next collective). Images become features
    chunk by chunk and are never all kept; the features meet on rank 0. Precision/recall are
    left to `dittrain eval`. The trainer catches every failure of a call: an evaluation never
    stops a run."""

    def __init__(self, settings: EvalSection, *, resolution: int | None = None, seed: int = 0, cache_dir=None,
                 log: Callable[[str], None] | None = None, objective: str | None = None):
        """settings: the run's eval section (--eval-ref, --eval-n, --eval-inception, --eval-steps,
        --eval-cfg, --eval-sampler, --eval-cfg-interval, --eval-time-shift, --eval-batch-size; 0
        steps: the FID protocol's). resolution: the store's image size, the reference's crop;
        seed: the run's; objective: the run's, to refuse a sampler that does not fit it now."""
        n = settings.eval_n
        if n < 2:
            raise EvalError(f"--eval-n must be at least 2 (a covariance needs two samples), got {n}")
        self.n, self.steps, self.cfg_scale = n, settings.eval_steps or None, settings.eval_cfg
        # the sampler (None: the objective's), the guidance interval and the grid's shift (None: the run's --t-shift)
        self.sampler, self.time_shift = settings.eval_sampler or None, settings.eval_time_shift
        try:
            self.cfg_interval = parse_cfg_interval(settings.eval_cfg_interval)
        except ValueError as e:
            raise EvalError(f"--eval-cfg-interval {e}") from None
        if objective is not None:  # a sampler or a shift that does not fit the run: refused before the first step
            self._check(objective)
        self.weights = find_inception(settings.eval_inception or None)  # fail now, not after hours of training
        self.ref_source = open_source(settings.eval_ref, resolution=resolution)
        self.resolution = resolution
        self.seed, self.batch_size = seed, settings.eval_batch_size
        self.cache_dir, self.log = cache_dir, log or (lambda line: None)
        self.inception: Inception | None = None
        self.ref: RefStats | None = None

    def _check(self, objective: str) -> None:
        """EvalError when --eval-sampler or --eval-time-shift does not fit the run's objective."""
        from dittrain.diffusion import DiffusionConfig
        from dittrain.inference.sample import check_guidance_times, check_sampler

        diffusion = DiffusionConfig(objective=objective, learn_sigma=False)
        try:
            check_sampler(diffusion, self.sampler, self.steps or 2)
        except UserError as e:
            raise EvalError(f"--eval-sampler: {e}") from None
        try:
            check_guidance_times(diffusion, self._settings(objective))
        except UserError as e:
            raise EvalError(str(e).replace("--time-shift", "--eval-time-shift")) from None

    def _settings(self, objective: str):
        """The SampleConfig of an evaluation (eval_settings: the FID protocol's steps and cfg unless given)."""
        from dittrain.inference.eval_samples import eval_settings

        return eval_settings(objective, steps=self.steps, cfg_scale=self.cfg_scale, sampler=self.sampler,
                             cfg_interval=self.cfg_interval, time_shift=self.time_shift)

    def _reference(self) -> RefStats:
        if self.ref is None:
            self.ref = reference_stats(self.ref_source, self.inception, resolution=self.resolution,
                                       batch_size=self.batch_size, cache_dir=self.cache_dir, with_pr=False,
                                       log=self.log)
        return self.ref

    def __call__(self, model, config: dict, store, *, rank: int = 0, world: int = 1) -> dict | None:
        """{"fid", "sfid", "inception_score", "eval_n", ...} of `model` (the EMA DiT, on its
        device; put back in its mode afterwards) sampled with the run's store, on rank 0 (None
        on the others). With world > 1 every rank must call it. A failure on any rank (an OOM on
        one card, say) is raised after the gather, on that rank and on rank 0, which names it: no
        rank is left waiting in a collective the failed one never reaches."""
        t0 = time.time()
        failed = None
        try:
            mine, settings = self._my_chunks(model, config, store, rank, world)
        except Exception as e:  # every rank must still meet the gather below
            if world == 1:
                raise
            failed, mine, settings = e, {}, None
        chunks = mine  # every rank's {chunk: features} merged on rank 0 ({} elsewhere)
        if world > 1:
            import torch.distributed as dist

            parts = [None] * world if rank == 0 else None
            dist.gather_object({"chunks": mine, "failed": None if failed is None else described(failed)}, parts, dst=0)
            if failed is not None:
                raise failed
            if rank != 0:
                return None
            others = [f"rank {r} ({p['failed']})" for r, p in enumerate(parts) if p["failed"] is not None]
            if others:  # rank 0 alone goes on to the metrics, so the ranks' next collectives still pair up
                raise RuntimeError(f"it failed on {', '.join(others)}")
            chunks = {i: f for part in parts for i, f in part["chunks"].items()}
        feats = {k: np.concatenate([chunks[i][k] for i in sorted(chunks)]) for k in FEATURES}
        metrics = compute_metrics(feats, self._reference(), with_pr=False)
        return {"fid": metrics["fid"], "sfid": metrics["sfid"], "inception_score": metrics["inception_score"],
                "eval_n": self.n, "eval_steps": settings.steps, "eval_cfg": settings.cfg_scale,
                # text where the loggers take numbers (TensorBoard keeps text out, metrics.jsonl has it)
                "eval_sampler": settings.sampler, "eval_cfg_interval": format_cfg_interval(settings.cfg_interval),
                **({} if settings.time_shift is None else {"eval_time_shift": settings.time_shift}),
                "eval_seconds": round(time.time() - t0, 3)}

    def _my_chunks(self, model, config: dict, store, rank: int, world: int):
        """({chunk index: Inception features} of the chunks this rank draws, the resolved SampleConfig)."""
        import torch

        from dittrain.inference import open_run, sample

        device = next(model.parameters()).device
        if self.inception is None:
            self.inception = load_inception(self.weights, device)
        diffusion = open_run.diffusion_config(config)  # the sampler and the time shift resolved, for the record
        settings = sample.check_guidance_times(diffusion, self._settings(diffusion.objective))
        settings = replace(settings, sampler=sample.check_sampler(diffusion, settings.sampler, settings.steps))
        kind = open_run.conditioning_kind(model.config)
        labels = sample.balanced_labels(self.n, model.config.num_classes, self.seed) if kind == "class" else None
        text = sample.store_text(store, self.n) if kind == "text" else None
        autoencoder = sample.kept_autoencoder(store, device)
        mine = {}
        for i, start in enumerate(range(0, self.n, self.batch_size)):
            if i % world != rank:
                continue
            stop = min(start + self.batch_size, self.n)
            chunk = replace(settings, n=stop - start, seed=self.seed + i, batch_size=self.batch_size)
            chunk_text = None
            if text is not None:  # rows start..stop of the text embeddings, cycled (the store's first captions, over n)
                rows = torch.arange(start, stop) % len(next(iter(text.values())))
                chunk_text = {k: v[rows] for k, v in text.items()}
            images = sample.sample_images(
                model, config, store, chunk, labels=None if labels is None else labels[start:stop],
                text=chunk_text, autoencoder=autoencoder)
            mine[i] = image_features(images, self.inception, batch_size=self.batch_size)
        return mine, settings
