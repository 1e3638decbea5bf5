"""Where things live: the import graph of ditdata/ and dittrain/, read from the source with `ast`
(nothing is imported), counting imports inside functions too, since those are what keep
`--help` fast and are where circles hide. Importing `a.b.c` runs `a/__init__.py` and
`a/b/__init__.py` first, so it counts as an import of those packages too (but for the
importer's own packages, which are already running).

- no import circles among the modules;
- rooms import downward only: each package's rooms sit in LAYERS, lowest first, and a room
  imports only rooms of lower layers (never one of its own layer: ditdata's stages, fetch,
  scoring and encode, never import each other; what they hand on lives in ditdata.imageshards);
- ditdata.common (the toolkit both sides share) imports nothing else of ditdata or dittrain;
- ditdata.store (the latent-store contract) imports nothing of ditdata outside the store and
  ditdata.common;
- dittrain imports ditdata only through the store, the common package and the named public
  modules in DITTRAIN_MAY_IMPORT;
- every room's __init__ docstring names each of its modules (the layout a newcomer reads);
- no module or function grows beyond RUNAWAY_* lines: an alarm for runaway growth, not a
  style rule (modules and functions are as long as the one idea they hold).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ditdata", "dittrain")
RUNAWAY_MODULE_LINES = 1000
RUNAWAY_FUNCTION_LINES = 150
# ditdata's public surface for the trainer: the store and the toolkit, autoencoders (decoding
# samples), the caption encoder (prompts) and pixels (reference images for FID: ditdata.pixels).
DITTRAIN_MAY_IMPORT = ("ditdata.store", "ditdata.common", "ditdata.autoencoders", "ditdata.clip", "ditdata.pixels",
                       "ditdata.textencoders")  # a T5 / Gemma-2 store's prompts are embedded as encode did
# The rooms (a top-level module or package of ditdata / dittrain) by layer, lowest first.
LAYERS = {
    "ditdata": [
        ["common"],
        ["store"],  # the contract
        ["errors"],
        ["config", "jsondocs", "images", "framing"],  # settings, JSON documents, one image's pixels
        ["imageshards"],  # the image shards and what stages hand each other beside them
        ["clip", "autoencoders", "pixels"],  # the models ditdata runs; dittrain's pixel surface
        ["features", "textencoders"],  # feature sets; the text-encoder registry (open_clip towers via clip)
        ["fetch", "scoring", "encode", "captions"],  # the stages
        ["inspection"],
        ["cli"],
        ["__main__"],
    ],
    "dittrain": [
        ["config"],
        ["model", "diffusion"],
        ["data"],
        ["rundir", "eval"],
        ["inference"],  # a trained run opened: sampling, serving, exports
        ["train"],  # a run trained (its grids and FID sample through inference)
        ["plan"],  # what a run would cost (it builds the train step to probe it)
        ["cli"],
        ["__main__"],
    ],
}


def _modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _lazy_exports(path: Path) -> dict[str, str]:
    """A package's `_EXPORTS = {name: submodule}` table (names imported on first use)."""
    for node in ast.parse(path.read_text()).body:
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets)
                and isinstance(node.value, ast.Dict)):
            return {k.value: v.value for k, v in zip(node.value.keys, node.value.values, strict=True)}
    return {}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports (at top level or inside functions)."""
    mods = _modules(root)
    lazy = {m: _lazy_exports(p) for m, p in mods.items() if p.name == "__init__.py"}

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    def target(base: str, name: str | None) -> str | None:
        if name is not None:
            if f"{base}.{name}" in mods:
                return f"{base}.{name}"
            if base in lazy and name in lazy[base]:
                return f"{base}.{lazy[base][name]}"
        return owner(base)

    def packages(name: str) -> set[str]:
        """name's enclosing packages (a.b.c -> a.b, a)."""
        parts = name.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts))}

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        running = packages(mod) | ({mod} if path.name == "__init__.py" else set())  # already being imported
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(target(a.name, None) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1])
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module
                deps.update(target(base, a.name) for a in node.names)
        deps = {d for d in deps if d}
        deps |= {p for d in deps for p in packages(d) if p in mods} - running  # importing a.b.c runs a.b
        graph[mod] = {d for d in deps if d != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, work = {}, {}, set(), [], [], []

    def visit(v: str) -> None:  # first sight of v: numbered, on the stack, its imports walked next
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        work.append((v, iter(sorted(graph.get(v, ())))))

    for start in sorted(graph):
        if start in index:
            continue
        visit(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    visit(w)
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _inside(mod: str, prefixes) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def room(mod: str) -> str:
    """ditdata.scoring.filter -> ditdata.scoring: the top-level module or package a module is in."""
    return ".".join(mod.split(".")[:2])


def layer_of(rm: str) -> int:
    pkg, _, name = rm.partition(".")
    for i, rooms in enumerate(LAYERS[pkg]):
        if name in rooms:
            return i
    raise KeyError(rm)


def _tree(root: Path, files: dict[str, str]) -> Path:
    """A fixture source tree under root: the two packages' __init__ files and `files` {path: text}."""
    for rel, text in {"ditdata/__init__.py": "", "dittrain/__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_graph_sees_function_level_and_lazy_imports(tmp_path):
    # a fixture tree: a circle closed only by an import inside a function, and a lazy export
    g = import_graph(_tree(tmp_path, {
        "ditdata/store/__init__.py": '_EXPORTS = {"Store": "reader"}\n',
        "ditdata/store/reader.py": "def f():\n    from ditdata import vae\n",
        "ditdata/vae.py": "from ditdata.store import Store\n",
    }))
    assert g["ditdata.vae"] == {"ditdata.store.reader", "ditdata.store"} and g["ditdata.store.reader"] == {"ditdata.vae"}
    assert cycles(g) == [["ditdata.store.reader", "ditdata.vae"]]


def test_an_import_of_a_submodule_counts_as_one_of_its_package(tmp_path):
    # a circle only through a package's __init__: a imports b, b imports a.sub (running a first)
    g = import_graph(_tree(tmp_path, {
        "ditdata/a/__init__.py": "from ditdata import b\n",
        "ditdata/a/sub.py": "from ditdata.a import sibling\n",  # its own package: already running, fine
        "ditdata/a/sibling.py": "",
        "ditdata/b.py": "def f():\n    from ditdata.a.sub import g\n",
    }))
    assert g["ditdata.b"] == {"ditdata.a.sub", "ditdata.a"}
    assert g["ditdata.a.sub"] == {"ditdata.a.sibling"}
    assert cycles(g) == [["ditdata.a", "ditdata.b"]]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_every_room_has_a_layer():
    rooms = {room(m) for m in _modules() if m not in PACKAGES}
    missing = []
    for rm in sorted(rooms):
        try:
            layer_of(rm)
        except KeyError:
            missing.append(rm)
    assert missing == [], "add these rooms to LAYERS (where they sit in the import order)"


def test_rooms_import_downward_only():
    upward = sorted(f"{m} -> {d}" for m, deps in import_graph().items() for d in deps
                    if m not in PACKAGES and d not in PACKAGES and room(m) != room(d)
                    and room(m).split(".")[0] == room(d).split(".")[0] and layer_of(room(d)) >= layer_of(room(m)))
    assert upward == []


def test_every_room_lists_its_modules():
    """A room's __init__ docstring names each module in it ("planner.py", or a dotted
    "dittrain.plan.planner"), so the layout is read from the tree and kept true by this test."""
    missing = {}
    for pkg in PACKAGES:
        for init in sorted((ROOT / pkg).glob("*/__init__.py")):
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            names = [p.stem for p in sorted(init.parent.glob("*.py")) if p.name != "__init__.py"]
            dotted = ".".join(init.parent.relative_to(ROOT).parts)
            absent = [n for n in names if f"{n}.py" not in doc and f"{dotted}.{n}" not in doc]
            if absent:
                missing[str(init.relative_to(ROOT))] = absent
    assert missing == {}


def test_the_common_package_imports_only_itself():
    bad = {m: sorted(d for d in deps if not _inside(d, ("ditdata.common",)))
           for m, deps in import_graph().items() if _inside(m, ("ditdata.common",))}
    assert {m: d for m, d in bad.items() if d} == {}


def test_the_store_is_only_the_contract():
    bad = {m: sorted(d for d in deps if not _inside(d, ("ditdata.store", "ditdata.common")))
           for m, deps in import_graph().items() if _inside(m, ("ditdata.store",))}
    assert {m: d for m, d in bad.items() if d} == {}


def test_dittrain_reaches_ditdata_only_through_its_public_surface():
    bad = {m: sorted(d for d in deps if d.startswith("ditdata") and d != "ditdata" and not _inside(d, DITTRAIN_MAY_IMPORT))
           for m, deps in import_graph().items() if _inside(m, ("dittrain",))}
    assert {m: d for m, d in bad.items() if d} == {}


def test_ditdata_never_imports_dittrain():
    bad = {m: sorted(d for d in deps if _inside(d, ("dittrain",)))
           for m, deps in import_graph().items() if _inside(m, ("ditdata",))}
    assert {m: d for m, d in bad.items() if d} == {}


def test_no_module_or_function_runs_away():
    long = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > RUNAWAY_MODULE_LINES}
    for mod, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > RUNAWAY_FUNCTION_LINES:
                    long[f"{mod}.{node.name}"] = n
    assert long == {}
