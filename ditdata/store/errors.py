class StoreError(Exception):
    """A store is absent, incomplete, corrupt or incompatible. The message names the file."""
