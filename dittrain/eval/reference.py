"""A reference's statistics and their cache.

FID and sFID need a reference's mean and covariance of the pool and spatial features;
precision/recall its pool features and their k=3 manifold radii. An ADM reference batch
(VIRTUAL_imagenet256_labeled.npz) carries mu / sigma / mu_s / sigma_s: those are used as
they are, its images only for precision/recall. Anything computed is cached beside the
reference (REF.ditkit-stats-KEY.npz beside a file, REF/.ditkit-stats-KEY.npz in a folder),
else, where that is read-only, in the cache folder ($XDG_CACHE_HOME/ditkit/eval, by default
~/.cache/ditkit/eval). KEY names the reference's content, the crop, the Inception weights
and the feature set, so a changed input never reads a stale file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ditdata.common.errors import one_line
from dittrain.eval.errors import EvalError
from dittrain.eval.features import image_features, source_features
from dittrain.eval.inception import FEATURE_SET, POOL_DIM, SPATIAL_DIM, Inception
from dittrain.eval.manifold import PR_K, manifold_radii
from dittrain.eval.metrics import feature_stats
from dittrain.eval.sources import Source, npz_array, open_source

CACHE_VERSION = 1
STATS_NAME = ".ditkit-stats-"  # REF.ditkit-stats-KEY.npz beside a file, REF/.ditkit-stats-KEY.npz in a folder
_PRECOMPUTED = ("mu", "sigma", "mu_s", "sigma_s")  # an ADM reference batch's statistics


@dataclass
class RefStats:
    """What the metrics need of a reference: FID (mu, sigma) and sFID (mu_s, sigma_s)
    statistics, and for precision/recall its pool features and their k=3 radii."""

    mu: np.ndarray
    sigma: np.ndarray
    mu_s: np.ndarray
    sigma_s: np.ndarray
    n: int | None  # reference images
    pool: np.ndarray | None = None  # (n, 2048) float32, for precision/recall
    radii: np.ndarray | None = None  # manifold_radii(pool, PR_K)
    digest: str | None = None  # the reference's content digest (Source.digest)
    source: str | None = None
    precomputed: bool = False  # FID/sFID statistics read from an ADM reference batch
    cache: str | None = None  # the cache file read or written
    cached: bool = False  # read from the cache: the network did not run on the reference
    skipped: int = 0  # unusable reference images


def image_stats(images, inception: Inception, *, batch_size: int = 64, with_pr: bool = True,
                progress: bool = False) -> RefStats:
    """RefStats of images (anything image_features takes), not cached."""
    return stats_from_features(image_features(images, inception, batch_size=batch_size, progress=progress,
                                              desc="reference"), with_pr=with_pr,
                               device=inception.device)


def stats_from_features(feats: dict, *, with_pr: bool = True, device="cpu") -> RefStats:
    mu, sigma = feature_stats(feats["pool"])
    mu_s, sigma_s = feature_stats(feats["spatial"])
    stats = RefStats(mu, sigma, mu_s, sigma_s, len(feats["pool"]))
    if with_pr:
        stats.pool = np.asarray(feats["pool"], np.float32)
        stats.radii = manifold_radii(stats.pool, PR_K, device=device)
    return stats


def cache_key(digest: str, resolution: int | None, inception_sha256: str, with_pool: bool) -> str:
    """The cache key: reference content, crop resolution, Inception weights, feature set."""
    from ditdata.common.files import json_digest

    spec = {"version": CACHE_VERSION, "ref": digest, "resolution": resolution, "inception": inception_sha256,
            "features": FEATURE_SET + (f"+pool,radii-k{PR_K}" if with_pool else "")}
    return json_digest(spec)[:20]


def default_cache_dir() -> Path:
    """Where statistics go when a reference's own folder is read-only: $XDG_CACHE_HOME/ditkit/eval,
    else ~/.cache/ditkit/eval (read at call time)."""
    from ditdata.common.cache import cache_dir

    return cache_dir("eval")


def _cache_paths(ref: Path, key: str, cache_dir) -> list[Path]:
    name = f"{STATS_NAME}{key}.npz"
    beside = ref / name if ref.is_dir() else ref.with_name(ref.name + name)
    elsewhere = (Path(cache_dir).expanduser() if cache_dir else default_cache_dir()) / f"{ref.name}{name}"
    return [beside, elsewhere]


def _read_cache(path: Path, with_pool: bool, log) -> RefStats | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            d = {k: z[k] for k in z.files}
        stats = RefStats(d["mu"], d["sigma"], d["mu_s"], d["sigma_s"], int(d["n"]) if int(d["n"]) >= 0 else None,
                         pool=d.get("pool"), radii=d.get("radii"), precomputed=bool(d["precomputed"]),
                         skipped=int(d["skipped"]))
        ok = (stats.mu.shape == (POOL_DIM,) and stats.sigma.shape == (POOL_DIM,) * 2
              and stats.mu_s.shape == (SPATIAL_DIM,) and stats.sigma_s.shape == (SPATIAL_DIM,) * 2
              and (not with_pool or (stats.pool is not None and stats.radii is not None
                                     and stats.pool.shape[1:] == (POOL_DIM,)
                                     and stats.radii.shape == stats.pool.shape[:1])))
        if not ok:
            raise ValueError("unexpected shapes")
    except Exception as e:
        log(f"note: ignoring the unreadable reference cache {path} ({one_line(e, 100)}); recomputing")
        return None
    return stats


def _write_cache(stats: RefStats, paths: list[Path], log) -> Path | None:
    """Write the statistics atomically beside the reference, else (read-only) in the cache
    dir; an eval never fails for want of a cache."""
    from ditdata.common import files

    arrays = {"mu": stats.mu, "sigma": stats.sigma, "mu_s": stats.mu_s, "sigma_s": stats.sigma_s,
              "n": np.int64(-1 if stats.n is None else stats.n), "precomputed": np.bool_(stats.precomputed),
              "skipped": np.int64(stats.skipped)}
    if stats.pool is not None:
        arrays |= {"pool": stats.pool, "radii": stats.radii}
    errors = []
    for p in paths:
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            with files.atomic_file(p, "wb") as f:
                np.savez(f, **arrays)
        except OSError as e:
            errors.append(f"{p}: {files.error_reason(e)}")
            continue
        if errors:
            log(f"note: reference statistics cached in {p} (not beside the reference: {errors[0]})")
        return p
    log(f"note: the reference statistics were not cached ({'; '.join(errors)})")
    return None


def reference_stats(ref, inception: Inception, *, resolution: int | None = None, batch_size: int = 64,
                    cache_dir=None, with_pr: bool = True, progress: bool = False,
                    log: Callable[[str], None] | None = None) -> RefStats:
    """The statistics of a reference: an .npz (ADM's reference batches: precomputed mu, sigma,
    mu_s, sigma_s are used as they are, its images only for precision/recall), a folder of
    images or a `ditdata fetch` image-shard folder (both centre-cropped to `resolution` with
    the encoder's ADM rule when it is given; shards need it). Images at their own size
    otherwise.

    Cached beside the reference (REF.ditkit-stats-KEY.npz for a file, REF/.ditkit-stats-KEY.npz
    for a folder; in `cache_dir`, default default_cache_dir(), where that is read-only),
    KEY = cache_key(content digest, resolution, Inception sha256, feature set). A second
    call with the same reference reads the file instead of running the network."""
    log = log or (lambda line: None)
    src = ref if isinstance(ref, Source) else open_source(ref, resolution=resolution)
    resolution = src.resolution  # the crop applied (None for an .npz: ADM batches are fed as they are)
    # the statistics an ADM reference batch carries (those present; checked: float64)
    shapes = {"mu": (POOL_DIM,), "sigma": (POOL_DIM,) * 2, "mu_s": (SPATIAL_DIM,), "sigma_s": (SPATIAL_DIM,) * 2}
    given = {name: npz_array(src, name, shapes[name]) for name in _PRECOMPUTED if name in src.npz}
    if len(given) == len(_PRECOMPUTED) and not with_pr:
        return RefStats(**given, n=src.count, source=str(src.path), precomputed=True)
    digest = src.digest()
    keys = [cache_key(digest, resolution, inception.sha256, True)]
    if not with_pr:
        keys.insert(0, cache_key(digest, resolution, inception.sha256, False))
    for key in keys:
        for p in _cache_paths(src.path, key, cache_dir):
            stats = _read_cache(p, with_pr, log)
            if stats is not None:
                if not with_pr:
                    stats.pool = stats.radii = None
                stats.digest, stats.source, stats.cache, stats.cached = digest, str(src.path), str(p), True
                return stats
    if src.kind == "npz" and src.arr is None:
        raise EvalError(f"{src.path}: no arr_0 (ADM's images array) in this .npz"
                        + (f" and not all of {', '.join(_PRECOMPUTED)}" if len(given) < 4 else ""))
    feats = source_features(src, inception, batch_size=batch_size, progress=progress, desc="reference",
                            keep=("pool", "spatial"))  # no IS for a reference: its logits are not kept
    stats = stats_from_features(feats, with_pr=with_pr, device=inception.device)
    stats.skipped, stats.digest, stats.source = src.skipped, digest, str(src.path)
    if src.skipped:
        log(f"note: skipped {src.skipped} unusable reference images (e.g. {src.skipped_examples[0]})")
    for name, value in given.items():  # an ADM reference batch's own statistics win
        setattr(stats, name, value)
    stats.precomputed = bool(given)
    written = _write_cache(stats, _cache_paths(src.path, keys[-1], cache_dir), log)
    stats.cache = str(written) if written else None
    return stats
