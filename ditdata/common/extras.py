"""Optional extras in one wording: "X needs the E extra: pip install 'ditkit[E]'", imported
with their import-time notes kept quiet where they are noise; and the installed version of a
distribution, as records name the libraries that made them."""

from __future__ import annotations

import importlib
import logging
from contextlib import contextmanager
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


# The loggers bitsandbytes' import speaks through (peft's import brings it, with transformers; so
# does --optimizer adamw8bit): on CPUs with AVX512-BF16 it looks for its optional 4-bit CPU kernel
# through the "kernels" package (transformers brings it): missing, it says so; present and
# offline, kernels warns that it skips the hub's publisher check. LoRA and the 8-bit optimizer
# use neither, so for a run both are noise.
BITSANDBYTES_LOGGERS = ("bitsandbytes.backends.cpu.ops", "kernels")


@contextmanager
def quiet_loggers(*names: str):
    """The loggers `names` at ERROR inside the block (an import's notes), at their own levels again after it."""
    quiet = [logging.getLogger(n) for n in names]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)


def require(module: str, what: str, extra: str, error: type[Exception] = UserError, quiet: tuple[str, ...] = ()):
    """`module` imported (the loggers `quiet` at ERROR meanwhile: quiet_loggers), or `error`
    naming the extra that brings it."""
    try:
        with quiet_loggers(*quiet):
            return importlib.import_module(module)
    except ImportError as e:
        raise missing_extra(what, extra, e, error) from e


def installed_version(dist: str) -> str | None:
    """The installed version of distribution `dist` (its pip name), None when it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
