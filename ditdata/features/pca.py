"""PCA of encoder tokens (`--features-dims K`): the stored targets are the K-dim projections
y = (x - mean) @ components.T, and x ~= y @ components + mean reconstructs them.

The fit is exact (eigendecomposition of the float64 covariance of the sampled tokens), and
deterministic: each component's sign is fixed so that its largest-magnitude entry is
positive, so the same sample gives the same bytes on every machine and every rerun.
"""

from __future__ import annotations

import numpy as np

CHUNK_ROWS = 8192  # tokens per step of the covariance sum (bounds the float64 copy)


def fit(x: np.ndarray, k: int) -> dict:
    """(M, dim) tokens -> {"components": (k, dim) float32, "mean": (dim,) float32,
    "explained_variance": the fraction of the total variance the k components keep}."""
    x = np.asarray(x, dtype=np.float32)
    m, dim = x.shape
    mean = x.astype(np.float64).mean(axis=0)
    cov = np.zeros((dim, dim), dtype=np.float64)
    for i in range(0, m, CHUNK_ROWS):
        c = x[i:i + CHUNK_ROWS].astype(np.float64) - mean
        cov += c.T @ c
    cov /= max(1, m - 1)
    values, vectors = np.linalg.eigh(cov)  # ascending
    order = np.argsort(values)[::-1][:k]
    comps = vectors[:, order].T  # (k, dim)
    signs = np.sign(comps[np.arange(k), np.abs(comps).argmax(axis=1)])
    comps *= np.where(signs == 0, 1.0, signs)[:, None]
    total = float(np.clip(values, 0, None).sum())
    kept = float(np.clip(values[order], 0, None).sum())
    return {"components": comps.astype(np.float32), "mean": mean.astype(np.float32),
            "explained_variance": kept / total if total > 0 else 1.0}


def project(x: np.ndarray, pca: dict) -> np.ndarray:
    """(..., dim) -> (..., k) float32."""
    return ((np.asarray(x, np.float32) - pca["mean"]) @ pca["components"].T).astype(np.float32)


def reconstruct(y: np.ndarray, pca: dict) -> np.ndarray:
    """(..., k) -> (..., dim) float32: the tokens the projections stand for."""
    return (np.asarray(y, np.float32) @ pca["components"] + pca["mean"]).astype(np.float32)
