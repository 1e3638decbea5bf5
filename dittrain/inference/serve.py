"""`dittrain serve`: a local web page that samples a run, over the one sampling path.

    server = Server(RUN, ServeConfig(device="auto"))  opened.TorchEngine: the run and its DiT, once
    out = server.generate(Request(choice="207", n=4, steps=50, seed=None))
                                                     (size="352x176": a bucketed run's bucket, as --size;
                                                     the page offers them in a dropdown, server.sizes)
    out.images, out.command, out.message, out.seed   PNG-ready uint8 images, the `dittrain sample`
                                                     line that gives them, a note, the seed used
    demo = build_app(server)                         gradio Blocks over generate
    serve(RUN, ServeConfig(port=7860))               the command: build, queue, launch, wait

The same images as the shown command. What decides the images (sample.py's docstring):
the weights, the seed (the noise of all samples first, then the ddpm and sde samplers'
noise batch after batch, random classes with the same seed), the batch size (ddpm, sde),
the device and the precision, besides steps, cfg (its interval), sampler, time shift and
the conditions. A request
is turned into ONE call (classes or prompt, n and a SampleConfig) from which both the
command line and the plan are made: plan_samples gets exactly what `dittrain sample`
gives it for that line (its cfg_channels default, no layout options), with the resolved
device and precision written out (`auto` could resolve otherwise elsewhere). run_plan
then draws it with the model the engine made at startup (eval mode, no state between
calls) and the autoencoder run_plan would load itself (load_autoencoder of the store, or
--vae), kept. A random seed is drawn before planning and shown (seed box, message,
command). When the weights file changes under a running server (training goes on), the
message says so: the command would then sample the new weights.

Requests are queued (gradio's queue, one at a time: the model is not thread-safe; a lock
guards direct callers too). A bad request (0 steps, too many images, a CFG scale
beyond +-100, a CFG interval outside 0..1, an unknown class, a text encoder that cannot load) is a
message in the page,
and so are samples that went NaN/inf (no images shown); the server stays up.

Offline (checked with gradio 6.31): GRADIO_ANALYTICS_ENABLED=False is set before gradio is
imported (no version check, no telemetry); launch(share=False) (no tunnel binary); no SSR
(no node server), no MCP, no PWA; the default theme's fonts are gradio's LocalFont files,
served by this server, and the page loads no script or font from elsewhere (the browser
test in tests/test_serve.py lists every resource the page fetched: all from the server).
HF_HUB_DISABLE_TELEMETRY defaults to 1; HF_HUB_OFFLINE is left as the user set it.

Public API: Request, Generated, Server, build_app, serve.
"""

from __future__ import annotations

import math
import os
import secrets
import shlex
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ditdata.common.errors import UserError, one_line
from ditdata.common.extras import missing_extra
from dittrain.config import CFG_EVERYWHERE, SampleConfig, ServeConfig, format_cfg_interval, parse_cfg_interval
from dittrain.diffusion import SAMPLERS
from dittrain.inference import open_run
from dittrain.inference.open_run import SampleError
from dittrain.inference.sample import MAX_CFG_SCALE, NonFiniteSamples, default_size, plan_samples, run_plan, run_sizes

_S, _SERVE = SampleConfig(), ServeConfig()
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes any int up to 2**64 - 1; the CLI any int
RANDOM = "random"  # the class choice that draws each sample's class with the seed
APP_CSS = "#gallery img { image-rendering: pixelated; }"  # tiny samples stay sharp when enlarged
_PRECISION_NAMES = {None: "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


@dataclass(frozen=True)
class Request:
    """One press of Generate. choice: a class run's class (an index, a name, or "random"),
    a text run's prompt, ignored for an unconditional run. seed None: draw one."""

    choice: str = ""
    n: int = 4
    steps: int = _S.steps
    cfg_scale: float = _S.cfg_scale
    sampler: str | None = None
    seed: int | None = _S.seed
    size: str | None = None  # a bucketed run: the bucket ("WxH" px); None: its default
    cfg_interval: str | tuple = _S.cfg_interval  # "LO,HI": guided where LO <= t <= HI (as --cfg-interval)
    time_shift: float | None = None  # a flow run's grid shift (as --time-shift); None or "": the run's


class Generated(NamedTuple):
    images: np.ndarray | list  # (N, H, W, 3) uint8; [] when the request failed
    command: str  # the `dittrain sample` line that writes these images ("" on failure)
    message: str  # what happened, or why not
    seed: int | None  # the seed used (drawn when the request asked for a random one)
    labels: tuple[int, ...] | None = None  # a class run: the class of each image

    @property
    def ok(self) -> bool:
        return len(self.images) > 0


@dataclass(frozen=True)
class _Call:
    """A request as `dittrain sample` arguments: the one source of the plan and the command."""

    classes: tuple[str, ...]
    prompts: tuple[str, ...]
    n: int
    settings: SampleConfig
    size: str | None = None  # a bucketed run's bucket, as `--size`


def _number(value, what: str, hint: str = "", whole: bool = False) -> float:
    """A finite number (a whole one with `whole`) the page sent; SampleError naming `what` otherwise."""
    kind = "whole number" if whole else "number"
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise SampleError(f"the {what} must be a {kind}, got {value!r}") from None
    if not math.isfinite(f) or (whole and f != int(f)):
        got = repr(value) if whole else f
        raise SampleError(f"the {what} must be a {'' if whole else 'finite '}{kind}{hint}, got {got}")
    return f


def _int(value, what: str, lo: int, hi: int, why: str = "") -> int:
    if value is None or value == "":
        raise SampleError(f"give the {what}")
    f = int(_number(value, what, whole=True))
    if not lo <= f <= hi:
        raise SampleError(f"the {what} must be in {lo}..{hi}{why}, got {f}")
    return f


def _path_arg(value):
    """A path the user gave, absolute when it exists (the command runs from any folder)."""
    return str(Path(value).resolve()) if value is not None and Path(value).exists() else value


def _fingerprint(ckpt) -> tuple | None:
    """(file, mtime, size) of the weights file `ckpt` reads now (None: cannot tell)."""
    from dittrain.inference.weights import weights_file

    try:
        f = weights_file(ckpt)
        st = f.stat()
        return str(f), st.st_mtime_ns, st.st_size
    except Exception:
        return None


class Server:
    """A run loaded once for sampling, and generate() for each request (see the module docstring).
    settings: the device, precision, batch size, the limits of a request and where the run's
    parts are (ServeConfig; host, port and queue size are serve()'s). text_encoder: an object
    with embed_text(prompts, tokens=) to use instead of the store's (tests); the store's is
    loaded on the first prompt and kept."""

    def __init__(self, ckpt, settings: ServeConfig = _SERVE, *, text_encoder=None, log=print):
        s = settings
        if s.max_images < 1 or s.max_steps < 1 or s.batch_size < 1:
            raise SampleError("--max-images, --max-steps and --batch-size must be at least 1")
        self.ckpt, self.latents, self.vae, self.model_name = ckpt, s.latents, s.vae, s.model
        self.text_pretrained, self.log = s.text_pretrained, log
        self._loaded = _fingerprint(ckpt)  # before loading: a change while it loads is seen too
        engine = open_run.TorchEngine(ckpt, latents=s.latents, vae=s.vae, model=s.model)
        self.config, self.store, note = engine.open(s.device)
        if note:
            log(note)
        self.model_cfg, self.diffusion = open_run.model_config(self.config), open_run.diffusion_config(self.config)
        self.kind = open_run.conditioning_kind(self.model_cfg)
        probe = plan_samples(self.config, self.store, SampleConfig(steps=2, precision=s.precision,
                                                                   batch_size=s.batch_size),
                             device=s.device, prompts=("probe",) if self.kind == "text" else (), n=1)
        self.device, self.batch_size = probe.device, s.batch_size
        self.precision = _PRECISION_NAMES.get(None if probe.amp is None else str(probe.amp), s.precision)
        self.name = probe.name
        self.max_images = s.max_images
        ddpm_limit = self.diffusion.num_timesteps if self.diffusion.objective == "ddpm" else s.max_steps + 1
        self.max_steps = min(s.max_steps, ddpm_limit)
        self._steps_limit = " (ddpm: the run's timesteps)" if ddpm_limit <= s.max_steps else " (the server's --max-steps)"
        self.samplers = tuple(SAMPLERS[self.diffusion.objective])
        self.names = open_run.class_names(self.store) if self.kind == "class" else None
        # a bucketed run: the page's size dropdown ("WxH" px), its default first chosen
        self.sizes = [b["name"] for b in run_sizes(self.config)]
        self.default_size = default_size(self.config, self.model_cfg)
        self.model = engine.network(self.device)
        del engine  # and its reference to the state dict
        self.autoencoder = open_run.load_autoencoder(self.store, self.device, s.vae)  # what run_plan would load
        self._text_encoder = text_encoder
        self._lock = threading.Lock()
        if self.kind == "text" and text_encoder is None:
            try:
                self.text_encoder()
            except SampleError as e:
                log(f"note: {e}; prompts fail until it loads")

    # -- what the page offers

    @property
    def num_classes(self) -> int:
        return self.model_cfg.num_classes

    def class_choices(self) -> list[tuple[str, str]]:
        """(label, value) pairs: "index: name" (or the index) -> the index; then random."""
        names = self.names or []
        pairs = [(f"{i}: {names[i]}" if i < len(names) else str(i), str(i)) for i in range(self.num_classes)]
        return pairs + [(f"{RANDOM} (each image's class drawn with the seed)", RANDOM)]

    @property
    def image_size(self) -> tuple[int, int] | None:
        if self.default_size:  # a bucketed run: its default bucket's (W, H)
            w, h = self.default_size.split("x")
            return int(w), int(h)
        res = (self.store.manifest.get("image") or {}).get("resolution") if hasattr(self.store, "manifest") else None
        return (res, res) if res else None

    def what(self) -> str:
        """The objective and the conditioning, in words."""
        return self.diffusion.objective + ", " + {"class": f"class-conditional, {self.num_classes} classes",
                                                  "text": "text-conditioned", "none": "unconditional"}[self.kind]

    def describe(self) -> str:
        return f"{self.name} ({self.what()}) from {Path(self.ckpt).resolve()}, on {self.device}, {self.precision}"

    # -- the text encoder, loaded on the first prompt and kept

    def text_encoder(self):
        if self._text_encoder is None:
            self._text_encoder = open_run.load_text_encoder(self.store, self.device, self.text_pretrained,
                                                   how="restart serve with")
        return self._text_encoder

    # -- one request

    def _call(self, req: Request, seed: int) -> _Call:
        n = _int(req.n, "number of images", 1, self.max_images, " (the server's --max-images)")
        steps = _int(req.steps, "number of steps", 1, self.max_steps, self._steps_limit)
        cfg = _number(req.cfg_scale if req.cfg_scale is not None else _S.cfg_scale, "CFG scale")
        if self.kind != "none" and abs(cfg) > MAX_CFG_SCALE:
            raise SampleError(f"the CFG scale must be in -{MAX_CFG_SCALE:g}..{MAX_CFG_SCALE:g} (1: no guidance), "
                              f"got {cfg:g}")
        sampler = req.sampler or self.diffusion.default_sampler
        if sampler not in self.samplers:
            raise SampleError(f"sampler {sampler!r} does not fit this {self.diffusion.objective} run; "
                              f"choose one of {', '.join(self.samplers)}")
        choice = str(req.choice if req.choice is not None else "").strip()
        classes = prompts = ()
        if self.kind == "class":
            classes = (choice or RANDOM,)
        elif self.kind == "text":
            if not choice:
                raise SampleError("this run is text-conditioned: write a prompt")
            prompts = (choice,)
        try:
            interval = parse_cfg_interval(req.cfg_interval if req.cfg_interval not in (None, "") else _S.cfg_interval)
        except ValueError as e:
            raise SampleError(f"the CFG interval {e}") from None
        shift = None if req.time_shift in (None, "") else req.time_shift
        if shift is not None:
            if self.diffusion.objective != "flow":
                raise SampleError(f"the time shift is for flow runs; this one is {self.diffusion.objective}")
            shift = _number(shift, "time shift", " > 0 (1: none)")
            if not shift > 0:
                raise SampleError(f"the time shift must be a finite number > 0 (1: none), got {shift:g}")
        settings = SampleConfig(cfg_scale=cfg if self.kind != "none" else _S.cfg_scale, steps=steps,
                                sampler=sampler, seed=seed, batch_size=self.batch_size, precision=self.precision,
                                cfg_interval=interval if self.kind != "none" else _S.cfg_interval,
                                time_shift=None if shift == self.diffusion.t_shift else shift)
        size = str(req.size).strip() if req.size and self.sizes else None  # plan_samples refuses an unknown one
        if req.size and not self.sizes:
            raise SampleError(f"size {req.size}: this run samples at its own size only (no aspect-ratio buckets)")
        return _Call(classes, prompts, n, settings, size)

    def command(self, call: _Call) -> str:
        """The `dittrain sample` line whose plan is this call's (see the module docstring)."""
        s = call.settings
        args = ["dittrain", "sample", "--ckpt", str(Path(self.ckpt).resolve())]
        for flag, value in (("--latents", _path_arg(self.latents)), ("--vae", _path_arg(self.vae)),
                            ("--model", self.model_name), ("--text-pretrained", _path_arg(self.text_pretrained))):
            if value is not None:
                args += [flag, str(value)]
        for c in call.classes:
            args += ["--class", c]
        for p in call.prompts:
            args += ["--prompt", p]
        args += ["--n", str(call.n), "--steps", str(s.steps)]
        if call.size is not None:
            args += ["--size", call.size]
        if self.kind != "none":
            args += ["--cfg", repr(s.cfg_scale)]
            if tuple(s.cfg_interval) != CFG_EVERYWHERE:
                args += ["--cfg-interval", format_cfg_interval(s.cfg_interval)]
        if s.time_shift is not None:
            args += ["--time-shift", repr(s.time_shift)]
        args += ["--sampler", s.sampler, "--seed", str(s.seed), "--batch-size", str(s.batch_size),
                 "--device", str(self.device), "--precision", s.precision, "--out", f"samples-seed{s.seed}.png"]
        return shlex.join(args)

    def generate(self, req: Request) -> Generated:
        """Sample one request: (images, command, message, seed); never raises for a bad request."""
        t0 = time.perf_counter()
        seed = req.seed
        try:
            if seed is None:
                seed = secrets.randbelow(2**31)
            seed = _int(seed, "seed", 0, MAX_SEED)
            call = self._call(req, seed)
            plan = plan_samples(self.config, self.store, call.settings, device=self.device, classes=call.classes,
                                prompts=list(call.prompts), n=call.n, size=call.size)
            with self._lock:  # gradio's queue runs one request at a time; direct callers too
                encoder = self.text_encoder() if plan.kind == "text" else None
                images = run_plan(self.model, plan, self.store, autoencoder=self.autoencoder, text_encoder=encoder)
        except NonFiniteSamples as e:  # NaN/inf samples: a message, never black images
            self.log(f"request failed: {e}")
            return Generated([], "", e.describe(after="no images are shown"), seed)
        except UserError as e:  # a bad request, or a text encoder that cannot load
            self.log(f"request refused: {e}")
            return Generated([], "", str(e), seed if isinstance(seed, int) else None)
        except Exception as e:  # a bug or out of memory: this request fails, the server stays up
            if "out of memory" in str(e).lower():
                if self.device.type == "cuda":
                    import torch

                    torch.cuda.empty_cache()
                msg = "out of memory: ask for fewer images, or restart serve with a smaller --batch-size"
            else:
                msg = f"internal error ({type(e).__name__}: {one_line(e, 300)}); see the server's log"
            print(traceback.format_exc(), file=sys.stderr, end="")
            return Generated([], "", msg, seed if isinstance(seed, int) else None)
        took = time.perf_counter() - t0
        drawn = " (drawn at random)" if req.seed is None else ""
        message = f"{len(images)} image{'s' * (len(images) > 1)} in {took:.1f} s, seed {seed}{drawn}"
        if self.kind == "class":
            shown = sorted(set(plan.labels))
            message += "; class " + ", ".join(f"{c}" + (f" ({self.names[c]})" if self.names and c < len(self.names)
                                                        else "") for c in shown[:8])
        if _fingerprint(self.ckpt) != self._loaded:
            message += (f". Note: {self.ckpt} has changed since this server loaded it (training goes on?); the "
                        "command samples the weights there now, restart serve to serve them")
        self.log(f"{plan.describe()}: {took:.1f} s")
        return Generated(images, self.command(call), message, seed, plan.labels)

    def captions(self, out: Generated) -> list[str]:
        """The gallery caption of each image: the command's single (NAME/NNNN.png) and its class."""
        caps = [f"{i:04d}.png" for i in range(len(out.images))]
        if out.labels is not None:
            caps = [f"{c}  class {k}" + (f": {self.names[k]}" if self.names and k < len(self.names) else "")
                    for c, k in zip(caps, out.labels, strict=True)]
        return caps


# -----------------------------------------------------------------------------
# The page


def _gradio():
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # before gradio is imported: no version check, telemetry
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        import gradio as gr
    except ImportError as e:
        raise missing_extra("dittrain serve", "serve", e, SampleError) from e
    return gr


def build_app(server: Server):
    """The page: settings on the left, the gallery, the command and a message on the right."""
    gr = _gradio()
    size = server.image_size
    with gr.Blocks(title=f"dittrain serve: {server.name}", analytics_enabled=False,
                   delete_cache=(3600, 3600)) as demo:
        gr.Markdown(f"### dittrain serve\n**{server.name}** ({server.what()}) `{Path(server.ckpt).resolve()}` "
                    f"on {server.device}, {server.precision}" + (f"; {size[0]}x{size[1]} px" if size else ""))
        with gr.Row():
            with gr.Column(scale=1, min_width=300):
                if server.kind == "class":
                    choices = server.class_choices()
                    cond = gr.Dropdown(choices, value=choices[0][1], label="class", elem_id="class")
                elif server.kind == "text":
                    cond = gr.Textbox(label="prompt", lines=2, elem_id="prompt",
                                      placeholder="embedded with the store's text encoder")
                else:
                    cond = gr.State("")
                if server.sizes:  # a bucketed run: one of its buckets' sizes
                    size_choice = gr.Dropdown(server.sizes, value=server.default_size, label="size (W x H px)",
                                              elem_id="size")
                else:
                    size_choice = gr.State(None)
                n = gr.Slider(1, server.max_images, value=min(4, server.max_images), step=1, label="images",
                              elem_id="n")
                steps = gr.Number(value=min(_S.steps, server.max_steps), precision=0, elem_id="steps",
                                  label=f"steps (1..{server.max_steps})")
                cfg = gr.Number(value=_S.cfg_scale, label="CFG scale (1: no guidance)", elem_id="cfg",
                                visible=server.kind != "none")
                interval = gr.Textbox(value=format_cfg_interval(_S.cfg_interval), elem_id="cfg-interval",
                                      label="guided where LO <= t <= HI (LO,HI; t: 0 data .. 1 noise)",
                                      visible=server.kind != "none")
                sampler = gr.Dropdown(list(server.samplers), value=server.diffusion.default_sampler,
                                      label="sampler", elem_id="sampler")
                flow = server.diffusion.objective == "flow"
                shift = gr.Number(value=server.diffusion.t_shift if flow else None, elem_id="time-shift",
                                  label="time shift S of the grid (1: none; the run's by default)", visible=flow)
                with gr.Row():
                    seed = gr.Number(value=_S.seed, precision=0, label="seed", elem_id="seed")
                    random_seed = gr.Checkbox(False, label="random seed (drawn, then shown)", elem_id="random-seed")
                go = gr.Button("Generate", variant="primary", elem_id="generate")
            with gr.Column(scale=2):
                gallery = gr.Gallery(format="png", columns=4, object_fit="contain", label="samples (PNG)",
                                     elem_id="gallery", buttons=["download", "fullscreen"], interactive=False)
                command = gr.Textbox(label="the same images from the command line", interactive=False,
                                     lines=2, elem_id="command", buttons=["copy"])
                message = gr.Markdown(elem_id="message")

        def on_generate(choice, n_, steps_, cfg_, sampler_, seed_, random_, size_, interval_, shift_):
            out = server.generate(Request(choice=choice, n=n_, steps=steps_, cfg_scale=cfg_, sampler=sampler_,
                                          seed=None if random_ else seed_, size=size_, cfg_interval=interval_,
                                          time_shift=shift_ if server.diffusion.objective == "flow" else None))
            if not out.ok:
                raise gr.Error(out.message, print_exception=False)
            items = list(zip(list(out.images), server.captions(out), strict=True))
            return items, out.command, out.message, out.seed

        inputs = [cond, n, steps, cfg, sampler, seed, random_seed, size_choice, interval, shift]
        go.click(on_generate, inputs, [gallery, command, message, seed])
        if server.kind == "text":
            cond.submit(on_generate, inputs, [gallery, command, message, seed])
    return demo


def serve(ckpt, settings: ServeConfig = _SERVE, *, log=print) -> None:
    """The command: check the port, load the run, launch the page, serve until Ctrl-C / SIGTERM."""
    host, port = settings.host, settings.port
    try:  # a port that cannot be bound fails in one line before the model loads
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        why = "in use" if e.errno in (98, 48, 10048) else one_line(e)
        raise SampleError(f"cannot listen on {host}:{port}: {why} (pass --port N, or --host)") from None
    _gradio()  # missing gradio: one line before the model loads
    server = Server(ckpt, settings, log=log)
    demo = build_app(server)
    demo.queue(max_size=settings.queue_size, default_concurrency_limit=1)
    try:
        demo.launch(server_name=host, server_port=port, share=False, inbrowser=False, prevent_thread_lock=True,
                    quiet=True, show_error=False, ssr_mode=False, mcp_server=False, pwa=False,
                    enable_monitoring=False, footer_links=["api", "settings"], css=APP_CSS)
    except OSError as e:
        raise SampleError(f"cannot listen on {host}:{port}: {one_line(e, 200)}") from e
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/"
    stopping: list[int] = []  # the stop signals received (see _catch_stop_signals)
    previous = _catch_stop_signals(stopping) if threading.current_thread() is threading.main_thread() else {}
    log(f"serving {server.describe()}")  # after the handlers: a signal once this line is out stops the server
    log(f"open {url}  (Ctrl-C stops)")
    try:
        while not stopping:
            time.sleep(0.2)
    finally:
        demo.close()  # joins uvicorn's thread for at most 5 s; the others are daemon threads
        for sig, handler in previous.items():
            if handler is not None:  # None: a handler not set from Python, which cannot be put back
                signal.signal(sig, handler)
    log("stopped")


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _catch_stop_signals(stopping: list) -> dict:
    """Make SIGINT (Ctrl-C) and SIGTERM append their number to `stopping`, whatever they did
    before; the handlers they had (to put back). Why not Python's KeyboardInterrupt: a process
    that starts with SIGINT ignored (a background job `cmd &` of a non-interactive shell, and
    every child of one, such as this server under a test run started that way) never gets a
    KeyboardInterrupt handler, so Ctrl-C did nothing and the server never stopped (the test's
    server hung in its wait loop, SIGINT in /proc/PID/status SigIgn). Why a list, not a
    threading.Event: the handler runs in the main thread between two bytecodes, possibly inside
    Event.wait() while it holds the Event's lock, and Event.set() would then wait for it forever.
    The first signal puts back the default actions: a second Ctrl-C while gradio closes (it may
    take seconds) ends the process at once, without the "stopped" line."""

    def handle(signum, frame):
        for sig in _STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        stopping.append(signum)

    return {sig: signal.signal(sig, handle) for sig in _STOP_SIGNALS}


__all__ = ["Generated", "Request", "Server", "build_app", "serve"]
