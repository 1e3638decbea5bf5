"""Multi-node torchrun on one machine: two "nodes" (two torchrun agents, --nnodes 2, one
rank each) meet through the c10d rendezvous on 127.0.0.1 and train / encode into one
shared --out, exactly as one process does; a node whose peers never come fails with a
rendezvous timeout instead of waiting forever."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from cliutil import assert_close_checkpoints, free_port, run_args
from storeutil import make_store

from ditdata.store import open_store

BIN = Path(sys.executable).parent
TORCHRUN = BIN / "torchrun"
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")]

# One machine: gloo must talk over the loopback interface (the machine's hostname may
# resolve to an address no socket listens on); torchrun's --local-addr does the same for
# the MASTER_ADDR the workers get. OMP_NUM_THREADS=1: the single-process runs round alike.
ENV = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")


def node_command(rank: int, port: int, module: str, args, *, nnodes: int = 2, conf: str = "") -> list[str]:
    """The torchrun command line of node `rank` of `nnodes` (one process each) that meet at
    127.0.0.1:port; node 0 hosts the rendezvous store (is_host), the others join it."""
    host = f"is_host={'true' if rank == 0 else 'false'}"
    return [str(TORCHRUN), "--nnodes", str(nnodes), "--nproc_per_node", "1", "--node_rank", str(rank),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"job{port}",
            "--rdzv-conf", ",".join(filter(None, [host, conf])), "--local-addr", "127.0.0.1",
            "-m", module, *map(str, args)]


def two_nodes(module: str, args, *, timeout: float = 300, args1=None, check: bool = True,
              ) -> list[subprocess.CompletedProcess]:
    """Start both nodes at once (Popen; node 1 with `args1` if given), wait for both; a node
    still running after `timeout` seconds is killed and the test fails with what it wrote.
    With `check`, both must succeed."""
    port = free_port()
    # Output to files, not pipes: polling (below) does not read pipes, and a full one would
    # block a node. Each node in its own process group, so that a kill takes its workers too.
    logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in (0, 1)]
    procs = [subprocess.Popen(node_command(r, port, module, args if r == 0 or args1 is None else args1),
                              stdout=logs[r][0], stderr=logs[r][1], text=True, env=ENV,
                              start_new_session=True) for r in (0, 1)]
    # Wait for both at once: a node that fails leaves the other's torchrun agent waiting out
    # its 300 s exit barrier, so with `check` a failure ends the wait at once.
    deadline = time.time() + timeout
    while any(p.poll() is None for p in procs) and time.time() < deadline:
        if check and any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    hung = [r for r, p in enumerate(procs) if p.poll() is None]
    for r in hung:
        os.killpg(procs[r].pid, signal.SIGKILL)
        procs[r].wait()
    done = []
    for p, (out, err) in zip(procs, logs, strict=True):
        with out, err:
            out.seek(0)
            err.seek(0)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
    both = "\n".join(f"node {r} (exit {c.returncode}):\n{c.stderr[-3000:]}" for r, c in enumerate(done))
    if check and any(c.returncode for c in done):
        pytest.fail(f"a node failed{f' (node(s) {hung} killed after it)' if hung else ''}:\n{both}")
    if hung:
        pytest.fail(f"node(s) {hung} did not finish in {timeout} s:\n{both}")
    return done


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_two_nodes_train_and_resume_like_one_process(tmp_path):
    """Identical samples, so the data partition cannot matter: two nodes with the global
    batch split over them compute what one process computes. Steps 1-4 log every step;
    the resumed run to step 8 logs every 3rd, so steps 4->5 and 6->7 settle one step late
    (the loss and stop flag all-reduced across the nodes). Rank 0 alone writes the run
    directory (metrics, checkpoints); both ranks resume from its checkpoint."""
    store = make_store(tmp_path / "same", identical=True, flip=False)
    common = ["--save-every", 4, "--loader", "resident", "--lr", "1e-3", "--grad-clip", "0"]
    single = subprocess.run([BIN / "dittrain", *run_args(store, tmp_path / "one", *common, "--max-steps", 8)],
                            capture_output=True, text=True, env=ENV, timeout=300)
    assert single.returncode == 0, single.stderr[-2000:]

    two = tmp_path / "two"
    first = two_nodes("dittrain.cli", run_args(store, two, *common, "--max-steps", 4))
    # c10d ignores --node_rank: global rank 0 is the first node in its (address, pid) order
    assert "global batch 8 = 2 rank(s)" in first[0].stderr + first[1].stderr
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["step_00000004.pt"]
    assert sorted(losses(two)) == [1, 2, 3, 4]
    second = two_nodes("dittrain.cli", run_args(store, two, *common, "--max-steps", 8, "--log-every", 3,
                                                "--resume"))
    assert "resuming at step 4" in second[0].stderr + second[1].stderr

    a, b = losses(tmp_path / "one"), losses(two)
    assert sorted(a) == list(range(1, 9)) and sorted(b) == [1, 2, 3, 4, 6, 8]
    # stated tolerance: float reduction order (all-reduce of two half-batch means)
    np.testing.assert_allclose([a[s] for s in b], [b[s] for s in b], rtol=1e-4)
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["step_00000004.pt", "step_00000008.pt"]
    assert_close_checkpoints(tmp_path / "one", two, ["model", "ema"], rtol=1e-4, atol=1e-5)


def test_two_nodes_encode_like_one_process(class_shards, tmp_path):
    """Each node encodes every other shard into the one --out; rank 0 writes the manifest
    once all exist: the same shards (checksums), stats and identity as one process."""
    common = ["--vae", "pixels", "--resolution", "16", "--device", "cpu", "--workers", "0", "--flip"]
    subprocess.run([BIN / "ditdata", "encode", class_shards, "--out", tmp_path / "single", *common],
                   check=True, capture_output=True, env=ENV, timeout=300)
    two_nodes("ditdata.cli", ["encode", class_shards, "--out", tmp_path / "multi", *common])
    single, multi = open_store(tmp_path / "single", verify=True), open_store(tmp_path / "multi", verify=True)
    assert len(multi.shards) == 4 and len(multi) == 8
    assert ({s.name: s.record["checksum"] for s in single.shards}
            == {s.name: s.record["checksum"] for s in multi.shards})
    assert single.manifest["stats"] == multi.manifest["stats"]
    assert single.identity == multi.identity


def test_lone_node_times_out_with_a_message(tmp_path):
    """A node whose peer never comes (a wrong --nnodes, endpoint or rdzv id on the other
    machine) gives up after the rendezvous join timeout and says so; it never trains."""
    store = make_store(tmp_path / "s", n=6, shards=1)
    t0 = time.time()
    r = subprocess.run(node_command(0, free_port(), "dittrain.cli", run_args(store, tmp_path / "r", "--max-steps", 1),
                                    conf="join_timeout=5"),
                       capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode != 0 and time.time() - t0 < 110
    assert "RendezvousTimeoutError" in r.stderr or "timed out" in r.stderr.lower(), r.stderr[-2000:]
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_node_without_the_store_stops_both(tmp_path):
    """The store (and --out) must be on a filesystem every node sees: a node that cannot open
    the store fails with the store error, and the other node stops too (its peer is gone)
    instead of waiting in a collective."""
    store = make_store(tmp_path / "s", n=6, shards=1)
    args = run_args(store, tmp_path / "r", "--max-steps", 2, "--batch-size", 2)
    lost = run_args(tmp_path / "not-here", tmp_path / "r", "--max-steps", 2, "--batch-size", 2)
    done = two_nodes("dittrain.cli", args, args1=lost, check=False, timeout=120)
    assert [c.returncode != 0 for c in done] == [True, True]
    assert "not-here: no such directory" in done[1].stderr, done[1].stderr[-2000:]
    assert not (tmp_path / "r" / "checkpoints").exists()
