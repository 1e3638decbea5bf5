"""Recaptioning: `ditdata caption SHARDS --captioner NAME --out-name SET` writes a named
caption set of an image-shard folder with a vision-language model.

    captioners.py  the captioner registry: presets (Florence-2, SmolVLM, Qwen2.5-VL), a local
                   folder, a cached hub id, python:MODULE:FUNCTION; how each family is asked
    quality.py     what makes a caption suspect: empty, repeated (a loop), truncated
    caption.py     the command's pass: shard by shard, resumable, torchrun ranks, one writer

The set's files are ditdata.imageshards.captionsets' (NNNNN.captions.SET.parquet beside each
shard), which `ditdata score --captions SET`, `filter --captions SET` and the text encoders
read. Importing this package is cheap: torch and transformers load inside the calls.
"""

from .caption import caption, report

__all__ = ["caption", "report"]
