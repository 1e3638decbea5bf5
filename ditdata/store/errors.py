from ditdata.common.errors import UserError


class StoreError(UserError):
    """A store is absent, incomplete, corrupt or incompatible. The message names the file."""
