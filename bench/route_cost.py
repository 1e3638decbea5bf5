"""Step time and activation memory of token routing (--route, TREAD) against none.

    python bench/route_cost.py [--models DiT-S/2,DiT-B/2] [--routes 0.5:2:8] [--input-size 32]
                               [--batch-size 32] [--reps 3] [--device cpu|cuda] [--threads N]

For each model: one forward + backward of a training step (the loss over every output token)
without routing and with each --routes value, alternated rep by rep so that a machine whose
speed drifts weighs on both alike; the kept tokens are drawn afresh each step, as in training
(dittrain.model.routing.draw). Reported: the bytes the forward keeps for the backward pass
(activations only, counted as bench/activation_memory.py counts them: every tensor autograd
saves, distinct storages, parameters left out), the median step time, and both against no
routing. Routes are written as `dittrain run --route` reads them for a new run, TREAD's counting
(0-based, START and END both routed: dittrain.model.routing). The default 0.5:2:8 is TREAD's own
DiT-B/2 route (CompVis/tread fccf77cc735a configs/model/tread.yaml): half the tokens skip blocks 2-8
of 0-11, the paper's i = 2, j = depth - 4 that is 0.5:2:24 on XL's 28. bench/RESULTS.md's figures
were measured with 0.5:1:10 (blocks 1-10, the last block with every token). fp32 on the CPU; bf16
autocast on CUDA, where the block after the rejoin runs with autocast off, as in training.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from activation_memory import KeptCounter, autocast, batch  # bench/activation_memory.py
from scratch import add_options, parse_on_device, parser, row, sync  # bench/scratch.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dittrain.model.dit import build_model  # noqa: E402
from dittrain.model.routing import RouteError, check, draw, parse_route  # noqa: E402


def step(model, inputs, route, gen, device) -> torch.Tensor:
    kwargs = dict(inputs)
    if route is not None:
        kwargs["route"] = draw(route, inputs["x"].shape[0], model.config.num_tokens, gen, device)
    with autocast(device):
        return model(**kwargs).float().pow(2).mean()


def measure(args, name: str, device) -> list[dict]:
    torch.manual_seed(0)
    model = build_model(name, input_size=args.input_size, in_channels=4, num_classes=1000).to(device).train()
    inputs, gen = batch(args, device), torch.Generator(device=device).manual_seed(0)
    routes = [None, *(parse_route(r) for r in args.routes.split(","))]
    try:  # END within the model, as dittrain run checks
        for route in routes:
            check(route, model.config.depth, name)
    except RouteError as e:
        raise SystemExit(f"route_cost: {e}") from None
    rows = []
    for route in routes:
        counter = KeptCounter(model)
        with counter.counting():
            loss = step(model, inputs, route, gen, device)
        loss.backward()
        rows.append(dict(model=name, route=str(route) if route else "none", kept=counter.total, times=[]))
        del loss
    for rep in range(args.reps + 1):  # rep 0 warms up; then the routes alternate
        for route, entry in zip(routes, rows, strict=True):
            model.zero_grad(set_to_none=False)
            sync(device)
            t0 = time.perf_counter()
            step(model, inputs, route, gen, device).backward()
            sync(device)
            if rep:
                entry["times"].append(time.perf_counter() - t0)
    for entry in rows:
        entry["step_s"] = statistics.median(entry.pop("times"))
    return rows


def main():
    ap = parser(__doc__)
    add_options(ap, ("--models", "DiT-S/2,DiT-B/2", "DiT sizes, comma-separated"),
                ("--routes", "0.5:2:8", "--route values against none, comma-separated (TREAD's counting)"),
                ("--input-size", 32, "latent side"), ("--batch-size", 32, "samples per step"),
                ("--reps", 3, "timed steps per variant"))
    args, device = parse_on_device(ap)
    dtype = "bf16 autocast" if device.type == "cuda" else "fp32"
    print(f"{args.input_size}x{args.input_size}x4 latents, batch {args.batch_size}, {dtype}, {device}, "
          f"median of {args.reps} alternated steps")
    print("\n| model | route | kept for backward (MiB) | vs none | step (s, median) | vs none |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.models.split(","):
        rows = measure(args, name, device)
        base = rows[0]
        for r in rows:
            print(row(r["model"], r["route"], f"{r['kept'] / 2**20:.1f}", f"{r['kept'] / base['kept']:.2f}x",
                      f"{r['step_s']:.3f}", f"{r['step_s'] / base['step_s']:.2f}x"), flush=True)


if __name__ == "__main__":
    main()
