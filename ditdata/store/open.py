"""Opening a store: a directory (reader.Store) or a URL (remote.RemoteStore, read through a
local cache). The one place that tells the two apart, so the reader knows local stores only
and the remote store builds on it."""

from __future__ import annotations

from .buckets import open_local
from .reader import Store


def is_url(root) -> bool:
    """A store location read through fsspec: anything with '://' except file://."""
    return isinstance(root, str) and "://" in root and not root.startswith("file://")


def open_store(root, *, verify: bool = False, features: str | None = None, captions=None, **remote) -> Store:
    """The store at `root`: a directory (a bucketed one: buckets.BucketedStore), or a URL (s3://, gs://, http(s)://, ...) read through
    a local cache (remote.RemoteStore; `remote` holds its cache_dir, cache_limit, storage_options).
    features: the name of one of its feature sets, read with it (features.FeaturedStore). captions: names
    of its caption sets, read joined per sample (captions.CaptionsView)."""
    if is_url(root):
        from .remote import RemoteStore  # (fsspec and the cache, only for URLs)

        store = RemoteStore(root, verify=verify, **remote)
    else:
        store = open_local(root, verify=verify)
    if captions:
        from .captions import CaptionsView

        store = CaptionsView(store, captions)
    if features:
        from .features import FeaturedStore, open_features

        return FeaturedStore(store, features, features=open_features(store, features, verify=verify))
    return store
