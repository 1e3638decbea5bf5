"""What one evaluation of the validation loss costs (--val-fraction, dittrain.train.validation).

    python bench/validation_cost.py [--model DiT-S/2] [--n 4096] [--fraction 0.03125] [--batch-size 64]
                                    [--rounds 3] [--device cpu] [--threads T] [--dir DIR]

A synthetic ImageNet-256-shaped store (n random 4x32x32 fp16 latents, classes 0..999, bench/scratch.py)
and a run over it with --val-fraction F, set up as `dittrain run` sets it up (setup, then
dittrain.train.validation.build). Timed, on --device:

    build       reading the held-out rows into memory (once, at the start of a run)
    evaluate    one evaluation of the live weights (a freshly initialised --model): held-out rows x 10 t
                forward passes of --batch-size, the median of --rounds (after one warm-up evaluation)
    noise       of which: drawing every row's fixed noise (a seeded CPU generator per row)
    train step  one optimizer step of the same model at the same batch (forward, backward, AdamW), the
                median of --rounds: what an evaluation is worth in training steps at that batch

and the evaluation's forward passes as a share of the training compute between two evaluations, for a
run of --val-every steps of --train-batch samples (a forward is about a third of a step's forward and
backward): rows x 10 / (3 x val_every x train_batch).
"""

from __future__ import annotations

import statistics
import time

from scratch import parse_on_device, parser, scratch_dir, sync, synthetic_store  # bench/scratch.py

OPTIONS = (("--model", "DiT-S/2", "the DiT (a name from `dittrain models`)"),
           ("--fraction", 0.03125, "--val-fraction"),
           ("--batch-size", 64, "--eval-batch-size: rows per forward"),
           ("--rounds", 3, "timed evaluations (and training steps)"),
           ("--val-every", 1000, "--val-every, for the share of the training compute"),
           ("--train-batch", 256, "the run's global batch, for the share of the training compute"))


def main() -> None:
    args, device = parse_on_device(parser(__doc__, *OPTIONS, n=4096, shard_size=1024))
    import torch

    from dittrain.config import TrainConfig
    from dittrain.train.setup import setup
    from dittrain.train.validation import build

    with scratch_dir(args.dir, "valcost-") as root:
        store = synthetic_store(root / "store", args.n, args.shard_size)
        cfg = TrainConfig.from_flat(latents=str(store), model=args.model, val_fraction=args.fraction,
                                    eval_batch_size=args.batch_size, batch_size=args.batch_size, device=str(device),
                                    out=str(root / "run"), amp="auto")
        run = setup(cfg)
        t0 = time.perf_counter()
        val = build(run)
        build_s = time.perf_counter() - t0

        from dittrain.model.dit import DiT

        torch.manual_seed(0)
        model = DiT(run.model_cfg).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(args.batch_size, *run.store.latent_shape, device=device)
        y = torch.randint(0, 1000, (args.batch_size,), device=device)

        def train_step() -> float:
            """One optimizer step of the same model at the same batch (forward, backward, AdamW), for scale."""
            sync(device)
            t0 = time.perf_counter()
            t = torch.randint(0, 1000, (args.batch_size,), device=device)
            with torch.autocast(device.type, dtype=run.amp_dtype, enabled=run.amp_dtype is not None):
                loss = run.diffusion.training_loss(model, x, {"y": y}, t=t).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(device)
            return time.perf_counter() - t0

        val.evaluate(model)  # warm-ups
        train_step()
        evals, noise, steps = [], [], []
        for _ in range(args.rounds):  # interleaved, so the machine's load weighs on both alike
            sync(device)
            t0 = time.perf_counter()
            val.evaluate(model)
            sync(device)
            evals.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for part in val.parts:
                val._noise(part, 0, len(part.rows), 0)
            noise.append(time.perf_counter() - t0)
            steps.append(train_step())

        ev, st = statistics.median(evals), statistics.median(steps)
        forwards = val.rows * len(val.t)
        share = forwards / (3 * args.val_every * args.train_batch)
        print(f"{args.model} on {device} ({torch.get_num_threads()} threads), {val.rows} held-out rows of {args.n} "
              f"x {len(val.t)} t = {forwards} forwards in batches of {args.batch_size}")
        print(f"build (rows read)  {build_s:.2f} s")
        print(f"evaluate           {ev:.2f} s (median of {args.rounds}: {', '.join(f'{e:.2f}' for e in evals)}), "
              f"{forwards / ev:.0f} samples/s")
        print(f"  noise            {statistics.median(noise):.3f} s ({100 * statistics.median(noise) / ev:.1f}%)")
        print(f"train step         {st:.3f} s at batch {args.batch_size}: one evaluation = {ev / st:.1f} steps")
        print(f"share of training  {100 * share:.2f}% of {args.val_every} steps x {args.train_batch} samples "
              "(forwards ~ 1/3 of a step's work)")


if __name__ == "__main__":
    main()
