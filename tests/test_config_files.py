"""`--config FILE.toml` on the data side and on sampling (ditdata.common.configfile): the
file's settings under the command line's (a bad key or value: tests/test_run_record.py)."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from cliutil import ditdata, dittrain, one_error_line
from tiny import class_tree

from ditdata.common import configfile


def _toml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_fetch_and_encode_read_their_settings_from_a_file(tmp_path):
    tree = class_tree(tmp_path / "tree", per_class=3, size=40)
    fetch = _toml(tmp_path / "fetch.toml", 'kind = "classes"\nsamples-per-shard = 5\nencode-format = "png"\n'
                                         'processes = 1\nquiet = true\n')
    r = ditdata("fetch", tree, "-o", tmp_path / "shards", "--config", fetch)
    assert r.exit_code == 0, r.output
    assert len(list((tmp_path / "shards").glob("*.tar"))) == 3  # 12 images, 5 per shard
    encode = _toml(tmp_path / "encode.toml", 'vae = "pixels"\nresolution = 16\ndevice = "cpu"\nworkers = 0\n'
                                           'batch-size = 4\nflip = true\n')
    # the command line wins: --no-flip over the file's flip = true
    r = ditdata("encode", tmp_path / "shards", "-o", tmp_path / "store", "--config", encode, "--no-flip")
    assert r.exit_code == 0, r.output
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["num_samples"] == 12
    assert manifest["latent"]["shape"] == [3, 16, 16] and manifest["latent"]["flip"] is False


def test_every_long_command_takes_a_config_file():
    from ditdata.cli import main as data
    from dittrain.cli import main as train

    for group, names in ((data, ["fetch", "score", "filter", "encode"]),
                         (train, ["run", "sample", "eval", "serve", "export"])):
        for name in names:
            assert "--config" in [o for p in group.commands[name].params for o in p.opts], name


def test_sample_reads_a_file(tmp_path):
    conf = _toml(tmp_path / "sample.toml", "steps = 0\n")
    r = dittrain("sample", "--config", conf, "--ckpt", tmp_path)
    assert r.exit_code == 2 and "steps" in one_error_line(r.output) and str(conf) in one_error_line(r.output)


def test_to_toml_reads_back():
    import tomllib

    tables = {"": {"name": 'a "quoted"\\ name\n', "n": 3}, "t": {"x": 1e-4, "on": True, "none": None,
                                                                  "inf": float("inf"), "list": ["a", "b"]}}
    back = tomllib.loads(configfile.to_toml(tables, header="a header\nof two lines"))
    assert back == {"name": 'a "quoted"\\ name\n', "n": 3, "t": {"x": 1e-4, "on": True, "inf": float("inf"),
                                                                   "list": ["a", "b"]}}


def test_given_tells_the_users_settings_from_the_defaults(tmp_path):
    seen = {}

    @click.command()
    @configfile.option()
    @click.option("--a", default=1)
    @click.option("--b", default=2)
    @click.option("--c", default=3)
    def cmd(a, b, c):
        seen.update(given=configfile.given(click.get_current_context()), values=(a, b, c))

    from click.testing import CliRunner

    conf = _toml(tmp_path / "c.toml", "a = 10\nb = 20\n")
    assert CliRunner().invoke(cmd, ["--config", conf, "--b", "5"]).exit_code == 0
    assert seen["values"] == (10, 5, 3) and seen["given"] >= {"a", "b"} and "c" not in seen["given"]


def test_a_repeatable_flag_takes_a_list(tmp_path):
    from ditdata.cli import main as data

    fetch = data.commands["fetch"]
    got = configfile.defaults_from(fetch, tmp_path / "f.toml", {"keep-col": ["similarity", "punsafe"], "threads": 4})
    assert got == {"keep_cols": ["similarity", "punsafe"], "threads": 4}
    for bad, why in (({"keep-col": "similarity"}, "takes a list"), ({"keep-col": [1.5, True]}, "not True"),
                     ({"threads": [4]}, "takes one value")):
        with pytest.raises(click.BadParameter, match=why):
            configfile.defaults_from(fetch, tmp_path / "f.toml", bad)


def test_a_recipe_file_gives_each_command_its_own_table(tmp_path):
    """A file with a [recipe] table: `run` reads [run] (with its section tables), `encode` reads
    [encode], the other commands' tables and the recipe's own are left alone; a command the
    recipe has no table for is told so in one line."""
    import tomllib

    recipe = _toml(tmp_path / "r.toml", '[recipe]\nname = "test"\nsource = "here"\n\n'
                                        '[encode]\nvae = "pixels"\nresolution = 16\n\n'
                                        '[run.model]\nmodel = "DiT-T/4"\n[run.optim]\nlr = 3e-4\nbatch-size = 4\n\n'
                                        '[sample]\nsteps = 7\n')
    r = dittrain("run", "--config", recipe, "--latents", tmp_path, "--out", tmp_path / "run", "--print-config")
    assert r.exit_code == 0, r.output
    printed = tomllib.loads(r.output)
    assert printed["optim"]["lr"] == 3e-4 and printed["optim"]["batch-size"] == 4
    assert printed["model"]["model"] == "DiT-T/4"
    r = dittrain("export", "--config", recipe, "--ckpt", tmp_path, "--out", tmp_path / "x.safetensors")
    assert r.exit_code == 2
    assert "a recipe file without a [export] table (it has [encode], [run], [sample])" in one_error_line(r.output)
    tree = class_tree(tmp_path / "tree", per_class=1, size=24)
    ok = ditdata("fetch", tree, "-o", tmp_path / "shards", "-q", "--processes", 1)
    assert ok.exit_code == 0, ok.output
    r = ditdata("encode", tmp_path / "shards", "-o", tmp_path / "store", "--config", recipe, "--workers", 0, "-q")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "store" / "manifest.json").read_text())["latent"]["shape"] == [3, 16, 16]
