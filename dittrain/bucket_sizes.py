"""A bucketed run's sizes: what `dittrain sample --size` and serve's size menu offer.

A run trained on a bucketed store (ditdata encode --buckets) records its buckets in its config
(store.buckets: name "WxH" in pixels, size [W, H], latent_shape [C, h, w], num_samples) and
samples at any of them; the default is the bucket whose latents are the model's square input,
else the most populated one (the top manifest's choice). A run on a plain store samples at its
one size, as ever: it has no sizes, and --size is refused.
"""

from __future__ import annotations

from dittrain.opened import SampleError
from dittrain.specs import DiTConfig


def run_sizes(config: dict) -> list[dict]:
    """A bucketed run's buckets as its config records them ({"name": "WxH", "size": [W, H],
    "latent_shape": [C, h, w], "num_samples"}), sorted by name; [] for a run on a plain store."""
    return sorted((config.get("store") or {}).get("buckets") or [], key=lambda b: b["name"])


def default_size(config: dict, cfg: DiTConfig) -> str | None:
    """The bucket sampled without --size: the one of the model's square input, else the most
    populated (the top manifest's choice); None for a plain run."""
    buckets = run_sizes(config)
    if not buckets:
        return None
    square = [b for b in buckets if b["latent_shape"][1:] == [cfg.input_size, cfg.input_size]]
    return (square or sorted(buckets, key=lambda b: -b["num_samples"]))[0]["name"]


def choose_size(config: dict, cfg: DiTConfig, size: str | None) -> tuple[str | None, tuple[int, int]]:
    """(bucket name, latent (H, W)) to sample at: `size` ("WxH" px, e.g. "352x176"), or the
    default; (None, the model's square input) for a plain run without --size. SampleError (one
    line, listing the sizes) for a size that is not one of the run's buckets."""
    buckets = run_sizes(config)
    given = None if size is None else str(size).strip().lower().replace(" ", "")
    if given is not None and not buckets:
        raise SampleError(f"--size {size}: this run was trained on a store without aspect-ratio buckets, so it samples "
                          "at its own size only; leave out --size")
    name = given or default_size(config, cfg)
    if name is None:
        return None, (cfg.input_size, cfg.input_size)
    chosen = next((b for b in buckets if b["name"] == name), None)
    if chosen is None:
        raise SampleError(f"--size {size}: not a bucket of this run's store; choose one of "
                          f"{', '.join(b['name'] for b in buckets)} (WxH pixels)")
    _, h, w = chosen["latent_shape"]
    return chosen["name"], (h, w)


__all__ = ["choose_size", "default_size", "run_sizes"]
