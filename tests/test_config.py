"""ditdata's settings in one place: ditdata/config.py drives the CLI's defaults and choices,
the Python API takes the same dataclasses, and the few values repeated for a light import
agree with their homes."""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
from cliutil import loaded_after
from PIL import Image

from ditdata import config
from ditdata.cli import main as cli
from ditdata.common.hub import hub_cache_dir
from ditdata.config import EncodeConfig, FetchConfig


def test_importing_config_is_cheap():
    assert loaded_after("import ditdata.config, ditdata.common.hub", ("torch", "numpy", "PIL", "pyarrow")) == []


def test_repeated_values_agree_with_their_homes():
    from ditdata import images
    from ditdata.imageshards import folder as imageshards
    from ditdata.store import backends, writer
    from ditdata.store.defaults import BACKENDS, CHUNK_SAMPLES, DEFAULT_BACKEND

    assert config.RESIZE_MODES == images.RESIZE_MODES
    assert imageshards.KINDS is config.KINDS
    assert tuple(backends.BACKEND_CLASSES) == BACKENDS and DEFAULT_BACKEND in BACKENDS
    assert backends.get_backend("zarr").chunk_samples == backends.get_backend("wds").chunk_samples == CHUNK_SAMPLES
    assert EncodeConfig("a", "b").chunk_samples == CHUNK_SAMPLES
    assert writer.StoreWriter.__init__.__kwdefaults__["chunk_samples"] == CHUNK_SAMPLES


def _cli_defaults(command: str) -> dict:
    return {p.name: p.default for p in cli.commands[command].params if p.name not in ("source", "shards")}


@pytest.mark.parametrize("command, cls", [("fetch", FetchConfig), ("encode", EncodeConfig)])
def test_cli_defaults_are_the_config_defaults(command, cls):
    opts = _cli_defaults(command)
    for f in fields(cls):
        if f.name in opts and f.default is not MISSING:
            assert opts[f.name] == f.default or (f.default == () and opts[f.name] in ((), None)), f.name
    covered = {f.name for f in fields(cls)} & set(opts)
    assert covered >= {f.name for f in fields(cls)} - {"shards", "out", "extra", "progress", "max_pixels"}


def test_cli_choices_are_the_config_choices():
    params = {p.name: p for p in cli.commands["fetch"].params} | {
        f"encode_{p.name}": p for p in cli.commands["encode"].params}
    assert tuple(params["kind"].type.choices) == config.KINDS
    assert tuple(params["resize_mode"].type.choices) == config.RESIZE_MODES
    assert tuple(params["distributor"].type.choices) == config.DISTRIBUTORS
    assert tuple(params["encode_posterior"].type.choices) == config.POSTERIORS
    assert tuple(params["encode_dtype"].type.choices) == config.DTYPES


def _tree(root: Path) -> Path:
    for i in range(3):
        (root / "cls").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (16 + i, 16), (i * 40, 10, 200)).save(root / "cls" / f"{i}.png")
    (root / "cls" / "broken.png").write_bytes(b"not a png")
    return root


def test_fetch_takes_a_config_or_keywords(tmp_path):
    from ditdata.fetch import fetch

    src = _tree(tmp_path / "src")
    a = fetch(src, tmp_path / "a", FetchConfig(samples_per_shard=2, processes=1, progress=False))
    b = fetch(src, tmp_path / "b", samples_per_shard=2, processes=1, progress=False)
    assert a["options"] == b["options"] and a["num_samples"] == b["num_samples"] == 3
    with pytest.raises(TypeError):
        fetch(src, tmp_path / "c", FetchConfig(), processes=1)
    with pytest.raises(TypeError):
        fetch(src, tmp_path / "c", no_such_option=1)


def test_folder_stats_name_read_failures_honestly(tmp_path):
    from ditdata.fetch import fetch
    from ditdata.imageshards.folder import read_shard_stats

    src = _tree(tmp_path / "src")
    (src / "cls" / "gone.png").symlink_to(tmp_path / "nowhere.png")  # listed, cannot be read
    info = fetch(src, tmp_path / "o", kind="classes", samples_per_shard=10, processes=1, progress=False)
    (stats,) = read_shard_stats(tmp_path / "o").values()
    assert stats["status_dict"] == {"success": 3, "not an image": 1, "read error": 1}
    assert (stats["failed_to_read"], stats["failed_to_resize"]) == (1, 1)
    assert "failed_to_download" not in stats  # a folder downloads nothing
    s = info["summary"]
    assert (s["failed_to_download"], s["failed_to_read"], s["failed_to_resize"], s["failed"]) == (0, 1, 1, 2)
    assert json.loads((tmp_path / "o" / "dataset.json").read_text())["summary"] == s


def test_hub_cache_follows_huggingface_hub_order(tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", "~/old")
    assert hub_cache_dir() == tmp_path / "home" / "old"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "new"))
    assert hub_cache_dir() == tmp_path / "new"

