"""dittrain.data: an explicitly requested resident loader refuses a store it cannot hold."""

from __future__ import annotations

import pytest
from cliutil import raises_one_line
from storeutil import schema, write_store

import dittrain.data as data
from ditdata.store import open_store
from dittrain.data import LoaderConfig, LoaderError, ResidentLoader, StreamingLoader, build_loader, choose_loader

SIZES = [10, 14]
B = 4


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    write_store(root, schema("float16"), SIZES)
    return open_store(root)


def need(store) -> int:
    return sum(SIZES) * data.base._Spec(store).resident_bytes


def fake_ram(monkeypatch, nbytes: int) -> None:
    monkeypatch.setattr(data.budget, "available_memory", lambda: (nbytes, "test figure"))


def test_explicit_resident_refuses_a_store_larger_than_ram(store, monkeypatch):
    fake_ram(monkeypatch, need(store) // 2)
    msg = raises_one_line(LoaderError, lambda: choose_loader(store, kind="resident"))
    assert data.budget._gib(need(store)) in msg and data.budget._gib(need(store) // 2) in msg  # need and available
    assert "test figure" in msg and "RAM" in msg  # where the figure came from
    assert "--loader streaming" in msg
    with pytest.raises(LoaderError):  # build_loader refuses before allocating anything
        build_loader(store, LoaderConfig(kind="resident"), batch_size=B)


def test_headroom_is_kept(store, monkeypatch):
    """Just over the need is not enough: the last 10% of the memory stays free."""
    fake_ram(monkeypatch, int(need(store) * 1.05))
    with pytest.raises(LoaderError, match="at most 90%"):
        choose_loader(store, kind="resident")


def test_auto_falls_back_to_streaming(store, monkeypatch):
    fake_ram(monkeypatch, need(store) // 2)
    kind, _, reason = choose_loader(store, kind="auto")
    assert kind == "streaming" and "over the 50% limit" in reason
    with build_loader(store, LoaderConfig(workers=0), batch_size=B) as loader:
        assert isinstance(loader, StreamingLoader)
        assert next(loader)["x"].shape[0] == B


def test_store_that_fits_is_accepted(store, monkeypatch):
    fake_ram(monkeypatch, need(store) * 2)  # 50%: within 90%
    kind, rdev, reason = choose_loader(store, kind="resident")
    assert (kind, rdev) == ("resident", "cpu")
    assert reason.startswith("resident: requested") and "50% of the available" in reason
    with build_loader(store, LoaderConfig(kind="resident"), batch_size=B) as loader:
        assert isinstance(loader, ResidentLoader) and next(loader)["x"].shape[0] == B


def test_ranks_of_one_machine_share_its_ram(store, monkeypatch):
    fake_ram(monkeypatch, need(store) * 2)  # the whole store fits once, not twice
    assert choose_loader(store, kind="resident", world_size=2, local_world_size=1)[0] == "resident"
    with pytest.raises(LoaderError, match="x 2 ranks on this machine"):
        choose_loader(store, kind="resident", world_size=2, local_world_size=2, split="batch")


def test_unknown_memory_is_not_refused(store, monkeypatch):
    monkeypatch.setattr(data.budget, "available_memory", lambda: (None, "unknown"))
    kind, _, reason = choose_loader(store, kind="resident")
    assert kind == "resident" and "not checked" in reason


def test_gpu_resident_uses_the_gpu_figure(store, monkeypatch):
    """resident_device="cuda" is checked against the GPU's free memory, not the RAM (no GPU
    needed: the figure comes from gpu_memory, replaced here)."""
    fake_ram(monkeypatch, 10**15)  # plenty of RAM must not matter
    monkeypatch.setattr(data.budget, "gpu_memory", lambda dev: (need(store) // 3, f"free memory of {dev}"))
    with pytest.raises(LoaderError) as e:
        choose_loader(store, kind="resident", resident_device="cuda")
    assert "of cuda" in str(e.value) and data.budget._gib(need(store) // 3) in str(e.value)
    monkeypatch.setattr(data.budget, "gpu_memory", lambda dev: (need(store) * 4, f"free memory of {dev}"))
    assert choose_loader(store, kind="resident", resident_device="cuda")[:2] == ("resident", "cuda")
