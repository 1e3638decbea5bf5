"""Decoded, cropped image batches of whole image shards, for a torch DataLoader: how `ditdata
encode` reads its input, and how `ditdata features` reads the same images again (the same
decode, the same crop, so a feature set's rows are the images the latents were made from).

    ShardImages(jobs, resolution, batch_size, keep, buckets=None)
        jobs: [(store shard name, tar path, samples its stats file records or None)]
        each DataLoader worker takes whole shards; a batch is {"shard", "bucket", "images"
        (B, H, W, 3) uint8, "meta", "last"}, and a shard's last batch carries its skip counts
        ("stats") and, for a tar found damaged or short, "bad"
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from ditdata.errors import DitdataError
from ditdata.framing import Framing
from ditdata.imageshards import folder as imageshards


class ShardImages(torch.utils.data.IterableDataset):
    """Per-shard uint8 image batches; each DataLoader worker takes whole shards.
    jobs: (store shard name, tar path, samples its stats file records or None); keep: the
    keys to read (None: all), or {store shard name: its keys} (`ditdata features`);
    buckets: the bucket sizes of --buckets (each batch then holds one bucket's images)."""

    def __init__(self, jobs, resolution: int, batch_size: int, keep: set | dict | None, buckets=None):
        self.jobs, self.batch_size, self.keep = jobs, batch_size, keep
        self.framing = Framing(resolution, tuple(buckets) if buckets else None)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        mine = self.jobs if info is None else self.jobs[info.id::info.num_workers]
        for name, path, expected in mine:
            keep = self.keep.get(name, set()) if isinstance(self.keep, dict) else self.keep
            yield from _shard_batches(name, path, expected, self.framing, self.batch_size, keep)


def _shard_batches(name, path, expected, framing: Framing, batch_size, keep):
    """The decoded, cropped images of one shard in batches (of one bucket each with
    --buckets: a shard's buckets fill in parallel); the last batch carries the shard's skip
    counts and, when the tar turned out damaged or short (it was checked before, but files
    can change), `bad`: the main process then drops the shard."""
    skipped, skipped_keys, filtered, seen = Counter(), [], 0, 0
    groups: dict = {None: []}  # bucket (None: the square crop) -> its pending (image, meta)
    res = framing.resolution

    def pack(bucket, batch, last, bad=None):
        images = np.stack([b[0] for b in batch]) if batch else np.zeros((0, res, res, 3), np.uint8)
        out = {"shard": name, "bucket": bucket, "images": images, "meta": [b[1] for b in batch], "last": last}
        if last:
            out["stats"] = {"skipped": dict(skipped), "skipped_keys": skipped_keys[:1000], "filtered_out": filtered}
            out["bad"] = bad
        return out

    try:
        for s in imageshards.iter_shard(path):
            seen += 1
            if keep is not None and s.key not in keep:
                filtered += 1
                continue
            try:
                img = s.decode()
            except imageshards.BadImageError as e:
                skipped[e.reason] += 1
                skipped_keys.append(s.key)
                continue
            meta = s.meta
            if meta.get("original_width") is None or meta.get("original_height") is None:
                # tars from other tools may not record it: the image as stored is the source
                meta = {**meta, "original_width": img.size[0], "original_height": img.size[1]}
            bucket, arr, extra = framing(img)
            batch = groups.setdefault(bucket, [])
            batch.append((arr, {**meta, **extra}))
            if len(batch) == batch_size:
                yield pack(bucket, batch, last=False)
                groups[bucket] = []
    except DitdataError as e:
        yield pack(None, [], last=True, bad=f"{e} after {seen} samples")
        return
    if expected is not None and seen != expected:
        yield pack(None, [], last=True, bad=f"holds {seen} samples but its stats file records {expected}")
        return
    for bucket, batch in groups.items():
        if bucket is not None and batch:
            yield pack(bucket, batch, last=False)
    yield pack(None, groups[None], last=True)
