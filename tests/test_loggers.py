"""dittrain run --logger: metrics.jsonl always, TensorBoard and W&B (offline here) with the
EMA sample grids as images; W&B never stops a run; clear errors for bad --logger values."""

from __future__ import annotations

import json
import re
import socket
import sys
from pathlib import Path

import pytest
from cliutil import dittrain, one_error_line, run_args

from dittrain.train.loggers import parse_loggers

pytestmark = pytest.mark.usefixtures("one_thread")
GRIDS = ["--sample-every", "2", "--sample-steps", "2"]  # grids at steps 2 and 4 of a 4-step run


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """W&B offline, its settings and caches under tmp_path, every HTTP(S) request it might make
    pointed at a local listener (`wandb_env.connections()`: how many reached it), and a guard
    that fails any connection of this process beyond the local machine."""
    pytest.importorskip("wandb")
    home = tmp_path / "home"
    home.mkdir()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    for name, value in {"WANDB_MODE": "offline", "HOME": home, "WANDB_CONFIG_DIR": home / "cfg",
                        "WANDB_CACHE_DIR": home / "cache", "WANDB_DATA_DIR": home / "data", "WANDB_BASE_URL": url,
                        "HTTP_PROXY": url, "HTTPS_PROXY": url, "http_proxy": url, "https_proxy": url}.items():
        monkeypatch.setenv(name, str(value))
    # the variables that replace ditkit's choices (RUN/wandb/, the kept id, ...) start unset
    for name in ("WANDB_API_KEY", "WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    connect = socket.socket.connect

    def local_only(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"network connection to {address} during a test")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", local_only)

    class Env:
        @staticmethod
        def connections() -> int:
            n = 0
            while True:
                try:
                    conn, _ = listener.accept()
                except BlockingIOError:
                    return n
                conn.close()
                n += 1

    yield Env
    listener.close()
    import wandb

    wandb.teardown()  # the next test starts its own W&B service, with its own environment


def _records(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def _wandb_records(path: Path):
    """The records of a .wandb file (a LevelDB-style log of 32 KiB blocks after a 7-byte
    header, each chunk a 7-byte header (crc, length, kind) and data)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, part = path.read_bytes(), 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            rec = pb.Record()
            rec.ParseFromString(part)
            part = b""
            yield rec


def _wandb_history(path: Path) -> dict[int, dict]:
    """{step: {tag: value}} from a .wandb file."""
    history = {}
    for rec in _wandb_records(path):
        if rec.WhichOneof("record_type") == "history":
            row = history.setdefault(rec.history.step.num, {})
            row |= {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
    return history


def _wandb_run(folder: Path) -> tuple[Path, dict]:
    """(the offline run folder under `folder`/wandb, what its .wandb file says of the run: id,
    project, name); exactly one such folder. W&B's service process writes the file and may still
    hold part of it in its buffers after run.finish() returns (seen on a loaded machine: no run
    record yet): tearing the service down closes the file first."""
    import wandb

    wandb.teardown()
    (run_dir,) = (folder / "wandb").glob("offline-run-*")
    (log,) = run_dir.glob("run-*.wandb")
    (run,) = (rec.run for rec in _wandb_records(log) if rec.WhichOneof("record_type") == "run")
    return run_dir, {"id": run.run_id, "project": run.project, "name": run.display_name}


def _wandb_run_folders(folder: Path, run_id: str) -> list[Path]:
    """The offline folders W&B made under `folder`/wandb for `run_id`: offline-run-DATE_TIME-ID, with
    '-1', '-2'... added when a resume starts within the same second as the folder before it."""
    named = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    return [p for p in (folder / "wandb").iterdir() if named.fullmatch(p.name)]


def test_logger_names():
    assert parse_loggers("tensorboard") == ["jsonl", "tensorboard"]
    assert parse_loggers(" wandb, jsonl,wandb ") == ["jsonl", "wandb"]
    assert parse_loggers("") == ["jsonl"]


def test_tensorboard_gets_the_grids_and_jsonl_is_kept(store, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    r = dittrain(*run_args(store, out, "--max-steps", 4, *GRIDS, "--logger", "tensorboard"))
    assert r.exit_code == 0, r.output
    assert [rec["step"] for rec in _records(out)] == [1, 2, 3, 4]
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    assert "samples/ema" in acc.Tags()["images"]
    images = acc.Images("samples/ema")
    assert [e.step for e in images] == [2, 4]
    assert images[0].encoded_image_string.startswith(b"\x89PNG")
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    assert not (out / "wandb").exists()


def test_wandb_offline_logs_scalars_and_grids_and_a_resume_continues_its_run(store, tmp_path, wandb_env):
    out = tmp_path / "run"
    r = dittrain(*run_args(store, out, "--max-steps", 4, *GRIDS, "--logger", "wandb"))
    assert r.exit_code == 0, r.output
    run_id = (out / "wandb_id.txt").read_text().strip()
    assert f"wandb run {run_id} (offline" in r.output
    run_dir, run = _wandb_run(out)
    # nothing in W&B's environment: ditkit's project, the run folder's name, RUN/wandb/
    assert run == {"id": run_id, "project": "ditkit", "name": "run"} and run_dir.name.endswith(run_id)
    pngs = sorted((run_dir / "files" / "media" / "images" / "samples").glob("ema_*.png"))
    assert len(pngs) == 2 and all(p.read_bytes().startswith(b"\x89PNG") for p in pngs)
    history = _wandb_history(run_dir / f"run-{run_id}.wandb")
    losses = {rec["step"]: rec["loss"] for rec in _records(out)}
    assert losses.keys() == {1, 2, 3, 4}
    assert {step: row["train/loss"] for step, row in history.items() if "train/loss" in row} == losses
    grids = {step: row["samples/ema/path"] for step, row in history.items() if "samples/ema/path" in row}
    assert grids.keys() == {2, 4} and sorted(grids.values()) == [str(p.relative_to(run_dir / "files")) for p in pngs]
    assert not (out / "tensorboard").exists()  # --logger wandb: W&B and metrics.jsonl only

    r = dittrain(*run_args(store, out, "--max-steps", 5, "--logger", "wandb", "--resume"))
    assert r.exit_code == 0, r.output
    assert (out / "wandb_id.txt").read_text().strip() == run_id  # the same W&B run goes on
    assert len(_wandb_run_folders(out, run_id)) == 2
    assert wandb_env.connections() == 0  # offline: not one request


def test_wandb_follows_its_environment_variables(store, tmp_path, wandb_env, monkeypatch):
    elsewhere = tmp_path / "wandb_dir"
    elsewhere.mkdir()
    for name, value in {"WANDB_PROJECT": "env-project", "WANDB_NAME": "env-name", "WANDB_RUN_ID": "envrun01",
                        "WANDB_DIR": elsewhere}.items():
        monkeypatch.setenv(name, str(value))
    out = tmp_path / "run"
    r = dittrain(*run_args(store, out, "--max-steps", 2, "--logger", "wandb"))
    assert r.exit_code == 0, r.output
    assert "wandb run envrun01 (offline" in r.output
    run_dir, run = _wandb_run(elsewhere)  # WANDB_DIR, not RUN/wandb/
    assert run == {"id": "envrun01", "project": "env-project", "name": "env-name"}
    assert run_dir.name.endswith("-envrun01") and not (out / "wandb").exists()
    assert (out / "wandb_id.txt").read_text().strip() == "envrun01"  # the id used, for a resume

    # a resume without WANDB_RUN_ID continues the same W&B run: the kept id
    monkeypatch.delenv("WANDB_RUN_ID")
    r = dittrain(*run_args(store, out, "--max-steps", 3, "--logger", "wandb", "--resume"))
    assert r.exit_code == 0, r.output
    assert "wandb run envrun01 (offline" in r.output
    assert len(_wandb_run_folders(elsewhere, "envrun01")) == 2
    assert wandb_env.connections() == 0


def test_wandb_flags_win_over_its_environment(store, tmp_path, wandb_env, monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "env-project")
    monkeypatch.setenv("WANDB_NAME", "env-name")
    out = tmp_path / "run"
    r = dittrain(*run_args(store, out, "--max-steps", 1, "--logger", "wandb", "--wandb-project", "flag-project",
                           "--wandb-name", "flag-name"))
    assert r.exit_code == 0, r.output
    _, run = _wandb_run(out)
    assert (run["project"], run["name"]) == ("flag-project", "flag-name")
    assert run["id"] == (out / "wandb_id.txt").read_text().strip()


def test_wandb_init_args(tmp_path, monkeypatch):
    from dittrain.train.loggers import wandb_init_args

    for name in ("WANDB_PROJECT", "WANDB_NAME", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "my-run"
    out.mkdir()
    (out / "wandb_id.txt").write_text("kept0001\n")
    args = wandb_init_args(out, project="", name="", resumed=True)  # the config's defaults
    assert args == {"project": "ditkit", "name": "my-run", "dir": str(out), "id": "kept0001", "resume": "allow"}
    assert wandb_init_args(out, project="", name=None, resumed=False)["project"] == "ditkit"
    assert wandb_init_args(out, project="p", name="n", resumed=False)["id"] != "kept0001"  # a fresh run
    for name in ("WANDB_PROJECT", "WANDB_NAME", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.setenv(name, "x")
    assert wandb_init_args(out, project="", name="", resumed=True) == {}  # W&B reads its variables
    assert wandb_init_args(out, project="ditkit", name="", resumed=True) == {"project": "ditkit"}  # a flag wins
    assert wandb_init_args(out, project="p", name="n", resumed=True) == {"project": "p", "name": "n"}


@pytest.mark.parametrize("how", ["init raises", "service unreachable"])
def test_wandb_that_cannot_start_is_a_note(store, tmp_path, wandb_env, monkeypatch, how):
    import wandb

    if how == "init raises":
        def broken(**kwargs):
            raise RuntimeError("no route to host (simulated)")

        monkeypatch.setattr(wandb, "init", broken)
    else:  # online against a closed port, with a short init timeout
        closed = socket.create_server(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        closed.close()
        monkeypatch.setenv("WANDB_MODE", "online")
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
        monkeypatch.setenv("WANDB_INIT_TIMEOUT", "2")
    out = tmp_path / "run"
    r = dittrain(*run_args(store, out, "--max-steps", 2, "--logger", "tensorboard,wandb"))
    assert r.exit_code == 0, r.output
    notes = [ln for ln in r.output.splitlines() if "wandb did not start" in ln]
    assert len(notes) == 1 and "training goes on without it" in notes[0], r.output
    assert [rec["step"] for rec in _records(out)] == [1, 2]
    assert not (out / "wandb_id.txt").exists()


def test_a_failed_wandb_log_call_is_one_note(store, tmp_path, wandb_env, monkeypatch):
    from wandb.sdk.wandb_run import Run

    def broken(self, *args, **kwargs):
        raise ConnectionError("service went away (simulated)")

    monkeypatch.setattr(Run, "log", broken)
    out = tmp_path / "run"
    r = dittrain(*run_args(store, out, "--max-steps", 3, "--logger", "wandb"))
    assert r.exit_code == 0, r.output
    assert r.output.count("wandb logging failed (ConnectionError: service went away (simulated))") == 1, r.output
    assert [rec["step"] for rec in _records(out)] == [1, 2, 3]


def refused(store, tmp_path, loggers: str) -> str:
    """`dittrain run --logger LOGGERS` fails before the run starts (no run folder): its one error line."""
    r = dittrain(*run_args(store, tmp_path / "run", "--max-steps", 2, "--logger", loggers))
    assert r.exit_code != 0
    assert not (tmp_path / "run").exists()
    return one_error_line(r.output)


def test_an_unknown_logger_is_one_line(store, tmp_path):
    assert "unknown logger 'nonsense'" in refused(store, tmp_path, "tensorboard,nonsense")


def test_wandb_without_its_extra_is_one_line(store, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb: ImportError
    assert "pip install 'ditkit[wandb]'" in refused(store, tmp_path, "wandb")
