"""What each extra of pyproject.toml costs to install (issue 24): the distributions it adds
beyond the core and their size on disk.

    .venv/bin/python bench/install_sizes.py [--pyproject pyproject.toml] [--list EXTRA]

Run it with the Python of an environment that has every extra installed (`.[all,test]`):
nothing is downloaded or installed. For each extra, the requirement tree of `ditkit[extra]`
is walked through the installed distributions' metadata (importlib.metadata): ditkit's own
requirements come from pyproject.toml (so an edit shows without a reinstall), every other
distribution's from its METADATA, markers evaluated for this interpreter and platform,
`name[extra]` requirements followed into the extra's own requirements. A distribution's
size is the sum of its RECORD's file sizes (a file listed without a size is stat'ed), so the
bytecode pip compiled is counted and the launcher scripts in bin/ are too.

Prints a Markdown table: extra, distributions added beyond the core, size added, total with
the core. ditkit itself, pip and setuptools are not counted. Caveats: the versions are this
environment's (a lean install may resolve others: img2dataset pins webdataset<0.3, so the
full environment holds webdataset 0.2 where a core install gets 1.x); a requirement not
installed here is reported, not guessed. --list EXTRA prints the distributions that extra adds
beyond the core (`--list core`: the core's), with their sizes, largest first.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ditdata.common.bytesize import format_size  # noqa: E402  (standard library only)

PROJECT = "ditkit"
NOT_COUNTED = {"pip", "setuptools", PROJECT}


@dataclass
class Tree:
    """The distributions one requirement set pulls in (canonical name -> version), and the
    requirements that are not installed in this environment."""

    dists: dict[str, str]
    missing: set[str]


def project_requirements(pyproject: Path) -> tuple[list[str], dict[str, list[str]]]:
    """The core requirements and each extra's, as pyproject.toml writes them."""
    project = tomllib.loads(pyproject.read_text())["project"]
    return list(project.get("dependencies", [])), dict(project.get("optional-dependencies", {}))


def _wanted(req: Requirement, extras: set[str]) -> bool:
    """Whether `req` applies here, for a distribution installed with `extras`."""
    if req.marker is None:
        return True
    env = default_environment()
    return any(req.marker.evaluate({**env, "extra": e}) for e in extras | {""})


def walk(extra: str, pyproject: Path = ROOT / "pyproject.toml") -> Tree:
    """The distributions `pip install ditkit[extra]` would hold (`core`: plain `ditkit`),
    read from this environment."""
    core, extras = project_requirements(pyproject)
    if extra != "core" and extra not in extras:
        raise SystemExit(f"install_sizes: pyproject.toml has no extra {extra!r}")
    tree = Tree({}, set())
    done: set[tuple[str, str]] = set()  # (distribution, extra) pairs already followed
    todo: list[tuple[Requirement, set[str]]] = [(Requirement(r), set()) for r in core]
    if extra != "core":
        todo.append((Requirement(f"{PROJECT}[{extra}]"), set()))
    while todo:
        req, parent_extras = todo.pop()
        if not _wanted(req, parent_extras):
            continue
        name = canonicalize_name(req.name)
        asked = {canonicalize_name(e) for e in req.extras}
        if name == PROJECT:  # our own extras, from pyproject.toml
            for e in sorted(asked - {k for n, k in done if n == PROJECT}):
                done.add((PROJECT, e))
                todo += [(Requirement(r), set()) for r in extras.get(e, [])]
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            tree.missing.add(str(req))
            continue
        tree.dists[name] = dist.version
        for e in sorted({""} | asked):
            if (name, e) in done:
                continue
            done.add((name, e))
            todo += [(Requirement(r), {e} if e else set()) for r in dist.requires or []]
    for n in NOT_COUNTED:
        tree.dists.pop(n, None)
    return tree


def dist_size(name: str) -> int:
    """Bytes on disk of the files a distribution's RECORD lists."""
    total = 0
    for f in md.distribution(name).files or []:
        if f.size is not None:
            total += f.size
        else:
            path = Path(f.locate())
            total += path.stat().st_size if path.is_file() else 0
    return total


def table(extras: tuple[str, ...], pyproject: Path) -> tuple[str, list[str]]:
    """The Markdown table, and a line per requirement that is not installed here."""
    sizes: dict[str, int] = {}

    def size(names) -> int:
        for n in names:
            if n not in sizes:
                sizes[n] = dist_size(n)
        return sum(sizes[n] for n in names)

    core = walk("core", pyproject)
    lines = ["| extra | distributions added beyond the core | size added | total with the core |",
             "|---|---:|---:|---:|"]
    notes = [f"core: {m} is not installed here" for m in sorted(core.missing)]
    for extra in extras:
        tree = core if extra == "core" else walk(extra, pyproject)
        added = set(tree.dists) - set(core.dists)
        total = size(tree.dists)
        if extra == "core":
            lines.append(f"| core (`pip install ditkit`) | {len(tree.dists)} distributions | - | {format_size(total)} |")
        else:
            lines.append(f"| {extra} | {len(added)} | {format_size(size(added))} | "
                         f"{len(tree.dists)} distributions, {format_size(total)} |")
        notes += [f"{extra}: {m} is not installed here" for m in sorted(tree.missing - core.missing)]
    return "\n".join(lines), notes


def listing(extra: str, pyproject: Path) -> str:
    """The distributions `extra` adds beyond the core (the core's own for `core`), largest first."""
    tree = walk(extra, pyproject)
    core = set() if extra == "core" else set(walk("core", pyproject).dists)
    rows = sorted(((dist_size(n), n, v) for n, v in tree.dists.items() if n not in core), reverse=True)
    out = [f"{format_size(s):>10}  {n} {v}" for s, n, v in rows]
    what = "the core" if extra == "core" else f"{extra}, beyond the core"
    out.append(f"{format_size(sum(s for s, _, _ in rows)):>10}  {len(rows)} distributions ({what})")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml")
    ap.add_argument("--extras", nargs="+", default=None,
                    help="Rows of the table (default: the core, then every extra in pyproject.toml's order).")
    ap.add_argument("--list", metavar="EXTRA", help="Print what one extra adds beyond the core (core: the core itself), largest first.")
    args = ap.parse_args(argv)
    if args.list:
        print(listing(args.list, args.pyproject))
        return 0
    extras = args.extras or ["core", *project_requirements(args.pyproject)[1]]
    text, notes = table(tuple(extras), args.pyproject)
    print(text)
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
