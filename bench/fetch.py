"""Folder-packing throughput of `ditdata fetch` (images/s) on real JPEGs.

    python bench/fetch.py [--n 3000] [--processes 1 2] [--repeat 2] [--dir /tmp/ditkit-bench-fetch] [--append]

Builds an ImageNet-like class tree (10 class folders of JPEGs, quality 90, shorter side
300-500 px like ILSVRC2012 train images) from random crops and rescales of the real
photographs shipped with scikit-image and scikit-learn, then times the real command
`ditdata fetch TREE --out OUT --processes P --samples-per-shard 500 -q` for each P, in
two modes:

  originals   no --image-size: every image is fully decoded (to catch corrupt files)
              and the RGB JPEG bytes are stored unchanged
  256 crop    --image-size 256 --resize-mode center_crop: decode (libjpeg draft
              scaling), resize, centre crop, re-encode as JPEG q95

Reported: wall time of the whole command (process start, scan, packing, dataset.json)
and images/s = N / wall time. Inputs are in the page cache (just written), so this is
CPU-bound packing, not disk reading. --append adds a section to bench/RESULTS.md.
"""

from __future__ import annotations

import io
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image
from scratch import parser  # bench/scratch.py

RESULTS = Path(__file__).with_name("RESULTS.md")
SECTION = "## ditdata fetch: folder packing"


def photos() -> list[np.ndarray]:
    from skimage import data
    from sklearn.datasets import load_sample_images

    out = [data.astronaut(), data.chelsea(), data.coffee(), data.rocket(), data.cat(),
           np.repeat(data.camera()[..., None], 3, axis=2)]
    out += list(load_sample_images().images)
    return [np.ascontiguousarray(a) for a in out]


def make_tree(root: Path, n: int, classes: int = 10, seed: int = 0) -> int:
    """n JPEGs in `classes` folders; returns the total size in bytes."""
    rng = np.random.default_rng(seed)
    srcs = photos()
    total = 0
    for i in range(n):
        src = srcs[rng.integers(len(srcs))]
        h, w = src.shape[:2]
        ch, cw = int(h * rng.uniform(0.5, 1.0)), int(w * rng.uniform(0.5, 1.0))
        y, x = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
        img = Image.fromarray(src[y:y + ch, x:x + cw])
        short = int(rng.integers(300, 501))
        s = short / min(img.size)
        img = img.resize((max(1, round(img.size[0] * s)), max(1, round(img.size[1] * s))), Image.Resampling.BILINEAR)
        if rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=90)
        d = root / f"n{i % classes:08d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"img_{i:06d}.JPEG").write_bytes(buf.getvalue())
        total += buf.tell()
    return total


def run_fetch(tree: Path, out: Path, processes: int, extra: list[str]) -> tuple[float, float, list[str]]:
    """Run the command; return (wall seconds, CPU seconds of it and its workers, argv)."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = ["ditdata", "fetch", str(tree), "--out", str(out), "--processes", str(processes),
           "--samples-per-shard", "500", "-q", *extra]
    exe = [str(Path(sys.executable).with_name("ditdata")), *cmd[1:]]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(exe, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime), cmd


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ditkit-bench-fetch"))
    ap.add_argument("--repeat", type=int, default=2, help="runs per setting; the fastest is reported")
    ap.add_argument("--append", action="store_true", help=f"append a section to {RESULTS}")
    args = ap.parse_args()

    tree, out = args.dir / "train", args.dir / "shards"
    shutil.rmtree(args.dir, ignore_errors=True)
    t0 = time.perf_counter()
    size = make_tree(tree, args.n)
    print(f"made {args.n} JPEGs ({size / 2**20:.0f} MiB, mean {size / args.n / 1024:.0f} KiB) "
          f"in {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    load_before = os.getloadavg()[0]
    rows = []
    for label, extra in (("originals", []), ("256 crop", ["--image-size", "256", "--resize-mode", "center_crop"])):
        for p in args.processes:
            # best of --repeat: other jobs on a shared machine only ever slow a run down
            wall, cpu, cmd = min(run_fetch(tree, out, p, extra) for _ in range(args.repeat))
            rows.append((label, p, wall, args.n / wall, cpu, " ".join(cmd)))
            print(f"{label:10s} processes={p}: {wall:6.1f} s  {args.n / wall:7.0f} img/s  "
                  f"{cpu:6.1f} CPU s  {args.n / cpu:5.0f} img/CPU-s", file=sys.stderr)
    shutil.rmtree(args.dir, ignore_errors=True)

    date = subprocess.run(["date"], capture_output=True, text=True).stdout.strip()
    lines = [
        SECTION,
        "",
        f"{date}; {os.cpu_count()}-core CPU ({cpu_name()}), no GPU; Python {platform.python_version()}, "
        f"Pillow {Image.__version__}. Load average before the timed runs: {load_before:.1f} "
        "(other jobs on the machine slow every figure down).",
        f"Input: {args.n} real JPEGs ({size / 2**20:.0f} MiB, mean {size / args.n / 1024:.0f} KiB, shorter side "
        "300-500 px) in 10 class folders, made from random crops of the scikit-image / scikit-learn "
        "photographs by `python bench/fetch.py"
        + (f" --n {args.n}" if args.n != 3000 else "") + "`; files in the page cache.",
        "",
        f"Best of {args.repeat} runs per setting.",
        "",
        "| mode | processes | wall time (s) | images/s | CPU time (s) | images per CPU-second |",
        "|---|---:|---:|---:|---:|---:|",
        *[f"| {m} | {p} | {w:.1f} | {r:.0f} | {c:.1f} | {args.n / c:.0f} |" for m, p, w, r, c, _ in rows],
        "",
        "Commands (wall time includes interpreter start, folder scan and dataset.json; CPU time is "
        "user + system of the command and its worker processes, a figure other jobs on the machine "
        "disturb less than wall time):",
        "",
        *[f"    {c}" for *_, c in rows],
        "",
        "`originals` fully decodes every image (to catch corrupt files) and stores the RGB JPEG bytes "
        "unchanged; `256 crop` decodes with libjpeg draft scaling, resizes (bicubic), centre-crops "
        "and re-encodes at quality 95.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.append:
        new = not RESULTS.exists()
        with open(RESULTS, "a", encoding="utf-8") as f:
            if new:
                f.write("# Benchmark results\n\n")
            f.write(text + "\n")


if __name__ == "__main__":
    main()
