"""The feature pass over a finished store: one feature shard per store shard, its rows the
store shard's rows in their order, then the feature set's manifest.

    store shard NNNNN (keys) --(its image shard NNNNN.tar: decode, the store's centre crop,
        only the store's keys)--> batches --(Targets: encoder, flip, PCA, int8)--> rows by
        key --(the store shard's order)--> feature shard NNNNN

The images are read by the reader encode reads them with (ditdata.imageshards.batches): the
same decode and the same crop at the store's resolution, so the features see exactly the pixels
the latents were made from. Batches never straddle shards, so a shard's bytes do not depend
on how the work was split: a rerun after a kill writes only the missing feature shards
(FeatureWriter.done), and torchrun ranks (each every WORLD_SIZE-th store shard, rank 0
writing the manifest after a barrier) give the same bytes as one process.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ditdata.common.progress import progress_bar
from ditdata.errors import DitdataError
from ditdata.imageshards.batches import ShardImages
from ditdata.store import FeatureSchema, FeatureWriter
from ditdata.store.features import FEATURES

from .targets import COSINE_SAMPLES, PCA_FIT_IMAGES, Targets, calibrate, decoded_pca


@dataclass(frozen=True)
class Job:
    """A feature shard to compute: the store shard's name, its image shard, its keys in order."""

    name: str
    tar: Path
    keys: list


def image_tar(store, shard, shards_dir: Path) -> Path:
    """The image shard a store shard was encoded from, in `shards_dir` (the record's
    `source` is the tar's path as encode was given it; only its name is trusted)."""
    source = shard.record.get("source")
    tar = shards_dir / (Path(source).name if source else f"{shard.name}.tar")
    if not tar.is_file():
        raise DitdataError(f"store shard {shard.name}: its image shard {tar.name} is not in {shards_dir}; pass "
                           "--shards DIR, the image shards the store was encoded from")
    return tar


def shard_jobs(store, shards, shards_dir: Path) -> list[Job]:
    return [Job(s.name, image_tar(store, s, shards_dir), store.read(s, ["key"])["key"].tolist()) for s in shards]


def _bad(job: Job, reason: str) -> DitdataError:
    return DitdataError(f"image shard {job.tar} {reason}: the features of store shard {job.name} cannot be "
                        "computed; restore the image shard the store was encoded from")


class ShardRows:
    """One feature shard being filled: stored arrays by key as batches arrive (in the image
    shard's order), put in the store shard's row order at the end."""

    def __init__(self):
        self.keys: list[str] = []
        self.parts: dict[str, list[np.ndarray]] = {}

    def add(self, keys, arrays: dict[str, np.ndarray]) -> None:
        self.keys.extend(keys)
        for f, v in arrays.items():
            self.parts.setdefault(f, []).append(v)

    def result(self, keys: list, schema: FeatureSchema, name: str, tar) -> dict[str, np.ndarray]:
        """The arrays in the order of `keys` (the store shard's rows); DitdataError when a
        key was not among the images (the image shard is not the one the store was made from)."""
        index = {k: i for i, k in enumerate(self.keys)}
        _check_rows(index, keys, name, tar)
        order = np.asarray([index[k] for k in keys], dtype=np.int64)
        out = {}
        for f, spec in schema.tensors.items():
            parts = self.parts.get(f)
            out[f] = np.concatenate(parts)[order] if parts else np.zeros((0, *spec.shape), np.dtype(spec.dtype))
        return out


def _check_rows(found, keys: list, name: str, tar) -> None:
    """DitdataError unless every key of the store shard is among the images `found`."""
    missing = [k for k in keys if k not in found]
    if missing:
        raise DitdataError(f"feature shard {name}: its rows do not match the store shard's: {len(missing)} of "
                           f"its {len(keys)} keys (e.g. {missing[0]!r}) are not images of {tar}; pass --shards, "
                           "the image shards the store was encoded from")


def run_pass(targets: Targets, writer: FeatureWriter, jobs: list[Job], *, resolution: int,
             batch_size: int, workers: int, progress: bool, desc: str) -> dict:
    """Compute and write the feature shard of every job. Returns {"written", "images", "seconds"}."""
    t0 = time.perf_counter()
    if not jobs:
        return {"written": 0, "images": 0, "seconds": 0.0}
    by_name = {j.name: j for j in jobs}
    pending: dict[str, ShardRows] = {}
    images = 0
    bar = progress_bar(total=sum(len(j.keys) for j in jobs), unit="img", desc=desc, enabled=progress)
    workers = min(workers, len(jobs))
    loader = torch.utils.data.DataLoader(
        ShardImages([(j.name, j.tar, None) for j in jobs], resolution, batch_size, {j.name: set(j.keys) for j in jobs}),
        batch_size=None, num_workers=workers, persistent_workers=False, prefetch_factor=4 if workers else None)
    for batch in loader:
        name = batch["shard"]
        rows = pending.setdefault(name, ShardRows())
        if batch["meta"]:
            keys = [m["key"] for m in batch["meta"]]
            rows.add(keys, targets(batch["images"], keys, name))
            images += len(keys)
            bar.update(len(keys))
        if batch["last"]:
            job = by_name[name]
            del pending[name]
            if batch["bad"]:
                raise _bad(job, batch["bad"])
            writer.write_shard(name, rows.result(job.keys, writer.schema, name, job.tar), {"key": job.keys},
                               source=str(job.tar))
    bar.close()
    return {"written": len(jobs), "images": images, "seconds": time.perf_counter() - t0}


# --------------------------------------------------------------------------- calibration


def calibration_need(dims: int | None, width: int) -> int:
    """How many of the store's first samples calibrate() reads."""
    return max(COSINE_SAMPLES, PCA_FIT_IMAGES if dims is not None and dims < width else 0)


def store_order_images(jobs: list[Job], resolution: int, batch_size: int, need: int):
    """(images, keys, shard name) batches of the store's first `need` samples, in the store's order."""
    for job in jobs:
        if need <= 0:
            return
        keys, need = job.keys[:need], need - len(job.keys)
        got = {}
        for batch in ShardImages([(job.name, job.tar, None)], resolution, batch_size, {job.name: set(keys)}):
            got.update((m["key"], img) for m, img in zip(batch["meta"], batch["images"], strict=True))
            if batch["last"] and batch["bad"]:
                raise _bad(job, batch["bad"])
        _check_rows(got, keys, job.name, job.tar)
        for i in range(0, len(keys), batch_size):
            part = keys[i:i + batch_size]
            yield np.stack([got[k] for k in part]), part, job.name


def recorded_config(set_dir: Path) -> dict | None:
    """The config.json a feature set being written records (what every shard is made with), or None."""
    try:
        cfg = json.loads((set_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def recorded_storage(set_dir: Path, encoder_info: dict, dtype: str, dims: int) -> dict | None:
    """The storage a feature set being written already records (config.json) when it was
    made with this encoder, dtype and dims: a resumed run keeps its PCA and measurements,
    so its shards are those of an uninterrupted run."""
    cfg = recorded_config(set_dir) or {}
    storage = cfg.get("storage")
    if (not isinstance(storage, dict) or cfg.get("encoder") != json.loads(json.dumps(encoder_info))
            or storage.get("dtype") != dtype or storage.get("dims") != dims):
        return None
    return storage


def check_resize(set_dir: Path, encoder_info: dict) -> None:
    """A feature set begun with the other --features-resize is refused before anything is
    computed, naming the choice that finishes it: its shards and new ones would hold targets
    of two preprocessings (a set made before the choice existed records "antialias"'s string)."""
    from .encoders import RESIZES

    old = ((recorded_config(set_dir) or {}).get("encoder") or {}).get("resize")
    new = encoder_info.get("resize")
    if old is None or old == new or not any((set_dir / "shards").glob("*.json")):
        return
    was = next((k for k, v in RESIZES.items() if v == old), None)
    now = next((k for k, v in RESIZES.items() if v == new), new)
    finish = f"finish it with --features-resize {was}" if was else f"it records resize {old!r}"
    raise DitdataError(f"{set_dir}: feature set {set_dir.name} was begun with "
                       f"{'--features-resize ' + was if was else 'another resize'} ({old}), not {now}; {finish}, "
                       f"or make a new set with another --out-name (or delete {set_dir})")


def resolve_storage(targets: Targets, set_dir: Path, dims: int | None, images, world: int) -> dict:
    """The feature set's storage: recorded (recorded_storage) or calibrated on rank 0, and
    the same on every rank (broadcast: an error on rank 0 is raised on every rank). A set begun
    with the other --features-resize is refused first (check_resize)."""
    rank = dist.get_rank() if world > 1 else 0
    result = None
    if rank == 0:
        try:
            enc = targets.encoder
            check_resize(set_dir, enc.info)
            result = ("ok", recorded_storage(set_dir, enc.info, targets.dtype, dims or enc.dim)
                      or calibrate(targets, images(), dims))
        except DitdataError as e:
            result = ("error", str(e))
            if world == 1:
                raise
    if world > 1:
        box = [result]
        dist.broadcast_object_list(box, src=0)
        result = box[0]
    if result[0] == "error":
        raise DitdataError(result[1])
    return result[1]


def storing_targets(targets: Targets, storage: dict) -> Targets:
    """The Targets that store as `storage` says (with its PCA)."""
    return Targets(targets.encoder, flip=targets.flip, dtype=targets.dtype, device=targets.device,
                   pca=decoded_pca(storage))


# --------------------------------------------------------------------------- finishing


def complete(store, name: str, targets: Targets, storage: dict, *, shards_dir: Path, batch_size: int,
             workers: int, progress: bool, rank: int, world: int, provenance: dict) -> dict:
    """This rank's missing feature shards of `store` (every WORLD_SIZE-th store shard), then,
    once every rank is done, the feature set's manifest (rank 0). Returns what was done."""
    schema = FeatureSchema.build(targets.encoder.tokens, storage["dims"], storage["dtype"], targets.flip)
    writer = FeatureWriter(store, name, schema=schema, info={"encoder": targets.encoder.info, "storage": storage})
    mine = [s for i, s in enumerate(store.shards) if i % world == rank]
    todo = [s for s in mine if not writer.done(s.name)]
    run = run_pass(targets, writer, shard_jobs(store, todo, shards_dir),
                   resolution=int(store.manifest["image"]["resolution"]), batch_size=batch_size, workers=workers,
                   progress=progress, desc=f"features[{rank}]" if world > 1 else "features")
    if world > 1:
        dist.barrier()
    manifest = writer.finalize(provenance=provenance) if rank == 0 else None
    if world > 1:
        dist.barrier()
    return {**run, "already": len(mine) - len(todo), "manifest": manifest,
            "bytes_per_sample": sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
                                    for s in schema.tensors.values())}


def features_dir(store_root, name: str) -> Path:
    return Path(store_root) / FEATURES / name
