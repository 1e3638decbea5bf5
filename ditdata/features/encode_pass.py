"""`ditdata encode --features NAME`: the feature set computed in encode's own pass, from the
cropped images encode's batch loop already holds (no second decode of the image shards).

    hook = InPass(cfg, device, folder, keep, skip, world)  # loads the encoder, calibrates
    hook.batch(shard, images, keys)       # every batch of the loop: targets by key
    hook.written(writer, record, keys, tar)   # right after the latent shard: its feature
                                              # shard, with exactly that shard's keys
    hook.finish(cfg, rank, world)         # after the store's manifest: the shards the pass
                                          # did not write (done before, or killed between),
                                          # then the feature set's manifest

The samples encode leaves out for non-finite latents are left out of the features too: the
feature shard takes the keys the latent shard was written with. The targets are those of
`ditdata features` run afterwards: the same calibration (the store's first samples), the
same crop, the same encoder batches when --batch-size is the same.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ditdata.config import FEATURE_DTYPES
from ditdata.errors import DitdataError
from ditdata.imageshards.batches import ShardImages
from ditdata.store import FeatureSchema, FeatureWriter, Store, open_store
from ditdata.store.features import check_name

from .encoders import default_feature_set_name, load_encoder
from .passes import ShardRows, complete, features_dir, recorded_config, resolve_storage, storing_targets
from .targets import Targets, storage_notes


class InPass:
    """The feature set of one `ditdata encode --features` run (module docstring).
    keep: the selection's keys (or None); skip: the names of
    image shards left out as damaged."""

    def __init__(self, cfg, device, folder, keep, skip: set, world: int):
        self.name = check_name(cfg.features_out_name or default_feature_set_name(cfg.features))
        enc = load_encoder(cfg.features, cfg.resolution, cfg.features_resolution, device, option="--features",
                           resize=cfg.features_resize)
        base = Targets(enc, flip=cfg.flip, dtype=FEATURE_DTYPES[cfg.features_dtype], device=device)

        def first_images():  # the store's first samples: the image shards' kept images, in order
            jobs = [(p.name[: -len(".tar")], p, None) for p in folder.shards if p.name[: -len(".tar")] not in skip]
            for batch in ShardImages(jobs, cfg.resolution, cfg.batch_size, keep):
                if batch["meta"]:
                    yield batch["images"], [m["key"] for m in batch["meta"]], batch["shard"]

        set_dir = features_dir(cfg.out, self.name)
        self.storage = resolve_storage(base, set_dir, cfg.features_dims, first_images, world)
        self.targets = storing_targets(base, self.storage)
        self.schema = FeatureSchema.build(enc.tokens, self.storage["dims"], self.storage["dtype"], cfg.flip)
        self.info = {"encoder": enc.info, "storage": self.storage}
        _refuse_other_settings(set_dir, self.name, self.schema, self.info)
        self.pending: dict[str, ShardRows] = {}
        self.written_shards, self.images, self.seconds = 0, 0, 0.0  # what the pass itself did

    def batch(self, shard: str, images, keys: list) -> None:
        t0 = time.perf_counter()
        self.pending.setdefault(shard, ShardRows()).add(keys, self.targets(images, keys, shard))
        self.images += len(keys)
        self.seconds += time.perf_counter() - t0

    def discard(self, shard: str) -> None:
        self.pending.pop(shard, None)

    def written(self, writer, record: dict, keys: list, tar) -> None:
        """Write the feature shard of the latent shard `record` just written, with its `keys`."""
        name = record["name"]
        rows = self.pending.pop(name, None) or ShardRows()
        # The store being written, holding just this shard: what its FeatureWriter needs (the
        # store's root and backend, the shard's checksum and keys). encode writes the store's
        # manifest last, so there is no store to open yet.
        view = Store.being_written(writer.root, writer.config, [record])
        fw = FeatureWriter(view, self.name, schema=self.schema, info=self.info)
        fw.write_shard(name, rows.result(keys, self.schema, name, tar), {"key": list(keys)}, source=str(tar))
        self.written_shards += 1

    def finish(self, cfg, rank: int, world: int) -> dict:
        """After the store's manifest (every rank): the missing feature shards, the manifest."""
        done = complete(open_store(cfg.out), self.name, self.targets, self.storage,
                        shards_dir=Path(cfg.shards), batch_size=cfg.batch_size, workers=cfg.workers,
                        progress=cfg.progress, rank=rank, world=world, provenance={
                            "shards_dir": str(Path(cfg.shards).resolve()), "made_by": "ditdata encode --features",
                            "features": {"encoder": cfg.features, "out_name": self.name, "dtype": cfg.features_dtype,
                                         "dims": cfg.features_dims, "resolution": cfg.features_resolution,
                                         "resize": cfg.features_resize, "batch_size": cfg.batch_size}})
        return {**done, "written": done["written"] + self.written_shards, "images": done["images"] + self.images,
                "seconds": done["seconds"] + self.seconds, "already": done["already"] - self.written_shards,
                "notes": storage_notes(self.storage)}


def _refuse_other_settings(set_dir: Path, name: str, schema: FeatureSchema, info: dict) -> None:
    """A feature set with finished shards made with other settings is refused before the pass
    (each shard's FeatureWriter sees only its own shard, so it cannot tell)."""
    old = recorded_config(set_dir)
    if old is None:
        return
    new = json.loads(json.dumps({"fields": schema.to_json(), **info}))
    differ = sorted(k for k in new if old.get(k) != new[k])
    if differ and any((set_dir / "shards").glob("*.json")):
        raise DitdataError(f"{set_dir}: feature set {name} was made with other settings ({', '.join(differ)} "
                           "differ); use the same --features options, another --features-out-name, or delete "
                           f"{set_dir}")
