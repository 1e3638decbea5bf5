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


@main.command("models")
@click.option("--resolution", default=256, show_default=True, help="Image size in pixels.")
@click.option("--downsample", default=8, show_default=True, help="Autoencoder downsample factor.")
@click.option("--channels", default=4, show_default=True, help="Latent channels.")
@click.option("--num-classes", default=1000, show_default=True, help="Classes (0 = unconditional).")
@click.option("--learn-sigma/--no-learn-sigma", default=True, show_default=True,
              help="Output the learned variance too (ddpm as in DiT).")
def models_cmd(resolution, downsample, channels, num_classes, learn_sigma):
    """The named DiT configs with parameters and forward GFLOPs (multiply-adds per sample)."""
    from dittrain.model import CONFIGS, describe

    if resolution % downsample:
        raise click.UsageError(f"--resolution {resolution} is not a multiple of --downsample {downsample}")
    size = resolution // downsample
    click.echo(f"at {resolution} px: latent {channels}x{size}x{size}, {num_classes} classes, "
               f"learn_sigma={learn_sigma}; GFLOPs = multiply-adds per sample per forward")
    click.echo(f"{'model':<10} {'depth':>5} {'hidden':>6} {'heads':>5} {'tokens':>6} {'params':>9} {'GFLOPs':>9}")
    for name, arch in CONFIGS.items():
        if size % arch["patch_size"]:
            continue  # the latent does not split into whole patches
        row = describe(name, input_size=size, in_channels=channels, num_classes=num_classes,
                       learn_sigma=learn_sigma)
        click.echo(f"{name:<10} {row['depth']:>5} {row['hidden']:>6} {row['heads']:>5} {row['tokens']:>6} "
                   f"{row['params'] / 1e6:>8.1f}M {row['gflops']:>9.2f}")


if __name__ == "__main__":
    sys.exit(main())
