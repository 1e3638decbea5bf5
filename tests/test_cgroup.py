"""dittrain.data.budget: the room left under this process's cgroup memory limit, read from a
fake cgroup tree: cgroup v2 at the path /proc/self/cgroup names and its parents (a Slurm job
without a cgroup namespace), the root files (a namespaced container), v1's memory controller;
and `--loader auto` streams a store that the job's limit cannot hold."""

from __future__ import annotations

from pathlib import Path

import pytest
from storeutil import schema, write_store

import dittrain.data as data
from ditdata.store import open_store
from dittrain.data import budget, choose_loader

MiB, GiB = 2**20, 2**30
JOB = "/slurm/uid_1/job_5"
STEP = JOB + "/step_0/user/task_0"


def fake_tree(tmp_path: Path, proc: str, files: dict[str, str | bytes]) -> tuple[Path, Path]:
    """(the /proc/self/cgroup file holding `proc`, a cgroup root holding `files`: path -> text)."""
    root = tmp_path / "cgroup"
    root.mkdir(parents=True)
    for rel, text in files.items():
        path = root / rel.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        _write(path, text)
    proc_file = tmp_path / "proc_self_cgroup"
    _write(proc_file, proc)
    return proc_file, root


def _write(path: Path, content: str | bytes | None) -> None:
    """Text or bytes into `path`; None: no such file."""
    if content is None:
        path.unlink(missing_ok=True)
    else:
        (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)


def v2_level(path: str, limit: str, current: int, inactive: int | None = None) -> dict[str, str]:
    """The memory files of one cgroup v2 directory."""
    files = {f"{path}/memory.max": f"{limit}\n", f"{path}/memory.current": f"{current}\n"}
    if inactive is not None:
        files[f"{path}/memory.stat"] = f"anon {current}\nfile {inactive}\ninactive_file {inactive}\n"
    return files


def room(tmp_path, proc, files):
    proc_file, root = fake_tree(tmp_path, proc, files)
    return budget._cgroup_available(proc_cgroup=str(proc_file), root=root)


def test_v2_the_tightest_limit_is_at_a_parent(tmp_path):
    # Slurm: the job's limit on .../job_5, the step's task cgroup below it has none
    files = {**v2_level(STEP, "max", 1 * GiB), **v2_level(JOB, str(8 * GiB), 3 * GiB),
             **v2_level("/slurm/uid_1", str(64 * GiB), 3 * GiB), **v2_level("/slurm", "max", 40 * GiB)}
    assert room(tmp_path, f"0::{STEP}\n", files) == (5 * GiB, f"the cgroup memory limit of {JOB} (memory.max)")


def test_v2_the_tightest_limit_is_at_the_leaf(tmp_path):
    files = {**v2_level(STEP, str(2 * GiB), GiB // 2), **v2_level(JOB, str(8 * GiB), GiB)}
    assert room(tmp_path, f"0::{STEP}\n", files) == (
        GiB + GiB // 2, f"the cgroup memory limit of {STEP} (memory.max)")


def test_v2_tightest_room_not_smallest_limit(tmp_path):
    # the parent's limit is larger, but its other children use most of it
    files = {**v2_level(STEP, str(4 * GiB), GiB), **v2_level(JOB, str(6 * GiB), 5 * GiB)}
    assert room(tmp_path, f"0::{STEP}\n", files)[0] == GiB


def test_v2_without_any_limit_is_none(tmp_path):
    files = {**v2_level(STEP, "max", GiB), **v2_level(JOB, "max", GiB), **v2_level("/", "max", GiB)}
    assert room(tmp_path, f"0::{STEP}\n", files) is None
    assert room(tmp_path / "empty", f"0::{STEP}\n", {}) is None  # no cgroup files at all


def test_inactive_page_cache_counts_as_room(tmp_path):
    # an earlier step that read the store left 3 GiB of page cache charged to the job
    files = v2_level(JOB, str(8 * GiB), 7 * GiB, inactive=3 * GiB)
    assert room(tmp_path, f"0::{JOB}\n", files)[0] == 4 * GiB


def test_a_namespaced_container_reads_the_root_files(tmp_path):
    files = v2_level("/", str(2 * GiB), GiB // 2)
    assert room(tmp_path, "0::/\n", files) == (GiB + GiB // 2, "the cgroup memory limit of / (memory.max)")
    # no namespace, but the container's own cgroup mounted as the root: the named path is not
    # there, its files are
    assert room(tmp_path / "bind", "0::/docker/abc123\n", files)[0] == GiB + GiB // 2


def test_v1_memory_controller_and_its_parents(tmp_path):
    unlimited = str(9223372036854771712)  # v1's "no limit"
    files = {f"/memory{STEP}/memory.limit_in_bytes": unlimited, f"/memory{STEP}/memory.usage_in_bytes": str(GiB),
             f"/memory{JOB}/memory.limit_in_bytes": str(4 * GiB), f"/memory{JOB}/memory.usage_in_bytes": str(GiB),
             f"/memory{JOB}/memory.stat": f"inactive_file 1\ntotal_inactive_file {GiB // 2}\n",
             "/memory/memory.limit_in_bytes": unlimited}
    proc = f"12:pids:/x\n4:memory:{STEP}\n3:cpu,cpuacct:/y\n0::/\n"
    assert room(tmp_path, proc, files) == (
        3 * GiB + GiB // 2, f"the cgroup memory limit of {JOB} (memory.limit_in_bytes)")
    # the same limit listed with other controllers on one hierarchy
    assert room(tmp_path / "joined", f"4:cpu,memory:{STEP}\n", files)[0] == 3 * GiB + GiB // 2
    files[f"/memory{JOB}/memory.limit_in_bytes"] = unlimited
    assert room(tmp_path / "none", proc, files) is None


def test_hybrid_takes_the_tighter_of_v2_and_v1(tmp_path):
    files = {**v2_level(JOB, str(8 * GiB), GiB), f"/memory{JOB}/memory.limit_in_bytes": str(3 * GiB),
             f"/memory{JOB}/memory.usage_in_bytes": str(GiB)}
    assert room(tmp_path, f"4:memory:{JOB}\n0::{JOB}\n", files) == (
        2 * GiB, f"the cgroup memory limit of {JOB} (memory.limit_in_bytes)")


@pytest.mark.parametrize("garbage", ["", "lots\n", "-5\n", "0\n", b"\xff\xfe\x00"])
def test_unreadable_or_garbage_files_are_ignored(tmp_path, garbage):
    files = {**v2_level(STEP, "max", GiB), f"{JOB}/memory.max": garbage, f"{JOB}/memory.current": "1",
             **v2_level("/slurm/uid_1", str(16 * GiB), 4 * GiB)}
    assert room(tmp_path, f"0::{STEP}\n", files) == (12 * GiB, "the cgroup memory limit of /slurm/uid_1 (memory.max)")


def test_garbage_usage_or_stat_leaves_the_limit(tmp_path):
    # a limit whose usage cannot be read is still an upper bound on the room
    files = {f"{JOB}/memory.max": str(2 * GiB), f"{JOB}/memory.current": "n/a", f"{JOB}/memory.stat": b"\xff\x00 x"}
    assert room(tmp_path, f"0::{JOB}\n", files)[0] == 2 * GiB


@pytest.mark.parametrize("proc", [None, "", "garbage\nno colons here\n", b"\xff\xfe", "0::/../../elsewhere\n"])
def test_a_missing_or_odd_proc_file_reads_the_root(tmp_path, proc):
    root = tmp_path / "cgroup"
    fake_tree(tmp_path, "", v2_level("/", str(2 * GiB), GiB))
    proc_file = tmp_path / "proc_self_cgroup"
    _write(proc_file, proc)
    assert budget._cgroup_available(proc_cgroup=str(proc_file), root=root)[0] == GiB


@pytest.fixture
def slurm_job(tmp_path, monkeypatch):
    """This process in a Slurm job with 1 GiB left under its limit, on a machine with 64 GiB free;
    returns a function that sets the job's limit (usage 0)."""
    proc_file, root = fake_tree(tmp_path, f"0::{STEP}\n", {**v2_level(STEP, "max", 0), **v2_level(JOB, str(GiB), 0)})
    monkeypatch.setattr(budget, "PROC_CGROUP", str(proc_file))
    monkeypatch.setattr(budget, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(budget, "_meminfo_available", lambda: 64 * GiB)

    def limit(nbytes: int) -> None:
        (root / JOB.lstrip("/") / "memory.max").write_text(f"{nbytes}\n")

    return limit


def test_available_memory_reports_the_jobs_limit(slurm_job):
    assert data.available_memory() == (GiB, f"the cgroup memory limit of {JOB} (memory.max)")
    slurm_job(128 * GiB)  # a limit above the free RAM: the RAM is what is left
    assert data.available_memory() == (64 * GiB, "MemAvailable in /proc/meminfo")


def test_loader_auto_streams_a_store_larger_than_the_jobs_limit(slurm_job, tmp_path):
    write_store(tmp_path / "s", schema("float16"), [40, 40])
    store = open_store(tmp_path / "s")
    need = len(store) * data.base._Spec(store).resident_bytes
    slurm_job(need)  # the whole store would fill the job's memory: over the 50% limit
    kind, _, reason = choose_loader(store, kind="auto")
    assert kind == "streaming" and f"the cgroup memory limit of {JOB} (memory.max)" in reason
    slurm_job(4 * need)  # fits in the job's limit
    kind, _, reason = choose_loader(store, kind="auto")
    assert kind == "resident" and JOB in reason
    slurm_job(MiB)  # and the streaming budget is sized to the job too
    assert data.loader_budget("auto")[0] == MiB // 4
