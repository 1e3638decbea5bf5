"""What the sampling commands (`dittrain sample`, `dittrain serve`) share on the command line:
their --device / --batch-size / --precision options, and `dittrain sample --engine`'s choice of
what draws, its options checked before anything loads. Light: click and dittrain.config only,
so `dittrain --help` stays instant."""

from __future__ import annotations

import click

from dittrain import config

_SAMPLE = config.SampleConfig()  # the defaults, from their one place


def sampling_options(batch_help: str):
    """--device, --batch-size and --precision of the sampling commands (sample, serve)."""
    def add(f):
        for option in reversed((
                click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N."),
                click.option("--batch-size", default=_SAMPLE.batch_size, show_default=True,
                             type=click.IntRange(min=1), help=batch_help),
                click.option("--precision", default=_SAMPLE.precision, show_default=True,
                             type=click.Choice(config.PRECISIONS),
                             help="Model autocast; auto: bf16 on GPUs that have it, else fp32."))):
            f = option(f)
        return f
    return add


def sample_engine(engine: str, onnx_file, ckpt, npz, *, latents, vae, model, size=None):
    """What `dittrain sample --engine` draws with, its options checked (nothing loads yet):
    dittrain.opened.TorchEngine or dittrain.onnx.OnnxEngine. --size (a bucketed run's bucket)
    is for the torch engine's PNGs: --npz and an ONNX graph sample at the run's default size."""
    if (engine == "onnx") != (onnx_file is not None):
        raise click.UsageError("--engine onnx and --onnx FILE go together")
    if ckpt is None and engine == "torch":
        raise click.UsageError("Missing option '--ckpt'")
    if engine == "onnx" and npz is not None:
        raise click.ClickException("--engine onnx writes --out samples; --npz samples with the torch engine")
    if size is not None and (npz is not None or engine == "onnx"):
        raise click.ClickException(f"--size {size}: {'--npz' if npz is not None else '--engine onnx'} samples at the "
                                   "run's default size only; leave out --size (or sample PNGs with the torch engine)")
    if engine == "onnx":
        from dittrain.onnx import OnnxEngine

        return OnnxEngine(onnx_file, ckpt, latents=latents, vae=vae, model=model)
    from dittrain.opened import TorchEngine

    return TorchEngine(ckpt, latents=latents, vae=vae, model=model)


__all__ = ["sample_engine", "sampling_options"]
