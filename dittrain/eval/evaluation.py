"""An evaluation end to end: samples and a reference in, the metrics with their provenance
out, and the small table `dittrain eval` prints."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from dittrain.eval.errors import EvalError
from dittrain.eval.features import image_features, source_features
from dittrain.eval.inception import FEATURE_SET, Inception, load_inception
from dittrain.eval.manifold import PR_K, precision_recall
from dittrain.eval.metrics import IS_SPLIT, feature_stats, fid, inception_score
from dittrain.eval.reference import RefStats, reference_stats
from dittrain.eval.sources import open_source


def compute_metrics(sample_feats: dict, ref: RefStats, *, with_pr: bool = True, device=None) -> dict:
    """fid, sfid, inception_score, precision, recall (None without the reference's pool
    features or with with_pr=False), n_samples, n_ref."""
    mu, sigma = feature_stats(sample_feats["pool"])
    mu_s, sigma_s = feature_stats(sample_feats["spatial"])
    out = {"fid": fid(mu, sigma, ref.mu, ref.sigma), "sfid": fid(mu_s, sigma_s, ref.mu_s, ref.sigma_s),
           "inception_score": inception_score(sample_feats["logits"]), "precision": None, "recall": None,
           "n_samples": int(len(sample_feats["pool"])), "n_ref": ref.n}
    if with_pr and ref.pool is not None:
        out["precision"], out["recall"] = precision_recall(ref.pool, sample_feats["pool"], PR_K,
                                                           ref_radii=ref.radii, device=device or "cpu")
    return out


def evaluate(samples, ref, *, inception=None, batch_size: int = 64, device="auto", resolution: int | None = None,
             cache_dir=None, with_pr: bool = True, progress: bool = False,
             log: Callable[[str], None] | None = None) -> dict:
    """compute_metrics of `samples` (a path: .npz or folder of images; or anything
    image_features takes) against `ref` (reference_stats), plus "provenance". `inception`:
    an Inception, or the weights file (None: find_inception). `resolution` (the reference's
    centre crop for folders) defaults to the samples' own (short side)."""
    t0 = time.time()
    log = log or (lambda line: None)
    sample_src = open_source(samples, allow_shards=False) if isinstance(samples, (str, Path)) else None
    if resolution is None:
        if sample_src is not None:
            size = sample_src.size
        else:  # an array's (N, H, W, 3) or a tensor's (N, 3, H, W); None for anything else
            shape = getattr(samples, "shape", None)
            size = (None if shape is None or len(shape) != 4
                    else (shape[1], shape[2]) if shape[-1] == 3 else (shape[2], shape[3]))
        resolution = min(size) if size else None
    if isinstance(ref, (str, Path)):
        ref = open_source(ref, resolution=resolution)  # inputs are checked before the network loads
    with _memory_hint(batch_size, with_pr, inception.device if isinstance(inception, Inception) else device):
        inc = inception if isinstance(inception, Inception) else load_inception(inception, device)
        ref_stats = reference_stats(ref, inc, resolution=resolution, batch_size=batch_size, cache_dir=cache_dir,
                                    with_pr=with_pr, progress=progress, log=log)
        if sample_src is not None:
            feats = source_features(sample_src, inc, batch_size=batch_size, progress=progress, desc="samples")
            if sample_src.skipped:
                log(f"note: skipped {sample_src.skipped} unusable samples (e.g. {sample_src.skipped_examples[0]})")
        else:
            feats = image_features(samples, inc, batch_size=batch_size, progress=progress, desc="samples")
        metrics = compute_metrics(feats, ref_stats, with_pr=with_pr, device=inc.device)
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for name in ("ditkit", "torch", "torch-fidelity", "scipy", "numpy"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    metrics["provenance"] = {
        "protocol": "ADM evaluator (guided-diffusion evaluations/evaluator.py), torch-fidelity Inception-v3",
        "samples": str(samples) if sample_src is not None else "in memory",
        "samples_skipped": sample_src.skipped if sample_src is not None else 0,
        "ref": ref_stats.source, "ref_digest": ref_stats.digest, "ref_skipped": ref_stats.skipped,
        "ref_statistics": "precomputed" if ref_stats.precomputed else "computed",
        "ref_cache": ref_stats.cache, "ref_cached": ref_stats.cached, "resolution": resolution,
        "inception": str(inc.path), "inception_sha256": inc.sha256, "feature_set": FEATURE_SET,
        "k": PR_K, "is_split": IS_SPLIT, "device": str(inc.device), "batch_size": batch_size,
        "seconds": round(time.time() - t0, 3), "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": versions,
    }
    return metrics


def _memory_hint(batch_size: int, with_pr: bool, device):
    """Out of GPU memory in `dittrain eval`: one line that names the Inception pass (fp32,
    exact: dittrain.eval.inception), its batch, and the flags that lower it (precision and
    recall compare features in 10,000 x 10,000 blocks on the same device)."""
    from ditdata.common.devices import resolve_device
    from ditdata.common.memory import halved, out_of_memory_hint

    hints = [halved("--batch-size", batch_size), "--no-precision-recall" if with_pr else None]
    return out_of_memory_hint(what="evaluating with the FID Inception-v3", batch=f"--batch-size {batch_size}",
                              precision="fp32", hints=hints, device=resolve_device(device), error=EvalError)


def format_table(metrics: dict) -> str:
    """The metrics as the small table `dittrain eval` prints."""
    def val(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    prov = metrics.get("provenance", {})
    how = ("cached" if prov.get("ref_cached") else "computed") + (
        ", precomputed FID/sFID statistics" if prov.get("ref_statistics") == "precomputed" else "")
    rows = [("FID", val(metrics["fid"], ".4f")), ("sFID", val(metrics["sfid"], ".4f")),
            ("Inception Score", val(metrics["inception_score"], ".4f")),
            ("Precision", val(metrics["precision"], ".4f")), ("Recall", val(metrics["recall"], ".4f")),
            ("samples", str(metrics["n_samples"]) + _skipped(prov.get("samples_skipped"))),
            ("reference", f"{metrics['n_ref']}{_skipped(prov.get('ref_skipped'))} ({how})")]
    return "\n".join(f"{k:<16} {v}" for k, v in rows)


def _skipped(n) -> str:
    return f" ({n} unusable skipped)" if n else ""


def write_json(metrics: dict, path) -> Path:
    from ditdata.common import files

    p = Path(path)
    files.write_json_atomic(p, metrics, indent=2)
    return p
