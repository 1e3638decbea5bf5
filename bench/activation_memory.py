"""Activation memory and recompute cost of each --grad-checkpointing mode (issue 17).

    python bench/activation_memory.py [--model DiT-S/2] [--input-size 32] [--batch-size 16]
                                      [--modes none,every,2,selective,selective-fc1,attn,mlp]
                                      [--reps 3] [--device cpu|cuda] [--threads N]

For each mode: the bytes the forward keeps for the backward pass (activations only, the
parameters left out), the median time of forward + backward over --reps steps, and that
time against "none". "selective-fc1" is the variant of "selective" that also recomputes the
MLP's fc1 (DiTBlock.selective_recompute_width = the MLP width); it is not a knob value.
"2" (checkpoint every 2nd block) is the whole-block mode with about selective's memory.

What is counted as kept: every tensor autograd saves (torch.autograd.graph.saved_tensors_hooks,
distinct storages), the tensors selective checkpointing caches (the model passes
respect_saved_tensors_hooks=True, so they reach the same hook), and the inputs of every
checkpointed region (a non-reentrant checkpoint keeps its inputs and nothing else; they are
found by wrapping dittrain.model.dit.checkpoint). fp32 on the CPU; --device cuda runs under bf16
autocast and also reports torch.cuda.max_memory_allocated over a step (the peak includes the
weights, their gradients and the recomputation of one block during backward).
CPU step times say little about GPU recompute cost (element-wise ops are cheap in FLOPs but
memory-bound on a GPU); the kept bytes are the same on any device for the same dtype.

`dittrain plan`'s memory model (issue 27, dittrain.plan.footprint) reads what this bench measures:

    python bench/activation_memory.py --table --write dittrain/plan/activation_table.json [--threads 1]
        the kept bytes of the trainer's forward for every block kind (mlp x norm x pos x QK-norm: each
        combination of the parts registered in dittrain.model.parts),
        fp32 and bf16 (CPU autocast), fused and math attention, modes none/every/selective/attn/
        mlp, on small shapes at 2 and 4 samples and depth 1 and 2, fitted exactly as coefficients
        of T*D, T*H, T*heads, T, D, T*T*heads per sample (and of the linear parameters per step);
        the embedders, the final layer with the loss, and REPA likewise (a few minutes on a CPU)
    python bench/activation_memory.py --check "MODEL:BATCH:MODE[:PRECISION];..." [--device cuda]
        predicted against measured: the peak of two steps of the trainer's step (CPU: the
        allocator's record, dittrain.plan.probe.cpu_peak_bytes; CUDA: torch.cuda.max_memory_allocated)
        and the kept bytes (on CUDA under its own autocast: the check of the CPU-measured bf16 rows)
    python bench/activation_memory.py --records
        the H200 records of bench/gpu_train.py (dittrain.plan.throughput) against the predicted peaks
        and speeds
"""

from __future__ import annotations

import contextlib
import itertools
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from scratch import add_device_args, open_device, parser, sync  # bench/scratch.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import dittrain.model.dit as model_mod  # noqa: E402
from ditdata.common import devices  # noqa: E402
from dittrain.config import TrainConfig  # noqa: E402
from dittrain.diffusion import Diffusion, DiffusionConfig  # noqa: E402
from dittrain.model.attention import attention_backend, attention_kernel  # noqa: E402
from dittrain.model.dit import DiT, build_model  # noqa: E402
from dittrain.model.parts import MLPS, NORMS, POSITIONS  # noqa: E402
from dittrain.model.sizes import DiTConfig, get_config  # noqa: E402
from dittrain.plan.footprint import (  # noqa: E402
    FP32,
    HALF,
    Setting,
    block_kind,
    block_sample,
    footprint,
    kept_bytes,
    model_parts,
    outside_fixed,
    outside_sample,
)
from dittrain.plan.footprint import MODES as TABLE_MODES  # noqa: E402
from dittrain.plan.probe import measured_peak  # noqa: E402
from dittrain.train.repa import Alignment, build_projector, projector_parts  # noqa: E402

MODES = ("none", "every", "2", "selective", "selective-fc1", "attn", "mlp")


class KeptCounter:
    """Bytes of the distinct storages kept for backward by one forward (parameters excluded)."""

    def __init__(self, model: torch.nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.kept: dict[int, int] = {}

    def add(self, t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            if s.data_ptr() not in self.params:
                self.kept[s.data_ptr()] = s.nbytes()
            # packed detached: the same storage kept (so no pointer is reused while counting), but no
            # grad_fn; a node's own output packed as itself is a cycle through the C++ graph that is never
            # freed, over 1 GB per block kind of --table
            return t.detach()
        return t

    @contextlib.contextmanager
    def counting(self):
        real = model_mod.checkpoint

        def recording(fn, *args, **kwargs):  # a checkpoint keeps its tensor inputs
            for a in args:
                self.add(a)
            return real(fn, *args, **kwargs)

        model_mod.checkpoint = recording
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.add, lambda t: t):
                yield self
        finally:
            model_mod.checkpoint = real

    @property
    def total(self) -> int:
        return sum(self.kept.values())


def make(args, mode: str, device: torch.device) -> torch.nn.Module:
    knob = "selective" if mode == "selective-fc1" else int(mode) if mode.isdigit() else mode
    torch.manual_seed(0)
    model = build_model(args.model, input_size=args.input_size, in_channels=4, num_classes=1000,
                        grad_checkpointing=knob).to(device).train()
    if mode == "selective-fc1":
        for block in model.blocks:
            block.selective_recompute_width = block.mlp.fc1.out_features
    return model


def batch(args, device):
    g = torch.Generator().manual_seed(1)
    n = args.batch_size
    return dict(x=torch.randn(n, 4, args.input_size, args.input_size, generator=g).to(device),
                t=torch.randint(0, 1000, (n,), generator=g).float().to(device),
                y=torch.randint(0, 1000, (n,), generator=g).to(device))


def autocast(device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def measure(args, mode: str, device: torch.device) -> dict:
    model = make(args, mode, device)
    inputs = batch(args, device)
    counter = KeptCounter(model)
    with counter.counting(), autocast(device):
        loss = model(**inputs).float().pow(2).mean()
    kept = counter.total
    loss.backward()
    del loss

    times, peak = [], None
    for i in range(args.reps + 1):  # the first step warms up (allocator, kernels)
        model.zero_grad(set_to_none=False)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        t0 = time.perf_counter()
        with autocast(device):
            loss = model(**inputs).float().pow(2).mean()
        loss.backward()
        sync(device)
        if i:
            times.append(time.perf_counter() - t0)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
        del loss
    del model
    return dict(mode=mode, kept=kept, step_s=statistics.median(times), peak=peak)

# ----------------------------------------------------------------------------- --table, --check (issue 27)

# Small shapes, varied so that every feature of dittrain.plan.footprint is pinned down (each fit is
# exact on them: its largest residual is printed): (hidden, heads, mlp_ratio, latent side, patch, channels)
SHAPES = ((64, 2, 4, 8, 2, 4), (128, 2, 4, 8, 2, 4), (64, 4, 4, 8, 2, 4), (64, 2, 2, 8, 2, 4), (64, 2, 4, 16, 2, 4),
          (96, 3, 4, 12, 2, 4), (128, 4, 2, 16, 2, 4), (64, 2, 3, 8, 2, 4), (32, 2, 4, 8, 2, 4), (64, 2, 4, 8, 1, 4),
          (64, 2, 4, 8, 2, 8), (64, 2, 4, 8, 4, 4))
# every combination of the registered block parts (dittrain.model.parts), with and without QK-norm
KINDS = tuple(dict(mlp=m, norm=n, pos=p, qk_norm=q) for m in MLPS for n in NORMS for p in POSITIONS for q in (False, True))
LOSSES = {"ddpm-sigma": ("ddpm", True), "ddpm": ("ddpm", False), "flow": ("flow", False)}
DTYPES = {FP32: None, HALF: torch.bfloat16}
KERNELS = {"fused": None, "math": "math"}  # fused: the kernel torch picks (on the CPU its flash kernel)
# (hidden, projector width, target dims) of the REPA rows
REPA_SHAPES = ((64, 96, 40), (128, 64, 24), (64, 32, 64), (96, 48, 48), (64, 64, 64), (64, 64, 32))


def shape_config(shape, kind: dict, depth: int = 1, learn_sigma: bool = True) -> DiTConfig:
    D, heads, ratio, side, p, C = shape
    return DiTConfig(input_size=side, in_channels=C, patch_size=p, hidden_size=D, depth=depth, num_heads=heads,
                     mlp_ratio=ratio, num_classes=10, learn_sigma=learn_sigma, **kind)


def kept_step(model: DiT, n: int, dtype, objective: str = "ddpm", kernel: str | None = None,
              repa: tuple[int, int] | None = None, split_at_final: bool = False):
    """Bytes the trainer's forward keeps for the backward (KeptCounter): the diffusion loss of
    dittrain.train.step.TrainStep on n samples with label dropout, under CPU autocast for bf16; repa
    (width, dims): with REPA's projector and targets aligned after block 1. split_at_final:
    (all of it, what was kept when the final layer started). On the model's device (CUDA: its
    autocast, which --check compares with the CPU's rows)."""
    config, device = model.config, next(model.parameters()).device
    diffusion = Diffusion(DiffusionConfig(objective=objective, learn_sigma=config.learn_sigma))
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(n, config.in_channels, config.input_size, config.input_size, generator=g).to(device)
    t = diffusion.sample_timesteps(n, generator=g).to(device)
    kwargs = {"y": torch.randint(0, config.num_classes, (n,), generator=g).to(device),
              "force_drop_ids": (torch.rand(n, generator=g) < 0.1).to(device)}
    owners, fn, align = torch.nn.ModuleList([model]), model, None
    if repa is not None:
        projector = build_projector(config.hidden_size, repa[0], repa[1], 0)
        owners.append(projector)
        side = config.input_size // config.patch_size
        align = Alignment(projector, projector, depth=1, weight=0.5, grid=(side, side), target_grid=(side, side))
        feat, fn = torch.randn(n, side * side, repa[1], generator=g), align.capture(model)
    counter, before = KeptCounter(owners), []
    hook = model.final_layer.register_forward_pre_hook(lambda *_: before.append(counter.total))
    try:
        with (counter.counting(), attention_kernel(kernel) if kernel else contextlib.nullcontext(),
              devices.autocast(device, dtype)):
            noise = torch.randn(x0.shape, generator=g).to(device)
            loss = diffusion.training_loss(fn, x0, kwargs, t=t, noise=noise).mean()
            if align is not None:
                loss = loss + align.loss(fn.hidden, feat)[0]
    finally:
        hook.remove()
    return (counter.total, before[0]) if split_at_final else counter.total


def fit(rows: list) -> tuple[tuple[float, ...], float]:
    """(coefficients, largest residual in bytes): least squares of the values on the features,
    rounded to 1/1024 byte."""
    X = np.array([f for f, _ in rows], dtype=float)
    y = np.array([v for _, v in rows], dtype=float)
    coef = np.round(np.linalg.lstsq(X, y, rcond=None)[0] * 1024) / 1024
    return tuple(float(c) for c in coef), float(np.abs(X @ coef - y).max())


def split(kept: dict) -> tuple[float, float]:
    """(per sample, per step) of bytes measured at 2 and 4 samples."""
    sample = (kept[4] - kept[2]) / 2
    return sample, kept[2] - 2 * sample


def models_of(shape, kind: dict, learn_sigma: bool = True) -> dict:
    """The shape at depth 1 and 2 (their difference is one block; depth 1 less it is the rest)."""
    torch.manual_seed(0)
    return {d: DiT(shape_config(shape, kind, d, learn_sigma)).train() for d in (1, 2)}


def kept_by_depth(models: dict, mode: str, dtype: str, kernel: str = "fused", objective: str = "ddpm") -> dict:
    """{(n, depth): (kept bytes, kept when the final layer started)}."""
    for model in models.values():
        model.set_grad_checkpointing(mode)
    return {(n, d): kept_step(m, n, DTYPES[dtype], objective, KERNELS[kernel], split_at_final=True)
            for n in (2, 4) for d, m in models.items()}


def outside_fit(cfg: DiTConfig, k: dict) -> dict:
    """{part: rows (features, bytes)} of what lies outside the blocks, from kept_by_depth's bytes:
    head (the embedders, before the blocks) and tail (the final layer and the loss)."""
    fixed_features = outside_fixed(cfg)
    rows = {}
    for part, of in (("head", lambda n: 2 * k[n, 1][1] - k[n, 2][1]), ("tail", lambda n: k[n, 1][0] - k[n, 1][1])):
        sample, fixed = split({n: of(n) for n in (2, 4)})
        rows[part] = ((outside_sample(cfg), sample), (fixed_features, fixed))
    return rows


def kind_rows(kind: dict, residuals: list) -> tuple[dict, dict]:
    """One block kind's rows: BLOCK {"kind/dtype/kernel": {mode: BLOCK_SAMPLE + BLOCK_FIXED
    coefficients}} and OUTSIDE {"kind/dtype/loss": OUTSIDE_SAMPLE + OUTSIDE_FIXED coefficients}."""
    key = block_kind(DiTConfig(**kind))
    data: dict = {}
    for shape in SHAPES:
        cfg = shape_config(shape, kind)
        models = models_of(shape, kind)
        for dtype, kernel, mode in itertools.product(DTYPES, KERNELS, TABLE_MODES):
            k = kept_by_depth(models, mode, dtype, kernel)
            sample, fixed = split({n: k[n, 2][0] - k[n, 1][0] for n in (2, 4)})
            rows = data.setdefault((f"{key}/{dtype}/{kernel}", mode), ([], []))
            rows[0].append((block_sample(cfg, cfg.num_tokens), sample))
            rows[1].append((model_parts(cfg).block_linear, fixed))
            if kernel == "fused" and mode == "none":
                add_outside(data, f"{key}/{dtype}/ddpm-sigma", outside_fit(cfg, k))
        for loss, (objective, sigma) in LOSSES.items():
            if loss != "ddpm-sigma":
                models = models_of(shape, kind, sigma)
                for dtype in DTYPES:
                    add_outside(data, f"{key}/{dtype}/{loss}",
                                outside_fit(models[1].config, kept_by_depth(models, "none", dtype, objective=objective)))
    block, outside = {}, {}
    for (name, mode), (sample_rows, fixed_rows) in data.items():
        (cs, rs), (cf, rf) = fit(sample_rows), fit(fixed_rows)
        residuals.append(max(rs, rf))
        if mode in ("head", "tail"):
            outside.setdefault(name, {})[mode] = cs + cf
        else:
            block.setdefault(name, {})[mode] = cs + cf
    return block, outside


def add_outside(data: dict, name: str, rows: dict) -> None:
    for part, (sample_row, fixed_row) in rows.items():
        lists = data.setdefault((name, part), ([], []))
        lists[0].append(sample_row)
        lists[1].append(fixed_row)


def repa_row(dtype: str, residuals: list) -> tuple[float, ...]:
    sample_rows, fixed_rows = [], []
    for hidden, width, dims in REPA_SHAPES:
        for side in (8, 12):
            torch.manual_seed(0)
            model = DiT(shape_config((hidden, 2, 4, side, 2, 4), KINDS[0], 2)).train()
            extra = {n: kept_step(model, n, DTYPES[dtype], repa=(width, dims)) - kept_step(model, n, DTYPES[dtype])
                     for n in (2, 4)}
            sample, fixed = split(extra)
            T = model.config.num_tokens
            sample_rows.append(((T * width, T * dims, T * hidden, T), sample))
            fixed_rows.append(((sum(projector_parts(hidden, width, dims)),), fixed))
    (cs, rs), (cf, rf) = fit(sample_rows), fit(fixed_rows)
    residuals.append(max(rs, rf))
    return cs + cf


def measure_table() -> dict:
    """Every row of dittrain/plan/activation_table.json, measured (a few minutes on a CPU)."""
    residuals: list[float] = []
    t0 = time.perf_counter()
    # LightningDiT's RMSNorm under CPU autocast: "Mismatch dtype ... Cannot dispatch to fused implementation"
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    block, outside = {}, {}
    for kind in KINDS:
        rows = kind_rows(kind, residuals)
        block.update(rows[0])
        outside.update(rows[1])
        print(f"{block_kind(DiTConfig(**kind))}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    repa = {dtype: repa_row(dtype, residuals) for dtype in DTYPES}
    print(f"measured in {time.perf_counter() - t0:.0f} s: {len(block)} block rows, {len(outside)} outside rows; "
          f"largest residual of the fits {max(residuals):.3g} B", file=sys.stderr)
    return {"BLOCK": block, "OUTSIDE": outside, "REPA": repa}


def write_table(tables: dict, path: str | None) -> None:
    """The measured table as dittrain/plan/activation_table.json (dittrain.plan.footprint describes it)."""
    import platform

    source = {"command": "python bench/activation_memory.py --table --write dittrain/plan/activation_table.json",
              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "python": platform.python_version(),
              "device": "cpu (fp32, and bf16 under CPU autocast)"}
    about = ("Activation memory of the DiT's training step, measured: bytes as coefficients of dittrain.plan.footprint's "
             "features (BLOCK_SAMPLE, BLOCK_FIXED, OUTSIDE_SAMPLE, OUTSIDE_FIXED, REPA_FEATURES). Written by "
             f"`{source['command']}`; do not edit by hand.")
    text = _table_json({"about": about, "SOURCE": source, **tables})
    if path is None:
        print(text)
        return
    Path(path).write_text(text)
    print(f"wrote {path}", file=sys.stderr)


def _table_json(data: dict) -> str:
    """JSON with one line per table row (a diff of a re-measured table shows the rows that moved)."""
    def entry(name, value, indent):
        if isinstance(value, dict) and any(isinstance(v, dict) for v in value.values()):
            rows = ",\n".join(f"{indent}  {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items())
            return f"{indent}{json.dumps(name)}: {{\n{rows}\n{indent}}}"
        return f"{indent}{json.dumps(name)}: {json.dumps(value)}"

    return "{\n" + ",\n".join(entry(k, v, " ") for k, v in data.items()) + "\n}\n"


def check(specs: str, input_size: int, device: torch.device) -> None:
    """Predicted (dittrain.plan.footprint) against measured peak and kept bytes of the trainer's step,
    for each MODEL:BATCH:MODE[:PRECISION] (4-channel latents of input_size, 1000 classes, ddpm with
    learned sigma, AdamW): a markdown table."""
    print(f"latents 4x{input_size}x{input_size}, 1000 classes, ddpm + learned sigma, AdamW, on {device}")
    print("\n| model | batch | mode | precision | predicted peak (MiB) | measured peak (MiB) | error | "
          "predicted kept (MiB) | measured kept (MiB) | peak moment |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---|")
    for spec in specs.split(";"):
        model, batch, mode, *rest = spec.split(":") if not spec.startswith("custom:") else _custom(spec)
        precision = rest[0] if rest else ("bf16" if device.type == "cuda" else FP32)
        n = int(batch)
        cfg = TrainConfig.from_flat(model=model, batch_size=n, grad_checkpointing=mode, amp=precision)
        model_cfg = get_config(model, input_size=input_size, in_channels=4, num_classes=1000,
                               grad_checkpointing=int(mode) if mode.isdigit() else mode)
        setting = Setting(model_cfg, micro_batch=n, mode=mode, precision=precision)
        predicted = footprint(setting)
        measured = measured_peak(cfg, model_cfg, device)
        torch.manual_seed(0)
        kept = kept_step(DiT(model_cfg).to(device).train(), n, DTYPES[setting.dtype])
        print(f"| {model} | {n} | {mode} | {precision} | {predicted.peak / 2**20:.1f} | {measured / 2**20:.1f} | "
              f"{100 * (predicted.peak / measured - 1):+.1f}% | {kept_bytes(setting) / 2**20:.1f} | "
              f"{kept / 2**20:.1f} | {predicted.moment} |", flush=True)


def records() -> None:
    """dittrain.plan.throughput.RECORDS (bench/gpu_train.py on an H200) against what dittrain.plan.footprint
    and the speed model predict for them: a markdown table."""
    from ditdata.common.devices import GPUS
    from dittrain.plan.throughput import RECORDS, rate, record_config, step_flops

    print("| model | grad ckpt | batch | measured peak (GiB) | predicted (GiB) | error | peak moment | measured img/s "
          "| predicted img/s | error |")
    print("|---|---|---:|---:|---:|---:|---|---:|---:|---:|")
    for r in RECORDS:
        cfg = record_config(r.model, r.mode)
        fp = footprint(Setting(cfg, micro_batch=r.batch, mode=r.mode, precision=HALF))
        speed = rate(GPUS[r.gpu], cfg, r.batch).flops_per_s / step_flops(cfg, r.mode)
        print(f"| {r.model} | {r.mode} | {r.batch} | {r.peak_gib:.1f} | {fp.peak / 2**30:.1f} | "
              f"{100 * (fp.peak / 2**30 / r.peak_gib - 1):+.1f}% | {fp.moment} | {r.images_per_s:.0f} | {speed:.0f} | "
              f"{100 * (speed / r.images_per_s - 1):+.1f}% |")


def _custom(spec: str) -> list[str]:
    """A custom size holds a colon of its own: custom:hidden=...:BATCH:MODE[:PRECISION]."""
    parts = spec.split(":")
    return [f"{parts[0]}:{parts[1]}", *parts[2:]]


def main():
    ap = parser(__doc__)
    ap.add_argument("--model", default="DiT-S/2")
    ap.add_argument("--input-size", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--table", action="store_true",
                    help="measure dittrain/plan/activation_table.json (every block kind, fp32 and bf16, fused and math "
                         "attention) and write it to --write")
    ap.add_argument("--write", default=None, metavar="PATH", help="--table: the file to write "
                    "(default: print a summary only)")
    ap.add_argument("--records", action="store_true",
                    help="the H200 records of bench/gpu_train.py (dittrain.plan.throughput) against dittrain plan's "
                         "predicted peak memory and speed")
    ap.add_argument("--check", default=None, metavar="SPECS",
                    help="predicted (dittrain.plan.footprint) against measured peak and kept bytes of the trainer's "
                         "step: MODEL:BATCH:MODE[:PRECISION];... (CPU: the allocator's record; CUDA: "
                         "torch.cuda.max_memory_allocated)")
    add_device_args(ap)
    args = ap.parse_args()
    device = open_device(args)
    if args.table:
        return write_table(measure_table(), args.write)
    if args.check:
        return check(args.check, args.input_size, device)
    if args.records:
        return records()
    dtype = "bf16 autocast" if device.type == "cuda" else "fp32"
    print(f"{args.model}, {args.input_size}x{args.input_size}x4 latents, batch {args.batch_size}, {dtype}, "
          f"{device}, attention {attention_backend(get_config(args.model, input_size=args.input_size), args.batch_size, torch.bfloat16 if device.type == 'cuda' else torch.float32, device)}")
    rows = [measure(args, m, device) for m in args.modes.split(",")]
    base = next((r for r in rows if r["mode"] == "none"), rows[0])
    peak_col = device.type == "cuda"
    print("\n| mode | kept for backward (MiB) | vs none | step (s, median) | recompute overhead |"
          + (" peak allocated (MiB) |" if peak_col else ""))
    print("|---|---:|---:|---:|---:|" + ("---:|" if peak_col else ""))
    for r in rows:
        line = (f"| {r['mode']} | {r['kept'] / 2**20:.1f} | {r['kept'] / base['kept']:.2f}x | {r['step_s']:.3f} | "
                f"{100 * (r['step_s'] / base['step_s'] - 1):+.0f}% |")
        if peak_col:
            line += f" {r['peak'] / 2**20:.0f} |"
        print(line)


if __name__ == "__main__":
    main()
