"""Lean installs (issue 24): what pyproject.toml declares, and that the demo's commands run on
the core alone.

- the `demo` extra (the README's first command) is the core plus scikit-learn: no
  self-reference to `all` or another extra, nothing of data/distributed/...;
- the core holds none of the optional packages; img2dataset has an upper bound that the
  tested release satisfies; huggingface_hub is declared beside the extras that import it;
- `python -m ditdata` and `python -m dittrain` run the command groups;
- fetch (class folders), encode --vae pixels, run and sample work with every optional package
  made unimportable (hidden from the import system of the child processes, which stands in for a fresh
  `pip install ditkit` here: the tests never reach a package index).

Nothing here reaches the network.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
CORE = [Requirement(r) for r in PYPROJECT["dependencies"]]
EXTRAS = {k: [Requirement(r) for r in v] for k, v in PYPROJECT["optional-dependencies"].items()}
# What the optional extras bring that the demo must never need (distribution names).
OPTIONAL = {"img2dataset", "open-clip-torch", "diffusers", "torchvision", "pandas", "huggingface-hub",
            "tensorboard", "matplotlib", "bitsandbytes", "wandb", "torch-fidelity", "gradio", "onnx",
            "onnxscript", "onnxruntime", "torchao", "pyspark", "ray", "s3fs", "gcsfs", "aiohttp", "transformers"}
# Their import names, made unimportable for the demo's commands (scikit-learn and scipy too:
# only pipelines/digits.py uses them).
BLOCKED = ("img2dataset", "open_clip", "diffusers", "torchvision", "pandas", "huggingface_hub",
           "tensorboard", "matplotlib", "bitsandbytes", "wandb", "torch_fidelity", "gradio", "onnx",
           "onnxscript", "onnxruntime", "torchao", "pyspark", "ray", "s3fs", "gcsfs", "aiohttp",
           "transformers", "sklearn", "scipy")


def _names(reqs) -> set[str]:
    return {canonicalize_name(r.name) for r in reqs}


def _expanded(extra: str) -> tuple[set[str], set[str]]:
    """(distribution names, ditkit extras) that `ditkit[extra]` requires, self-references
    followed."""
    names, seen, todo = set(), set(), [extra]
    while todo:
        e = todo.pop()
        if e in seen:
            continue
        seen.add(e)
        for r in EXTRAS[e]:
            if canonicalize_name(r.name) == "ditkit":
                todo += sorted(r.extras)
            else:
                names.add(canonicalize_name(r.name))
    return names, seen


# --------------------------------------------------------------------------- declarations


def test_demo_extra_is_the_core_plus_scikit_learn():
    names, extras = _expanded("demo")
    assert extras == {"demo"}  # no ditkit[all], ditkit[data], ... inside it
    assert names == {"scikit-learn"}
    for other in ("data", "distributed", "vae", "serve", "export", "remote"):
        assert not names & _expanded(other)[0], other
    # and scikit-learn is what the demo's own script imports
    tree = ast.parse((REPO / "pipelines" / "digits.py").read_text())
    imported = {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "sklearn" in imported


def test_the_core_holds_no_optional_package():
    assert not _names(CORE) & OPTIONAL
    assert not _names(CORE) & {"scikit-learn", "scipy"}
    # `all` is every extra but the test tools
    assert _expanded("all")[1] == set(EXTRAS) - {"test"}


def test_img2dataset_has_an_upper_bound_the_tested_release_meets():
    (req,) = [r for r in EXTRAS["data"] if canonicalize_name(r.name) == "img2dataset"]
    assert any(s.operator in ("<", "<=", "~=", "==") for s in req.specifier), req
    try:
        installed = md.version("img2dataset")
    except md.PackageNotFoundError:
        pytest.skip("img2dataset is not installed here")
    assert req.specifier.contains(installed), (str(req), installed)


# An import name -> its distribution, for the names that differ (the rest are the same, canonicalized).
DISTRIBUTION = {"PIL": "pillow", "yaml": "pyyaml", "open_clip": "open-clip-torch", "faiss": "faiss-cpu",
                "torch_fidelity": "torch-fidelity", "sklearn": "scikit-learn"}
# Declared, never imported by our code: each is what a package we call loads at run time.
LOADED_FOR_US = {
    "onnxscript": "torch.onnx.export(dynamo=True) imports it (dittrain/inference/onnx.py)",
    "onnx": "torch's ONNX exporter writes and checks the model with it",
    "aiohttp": "fsspec's http(s):// filesystem (--latents https://)",
    "s3fs": "fsspec's s3:// filesystem",
    "gcsfs": "fsspec's gs:// filesystem",
    "tensorboard": "torch.utils.tensorboard's SummaryWriter (--logger tensorboard)",
    "scikit-learn": "the demo's images (pipelines/digits.py)",
    "torchvision": "transformers' Qwen2.5-VL and SmolVLM processors (the captions extra)",
}


def _third_party_imports() -> dict[str, set[str]]:
    """{distribution: the extras named where it is imported} over ditdata/ and dittrain/: a plain
    import gives the empty set (any declaration serves), `require("module", what, "extra")` (the one
    way an optional import reports its extra, ditdata.common.extras) gives that extra."""
    found: dict[str, set[str]] = {}
    for path in sorted([*(REPO / "ditdata").rglob("*.py"), *(REPO / "dittrain").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                mods, extra = [a.name for a in node.names], None
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods, extra = [node.module], None
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "require" and len(node.args) >= 3
                  and all(isinstance(a, ast.Constant) for a in (node.args[0], node.args[2]))):
                mods, extra = [node.args[0].value], node.args[2].value
            else:
                continue
            for m in mods:
                top = m.split(".")[0]
                if top in sys.stdlib_module_names or top in ("ditdata", "dittrain"):
                    continue
                extras = found.setdefault(canonicalize_name(DISTRIBUTION.get(top, top)), set())
                if extra is not None:
                    extras.add(extra)
    return found


def test_every_import_is_declared_where_its_users_look():
    """What ditdata and dittrain import is in the core or an extra; where the code says which extra
    brings it (require(..., "EXTRA")), that extra does: the error's `pip install 'ditkit[EXTRA]'` works."""
    core, declared = _names(CORE), set().union(*(_expanded(e)[0] for e in EXTRAS if e != "test"))
    imports = _third_party_imports()
    assert {"torch", "diffusers", "transformers", "torchvision"} <= set(imports)  # the scan sees imports
    undeclared = sorted(d for d in imports if d not in core | declared)
    assert not undeclared, f"imported, declared by no extra: {undeclared}"
    for dist, extras in imports.items():
        for extra in extras:
            assert extra in EXTRAS, f"require(...) names the extra {extra!r}, which pyproject.toml lacks"
            assert dist in core | _expanded(extra)[0], f"require({dist!r}, ..., {extra!r}): {extra} lacks it"


def test_every_declared_package_is_imported_or_loaded_for_us():
    """Nothing rides in an extra unused: each package is imported somewhere or is in LOADED_FOR_US with
    the library that loads it; torchvision only where an image transform needs it (not in vae)."""
    imports = _third_party_imports()
    for extra in [None, *EXTRAS]:
        if extra in ("test", "all"):
            continue
        names = _names(CORE) if extra is None else _names(r for r in EXTRAS[extra] if r.name != "ditkit")
        unused = sorted(n for n in names if n not in imports and n not in LOADED_FOR_US)
        assert not unused, f"{extra or 'the core'} declares what nothing imports: {unused}"
    assert "torchvision" not in _names(EXTRAS["vae"])
    assert "pyyaml" in _names(CORE)  # --config FILE.yaml and LDM configs, everywhere


def test_the_torch_floor_is_the_tested_release():
    (req,) = [r for r in CORE if r.name == "torch"]
    assert str(req.specifier) == ">=2.14"  # .ci/run tests 2.14.1; older releases are not tested
    assert req.specifier.contains(md.version("torch").split("+")[0])


# --------------------------------------------------------------------------- python -m


def _python_m(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=timeout)


def test_python_m_ditdata_help():
    r = _python_m("ditdata", "--help")
    assert r.returncode == 0, r.stderr
    assert "python -m ditdata" in r.stdout and "encode" in r.stdout and "fetch" in r.stdout


def test_python_m_dittrain_models():
    r = _python_m("dittrain", "models", "--resolution", "32", "--downsample", "8")
    assert r.returncode == 0, r.stderr
    assert "DiT-XL/2" in r.stdout and "GFLOPs" in r.stdout


def test_python_m_reports_errors_as_the_scripts_do(tmp_path):
    r = _python_m("ditdata", "verify", tmp_path / "nothing-here")
    assert r.returncode != 0 and "Traceback" not in r.stderr


# --------------------------------------------------------------------------- the core alone

_BLOCKER = '''
import sys

BLOCKED = {blocked!r}


class _Hide:
    """A meta-path finder that finds nothing of BLOCKED (so `import x` and
    importlib.util.find_spec("x") both see it absent, as in a core-only install)."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        find = getattr(self.finder, "find_spec", None)
        return None if find is None else find(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]
'''


@pytest.mark.slow
def test_the_demo_commands_need_only_the_core(tmp_path):
    """The demo's four ditkit commands (pipelines/demo.sh, reduced) with every optional
    package unimportable, in the children too (sitecustomize on PYTHONPATH)."""
    from tiny import class_tree

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_BLOCKER.format(blocked=BLOCKED))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1")
    probe = _python_m("ditdata", "--help", env=env)  # the blocker is active in children
    assert probe.returncode == 0, probe.stderr
    check = subprocess.run([sys.executable, "-c", "import importlib.util as u; assert u.find_spec('diffusers') is None; "
                            "import diffusers"], capture_output=True, text=True, env=env)
    assert "ModuleNotFoundError: No module named 'diffusers'" in check.stderr, check.stderr

    tree = class_tree(tmp_path / "tree", per_class=3, size=16)
    steps = [
        ("ditdata", "fetch", tree, "--out", tmp_path / "shards", "--kind", "classes",
         "--samples-per-shard", 4, "--processes", 2, "-q"),
        ("ditdata", "encode", tmp_path / "shards", "--vae", "pixels", "--resolution", 16,
         "--out", tmp_path / "store", "--device", "cpu", "--workers", 1, "--batch-size", 8),
        ("dittrain", "run", "--latents", tmp_path / "store", "--out", tmp_path / "run", "--model", "DiT-T/4",
         "--objective", "flow", "--batch-size", 4, "--max-steps", 2, "--save-every", 2,
         "--sample-every", 0, "--device", "cpu"),
        ("dittrain", "sample", "--ckpt", tmp_path / "run", "--classes", "all", "--n-per-class", 1,
         "--steps", 2, "--seed", 0, "--device", "cpu", "--out", tmp_path / "samples"),
    ]
    for args in steps:
        r = _python_m(*args, env=env)
        assert r.returncode == 0, f"{args[:2]}: {r.stderr[-2000:]}"
    assert (tmp_path / "samples" / "grid.png").is_file()
    # and an autoencoder from the hub names the extra that brings it, in one line
    r = _python_m("ditdata", "encode", tmp_path / "shards", "--vae", "sd-vae-ft-ema", "--resolution", 16,
                  "--out", tmp_path / "store-kl", "--device", "cpu", "--workers", 0, env=env)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "pip install 'ditkit[vae]'" in r.stderr, r.stderr[-2000:]
    # ... and so does CLIP scoring (open_clip is the data extra's)
    r = _python_m("ditdata", "score", tmp_path / "shards", "--clip", "ViT-B-32", "--pretrained", "laion2b_s34b_b79k",
                  "--device", "cpu", "-q", env=env)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr[-2000:]
    assert "pip install 'ditkit[data]'" in r.stderr, r.stderr[-2000:]
