"""The DiT forward as an ONNX file, checked against PyTorch, and sampled through onnxruntime.

    export_onnx(model, config, "dit.onnx", record)     `dittrain export --format onnx`
    net = OnnxDiT("dit.onnx")                           a DiT-shaped callable over onnxruntime
    dittrain sample --engine onnx --onnx dit.onnx --out grid.png

The file holds one graph, out = DiT(inputs), for the model's own inputs (names and order):

    class-conditional   x (N, C, H, W) float32, t (N,) float32, y (N,) int64 (num_classes = null)
    text-conditioned    x, t, then text_pooled (N, Dp) float32 and/or text_tokens (N, L, Dt)
                        float32 + text_mask (N, L) bool (True = a real token)
    unconditional       x, t
    output              out (N, C or 2C, H, W) float32: eps (or velocity), then the learned variance

N is a dynamic axis ("batch", 1..max_batch; classifier-free guidance doubles it), and so is
L ("tokens"); C, H, W are the run's. Exported with torch.onnx.export(dynamo=True) (SDPA
becomes MatMul/Softmax), one self-contained file (initializers inside) unless the weights
pass 2 GB, protobuf's limit: then FILE.onnx + FILE.onnx.data, which must stay together.
Its metadata_props carry the run config ("dittrain_config", the JSON of config.json) and
what made it ("dittrain_export": source, input names, the check's tolerance and diffs), so
`--engine onnx` needs no run directory; --ckpt RUN gives the config of a file without them.

The check: onnxruntime (CPU) against the PyTorch fp32 model on random inputs of batch 2 and
3 (which proves the batch axis is dynamic); the largest absolute difference must be at most
tolerance x max(1, max |PyTorch output|) (default 1e-4: outputs are eps of unit scale). A
file that fails is not published.

Sampling: OnnxDiT has the DiT's call signature, its `.config` and unconditional_kwargs, so
sample.run_plan draws with it unchanged: classifier-free guidance and the sampler loop stay
in PyTorch, every network call goes through onnxruntime (CUDAExecutionProvider when the
device is cuda and onnxruntime-gpu is installed, else the CPU).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

from ditdata.common.errors import one_line
from ditdata.common.extras import missing_extra
from ditdata.common.files import fsync_dir, publish, tmp_name
from dittrain.config import OnnxConfig
from dittrain.inference.open_run import (
    ExportError,
    SampleError,
    load_for_sampling,
    model_config,
    run_store,
    sampling_device,
)
from dittrain.model.dit import DiT
from dittrain.model.sizes import DiTConfig

CONFIG_KEY, EXPORT_KEY = "dittrain_config", "dittrain_export"  # metadata_props
OUTPUT = "out"
_O = OnnxConfig()  # --tolerance, --max-batch and --opset of `dittrain export --format onnx`
TOLERANCE = _O.tolerance  # x max(1, max |PyTorch output|)
MAX_BATCH = _O.max_batch
EXAMPLE_TOKENS = 7  # the text length traced with (any L works: the axis is dynamic)
EXTERNAL_DATA_BYTES = 1_800_000_000  # above this the initializers go to FILE.onnx.data (protobuf: 2 GB)
_NUMPY = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(bool)": np.bool_}


def input_names(cfg: DiTConfig) -> list[str]:
    """The ONNX inputs of a model of config `cfg`, in order (module docstring)."""
    names = ["x", "t"]
    if cfg.num_classes:
        names.append("y")
    if cfg.text_pooled_dim:
        names.append("text_pooled")
    if cfg.text_token_dim:
        names += ["text_tokens", "text_mask"]
    return names


def random_inputs(cfg: DiTConfig, n: int, generator: torch.Generator, tokens: int = EXAMPLE_TOKENS) -> dict:
    """Inputs of batch n for every input the model takes: latents ~ N(0, 1), timesteps in
    [0, 1000), labels including the null class, text with a partly masked (and, in row 1,
    an empty) caption."""
    g = generator
    out = {"x": torch.randn(n, cfg.in_channels, cfg.input_size, cfg.input_size, generator=g),
           "t": torch.rand(n, generator=g) * 1000}
    if cfg.num_classes:
        out["y"] = torch.randint(0, cfg.num_classes + 1, (n,), generator=g)
    if cfg.text_pooled_dim:
        out["text_pooled"] = torch.randn(n, cfg.text_pooled_dim, generator=g)
    if cfg.text_token_dim:
        out["text_tokens"] = torch.randn(n, tokens, cfg.text_token_dim, generator=g)
        mask = torch.rand(n, tokens, generator=g) < 0.7
        mask[:, 0] = True
        if n > 1:
            mask[1] = False  # no real token: the cross-attention contributes nothing
        out["text_mask"] = mask
    return out


# -----------------------------------------------------------------------------
# Export and check


def _trace(model: DiT, names: list[str], max_batch: int, opset: int | None):
    """The ONNXProgram of model's forward with a dynamic batch (and text length)."""
    ex = random_inputs(model.config, 2, torch.Generator().manual_seed(0))
    kw = {} if opset is None else {"opset_version": opset}
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    shapes = {k: {0: batch} for k in names}
    if "text_tokens" in names:
        tokens = torch.export.Dim("tokens", min=1, max=4096)
        shapes["text_tokens"][1] = shapes["text_mask"][1] = tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on axis names and deprecations
        try:
            return torch.onnx.export(model, (ex["x"], ex["t"]), kwargs={k: ex[k] for k in names[2:]}, dynamo=True,
                                     input_names=names, output_names=[OUTPUT],
                                     dynamic_shapes=shapes, verbose=False, **kw)
        except Exception as e:
            raise ExportError(f"torch.onnx.export failed ({type(e).__name__}: {one_line(e, 300)})") from e


def _session(path: Path, device: torch.device | None = None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only
    options.intra_op_num_threads = torch.get_num_threads()  # follow torch's (OMP_NUM_THREADS, tests)
    providers = ["CPUExecutionProvider"]
    if device is not None and device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    return ort.InferenceSession(str(path), options, providers=providers)


def check_onnx(path: Path, model: DiT, tolerance: float = TOLERANCE, batches=(2, 3)) -> dict[int, float]:
    """{batch: max |onnxruntime - PyTorch|} on random inputs; ExportError beyond the tolerance."""
    session = _session(path)
    diffs = {}
    g = torch.Generator().manual_seed(1)
    for n in batches:
        inputs = random_inputs(model.config, n, g, tokens=EXAMPLE_TOKENS + n)  # another length too
        with torch.no_grad():
            ref = model(**inputs).numpy()
        got = session.run([OUTPUT], {k: v.numpy() for k, v in inputs.items()})[0]
        if got.shape != ref.shape:
            raise ExportError(f"onnx check failed: onnxruntime gave {got.shape} for batch {n}, PyTorch {ref.shape}")
        diffs[n] = float(np.abs(got.astype(np.float64) - ref).max())
        bound = tolerance * max(1.0, float(np.abs(ref).max()))
        if not diffs[n] <= bound:  # NaN fails too
            raise ExportError(f"onnx check failed: onnxruntime differs from PyTorch by {diffs[n]:.2e} at batch {n} "
                              f"(tolerance {bound:.1e}); nothing written")
    return diffs


def trtexec_command(path, cfg: DiTConfig, *, tokens: int | None = None, opt: int = 64, largest: int = 128) -> str:
    """The TensorRT command that builds an fp16 engine from the file, with min/opt/max shapes
    for its inputs (opt 64 = the default --batch-size 32 doubled by guidance)."""
    L = tokens or 77

    def dims(n: int) -> str:
        shape = {"x": (n, cfg.in_channels, cfg.input_size, cfg.input_size), "t": (n,), "y": (n,),
                 "text_pooled": (n, cfg.text_pooled_dim), "text_tokens": (n, L, cfg.text_token_dim),
                 "text_mask": (n, L)}
        return ",".join(f"{k}:{'x'.join(map(str, shape[k]))}" for k in input_names(cfg))

    path = Path(path)
    return (f"trtexec --onnx={path} --minShapes={dims(1)} --optShapes={dims(opt)} --maxShapes={dims(largest)} "
            f"--fp16 --saveEngine={path.with_suffix('.plan')}")


def export_onnx(model: DiT, config: dict, out, record: dict, settings: OnnxConfig = _O, *,
                tokens: int | None = None, log=print) -> list[Path]:
    """Write `model` (a float32 DiT in eval mode) as out (.onnx), check it with onnxruntime,
    then publish it; returns the files written (FILE.onnx, and FILE.onnx.data past 2 GB).
    settings: the check's tolerance, the dynamic batch's upper bound and the opset
    (OnnxConfig). tokens: the text length of the run's store, for the trtexec shapes."""
    tolerance, max_batch, opset = settings.tolerance, settings.max_batch, settings.opset
    out = Path(out)
    cfg = model.config
    names = input_names(cfg)
    big = sum(p.numel() * p.element_size() for p in model.state_dict().values()) > EXTERNAL_DATA_BYTES
    log(f"exporting the forward ({', '.join(names)} -> {OUTPUT}; dynamic batch 1..{max_batch}"
        f"{', dynamic text length' if cfg.text_token_dim else ''}) with torch.onnx.export (dynamo)")
    program = _trace(model, names, max_batch, opset)
    tmp = tmp_name(out)  # a private folder: an external data file is named after its model
    tmp.mkdir(parents=True)
    try:
        staged = tmp / out.name
        program.model.metadata_props[CONFIG_KEY] = json.dumps(config)
        program.model.metadata_props[EXPORT_KEY] = json.dumps(
            {**record, "inputs": names, "output": OUTPUT, "tolerance": tolerance})
        program.save(str(staged), external_data=big)
        diffs = check_onnx(staged, model, tolerance)
        log(f"check: onnxruntime (CPU) vs PyTorch fp32 on random inputs: max abs diff "
            f"{diffs[2]:.1e} at batch 2, {diffs[3]:.1e} at batch 3 (tolerance {tolerance:.0e} x max(1, max |output|))")
        files = sorted(tmp.iterdir(), key=lambda p: p.suffix == ".onnx")  # the data file first
        for f in files:
            publish(f, out.parent / f.name)
        stale = out.parent / f"{out.name}.data"
        if not big and stale.is_file():  # an earlier export's weights; this file is self-contained
            stale.unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(out.parent)
    written = [out.parent / f.name for f in files]
    if big:
        log(f"note: the weights pass 2 GB (protobuf's limit): they are in {out.name}.data, which must stay beside "
            f"{out.name}")
    log(f"TensorRT (on the GPU machine): {trtexec_command(out, cfg, tokens=tokens)}")
    if cfg.text_token_dim and not tokens:
        log("note: 77 text tokens assumed in the trtexec shapes (the run's store was not readable): use its length")
    return written


# -----------------------------------------------------------------------------
# Sampling through onnxruntime


def read_config(session) -> dict | None:
    meta = session.get_modelmeta().custom_metadata_map
    return json.loads(meta[CONFIG_KEY]) if CONFIG_KEY in meta else None


class OnnxDiT(torch.nn.Module):
    """A DiT-shaped callable over an onnxruntime session of an exported file: the DiT's call
    signature, `.config` (the DiTConfig) and unconditional_kwargs, so sample.run_plan and
    Diffusion.sample use it as they use the DiT. It has no parameters; its outputs come back
    on the device of x. `config`: the run config, when the file carries none."""

    unconditional_kwargs = DiT.unconditional_kwargs

    def __init__(self, path, config: dict | None = None, device: torch.device | str = "cpu"):
        super().__init__()
        try:
            import onnxruntime
        except ImportError as e:
            raise missing_extra("--engine onnx", "export", e, SampleError) from e
        self.path = Path(path)
        try:
            self.session = _session(self.path, torch.device(device))
        except Exception as e:
            raise SampleError(f"{path}: not an ONNX file onnxruntime can run ({type(e).__name__}: "
                              f"{one_line(e, 200)})") from e
        self.run_config = read_config(self.session) or config
        if self.run_config is None:
            raise SampleError(f"{path} carries no dittrain run config (metadata {CONFIG_KEY}); pass --ckpt RUN, the "
                              "run it was exported from")
        self.config = model_config(self.run_config)
        self.inputs = {i.name: _NUMPY.get(i.type) for i in self.session.get_inputs()}
        want = input_names(self.config)
        if list(self.inputs) != want:
            raise SampleError(f"{path} takes {', '.join(self.inputs)}, but a model of this run config takes "
                              f"{', '.join(want)}: not an export of it")
        self.provider = self.session.get_providers()[0]
        self.version = onnxruntime.__version__

    def forward(self, x, t, y=None, text_pooled=None, text_tokens=None, text_mask=None, force_drop_ids=None):
        given = {"x": x, "t": t, "y": y, "text_pooled": text_pooled, "text_tokens": text_tokens,
                 "text_mask": text_mask}
        if force_drop_ids is not None:
            raise ValueError("force_drop_ids is a training input; the exported forward has none")
        feed = {}
        for name, dtype in self.inputs.items():
            if given[name] is None:
                raise ValueError(f"this model takes {name}")
            feed[name] = np.ascontiguousarray(given[name].detach().cpu().numpy().astype(dtype, copy=False))
        out = self.session.run([OUTPUT], feed)[0]
        return torch.from_numpy(out).to(x.device)

    def extra_repr(self) -> str:
        return f"{self.path}, {self.provider}"


def load_for_onnx_sampling(path, ckpt=None, *, latents=None, vae: str | None = None, model: str | None = None,
                           device="auto") -> tuple[OnnxDiT, dict, object, str | None]:
    """(network, run config, store, note) for `dittrain sample --engine onnx --onnx FILE`: the
    run config from the file's metadata, or from --ckpt (a run, an export or a plain state dict,
    as load_for_sampling reads it: then the file must be its model); the store is the run's
    (or --latents, or a stand-in with --vae, as for plain weights). A UserError on any problem."""
    dev = sampling_device(device)
    if ckpt is not None:
        _, config, store, note = load_for_sampling(ckpt, latents=latents, vae=vae, model=model)
        net = OnnxDiT(path, config, dev)
        run_model = model_config(config)
        ignore = {"grad_checkpointing", "class_dropout_prob"}  # training-only knobs
        if not all(getattr(net.config, k) == getattr(run_model, k) for k in net.config.__dataclass_fields__
                   if k not in ignore):
            raise SampleError(f"--onnx {path} is not a model of --ckpt {ckpt}: their model configs differ")
        return net, config, store, note
    net = OnnxDiT(path, None, dev)
    return (net, net.run_config, *run_store(net.run_config, latents, vae, path))


class OnnxEngine:
    """`dittrain sample --engine onnx --onnx FILE`: every network call through onnxruntime
    (load_for_onnx_sampling), guidance and the sampler loop in PyTorch; the engine interface
    of dittrain.inference.open_run (open, network, describe, record)."""

    def __init__(self, path, ckpt=None, *, latents=None, vae: str | None = None, model: str | None = None):
        self.path, self.ckpt, self.latents, self.vae, self.model = path, ckpt, latents, vae, model
        self.net = None

    def open(self, device="auto") -> tuple[dict, object, str | None]:
        self.net, config, store, note = load_for_onnx_sampling(self.path, self.ckpt, latents=self.latents,
                                                               vae=self.vae, model=self.model, device=device)
        return config, store, note

    def network(self, device) -> OnnxDiT:
        return self.net  # made for the device open() was given, which is the plan's

    def describe(self) -> str:
        return f"engine: onnxruntime {self.net.version} ({self.net.provider}) on {self.path}"

    def record(self) -> dict:
        return {"engine": "onnx", "onnx": str(Path(self.path).resolve())}


__all__ = [
    "OnnxDiT", "OnnxEngine", "TOLERANCE", "check_onnx", "export_onnx", "input_names", "load_for_onnx_sampling", "random_inputs",
    "read_config", "trtexec_command",
]
