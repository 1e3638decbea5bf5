"""The dittrain streaming loader against its peers (issue 17): samples/s and the peak PSS of
the whole process tree, each loader in a fresh process, interleaved over --rounds.

    python bench/loader.py --peers [--n 100000] [--shard-size 10000] [--batch-size 256]
                           [--workers 2] [--rounds 2] [--budgets auto,1GiB] [--dir DIR]

Same data for all: N latents 4x32x32 fp16 + int64 labels, random horizontal flips, a
shuffled order, `--workers` reader processes, batch --batch-size as float32 x and int64 y.
  dittrain      the latent store (zarr) with the flipped twin stored (what `ditdata encode`
                writes): StreamingLoader at each of --budgets (the flip is a row choice)
  mosaicml      streaming.StreamingDataset over MDS shards (x as raw bytes), torch DataLoader
  litdata       litdata.StreamingDataset over optimize()d chunks, StreamingDataLoader
  webdataset    tar shards of raw-bytes samples, shardshuffle + shuffle(1000) buffer,
                batched in the workers, torch DataLoader(batch_size=None)
The peers flip on the fly (torch.flip with p=0.5 per sample). A peer whose package does not
import is skipped with the reason. PSS (proportional set size: shared pages split between
the processes sharing them) is summed over the process and all its descendants from
/proc/PID/smaps_rollup every 20 ms; the peak covers startup and the timed epoch. Each
child process times one epoch after its first batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

SHAPE = (4, 32, 32)
PEERS = ("mosaicml", "litdata", "webdataset")


# ------------------------------------------------------------------------------ the data
def _arrays(n: int):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, *SHAPE), dtype=np.float32).astype(np.float16), rng.integers(0, 1000, n)


def write_all(root: Path, n: int, shard: int) -> dict[str, str]:
    """Every format under root (kept when complete); {name: why not} for peers that fail."""
    x, y = _arrays(n)
    skipped = {}
    done = root / ".peers-complete"
    have = json.loads(done.read_text()) if done.is_file() else {}
    if have.get("key") != [n, shard]:
        have = {"key": [n, shard]}
    for name, writer in (("dittrain", _write_store), ("mosaicml", _write_mds), ("litdata", _write_litdata),
                         ("webdataset", _write_wds)):
        if name in have:
            if have[name] is not True:
                skipped[name] = have[name]
            continue
        t = time.perf_counter()
        try:
            writer(root / name, x, y, shard)
            have[name] = True
            print(f"wrote {name} in {time.perf_counter() - t:.0f} s", flush=True)
        except Exception as e:  # an uninstallable or broken peer: say why, go on
            have[name] = skipped[name] = f"{type(e).__name__}: {e}"[:300]
        done.write_text(json.dumps(have))
    return skipped


def _write_store(path, x, y, shard):
    import shutil

    from ditdata.store import Schema, StoreWriter, TensorSpec

    shutil.rmtree(path, ignore_errors=True)
    schema = Schema(tensors={"latent": TensorSpec(SHAPE, "float16"), "latent_flip": TensorSpec(SHAPE, "float16")},
                    columns={"key": "string", "label": "int64"})
    info = {"vae": {"name": "bench"}, "image": {"resolution": 256},
            "conditioning": {"type": "class", "num_classes": 1000}}
    w = StoreWriter(path, schema=schema, info=info, backend="zarr", chunk_samples=1024)
    for s, a in enumerate(range(0, len(x), shard)):
        sl = slice(a, min(len(x), a + shard))
        w.write_shard(f"{s:05d}", {"latent": x[sl], "latent_flip": np.ascontiguousarray(x[sl][..., ::-1])},
                      {"key": [str(i) for i in range(sl.start, sl.stop)], "label": y[sl]})
    w.finalize()


def _shard_bytes(shard: int) -> int:
    return shard * (int(np.prod(SHAPE)) * 2 + 64)


def _write_mds(path, x, y, shard):
    import shutil

    from streaming import MDSWriter

    shutil.rmtree(path, ignore_errors=True)
    with MDSWriter(out=str(path), columns={"x": "bytes", "y": "int"}, size_limit=_shard_bytes(shard)) as w:
        for i in range(len(x)):
            w.write({"x": x[i].tobytes(), "y": int(y[i])})


def _ld_items(job):  # module level: litdata.optimize runs it in its own worker processes
    src, a, b = job
    x, y = np.load(src + ".x.npy", mmap_mode="r"), np.load(src + ".y.npy")
    for i in range(a, b):
        yield {"x": x[i].tobytes(), "y": int(y[i])}


def _write_litdata(path, x, y, shard):
    import shutil

    import litdata

    shutil.rmtree(path, ignore_errors=True)
    src = str(path) + "-src"
    np.save(src + ".x.npy", x)
    np.save(src + ".y.npy", y)
    jobs = [(src, a, min(len(x), a + shard)) for a in range(0, len(x), shard)]
    litdata.optimize(fn=_ld_items, inputs=jobs, output_dir=str(path), chunk_bytes=_shard_bytes(shard),
                     num_workers=1, mode="overwrite")


def _write_wds(path, x, y, shard):
    import shutil

    import webdataset as wds

    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    with wds.ShardWriter(str(path / "%05d.tar"), maxcount=shard, verbose=0) as w:
        for i in range(len(x)):
            w.write({"__key__": f"{i:08d}", "x.bin": x[i].tobytes(), "cls": str(int(y[i])).encode()})


# ------------------------------------------------------------------------------ the readers
def _flip(x: torch.Tensor) -> torch.Tensor:
    m = torch.rand(len(x)) < 0.5
    x[m] = x[m].flip(-1)
    return x


def _decode(xb: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(xb), dtype=torch.float16).view(*SHAPE)


def _collate(samples):
    x = torch.stack([_decode(s["x"]) for s in samples])
    return _flip(x).float(), torch.tensor([int(s["y"]) for s in samples])


def _wds_sample(s):
    return {"x": s["x.bin"], "y": int(s["cls"])}


def _wds_batch(samples):  # webdataset .batched(collation_fn=...): a list of samples
    return _collate(samples)


def make_reader(name: str, root: Path, args, budget: str | None):
    """An iterator of (x float32 (B, C, h, w), y int64 (B,)) over one epoch or more."""
    B, W = args.batch_size, args.workers
    if name == "dittrain":
        from dittrain.data import StreamingLoader

        loader = StreamingLoader(root / "dittrain", batch_size=B, workers=W, memory=budget)
        print(f"  {loader.reason}", file=sys.stderr, flush=True)
        return ((b["x"], b["y"]) for b in loader), loader
    if name == "mosaicml":
        from streaming import StreamingDataset

        ds = StreamingDataset(local=str(root / "mosaicml"), shuffle=True, batch_size=B, shuffle_seed=0)
        dl = torch.utils.data.DataLoader(ds, batch_size=B, num_workers=W, collate_fn=_collate, drop_last=True)
        return iter(dl), None
    if name == "litdata":
        import litdata

        ds = litdata.StreamingDataset(str(root / "litdata"), shuffle=True, seed=0)
        dl = litdata.StreamingDataLoader(ds, batch_size=B, num_workers=W, collate_fn=_collate, drop_last=True)
        return iter(dl), None
    if name == "webdataset":
        import webdataset as wds

        urls = sorted(str(p) for p in (root / "webdataset").glob("*.tar"))
        ds = (wds.WebDataset(urls, shardshuffle=len(urls), nodesplitter=None, empty_check=False)
              .shuffle(1000).map(_wds_sample).batched(B, collation_fn=_wds_batch, partial=False))
        dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=W)
        return iter(dl), None
    raise ValueError(name)


def child(name: str, root: Path, args, budget: str | None) -> None:
    """One loader in this process: startup (to the first batch) and one timed epoch."""
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    it, loader = make_reader(name, root, args, budget)
    x, y = next(it)
    startup = time.perf_counter() - t0
    steps = args.n // args.batch_size - 1
    t1, seen = time.perf_counter(), 0
    for _ in range(steps):
        try:
            x, y = next(it)
        except StopIteration:  # a peer's epoch ended (its own rounding): count what it gave
            break
        assert x.dtype == torch.float32 and x.shape[1:] == SHAPE
        seen += len(x)
    rate = seen / (time.perf_counter() - t1)
    extra = {"estimate": loader.memory_estimate, "reason": loader.reason} if loader is not None else {}
    print("RESULT " + json.dumps({"rate": rate, "startup": startup, "seen": seen, **extra}), flush=True)
    if loader is not None:
        loader.close()


# ------------------------------------------------------------------------------ PSS of a tree
def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def tree_pss(pid: int) -> int:
    total = 0
    for p in _descendants(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
    return total


class PeakSampler(threading.Thread):
    def __init__(self, pid: int, every: float = 0.02):
        super().__init__(daemon=True)
        self.pid, self.every, self.peak, self._stop_ = pid, every, 0, threading.Event()

    def run(self):
        while not self._stop_.is_set():
            self.peak = max(self.peak, tree_pss(self.pid))
            time.sleep(self.every)

    def stop(self) -> int:
        self._stop_.set()
        self.join()
        return self.peak


def measured_child(cmd: list[str]) -> tuple[dict | None, int]:
    """Run a benchmark child (one thread; it prints `RESULT {json}`), sampling its process
    tree's PSS: (its result with "peak" added, or None when it failed; its exit status)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    sampler = PeakSampler(proc.pid)
    sampler.start()
    out, _ = proc.communicate()
    peak = sampler.stop()
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        return None, proc.returncode
    return json.loads(line[-1][7:]) | {"peak": peak}, 0


def parse_or_run_child(ap, kinds, child):
    """The streaming benches' command line (bench/feature_loader.py, bench/latent_loader.py): their
    shared options (--batch-size, --workers, --budget, --rounds, and the children's hidden --child KIND
    and --root) added to `ap`, parsed: the args; a child process runs child(args) and exits."""
    import argparse

    ap.add_argument("--batch-size", type=int, default=256, help="samples per batch")
    ap.add_argument("--workers", type=int, default=2, help="streaming loader processes")
    ap.add_argument("--budget", default="auto", help="the loader's memory budget (--loader-memory)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", choices=list(kinds), help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        sys.exit(0)
    return args


def timed_epoch(loader, samples: int, t0: float, base: int, check, keep: str | None = None) -> None:
    """A streaming bench child's measurement (bench/latent_loader.py, bench/text_tokens.py) once it
    has built `loader` (t0: the time before it built it; base: its process tree's PSS then):
    check(batch) on the first batch (the startup) and on each later batch of one epoch of
    `samples` (timed); then its `RESULT {json}` line (rate, startup, the loader's reason, its
    memory plan's estimate and budget, base and, with `keep`, what check returned for each timed
    batch under that name) for child_rounds, and the loader closed."""
    B = loader.batch_size
    check(next(loader))
    startup = time.perf_counter() - t0
    steps = samples // B - 1
    t1 = time.perf_counter()
    checked = [check(next(loader)) for _ in range(steps)]
    rate = steps * B / (time.perf_counter() - t1)
    plan = loader.memory_plan
    print("RESULT " + json.dumps({"rate": rate, "startup": startup, "reason": loader.reason, "estimate": plan.estimate,
                                  "budget": plan.budget, "base": base} | ({keep: checked} if keep else {})),
          flush=True)
    loader.close()


def budget_cells(rs: list[dict]) -> dict[str, str]:
    """One kind's timed_epoch results over the rounds (child_rounds' peak added) as table cells:
    rate (the median samples/s), peak (of the tree, and over the child before its loader, the
    highest), estimate and budget (the loader's) and within (whether each peak stayed within it)."""
    rate = float(np.median([r["rate"] for r in rs]))
    peak, est, budget = max(r["peak"] for r in rs), rs[-1]["estimate"], rs[-1]["budget"]
    own = max(r["peak"] - r["base"] for r in rs)
    within = "no budget" if budget is None else \
        f"{'yes' if peak <= budget else 'NO'}; {'yes' if own <= budget else 'NO'}"
    return {"rate": f"{rate:,.0f}", "peak": f"{peak / 2**30:.2f} GiB ({own / 2**30:.2f} GiB)",
            "estimate": f"{est / 2**30:.2f} GiB", "budget": "-" if budget is None else f"{budget / 2**30:.2f} GiB",
            "within": within}


def child_rounds(script: str, kinds, root: Path, args, extra: list[str], words) -> dict[str, list[dict]]:
    """args.rounds rounds of one measured child of `script` per kind, interleaved (every kind once
    a round), with add_child_args' options and `extra`; prints a line per child, words(result) after
    its kind. {kind: [results]}; exits naming the kind when a child fails."""
    results: dict[str, list[dict]] = {k: [] for k in kinds}
    for rnd in range(args.rounds):
        for kind in kinds:
            cmd = [sys.executable, script, "--child", kind, "--root", str(root), "--n", str(args.n),
                   "--batch-size", str(args.batch_size), "--workers", str(args.workers), "--budget", args.budget,
                   *extra]
            r, rc = measured_child(cmd)
            if r is None:
                sys.exit(f"{Path(script).name}: the {kind} child failed (exit {rc})")
            results[kind].append(r)
            print(f"round {rnd}: {kind}: {words(r)}", flush=True)
    return results


def compare(root: Path, args) -> None:
    skipped = write_all(root, args.n, args.shard_size)
    runs = [("dittrain", b) for b in args.budgets.split(",")] + [(p, None) for p in PEERS if p not in skipped]
    results: dict[tuple, list] = {r: [] for r in runs}
    for rnd in range(args.rounds):
        for name, budget in runs:  # interleaved: every loader once per round
            cmd = [sys.executable, __file__, "--child", name, "--root", str(root), "--n", str(args.n),
                   "--batch-size", str(args.batch_size), "--workers", str(args.workers)]
            if budget:
                cmd += ["--budget", budget]
            r, rc = measured_child(cmd)
            if r is None:
                print(f"round {rnd}: {name} {budget or ''} failed (exit {rc})", flush=True)
                continue
            results[(name, budget)].append(r)
            print(f"round {rnd}: {name} {budget or ''}: {r['rate']:,.0f} samples/s, peak PSS "
                  f"{r['peak'] / 2**30:.2f} GiB, startup {r['startup']:.1f} s"
                  + (f", estimate {r['estimate'] / 2**30:.2f} GiB" if "estimate" in r else ""), flush=True)
    print(f"\n{args.n:,} latents {SHAPE} fp16 + labels, flips, batch {args.batch_size}, {args.workers} workers, "
          f"{args.rounds} interleaved rounds (median rate, max peak)\n")
    print("| loader | samples/s | peak PSS of the process tree | loader's estimate | startup (s) |")
    print("|---|---:|---:|---:|---:|")
    for (name, budget), rs in results.items():
        if not rs:
            continue
        rate = float(np.median([r["rate"] for r in rs]))
        peak = max(r["peak"] for r in rs)
        est = f"{rs[0]['estimate'] / 2**30:.2f} GiB" if "estimate" in rs[0] else "-"
        label = f"dittrain streaming, --loader-memory {budget}" if name == "dittrain" else name
        print(f"| {label} | {rate:,.0f} | {peak / 2**30:.2f} GiB | {est} | "
              f"{float(np.median([r['startup'] for r in rs])):.1f} |")
    for name, why in skipped.items():
        print(f"| {name} | not run: {why} | | | |")


if __name__ == "__main__":  # the child process of compare()
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--child", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--batch-size", type=int, required=True)
    ap.add_argument("--workers", type=int, required=True)
    ap.add_argument("--budget", default=None)
    a = ap.parse_args()
    child(a.child, Path(a.root), a, a.budget)
