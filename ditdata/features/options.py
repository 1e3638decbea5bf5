"""The options a feature set is made with, checked, and the end-of-run line of a run that
made one: shared by `ditdata features` and `ditdata encode --features` (encode imports this
module, never the package's command, which imports encode's reader)."""

from __future__ import annotations

from ditdata.config import FEATURE_DTYPES, MAX_RESOLUTION
from ditdata.errors import DitdataError


def check_options(*, dtype: str, dims: int | None, resolution: int | None, flag: str = "--features") -> None:
    """The options a feature set is made with (one line naming the flag when one is wrong)."""
    if dtype not in FEATURE_DTYPES:
        raise DitdataError(f"{flag}-dtype {dtype!r}: use one of {', '.join(FEATURE_DTYPES)}")
    if dims is not None and dims < 1:
        raise DitdataError(f"{flag}-dims {dims}: expected at least 1 (the PCA's dims)")
    if resolution is not None and not 0 < resolution <= MAX_RESOLUTION:
        raise DitdataError(f"{flag}-resolution {resolution}: expected 1 to {MAX_RESOLUTION} pixels (e.g. 224)")


def report(summary: dict) -> str | None:
    """The end-of-run line; None on the ranks that wrote no manifest."""
    m = summary.get("manifest")
    if m is None:
        return None
    enc, storage = m["encoder"], m["storage"]
    feat = m["fields"]["tensors"]["feat"]
    pca = storage.get("pca")
    pca_part = (f", PCA {enc['dim']} -> {storage['dims']} dims ({100 * pca['explained_variance']:.1f}% of the "
                "variance)" if pca else "")
    flips = ", with flips" if "feat_flip" in m["fields"]["tensors"] else ""
    rate = summary["images"] / summary["seconds"] if summary["seconds"] > 0 else 0.0
    return (f"feature set {m['name']} ({enc['name']}, {feat['shape'][0]} tokens x {feat['shape'][1]} "
            f"{feat['dtype']}{pca_part}{flips}): {m['num_samples']} rows, {summary['bytes_per_sample']} bytes per "
            f"sample, cosine to fp32 {storage['cosine_to_fp32']:.4f}; this run wrote {summary['written']} shards "
            f"({summary['already']} already done) at {rate:.1f} img/s")
