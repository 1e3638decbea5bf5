"""`dittrain`: the command-line surface of the trainer. Options are parsed here and
handed to the module named after each command; torch is imported inside them so
`dittrain --help` stays instant."""

from __future__ import annotations

import os
import sys

import click

from ditdata.common import configfile
from ditdata.common.cli import FiniteFloat, OneLineErrors, SectionedCommand, aliased, quiet_option
from dittrain import config
from dittrain.model.parts import spec_choices  # the block parts' names, without torch

# torch's CPU allocator puts its tensors of 2 MiB and more on transparent huge pages where the
# kernel offers them (madvise). It reads THP_MEM_ALLOC_ENABLE once, at its first large allocation,
# so it is set here, before torch is imported; the user's own setting wins. A host batch is a fresh
# tensor every step (192 MiB of float32 for 256 latents of 768 x 16 x 16), and faulting it in 4 KiB
# page by page was most of the CPU's share of the streaming loader's work: measured 2,200 -> 4,074
# samples/s of RAE latents on 2 workers, memory unchanged (bench/latent_loader.py, bench/RESULTS.md).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


@click.group(cls=OneLineErrors,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="ditkit")
def main():
    """Train Diffusion Transformers on a ditdata latent store, on one GPU.

    \b
      dittrain models                         the named DiT sizes, parameters and GFLOPs
      dittrain plan --model DiT-XL/2 --latents STORE --gpu-memory 24GiB   what fits, how fast, how long
      dittrain run --latents STORE --model DiT-B/2 --out RUN
      dittrain sample --ckpt RUN --class 207 --cfg 4.0 --out grid.png
      dittrain sample --ckpt RUN --n 50000 --npz samples.npz    FID-50K samples (resumable)
      dittrain eval --samples samples.npz --ref VIRTUAL_imagenet256_labeled.npz
      dittrain serve --ckpt RUN               a local web page: classes/prompt -> PNGs + the sample command
      dittrain export --ckpt RUN --format onnx --out dit.onnx    also diffusers, fp16, int8
      dittrain runs runs/* --plot loss.png    a table of runs (steps, loss, speed, FID) and their losses
    """


@main.command("models")
@click.option("--resolution", default=256, show_default=True, type=click.IntRange(min=1), help="Image size in pixels.")
@click.option("--downsample", default=8, show_default=True, type=click.IntRange(min=1),
              help="Autoencoder downsample factor.")
@click.option("--channels", default=4, show_default=True, type=click.IntRange(min=1), help="Latent channels.")
@click.option("--num-classes", default=1000, show_default=True, type=click.IntRange(min=0),
              help="Classes (0 = unconditional).")
@click.option("--learn-sigma/--no-learn-sigma", default=True, show_default=True,
              help="Output the learned variance too (ddpm as in DiT).")
@click.option("--model", "specs", multiple=True, metavar="SPEC",
              help="Also show this model (repeatable): a name, or a custom size "
                   f"custom:hidden=512,depth=8,heads=8,patch=2 (optional: ,mlp_ratio=R{spec_choices()},qk_norm=0|1).")
def models_cmd(resolution, downsample, channels, num_classes, learn_sigma, specs):
    """The named DiT configs (and any --model SPEC) with parameters and forward GFLOPs
    (multiply-adds per sample)."""
    from dittrain.model.dit import models_table

    for line in models_table(resolution, downsample, channels, num_classes, learn_sigma, specs):
        click.echo(line)


# the defaults, from their one place (dittrain.config, light: imported above anyway)
_D, _SAMPLE, _EVAL = config.TrainConfig().flat(), config.SampleConfig(), config.EvalSampleConfig()
_SERVE, _ONNX = config.ServeConfig(), config.OnnxConfig()


# ------------------------------------------------------------------ what sample and serve share


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
    dittrain.inference.open_run.TorchEngine or dittrain.inference.onnx.OnnxEngine. --size (a bucketed run's bucket)
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
        from dittrain.inference.onnx import OnnxEngine

        return OnnxEngine(onnx_file, ckpt, latents=latents, vae=vae, model=model)
    from dittrain.inference.open_run import TorchEngine

    return TorchEngine(ckpt, latents=latents, vae=vae, model=model)


def _rate_pair(value: str | None) -> tuple[float, float] | None:
    """--route-guidance STRONG,WEAK: two selection rates in [0, 1) (dittrain.inference.route_guidance)."""
    if value is None:
        return None
    import math

    try:
        rates = tuple(float(v) for v in value.split(","))
    except ValueError:
        rates = ()
    if len(rates) != 2 or not all(math.isfinite(r) and 0 <= r < 1 for r in rates):
        raise click.BadParameter(f"{value!r}: give STRONG,WEAK, two selection rates in [0, 1) (the fraction of "
                                 "tokens that skips the run's routed blocks), e.g. 0.3,0.7 as TREAD")
    return rates


def _say(line: str) -> None:
    """A command's log line: notes on stderr, the rest on stdout (sample, export)."""
    click.echo(line, err=line.startswith("note:"))


class RunCommand(SectionedCommand):
    """`dittrain run --help`: the options under TrainConfig's section headings (data, model,
    diffusion, optim, ...), in the order config.json and docs/workflow.md use."""

    # flags without a field of their own; "config": how this invocation reads its settings
    EXTRA = {"no_compile": "performance", "config": "config", "print_config": "config", "allow_changes": "config",
             "quiet": "logging"}
    FIRST: tuple[str, ...] = ()  # sections before config's

    def section_of(self, name: str) -> str | None:
        return config.SECTION_OF.get(name) or self.EXTRA.get(name)

    def sections(self) -> list[str]:
        return [*self.FIRST, "config", *config.SECTIONS]


class PlanCommand(RunCommand):
    """`dittrain plan --help`: its own options, then the run's it shares, by section."""

    EXTRA = {name: "plan" for name in ("latent_shape", "classes", "samples", "gpu_memory", "gpu", "epochs", "probe",
                                        "show_all", "write_config")}
    FIRST = ("plan",)


_CFG_RANGE = FiniteFloat(-config.MAX_CFG_SCALE, config.MAX_CFG_SCALE)  # a guidance scale


class AdamBetas(click.ParamType):
    """--adam-betas B1,B2: two numbers in [0, 1), kept in the one spelling config.json records."""

    name = "B1,B2"

    def convert(self, value, param, ctx):
        try:
            return config.adam_betas_text(config.parse_adam_betas(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


class ShiftOrAuto(FiniteFloat):
    """--t-shift S (a finite number > 0) or auto (resolved at the start from the store's latent shape)."""

    name = "S|auto"
    words = ("auto",)  # what a --config file may give besides a number (ditdata.common.configfile)

    def __init__(self):
        super().__init__(min=0, min_open=True)

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        return super().convert(value, param, ctx)


class CfgInterval(click.ParamType):
    """--cfg-interval LO,HI: two numbers with 0 <= LO <= HI <= 1 (dittrain.config.parse_cfg_interval);
    the pair (LO, HI), or as_text: the field's text, written back exactly (`run`'s --eval-cfg-interval)."""

    name = "LO,HI"

    def __init__(self, as_text: bool = False):
        self.as_text = as_text

    def convert(self, value, param, ctx):
        try:
            interval = config.parse_cfg_interval(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return config.format_cfg_interval(interval) if self.as_text else interval


_INTERVAL_HELP = ("Classifier-free guidance only where LO <= t <= HI, t in 0..1 with 1 the noise end (flow: its t; "
                  "ddpm: timestep / 1000); the conditional pass alone elsewhere. REPA's --guidance-high 0.7 is 0,0.7; "
                  "LightningDiT's cfg_interval_start c is 0,1-c (its t runs the other way).")
_SHIFT_HELP = ("Flow runs: shift the sampling time grid, t -> S t / (1 + (S - 1) t) (S > 1: more steps near the "
               "noise; 1: none). Default: the run's --t-shift. LightningDiT's timestep_shift s is S = 1/s.")


def _opt(*names, field, **kw):
    """A click option whose default is TrainConfig's (the one place defaults live)."""
    return click.option(*names, default=_D[field], show_default=True, **kw)


@main.command("run", cls=RunCommand)
@configfile.option(sections=lambda: {**config.SECTION_OF, **RunCommand.EXTRA},
                   cli_only=("print_config", "allow_changes"))
@click.option("--print-config", is_flag=True,
              help="Print the resolved settings (the --config file, the flags and, with --resume, the "
                   "run's record) as a TOML file that --config reads back, and exit.")
@click.option("--allow-changes", is_flag=True,
              help="--resume: apply flags that change what is learned (lr, schedule, EMA, batch, loss, "
                   "precision, ...) instead of refusing them; each change goes into config.json's history.")
@click.option("--latents", cls=configfile.OneOrMany, multiple=True, metavar="STORE[:R]",
              help="The latent store written by `ditdata encode`, or its URL in object storage "
                   "(s3://, gs://, http(s)://; pip install 'ditkit[remote]'), read through --cache-dir. Repeat it "
                   "to mix stores (same latent shape, autoencoder and conditioning): STORE:R takes each of its "
                   "samples R times per epoch (kohya's repeats; 0.3: 30% of the store per epoch; default 1).")
@_opt("--cache-dir", field="cache_dir", help="URL stores: the local cache of verified shards "
      "(default $XDG_CACHE_HOME/ditkit/stores, else ~/.cache/ditkit/stores); shared by runs and workers.")
@_opt("--cache-limit", field="cache_limit", help="URL stores: the cache's size limit, e.g. 20GiB (default "
      "50GiB); least recently used shards not being read are removed; at least the largest shard.")
@click.option("--out", "-o", default="", type=click.Path(file_okay=False, path_type=str),
              help="Run directory: config.json, metrics.jsonl, checkpoints/, ema.safetensors, samples/. "
                   "Required (in the --config file or here), except with --print-config.")
@_opt("--model", field="model", help="A name from `dittrain models`, e.g. DiT-XL/2 or LightningDiT-XL/1, or a "
      "custom size custom:hidden=512,depth=8,heads=8,patch=2 (optional: ,mlp_ratio=R and the block choices "
      f"{spec_choices()},qk_norm=0|1).")
@_opt("--objective", field="objective", type=click.Choice(config.OBJECTIVES),
      help="ddpm: epsilon prediction as in DiT; flow: rectified flow (velocity).")
@_opt("--batch-size", field="batch_size", type=click.IntRange(min=1),
      help="GLOBAL batch per optimizer step (split over ranks and accumulation steps).")
@_opt("--accumulation-steps", field="accumulation_steps", type=click.IntRange(min=1))
@_opt("--lr", field="lr", type=FiniteFloat(min=0), help="Peak learning rate (AdamW).")
@_opt("--adam-betas", field="adam_betas", type=AdamBetas(),
      help="AdamW's beta1,beta2, each in [0, 1) (both --optimizer kinds): DiT's 0.9,0.999; LightningDiT "
           "trains with 0.9,0.95 (with its batch of 1024 and lr 2e-4).")
@_opt("--weight-decay", field="weight_decay", type=FiniteFloat(min=0))
@_opt("--optimizer", field="optimizer", type=click.Choice(config.OPTIMIZERS),
      help="adamw: torch AdamW (fp32 state, 8 bytes per parameter); adamw8bit: bitsandbytes' 8-bit "
           "AdamW (about 2 bytes per parameter; pip install 'ditkit[optim]'). Same lr, betas, weight decay.")
@_opt("--warmup-steps", field="warmup_steps", type=click.IntRange(min=0))
@_opt("--lr-schedule", field="lr_schedule", type=click.Choice(config.LR_SCHEDULES))
@_opt("--min-lr", field="min_lr", type=FiniteFloat(min=0), help="The cosine and linear schedules' floor.")
@_opt("--lr-decay-start", field="lr_decay_start", type=click.IntRange(min=0), metavar="STEP",
      help="--lr-schedule linear: the lr is held until this step (or the warmup's end), then falls linearly.")
@_opt("--lr-decay-end", field="lr_decay_end", type=click.IntRange(min=0), metavar="STEP",
      help="--lr-schedule linear: the step it reaches --min-lr, kept after (0: --max-steps). RAE: 40 and 800 "
           "epochs for start and end.")
@_opt("--grad-clip", field="grad_clip", type=FiniteFloat(min=0), help="Max gradient norm (0: no clipping).")
@_opt("--max-steps", field="max_steps", type=click.IntRange(min=1))
@_opt("--ema", field="ema", type=FiniteFloat(0, 1), help="EMA decay (0..1).")
@_opt("--class-dropout", field="class_dropout", type=FiniteFloat(0, 1), help="Label dropout for CFG (0..1).")
@_opt("--caption-dropout", field="caption_dropout", type=FiniteFloat(0, 1), help="Caption dropout for CFG (0..1).")
@click.option("--learn-sigma/--no-learn-sigma", default=None,
              help="Learned variance (default: on for ddpm, off for flow).")
@_opt("--qk-norm/--no-qk-norm", field="qk_norm", help="QK-norm (RMSNorm of q and k per head) on or off, "
      "whatever --model says; neither: the model's own (a custom spec's qk_norm=0|1; the presets' is off, as in "
      "LightningDiT's released configs, whose 800-epoch config suggests it against NaN losses).")
@_opt("--latent-norm", field="latent_norm", type=click.Choice(config.LATENT_NORMS),
      help="channel: standardise each latent channel with the store's recorded mean/std before the model "
           "(recorded in the run config; sampling undoes it before decoding). Helps scale-1 stores (TAEF2). "
           "auto: channel where the store's autoencoder publishes no scaling factor (VA-VAE, ldm: without "
           "scale_factor), else none; the startup line says which, the run records it.")
@_opt("--loss-weighting", field="loss_weighting", type=click.Choice(config.LOSS_WEIGHTINGS),
      help="ddpm: min-snr weights the eps MSE by min(SNR, gamma) / SNR (the learned-variance VLB term "
           "stays unweighted).")
@_opt("--min-snr-gamma", field="min_snr_gamma", type=FiniteFloat(min=0, min_open=True), help="gamma of min-snr.")
@_opt("--t-sampling", field="t_sampling", type=click.Choice(config.T_SAMPLINGS),
      help="flow: how training draws t in (0, 1).")
@_opt("--t-mean", field="t_mean", type=FiniteFloat(), help="flow logit-normal: t = sigmoid(N(mean, std)).")
@_opt("--t-std", field="t_std", type=FiniteFloat(min=0, min_open=True))
@_opt("--t-shift", field="t_shift", type=ShiftOrAuto(),
      help="flow: SD3's shift t -> S t / (1 + (S - 1) t) of the training t and of the Euler/Heun "
           "sampling grid (1: none; S > 1 spends more time near the noise). auto: RAE's S = sqrt(C x H x W / "
           "4096) of the store's latent (6.93 for 768x16x16; 1 for SD-VAE's 4x32x32), recorded as the number.")
@_opt("--flow-time-scale", field="flow_time_scale", type=FiniteFloat(min=0, min_open=True), metavar="S",
      help="flow: the model's timestep embedder sees t x S (1000: DiT's and SD3's scale; 1: SiT's, REPA's and "
           "LightningDiT's, which feed t in [0, 1]).")
@_opt("--velocity-cosine-weight", field="velocity_cosine_weight", type=FiniteFloat(min=0), metavar="W",
      help="flow: add W x mean(1 - cosine) of the predicted and the true velocity, over the channels at each "
           "position, to the MSE (LightningDiT's cosine loss, W = 1; logged as velocity_cosine_loss). 0: off.")
@_opt("--precision", "--amp", "amp", field="amp", type=click.Choice(config.AMP_MODES),
      help="Autocast (as sample's and serve's --precision; --amp is the older name): auto: bf16 on "
           "GPUs that have it, else fp16 with a grad scaler; fp32 on the CPU.")
@_opt("--grad-checkpointing", field="grad_checkpointing", is_flag=False, flag_value="every",
      help="Recompute activations in the backward pass to save memory: every (every block's, the "
           "most saved; also what the bare flag means), k (every k-th block's), attn (each block's "
           "attention branch: norm, modulate, self- and cross-attention), mlp (each block's MLP "
           "branch, the widest activations), selective (every block, keeping its matmul and "
           "attention outputs: only element-wise ops are recomputed) or none.")
@_opt("--compile", field="compile", type=click.Choice(config.COMPILE), is_flag=False,
      flag_value="blocks",
      help="torch.compile: blocks (each transformer block, one graph for all: compiles in seconds to a "
           "minute; also what the bare flag means), model (the whole forward, longer to compile), auto "
           "(blocks on CUDA, off on the CPU) or off. The first step's time, compilation included, is printed.")
@click.option("--no-compile", is_flag=True, help="The same as --compile off.")
@_opt("--compile-mode", field="compile_mode", type=click.Choice(config.COMPILE_MODES),
      help="torch.compile mode: reduce-overhead replays CUDA graphs (for small models whose step is "
           "bound by kernel launches; more memory); max-autotune searches kernels (long compiles).")
@_opt("--tf32/--no-tf32", field="tf32")
@_opt("--loader", field="loader", type=click.Choice(config.LOADERS),
      help="auto: keep the store in RAM when it fits, else stream it.")
@_opt("--bucket-remainder", field="bucket_remainder", type=click.Choice(config.BUCKET_REMAINDERS),
      help="A bucketed store: each bucket's last partial batch per epoch, pad (with repeats) or drop.")
@_opt("--resident-device", field="resident_device", type=click.Choice(config.RESIDENT_DEVICES),
      help="Where a resident store lives (cuda: on the GPU, no host-to-device copies).")
@_opt("--workers", field="workers", type=click.IntRange(min=0), help="Streaming loader processes.")
@_opt("--shuffle-window", field="shuffle_window", type=click.IntRange(min=0),
      help="Streaming: shards shuffled together in memory (0: the most, up to 4, that fit --loader-memory). "
           "It decides the data order: a resumed run keeps the window it was saved with.")
@_opt("--loader-memory", field="loader_memory",
      help="Streaming: budget for the loader's own memory (worker windows, shared-memory slots, batches): "
           "auto (25% of the available RAM, split over this machine's ranks, at most 4 GiB) or a size such "
           "as 2GiB or 512MiB. The window and prefetch depth are sized to fit it; an explicit "
           "--shuffle-window or --workers that cannot fit is refused. The estimate is in the startup line.")
@_opt("--caption-mix", field="caption_mix", metavar="SET=W,...|clip-score[:temperature=T,threshold=S]",
      help="A store with several caption sets (ditdata encode --captions alt,SET,...): each sample's caption "
           "set, drawn per sample per step from the seed: SET=W,... in these proportions (alt=0.2,recap=0.8), or "
           "clip-score: SANA's rule, weights = CLIP score ** (1/T) over the sets scoring at least S (defaults "
           "T=0.1, S=0.25, SANA's 0.1 and 25 on its 100 x cosine scale), the best-scored set when none does. "
           "Default: the store's first set.")
@_opt("--seed", field="seed", type=int)
@_opt("--save-every", field="save_every", type=click.IntRange(min=1))
@_opt("--keep", field="keep", type=click.IntRange(min=1), help="Checkpoints kept.")
@_opt("--async-save/--no-async-save", field="async_save",
      help="Write each checkpoint (and ema.safetensors) from a background thread after a copy of the "
           "state to host memory, so the step does not wait for the disk (an XL/2 checkpoint is ~11 GB); "
           "costs one host copy of the state. The run waits for the last write before it exits; a "
           "failed write stops the run at the next save. --no-async-save: write on the step.")
@_opt("--log-every", field="log_every", type=click.IntRange(min=1))
@_opt("--sample-every", field="sample_every", type=click.IntRange(min=0),
      help="EMA sample grid every N steps and at the end (0: never).")
@_opt("--sample-steps", field="sample_steps", type=click.IntRange(min=1))
@_opt("--sample-cfg", field="sample_cfg", type=_CFG_RANGE)
@_opt("--sample-classes", field="sample_classes", metavar="LIST",
      help="Class runs: the classes the EMA grids show, one sample each, the same noise every grid "
           "(indices or the store's class names, comma-separated, e.g. 1,207,360; default: 16 drawn with --seed).")
@_opt("--sample-prompts", field="sample_prompts", metavar="FILE",
      help="Text runs: a UTF-8 file, one prompt a line (blank lines and lines starting with # skipped), for the "
           "EMA grids, one sample each, the same noise every grid. Embedded once at startup with the store's "
           "text encoder (its weights must be here); default: the store's first 16 captions' embeddings.")
@_opt("--logger", field="logger", metavar="NAMES",
      help="Where metrics and sample grids go, comma-separated: tensorboard, wandb, jsonl (metrics.jsonl, "
           "always on). wandb needs the wandb extra, honours WANDB_MODE=offline|disabled and never stops a run.")
@click.option("--wandb-project", default=_D["wandb_project"],
              help="W&B project (--logger wandb; default: $WANDB_PROJECT, else ditkit).")
@click.option("--wandb-name", default=_D["wandb_name"],
              help="W&B run name (default: $WANDB_NAME, else the --out folder's name).")
@_opt("--eval-every", field="eval_every", type=click.IntRange(min=0),
      help="FID of the EMA model every N steps and at the end, to metrics.jsonl and TensorBoard "
           "(0: never; needs --eval-ref and the Inception file, see `dittrain eval --help`).")
@_opt("--eval-n", field="eval_n", type=click.IntRange(min=2), help="Samples per evaluation (FID-N).")
@click.option("--eval-ref", default="", metavar="REF",
              help="The FID reference: an ADM reference batch .npz, an .npz or folder of images, or "
                   "image shards from `ditdata fetch` (statistics cached beside it).")
@click.option("--eval-inception", default="", metavar="FILE",
              help="The FID Inception weights (default: $DITKIT_INCEPTION, else the torch hub cache).")
@_opt("--eval-steps", field="eval_steps", type=click.IntRange(min=0),
      help="Sampling steps of an evaluation (0: the FID protocol: 250 ddpm, 50 Euler for flow).")
@_opt("--eval-cfg", field="eval_cfg", type=_CFG_RANGE, help="Guidance scale of an evaluation.")
@_opt("--eval-sampler", field="eval_sampler", type=click.Choice(config.SAMPLERS),
      help="Sampler of an evaluation (default: ddpm for ddpm runs, euler for flow; sde: REPA's FID protocol; "
           "dpm++, unipc: either objective, fewer steps).")
@_opt("--eval-cfg-interval", field="eval_cfg_interval", type=CfgInterval(as_text=True),
      help="Guidance interval of an evaluation (as `dittrain sample --cfg-interval`).")
@_opt("--eval-time-shift", field="eval_time_shift", type=FiniteFloat(min=0, min_open=True),
      help="Flow runs: the sampling grid's shift of an evaluation (default: the run's --t-shift).")
@_opt("--eval-batch-size", field="eval_batch_size", type=click.IntRange(min=1))
@_opt("--val-fraction", field="val_fraction", type=FiniteFloat(0, 1, max_open=True), metavar="F",
      help="Hold out this share of the store's rows (drawn with the validation's own seed: the same rows for "
           "every run on the store), never trained on, and log their loss (val/loss, val/loss_t<T>) every "
           "--val-every steps: the live weights' MSE at 10 fixed t with fixed noise, the same numbers for the "
           "same weights. 0: none. Fixed for the run (--resume keeps it).")
@_opt("--val-latents", field="val_latents", metavar="STORE",
      help="Validate on all the rows of this second store instead (same latent shape, conditioning and "
           "autoencoder as --latents); training keeps every row of --latents.")
@_opt("--val-every", field="val_every", type=click.IntRange(min=1),
      help="Steps between validation losses (also at the start and the last step).")
@_opt("--max-nonfinite", field="max_nonfinite", type=click.IntRange(min=1),
      help="Consecutive NaN/inf losses (each step skipped) before the run stops.")
@_opt("--resume/--no-resume", field="resume",
      help="Continue from the latest checkpoint in --out, with the settings recorded in its config.json "
           "(`--resume --out RUN` alone is enough); flags given apply on top, see --allow-changes.")
@click.option("--init-from", default=_D["init_from"], metavar="FILE_OR_RUN",
              help="Fine-tune: start the model and its EMA from these weights (a plain state dict .pt such "
                   "as DiT-XL-2-256x256.pt, an EMA export, a run directory or a checkpoint: its EMA); "
                   "optimizer, step and schedule start fresh. Another class count re-initialises the label "
                   "embedder; other shapes must fit. Ignored by a --resume that finds a checkpoint.")
@_opt("--device", field="device")
@_opt("--repa", field="repa", metavar="SET", help="REPA: align the tokens after block --repa-depth with feature set SET "
      "of the store (`ditdata features`, e.g. DINOv2) through a projector that trains with the model (never exported).")
@_opt("--repa-depth", field="repa_depth", type=click.IntRange(min=1), help="The block, 1-based (the paper: 8).")
@_opt("--repa-weight", field="repa_weight", type=FiniteFloat(min=0), help="loss = diffusion loss + weight x REPA loss.")
@_opt("--repa-projector-dim", field="repa_projector_dim", type=click.IntRange(min=1), help="The projector MLP's width.")
@_opt("--repa-min-cosine", field="repa_min_cosine", type=FiniteFloat(0, 1),
      help="Refuse a feature set whose stored targets keep a lower mean cosine to the encoder's fp32 output (its "
           "manifest's cosine_to_fp32), or record a non-finite one; 0 trains on any set.")
@_opt("--route", field="route", metavar="RATE:START:END", help="Token routing (TREAD), in training: a fraction "
      "RATE of the tokens skips blocks START..END (0-based, both routed, as TREAD counts; the next block runs "
      "without autocast, as its code), e.g. 0.5:2:24 on DiT-XL/2 (i = 2, j = depth - 4), 0.5:2:8 on B/2.")
@_opt("--route-convention", field="route_convention", type=click.Choice(config.ROUTE_CONVENTIONS),
      help="tread, or half-open (START <= i < END, no fp32 block): runs recorded before this option, kept on --resume.")
@_opt("--lora", field="lora", type=int, metavar="RANK", help="LoRA fine-tuning (through peft): the --init-from "
      "weights stay frozen, a rank-RANK adapter on the --lora-targets linears trains; only it is in the optimizer, "
      "the EMA and the checkpoints. 0: off (a full fine-tune).")
@_opt("--lora-targets", field="lora_targets", metavar="PATTERNS", help="The linears to adapt, comma-separated: "
      "names (a module so named, or ending in .NAME: attn.qkv, mlp.fc1) or regular expressions of the full name "
      "(blocks\\.2[0-7]\\.attn\\.qkv). Default: every block's attention (self and cross) and MLP.")
@_opt("--lora-alpha", field="lora_alpha", type=FiniteFloat(min=0), help="The adapter's scale is alpha / rank; "
      "0: the rank (scale 1, as diffusers' LoRA scripts).")
@_opt("--lora-dropout", field="lora_dropout", type=FiniteFloat(0, 1), help="Dropout on the adapter's input.")
@quiet_option
def run_cmd(print_config, allow_changes, quiet, **options):
    """Train a DiT on a latent store.

    Shapes, classes and text dimensions come from the store's manifest. Checkpoints hold
    everything needed for an exact resume. SIGTERM, SIGINT and SIGUSR1 (Slurm's
    --signal=USR1@120) finish the step, save, print the resume command and exit with status
    75; a finished run exits 0.

    \b
    Examples:
      dittrain run --latents ./store --model DiT-XL/2 --batch-size 256 --precision bf16 \\
          --grad-checkpointing every --out runs/exp1
      dittrain run --config exp1.toml --lr 3e-4          the file's settings, --lr overridden
      dittrain run --resume --out runs/exp1              continue with the recorded settings
      dittrain run --config exp1.toml --print-config     the resolved settings, as TOML
      torchrun --standalone --nproc_per_node 8 -m dittrain.cli run --latents ./store --out runs/ddp
    """
    from dittrain.train.resume import settle

    ctx = click.get_current_context()
    chosen = configfile.given(ctx)
    if options.pop("no_compile"):
        options["compile"] = "off"
        chosen.add("compile")
    options["latents"] = config.latents_value(options["latents"])  # one store: its string, as before mixtures
    cfg, resumption = settle(options, chosen, allow_changes=allow_changes)
    if print_config:
        from dittrain.train.resume import config_toml

        click.echo(config_toml(cfg), nl=False)
        return 0
    if not cfg.checkpointing.out:
        raise click.UsageError("Missing option '--out' (the run directory)")
    if not cfg.data.latents:
        raise click.UsageError("Missing option '--latents' (a latent store; a --resume of a recorded run "
                               "takes its own)")
    from dittrain.train.loop import STOPPED_STATUS, run

    result = run(cfg, resumption, progress=not quiet)
    if result.get("stopped"):
        return STOPPED_STATUS  # the loop said where it stopped and how to resume
    click.echo(f"{result['out']}: finished at step {result['step']}")
    return 0


@main.command("plan", cls=PlanCommand)
@click.option("--latent-shape", metavar="CxHxW", help="Without --latents: the latents' shape, e.g. 4x32x32.")
@click.option("--classes", default=0, type=click.IntRange(min=0), help="Without --latents: classes (0: none).")
@click.option("--samples", type=click.IntRange(min=1), help="Without --latents: the dataset's size (for epochs).")
@click.option("--gpu-memory", metavar="SIZE", help="The memory to fit in, e.g. 24GiB (1 GiB of a GPU's is left to "
              "the CUDA context). Default: the free memory of --device, else --gpu's.")
@click.option("--gpu", metavar="NAME", help="The card, for its memory and recorded speed: H200, H100, A100, "
              "A100-80GB, L40S, RTX 4090, RTX 3090, A6000, V100.")
@click.option("--epochs", type=FiniteFloat(min=0, min_open=True), help="The run's length (else --max-steps).")
@click.option("--probe", is_flag=True, help="Time a few steps of each fitting candidate on --device; rank by them.")
@click.option("--all", "show_all", is_flag=True, help="Every candidate, not the largest micro-batch of each mode.")
@click.option("--write-config", type=click.Path(dir_okay=False, path_type=str), metavar="FILE.toml",
              help="Also write the pick as a `dittrain run --config` file.")
def plan_cmd(write_config, **options):
    """What fits a GPU, how fast, for how long, before a run starts: the candidate settings of the
    global batch (micro-batch and accumulation, --grad-checkpointing, --optimizer; --compile with
    --probe on a GPU) with their predicted peak memory by part, the fastest that fits and its
    `dittrain run` command, the run's steps, epochs and GPU-hours, what the loader must deliver
    and the FID-50K sampling time. `dittrain run` flags given are kept; the rest are searched.

    \b
    Examples:
      dittrain plan --model DiT-XL/2 --latent-shape 4x32x32 --classes 1000 --gpu "RTX 4090"
      dittrain plan --model DiT-B/2 --latents ./store --device cuda --probe --epochs 80
    """
    from dittrain.plan.planner import make_plan, report, request_from, write_config_file

    run = {p.name for p in main.commands["run"].params}
    options["latents"] = config.latents_value(options["latents"])
    if isinstance(options["latents"], list):
        raise click.UsageError("dittrain plan takes one --latents store (a mixture's stores share its latent shape: "
                               "plan with the first)")
    req = request_from({k: v for k, v in options.items() if k in run}, configfile.given(click.get_current_context()),
                       **{k: v for k, v in options.items() if k not in run})
    plan = make_plan(req, log=_say)
    click.echo("\n".join(report(plan)))
    if write_config:
        click.echo(write_config_file(plan, write_config))


# the same options as run's (--steps: the issue's and the users' name for --max-steps here)
plan_cmd.params[:0] = [aliased(p, "--steps") if p.name == "max_steps" else p for p in run_cmd.params
                       if p.name in config.PLAN_RUN_OPTIONS]


@main.command("sample")
@configfile.option(cli_only=("print_config",))
@click.option("--print-config", is_flag=True,
              help="Print the sampling settings (the --config file under the flags, the defaults resolved) as a "
                   "TOML file that --config reads back, and exit.")
@click.option("--ckpt", default=None, type=click.Path(exists=True, path_type=str),
              help="A run directory (its ema.safetensors, else its latest checkpoint), an EMA "
                   "export .safetensors (fp32, or fp16 from `dittrain export`), an int8 export .pt, a "
                   "checkpoint .pt (its EMA weights), or a plain state dict "
                   ".pt such as facebookresearch's DiT-XL-2-256x256.pt (the model inferred from its "
                   "shapes; needs --vae or --latents). Required, except with --engine onnx.")
@click.option("--engine", default="torch", show_default=True, type=click.Choice(["torch", "onnx"]),
              help="torch: the PyTorch DiT of --ckpt; onnx: the --onnx file through onnxruntime (guidance "
                   "and the sampler loop stay in PyTorch).")
@click.option("--onnx", "onnx_file", default=None, type=click.Path(exists=True, dir_okay=False, path_type=str),
              metavar="FILE.onnx", help="--engine onnx: a file from `dittrain export --format onnx` (its run "
                                        "config is in it; --ckpt RUN for a file without it).")
@click.option("--out", "-o", default=None, type=click.Path(path_type=str),
              help="NAME.png: the grid there, singles in NAME/. Otherwise a folder: DIR/grid.png, "
                   "singles in DIR/samples/. Optional with --npz: then only a grid of the first 64 samples.")
@click.option("--npz", default=None, type=click.Path(dir_okay=False, path_type=str), metavar="FILE.npz",
              help="Evaluation samples: --n (default 50000) images in one .npz as the ADM evaluator reads "
                   "it (arr_0 uint8 N x H x W x 3, arr_1 int64 labels), drawn in resumable chunks in "
                   "FILE.npz.parts/ (rerun the same command to continue; torchrun shares the chunks out).")
@click.option("--chunk-size", type=click.IntRange(min=1), default=None,
              help="--npz: samples per chunk file, the unit of resuming and of sharing over ranks "
                   "(default 256); part of the job: a resume must use the same.")
@click.option("--overwrite", is_flag=True, help="--npz: replace an existing FILE.npz.")
@click.option("--class", "--classes", "classes", multiple=True, metavar="C",
              help="Class-conditional models: an index, a class name, 'all', or a comma list; "
                   "repeatable; or one word: 'random' (each sample's class drawn with --seed, the default) "
                   "or 'balanced' (every class N // classes times, +1 for N % classes of them drawn with --seed, in an "
                   "order shuffled with --seed). Default: random (all with --n-per-class).")
@click.option("--prompt", "prompts", multiple=True, metavar="TEXT",
              help="Text models: a prompt (repeatable), embedded with the store's text encoder.")
@click.option("--n", "--num-samples", "n", type=click.IntRange(min=1), default=None,
              help=f"Samples in all (default {_SAMPLE.n}); classes or prompts are cycled over them. "
                   f"With --npz the default is {_EVAL.n}. Under torchrun write --num-samples "
                   "(torchrun's own parser takes --n for an ambiguous option of its own).")
@click.option("--n-per-class", type=click.IntRange(min=1), default=None,
              help="One ROW per class (or prompt) of this many samples; singles under "
                   "samples/<class or prompt index>/.")
@click.option("--per-class-dir", is_flag=True,
              help="Singles under <class or prompt index>/NNNN.png also in the flat layout.")
@click.option("--nrow", type=click.IntRange(min=1), default=None,
              help="Images per grid row (default: ceil(sqrt(n)); --n-per-class in the row layout).")
@click.option("--grid-scale", default=1, show_default=True, type=click.IntRange(min=1),
              help="Enlarge the grid this many times (nearest neighbour) for tiny images.")
@click.option("--cfg", "cfg_scale", default=None, type=_CFG_RANGE,
              help=f"Classifier-free guidance scale (1: none; ignored for unconditional models). Default "
                   f"{_SAMPLE.cfg_scale}; with --npz {_EVAL.cfg_scale} (the DiT paper's "
                   f"FID protocol); with --route-guidance its scale, {config.ROUTE_GUIDANCE_CFG} (TREAD's).")
@click.option("--cfg-channels", default=_SAMPLE.cfg_channels, show_default=True,
              type=click.IntRange(min=0),
              help="Guide only the first N latent channels (0: all). facebookresearch/DiT's, SiT's and "
                   "LightningDiT's samplers guide the first 3 'for exact reproducibility': --cfg-channels 3 "
                   "reproduces the FIDs published with their checkpoints (REPA's guides all).")
@click.option("--cfg-interval", default=config.format_cfg_interval(_SAMPLE.cfg_interval), show_default=True,
              type=CfgInterval(), help=_INTERVAL_HELP)
@click.option("--steps", default=None, type=click.IntRange(min=1),
              help=f"Sampling steps (sde: model evaluations, REPA's --num-steps). Default {_SAMPLE.steps}; with "
                   f"--npz {_EVAL.ddpm_steps} for a ddpm run (DiT's FID protocol), {_EVAL.flow_steps} Euler steps "
                   "for a flow run.")
@click.option("--sampler", type=click.Choice(config.SAMPLERS), default=None,
              help="Default: ddpm for the ddpm objective, euler for flow (dittrain.diffusion.SAMPLER_TABLE). Flow "
                   "runs: euler, heun, or sde: SiT's and REPA's Euler-Maruyama (diffusion w(t) = 2t, steps-1 "
                   "stochastic steps from t=1 to 0.04, then the mean step to 0). Either objective: dpm++ "
                   "(DPM-Solver++(2M)) or unipc (UniPC), diffusers' multistep schedulers, about 20 steps for "
                   "what ddpm needs 250 for (bench/RESULTS.md). ddpm and sde draw noise batch "
                   "after batch, so --batch-size is part of what decides their images.")
@click.option("--time-shift", default=None, type=FiniteFloat(min=0, min_open=True), metavar="S", help=_SHIFT_HELP)
@click.option("--seed", default=_SAMPLE.seed, show_default=True, type=int)
@click.option("--size", default=None, metavar="WxH",
              help="A bucketed store's run: sample at this bucket's size in pixels, e.g. 352x176 (default: square).")
@click.option("--route-guidance", default=None, metavar="STRONG,WEAK", callback=lambda c, p, v: _rate_pair(v),
              help="TREAD's guidance by selection rates (a run trained with --route): every step two passes "
                   "routed through the run's blocks, STRONG then WEAK of the tokens skipping them, combined as "
                   "weak + --cfg x (strong - weak) in place of classifier-free guidance; TREAD's example: "
                   f"0.3,0.7 (--cfg defaults to its {config.ROUTE_GUIDANCE_CFG} with it). PNG samples, --engine torch.")
@click.option("--route-guidance-cond", default=_SAMPLE.route_guidance_cond, show_default=True,
              type=click.Choice(config.ROUTE_GUIDANCE_CONDS),
              help="--route-guidance: null gives both passes the null class (or empty caption), as TREAD's "
                   "sampler; cond gives both the sample's class or prompt.")
@sampling_options("Samples per forward pass (CFG doubles it).")
@click.option("--latents", type=click.Path(file_okay=False, path_type=str), default=None,
              help="The latent store, if not at the path the run recorded (e.g. moved).")
@click.option("--vae", default=None, metavar="NAME_OR_DIR",
              help="The autoencoder to decode with: a preset (sd-vae-ft-ema, ...), a diffusers folder or the "
                   "TAEF2 folder. Required for a plain state dict without --latents; for a run, where its "
                   "store's autoencoder is if not where the manifest says.")
@click.option("--model", default=None, metavar="NAME",
              help="A plain state dict's model (a name from `dittrain models`, or "
                   "custom:hidden=H,depth=D,heads=N,patch=P) instead of the one inferred from its shapes; "
                   "needed when no named size has its hidden size and depth.")
@click.option("--text-pretrained", default=None, metavar="FILE_OR_TAG",
              help="The text encoder's weights, if not where the store's manifest says.")
@quiet_option
def sample_cmd(quiet, ckpt, out, classes, prompts, n, n_per_class, per_class_dir, nrow, cfg_scale, cfg_channels, steps,
               sampler, seed, device, batch_size, precision, latents, vae, model, text_pretrained,
               grid_scale, npz, chunk_size, overwrite, engine, onnx_file, size, route_guidance, route_guidance_cond,
               cfg_interval, time_shift, print_config):
    """Sample a trained run with classifier-free guidance; write a PNG grid and every sample.

    Decodes with the autoencoder named in the store's manifest. Same --seed (and
    --batch-size and device) -> the same images. A store other than the recorded one
    (--latents) is used, with a note, when its latent shape and classes / text widths fit
    the model, and refused otherwise.

    \b
    Output (--out); singles are numbered in grid order, samples.json says what each is:
      NAME.png  ->  NAME.png (grid), NAME/0000.png ..., NAME/samples.json
      DIR       ->  DIR/grid.png, DIR/samples/0000.png ..., DIR/samples/samples.json
      --n-per-class K: one grid row of K per class (or prompt), singles under
      <singles>/<class or prompt index>/0000.png ... (--per-class-dir: the same, flat grid)

    \b
    Examples:
      dittrain sample --ckpt runs/exp1 --class 207 --cfg 4.0 --steps 50 --n 16 --out grid.png
      dittrain sample --ckpt runs/exp1 --classes all --n-per-class 8 --out samples_dir
      dittrain sample --ckpt runs/t2i --prompt "a red fox in snow" --n 8 --out fox.png
      dittrain sample --ckpt DiT-XL-2-256x256.pt --vae sd-vae-ft-ema --class 207 --out panda.png
      dittrain sample --ckpt runs/xl2-tread --route-guidance 0.3,0.7 --cfg 1.5 --out tread.png   (TREAD)
      dittrain sample --engine onnx --onnx dit.onnx --class 207 --out grid.png   (dittrain export)

    \b
    Evaluation samples (--npz; the ADM evaluator's file, `dittrain eval` reads it):
      dittrain sample --ckpt runs/exp1 --n 50000 --npz samples.npz --classes balanced
      torchrun --standalone --nproc_per_node 8 -m dittrain.cli sample --ckpt runs/exp1 --num-samples 50000 \\
          --npz samples.npz
      Sample i depends only on the settings and --seed (not on ranks or interruptions);
      text models cycle the --prompt values (arr_1: the prompt's index); unconditional: no arr_1.
    """
    if print_config:
        click.echo(_sample_toml(click.get_current_context()), nl=False)
        return
    from dittrain.config import NpzConfig, SampleConfig
    from dittrain.inference.sample import sample_to_files

    if route_guidance is not None and (npz is not None or engine != "torch"):
        raise click.ClickException("--route-guidance draws PNG samples with --engine torch (not --npz, not onnx)")
    drawer = sample_engine(engine, onnx_file, ckpt, npz, latents=latents, vae=vae, model=model, size=size)
    if npz is not None:
        from dittrain.inference.eval_samples import sample_to_npz

        if n_per_class is not None or per_class_dir:
            raise click.ClickException("--npz writes --n samples into one file: not with --n-per-class or "
                                       "--per-class-dir (--classes balanced gives every class alike)")
        given = {"n": n, "cfg_scale": cfg_scale, "chunk_size": chunk_size}  # None: the FID protocol's
        settings = NpzConfig(steps=steps, cfg_channels=cfg_channels, cfg_interval=cfg_interval, time_shift=time_shift,
                             sampler=sampler, seed=seed, batch_size=batch_size, precision=precision,
                             **{k: v for k, v in given.items() if v is not None})
        sample_to_npz(drawer, npz, settings, classes=classes, prompts=prompts, device=device,
                      text_pretrained=text_pretrained, overwrite=overwrite, preview=out, log=_say,
                      progress=not quiet)
        return
    if out is None:
        raise click.ClickException("give --out (a PNG grid and every sample) or --npz (evaluation samples)")
    if chunk_size is not None or overwrite:
        raise click.ClickException("--chunk-size and --overwrite apply to --npz only")
    d = SampleConfig()
    if cfg_scale is None:  # TREAD's scale with its guidance, else the sampler's
        cfg_scale = config.ROUTE_GUIDANCE_CFG if route_guidance is not None else d.cfg_scale
    settings = SampleConfig(cfg_scale=cfg_scale,
                            steps=d.steps if steps is None else steps, sampler=sampler, seed=seed,
                            batch_size=batch_size, precision=precision, cfg_channels=cfg_channels,
                            route_guidance=route_guidance, route_guidance_cond=route_guidance_cond,
                            cfg_interval=cfg_interval, time_shift=time_shift)
    sample_to_files(drawer, out, classes=classes, prompts=prompts, n=n, n_per_class=n_per_class,
                    per_class_dir=per_class_dir, nrow=nrow, settings=settings, device=device,
                    text_pretrained=text_pretrained, grid_scale=grid_scale, size=size, log=_say)


def _sample_toml(ctx: click.Context) -> str:
    """`dittrain sample --print-config`: every option's value (the --config file's under the flags)
    as the TOML file --config reads, the defaults that do not depend on the run resolved as the
    command resolves them (--cfg, --n, --chunk-size by --npz); what the run's objective decides
    (--steps with --npz, --sampler, --time-shift) is left out when not given, and named in a comment."""
    from ditdata.common.configfile import CONFIG_OPTION, key_of, to_toml

    p = dict(ctx.params)
    npz = p["npz"] is not None
    for name, plain, with_npz in (("cfg_scale", _SAMPLE.cfg_scale, _EVAL.cfg_scale), ("n", _SAMPLE.n, _EVAL.n),
                                  ("chunk_size", None, _EVAL.chunk_size), ("steps", _SAMPLE.steps, None)):
        if p[name] is None:
            p[name] = with_npz if npz else plain
    by_run = {"steps": "steps (--npz: 250 for ddpm, 50 for flow)", "sampler": "sampler (ddpm or euler)",
              "time_shift": "time-shift (flow: the run's --t-shift)"}
    open_ = [why for name, why in by_run.items() if p[name] is None]
    values = {}
    for o in ctx.command.params:
        if isinstance(o, click.Option) and o.name not in (CONFIG_OPTION, "print_config") and not o.is_eager:
            v = p[o.name]
            values[key_of(o)] = config.format_cfg_interval(v) if o.name == "cfg_interval" else \
                list(v) if isinstance(v, tuple) else v
    header = "dittrain sample --config FILE: the settings of one sampling call"
    if open_:
        header += f"\nleft to the run: {', '.join(open_)}"
    return to_toml({"": values}, header=header)


@main.command("export")
@configfile.option()
@click.option("--ckpt", required=True, type=click.Path(exists=True, path_type=str),
              help="What `dittrain sample --ckpt` takes: a run directory (its EMA), an EMA export, a checkpoint or "
                   "a plain state dict (not an int8 export).")
@click.option("--format", "fmt", default=None, type=click.Choice(["onnx", "diffusers", "fp16", "int8"]),
              help="onnx: FILE.onnx (the forward, dynamic batch); diffusers: a DiTPipeline folder; fp16: "
                   "FILE.safetensors; int8: FILE.pt (torchao weight-only). Required, except with --merge-lora.")
@click.option("--merge-lora", is_flag=True, help="A --lora run: write the folder --out with its EMA adapter merged "
              "into the base (ema.safetensors, which every command takes) and the adapter as peft saves it "
              "(adapter_model.safetensors, adapter_config.json).")
@click.option("--out", "-o", required=True, type=click.Path(path_type=str),
              help="FILE.onnx, a folder (diffusers, --merge-lora), FILE.safetensors (fp16) or FILE.pt (int8).")
@click.option("--overwrite", is_flag=True, help="Replace an existing --out.")
@click.option("--latents", type=click.Path(file_okay=False, path_type=str), default=None,
              help="The run's latent store, if not at the path it recorded (diffusers: its autoencoder and "
                   "class names; onnx: the text length for the trtexec shapes).")
@click.option("--vae", default=None, metavar="NAME_OR_DIR",
              help="diffusers: the AutoencoderKL, if not where the store's manifest says (or, for a plain state "
                   "dict, instead of a store).")
@click.option("--model", default=None, metavar="NAME", help="A plain state dict's model (as sample's).")
@click.option("--tolerance", default=_ONNX.tolerance, show_default=True, type=FiniteFloat(min=0),
              help="onnx: the largest |onnxruntime - PyTorch| allowed, times max(1, max |output|).")
@click.option("--max-batch", default=_ONNX.max_batch, show_default=True, type=click.IntRange(min=2),
              help="onnx: the largest batch of the dynamic axis (guidance doubles the sampling batch).")
@click.option("--opset", default=_ONNX.opset, type=click.IntRange(min=17), help="onnx: the opset (default: the exporter's).")
def export_cmd(ckpt, fmt, merge_lora, out, overwrite, latents, vae, model, tolerance, max_batch, opset):
    """Export a run's EMA weights for other tools: ONNX (TensorRT, onnxruntime), a diffusers
    DiTPipeline, or fp16 / int8 files that `dittrain sample` and `dittrain serve` load.

    \b
    Each export is reloaded and compared with the fp32 PyTorch model (the differences are
    printed) and the sizes of the files written are shown; a refused export writes nothing
    and says why in one line.

    \b
      onnx       x, t (and y, or text_pooled/text_tokens/text_mask) -> out, dynamic batch;
                 run config in its metadata; prints the trtexec command for a TensorRT engine
      diffusers  DiTPipeline.from_pretrained(DIR, local_files_only=True); class-conditional
                 ddpm runs on an AutoencoderKL store only. Timesteps match exactly after
                 dittrain.inference.export.match_dit_timesteps(pipe) (diffusers does not save that
                 setting); class 1000 is the null class of its guidance (fewer classes: padded)
      fp16       half the size; sampling casts the weights back to float32
      int8       torchao weight-only int8 linears (about 1/4 of fp32); needs torchao to load

    \b
    Examples:
      dittrain export --ckpt runs/exp1 --format onnx --out dit.onnx
      dittrain sample --engine onnx --onnx dit.onnx --class 207 --out grid.png
      dittrain export --ckpt runs/exp1 --format diffusers --out dit-pipeline
      dittrain export --ckpt runs/exp1 --format fp16 --out dit-fp16.safetensors
      dittrain sample --ckpt dit-fp16.safetensors --class 207 --out grid.png
      dittrain export --ckpt runs/lora1 --merge-lora --out dit-lora   merged weights + peft adapter
    """
    if merge_lora:
        if fmt is not None:
            raise click.UsageError(f"--merge-lora writes its own folder; export that folder with --format {fmt} after")
        from dittrain.inference.export import export_lora

        export_lora(ckpt, out, overwrite=overwrite, log=_say)
        return
    if fmt is None:
        raise click.UsageError("Missing option '--format' (or --merge-lora for a --lora run)")
    from dittrain.inference.export import export

    export(ckpt, fmt, out, overwrite=overwrite, latents=latents, vae=vae, model=model,
           onnx=config.OnnxConfig(tolerance=tolerance, max_batch=max_batch, opset=opset), log=_say)


def _check_folder(flag: str, path: str | None) -> None:
    """A file option (--plot, --json) whose folder must exist before any work starts."""
    from pathlib import Path

    if path and not Path(path).resolve().parent.is_dir():
        raise click.UsageError(f"{flag} {path}: its folder does not exist")


def _table_and_file(rows, format_table, path: str | None, write) -> None:
    """A report command's table on stdout, then its file (--plot, --json) when asked."""
    click.echo(format_table(rows))
    if path:
        click.echo(f"wrote {write(rows, path)}")


@main.command("runs")
@click.argument("run_dirs", nargs=-1, required=True, metavar="RUN_DIR...", type=click.Path(path_type=str))
@click.option("--plot", default=None, type=click.Path(dir_okay=False, path_type=str), metavar="FILE.png",
              help="Also draw the runs' loss curves into this PNG (log scale, EMA-smoothed over the raw records).")
def runs_cmd(run_dirs, plot):
    """A table of runs: model, store, steps done / max steps, last loss, images/s and data-wait
    share (means of the last records), best FID (with its step) and status.

    \b
    Status: finished (a checkpoint at max steps), has checkpoint (step N: resumable), no
    checkpoint (logged, never saved), empty (nothing logged yet), or not a run (no config.json).
    Torn metrics lines are skipped and counted.

    \b
    Examples:
      dittrain runs runs/*
      dittrain runs runs/exp1 runs/exp2 --plot loss.png
    """
    from dittrain.train.runs import format_table, plot_losses, summarize_all

    _check_folder("--plot", plot)
    _table_and_file(summarize_all(run_dirs), format_table, plot, plot_losses)


@main.command("eval")
@configfile.option()
@click.option("--samples", required=True, type=click.Path(exists=True, path_type=str),
              help="Samples: an .npz (arr_0: uint8 N x H x W x 3, as ADM and `dittrain sample --npz` "
                   "write) or a folder of images (recursive, one size).")
@click.option("--ref", required=True, type=click.Path(exists=True, path_type=str),
              help="Reference: an .npz (ADM reference batches: their precomputed mu/sigma/mu_s/sigma_s "
                   "are used), a folder of images or a `ditdata fetch` image-shard folder.")
@click.option("--inception", default=None, type=click.Path(path_type=str), metavar="FILE",
              help="The Inception weights file (default: $DITKIT_INCEPTION, else the torch hub cache).")
@click.option("--json", "json_out", default=None, type=click.Path(dir_okay=False, path_type=str), metavar="OUT",
              help="Also write the metrics and their provenance to this JSON file.")
@click.option("--batch-size", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--resolution", default=None, type=click.IntRange(min=1), metavar="N",
              help="Centre-crop reference folders and image shards to N with the encoder's ADM rule "
                   "(default: the samples' resolution). .npz images are fed as they are.")
@click.option("--cache-dir", default=None, type=click.Path(file_okay=False, path_type=str),
              help="Where the reference statistics are cached when the reference's own folder is read-only "
                   "(default $XDG_CACHE_HOME/ditkit/eval, else ~/.cache/ditkit/eval).")
@click.option("--precision-recall/--no-precision-recall", "with_pr", default=True, show_default=True,
              help="Precision and recall need every reference feature (and for an ADM batch, a pass "
                   "over its images); off: FID, sFID and IS only.")
@quiet_option
def eval_cmd(samples, ref, inception, json_out, batch_size, device, resolution, cache_dir, with_pr, quiet):
    """FID, sFID, Inception Score, precision and recall of samples against a reference.

    As ADM's evaluator (guided-diffusion evaluations/evaluator.py) computes them, on
    torch-fidelity's port of the TF Inception-v3 (2015-12-05; any image size, resized to 299
    inside as TF does). The reference's statistics are cached beside it.

    \b
      FID        Frechet distance of Gaussians fit to pool3 (2048-d) features of samples and
                 reference: mean, np.cov, scipy sqrtm (1e-6 diagonal retry). Lower is better.
      sFID       the same on spatial features: mixed_6/conv, first 7 channels x 17 x 17
                 (2023-d). Lower is better.
      IS         exp(mean KL(p(y|x) || p(y))), softmax of the unbiased 1008-way logits, per
                 split of 5000 samples, mean over splits (samples only). Higher is better.
      Precision  share of samples within some reference point's k=3 radius (squared pool3
                 distance to its 3rd nearest neighbour): fidelity.
      Recall     share of reference points within some sample's k=3 radius: diversity.

    \b
    The Inception weights are never downloaded: --inception FILE, else $DITKIT_INCEPTION, else
    weights-inception-2015-12-05-6726825d.pth (or pytorch-fid's pt_inception-2015-12-05-
    6726825d.pth) in the torch hub cache, $TORCH_HOME/hub/checkpoints/ (default
    ~/.cache/torch/hub/checkpoints/). Get it on a machine with internet from
    https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/weights-inception-2015-12-05-6726825d.pth

    \b
    Examples:
      dittrain eval --samples samples.npz --ref VIRTUAL_imagenet256_labeled.npz --json fid.json
      dittrain eval --samples out/samples --ref ./imagenet-val-shards --resolution 256
    """
    from dittrain.eval import evaluate, format_table, write_json

    _check_folder("--json", json_out)

    def log(line):
        click.echo(line, err=True)

    metrics = evaluate(samples, ref, inception=inception, batch_size=batch_size, device=device,
                       resolution=resolution, cache_dir=cache_dir, with_pr=with_pr, progress=not quiet, log=log)
    _table_and_file(metrics, format_table, json_out, write_json)


@main.command("serve")
@configfile.option()
@click.option("--ckpt", required=True, type=click.Path(exists=True, path_type=str),
              help="What `dittrain sample --ckpt` takes: a run directory, an EMA export, a checkpoint or a "
                   "plain state dict (with --vae or --latents). Loaded once, at start.")
@click.option("--host", default=_SERVE.host, show_default=True,
              help="The address to listen on; 0.0.0.0 opens the page to the network (no login: trusted networks).")
@click.option("--port", default=_SERVE.port, show_default=True, type=click.IntRange(1, 65535))
@sampling_options("Samples per forward pass (CFG doubles it); part of what decides ddpm's images.")
@click.option("--max-images", default=_SERVE.max_images, show_default=True, type=click.IntRange(min=1),
              help="The most images one request may ask for.")
@click.option("--max-steps", default=_SERVE.max_steps, show_default=True, type=click.IntRange(min=1),
              help="The most sampling steps one request may ask for (ddpm: at most its timesteps).")
@click.option("--queue-size", default=_SERVE.queue_size, show_default=True, type=click.IntRange(min=1),
              help="Requests waiting their turn (one runs at a time) before new ones are turned away.")
@click.option("--latents", type=click.Path(file_okay=False, path_type=str), default=None,
              help="The latent store, if not at the path the run recorded.")
@click.option("--vae", default=None, metavar="NAME_OR_DIR", help="The autoencoder to decode with (as sample's).")
@click.option("--model", default=None, metavar="NAME", help="A plain state dict's model (as sample's).")
@click.option("--text-pretrained", default=None, metavar="FILE_OR_TAG",
              help="The text encoder's weights, if not where the store's manifest says.")
def serve_cmd(ckpt, host, port, **options):
    """A local web page that samples a run: pick a class (or write a prompt), the number of
    images, steps, CFG scale, sampler and seed; get the PNGs and the `dittrain sample`
    command that writes exactly the same images.

    \b
    The model loads once; requests queue and run one at a time. Nothing is fetched from the
    network (no analytics, no share link, fonts served locally). Ctrl-C stops.

    \b
    Examples:
      dittrain serve --ckpt runs/exp1                     then open http://127.0.0.1:7860/
      dittrain serve --ckpt runs/t2i --port 8080 --device cuda:1
      ssh -L 7860:127.0.0.1:7860 gpu-box                  to reach a remote server's page
    """
    from dittrain.inference.serve import serve

    serve(ckpt, config.ServeConfig(host=host, port=port, **options), log=click.echo)


if __name__ == "__main__":
    sys.exit(main())
