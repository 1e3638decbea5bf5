"""`ditdata features`: representation targets (e.g. DINOv2 patch tokens, for REPA) cached in
a latent store as a feature set, beside its latents and row for row, without touching them.

    STORE's shards (their keys, in order) + the image shards the store was encoded from
        --(encode's reader: decode, the store's centre crop; only the store's keys)--> uint8
        --(the encoder at its input resolution; the flipped image too when the store has
           flips; optional PCA; int8 per token)--> STORE/features/SET   (ditdata.store.features)

One writer per store: the command holds the store's lock (the one `ditdata encode` holds).
Each feature shard is published atomically, so a killed run is resumed by running it again;
under torchrun each rank takes every WORLD_SIZE-th store shard and rank 0 writes the feature
set's manifest once all are done. `ditdata encode --features NAME` makes the same feature
set in encode's own pass (encode_pass.py).

Modules: encoders.py (the table of encoders and how each is loaded, offline), targets.py
(images -> stored targets, and the calibration: PCA fit, cosine to fp32), pca.py, passes.py
(the pass over a store's shards), encode_pass.py (the encode hook). The images come from ditdata.imageshards.batches,
the reader encode uses. Here: the command, the checks of a feature set's options and the
end-of-run line (encode --features uses both). Importing this package is cheap: torch and
transformers are imported inside the calls.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict
from pathlib import Path

from ditdata.config import FEATURE_DTYPES, FEATURE_RESIZES, MAX_RESOLUTION, FeaturesConfig
from ditdata.errors import DitdataError

from .encoders import default_feature_set_name

# Ranks wait for each other at the manifest: a rank with more (or slower) shards may take hours.
GROUP_TIMEOUT = dt.timedelta(hours=12)


def check_options(*, dtype: str, dims: int | None, resolution: int | None, resize: str = "reference",
                  flag: str = "--features") -> None:
    """The options a feature set is made with (one line naming the flag when one is wrong)."""
    if resize not in FEATURE_RESIZES:
        raise DitdataError(f"{flag}-resize {resize!r}: use one of {', '.join(FEATURE_RESIZES)}")
    if dtype not in FEATURE_DTYPES:
        raise DitdataError(f"{flag}-dtype {dtype!r}: use one of {', '.join(FEATURE_DTYPES)}")
    if dims is not None and dims < 1:
        raise DitdataError(f"{flag}-dims {dims}: expected at least 1 (the PCA's dims)")
    if resolution is not None and not 0 < resolution <= MAX_RESOLUTION:
        raise DitdataError(f"{flag}-resolution {resolution}: expected 1 to {MAX_RESOLUTION} pixels (e.g. 224)")


def report(summary: dict) -> str | None:
    """The end-of-run line; None on the ranks that wrote no manifest."""
    m = summary.get("manifest")
    if m is None:
        return None
    enc, storage = m["encoder"], m["storage"]
    feat = m["fields"]["tensors"]["feat"]
    pca = storage.get("pca")
    pca_part = (f", PCA {enc['dim']} -> {storage['dims']} dims ({100 * pca['explained_variance']:.1f}% of the "
                "variance)" if pca else "")
    flips = ", with flips" if "feat_flip" in m["fields"]["tensors"] else ""
    rate = summary["images"] / summary["seconds"] if summary["seconds"] > 0 else 0.0
    return (f"feature set {m['name']} ({enc['name']}, {feat['shape'][0]} tokens x {feat['shape'][1]} "
            f"{feat['dtype']}{pca_part}{flips}): {m['num_samples']} rows, {summary['bytes_per_sample']} bytes per "
            f"sample, cosine to fp32 {storage['cosine_to_fp32']:.4f}; this run wrote {summary['written']} shards "
            f"({summary['already']} already done) at {rate:.1f} img/s")


def compute_features(cfg: FeaturesConfig) -> dict:
    """Add feature set cfg.out_name (default: from the encoder's name) to the local store
    cfg.store, resuming a killed run. Returns a summary (report() makes its line)."""
    from ditdata.common.lock import rank_zero_lock
    from ditdata.store import is_url
    from ditdata.store.features import check_name

    check_options(dtype=cfg.dtype, dims=cfg.dims, resolution=cfg.resolution, resize=cfg.resize)
    if cfg.batch_size < 1 or cfg.workers < 0:
        raise DitdataError("--batch-size must be at least 1, --workers at least 0")
    if is_url(cfg.store):
        raise DitdataError(f"{cfg.store}: feature sets are added to a local store; run `ditdata features` "
                           "where the store is written, then upload it")
    name = check_name(cfg.out_name or default_feature_set_name(cfg.encoder))
    store = _open(cfg.store)  # a store, before its lock is taken (the lock would create the folder)
    if store.buckets:
        raise DitdataError(f"{cfg.store}: a bucketed store (encode --buckets); feature sets of bucketed stores "
                           "are not supported yet (their targets would need each bucket's crop)")
    # one writer per store: the lock `ditdata encode` takes, so neither runs beside the other
    with rank_zero_lock(cfg.store, "ditdata features"):
        return _compute(cfg, name)


def _open(root):
    from ditdata.store import open_store

    return open_store(root)


def memory_hint(encoder: str, batch_size: int, flip: bool, device):
    """Out of GPU memory while computing features: one line naming the encoder, the batch,
    the precision, and a smaller --batch-size (ditdata.common.memory)."""
    from ditdata.common.devices import amp_dtype
    from ditdata.common.memory import halved, out_of_memory_hint

    batch = f"--batch-size {batch_size}" + (f" ({2 * batch_size} images a pass: the store has flips)" if flip else "")
    return out_of_memory_hint(what=f"computing {encoder} features", batch=batch, precision=amp_dtype(device),
                              device=device, hints=[halved("--batch-size", batch_size)], error=DitdataError)


def _compute(cfg: FeaturesConfig, name: str) -> dict:
    from ditdata.common.devices import resolve_device
    from ditdata.common.dist import join, launch_env, leave

    from .encoders import load_encoder
    from .passes import (
        calibration_need,
        complete,
        features_dir,
        resolve_storage,
        shard_jobs,
        store_order_images,
        storing_targets,
    )
    from .targets import Targets, storage_notes

    store, env = _open(cfg.store), launch_env()
    # the image shards the store was encoded from: --shards, else the folder its manifest records
    d = cfg.shards or (store.manifest.get("provenance") or {}).get("shards_dir")
    if not d:
        raise DitdataError(f"{cfg.store}: its manifest records no image-shard folder; pass --shards DIR, "
                           "the image shards the store was encoded from")
    if not Path(d).is_dir():
        where = "--shards" if cfg.shards else "the image-shard folder the manifest records,"
        raise DitdataError(f"{where} {d}: no such directory; pass --shards DIR, the image shards the store "
                           "was encoded from")
    shards_dir = Path(d)
    res = int(store.manifest["image"]["resolution"])
    device = resolve_device(cfg.device)
    own_group = join(device, timeout=GROUP_TIMEOUT)  # a group we join, we also leave
    with memory_hint(cfg.encoder, cfg.batch_size, store.schema.flip, device):
        enc = load_encoder(cfg.encoder, res, cfg.resolution, device, resize=cfg.resize)
        base = Targets(enc, flip=store.schema.flip, dtype=FEATURE_DTYPES[cfg.dtype], device=device)
        need = calibration_need(cfg.dims, enc.dim)

        def first_images():
            return store_order_images(shard_jobs(store, _first_shards(store, need), shards_dir),
                                      res, cfg.batch_size, need)

        storage = resolve_storage(base, features_dir(store.root, name), cfg.dims, first_images, env.world_size)
        done = complete(store, name, storing_targets(base, storage), storage,
                        shards_dir=shards_dir, batch_size=cfg.batch_size, workers=cfg.workers, progress=cfg.progress,
                        rank=env.rank, world=env.world_size, provenance={
                            "shards_dir": str(shards_dir.resolve()),
                            "features": {k: v for k, v in asdict(cfg).items() if k != "progress"}})
    leave(own_group)  # after complete's last barrier (see ditdata.encode)
    return {**done, "notes": storage_notes(storage)}


def _first_shards(store, need: int) -> list:
    """The first store shards that hold `need` samples (or all)."""
    out, n = [], 0
    for s in store.shards:
        if n >= need:
            break
        out.append(s)
        n += s.num_samples
    return out


__all__ = ["FeaturesConfig", "check_options", "compute_features", "default_feature_set_name", "memory_hint",
           "report"]
