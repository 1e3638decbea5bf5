from ditdata.common.errors import UserError


class DitdataError(UserError):
    """A failure the user can act on (bad input, missing model, ...): the CLI prints the
    message as one line and exits non-zero instead of showing a traceback."""
