"""Checkpoint saves off the step (issue 17): how long `_save` blocks the training loop,
synchronous (--no-async-save) against the background writer (--async-save).

    python bench/checkpoint_save.py [--model DiT-B/2] [--saves 3] [--device cpu] [--dir DIR]

Builds the model, its EMA and AdamW state (one optimizer step, so the moments exist) as a
real dittrain.train.checkpoint.RunState, then calls dittrain.train.loop._save as the loop does, `--saves`
times per mode, with "steps" in between: a fixed matmul workload standing in for the training
step (a real DiT step on a 2-core CPU would take seconds and hide nothing). Reports per mode:
the main thread's time inside _save (the step-time spike), the write itself (torch.save +
fsync + rename, and the EMA export; in the background for async), and the proxy step's median
time while no write runs and while one does (what a background write costs the steps it
overlaps: the GIL, memory bandwidth, a shared CPU). Prints a Markdown table for
bench/RESULTS.md. Needs about 2x the state in RAM (the host copy) and 2 checkpoints on disk.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from scratch import add_device_args, open_device, parser  # bench/scratch.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dittrain.train.checkpoint as checkpoint  # noqa: E402
import dittrain.train.loop as train  # noqa: E402
from dittrain.config import TrainConfig  # noqa: E402
from dittrain.model.dit import DiT  # noqa: E402
from dittrain.model.sizes import get_config  # noqa: E402
from dittrain.train.checkpoint import RunState  # noqa: E402


class _Loader:
    """A loader's state_dict, without a store."""

    def state_dict(self) -> dict:
        return {"kind": "bench", "batches": 0}


def build_state(model: str, device: torch.device) -> RunState:
    cfg = get_config(model, input_size=32, in_channels=4, num_classes=1000)
    net, ema = DiT(cfg).to(device), DiT(cfg).to(device).requires_grad_(False)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # the moments exist now: the state is what a real checkpoint holds
    return RunState(model=net, ema=ema, optimizer=opt, lr_schedule=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                    scaler=torch.amp.GradScaler(device.type, enabled=False), loader=_Loader(),
                    noise_gen=torch.Generator(device).manual_seed(0), config={"bench": model}, device=device)


def state_bytes(state: dict) -> int:
    def walk(x):
        if isinstance(x, torch.Tensor):
            yield x.untyped_storage().data_ptr(), x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                yield from walk(v)
        elif isinstance(x, list | tuple):
            for v in x:
                yield from walk(v)
    return sum(dict(walk(state)).values())


def proxy_step(a: torch.Tensor, reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        a @ a
    if a.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t


def measure(state: RunState, out: Path, *, async_save: bool, saves: int, steps_between: int) -> dict:
    writes = []  # (start, end) of each write, whichever thread makes it
    real_save, real_export = checkpoint.save_checkpoint, checkpoint.export_weights

    def timed(fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                writes.append((t, time.perf_counter()))
        return wrapper

    checkpoint.save_checkpoint, checkpoint.export_weights = timed(real_save), timed(real_export)
    train.save_checkpoint, train.export_weights = checkpoint.save_checkpoint, checkpoint.export_weights
    cfg = TrainConfig.from_flat(out=str(out), keep=2, async_save=async_save)
    run = SimpleNamespace(cfg=cfg, master=True, world=1, out=out, saver=None)
    a = torch.randn(768, 768, device=state.device)
    blocking, steps = [], []  # steps: (start, duration)
    try:
        for i in range(saves):
            state.step = i + 1
            t = time.perf_counter()
            train._save(run, state)
            blocking.append(time.perf_counter() - t)
            for _ in range(steps_between):
                t = time.perf_counter()
                steps.append((t, proxy_step(a, 20)))
        if run.saver is not None:
            run.saver.wait()
            run.saver.close()
    finally:
        checkpoint.save_checkpoint, checkpoint.export_weights = real_save, real_export
        train.save_checkpoint, train.export_weights = real_save, real_export
    # a checkpoint and its EMA export are one "write" (consecutive entries)
    spans = [(writes[j][0], writes[j + 1][1]) for j in range(0, len(writes), 2)]
    during = [d for t, d in steps if any(s <= t + d and t <= e for s, e in spans)]
    idle = [d for t, d in steps if not any(s <= t + d and t <= e for s, e in spans)]
    return {"blocking": blocking, "write": [e - s for s, e in spans],
            "step_idle": statistics.median(idle) if idle else float("nan"),
            "step_during": statistics.median(during) if during else float("nan"), "n_during": len(during)}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", default="DiT-B/2")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--steps-between", type=int, default=60, help="proxy steps after each save")
    add_device_args(ap, threads=False)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder)")
    args = ap.parse_args()
    device = open_device(args)
    state = build_state(args.model, device)
    size = state_bytes(state.state_dict())
    print(f"{args.model}: state {size / 2**20:.0f} MiB (model, EMA, AdamW moments) on {device}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for mode in (False, True, False, True):  # interleaved: a shared machine's load hits both
            out = Path(tmp) / ("async" if mode else "sync")
            r = measure(state, out, async_save=mode, saves=args.saves, steps_between=args.steps_between)
            rows.append((mode, r))
            print(f"{'async' if mode else 'sync '}: blocking {[round(b, 3) for b in r['blocking']]} s, "
                  f"write {[round(w, 2) for w in r['write']]} s, proxy step {r['step_idle'] * 1e3:.1f} ms idle / "
                  f"{r['step_during'] * 1e3:.1f} ms during a write ({r['n_during']} steps)", file=sys.stderr)
    print("\n| mode | _save blocks the loop (median, s) | write (median, s) | proxy step idle / during a write (ms) |")
    print("|---|---:|---:|---:|")
    for mode in (False, True):
        rs = [r for m, r in rows if m == mode]
        blocking = statistics.median(b for r in rs for b in r["blocking"])
        write = statistics.median(w for r in rs for w in r["write"])
        idle = statistics.median(r["step_idle"] for r in rs)
        during = statistics.median(r["step_during"] for r in rs)
        name = "--async-save" if mode else "--no-async-save"
        print(f"| `{name}` | {blocking:.3f} | {write:.2f} | {idle * 1e3:.0f} / "
              f"{'-' if during != during else f'{during * 1e3:.0f}'} |")


if __name__ == "__main__":
    main()
