"""What the benchmarks share: their command line (the docstring as --help, --device and
--threads), the torch device and its sync, markdown table rows, the scratch directory (--dir
DIR, kept and its inputs reused when complete, or a temporary directory removed at the end)
and the synthetic latent store. Imports only the standard library at the top: torch and the
store when called."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def scratch_dir(path: str | None, prefix: str) -> Iterator[Path]:
    root = Path(path) if path else Path(tempfile.mkdtemp(prefix=prefix))
    root.mkdir(parents=True, exist_ok=True)
    try:
        yield root
    finally:
        if path is None:
            shutil.rmtree(root, ignore_errors=True)


def parser(doc: str, *options: tuple, n: int | None = None, shard_size: int | None = None,
           scratch: bool = False) -> argparse.ArgumentParser:
    """A benchmark's command line, its module docstring as the --help text (layout kept); with
    n and shard_size, the synthetic store's arguments too (add_store_args); its own `options`
    (add_options rows); with `scratch`, --dir (add_dir_arg)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if n is not None:
        add_store_args(ap, n=n, shard_size=shard_size)
    add_options(ap, *options)
    if scratch:
        add_dir_arg(ap)
    return ap


def add_device_args(ap, device: str = "cpu", *, threads: bool = True) -> None:
    """--device (a torch device) and, with `threads`, --threads (torch's CPU threads)."""
    ap.add_argument("--device", default=device, help=f"torch device: cpu, cuda, cuda:1 (default {device})")
    if threads:
        ap.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: torch's)")


def parse_on_device(ap, device: str = "cpu"):
    """(args, torch device): --device and --threads added to `ap`, the command line parsed,
    the device opened (open_device)."""
    add_device_args(ap, device)
    args = ap.parse_args()
    return args, open_device(args)


def open_device(args, no_cuda: str = "no CUDA device here: use --device cpu"):
    """torch.device(args.device), torch's CPU threads set to args.threads where given; where
    it names CUDA on a machine without, prints `no_cuda` and exits with status 2."""
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(no_cuda, file=sys.stderr)
        sys.exit(2)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    return device


def sync(device) -> None:
    """Wait for the work queued on a CUDA device (timings); nothing on the CPU."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def add_store_args(ap, *, n: int, shard_size: int) -> None:
    """The synthetic latent store's size and where it lives (--n, --shard-size, --dir)."""
    ap.add_argument("--n", type=int, default=n, help="latents in the synthetic store")
    ap.add_argument("--shard-size", type=int, default=shard_size, help="latents per store shard")
    add_dir_arg(ap)


def add_options(ap, *rows: tuple) -> None:
    """A benchmark's own options from a table of (flag, default, help): each takes the type
    of its default (int, float or str)."""
    for flag, default, text in rows:
        ap.add_argument(flag, type=type(default), default=default, help=f"{text} (default {default})")


def add_dir_arg(ap) -> None:
    """--dir: the scratch directory (scratch_dir's `path`)."""
    ap.add_argument("--dir", default=None,
                    help="scratch directory, kept and reused when complete (default: a temp dir, removed after)")


def row(*cells) -> str:
    """A markdown table row of `cells`, each as str() writes it: `| a | b | c |`."""
    return "| " + " | ".join(map(str, cells)) + " |"


SHAPE = (4, 32, 32)  # 256 px through an f8 autoencoder with 4 channels
INFO = {"vae": {"name": "bench"}, "image": {"resolution": 256, "crop": "center"},
        "conditioning": {"type": "class", "num_classes": 1000}}


def synthetic_store(store: Path, n: int, shard: int, *, backend: str = "zarr") -> Path:
    """n random 4x32x32 fp16 latents with labels 0..999 in a latent store at `store`, shards
    of `shard` samples written one at a time (memory: one shard); reused when a previous call
    with the same n, shard and backend completed (STORE.complete records them)."""
    import numpy as np

    from ditdata.store import Schema, StoreWriter, TensorSpec

    done, tag = store.with_name(store.name + ".complete"), f"{n} {shard} {backend}"
    if done.is_file() and done.read_text() == tag:
        return store
    shutil.rmtree(store, ignore_errors=True)
    rng = np.random.default_rng(0)
    schema = Schema(tensors={"latent": TensorSpec(SHAPE, "float16")}, columns={"key": "string", "label": "int64"})
    w = StoreWriter(store, schema=schema, info=INFO, backend=backend, chunk_samples=1024)
    for s, start in enumerate(range(0, n, shard)):
        m = min(n, start + shard) - start
        x = rng.standard_normal((m, *SHAPE), dtype=np.float32).astype(np.float16)
        w.write_shard(f"{s:05d}", {"latent": x},
                      {"key": [str(i) for i in range(start, start + m)], "label": rng.integers(0, 1000, m)})
    w.finalize()
    done.write_text(tag)
    return store
