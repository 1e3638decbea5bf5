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
found by wrapping dittrain.model.checkpoint). fp32 on the CPU; --device cuda runs under bf16
autocast and also reports torch.cuda.max_memory_allocated over a step (the peak includes the
weights, their gradients and the recomputation of one block during backward).
CPU step times say little about GPU recompute cost (element-wise ops are cheap in FLOPs but
memory-bound on a GPU); the kept bytes are the same on any device for the same dtype.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
from scratch import add_device_args, open_device, parser, sync  # bench/scratch.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dittrain.model as model_mod  # noqa: E402
from dittrain.model import build_model  # noqa: E402
from dittrain.sdpa import attention_backend  # noqa: E402
from dittrain.specs import get_config  # noqa: E402

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


def main():
    ap = parser(__doc__)
    ap.add_argument("--model", default="DiT-S/2")
    ap.add_argument("--input-size", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--reps", type=int, default=3)
    add_device_args(ap)
    args = ap.parse_args()
    device = open_device(args)
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
