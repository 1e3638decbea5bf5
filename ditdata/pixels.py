"""The pixel surface dittrain may use (dittrain.eval reads reference image folders and
`ditdata fetch` image shards through it): the decoder, the encoder's ADM centre crop and the
shard readers. It sits above ditdata.images, ditdata.imageshards.folder and ditdata.framing, so
none of them imports it, and dittrain needs no other ditdata module for pixels."""

from __future__ import annotations

from pathlib import Path

from ditdata.framing import center_crop
from ditdata.images import IMAGE_EXTENSIONS, BadImageError, decode_rgb
from ditdata.imageshards.folder import DATASET_INFO, FETCH_STATE, check_shard, iter_shard
from ditdata.imageshards.folder import read_folder as read_shard_folder

__all__ = ["IMAGE_EXTENSIONS", "BadImageError", "center_crop", "check_shard", "decode_rgb", "is_shard_folder",
           "iter_shard", "read_shard_folder"]


def is_shard_folder(path) -> bool:
    """Whether folder `path` holds image shards: a `ditdata fetch` output, finished or not, or
    tars written by another tool."""
    p = Path(path)
    return (p / DATASET_INFO).exists() or (p / FETCH_STATE).exists() or any(p.glob("*.tar"))
