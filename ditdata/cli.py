"""`ditdata`: the command-line surface of the data side. No logic lives here: each
command parses and checks its options, hands them to one module and prints what that
module reports (its `report`, `describe` or list of faults):

    fetch -> ditdata.fetch    score -> ditdata.scoring.score    filter -> ditdata.scoring.filter
    caption -> ditdata.captions
    dedup -> ditdata.scoring.dedup
    encode -> ditdata.encode  features -> ditdata.features  inspect, verify -> ditdata.inspection

The defaults and choices of fetch, score, filter, dedup, encode and features are those of
ditdata/config.py (FetchConfig, ScoreConfig, FilterConfig, DedupConfig, EncodeConfig, FeaturesConfig),
which imports nothing heavy; torch, img2dataset, open_clip, diffusers and
zarr are imported inside the calls, so `ditdata --help` stays instant."""

from __future__ import annotations

import sys
from dataclasses import MISSING, fields
from functools import partial

import click

from ditdata.autoencoders.presets import PRESETS
from ditdata.common import configfile
from ditdata.common.cli import FiniteFloat, OneLineErrors, quiet_option
from ditdata.common.extras import install_hint
from ditdata.config import (
    CLIP_MODEL,
    DEDUP_EXACT_MAX,
    DEFAULT_URL_IMAGE_SIZE,
    DISTRIBUTORS,
    DTYPES,
    ENCODE_FORMATS,
    FEATURE_DTYPES,
    FEATURE_RESIZES,
    FEATURE_RESOLUTION_RULE,
    KINDS,
    PCA_FIT_IMAGES,
    PCA_TOKENS_PER_IMAGE,
    POSTERIORS,
    RESIZE_MODES,
    TEXT_DTYPES,
    CaptionConfig,
    DedupConfig,
    EncodeConfig,
    FeaturesConfig,
    FetchConfig,
    FilterConfig,
    ScoreConfig,
)
from ditdata.store.defaults import BACKENDS


def _opt(config, *names, field, **kw):
    """A click option for `field` of the dataclass `config`, with its default (the one place
    defaults live; None is not shown)."""
    default = next(f.default for f in fields(config) if f.name == field)
    assert default is not MISSING, field
    return click.option(*names, field, default=default, show_default=True, **kw)


_fetch_opt = partial(_opt, FetchConfig)
_encode_opt = partial(_opt, EncodeConfig)
_features_opt = partial(_opt, FeaturesConfig)
_dedup_opt = partial(_opt, DedupConfig)
_score_opt = partial(_opt, ScoreConfig)
_caption_opt = partial(_opt, CaptionConfig)
_quiet = quiet_option


def _skip_bad_shards_help(recorded: str) -> str:
    """--skip-bad-shards of score and encode: what a left-out shard leaves behind."""
    return ("Leave out image shards whose tar is damaged or holds fewer samples than its stats "
            f"file says ({recorded}) instead of stopping.")


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="ditkit")
def main():
    """Turn images into a cached latent store for DiT training.

    \b
    Pipeline (pixels are processed once, latents reused by every experiment):
      ditdata fetch   SOURCE --out SHARDS        URL list / ImageNet / folder -> image shards
      ditdata score   SHARDS --clip ViT-B-32     CLIP score per image-caption pair
      ditdata caption SHARDS --captioner NAME --out-name SET   recaption with a VLM (a named caption set)
      ditdata filter  SHARDS --min-clip-score X  -> a selection of keys
      ditdata dedup   SHARDS --threshold 0.95    near-duplicates out -> a selection
      ditdata encode  SHARDS --vae NAME --out STORE
      ditdata features STORE --encoder dinov2-vitb14   representation targets (REPA) beside the latents
      ditdata inspect STORE                      summary (and --decode N to eyeball latents)
      ditdata verify  STORE                      recompute checksums and shapes
    """


@main.command()
@configfile.option()
@click.argument("source", required=False, type=click.Path(exists=True, path_type=str))
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False, path_type=str),
              help="Shards folder to write (created; an interrupted fetch into it is resumed).")
@click.option("--retry-failed", is_flag=True,
              help="On the --out of a finished URL fetch: refetch only the rows whose latest status is a "
                   "transient failure (timeout, connection error, HTTP 5xx or 429) into new shards under "
                   "their keys, with the first fetch's settings (SOURCE and the others may be left out; only "
                   "--processes, --threads, --timeout, --retries and the distributor may change). Repeatable.")
@_fetch_opt("--kind", field="kind", type=click.Choice(KINDS),
            help="What SOURCE holds. Default: detected (a URL-list file or folder of them -> urls; "
                 "images with same-stem .txt files -> captions; one folder per class -> classes).")
@_fetch_opt("--image-size", field="image_size", type=click.IntRange(min=1),
            help=f"Resize to this size (see --resize-mode). Default: {DEFAULT_URL_IMAGE_SIZE} for URL lists, "
                 "originals kept for folders.")
@_fetch_opt("--resize-mode", field="resize_mode", type=click.Choice(RESIZE_MODES),
            help="img2dataset's names: center_crop = smaller side to size then centre square; "
                 "keep_ratio = smaller side to size; border = longer side to size, white padding; "
                 "no = keep the original size.")
@_fetch_opt("--min-image-size", field="min_image_size", type=click.IntRange(min=0),
            help="Skip images whose smaller side (before resizing) is below this.")
@_fetch_opt("--max-aspect-ratio", field="max_aspect_ratio", type=FiniteFloat(min=1, allow_inf=True),
            help="Skip images whose longer/shorter side ratio is above this (at least 1).")
@_fetch_opt("--samples-per-shard", field="samples_per_shard", type=click.IntRange(min=1))
@_fetch_opt("--processes", field="processes", type=click.IntRange(min=1),
            help="Worker processes. Default: all CPU cores.")
@_fetch_opt("--threads", field="threads", type=click.IntRange(min=1),
            help="Download threads per process (URL lists).")
@_fetch_opt("--url-col", field="url_col", help="URL column of the URL list. Default: url, URL, image_url, ...")
@_fetch_opt("--caption-col", field="caption_col",
            help="Caption column. Default: caption, TEXT, text, ... if present; '' for none.")
@_fetch_opt("--keep-col", field="keep_cols", multiple=True,
            help="Extra URL-list column to keep in each sample's json (repeatable), e.g. similarity.")
@_fetch_opt("--encode-format", field="encode_format", type=click.Choice(ENCODE_FORMATS),
            help="Format of re-encoded images (RGB JPEG originals of folders are stored unchanged "
                 "when not resized).")
@_fetch_opt("--encode-quality", field="encode_quality", type=click.IntRange(0, 100),
            help="JPEG/WebP quality of re-encoded images (0-100).")
@_fetch_opt("--distributor", field="distributor", type=click.Choice(DISTRIBUTORS),
            help="img2dataset's distributor (URL lists); pyspark and ray are optional "
                 f"extras: {install_hint('distributed')}.")
@_fetch_opt("--spark-master", field="spark_master", metavar="URL",
            help="--distributor pyspark: the cluster to run on, e.g. spark://HOST:7077 (--out must then be "
                 "a path every executor can write). Default: the active Spark session (spark-submit), "
                 "else a local[--processes] session on 127.0.0.1, stopped when the fetch ends. Needs Java.")
@_fetch_opt("--ray-address", field="ray_address", metavar="ADDRESS",
            help="--distributor ray: the cluster to join, e.g. ray://HOST:10001 or auto. Default: an "
                 "initialised Ray, else a local Ray with --processes CPUs, shut down when the fetch ends.")
@_fetch_opt("--timeout", field="timeout", type=click.IntRange(min=1), help="Download timeout in seconds (URL lists).")
@_fetch_opt("--retries", field="retries", type=click.IntRange(min=0), help="Download retries per URL (URL lists).")
@_fetch_opt("--shuffle-seed", field="shuffle_seed", type=int,
            help="Folders: shuffle the sorted file list with this seed before sharding (deterministic). "
                 "Default: sorted order (ImageNet shards then hold consecutive classes).")
@_fetch_opt("--overwrite", field="overwrite", is_flag=True,
            help="Delete a previous fetch in --out first instead of resuming it.")
@_quiet
def fetch(source, out, retry_failed, quiet, **options):
    """Fetch SOURCE into WebDataset image shards in SHARDS_DIR (--out): NNNNN.tar with
    {key}.jpg, {key}.json (key, source, size, caption or label) and {key}.txt captions,
    NNNNN_stats.json per shard, and dataset.json written last when everything is done.

    SOURCE is a URL list (.parquet/.csv/.tsv/.jsonl/.json/.txt, or a folder of them;
    downloaded with img2dataset), a class-per-folder tree such as ImageNet's train
    folder (sorted folder names -> labels 0..K-1), or a folder of images with
    same-stem .txt captions. Broken, truncated, non-image and oversized (decompression
    bomb) files are skipped and counted by reason; greyscale, CMYK, 16-bit, palette and
    RGBA images are converted to RGB (alpha on white) and EXIF rotation is applied.
    Rerun the same command to resume an interrupted fetch: finished shards are kept.

    A URL list is fetched over http and https only: rows with a file://, ftp://, data:
    or other scheme, a local path, an empty or malformed URL, and redirects off http(s)
    are not fetched but counted by reason ("refused URL: file scheme", "refused
    redirect: ftp scheme", ...); a list without any http(s) URL is refused.

    `ditdata fetch --retry-failed --out SHARDS` refetches, in a new pass, the rows of a
    finished URL fetch whose latest status is a transient failure (timeout, connection
    error, HTTP 5xx or 429; never a 4xx, a decode error or a refused URL) into new shards
    under the keys they had, and rewrites dataset.json; repeat it until nothing is left.

    \b
    Examples:
      # LAION-style parquet: 256 px centre crops, keep CLIP similarity and safety scores
      ditdata fetch laion_part0.parquet --out ./laion_shards --url-col URL --caption-col TEXT \\
          --image-size 256 --resize-mode center_crop --min-image-size 128 --max-aspect-ratio 2 \\
          --keep-col similarity --keep-col punsafe --keep-col pwatermark --processes 16 --threads 64
    \b
      # then refetch the rows that timed out or got a 5xx / 429, with a longer timeout
      ditdata fetch --retry-failed --out ./laion_shards --timeout 30
    \b
      # ImageNet ILSVRC2012 train (n01440764/..., 1000 classes), originals kept
      ditdata fetch /data/imagenet/train --out ./imagenet_shards --kind classes --processes 8
    \b
      # the same, shrunk at packing time (smaller side 288, then centre 288 x 288)
      ditdata fetch /data/imagenet/train --out ./in288 --image-size 288 --resize-mode center_crop
    \b
      # a folder of x.jpg + x.txt pairs, shuffled deterministically
      ditdata fetch ./my_photos --out ./photo_shards --kind captions --image-size 512 --shuffle-seed 0
    """
    from ditdata.fetch import fetch as run_fetch
    from ditdata.fetch import report

    if retry_failed:
        from ditdata.fetch.retries import retry_failed as run_retry

        given = configfile.given(click.get_current_context()) & set(options)
        line, _ = run_retry(out, source, **{k: options[k] for k in sorted(given)})
        click.echo(f"{out}: {line}")
        return
    if source is None:
        raise click.UsageError("Missing argument 'SOURCE'.")
    info = run_fetch(source, out, FetchConfig(**options, progress=not quiet))
    click.echo(f"{out}: {report(info)}")


@main.command()
@configfile.option()
@click.argument("shards", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.option("--clip", "clip_name", default=None,
              help="open_clip model name, e.g. ViT-B-32 (LAION-5B's filter), ViT-L-14 (DataComp). "
                   f"Default: {CLIP_MODEL}, or the --clip-config file's stem.")
@click.option("--pretrained", required=True,
              help="open_clip pretrained tag (e.g. laion2b_s34b_b79k, openai), resolved from the local "
                   "Hugging Face cache only, or a local weights file.")
@click.option("--clip-config", type=click.Path(exists=True, dir_okay=False, path_type=str), default=None,
              help="An open_clip model-config JSON (embed_dim, vision_cfg, text_cfg) for a custom "
                   "architecture; the model is then named after the file's stem.")
@_score_opt("--device", field="device", help="auto, cpu, cuda, cuda:1, ... (bf16 autocast on CUDA).")
@_score_opt("--batch-size", field="batch_size", type=click.IntRange(min=1))
@click.option("--threads", "workers", default=None, type=click.IntRange(min=0),
              help="Image decoding threads (0: decode in the main thread). Default: CPU cores, at most 8. "
                   "(Threads, as fetch's --threads; --workers counts processes everywhere.)")
@click.option("--overwrite", is_flag=True,
              help="Recompute every shard, replacing scores made by another model or weights.")
@click.option("--skip-bad-shards", is_flag=True,
              help=_skip_bad_shards_help("each gets NNNNN.clip.skipped.json; filter selects nothing from it"))
@click.option("--save-embeddings", is_flag=True,
              help="Also keep each image's L2-normalised CLIP embedding (float16 column image_embedding), "
                   "for `ditdata dedup`. Shards scored before without them are scored again.")
@click.option("--aesthetic", type=click.Path(dir_okay=False, path_type=str), default=None, metavar="FILE",
              help="Also score each image with the LAION aesthetic predictor in this local state-dict file "
                   "(the MLP or the linear head; made for ViT-L-14 embeddings): column aesthetic.")
@_score_opt("--captions", field="captions", metavar="SET",
            help="Score this caption set (`ditdata caption --out-name SET`) instead of the shards' own captions "
                 "(alt): NNNNN.clip.SET.parquet, row for row with NNNNN.clip.parquet.")
@_quiet
def score(shards, clip_name, pretrained, clip_config, device, batch_size, workers, overwrite,
          skip_bad_shards, save_embeddings, aesthetic, captions, quiet):
    """CLIP-score every image-caption pair of the image SHARDS folder (from `ditdata fetch`).

    Writes NNNNN.clip.parquet beside each NNNNN.tar: key, clip_score (cosine similarity
    of the L2-normalised open_clip embeddings; null without a caption or for an
    undecodable image), model, pretrained, status, image sizes and caption length. Each
    file is published atomically; rerun to resume (shards already scored with the same
    weights are skipped). A damaged shard (truncated tar, fewer samples than its stats
    file) stops the run before the model is loaded, unless --skip-bad-shards. Nothing is downloaded: a tag whose weights are not in the local
    Hugging Face cache fails at once, saying how to supply them.

    \b
    Examples:
      ditdata score ./laion_shards --clip ViT-B-32 --pretrained laion2b_s34b_b79k
      ditdata score ./laion_shards --clip ViT-L-14 --pretrained datacomp_xl_s13b_b90k --batch-size 256
      ditdata score ./shards --clip ViT-B-32 --pretrained ./open_clip_pytorch_model.bin --device cpu
      ditdata score ./laion_shards --clip ViT-L-14 --pretrained openai --save-embeddings \\
          --aesthetic ./sac+logos+ava1-l14-linearMSE.pth
      ditdata score ./laion_shards --clip ViT-B-32 --pretrained laion2b_s34b_b79k --captions florence
    """
    from ditdata.scoring.score import report
    from ditdata.scoring.score import score as run_score

    summary = run_score(ScoreConfig(shards=shards, pretrained=pretrained, clip=clip_name, clip_config=clip_config,
                                    device=device, batch_size=batch_size, workers=workers, overwrite=overwrite,
                                    skip_bad_shards=skip_bad_shards, save_embeddings=save_embeddings,
                                    aesthetic=aesthetic, captions=captions, progress=not quiet))
    click.echo(f"{shards}: {report(summary)}")


@main.command()
@configfile.option()
@click.argument("shards", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.option("--captioner", required=True,
              help="A preset (florence2-base, florence2-large, smolvlm-256m, smolvlm-500m, smolvlm2-2.2b, "
                   "qwen2.5-vl-3b, qwen2.5-vl-7b) from the local Hugging Face cache, a local save_pretrained "
                   "directory, a cached hub id, or python:MODULE:FUNCTION.")
@click.option("--out-name", required=True,
              help="The caption set's name (letters, digits, _ and -): NNNNN.captions.NAME.parquet beside each "
                   "shard. 'alt' is reserved for the shards' own captions.")
@_caption_opt("--prompt", field="prompt",
              help="The instruction. Default: <MORE_DETAILED_CAPTION> for Florence-2 (a task token: <CAPTION>, "
                   "<DETAILED_CAPTION>, ...), 'Describe this image in detail.' for chat models.")
@_caption_opt("--max-new-tokens", field="max_new_tokens", type=click.IntRange(min=1),
              help="Generation stops here; a caption cut there is flagged truncated.")
@_caption_opt("--num-beams", field="num_beams", type=click.IntRange(min=1),
              help="Beam search width (deterministic either way). Default: what the model's generation config "
                   "sets (greedy without num_beams there; Florence-2's card calls it with 3).")
@_caption_opt("--batch-size", field="batch_size", type=click.IntRange(min=1), help="Images per generate call.")
@_caption_opt("--device", field="device", help="auto, cpu, cuda, cuda:1, ... (bf16 weights on CUDA, fp32 on CPU).")
@_caption_opt("--limit", field="limit", type=click.IntRange(min=1),
              help="Caption at most this many more shards in this run (rerun to go on).")
@click.option("--overwrite", is_flag=True,
              help="Caption every shard again, replacing a set made with another captioner or settings.")
@click.option("--skip-bad-shards", is_flag=True,
              help=_skip_bad_shards_help("they get no caption file and are reported"))
@_quiet
def caption(shards, captioner, out_name, prompt, max_new_tokens, num_beams, batch_size, device, limit, overwrite,
            skip_bad_shards, quiet):
    """Recaption every image of the image SHARDS folder with a vision-language model.

    Writes the caption set OUT_NAME: NNNNN.captions.OUT_NAME.parquet beside each NNNNN.tar
    (key, caption, status, tokens; one row per sample in stored order). Greedy decoding, so
    a rerun gives the same text. Each file is published atomically; rerun to resume (shards
    done with the same captioner and settings are skipped; a set made with others is refused
    unless --overwrite). Captions that come back empty, looping (the same words over and
    over) or cut at --max-new-tokens are counted and flagged in the status column; images
    that cannot be decoded get a null caption and the reason. Under torchrun the ranks share
    the shards. Nothing is downloaded: a model not in the local Hugging Face cache fails at
    once with the `hf download` command that fetches it.
    Then `ditdata score --captions OUT_NAME` scores the set with CLIP.

    \b
    Examples:
      ditdata caption ./laion_shards --captioner florence2-large --out-name florence
      ditdata caption ./laion_shards --captioner qwen2.5-vl-7b --out-name qwen \\
          --prompt "Describe this image in one detailed paragraph." --max-new-tokens 300 --batch-size 16
      ditdata caption ./shards --captioner ./my_vlm --out-name mine --device cpu --limit 1
    """
    from ditdata.captions import caption as run_caption
    from ditdata.captions import report

    summary = run_caption(CaptionConfig(shards=shards, captioner=captioner, out_name=out_name, prompt=prompt,
                                        max_new_tokens=max_new_tokens, num_beams=num_beams, batch_size=batch_size,
                                        device=device, limit=limit, overwrite=overwrite,
                                        skip_bad_shards=skip_bad_shards, progress=not quiet))
    if summary["rank"] == 0:
        click.echo(f"{shards}: {report(summary)}")


@main.command(name="filter")
@configfile.option()
@click.argument("shards", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.option("--min-clip-score", type=FiniteFloat(), default=None,
              help="Keep clip_score >= X (LAION-5B: 0.28 with ViT-B/32).")
@click.option("--top-fraction", type=FiniteFloat(min=0, max=1, min_open=True), default=None,
              help="Keep the top F of all scored samples (DataComp: 0.3 with ViT-L/14); ties at the "
                   "cut-off are all kept.")
@click.option("--min-width", type=click.IntRange(min=1), default=None, help="Source image width >= W.")
@click.option("--min-height", type=click.IntRange(min=1), default=None, help="Source image height >= H.")
@click.option("--max-aspect-ratio", type=FiniteFloat(min=1), default=None,
              help="Longer side / shorter side <= R.")
@click.option("--min-caption-length", type=click.IntRange(min=0), default=None,
              help="Caption of at least N characters (after stripping whitespace).")
@click.option("--min-aesthetic", type=FiniteFloat(), default=None,
              help="Keep aesthetic >= A (from `ditdata score --aesthetic`; LAION-Aesthetics: 5, 6, 6.5).")
@click.option("--top-aesthetic-fraction", type=FiniteFloat(min=0, max=1, min_open=True), default=None,
              help="Keep the top F by aesthetic score (ties at the cut-off all kept).")
@click.option("--select", type=click.Path(exists=True, dir_okay=False, path_type=str), default=None,
              metavar="SELECTION",
              help="Only samples of this earlier selection (e.g. `ditdata dedup`'s); top fractions are "
                   "then of its samples.")
@click.option("--captions", default="alt", show_default=True, metavar="SET",
              help="Whose CLIP scores and caption lengths the rules read: the shards' own captions (alt) or a "
                   "caption set scored with `ditdata score --captions SET`.")
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False, path_type=str),
              help="Selection file to write: parquet, or JSON if the name ends in .json.")
def filter_(shards, min_clip_score, top_fraction, min_width, min_height, max_aspect_ratio, min_caption_length,
            min_aesthetic, top_aesthetic_fraction, select, captions, out):
    """Select samples of a scored SHARDS folder by CLIP score, aesthetic score, size and
    caption, and write their keys to --out.

    At most one CLIP-score rule (--min-clip-score X or --top-fraction F) and at most one
    aesthetic rule (--min-aesthetic A or --top-aesthetic-fraction F), each a global
    threshold over all shards; at least one rule of any kind. Every rule given must hold
    (AND). The two top fractions are each resolved on their own score over the same
    candidates (all samples, or those of --select), not one after the other: 0.5 and 0.5
    keep the samples in both top halves. Samples without a score (no caption,
    undecodable image) never pass a score rule. Sizes are those of the source image when
    fetch recorded them. Images are never rewritten: pass the selection to
    `ditdata encode --select`. To drop near-duplicates too, run `ditdata dedup --select`
    on this selection (or --select a dedup selection here).

    \b
    Examples:
      ditdata filter ./laion_shards --min-clip-score 0.28 --out keep.parquet
      ditdata filter ./laion_shards --top-fraction 0.3 --min-width 256 --min-height 256 \\
          --max-aspect-ratio 2 --min-caption-length 5 --out keep.parquet
      ditdata filter ./laion_shards --min-clip-score 0.28 --min-aesthetic 5 --out keep.parquet
      ditdata filter ./laion_shards --top-aesthetic-fraction 0.2 --select dedup.parquet --out keep.parquet
      ditdata filter ./laion_shards --min-clip-score 0.3 --captions florence --out keep.parquet
    """
    for a, b, flags in ((min_clip_score, top_fraction, "--min-clip-score X and --top-fraction F"),
                        (min_aesthetic, top_aesthetic_fraction, "--min-aesthetic A and --top-aesthetic-fraction F")):
        if a is not None and b is not None:
            raise click.UsageError(f"give at most one of {flags}")
    if all(v is None for v in (min_clip_score, top_fraction, min_aesthetic, top_aesthetic_fraction, select)):
        raise click.UsageError("give a rule: --min-clip-score X, --top-fraction F, --min-aesthetic A, "
                               "--top-aesthetic-fraction F or --select SELECTION")
    from ditdata.scoring.filter import filter_shards, report

    _, summary = filter_shards(FilterConfig(shards=shards, out=out, min_clip_score=min_clip_score,
                                            top_fraction=top_fraction, min_width=min_width, min_height=min_height,
                                            max_aspect_ratio=max_aspect_ratio, min_caption_length=min_caption_length,
                                            min_aesthetic=min_aesthetic, top_aesthetic_fraction=top_aesthetic_fraction,
                                            select=select, captions=captions))
    click.echo(f"{shards}: {report(summary)}")


@main.command()
@configfile.option()
@click.argument("shards", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False, path_type=str),
              help="Selection file to write: parquet, or JSON if the name ends in .json.")
@_dedup_opt("--threshold", field="threshold", type=FiniteFloat(min=0, max=1, min_open=True),
            help="Cosine similarity of the CLIP image embeddings at or above which two images are duplicates.")
@_dedup_opt("--exact/--approximate", field="exact",
            help=f"Compare every pair (exact) or join within k-means cells (approximate). Default: exact up "
                 f"to {DEDUP_EXACT_MAX} images, approximate above.")
@_dedup_opt("--select", field="select", type=click.Path(exists=True, dir_okay=False, path_type=str),
            metavar="SELECTION", help="Only the samples of this selection (e.g. `ditdata filter`'s).")
@_dedup_opt("--grid", field="grid", type=click.Path(dir_okay=False, path_type=str), metavar="PNG",
            help="The sample grid of the largest groups. Default: --out's name with .groups.png; '' for none.")
@_dedup_opt("--grid-groups", field="grid_groups", type=click.IntRange(min=0), help="Groups shown in the grid.")
@_dedup_opt("--threads", field="threads", type=click.IntRange(min=1), help="faiss threads. Default: all cores.")
@_quiet
def dedup(shards, quiet, **options):
    """Drop near-duplicate images of a scored SHARDS folder: write a selection that keeps one
    image per group (the highest CLIP score; ties: the smallest key).

    Needs the image embeddings of `ditdata score --save-embeddings` (faiss-cpu, the dedup
    extra, searches them). Two images whose embeddings reach --threshold are a pair; pairs
    chain into groups. Images without an embedding (no caption, undecodable) are left out.
    The selection composes with `ditdata filter` both ways (--select here, or there);
    pass it to `ditdata encode --select`. Look at the grid before trusting a threshold.

    \b
    Examples:
      ditdata score ./laion_shards --clip ViT-L-14 --pretrained openai --save-embeddings
      ditdata dedup ./laion_shards --threshold 0.95 --out dedup.parquet
      ditdata filter ./laion_shards --min-clip-score 0.28 --out keep.parquet
      ditdata dedup ./laion_shards --select keep.parquet --out keep-dedup.parquet
    """
    from ditdata.scoring.dedup import dedup as run_dedup
    from ditdata.scoring.dedup import report

    summary = run_dedup(DedupConfig(shards=shards, progress=not quiet, **options))
    click.echo(f"{shards}: {report(summary)}")


def _cache_opts(f):
    """--cache-dir and --cache-limit: where a STORE given as a URL is cached (ditdata.store.remote)."""
    f = click.option("--cache-limit", default=None,
                     help="URL stores: the cache's size limit, e.g. 20GiB (default 50GiB).")(f)
    return click.option("--cache-dir", default=None, type=click.Path(file_okay=False, path_type=str),
                        help="URL stores (s3://, gs://, http(s)://): the local cache of verified shards "
                             "(default $XDG_CACHE_HOME/ditkit/stores, else ~/.cache/ditkit/stores).")(f)


def _cache(cache_dir, cache_limit) -> dict:
    """The cache options given (none for a local store's usual call)."""
    return {k: v for k, v in (("cache_dir", cache_dir), ("cache_limit", cache_limit)) if v is not None}


@main.command()
@click.argument("store", type=click.Path(file_okay=False, path_type=str))
@click.option("--decode", "decode_n", type=click.IntRange(min=1), default=None,
              help="Also decode the first N stored latents with the store's own autoencoder.")
@click.option("--out", "-o", type=click.Path(file_okay=False, path_type=str), default=None,
              help="Directory for the --decode PNGs (named by sample key).")
@click.option("--vae", default=None,
              help="Where to find the store's autoencoder if not where it was recorded "
                   "(a directory, a preset name, or ldm:CHECKPOINT: the manifest has its LDM config).")
@click.option("--device", default="cpu", show_default=True)
@_cache_opts
def inspect(store, decode_n, out, vae, device, cache_dir, cache_limit):
    """Print a readable summary of a latent STORE: samples, shards, latent shape and dtype,
    autoencoder, conditioning, per-channel statistics, feature sets and size on disk; for a
    bucketed store (encode --buckets) the histogram of its buckets (size, latent shape,
    samples, share, a bar). Given an image-shard folder instead: its caption sets (shards
    covered; ok, empty, repeated, truncated and undecodable counts; the captioner) and
    which sets have CLIP scores.

    With --decode N --out DIR, decode the first N latents back to images so you can
    eyeball the cache.

    \b
    Examples:
      ditdata inspect ./store
      ditdata inspect ./store --decode 16 --out ./peek
      ditdata inspect ./laion_shards
    """
    from ditdata.inspection import describe

    if decode_n and not out:
        raise click.UsageError("--decode needs --out DIR")
    if decode_n:
        from ditdata.store import refuse_inside_store

        refuse_inside_store(out, "--out")
    click.echo(describe(store, **_cache(cache_dir, cache_limit)))
    if decode_n:
        from ditdata.inspection import decode_samples

        paths = decode_samples(store, decode_n, out, vae=vae, device=device, **_cache(cache_dir, cache_limit))
        click.echo(f"decoded {len(paths)} samples into {out}")


@main.command()
@click.argument("store", type=click.Path(file_okay=False, path_type=str))
@_cache_opts
@_quiet
def verify(store, cache_dir, cache_limit, quiet):
    """Recompute every checksum of a latent STORE and read every shard to check shapes,
    counts and that no value is NaN or inf (of every bucket, for a bucketed store), and the
    same for each of its feature sets, which must match the store row for row. Exits
    non-zero, naming each faulty file, if anything is wrong. Tokens exactly zero in every
    dimension (a latent position, a feature token) are counted per shard and shown as
    WARNING lines, which do not change the exit status. Given an image-shard folder instead:
    each caption-set file must be complete, made for its shard as it is, hold the shard's keys
    in stored order and statuses that agree with its captions and counts.

    \b
    Examples:
      ditdata verify ./store
      ditdata verify ./laion_shards
    """
    from ditdata.inspection import verify_all

    faults, n, sets, warnings, captions = verify_all(store, progress=not quiet, **_cache(cache_dir, cache_limit))
    for w in warnings:
        click.echo(f"WARNING {w}", err=True)
    for f in faults:
        click.echo(f"FAULT {f}", err=True)
    if faults:
        raise click.ClickException(f"{store}: {len(faults)} fault(s) found")
    click.echo(f"{store}: OK ({n} samples verified" + (f"; feature sets {', '.join(sets)}" if sets else "")
               + (f"; caption sets {', '.join(captions)}" if captions else "")
               + (f"; {len(warnings)} warning(s)" if warnings else "") + ")")


@main.command()
@configfile.option()
@click.argument("shards", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False, path_type=str),
              help="The latent store directory (created, resumed or appended to).")
@_encode_opt("--vae", field="vae",
             help=f"Autoencoder: {', '.join(PRESETS)}, a local directory (diffusers AutoencoderKL or TAEF2 "
                  "weights), a cached hub id, or ldm:CHECKPOINT (one LDM-format .ckpt/.pt/.safetensors file, "
                  "with --vae-config).")
@_encode_opt("--vae-config", field="vae_config", type=click.Path(exists=True, dir_okay=False, path_type=str),
             metavar="CONFIG.yaml",
             help="The LDM config of --vae ldm:CHECKPOINT (model.params.embed_dim and ddconfig, as VA-VAE and the "
                  "CompVis autoencoders ship it). Without a scale_factor in it the latents are stored unscaled and "
                  "`dittrain run` standardises them per channel (--latent-norm auto).")
@_encode_opt("--resolution", field="resolution", type=click.IntRange(min=1),
             help="Square crop size in pixels (ADM rule: resize short side, center crop).")
@_encode_opt("--buckets", field="buckets", metavar="AREA[:STEP]",
             help="Aspect-ratio buckets instead of the square crop (--resolution is then unused): sizes W x H of "
                  "about AREA^2 pixels, sides multiples of STEP (default: the autoencoder's downsample factor x 2), "
                  "ratios 1:2 to 2:1. Each image goes to the bucket nearest its aspect ratio, resized to cover it "
                  "and centre-cropped by at most STEP pixels; one store per bucket under STORE/buckets/WxH. "
                  "E.g. 256 or 512:32.")
@_encode_opt("--backend", field="backend", type=click.Choice(BACKENDS))
@_encode_opt("--flip/--no-flip", field="flip", help="Also store the latent of the horizontally flipped image.")
@_encode_opt("--posterior", field="posterior", type=click.Choice(POSTERIORS),
             help="Store one posterior sample, or mean and std so training draws fresh samples.")
@_encode_opt("--dtype", field="dtype", type=click.Choice(DTYPES),
             help="Storage dtype of latents and text embeddings. int8: latents as int8 codes with a float32 "
                  "scale per token (half of float16's bytes; dequantized on the training device), text "
                  "embeddings float16; with --posterior sample only.")
@_encode_opt("--device", field="device", help="auto, cpu, cuda, cuda:1, ...")
@_encode_opt("--batch-size", field="batch_size", type=click.IntRange(min=1))
@_encode_opt("--workers", field="workers", type=click.IntRange(min=0),
             help="Image decoding processes (each takes whole shards).")
@_encode_opt("--select", field="select", type=click.Path(exists=True, dir_okay=False, path_type=str),
             help="A selection written by `ditdata filter`: encode only those keys.")
@_encode_opt("--text-encoder", field="text_encoder",
             help="Caption embeddings: an open_clip model (ViT-B-32, with --text-pretrained; tokens padded to 77), "
                  "or a transformers encoder whose tokens are stored unpadded: t5-v1_1-xxl, flan-t5-xl (PixArt's "
                  "convention), gemma-2-2b (SANA's), a folder saved with save_pretrained, or a cached hub id.")
@_encode_opt("--text-pretrained", field="text_pretrained",
             help="Its pretrained tag (from the local cache) or a weights file.")
@_encode_opt("--text-config", field="text_config", type=click.Path(exists=True, dir_okay=False, path_type=str),
             help="An open_clip model-config JSON for a custom text encoder.")
@_encode_opt("--text-tokens/--no-text-tokens", field="text_tokens",
             help="Also store per-token text embeddings and mask (for cross-attention; open_clip encoders).")
@_encode_opt("--text-max-tokens", field="text_max_tokens", type=click.IntRange(min=1),
             help="Transformers encoders: tokens kept per caption (default the reference's: T5 120 as "
                  "PixArt-alpha, 300 for PixArt-Sigma; Gemma-2 300 as SANA).")
@_encode_opt("--text-dtype", field="text_dtype", type=click.Choice(TEXT_DTYPES),
             help="Transformers encoders: storage of the unpadded tokens; int8 keeps a float32 scale per token "
                  "(the latents' int8 rule), dequantized on the training device.")
@_encode_opt("--text-instruction", field="text_instruction", type=click.Choice(("reference", "none")),
             help="Gemma-2: SANA's complex human instruction before each caption (reference) or none.")
@_encode_opt("--captions", field="captions", metavar="SET",
             help="Embed the caption set SET (`ditdata caption --out-name SET`, beside the shards) instead of "
                  "the alt text; `caption` in the store is then the set's. Default: the alt text.")
@_encode_opt("--features", field="features", metavar="ENCODER",
             help="Also compute a feature set (representation targets for REPA) with this encoder, as "
                  "`ditdata features --encoder` takes it, in the same pass (see below).")
@_encode_opt("--features-out-name", field="features_out_name", metavar="SET",
             help="The feature set's name. Default: from the encoder's name (e.g. dinov2-vitb14).")
@_encode_opt("--features-dtype", field="features_dtype", type=click.Choice(list(FEATURE_DTYPES)),
             help="Storage of the feature set's targets (int8: per-token scale).")
@_encode_opt("--features-dims", field="features_dims", type=click.IntRange(min=1),
             help="Store the targets' PCA to this many dims. Default: the encoder's width (no PCA).")
@_encode_opt("--features-resolution", field="features_resolution", type=click.IntRange(min=1),
             help=f"The feature encoder's input px. Default: {FEATURE_RESOLUTION_RULE}.")
@_encode_opt("--features-resize", field="features_resize", type=click.Choice(FEATURE_RESIZES),
             help="How the crops reach the encoder's input px, as `ditdata features --features-resize`.")
@_encode_opt("--seed", field="seed", type=int, help="Seed of the posterior draws.")
@_encode_opt("--chunk-samples", field="chunk_samples", type=click.IntRange(min=1),
             help="Samples per storage chunk (large chunks read fast).")
@_encode_opt("--skip-bad-shards", field="skip_bad_shards", is_flag=True,
             help=_skip_bad_shards_help("each is recorded in the manifest"))
@_quiet
def encode(shards, out, quiet, **options):
    """Encode the image SHARDS folder (from `ditdata fetch`) into a latent store.

    One store shard per image shard, each published atomically: rerun the same command
    after a crash and only the missing shards are encoded. Under `torchrun` each rank
    encodes its share of shards and rank 0 writes the manifest. One encode per store at
    a time (a second one exits at once, naming the first's pid).

    Every image shard is checked first: a truncated tar, or one holding fewer samples than
    its stats file records, stops the run (or is left out with --skip-bad-shards). Images
    that cannot be decoded and latents that are not finite in the storage dtype (NaN, or
    fp16 overflow) are skipped and counted by reason. A folder of tars written by another
    tool (no dataset.json) is read as it is.

    With --buckets AREA[:STEP] the store is bucketed: every image keeps (nearly) its
    aspect ratio, in the bucket whose shape is nearest it; each input shard becomes at most
    one shard per bucket (named after it), and the top manifest, written last, lists the
    buckets with their counts (`ditdata inspect STORE` shows the histogram).

    With --features ENCODER the feature set of `ditdata features` is made in the same
    pass, from the same cropped images: each feature shard is written right after its
    latent shard with exactly its rows; shards encoded before (or by a killed run) get
    theirs once the store's manifest is written, then the feature set's manifest follows.

    \b
    Examples:
      ditdata encode ./imagenet-shards --vae sd-vae-ft-ema --resolution 256 --flip --out ./store
      ditdata encode ./imagenet-shards --vae sd-vae-ft-ema --flip --features dinov2-vitb14 --out ./store
      ditdata encode ./laion-shards --vae sdxl-vae --buckets 512 --flip --out ./store
      ditdata encode ./laion-shards --vae sdxl-vae --select keep.parquet \\
          --text-encoder ViT-B-32 --text-pretrained laion2b_s34b_b79k --out ./store
      ditdata encode ./imagenet-shards --vae rae-dinov2-b --flip --dtype int8 --out ./rae_store
      torchrun --standalone --nproc_per_node 8 -m ditdata.cli encode ./shards --vae taef2 --out ./store
    """
    from ditdata.encode import encode, report

    summary = encode(EncodeConfig(shards=shards, out=out, progress=not quiet, **options))
    line = report(summary)
    if line is not None:  # rank 0, which wrote the manifest
        for note in (summary.get("features") or {}).get("notes", []):
            click.echo(f"note: {note}", err=True)
        click.echo(f"{out}: {line}")


@main.command()
@configfile.option()
@click.argument("store", type=click.Path(file_okay=False, path_type=str))
@click.option("--encoder", required=True,
              help="dinov2-vits14, dinov2-vitb14, dinov2-vitl14, dinov2-vitg14 (and -reg: with registers), "
                   "from the local Hugging Face cache; a directory saved with transformers' save_pretrained; a "
                   "cached hub id; or python:MODULE:FUNCTION, FUNCTION() returning a torch module that maps "
                   "float images (N, 3, H, W) in [0, 1] to (N, tokens, dim) (optional attributes: resolution, its "
                   "input px; grid, (h, w) or n for n x n). Its outputs must be finite: a NaN or inf stops the "
                   "command naming the shard and sample, and nothing of the set is published.")
@_features_opt("--out-name", field="out_name", metavar="SET",
               help="The feature set's name. Default: from the encoder's name (e.g. dinov2-vitb14).")
@_features_opt("--shards", field="shards", type=click.Path(file_okay=False, path_type=str),
               help="The image shards the store was encoded from. Default: the folder its manifest records.")
@_features_opt("--features-dtype", field="dtype", type=click.Choice(list(FEATURE_DTYPES)),
               help="Storage of the targets: int8 with a per-token scale (a quarter of fp32), or fp16.")
@_features_opt("--features-dims", field="dims", type=click.IntRange(min=1),
               help=f"Store the targets' PCA to this many dims (fitted on the store's first {PCA_FIT_IMAGES} "
                    f"images, {PCA_TOKENS_PER_IMAGE} tokens each; `dittrain run --repa` rebuilds the encoder's "
                    "tokens from them). Default: the encoder's width (no PCA).")
@_features_opt("--features-resolution", field="resolution", type=click.IntRange(min=1),
               help=f"The encoder's input px (a multiple of its patch). Default: {FEATURE_RESOLUTION_RULE} "
                    "(REPA's: 256 px -> 224, 16x16 tokens of a patch-14 DINOv2).")
@_features_opt("--features-resize", field="resize", type=click.Choice(FEATURE_RESIZES),
               help="reference: REPA's (bicubic, no antialias, no clamp; DINOv2 positions resampled once); "
                    "antialias: the earlier rule, to finish or remake a set made with it.")
@_features_opt("--batch-size", field="batch_size", type=click.IntRange(min=1))
@_features_opt("--device", field="device", help="auto, cpu, cuda, cuda:1, ... (bf16 autocast on CUDA).")
@_features_opt("--workers", field="workers", type=click.IntRange(min=0),
               help="Image decoding processes (each takes whole shards).")
@_quiet
def features(store, quiet, **options):
    """Add a feature set to the local latent STORE: per-sample representation targets (the
    patch tokens of a frozen encoder such as DINOv2, for REPA), kept beside the latents, row
    for row, without touching them (the store's identity does not change).

    Each store shard's images are read again from its image shard (--shards), decoded and
    centre-cropped exactly as encode did, resized to the encoder's input resolution as
    REPA does (bicubic, --features-resize) and encoded; when the store has flips the flipped image is
    encoded too. The targets are stored as int8 (per-token scale) or fp16, optionally
    reduced by a PCA; the mean cosine of the stored targets to the fp32 encoder output is
    measured on the first samples and recorded. Each feature shard is published
    atomically: rerun the same command after a crash to resume. Under torchrun each rank
    computes its share of shards and rank 0 writes the feature set's manifest. Nothing is
    downloaded: a model missing from the local Hugging Face cache fails at once, naming
    the `hf download` command that fetches it.

    \b
    Examples:
      ditdata features ./store --shards ./imagenet-shards --encoder dinov2-vitb14
      ditdata features ./store --encoder dinov2-vitl14-reg --out-name dino-l --features-dims 256
      ditdata features ./store --encoder ./my-dinov2 --features-dtype fp16 --batch-size 128
      torchrun --standalone --nproc_per_node 8 -m ditdata.cli features ./store --encoder dinov2-vitb14
    """
    from ditdata.features import compute_features, report

    summary = compute_features(FeaturesConfig(store=store, progress=not quiet, **options))
    line = report(summary)
    if line is not None:  # rank 0, which wrote the manifest
        for note in summary["notes"]:
            click.echo(f"note: {note}", err=True)
        click.echo(f"{store}: {line}")


if __name__ == "__main__":
    sys.exit(main())
