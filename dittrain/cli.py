"""`dittrain`: the command-line surface of the trainer. Options are parsed here and
handed to the module named after each command; torch is imported inside them so
`dittrain --help` stays instant."""

from __future__ import annotations

import sys

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="ditkit")
def main():
    """Train Diffusion Transformers on a ditdata latent store, on one GPU.

    \b
      dittrain models                         the named DiT sizes, parameters and GFLOPs
      dittrain run --latents STORE --model DiT-B/2 --out RUN
      dittrain sample --ckpt RUN --class 207 --cfg 4.0 --out grid.png
    """


if __name__ == "__main__":
    sys.exit(main())
