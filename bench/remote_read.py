"""Streaming-loader throughput from a store served over HTTP (ditdata.store.remote) against
the same store on local disk.

    python bench/remote_read.py [--n 50000] [--shard-size 5000] [--backend wds|zarr]
                                [--batch-size 256] [--workers 2] [--dir DIR]

Writes N latents of 4x32x32 fp16 (with int64 labels) as one store, serves its directory
with Python's http.server on 127.0.0.1 (a thread of this process), and times, in samples/s,
a consumer that only takes batches from dittrain.data.StreamingLoader (shuffle_window 2):

  local disk          epochs 1 and 2 from the store directory (freshly written: served from
                      the page cache)
  http, cold cache    epoch 1 from http://127.0.0.1: includes every shard's download into an
                      empty --cache-dir, its sha256 check and the rename into the cache
  http, warm cache    epoch 2 on the same loader: the shards are read from the cache

Each figure is one whole epoch, timed from the first next() (the workers' start included).
"""

from __future__ import annotations

import functools
import http.server
import shutil
import threading
import time

import torch
from scratch import SHAPE, parser, scratch_dir, synthetic_store  # bench/scratch.py

from ditdata.store import open_store
from dittrain.data import StreamingLoader


def epochs(store, args, count: int) -> list[float]:
    """samples/s of each of `count` whole epochs of one streaming loader."""
    loader = StreamingLoader(store, batch_size=args.batch_size, workers=args.workers, shuffle_window=2)
    per_epoch = loader.samples_per_epoch
    steps = per_epoch // args.batch_size
    rates = []
    try:
        for _ in range(count):
            t = time.perf_counter()
            for _ in range(steps):
                next(loader)
            rates.append(steps * args.batch_size / (time.perf_counter() - t))
    finally:
        loader.close()
    return rates


def main():
    ap = parser(__doc__, n=50_000, shard_size=5_000)
    ap.add_argument("--backend", default="wds", choices=["wds", "zarr"])
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with scratch_dir(args.dir, "remote-read-") as root:
        store = synthetic_store(root / f"store-{args.backend}", args.n, args.shard_size, backend=args.backend)
        handler = functools.partial(_Quiet, directory=str(root))
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{srv.server_address[1]}/{store.name}"
        cache = root / "cache"
        try:
            size = open_store(store).nbytes_on_disk()
            print(f"{args.n} latents {SHAPE} fp16, {args.backend}, shards of {args.shard_size}, "
                  f"{size / 2**20:.0f} MiB; batch {args.batch_size}, {args.workers} workers")
            local1, local2 = epochs(store, args, 2)
            print(f"local disk, epoch 1  {local1:>10,.0f} samples/s")
            print(f"local disk, epoch 2  {local2:>10,.0f} samples/s")
            shutil.rmtree(cache, ignore_errors=True)
            cold, warm = epochs(open_store(url, cache_dir=cache), args, 2)
            print(f"http, cold cache     {cold:>10,.0f} samples/s  (epoch 1: downloads {size / 2**20:.0f} MiB, "
                  f"{size / 2**20 * cold / args.n:.0f} MiB/s)")
            print(f"http, warm cache     {warm:>10,.0f} samples/s  (epoch 2)")
        finally:
            srv.shutdown()
            srv.server_close()
            shutil.rmtree(cache, ignore_errors=True)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


if __name__ == "__main__":
    main()
