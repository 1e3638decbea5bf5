"""Inception features of images: arrays, tensors, iterables of batches, paths and Sources.

Images go through the network batch by batch; only their features are kept. With
progress=True a bar (ditdata.common.progress: plain lines when stderr is no terminal)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from dittrain.eval.errors import EvalError
from dittrain.eval.inception import FEATURES, Inception
from dittrain.eval.sources import Source, open_source, source_batches


def _rebatch(images, batch_size: int) -> Iterator:
    """An array / tensor (sliced) or an iterable of batches (each cut to batch_size)."""
    import torch

    if isinstance(images, (np.ndarray, torch.Tensor)):
        images = [images]
    for b in images:
        for i in range(0, len(b), batch_size):
            yield b[i:i + batch_size]


def image_features(images, inception: Inception, *, batch_size: int = 64, progress: bool = False,
                   desc: str = "features", total: int | None = None) -> dict[str, np.ndarray]:
    """Features of images: a uint8 (N, H, W, 3) array, a (N, 3, H, W) tensor, an iterable of
    such batches, or a path (.npz / folder of images). Only the features are kept."""
    if isinstance(images, (str, Path)):
        return source_features(open_source(images, allow_shards=False), inception, batch_size=batch_size,
                               progress=progress, desc=desc)
    if total is None and hasattr(images, "__len__") and hasattr(images, "shape"):
        total = len(images)
    return _run(_rebatch(images, batch_size), inception, progress=progress, desc=desc, total=total)


def source_features(src: Source, inception: Inception, *, batch_size: int = 64, progress: bool = False,
                    desc: str = "features", keep=FEATURES) -> dict[str, np.ndarray]:
    """Features of a Source's images (unusable ones skipped and counted on it)."""
    return _run(source_batches(src, batch_size), inception, progress=progress, desc=f"{desc} {src.path.name}",
                total=src.count, keep=keep)


def _run(batches: Iterable, inception: Inception, *, progress: bool, desc: str, total: int | None,
         keep=FEATURES) -> dict:
    from ditdata.common.progress import progress_bar

    parts: dict[str, list] = {k: [] for k in keep}
    with progress_bar(total=total, unit="img", desc=desc, enabled=progress) as bar:
        for b in batches:
            feats = inception.features(b)
            for k in keep:
                parts[k].append(feats[k])
            bar.update(len(b))
    if not parts["pool"]:
        raise EvalError(f"{desc}: no usable images")
    return {k: np.concatenate(v) for k, v in parts.items()}
