"""Does --route (TREAD) cost or help sample quality on the digits? The demo's pixel store, 3 seeds.

    python bench/route_digits.py [--steps 150,300,600] [--seeds 0,1,2] [--route 0.5:1:4]
                                 [--threads 2] [--dir DIR]

The demo's data and model (bench/digits_runs.py: 1,797 digits at 16 px, pixel store, DiT-T/4:
a 4 x 4 token grid, 6 blocks; flow, batch 32, lr 1e-3, EMA 0.99), trained by `dittrain run`
without and with `--route RATE:START:END` (TREAD's counting, 0-based and both ends routed; default
0.5:1:4: half of the 16 tokens skip blocks 1-4 of 0-5, the first and the last block see every token,
as TREAD's guidelines ask; its i = 2, j = depth - 4 would route one block of six), for each seed, a
checkpoint at each step count; each checkpoint sampled (EMA, 10 per digit,
CFG 3, 40 Euler steps, every token: routing is training only) and judged by a 1-NN classifier
on the real 8 x 8 digits: the fraction of samples that are the digit they were conditioned on,
and their mean distance to the nearest real digit. Prints the table and the training times and
writes DIR/results/summary.json.
"""

from __future__ import annotations

import digits_runs as runs  # bench/digits_runs.py
from scratch import scratch_dir  # bench/scratch.py


def main() -> None:
    a, env = runs.parse_args(__doc__, ("--route", "0.5:1:4", "--route, TREAD's counting (DiT-T has blocks 0-5)"))
    with scratch_dir(a.dir, "route_digits_") as root:
        store = runs.build_store(root, env)
        rows = []
        for seed in map(int, a.seeds.split(",")):
            for variant, extra in (("plain", []), ("--route", ["--route", a.route])):
                rows += runs.train_and_judge(store, root, variant, seed, a.steps, extra, env)
        runs.write_summary(root, a, rows)
        print(f"\nDiT-T/4 on the 16 px digits (flow, batch 32, lr 1e-3); --route {a.route}; seeds {a.seeds}; "
              "100 samples per checkpoint\n")
        runs.print_comparison(rows, a.steps, ("plain", "--route"))


if __name__ == "__main__":
    main()
