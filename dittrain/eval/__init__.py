"""Sample quality: FID, sFID, Inception Score, precision and recall, as ADM computes them.

The protocol is that of ADM's evaluator (openai/guided-diffusion, evaluations/evaluator.py),
the one DiT and most ImageNet diffusion papers report:

    network     the TF Inception-v3 graph of 2015-12-05, here torch-fidelity's port of it
                (FeatureExtractorInceptionV3), uint8 images in at any size and resized to
                299 by its TF1-compatible bilinear resize, as ADM's graph does
    features.py  pool3 (2048-d: FID, precision, recall), the first 7 channels of mixed_6/conv
                (2023-d: sFID) and the 1008 logits (Inception Score); exactly which tensors,
                in dittrain.eval.inception's docstring
    FID         |mu1 - mu2|^2 + tr(S1) + tr(S2) - 2 tr(sqrtm(S1 S2)), mean and np.cov in
                float64, scipy.linalg.sqrtm, retried with 1e-6 added to the diagonals when
                not finite, real part taken when the imaginary diagonal is ~0 (atol 1e-3)
    IS          exp(mean_x KL(p(y|x) || p(y))) per split of 5000 samples, mean over splits
    P / R       k=3 manifolds: a point's radius is the squared distance to its 3rd nearest
                neighbour (itself excluded); precision = share of samples within the radius of
                some reference point, recall = share of reference points within the radius of
                some sample. ADM computes the distances in fp16 (fp32 when that overflows);
                here in fp32, in 10,000 x 10,000 blocks, on the Inception's device.

Inputs are ADM sample batches (.npz with arr_0, uint8 N x H x W x 3), folders of images
and, as the reference, also an ADM reference batch (VIRTUAL_imagenet256_labeled.npz: its
precomputed mu/sigma/mu_s/sigma_s are used, its images only for precision/recall) or an
image-shard folder of `ditdata fetch` (centre-cropped with the encoder's ADM rule). The
statistics of a reference are cached beside it (see `reference_stats`).

    inception = load_inception(device="cuda")           # offline: see find_inception
    ref = reference_stats("VIRTUAL_imagenet256_labeled.npz", inception)
    feats = image_features(uint8_nhwc_batches, inception)
    metrics = compute_metrics(feats, ref)               # fid, sfid, inception_score, ...

The modules, each readable alone (leaves first):

    errors.py      EvalError
    metrics.py     FID, sFID statistics, Inception Score (numpy, scipy)
    manifold.py    precision and recall on k-NN manifolds (torch, in blocks)
    inception.py   the network: finding and checking its weights file, features of a batch
    sources.py     .npz batches, image folders and image shards, read in uint8 batches
    features.py    images of any of those kinds -> features
    reference.py   a reference's statistics and their cache
    evaluation.py  evaluate(): samples against a reference, with provenance; the table

The metrics know nothing of sampling: the trainer's evaluation (FID during a run) is
dittrain.train.fid. torch, scipy and torch-fidelity are imported inside the functions
that need them.
"""

from dittrain.eval.errors import EvalError
from dittrain.eval.evaluation import compute_metrics, evaluate, format_table, write_json
from dittrain.eval.features import image_features, source_features
from dittrain.eval.inception import (
    FEATURE_SET,
    FEATURES,
    INCEPTION_ENV,
    INCEPTION_FILES,
    LOGITS_DIM,
    POOL_DIM,
    SPATIAL_CHANNELS,
    SPATIAL_DIM,
    Inception,
    find_inception,
    hub_checkpoints,
    inception_url,
    load_inception,
)
from dittrain.eval.manifold import PR_BLOCK, PR_K, manifold_radii, precision_recall
from dittrain.eval.metrics import FID_EPS, IS_SPLIT, feature_stats, fid, inception_score
from dittrain.eval.reference import (
    CACHE_VERSION,
    STATS_NAME,
    RefStats,
    cache_key,
    default_cache_dir,
    image_stats,
    reference_stats,
    stats_from_features,
)
from dittrain.eval.sources import Source, open_source

__all__ = [
    "CACHE_VERSION", "FEATURES", "FEATURE_SET", "FID_EPS", "INCEPTION_ENV", "INCEPTION_FILES", "IS_SPLIT",
    "LOGITS_DIM", "POOL_DIM", "PR_BLOCK", "PR_K", "SPATIAL_CHANNELS", "SPATIAL_DIM", "STATS_NAME",
    "EvalError", "Inception", "RefStats", "Source",
    "cache_key", "compute_metrics", "default_cache_dir", "evaluate", "feature_stats", "fid", "find_inception",
    "format_table", "hub_checkpoints", "image_features", "image_stats", "inception_score", "inception_url",
    "load_inception", "manifold_radii", "open_source", "precision_recall", "reference_stats",
    "source_features", "stats_from_features", "write_json",
]
