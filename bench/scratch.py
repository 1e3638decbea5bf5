"""The benchmarks' scratch directory: --dir DIR (kept, and its inputs reused when complete)
or a temporary directory removed at the end."""

from __future__ import annotations

import shutil
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


def add_store_args(ap, *, n: int, shard_size: int) -> None:
    """The synthetic latent store's size and where it lives (--n, --shard-size, --dir)."""
    ap.add_argument("--n", type=int, default=n, help="latents in the synthetic store")
    ap.add_argument("--shard-size", type=int, default=shard_size, help="latents per store shard")
    ap.add_argument("--dir", default=None,
                    help="scratch directory, kept and reused when complete (default: a temp dir, removed after)")
