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
