"""The latent store: the one contract between ditdata (writes) and dittrain (reads).

    from ditdata.store import open_store, StoreWriter, Schema, TensorSpec

A store is a directory with `manifest.json` (written last, atomically) and one shard
per input shard under `shards/`, in the `zarr` or `wds` backend. See manifest.py for
the manifest's fields and writer.py for how shards are published.
"""

from .errors import StoreError
from .manifest import FORMAT_VERSION, MANIFEST, decode_array, encode_array, identity
from .reader import Shard, Store, open_store
from .schema import BFLOAT16, LATENT_FIELDS, TEXT_FIELDS, Schema, TensorSpec
from .writer import StoreWriter

__all__ = [
    "BFLOAT16", "FORMAT_VERSION", "LATENT_FIELDS", "MANIFEST", "TEXT_FIELDS", "Schema", "Shard",
    "Store", "StoreError", "StoreWriter", "TensorSpec", "decode_array", "encode_array",
    "identity", "open_store",
]
