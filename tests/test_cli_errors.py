"""What a tired user types: every CLI error path exits non-zero with ONE line that names
the bad input, and no traceback (nor the catch-all "internal error" line, which would
mean the case is handled by accident)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny import class_tree, fetch_tree

from ditdata.cli import main as ditdata_cli
from dittrain.cli import main as dittrain_cli

CLIS = {"ditdata": ditdata_cli, "dittrain": dittrain_cli}


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, Path]:
    """Good inputs (image shards, a store, a run, a scored caption folder) and damaged
    copies of them."""
    root = tmp_path_factory.mktemp("cli")
    e = {"root": root}
    e["tree"] = class_tree(root / "tree", per_class=2, size=40)
    e["shards"] = fetch_tree(e["tree"], root / "shards", samples_per_shard=2)
    run = CliRunner().invoke
    r = run(ditdata_cli, ["encode", str(e["shards"]), "--vae", "pixels", "--resolution", "32", "--out",
                          str(root / "store"), "--workers", "0", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    e["store"] = root / "store"
    r = run(dittrain_cli, ["run", "--latents", str(e["store"]), "--out", str(root / "run"), "--model", "DiT-T/4",
                           "--batch-size", "4", "--max-steps", "2", "--sample-every", "0", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    e["run"] = root / "run"
    e["file"] = root / "a.txt"
    e["file"].write_text("hello")
    (root / "empty").mkdir()
    e["empty"] = root / "empty"

    def damaged_store(name, edit):
        d = root / name
        shutil.copytree(e["store"], d)
        m = json.loads((d / "manifest.json").read_text())
        edit(m)
        (d / "manifest.json").write_text(json.dumps(m))
        return d

    e["manifest_badjson"] = root / "badjson"
    shutil.copytree(e["store"], e["manifest_badjson"])
    (e["manifest_badjson"] / "manifest.json").write_text("{not json")
    e["manifest_shard_int"] = damaged_store("shard_int", lambda m: m["shards"].__setitem__(0, 5))
    e["manifest_latent"] = damaged_store("latent", lambda m: m.__setitem__("latent", {"shape": [3]}))
    e["manifest_cond"] = damaged_store("cond", lambda m: m.__setitem__("conditioning", None))
    e["manifest_files"] = damaged_store("files", lambda m: m["shards"][0].__setitem__("files", ["x"]))
    e["manifest_escape"] = damaged_store("escape", lambda m: m["shards"][0].__setitem__("path", "../../etc"))
    e["manifest_vae"] = damaged_store("vae", lambda m: m.__setitem__("vae", "x"))
    e["store_config"] = root / "store_config"
    shutil.copytree(e["store"], e["store_config"])
    (e["store_config"] / "config.json").write_text("{bad")

    def damaged_shards(name, edit):
        d = root / name
        shutil.copytree(e["shards"], d)
        edit(d)
        return d

    e["dataset_kind"] = damaged_shards("kind", lambda d: (d / "dataset.json").write_text(json.dumps(
        {"format": "ditdata-images", "version": 1, "kind": "weird", "num_shards": 4, "num_samples": 8})))
    e["dataset_classes"] = damaged_shards("classes", lambda d: (d / "dataset.json").write_text(json.dumps(
        {"format": "ditdata-images", "version": 1, "kind": "classes", "num_shards": 4, "num_samples": 8,
         "num_classes": "x", "class_names": 5})))
    e["stats_bad"] = damaged_shards("stats", lambda d: (d / "00000_stats.json").write_text("{bad"))
    e["metrics_torn"] = root / "torn"
    shutil.copytree(e["run"], e["metrics_torn"])
    with open(e["metrics_torn"] / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')  # a crash mid-line
    return e


# (CLI, arguments with {placeholders} from env, a fragment the one error line must hold)
CASES = [
    # fetch
    ("ditdata", "fetch {root}/nope --out {root}/f", "does not exist"),
    ("ditdata", "fetch {tree} --out {file}", "is a file"),
    ("ditdata", "fetch {tree} --out {root}/f --processes 0", "'--processes': 0 is not in the range"),
    ("ditdata", "fetch {tree} --out {root}/f --timeout -1", "'--timeout'"),
    ("ditdata", "fetch {tree} --out {root}/f --encode-quality 500", "'--encode-quality'"),
    ("ditdata", "fetch {tree} --out {root}/f --max-aspect-ratio nan", "not a finite number"),
    ("ditdata", "fetch {tree} --out {root}/f --max-aspect-ratio 0.5", "'--max-aspect-ratio'"),
    ("ditdata", "fetch {tree} --out {tree}", "must not be inside the source"),
    ("ditdata", "fetch {empty} --out {root}/f", "no images found"),
    ("ditdata", "fetch {file} --out {root}/f", "none of its 1 rows is an http(s) URL"),
    ("ditdata", "fetch {tree} --out {root}/f --distributor ray", "applies to URL lists"),
    # score / filter
    ("ditdata", "score {empty} --pretrained x", "dataset.json is missing"),
    ("ditdata", "score {shards} --clip NoSuchModel --pretrained x", "unknown open_clip model 'NoSuchModel'"),
    ("ditdata", "score {stats_bad} --clip ViT-B-32 --pretrained x", "00000_stats.json: unreadable stats file"),
    ("ditdata", "filter {shards} --min-clip-score 0.2 --top-fraction 0.5 --out {root}/s.parquet",
     "at most one of"),
    ("ditdata", "filter {shards} --top-fraction nan --out {root}/s.parquet", "not a finite number"),
    ("ditdata", "filter {shards} --min-clip-score 0.2 --out {root}/s.parquet", "no complete CLIP scores"),
    # encode
    ("ditdata", "encode {shards} --vae {root}/no/such/vae --out {root}/e", "unknown autoencoder"),
    ("ditdata", "encode {shards} --vae {file} --out {root}/e", "an autoencoder is a directory"),
    ("ditdata", "encode {shards} --vae {empty} --out {root}/e", "not a recognised autoencoder directory"),
    ("ditdata", "encode {shards} --vae ldm:{file} --out {root}/e --device cpu", "needs its LDM config: --vae-config"),
    ("ditdata", "encode {shards} --vae ldm:{file} --vae-config {file} --out {root}/e --device cpu",
     "a.txt: not an LDM config"),
    ("ditdata", "encode {shards} --vae ldm:{root}/gone.pt --vae-config {file} --out {root}/e --device cpu",
     "gone.pt: no such checkpoint file"),
    ("ditdata", "encode {shards} --vae sd-vae-ft-ema --out {root}/e --device cpu", "not in the local Hugging Face cache"),
    ("ditdata", "encode {shards} --vae pixels --resolution 100000 --out {root}/e", "expected 1 to 4096"),
    ("ditdata", "encode {shards} --vae pixels --out {root}/e --device bogus", "--device 'bogus': not a device"),
    ("ditdata", "encode {shards} --vae pixels --out {run} --device cpu", "holds files a latent store does not"),
    ("ditdata", "encode {shards} --vae pixels --out {tree} --device cpu", "not empty and not a latent store"),
    ("ditdata", "encode {shards} --vae pixels --out {shards} --device cpu", "must not be the image-shard folder"),
    ("ditdata", "encode {shards} --vae pixels --out {store}/inner --device cpu", "inside the latent store"),
    ("ditdata", "encode {shards} --vae pixels --out {store_config} --device cpu", "config.json: unreadable store config"),
    ("ditdata", "encode {shards} --vae pixels --out {root}/e --select {file}", "not a valid selection file"),
    ("ditdata", "encode {shards} --vae pixels --out {root}/e --posterior mean_std --device cpu", "is deterministic"),
    ("ditdata", "encode {shards} --vae pixels --out {root}/e --text-tokens", "need --text-encoder"),
    ("ditdata", "encode {shards} --vae pixels --out {root}/e --text-encoder ViT-B-32", "needs --text-pretrained"),
    ("ditdata", "encode {dataset_kind} --vae pixels --out {root}/e", "kind 'weird' is not one of"),
    ("ditdata", "encode {dataset_classes} --vae pixels --out {root}/e", "a class dataset needs num_classes"),
    # inspect / verify on damaged manifests
    *[(("ditdata", f"{cmd} {{{m}}}", what)) for cmd in ("inspect", "verify") for m, what in (
        ("manifest_badjson", "manifest.json: not valid JSON"),
        ("manifest_shard_int", "shard #0 must be an object"),
        ("manifest_latent", "latent must be"),
        ("manifest_cond", "conditioning must be an object"),
        ("manifest_files", "shard #0: path and files must be relative paths"),
        ("manifest_escape", "shard #0: path and files must be relative paths"),
        ("manifest_vae", "vae must be a JSON object"),
        ("empty", "manifest.json: missing"))],
    ("ditdata", "inspect {store} --decode 2", "--decode needs --out DIR"),
    ("ditdata", "inspect {store} --decode 2 --out {store}/peek", "inside the latent store"),
    # dittrain run
    ("dittrain", "run --latents {manifest_cond} --out {root}/r --device cpu", "conditioning must be an object"),
    ("dittrain", "run --latents {shards} --out {root}/r --device cpu", "manifest.json: missing"),
    ("dittrain", "run --latents {store} --out {root}/r --model DiT-Q/2 --device cpu", "unknown model 'DiT-Q/2'"),
    ("dittrain", "run --latents {store} --out {root}/r --device bogus", "--device 'bogus': not a device"),
    ("dittrain", "run --latents {store} --out {root}/r --device cuda:3", "CUDA is not available"),
    ("dittrain", "run --latents {store} --out {root}/r --lr -1", "'--lr': -1.0 is not in the range"),
    ("dittrain", "run --latents {store} --out {root}/r --ema 2", "'--ema'"),
    ("dittrain", "run --latents {store} --out {root}/r --class-dropout 1.5", "'--class-dropout'"),
    ("dittrain", "run --latents {store} --out {root}/r --sample-cfg inf", "is not in the range -100.0<=x<=100.0"),
    ("dittrain", "run --latents {store} --out {root}/r --sample-cfg nan", "not a finite number"),
    ("dittrain", "run --latents {store} --out {root}/r --model DiT-T/4 --device cpu --grad-checkpointing foo",
     "grad_checkpointing must be"),
    ("dittrain", "run --latents {store} --out {root}/r --model DiT-T/4 --device cpu --resident-device cuda "
                 "--loader resident", "--resident-device cuda needs --device cuda"),
    ("dittrain", "run --latents {store} --out {root}/r --batch-size 3 --accumulation-steps 2 --device cpu "
                 "--model DiT-T/4", "must be a multiple of"),
    ("dittrain", "run --latents {store} --out {store} --device cpu", "inside the latent store"),
    ("dittrain", "run --latents {store} --out {shards} --device cpu", "is an image-shard folder"),
    ("dittrain", "run --latents {store} --out {file}", "is a file"),
    ("dittrain", "run --latents {store} --out {run} --model DiT-T/4 --batch-size 4 --device cpu", "pass --resume"),
    ("dittrain", "run --latents {store} --out {run} --model DiT-S/4 --batch-size 4 --device cpu --resume",
     "cannot change on a resume"),  # the run's record says DiT-T/4 (dittrain.train.resume)
    ("dittrain", "run --latents {store} --out {run} --model DiT-T/4 --batch-size 8 --device cpu --resume "
                 "--max-steps 3", "changes what is learned: --batch-size 4 -> 8"),
    # dittrain sample
    ("dittrain", "sample --ckpt {file} --out {root}/g.png", "unreadable checkpoint"),
    ("dittrain", "sample --ckpt {empty} --out {root}/g.png", "no ema.safetensors and no checkpoints"),
    ("dittrain", "sample --ckpt {run} --class 99 --out {root}/g.png --device cpu", "class 99 is out of range"),
    ("dittrain", "sample --ckpt {run} --class zebra --out {root}/g.png --device cpu", "unknown class 'zebra'"),
    ("dittrain", "sample --ckpt {run} --prompt cat --out {root}/g.png --device cpu", "--prompt needs a text"),
    ("dittrain", "sample --ckpt {run} --steps 0 --out {root}/g.png", "'--steps': 0 is not in the range"),
    ("dittrain", "sample --ckpt {run} --cfg nan --out {root}/g.png", "not a finite number"),
    ("dittrain", "sample --ckpt {run} --out {root}/g.jpg --device cpu", "samples are written as PNG"),
    ("dittrain", "sample --ckpt {run} --out {store}/samples --device cpu", "inside the latent store"),
    ("dittrain", "sample --ckpt {run} --out {root}/g.png --device bogus", "bad device 'bogus'"),
    ("dittrain", "sample --ckpt {run} --out {root}/g.png --latents {manifest_badjson} --device cpu",
     "manifest.json: not valid JSON"),
    # dittrain models
    ("dittrain", "models --downsample 0", "'--downsample': 0 is not in the range"),
    ("dittrain", "models --resolution 30", "is not a multiple of --downsample 8"),
]


@pytest.mark.parametrize("cli, args, fragment", CASES, ids=[f"{c} {a}" for c, a, _ in CASES])
def test_bad_input_gives_one_line(env, cli, args, fragment):
    argv = [a.format(**{k: str(v) for k, v in env.items()}) for a in args.split()]
    before = sorted(p.relative_to(env["root"]) for p in env["root"].rglob("*"))
    r = CliRunner().invoke(CLIS[cli], argv)
    assert r.exit_code != 0, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    lines = [ln for ln in r.output.splitlines() if ln.strip() and not ln.startswith("note: ")]
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.output
    assert "Traceback" not in r.output and "internal error" not in lines[0], lines[0]
    assert fragment in lines[0], lines[0]
    after = sorted(p.relative_to(env["root"]) for p in env["root"].rglob("*"))
    assert after == before, "a refused command left files behind"


def test_a_torn_metrics_line_does_not_stop_a_resume(env, tmp_path):
    run = tmp_path / "torn"
    shutil.copytree(env["metrics_torn"], run)
    r = CliRunner().invoke(dittrain_cli, ["run", "--latents", str(env["store"]), "--out", str(run), "--model",
                                          "DiT-T/4", "--batch-size", "4", "--max-steps", "3", "--sample-every",
                                          "0", "--device", "cpu", "--resume"])
    assert r.exit_code == 0, r.output
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 3]  # the run logs at its last step (2), the resume at its own (3)


@pytest.mark.parametrize("error, line", [
    (ZeroDivisionError("a bug"), "Error: internal error (ZeroDivisionError: a bug); rerun with DITKIT_DEBUG=1 "
                                 "for the traceback and please report it"),
    (OSError(28, "No space left on device", "/data/store/shards/00003.zarr"),
     "Error: /data/store/shards/00003.zarr: No space left on device"),
])
def test_unexpected_and_os_errors_are_one_line_unless_debugging(env, monkeypatch, error, line):
    import ditdata.inspection

    def fail(path):
        raise error

    monkeypatch.setattr(ditdata.inspection, "describe", fail)
    r = CliRunner().invoke(ditdata_cli, ["inspect", str(env["store"])])
    assert r.exit_code == 1 and r.output.strip() == line
    monkeypatch.setenv("DITKIT_DEBUG", "1")
    r = CliRunner().invoke(ditdata_cli, ["inspect", str(env["store"])])
    assert r.exception is error  # the traceback is there for the bug report


def test_resident_loader_that_does_not_fit_is_refused_at_once(env, monkeypatch):
    """A store larger than the memory: `--loader resident` stops before loading anything
    (here the RAM is made to look tiny) and the run directory is left as it was."""
    import dittrain.data.budget

    monkeypatch.setattr(dittrain.data.budget, "available_memory", lambda: (4096, "MemAvailable in /proc/meminfo"))
    out = env["root"] / "too-big"
    r = CliRunner().invoke(dittrain_cli, ["run", "--latents", str(env["store"]), "--out", str(out), "--model",
                                          "DiT-T/4", "--batch-size", "4", "--device", "cpu", "--loader", "resident"])
    assert r.exit_code == 1
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "loader 'resident' needs" in lines[0] and "4.0 KiB" not in lines[0]
    assert "use --loader streaming" in lines[0]
    assert not out.exists()
