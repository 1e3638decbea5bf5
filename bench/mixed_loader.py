"""Several stores mixed (dittrain.data.mixture, `dittrain run --latents A --latents B:R`) against one
store: samples/s of the same loader kind.

    PYTHONPATH=bench python bench/mixed_loader.py [--n 16384] [--shard-size 2048] [--batch-size 256]
                                                  [--batches 256] [--workers 2] [--repeats 0.5]
                                                  [--rounds 5] [--warmup 64] [--dir DIR]

Writes two synthetic stores (bench/scratch.py: N random 4x32x32 fp16 latents with labels, zarr),
then builds, per loader kind (resident; streaming with --workers worker processes and a shuffle
window of 2 shards), both loaders below once (the build and first batch timed apart), runs
--warmup batches of each, then times --batches batches of --batch-size on the CPU, round by round,
the two interleaved (each batch's x float32 (B, 4, 32, 32)):

    single    build_loader(A): today's loader, what one --latents gets
    mixture   build_mixture([A, B], [1, R]): both stores, A once and B R times per epoch, each
              batch the next one of its store's own loader (the mixture's own work: the seeded
              order of the stores' batches, and a loader that is elsewhere moved on a resume)

The rates are the median over --rounds. The goal: the mixture within 10% of
one store. Each streaming store of the mixture runs --workers processes of its own (as
build_mixture makes them; idle ones sleep), the same memory budget shared between them.
"""

from __future__ import annotations

import statistics
import time

from scratch import parser, scratch_dir, synthetic_store  # bench/scratch.py


def timed(loader, batches: int) -> float:
    """samples/s of the loader's next `batches` batches."""
    t0, n = time.perf_counter(), 0
    for _ in range(batches):
        n += len(next(loader)["x"])
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = parser(__doc__, ("--batch-size", 256, "samples per batch"), ("--batches", 256, "batches timed per round"),
                ("--warmup", 64, "batches before the timing"),
                ("--workers", 2, "streaming loader processes (of each store)"),
                ("--repeats", 0.5, "the second store's repeats per epoch"), ("--rounds", 5, "rounds, interleaved"),
                n=16384, shard_size=2048)
    args = ap.parse_args()
    import torch

    from dittrain.config import LoaderConfig
    from dittrain.data import build_loader, build_mixture

    torch.set_num_threads(1)
    with scratch_dir(args.dir, "mixed_loader_") as root:
        a = synthetic_store(root / "a", args.n, args.shard_size)
        b = synthetic_store(root / "b", args.n, args.shard_size)
        for kind in ("resident", "streaming"):
            settings = LoaderConfig(kind=kind, workers=args.workers, shuffle_window=2)
            made, startup = {}, {}
            for name, make in (("single", lambda s=settings: build_loader(a, s, batch_size=args.batch_size, seed=0)),
                               ("mixture", lambda s=settings: build_mixture([a, b], [1.0, args.repeats], s,
                                                                           batch_size=args.batch_size, seed=0))):
                t0 = time.perf_counter()
                made[name] = make()
                first = next(made[name])
                startup[name] = time.perf_counter() - t0
                assert first["x"].dtype == torch.float32
                timed(made[name], args.warmup)  # the first windows, pages and epoch orders
            got = {name: [] for name in made}
            for _ in range(args.rounds):
                for name, loader in made.items():
                    got[name].append(timed(loader, args.batches))
            for loader in made.values():
                loader.close()
            med = {name: statistics.median(runs) for name, runs in got.items()}
            for name, runs in got.items():
                print(f"{kind:9s} {name:8s} {med[name]:9,.0f} samples/s  (rounds: "
                      f"{', '.join(f'{r:,.0f}' for r in runs)}; built and first batch in {startup[name]:.2f} s)")
            print(f"{kind:9s} mixture / single: {med['mixture'] / med['single']:.1%}")


if __name__ == "__main__":
    main()
