"""The evaluation's one error type."""

from __future__ import annotations

from ditdata.common.errors import UserError


class EvalError(UserError):
    """Something the user can fix (missing weights, bad input file): one line, no traceback."""
