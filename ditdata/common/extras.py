"""Optional extras in one wording: "X needs the E extra: pip install 'ditkit[E]'"; and the
installed version of a distribution, as records name the libraries that made them."""

from __future__ import annotations

import importlib
from importlib import metadata

from ditdata.common.errors import UserError


def install_hint(extra: str) -> str:
    return f"pip install 'ditkit[{extra}]'"


def missing_extra(what: str, extra: str, cause: BaseException | None = None,
                  error: type[Exception] = UserError) -> Exception:
    """The error to raise when `what` needs an extra that is not installed (the import's own
    message in brackets, where there is one)."""
    why = f" ({' '.join(str(cause).split())})" if cause is not None and str(cause) else ""
    return error(f"{what} needs the {extra} extra{why}: {install_hint(extra)}")


def require(module: str, what: str, extra: str, error: type[Exception] = UserError):
    """`module` imported, or `error` naming the extra that brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise missing_extra(what, extra, e, error) from e


def installed_version(dist: str) -> str | None:
    """The installed version of distribution `dist` (its pip name), None when it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
