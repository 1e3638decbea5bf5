"""Where things live: the import graph of ditdata/ and dittrain/ and the size of their parts.

Read from the source with `ast` (nothing is imported), counting imports inside functions too,
since those are what keep `--help` fast and are where circles hide:

- no import circles among the modules;
- ditdata.common (the toolkit both sides share) imports nothing else of ditdata or dittrain;
- ditdata.store (the latent-store contract) imports nothing of ditdata outside the store and
  ditdata.common;
- dittrain imports ditdata only through the store, the common package and the named public
  modules in DITTRAIN_MAY_IMPORT;
- no module over MAX_MODULE_LINES lines and no function over MAX_FUNCTION_LINES.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ditdata", "dittrain")
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 60
# ditdata's public surface for the trainer: the store and the toolkit, autoencoders (decoding
# samples), the caption encoder (prompts) and pixels (reference images for FID: ditdata.pixels).
DITTRAIN_MAY_IMPORT = ("ditdata.store", "ditdata.common", "ditdata.vae", "ditdata.clip", "ditdata.pixels")


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

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
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
        graph[mod] = {d for d in deps if d and d != mod}
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


def test_the_graph_sees_function_level_and_lazy_imports(tmp_path):
    # a fixture tree: a circle closed only by an import inside a function, and a lazy export
    (tmp_path / "ditdata" / "store").mkdir(parents=True)
    (tmp_path / "dittrain").mkdir()
    (tmp_path / "ditdata" / "__init__.py").write_text("")
    (tmp_path / "ditdata" / "store" / "__init__.py").write_text('_EXPORTS = {"Store": "reader"}\n')
    (tmp_path / "ditdata" / "store" / "reader.py").write_text("def f():\n    from ditdata import vae\n")
    (tmp_path / "ditdata" / "vae.py").write_text("from ditdata.store import Store\n")
    (tmp_path / "dittrain" / "__init__.py").write_text("")
    g = import_graph(tmp_path)
    assert g["ditdata.vae"] == {"ditdata.store.reader"} and g["ditdata.store.reader"] == {"ditdata.vae"}
    assert cycles(g) == [["ditdata.store.reader", "ditdata.vae"]]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_common_package_imports_only_itself():
    bad = {m: sorted(d for d in deps if not _inside(d, ("ditdata.common",)))
           for m, deps in import_graph().items() if _inside(m, ("ditdata.common",))}
    assert {m: d for m, d in bad.items() if d} == {}


def test_the_store_is_only_the_contract():
    bad = {m: sorted(d for d in deps if not _inside(d, ("ditdata.store", "ditdata.common")))
           for m, deps in import_graph().items() if _inside(m, ("ditdata.store",))}
    assert {m: d for m, d in bad.items() if d} == {}


def test_dittrain_reaches_ditdata_only_through_its_public_surface():
    bad = {m: sorted(d for d in deps if d.startswith("ditdata") and not _inside(d, DITTRAIN_MAY_IMPORT))
           for m, deps in import_graph().items() if _inside(m, ("dittrain",))}
    assert {m: d for m, d in bad.items() if d} == {}


def test_ditdata_never_imports_dittrain():
    bad = {m: sorted(d for d in deps if _inside(d, ("dittrain",)))
           for m, deps in import_graph().items() if _inside(m, ("ditdata",))}
    assert {m: d for m, d in bad.items() if d} == {}


@pytest.mark.parametrize("limit", [MAX_MODULE_LINES])
def test_no_module_is_too_long(limit):
    sizes = {m: len(p.read_text().splitlines()) for m, p in _modules().items()}
    assert {m: n for m, n in sizes.items() if n > limit} == {}


def test_no_function_is_too_long():
    long = {}
    for mod, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{mod}.{node.name}"] = n
    assert long == {}
