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


# ------------------------------------------------------------------ YAML, JSON, --SECTION.KEY, -v


def _printed(*args) -> str:
    """`dittrain run ... --print-config`: the resolved settings as TOML (nothing runs)."""
    r = dittrain("run", *args, "--print-config")
    assert r.exit_code == 0, r.output
    return r.output


RUN_TOML = ('[optim]\nlr = 1e-4\nbatch-size = 64\nema = 0.999\n[performance]\ntf32 = false\n'
            '[logging]\nsample-classes = "1,2"\n')


def test_yaml_and_json_files_mean_what_the_toml_file_means(tmp_path):
    toml = _printed("--config", _toml(tmp_path / "run.toml", RUN_TOML))
    assert 'lr = 0.0001' in toml and "batch-size = 64" in toml and "tf32 = false" in toml
    yaml_text = ("optim:\n  lr: 1e-4        # YAML 1.1 would read a string here\n  batch-size: 64\n  ema: 0.999\n"
                 "performance: {tf32: false}\nlogging:\n  sample-classes: \"1,2\"\n  sample-every: ~\n")
    for name in ("run.yaml", "run.yml"):
        assert _printed("--config", _toml(tmp_path / name, yaml_text)) == toml
    as_json = {"optim": {"lr": 1e-4, "batch_size": 64, "ema": 0.999}, "performance": {"tf32": False},
               "logging": {"sample-classes": "1,2", "log-every": None}}
    assert _printed("--config", _toml(tmp_path / "run.json", json.dumps(as_json))) == toml
    # a recipe file in YAML: [run] with its sections
    recipe = "recipe: {name: toy}\nrun:\n  optim: {lr: 1e-4, batch-size: 64, ema: 0.999}\n  performance: {tf32: false}\n" \
             "  logging: {sample-classes: '1,2'}\n"
    assert _printed("--config", _toml(tmp_path / "recipe.yaml", recipe)) == toml


@pytest.mark.parametrize("name, text, needle", [
    ("bad.yaml", "optim: [lr: 1\n", "not valid YAML"),
    ("bad.json", '{"optim": {"lr": 1e-4,}}', "not valid JSON"),
    ("list.yaml", "- lr\n- 1e-4\n", "must be a table of keys"),
    ("run.ini", "[optim]\nlr = 1\n", "is .toml, .yaml, .yml or .json"),
    ("type.yaml", "optim: {lr: fast}\n", "[optim] lr: takes a number"),
    ("where.json", '{"model": {"lr": 0.1}}', "belongs in the [optim] table"),
])
def test_a_bad_yaml_or_json_file_is_one_line(tmp_path, name, text, needle):
    r = dittrain("run", "--config", _toml(tmp_path / name, text), "--print-config")
    line = one_error_line(r.output)
    assert r.exit_code == 2 and needle in line and name in line, line


def test_dotted_flags_are_the_files_keys(tmp_path):
    plain = _printed("--lr", "1e-4", "--batch-size", "64", "--ema", "0.999", "--no-tf32", "--sample-classes", "1,2")
    assert _printed("--optim.lr", "1e-4", "--optim.batch-size=64", "--optim.ema", "0.999", "--performance.tf32",
                    "false", "--logging.sample_classes", "1,2") == plain
    assert _printed("--optim.lr=1e-4", "--optim.batch_size", "64", "--optim.ema=0.999", "--performance.no-tf32",
                    "--logging.sample-classes=1,2") == plain
    assert _printed("--config", _toml(tmp_path / "run.toml", RUN_TOML)) == plain
    # the command line wins over the file, dotted or not
    assert "lr = 0.002" in _printed("--config", tmp_path / "run.toml", "--optim.lr", "2e-3")
    assert "tf32 = true" in _printed("--config", tmp_path / "run.toml", "--performance.tf32")
    assert "tf32 = true" in _printed("--config", tmp_path / "run.toml", "--performance.tf32=on")
    # dittrain plan takes them too (its own section: plan)
    r = dittrain("plan", "--plan.gpu-memory", "24GiB", "--model.model", "DiT-B/2", "--plan.latent-shape", "4x32x32",
                 "--plan.classes", "10")
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("args, needle", [
    (("--optim.lrr", "1"), "--optim.lrr: no such key in the optim section (did you mean --optim.lr?)"),
    (("--model.lr", "1"), "--model.lr: no such key in the model section (--lr is in the optim section)"),
    (("--opt.lr", "1"), "--opt.lr: no section 'opt'; the sections are data, model"),
    (("--performance.tf32=maybe",), "--performance.tf32: takes true or false, not 'maybe'"),
])
def test_a_bad_dotted_flag_is_one_line(args, needle):
    r = dittrain("run", *args, "--print-config")
    assert r.exit_code == 2 and needle in one_error_line(r.output), r.output


def test_verbose_is_the_spelling_of_ditkit_debug(tmp_path, monkeypatch):
    from ditdata.common.cli import DEBUG_ENV
    from ditdata.store.errors import StoreError

    monkeypatch.setenv(DEBUG_ENV, "0")  # restored after the test, whatever -v sets
    r = dittrain("run", "--latents", tmp_path / "nowhere", "--out", tmp_path / "run")
    assert "no such directory" in one_error_line(r.output)
    for flag in ("-v", "--verbose"):
        monkeypatch.setenv(DEBUG_ENV, "0")
        r = dittrain("run", "--latents", tmp_path / "nowhere", "--out", tmp_path / "run", flag)
        assert isinstance(r.exception, StoreError), r.output  # the traceback, not one line
        r = ditdata("inspect", tmp_path / "nowhere", flag)
        assert r.exception is not None and not isinstance(r.exception, SystemExit), r.output
    from ditdata.cli import main as data
    from dittrain.cli import main as train

    for group in (data, train):
        for name, command in group.commands.items():
            assert "--verbose" in [o for p in command.params for o in p.opts], name
