"""What a run reports, on rank 0: metrics records and sample grids to the loggers
(dittrain.train.loggers: metrics.jsonl always, TensorBoard, W&B), the progress bar and its notes,
FID evaluations during training; and what running out of GPU memory says.

    with Log(run, state, resumed=..., progress=...) as log:   the loggers and the bar, closed on errors too
        log.step(loss, grad_norm[, metrics, shapes])
                                                 after every kept optimizer step (metrics: the loss
                                                 terms' {name: () tensor}, dittrain.train.losses, logged
                                                 under their names: --repa's repa_loss, repa_cos;
                                                 shapes: the micro-batches' (B, C, H, W), logged as
                                                 batch_shape on a bucketed store's run)
        log.skipped()                            after a step skipped for a non-finite loss
    watched(run)                                 what the grids show (--sample-classes, --sample-prompts)
    sample_grid(run, ema, step, log)             an EMA grid in RUN/samples/ (never stops a run)
    evaluate(run, state, step, log)              FID of the EMA model (never stops a run)
    measure(run, step, log, ...)                 a measurement's status, failure note and report
                                                 (evaluate's and dittrain.train.validation's)
    with training_memory_hint(run): ...          out of GPU memory -> one line: model, batch, precision,
                                                 the flags that lower it (ditdata.common.memory) and
                                                 the `dittrain plan` command that lists what fits

The bar is ditdata.common.progress's: tqdm on a terminal; in a file (Slurm, nohup, CI) one
plain line per --log-every steps, `train: 200/400000 step (0%), 3.10 step/s, elapsed 01:04,
ETA 35:49:28; loss 0.1520 lr 1.00e-04 794 img/s wait 2%`.
"""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ditdata.common.devices import gpu_named
from ditdata.common.errors import described
from ditdata.common.memory import halved, out_of_memory_hint
from ditdata.common.progress import Lines, progress_bar
from dittrain.model.dit import DiT
from dittrain.model.routing import block_tokens, route_of
from dittrain.model.sizes import flops_per_forward
from dittrain.train.checkpoint import RunState
from dittrain.train.loggers import open_loggers
from dittrain.train.losses import shown
from dittrain.train.setup import Run, TrainError, text_token_count


class Log:
    """What a run reports. Every log_every steps (and at the last) a metrics record: to the
    loggers (--logger: metrics.jsonl always, TensorBoard, W&B; dittrain.train.loggers) and the
    progress bar's postfix, on rank 0; so are evaluations and the EMA sample grids. The bar
    advances once per optimizer step; a skipped (non-finite) step shows in its postfix.
    progress=False (-q/--quiet): no bar and no progress lines (the loggers write as ever)."""

    def __init__(self, run: Run, state: RunState, *, resumed: bool = False, progress: bool = True):
        cfg, device = run.cfg, run.device
        self.run, self.state = run, state
        # 2 FLOPs/MAC x (forward + 2 backward) per sample of the global batch; --route: what the routed step computes
        m = run.model_cfg
        tokens = block_tokens(route_of(cfg.routing), m.depth, m.num_tokens)
        self.flops_step = 6 * flops_per_forward(m, text_token_count(run.store), tokens) * cfg.optim.batch_size
        # MFU against the card's dense bf16/fp16 peak (ditdata.common.devices.GPUS); unknown cards: no MFU
        gpu = gpu_named(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        self.peak = gpu.peak_flops if gpu is not None else None
        self.loggers = open_loggers(cfg.logging.logger, run.out, config=run.resolved, resumed=resumed,
                                    wandb_project=cfg.logging.wandb_project, wandb_name=cfg.logging.wandb_name,
                                    note=note) if run.master else []
        self.bar = progress_bar(total=cfg.optim.max_steps, initial=state.step, desc="train", unit="step",
                                enabled=run.master and progress, every=cfg.logging.log_every, mininterval=1.0)
        self.postfix, self.shown = "", 0.0
        self.t_last, self.wait_last, self.steps_since = time.perf_counter(), state.loader.wait_seconds, 0
        self.bucketed = bool(run.store.buckets)  # aspect-ratio buckets: each record says its batch's shape
        self.shown_metrics = shown(cfg)  # the loss terms' metrics the postfix shows beside the loss (repa_loss)

    def __enter__(self) -> Log:
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)  # closed; a plain-line bar writes no last line over an error
        for logger in self.loggers:
            logger.close()

    def step(self, loss: torch.Tensor, grad_norm: torch.Tensor, metrics: dict[str, torch.Tensor] | None = None,
             shapes: tuple[tuple[int, ...], ...] = ()) -> None:
        """After an optimizer step (state.step is its number). The device scalars are read on
        log steps only. metrics: the loss terms' (Attempt.metrics); shapes: the step's
        micro-batch shapes (a bucketed run logs them)."""
        cfg, step = self.run.cfg, self.state.step
        self.steps_since += 1
        if step % cfg.logging.log_every == 0 or step == cfg.optim.max_steps:
            rec, now = self._record(loss, grad_norm, metrics or {})
            if self.bucketed and shapes:  # "8x4x32x48" (B x C x H x W), micro-batches joined by "+"
                rec["batch_shape"] = "+".join("x".join(map(str, s)) for s in shapes)
            if self.run.master:
                self._scalars("train", rec)
                terms = "".join(f" {name} {rec[name]:.4f}" for name in self.shown_metrics if name in rec)
                shape = f" batch {rec['batch_shape']}" if "batch_shape" in rec else ""
                self.postfix = (f"loss {rec['loss']:.4f}{terms} lr {rec['lr']:.2e} {rec['images_per_s']:.0f} img/s "
                                f"wait {100 * rec['data_wait_frac']:.0f}%{shape}")
                self.bar.set_postfix_str(self._postfix())
            self.t_last, self.wait_last, self.steps_since = now, self.state.loader.wait_seconds, 0
        self.bar.update(1)

    def evaluation(self, rec: dict) -> None:
        """An evaluation's record {"step", "fid", "sfid", "inception_score", "eval_n", ...}:
        to the loggers as eval/* (in metrics.jsonl a record without "loss"), and a line."""
        self._report("eval", rec, f"FID-{rec['eval_n']} {rec['fid']:.3f}, sFID {rec['sfid']:.3f}, "
                     f"IS {rec['inception_score']:.2f} ({rec['eval_seconds']:.0f} s)")

    def validation(self, rec: dict) -> None:
        """A validation loss' record {"step", "loss", "loss_t<T>", ..., "rows", "seconds"}
        (dittrain.train.validation): to the loggers as val/* (metrics.jsonl: val_loss, ...), and a line."""
        self._report("val", rec, f"val loss {rec['loss']:.5f} ({rec['rows']} rows, {rec['seconds']:.1f} s)")

    def _report(self, group: str, rec: dict, line: str) -> None:
        """A measurement's record to the loggers as GROUP/*, the status cleared, and `line` after its step."""
        self._scalars(group, rec)
        self.status("")
        self.bar.write(f"dittrain: step {rec['step']}: {line}", file=sys.stderr)

    def grid(self, step: int, path: Path) -> None:
        """An EMA sample grid written at `path` (a PNG): to the loggers that show images."""
        from PIL import Image

        with Image.open(path) as im:
            image = np.asarray(im.convert("RGB"))
        for logger in self.loggers:
            logger.image(step, "samples/ema", image)

    def _scalars(self, group: str, rec: dict) -> None:
        """A record {"step", name: value, ...} to every logger, as GROUP/name tags."""
        values = {f"{group}/{k}": v for k, v in rec.items() if k != "step"}
        for logger in self.loggers:
            logger.scalars(rec["step"], values)

    def status(self, text: str) -> None:
        """Show what the run is doing besides training (e.g. evaluating) after the figures."""
        self.bar.set_postfix_str(f"{self._postfix()} {text}".strip())

    def skipped(self) -> None:
        """After a step skipped for a non-finite loss: the postfix counts it (redrawn at most
        once a second; the bar does not advance)."""
        self.bar.set_postfix_str(self._postfix(), refresh=False)
        n = self.state.nonfinite_total
        if isinstance(self.bar, Lines):  # a log file: a line of its own, as a bar would show it
            if not self.bar.disable and (n == 1 or n % self.run.cfg.logging.log_every == 0):
                self.bar.write(f"train: step {self.state.step}: non-finite skipped {n} (the step did not advance)")
        elif time.monotonic() - self.shown >= 1.0:
            self.bar.refresh()
            self.shown = time.monotonic()

    def _postfix(self) -> str:
        """The last record's figures, and the count of skipped steps when there are any."""
        n = self.state.nonfinite_total
        return f"{self.postfix} non-finite skipped {n}".strip() if n else self.postfix

    def _record(self, loss: torch.Tensor, grad_norm: torch.Tensor, metrics: dict) -> tuple[dict, float]:
        """(the metrics record since the last one, its time)."""
        device, state = self.run.device, self.state
        now = time.perf_counter()
        dt = now - self.t_last
        wait = state.loader.wait_seconds - self.wait_last
        # the loss terms' figures beside the diffusion loss (train/repa_loss, ...), read in one host copy
        terms = dict(zip(metrics, torch.stack(list(metrics.values())).tolist(), strict=True)) if metrics else {}
        rec = {"step": state.step, "loss": loss.item(), **terms, "lr": state.lr_schedule.get_last_lr()[0],
               "grad_norm": float(grad_norm),
               "images_per_s": self.steps_since * self.run.cfg.optim.batch_size / dt if dt > 0 else 0.0,
               "data_wait_frac": wait / dt if dt > 0 else 0.0, "nonfinite_skipped": state.nonfinite_total}
        if device.type == "cuda":
            rec["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        if self.peak:
            rec["mfu"] = self.flops_step * self.steps_since / dt / (self.peak * self.run.world)
        return rec, now


def note(line: str) -> None:
    """A line on stderr that leaves the progress bar whole."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)


def measure(run: Run, step: int, log: Log, what: str, doing: str, compute: Callable[[], dict],
            report: Callable[[dict], None]) -> None:
    """A measurement during training (`what`: an evaluation, a validation): the bar's status says `doing`
    while every rank runs `compute`; rank 0 `report`s its record {"step": step, ...}. A failure is a note on
    the rank it happened on: a measurement never stops the run."""
    log.status(doing)
    try:
        rec = compute()
    except Exception as e:
        print(f"\ndittrain: {what} at step {step} failed on rank {run.rank} ({described(e)}); training goes on",
              file=sys.stderr)
        log.status("")
        return
    if run.master:
        report({"step": step, **rec})


def evaluate(run: Run, state: RunState, step: int, log: Log) -> None:
    """FID of the EMA model, every rank drawing its share, logged by rank 0. A failure is a
    note: an evaluation never stops the run."""
    measure(run, step, log, "evaluation", f"evaluating FID-{run.cfg.eval.eval_n}",
            lambda: run.evaluator(state.ema, run.resolved, run.store, rank=run.rank, world=run.world), log.evaluation)


def sample_grid(run: Run, ema: DiT, step: int, log: Log) -> None:
    """An EMA sample grid (a PNG in RUN/samples/, and to the loggers), when the store's
    autoencoder can be loaded here (else a note)."""
    path = run.out / "samples" / f"step_{step:08d}.png"
    try:
        from dittrain.inference.sample import write_training_grid
    except ImportError:
        return
    from dittrain.config import SampleConfig

    cfg = run.cfg
    settings = SampleConfig(steps=cfg.logging.sample_steps, cfg_scale=cfg.logging.sample_cfg, seed=cfg.optim.seed)
    try:
        write_training_grid(ema, run.resolved, run.store, path, settings, device=run.device, **(run.watch or {}))
    except Exception as e:  # samples are a convenience: never kill a run over them
        print(f"dittrain: no sample grid at {path.name} ({type(e).__name__}: {e})", file=sys.stderr)
        return
    log.grid(step, path)


def watched(run: Run) -> dict:
    """What every EMA grid shows, resolved once before the run writes anything: {"labels": [...]}
    (--sample-classes), {"text": {field: (N, ...)}} (--sample-prompts, embedded on rank 0 with the
    store's text encoder, rounded to the store's dtype as training sees it, then the encoder let
    go), or {} for the defaults (the seed's classes, the store's first captions). A list or file
    that is bad or does not fit the model's conditioning is a one-line TrainError on every rank."""
    from dittrain.inference.open_run import SampleError, conditioning_kind
    from dittrain.inference.sample import parse_classes

    cfg, kind = run.cfg.logging, conditioning_kind(run.model_cfg)
    if cfg.sample_classes.strip():
        if kind != "class":
            raise TrainError(f"--sample-classes: this is a {kind}-conditioned run (its store has no classes)"
                             + ("; give --sample-prompts FILE" if kind == "text" else ""))
        try:
            labels = parse_classes([cfg.sample_classes], run.model_cfg.num_classes,
                                   list(run.store.conditioning.class_names or ()))
        except SampleError as e:
            raise TrainError(f"--sample-classes: {e}") from None
        if not labels:
            raise TrainError(f"--sample-classes {cfg.sample_classes!r} names no class")
        return {"labels": labels}
    if not cfg.sample_prompts:
        return {}
    if kind != "text":
        raise TrainError(f"--sample-prompts: this is a {kind}-conditioned run (its store has no text embeddings)"
                         + ("; give --sample-classes LIST" if kind == "class" else ""))
    path = Path(cfg.sample_prompts)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TrainError(f"--sample-prompts {path}: cannot read it ({described(e)})") from None
    prompts = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise TrainError(f"--sample-prompts {path}: no prompts in it (one a line; blank lines and # lines are skipped)")
    if not run.master:  # only rank 0 draws grids
        return {}
    from dittrain.inference.sample import embed_prompts

    try:
        text = embed_prompts(run.store, prompts, tokens=bool(run.model_cfg.text_token_dim), device=run.device)
    except SampleError as e:  # the encoder's weights missing: the line says how to get them
        raise TrainError(f"--sample-prompts: {e}") from None
    if run.device.type == "cuda":
        torch.cuda.empty_cache()  # the encoder is gone; its memory goes back before the model is built
    return {"text": text}


def training_memory_hint(run: Run):
    """A block in which running out of GPU memory is one line that names the model, the
    batch (global, micro-batch per rank, accumulation, ranks) and the precision, and the
    flags that lower the memory still unused by this run (ditdata.common.memory)."""
    cfg = run.cfg
    acc, micro, gc = cfg.optim.accumulation_steps, run.per_rank, cfg.performance.grad_checkpointing
    ranks = f" x {run.world} ranks" if run.world > 1 else ""
    batch = f"global batch {cfg.optim.batch_size} (micro-batch {micro} x {acc} accumulation{ranks})"
    hints = [{"none": "--grad-checkpointing selective", "every": None}.get(gc, "--grad-checkpointing every")]
    if micro % 2 == 0:  # the same global batch in smaller pieces
        hints.append(f"--accumulation-steps {2 * acc} (micro-batch {micro // 2})")
    if cfg.optim.optimizer == "adamw":
        hints.append("--optimizer adamw8bit")
    if micro % 2:
        hints.append(halved("--batch-size", cfg.optim.batch_size))
    return out_of_memory_hint(what=f"training {cfg.model.model}", batch=batch, precision=run.amp_dtype,
                              hints=hints, device=run.device, see=plan_hint(cfg, run.device))


def plan_hint(cfg, device) -> str:
    """Where an out-of-memory run is sent: `dittrain plan` with the run's model, store and batch
    lists the settings that fit this GPU and picks the fastest."""
    from dittrain.config import latent_sources

    # several --latents: the first store's path (plan takes one store; the others share its latent shape)
    first = cfg.data.latents if isinstance(cfg.data.latents, str) else latent_sources(cfg.data.latents)[0][0]
    store = shlex.quote(first) if first else "STORE"
    return (f"`dittrain plan --model {shlex.quote(cfg.model.model)} --latents {store} --batch-size "
            f"{cfg.optim.batch_size} --device {device}` lists the settings that fit this GPU")


__all__ = ["Log", "evaluate", "note", "sample_grid", "training_memory_hint", "watched"]
