"""Names a package imports on first use: its `_EXPORTS = {name: submodule}` table, read by a
module `__getattr__` (PEP 562), so importing the package costs nothing until a name is used.

    _EXPORTS = {"Store": "reader", ...}
    __getattr__ = lazy_exports(__name__, _EXPORTS, globals())

tests/test_structure.py reads the same `_EXPORTS` tables to count these imports in the graph.
"""

from __future__ import annotations

import importlib


def lazy_exports(package: str, exports: dict[str, str], namespace: dict):
    """The `__getattr__` of `package`: exports[name] is the submodule that defines name; a name
    once imported is kept in the package's `namespace`, so the next use is a plain lookup."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{exports[name]}", package), name)
        namespace[name] = value
        return value

    return __getattr__
