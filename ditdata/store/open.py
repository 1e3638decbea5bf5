"""Opening a store: a directory (reader.Store) or a URL (remote.RemoteStore, read through a
local cache). The one place that tells the two apart, so the reader knows local stores only
and the remote store builds on it."""

from __future__ import annotations

from .reader import Store


def is_url(root) -> bool:
    """A store location read through fsspec: anything with '://' except file://."""
    return isinstance(root, str) and "://" in root and not root.startswith("file://")


def open_store(root, *, verify: bool = False, **remote) -> Store:
    """The store at `root`: a directory, or a URL (s3://, gs://, http(s)://, ...) read through
    a local cache (remote.RemoteStore; `remote` holds its cache_dir, cache_limit, storage_options)."""
    if is_url(root):
        from .remote import RemoteStore  # (fsspec and the cache, only for URLs)

        return RemoteStore(root, verify=verify, **remote)
    return Store(root, verify=verify)
