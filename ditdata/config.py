"""The settings of `ditdata fetch`, `score`, `caption`, `filter`, `dedup`, `encode` and `features`: every
option with its default and its choices, in one place. The command line builds its options
from these dataclasses (ditdata/cli.py), and the Python API takes them
(`fetch(source, out, FetchConfig(...))`, `score(ScoreConfig(...))`, `filter_shards(FilterConfig(...))`,
`dedup(DedupConfig(...))`, `encode(EncodeConfig(...))`, `compute_features(FeaturesConfig(...))`).

Importing this module is cheap (the standard library only): `ditdata --help` shows these
defaults without loading numpy or torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ditdata.store.defaults import CHUNK_SAMPLES, DEFAULT_BACKEND

# ------------------------------------------------------------------------------- fetch

KINDS = ("urls", "classes", "captions")  # what a fetch reads: a URL list, class folders, captions
# ditdata.images.RESIZE_MODES, repeated here because that module loads numpy and PIL;
# tests/test_config.py checks that the two agree.
RESIZE_MODES = ("no", "keep_ratio", "center_crop", "border", "keep_ratio_largest")
ENCODE_FORMATS = ("jpg", "png", "webp")
DISTRIBUTORS = ("multiprocessing", "pyspark", "ray")
DEFAULT_URL_IMAGE_SIZE = 256  # image_size of a URL list when none is given


@dataclass(frozen=True)
class FetchConfig:
    """How `ditdata fetch` turns a source into image shards (the source and the output
    folder are the call's arguments)."""

    kind: str | None = None  # one of KINDS; None: detected from the source
    image_size: int | None = None  # None: DEFAULT_URL_IMAGE_SIZE for URL lists, originals for folders
    resize_mode: str = "center_crop"  # one of RESIZE_MODES (img2dataset's names)
    min_image_size: int = 0  # smaller side before resizing
    max_aspect_ratio: float = math.inf  # longer / shorter side
    encode_format: str = "jpg"  # of re-encoded images
    encode_quality: int = 95  # JPEG / WebP quality
    max_pixels: int | None = None  # decompression-bomb limit; None: ditdata.images.DEFAULT_MAX_PIXELS
    samples_per_shard: int = 10000
    processes: int | None = None  # None: every CPU core
    threads: int = 64  # download threads per process (URL lists)
    url_col: str | None = None  # None: the first of fetch.URL_COLUMNS present
    caption_col: str | None = None  # None: the first of fetch.CAPTION_COLUMNS present; "": none
    keep_cols: tuple[str, ...] = ()  # URL-list columns kept in each sample's json
    distributor: str = "multiprocessing"  # one of DISTRIBUTORS (URL lists)
    spark_master: str | None = None  # pyspark: None: an active session, else local[processes]
    ray_address: str | None = None  # ray: None: a running ray.init(), else a local instance
    timeout: int = 10  # download timeout in seconds
    retries: int = 0  # download retries per URL
    shuffle_seed: int | None = None  # folders: shuffle the sorted file list with this seed
    overwrite: bool = False  # delete a previous fetch in the output folder first
    progress: bool = True


# ------------------------------------------------------------------------------- score

CLIP_MODEL = "ViT-B-32"  # the open_clip model of `ditdata score` when none is named
SCORE_BATCH_SIZE = 128


@dataclass
class ScoreConfig:
    """`ditdata score`: the CLIP score of every image-caption pair of an image-shard folder
    (ditdata.scoring.score), and on request each image's embedding and aesthetic score."""

    shards: str  # the image-shard folder (`ditdata fetch --out`)
    pretrained: str | None  # open_clip pretrained tag (the local Hugging Face cache only) or a weights file
    clip: str | None = None  # the open_clip model; None: CLIP_MODEL, or clip_config's stem
    clip_config: str | None = None  # an open_clip model-config JSON for a custom architecture
    device: str = "auto"  # auto: cuda when available
    batch_size: int = SCORE_BATCH_SIZE
    workers: int | None = None  # image decoding threads (0: the main thread); None: CPU cores, at most 8
    overwrite: bool = False  # score every shard again, replacing scores of other weights
    skip_bad_shards: bool = False  # leave out (and record) image shards that are damaged
    save_embeddings: bool = False  # keep each image's CLIP embedding too (for `ditdata dedup`)
    aesthetic: str | None = None  # the LAION aesthetic predictor's state-dict file; None: no aesthetic scores
    captions: str = "alt"  # the caption set scored: "alt", the shards' own, or a `ditdata caption` set
    progress: bool = True


# ------------------------------------------------------------------------------- caption

CAPTION_BATCH_SIZE = 8
CAPTION_MAX_NEW_TOKENS = 256


@dataclass
class CaptionConfig:
    """`ditdata caption`: a named caption set of an image-shard folder written by a
    vision-language model (ditdata.captions). Resume rule of each field: "fixed" ones are
    recorded in every shard's caption file, and a rerun with another value refuses to mix
    the two (--overwrite replaces them); "safe" ones may change between runs."""

    shards: str  # the image-shard folder (`ditdata fetch --out`)
    captioner: str  # fixed: a preset, directory, cached hub id or python:MODULE:FUNCTION (ditdata.captions.captioners)
    out_name: str  # the caption set's name (letters, digits, _ and -; "alt" is the shards' own captions)
    prompt: str | None = None  # fixed: the instruction; None: the captioner family's default
    max_new_tokens: int = CAPTION_MAX_NEW_TOKENS  # fixed: generation stops here (the caption is flagged truncated)
    num_beams: int | None = None  # fixed: None: what the model's generation config sets (greedy when none)
    batch_size: int = CAPTION_BATCH_SIZE  # safe: images per generate call (within one shard)
    device: str = "auto"  # safe: auto: cuda when available (bf16 weights there, fp32 on the CPU)
    limit: int | None = None  # safe: caption at most this many more shards in this run (None: all)
    overwrite: bool = False  # caption every shard again, replacing a set made with other settings
    skip_bad_shards: bool = False  # safe: leave out damaged image shards instead of stopping
    progress: bool = True


# ------------------------------------------------------------------------------- filter


@dataclass
class FilterConfig:
    """`ditdata filter`: the rule that selects samples of a scored image-shard folder
    (ditdata.scoring.filter's docstring: every rule given must hold; None: not applied)."""

    shards: str  # the scored image-shard folder
    out: str  # the selection file to write (parquet, or JSON if it ends in .json)
    min_clip_score: float | None = None  # clip_score >= X
    top_fraction: float | None = None  # the top F of the scored samples (ties at the cut-off kept)
    min_width: int | None = None  # of the source image
    min_height: int | None = None
    max_aspect_ratio: float | None = None  # longer / shorter side <= R
    min_caption_length: int | None = None  # characters, after stripping whitespace
    min_aesthetic: float | None = None  # aesthetic >= A (`ditdata score --aesthetic`)
    top_aesthetic_fraction: float | None = None  # the top F by aesthetic score
    select: str | None = None  # only the samples of an earlier selection (e.g. `ditdata dedup`'s)
    captions: str = "alt"  # whose CLIP scores the rules read: the shards' own captions or a caption set's

# ------------------------------------------------------------------------------- dedup

# Up to this many embeddings `ditdata dedup` compares every pair (exact); above it, an IVF
# self-join (ditdata.scoring.dedup). The exact search's cost grows with the square of the count: on 2
# shared CPU cores 20 k took 5-20 s and 100 k 5-6 minutes, while the IVF join did 200 k
# in 35 s (bench/dedup.py, bench/RESULTS.md).
DEDUP_EXACT_MAX = 20_000


@dataclass
class DedupConfig:
    """`ditdata dedup`: near-duplicate groups over the image embeddings `ditdata score
    --save-embeddings` kept, one image kept per group, written as a selection."""

    shards: str = ""  # the scored image-shard folder
    out: str = ""  # the selection file to write (parquet, or JSON if it ends in .json)
    threshold: float = 0.95  # cosine similarity at or above which two images are duplicates
    exact: bool | None = None  # None: exact up to DEDUP_EXACT_MAX embeddings, an IVF index above
    select: str | None = None  # only the samples of an earlier selection (e.g. `ditdata filter`'s)
    grid: str | None = None  # the sample grid PNG; default: OUT's name with .groups.png; "" for none
    grid_groups: int = 8  # largest groups shown in the grid, one row each
    threads: int | None = None  # faiss threads; default: all CPU cores
    progress: bool = True


# ------------------------------------------------------------------------------ encode

POSTERIORS = ("sample", "mean_std")
# --dtype: the latents' storage. int8 keeps a float32 scale per token beside them (the C channels at
# one position; ditdata.store.quantize): half of float16's bytes, for wide latents such as an RAE's
# 768 x 16 x 16 (bench/RESULTS.md has what it does to the decoder's output); one latent per image
# only (--posterior sample), text embeddings then stay float16
DTYPES = ("float16", "bfloat16", "int8")
# --text-dtype: the unpadded token embeddings of a transformers text encoder (int8: codes with a float32
# scale per token, the latents' rule, ditdata.store.quantize)
TEXT_DTYPES = ("float16", "bfloat16", "int8")
# Far above any DiT recipe (256-1024 px); a mistyped --resolution 100000 would otherwise
# allocate 30 GB per decoded image before anything could say no.
MAX_RESOLUTION = 4096


@dataclass
class EncodeConfig:
    """How `ditdata encode` turns an image-shard folder into a latent store."""

    shards: str
    out: str
    vae: str = "sd-vae-ft-ema"  # a preset, ldm:CHECKPOINT, a directory or a cached hub id (ditdata.autoencoders.kinds)
    vae_config: str | None = None  # the LDM config (yaml) of --vae ldm:CHECKPOINT (ditdata.autoencoders.ldm)
    resolution: int = 256
    buckets: str | None = None  # "AREA[:STEP]": aspect-ratio buckets instead of the square crop (ditdata.framing)
    backend: str = DEFAULT_BACKEND  # one of ditdata.store.defaults.BACKENDS
    flip: bool = False
    posterior: str = "sample"  # one of POSTERIORS: one frozen draw, or mean and std (fresh draws in training)
    dtype: str = "float16"  # one of DTYPES: storage dtype of latents and text embeddings (float16 with int8)
    device: str = "auto"  # auto: cuda when available
    batch_size: int = 32
    workers: int = 2
    select: str | None = None
    text_encoder: str | None = None  # an open_clip model name, or a transformers encoder (ditdata.textencoders)
    text_pretrained: str | None = None  # its pretrained tag or weights file (open_clip)
    text_config: str | None = None  # an open_clip model-config JSON for custom models
    text_tokens: bool = False  # also store per-token embeddings and mask (open_clip; transformers ones always do)
    # transformers encoders (T5, Gemma-2): tokens stored unpadded (each caption its own length)
    text_max_tokens: int | None = None  # None: the reference's (T5 120 as PixArt-alpha, Gemma-2 300 as SANA)
    text_dtype: str = "float16"  # one of TEXT_DTYPES: their storage (int8: a float32 scale per token)
    text_instruction: str = "reference"  # one of ditdata.textencoders.INSTRUCTIONS (SANA's for Gemma-2, or none)
    captions: str | None = None  # a caption set (ditdata.imageshards.captionsets) embedded instead of the alt text
    seed: int = 0
    chunk_samples: int = CHUNK_SAMPLES
    skip_bad_shards: bool = False  # leave out (and record) image shards that are damaged
    # A feature set computed in the same run (FeaturesConfig's fields of the same names)
    features: str | None = None  # a feature encoder (FeaturesConfig.encoder); None: no features
    features_out_name: str | None = None  # None: default_feature_set_name(features)
    features_dtype: str = "int8"  # one of FEATURE_DTYPES
    features_dims: int | None = None  # PCA to this many dims; None: the encoder's width
    features_resolution: int | None = None  # encoder input px; None: FEATURE_RESOLUTION_RULE
    features_resize: str = "reference"  # one of FEATURE_RESIZES
    progress: bool = True
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------- features

# --features-dtype: the stored dtype's short name -> the store's dtype name
FEATURE_DTYPES = {"int8": "int8", "fp16": "float16"}
FEATURE_RESOLUTION_RULE = "(store resolution // 16) * patch"  # REPA's: 256 px -> 224 for patch 14
# --features-resize: how images (and a DINOv2's position grid) reach the encoder's input size
# (ditdata.features.encoders): "reference", REPA's (bicubic, no antialias, no clamp; position
# embeddings resampled once, antialiased), the default; "antialias", ditkit's rule before it, kept
# only to finish or remake feature sets made with it (antialiased, clamped)
FEATURE_RESIZES = ("reference", "antialias")
FEATURES_BATCH_SIZE = 64
FEATURE_COSINE_SAMPLES = 64  # the first samples the stored targets are compared with fp32 on
PCA_FIT_IMAGES = 1024  # --features-dims: the PCA is fitted on the store's first this many images,
PCA_TOKENS_PER_IMAGE = 64  # ... on a seeded sample of this many tokens of each


@dataclass
class FeaturesConfig:
    """How `ditdata features` adds a feature set (representation targets, e.g. DINOv2 patch
    tokens for REPA) to a local latent store."""

    store: str
    encoder: str  # a preset (ditdata.features.encoders.PRESETS), directory, hub id or python:MODULE:FUNCTION
    out_name: str | None = None  # the feature set's name; None: default_feature_set_name(encoder)
    shards: str | None = None  # the image shards the store was encoded from; None: as its manifest records
    dtype: str = "int8"  # one of FEATURE_DTYPES
    dims: int | None = None  # PCA to this many dims; None: the encoder's width (no PCA)
    resolution: int | None = None  # encoder input px; None: FEATURE_RESOLUTION_RULE
    resize: str = "reference"  # one of FEATURE_RESIZES: REPA's resize (the default), or "antialias"
    batch_size: int = FEATURES_BATCH_SIZE
    device: str = "auto"
    workers: int = 2
    progress: bool = True
