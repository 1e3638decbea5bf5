"""The latent store: the one contract between ditdata (writes) and dittrain (reads).

    from ditdata.store import open_store, StoreWriter, Schema, TensorSpec

A store is a directory with `manifest.json` (written last, atomically) and one shard
per input shard under `shards/`, in the `zarr` or `wds` backend. See manifest.py for
the manifest's fields, schema.py for what a sample holds (and the int8 fields' quantization), writer.py for how shards are
published (defaults.py: its options' defaults), backends.py for the shard
formats (a table of Backend classes with capability flags), reader.py for reading a local
store, remote.py for a store at a URL, open.py for opening either, features.py for the
feature sets (representation targets, row for row) a store can hold beside its latents, and
captions.py for its caption sets (several captions per image, each embedded, and a store read
with several of them joined); errors.py has StoreError.

A bucketed store (`ditdata encode --buckets`, aspect-ratio buckets) is a directory of plain
stores, one per bucket size, under a top manifest (buckets.py):

    STORE/manifest.json        top manifest, written last: counts, stats, "buckets" section
    STORE/buckets/WxH/         a plain store (manifest.json, config.json, shards/) whose
                               latents are all (C, H/f, W/f)

`open_store` opens either; `store.buckets` is () for a plain store and the Buckets (each
with its plain `.store`) of a bucketed one, whose top reads no samples itself.

The package holds the contract and nothing else; what both command-line tools share
(atomic files, locks, devices, one-line errors, sizes) is in ditdata.common. Names are
imported on first use, so importing the package does not pay for numpy.
"""

from __future__ import annotations

from ditdata.common.lazy import lazy_exports

_EXPORTS = {
    "StoreError": "errors",
    "FORMAT_VERSION": "manifest", "MANIFEST": "manifest", "decode_array": "manifest",
    "encode_array": "manifest", "identity": "manifest", "enclosing_store": "manifest",
    "refuse_inside_store": "manifest",
    "Conditioning": "reader", "Shard": "reader", "Store": "reader",
    "open_store": "open", "is_url": "open",
    "Backend": "backends", "BACKEND_CLASSES": "backends",
    "BFLOAT16": "schema", "LATENT_FIELDS": "schema", "TEXT_FIELDS": "schema", "Schema": "schema",
    "TensorSpec": "schema",
    "StoreWriter": "writer",
    "FeatureSchema": "schema", "FEATURE_FIELDS": "schema",
    "FeatureSet": "features", "FeatureWriter": "features", "FeaturedStore": "features",
    "open_features": "features", "feature_sets": "features",
    "quantize": "schema", "dequantize": "schema", "values": "schema", "LATENT_SCALES": "schema",
    "RemoteStore": "remote", "parse_size": "remote",
    "Bucket": "buckets", "BucketedStore": "buckets", "finalize_buckets": "buckets", "bucket_name": "buckets",
    "parse_bucket_name": "buckets",
    "CaptionSet": "captions", "CaptionsView": "captions", "caption_sets": "captions",
}
__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
