"""Improved precision and recall (k-NN manifolds), as ADM's evaluator computes them.

A point's radius is the squared distance to its 3rd nearest neighbour (itself excluded);
precision = share of samples within the radius of some reference point, recall = share of
reference points within the radius of some sample. ADM computes the distances in fp16
(fp32 when that overflows); here in fp32, in 10,000 x 10,000 blocks, on the Inception's
device (torch, imported inside the functions), never the full N x N matrix.
"""

from __future__ import annotations

import numpy as np

from dittrain.eval.errors import EvalError

PR_K = 3  # ADM's nhood_sizes
PR_BLOCK = 10_000  # ADM's row/column batch


class exact_fp32:
    """No autocast and no TF32 inside the block (a trainer may have turned them on): ADM's
    features and distances are plain fp32."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        import torch

        self._autocast = torch.autocast(self.device.type, enabled=False)
        self._autocast.__enter__()
        self._tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    def __exit__(self, *exc):
        import torch

        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self._tf32
        return self._autocast.__exit__(*exc)


def _torch_feats(x, device):
    import torch

    return torch.as_tensor(np.asarray(x, dtype=np.float32), device=torch.device(device))


def _sq_dists(a, b):
    """Squared euclidean distances (ADM's |u|^2 - 2 u.v + |v|^2, clamped at 0)."""
    d = (a * a).sum(1)[:, None] - 2 * (a @ b.T) + (b * b).sum(1)[None, :]
    return d.clamp_min_(0)


def manifold_radii(feats, k: int = PR_K, *, block: int = PR_BLOCK, device="cpu") -> np.ndarray:
    """Each point's squared distance to its k-th nearest neighbour in `feats`, itself
    excluded (index k of its sorted row of distances, index 0 being itself), computed in
    blocks: a running k+1 smallest per row, never the full N x N matrix."""
    import torch

    x = _torch_feats(feats, device)
    n = len(x)
    if n <= k:
        raise EvalError(f"precision/recall with k={k} need more than {k} images per side, got {n}")
    out = torch.empty(n, dtype=torch.float32, device=x.device)
    with exact_fp32(x.device):
        for i in range(0, n, block):
            rows, best = x[i:i + block], None
            for j in range(0, n, block):
                d = _sq_dists(rows, x[j:j + block])
                cand = d if best is None else torch.cat([best, d], dim=1)
                best = torch.topk(cand, min(k + 1, cand.shape[1]), dim=1, largest=False).values
            out[i:i + block] = best[:, k]
    return out.cpu().numpy()


def precision_recall(ref_feats, sample_feats, k: int = PR_K, *, ref_radii=None, block: int = PR_BLOCK,
                     device="cpu") -> tuple[float, float]:
    """ADM's improved precision and recall (k-NN manifolds, see the module docstring):
    precision = share of samples inside the reference manifold, recall = share of reference
    points inside the sample manifold. `ref_radii` (manifold_radii of ref_feats) saves
    recomputing them against a fixed reference."""
    import torch

    r, s = _torch_feats(ref_feats, device), _torch_feats(sample_feats, device)
    if r.ndim != 2 or s.ndim != 2 or r.shape[1] != s.shape[1]:
        raise EvalError(f"precision/recall: features {tuple(r.shape)} and {tuple(s.shape)} do not match")
    if ref_radii is None:
        ref_radii = manifold_radii(ref_feats, k, block=block, device=device)
    r_rad = _torch_feats(ref_radii, device)
    s_rad = _torch_feats(manifold_radii(sample_feats, k, block=block, device=device), device)
    s_in = torch.zeros(len(s), dtype=torch.bool, device=s.device)
    r_in = torch.zeros(len(r), dtype=torch.bool, device=r.device)
    with exact_fp32(s.device):
        for i in range(0, len(s), block):
            for j in range(0, len(r), block):
                d = _sq_dists(s[i:i + block], r[j:j + block])  # samples x references
                s_in[i:i + block] |= (d <= r_rad[None, j:j + block]).any(dim=1)
                r_in[j:j + block] |= (d <= s_rad[i:i + block, None]).any(dim=0)
    return int(s_in.sum()) / len(s_in), int(r_in.sum()) / len(r_in)
