"""`ditdata`: the command-line surface of the data side. No logic lives here: each
command parses its options and calls the module named after it. Heavy libraries
(torch, img2dataset, open_clip, diffusers, zarr) are imported inside those calls so
`ditdata --help` stays instant."""

from __future__ import annotations

import sys

import click


class Group(click.Group):
    """Expected failures (bad input, a broken store, a missing model) become one line on
    stderr and exit status 1; anything else is a bug and keeps its traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except Exception as e:
            if isinstance(e, user_errors()):
                raise click.ClickException(str(e)) from e
            raise


def user_errors() -> tuple[type[Exception], ...]:
    from ditdata.errors import DitdataError
    from ditdata.store.errors import StoreError

    return (DitdataError, StoreError)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="ditkit")
def main():
    """Turn images into a cached latent store for DiT training.

    \b
    Pipeline (pixels are processed once, latents reused by every experiment):
      ditdata fetch   SOURCE --out SHARDS        URL list / ImageNet / folder -> image shards
      ditdata score   SHARDS --clip ViT-B-32     CLIP score per image-caption pair
      ditdata filter  SHARDS --min-clip-score X  -> a selection of keys
      ditdata encode  SHARDS --vae NAME --out STORE
      ditdata inspect STORE                      summary (and --decode N to eyeball latents)
      ditdata verify  STORE                      recompute checksums and shapes
    """


@main.command()
@click.argument("source", type=click.Path(exists=True, path_type=str))
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False, path_type=str),
              help="Shards folder to write (created; an interrupted fetch into it is resumed).")
@click.option("--kind", type=click.Choice(["urls", "classes", "captions"]), default=None,
              help="What SOURCE holds. Default: detected (a URL-list file or folder of them -> urls; "
                   "images with same-stem .txt files -> captions; one folder per class -> classes).")
@click.option("--image-size", type=int, default=None,
              help="Resize to this size (see --resize-mode). Default: 256 for URL lists, "
                   "originals kept for folders.")
@click.option("--resize-mode", type=click.Choice(["no", "keep_ratio", "center_crop", "border", "keep_ratio_largest"]),
              default="center_crop", show_default=True,
              help="img2dataset's names: center_crop = smaller side to size then centre square; "
                   "keep_ratio = smaller side to size; border = longer side to size, white padding; "
                   "no = keep the original size.")
@click.option("--min-image-size", type=int, default=0, show_default=True,
              help="Skip images whose smaller side (before resizing) is below this.")
@click.option("--max-aspect-ratio", type=float, default=float("inf"), show_default=True,
              help="Skip images whose longer/shorter side ratio is above this.")
@click.option("--samples-per-shard", type=int, default=10000, show_default=True)
@click.option("--processes", type=int, default=None, help="Worker processes. Default: all CPU cores.")
@click.option("--threads", type=int, default=64, show_default=True, help="Download threads per process (URL lists).")
@click.option("--url-col", default=None, help="URL column of the URL list. Default: url, URL, image_url, ...")
@click.option("--caption-col", default=None,
              help="Caption column. Default: caption, TEXT, text, ... if present; '' for none.")
@click.option("--keep-col", "keep_cols", multiple=True,
              help="Extra URL-list column to keep in each sample's json (repeatable), e.g. similarity.")
@click.option("--encode-format", type=click.Choice(["jpg", "png", "webp"]), default="jpg", show_default=True,
              help="Format of re-encoded images (RGB JPEG originals of folders are stored unchanged "
                   "when not resized).")
@click.option("--encode-quality", type=int, default=95, show_default=True)
@click.option("--distributor", type=click.Choice(["multiprocessing", "pyspark", "ray"]), default="multiprocessing",
              show_default=True, help="img2dataset's distributor (URL lists); pyspark and ray are optional "
                                      "extras: pip install 'ditkit[distributed]'.")
@click.option("--timeout", type=int, default=10, show_default=True, help="Download timeout in seconds (URL lists).")
@click.option("--retries", type=int, default=0, show_default=True, help="Download retries per URL (URL lists).")
@click.option("--shuffle-seed", type=int, default=None,
              help="Folders: shuffle the sorted file list with this seed before sharding (deterministic). "
                   "Default: sorted order (ImageNet shards then hold consecutive classes).")
@click.option("--overwrite", is_flag=True,
              help="Delete a previous fetch in --out first instead of resuming it.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def fetch(source, out, kind, image_size, resize_mode, min_image_size, max_aspect_ratio, samples_per_shard,
          processes, threads, url_col, caption_col, keep_cols, encode_format, encode_quality, distributor,
          timeout, retries, shuffle_seed, overwrite, quiet):
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

    \b
    Examples:
      # LAION-style parquet: 256 px centre crops, keep CLIP similarity and safety scores
      ditdata fetch laion_part0.parquet --out ./laion_shards --url-col URL --caption-col TEXT \\
          --image-size 256 --resize-mode center_crop --min-image-size 128 --max-aspect-ratio 2 \\
          --keep-col similarity --keep-col punsafe --keep-col pwatermark --processes 16 --threads 64
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

    info = run_fetch(
        source, out, kind=kind, image_size=image_size, resize_mode=resize_mode,
        min_image_size=min_image_size, max_aspect_ratio=max_aspect_ratio,
        samples_per_shard=samples_per_shard, processes=processes, threads=threads,
        url_col=url_col, caption_col=caption_col, keep_cols=keep_cols,
        encode_format=encode_format, encode_quality=encode_quality, distributor=distributor,
        timeout=timeout, retries=retries, shuffle_seed=shuffle_seed, overwrite=overwrite,
        progress=not quiet,
    )
    click.echo(f"{out}: {report(info)}")


@main.command()
@click.argument("store", type=click.Path(file_okay=False, path_type=str))
def inspect(store):
    """Print a readable summary of a latent STORE: samples, shards, latent shape and dtype,
    autoencoder, conditioning, per-channel statistics and size on disk.

    \b
    Example:
      ditdata inspect ./store
    """
    from ditdata.summary import describe

    click.echo(describe(store))


@main.command()
@click.argument("store", type=click.Path(file_okay=False, path_type=str))
def verify(store):
    """Recompute every checksum of a latent STORE and read every shard to check shapes and
    counts. Exits non-zero, naming each faulty file, if anything is wrong.

    \b
    Example:
      ditdata verify ./store
    """
    from ditdata.summary import verify_store

    faults, n = verify_store(store)
    for f in faults:
        click.echo(f"FAULT {f}", err=True)
    if faults:
        raise click.ClickException(f"{store}: {len(faults)} fault(s) found")
    click.echo(f"{store}: OK ({n} samples verified)")


if __name__ == "__main__":
    sys.exit(main())
