"""FID, sFID and Inception Score of features, as ADM's evaluator computes them (numpy, scipy).

    FID     |mu1 - mu2|^2 + tr(S1) + tr(S2) - 2 tr(sqrtm(S1 S2)), mean and np.cov in float64,
            scipy.linalg.sqrtm, retried with 1e-6 added to the diagonals when not finite,
            real part taken when the imaginary diagonal is ~0 (atol 1e-3); sFID is the same
            on the spatial features
    IS      exp(mean_x KL(p(y|x) || p(y))) per split of 5000 samples, mean over splits

Precision and recall (k-NN manifolds, blockwise on a device) are in dittrain.eval.manifold.
"""

from __future__ import annotations

import warnings

import numpy as np

from dittrain.eval.errors import EvalError

IS_SPLIT = 5000  # ADM's split_size
FID_EPS = 1e-6


def feature_stats(feats: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ADM's statistics of (N, D) features: mean and np.cov(rowvar=False), in float64."""
    feats = np.asarray(feats, dtype=np.float64)
    if feats.ndim != 2 or len(feats) < 2:
        raise EvalError(f"statistics need at least 2 images, got {len(feats) if feats.ndim else 0}")
    return feats.mean(axis=0), np.cov(feats, rowvar=False)


def fid(mu1, sigma1, mu2, sigma2, eps: float = FID_EPS) -> float:
    """The Frechet distance between N(mu1, sigma1) and N(mu2, sigma2) by ADM's formula."""
    from scipy import linalg

    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    s1, s2 = np.atleast_2d(np.asarray(sigma1, np.float64)), np.atleast_2d(np.asarray(sigma2, np.float64))
    if mu1.shape != mu2.shape or s1.shape != s2.shape or s1.shape != mu1.shape * 2:
        raise EvalError(f"statistics do not match: mean {mu1.shape} vs {mu2.shape}, "
                        f"covariance {s1.shape} vs {s2.shape}")
    diff = mu1 - mu2
    with warnings.catch_warnings():
        # Fewer images than dimensions make the covariances singular: scipy warns, ADM's
        # formula goes on (the retry below, then the imaginary-part check).
        warnings.simplefilter("ignore", linalg.LinAlgWarning)
        covmean = linalg.sqrtm(s1.dot(s2))
        if not np.isfinite(covmean).all():
            offset = np.eye(s1.shape[0]) * eps  # singular product: nudge both diagonals
            covmean = linalg.sqrtm((s1 + offset).dot(s2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            worst = np.max(np.abs(np.diagonal(covmean).imag))
            raise EvalError(f"FID: the covariance square root has an imaginary component {worst:.3g} "
                            "(too few or degenerate images?)")
        covmean = covmean.real
    return float(diff.dot(diff) + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean))


def inception_score(logits, split_size: int = IS_SPLIT) -> float:
    """ADM's Inception Score of (N, 1008) unbiased logits: exp(mean KL(p(y|x) || p(y))) per
    split of `split_size` (the last one may be shorter), averaged over the splits."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    scores = []
    for i in range(0, len(p), split_size):
        part = p[i:i + split_size]
        kl = part * (np.log(part) - np.log(part.mean(axis=0, keepdims=True)))
        scores.append(np.exp(kl.sum(axis=1).mean()))
    return float(np.mean(scores))
