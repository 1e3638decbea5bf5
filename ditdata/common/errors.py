"""The one base class of failures a user can act on, and the one way to shorten an
exception to a line.

Every module's own error (StoreError, CheckpointError, SampleError, ...) derives from
UserError, so the command-line groups catch one type and print its message as one line;
anything else is a bug and is reported as one (ditdata.common.cli)."""

from __future__ import annotations


class UserError(Exception):
    """A failure the user can act on (bad input, a missing model or extra, a busy output):
    its message is the whole story, printed as one line with a non-zero exit."""


def one_line(e: BaseException | str, limit: int = 500) -> str:
    """An exception (or text) as one line of at most `limit` characters; the type's name
    when the message is empty."""
    text = " ".join(str(e).split())[:limit]
    return text or (type(e).__name__ if isinstance(e, BaseException) else "")


def described(e: BaseException, limit: int = 300) -> str:
    """A third-party library's exception as one line that names its type ("OSError: ...")."""
    return f"{type(e).__name__}: {one_line(e, limit)}"


def first_names(names, most: int = 10) -> str:
    """The first `most` of `names`, comma-separated, with " ..." when there are more: a list
    an error message can name without growing past a line."""
    names = list(names)
    return ", ".join(map(str, names[:most])) + (" ..." if len(names) > most else "")
