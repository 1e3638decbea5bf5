"""Sample quality: FID, sFID, Inception Score, precision and recall, as ADM computes them.

The protocol is that of ADM's evaluator (openai/guided-diffusion, evaluations/evaluator.py),
the one DiT and most ImageNet diffusion papers report:

    network     the TF Inception-v3 graph of 2015-12-05, here torch-fidelity's port of it
                (FeatureExtractorInceptionV3), uint8 images in at any size and resized to
                299 by its TF1-compatible bilinear resize, as ADM's graph does
    pool        pool3, 2048-d                                   -> FID, precision, recall
    spatial     mixed_6/conv (torch-fidelity: Mixed_6d.branch1x1 after its ReLU, 192x17x17),
                first 7 channels, flattened (h, w, c) as TF's NHWC tensor is: 2023-d -> sFID
    logits      pool3 @ softmax weights, no bias (1008 classes)  -> Inception Score
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

torch, scipy and torch-fidelity are imported inside the functions that need them.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
import zipfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path

import numpy as np

from ditdata.common.errors import UserError

INCEPTION_FILES = ("weights-inception-2015-12-05-6726825d.pth",  # torch-fidelity's name
                   "pt_inception-2015-12-05-6726825d.pth")  # pytorch-fid's: same keys and shapes
INCEPTION_ENV = "DITKIT_INCEPTION"
POOL_DIM, SPATIAL_CHANNELS, SPATIAL_DIM, LOGITS_DIM = 2048, 7, 7 * 17 * 17, 1008
IS_SPLIT = 5000  # ADM's split_size
PR_K = 3  # ADM's nhood_sizes
PR_BLOCK = 10_000  # ADM's row/column batch
FID_EPS = 1e-6
DEFAULT_CACHE_DIR = Path("~/.cache/ditkit/eval")
CACHE_VERSION = 1
# What a cache file holds, part of its key: the two feature sets' definitions.
FEATURE_SET = "tf-inception-2015-12-05:pool3-2048,mixed_6/conv[:7]-nhwc-2023"
STATS_NAME = ".ditkit-stats-"  # REF.ditkit-stats-KEY.npz beside a file, REF/.ditkit-stats-KEY.npz in a folder
_PRECOMPUTED = ("mu", "sigma", "mu_s", "sigma_s")  # an ADM reference batch's statistics
FEATURES = ("pool", "spatial", "logits")  # what Inception.features returns


class EvalError(UserError):
    """Something the user can fix (missing weights, bad input file): one line, no traceback."""


def _line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


# ----------------------------------------------------------------------------- metrics


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
    with _exact_fp32(x.device):
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
    with _exact_fp32(s.device):
        for i in range(0, len(s), block):
            for j in range(0, len(r), block):
                d = _sq_dists(s[i:i + block], r[j:j + block])  # samples x references
                s_in[i:i + block] |= (d <= r_rad[None, j:j + block]).any(dim=1)
                r_in[j:j + block] |= (d <= s_rad[i:i + block, None]).any(dim=0)
    return int(s_in.sum()) / len(s_in), int(r_in.sum()) / len(r_in)


# ----------------------------------------------------------------------------- the network


def inception_url() -> str:
    """Where torch-fidelity downloads the weights from (to fetch them on another machine)."""
    try:
        from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3
    except ImportError:
        raise EvalError("torch-fidelity is not installed: pip install 'ditkit[eval]'") from None
    return URL_INCEPTION_V3


def hub_checkpoints() -> Path:
    import torch

    return Path(torch.hub.get_dir()) / "checkpoints"


def find_inception(path=None) -> Path:
    """The Inception weights file: `path`, else $DITKIT_INCEPTION, else torch-fidelity's or
    pytorch-fid's file in the torch hub cache. Never downloads: EvalError saying where to
    get it and where to put it."""
    where = hub_checkpoints()
    fix = (f"download {inception_url()} on a machine with internet access and put it in {where}/ "
           f"(or pass --inception FILE, or set {INCEPTION_ENV})")
    for given, how in ((path, "--inception"), (os.environ.get(INCEPTION_ENV) or None, f"${INCEPTION_ENV}")):
        if given is not None:
            p = Path(given).expanduser()
            if not p.is_file():
                raise EvalError(f"Inception weights {p} (from {how}): no such file; {fix}")
            return p
    for name in INCEPTION_FILES:
        if (where / name).is_file():
            return where / name
    raise EvalError(f"Inception weights {INCEPTION_FILES[0]} not found in {where}; {fix}")


def _check_state_dict(path: Path) -> dict:
    """Load the file as plain tensors only (torch-fidelity itself unpickles it with
    weights_only=False, which can run code): refuse anything else before it gets there."""
    import torch

    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol of foreign files
            warnings.simplefilter("ignore")
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        # torch's own message is a paragraph about weights_only; its first sentence is the reason
        reason = _line(e).split(". ")[0]
        raise EvalError(f"{path}: not a plain tensor state dict (the FID Inception weights are one), "
                        f"refused without unpickling it ({reason[:200]})") from None
    if not isinstance(sd, dict) or not sd or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise EvalError(f"{path}: not an Inception state dict (expected a dict of name -> tensor, "
                        f"got {type(sd).__name__})")
    return sd


class _Mismatch(Exception):
    pass


_NETWORK = None


def _network_class():
    """torch-fidelity's InceptionV3 whose weight load reports a wrong state dict in one line."""
    global _NETWORK
    if _NETWORK is None:
        try:
            from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
        except ImportError:
            raise EvalError("torch-fidelity is not installed: pip install 'ditkit[eval]'") from None

        class Network(FeatureExtractorInceptionV3):
            def load_state_dict(self, state_dict, strict=True, assign=False):
                try:
                    return super().load_state_dict(state_dict, strict=strict, assign=assign)
                except RuntimeError as e:
                    raise _Mismatch(_describe_mismatch(self.state_dict(), state_dict) or _line(e)) from None

        _NETWORK = Network
    return _NETWORK


def _describe_mismatch(want: dict, got: dict) -> str:
    bn = "num_batches_tracked"  # BatchNorm's counter: older files may lack it
    missing = [k for k in want if k not in got and not k.endswith(bn)]
    unexpected = [k for k in got if k not in want]
    shapes = [f"{k} {tuple(got[k].shape)} (expected {tuple(want[k].shape)})"
              for k in want if k in got and tuple(got[k].shape) != tuple(want[k].shape)]
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing keys (e.g. {missing[0]})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected keys (e.g. {unexpected[0]})")
    if shapes:
        parts.append(f"{len(shapes)} wrong shapes (e.g. {shapes[0]})")
    return "; ".join(parts)


class Inception:
    """The FID Inception-v3 on a device. `features(batch)` -> {"pool": (N, 2048),
    "spatial": (N, 2023), "logits": (N, 1008)} float32 numpy arrays, for a uint8 batch:
    numpy (N, H, W, 3) or torch (N, 3, H, W), any H and W (resized to 299 inside)."""

    def __init__(self, net, device, path: Path):
        self.net, self.device, self.path = net, device, Path(path)
        self.images_seen = 0  # how many images went through the network (tests count it)
        self._spatial = None
        net.Mixed_6d.branch1x1.register_forward_hook(self._keep_spatial)

    def _keep_spatial(self, module, inputs, output):
        # TF's mixed_6/conv (ADM's sFID tensor) is the output of this block's 1x1 branch
        # (conv, batch norm, ReLU: 192 x 17 x 17). ADM keeps its first 7 channels of the NHWC
        # tensor; flattening them in TF's (h, w, c) order, not torch's (c, h, w), keeps the
        # features comparable with an ADM reference batch's precomputed mu_s / sigma_s (a
        # permutation leaves FID unchanged only when both sides share it).
        self._spatial = output[:, :SPATIAL_CHANNELS].permute(0, 2, 3, 1).flatten(1).float()

    @cached_property
    def sha256(self) -> str:
        from ditdata.common.files import sha256_file

        return sha256_file(self.path)

    def features(self, images) -> dict[str, np.ndarray]:
        import torch

        x = _as_nchw(images)
        with _exact_fp32(self.device), torch.inference_mode():
            pool, logits = self.net(x.to(self.device))
            spatial, self._spatial = self._spatial, None
        self.images_seen += len(x)
        return {"pool": pool.float().cpu().numpy(), "spatial": spatial.cpu().numpy(),
                "logits": logits.float().cpu().numpy()}


def _as_nchw(images):
    import torch

    if isinstance(images, np.ndarray):
        if images.ndim == 3:
            images = images[None]
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"expected uint8 (N, H, W, 3) images, got {images.dtype} {images.shape}")
        return torch.from_numpy(np.require(images, requirements=["C", "W"])).permute(0, 3, 1, 2)
    if isinstance(images, torch.Tensor):
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"expected a uint8 (N, 3, H, W) tensor, got {images.dtype} {tuple(images.shape)}")
        return images
    raise ValueError(f"expected a uint8 numpy (N, H, W, 3) or torch (N, 3, H, W) batch, got {type(images).__name__}")


class _exact_fp32:
    """No autocast and no TF32 inside the network (a trainer may have turned them on):
    ADM's features are plain fp32."""

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


def load_inception(path=None, device="cpu") -> Inception:
    """The FID network from its weights file (find_inception: `path`, $DITKIT_INCEPTION or
    the torch hub cache), checked to be a plain state dict of the right keys and shapes."""
    from ditdata.common.devices import resolve_device

    dev = resolve_device(device)
    p = find_inception(path)
    _check_state_dict(p)
    Network = _network_class()
    try:
        net = Network("ditkit-inception-v3", ["2048", "logits_unbiased"], feature_extractor_weights_path=str(p))
    except _Mismatch as e:
        raise EvalError(f"{p}: not the FID Inception-v3 weights: {e}") from None
    return Inception(net.to(dev), dev, p)


# ----------------------------------------------------------------------------- image sources


class _Bad(Exception):
    """An unusable image: skipped and counted."""


@dataclass
class Source:
    """Images to measure, read in batches: an ADM .npz, a folder of images or image shards."""

    path: Path
    kind: str  # "npz", "images" or "shards"
    count: int | None  # images it holds (None: unknown up front)
    size: tuple[int, int] | None  # (height, width) of its first image, as stored
    jobs: Callable[[], Iterator[Callable]] | None = None  # folders: one loader per image
    npz: dict = field(default_factory=dict)  # npz: arrays other than arr_0, loaded lazily
    arr: _NpyMember | None = None  # npz: arr_0, read in batches
    skipped: int = 0  # unusable images met by the last read
    skipped_examples: list = field(default_factory=list)
    resolution: int | None = None  # the ADM centre crop applied, if any

    def digest(self) -> str:
        """The reference's identity for the cache: a file's sha256; for a folder, the
        sha256 of the sorted list of its files' relative names, sizes and mtimes."""
        if self.kind == "npz":
            return "sha256:" + _file_sha256(self.path)
        names = (_image_files(self.path) if self.kind == "images"
                 else sorted(p for p in self.path.iterdir() if p.is_file() and not p.name.startswith(".")))
        h = hashlib.sha256()
        for p in names:
            st = p.stat()
            h.update(f"{p.relative_to(self.path).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return "listing-sha256:" + h.hexdigest()


_SHA_MEMO: dict[tuple, str] = {}


def _file_sha256(path: Path) -> str:
    """sha256 of a file, remembered per (path, size, mtime) for repeated evals in one process."""
    from ditdata.common.files import sha256_file

    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SHA_MEMO:
        _SHA_MEMO[key] = sha256_file(path)
    return _SHA_MEMO[key]


def _image_files(root: Path) -> list[Path]:
    from ditdata.images import IMAGE_EXTENSIONS

    return sorted(p for p in root.rglob("*")
                  if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(root).parts))


def open_source(path, *, resolution: int | None = None, allow_shards: bool = True) -> Source:
    """What `path` is: an .npz (ADM: arr_0 uint8 N x H x W x 3, other arrays kept for the
    reference's precomputed statistics), a `ditdata fetch` image-shard folder (needs a
    resolution: the encoder's ADM centre crop) or a folder of images (sorted, recursive;
    centre-cropped too when a resolution is given, else fed at their own size)."""
    p = Path(path).expanduser()
    if p.is_file():
        return _open_npz(p)
    if not p.is_dir():
        raise EvalError(f"{p}: no such file or directory")
    from ditdata import imageshards

    if (p / imageshards.DATASET_INFO).exists() or (p / imageshards.FETCH_STATE).exists() or any(p.glob("*.tar")):
        if not allow_shards:
            raise EvalError(f"{p}: an image-shard folder; samples must be an .npz or a folder of images")
        return _open_shards(p, resolution)
    files = _image_files(p)
    if not files:
        raise EvalError(f"{p}: no images in this folder (nor an .npz, nor image shards)")
    return Source(p, "images", len(files), _header_size(files), resolution=resolution,
                  jobs=lambda: (partial(_load_file, f, resolution) for f in files))


def _header_size(files: list[Path]) -> tuple[int, int] | None:
    from PIL import Image

    for f in files[:16]:
        try:
            with Image.open(f) as img:
                w, h = img.size
            return h, w
        except Exception:
            continue
    return None


def _load_file(f: Path, resolution: int | None):
    from ditdata.images import BadImageError, decode_rgb

    name = str(f)
    try:
        img = decode_rgb(f.read_bytes())
    except (OSError, BadImageError) as e:
        raise _Bad(f"{name}: {_line(e)}") from None
    return name, _crop(img, resolution)


def _crop(img, resolution: int | None) -> np.ndarray:
    if resolution is None:
        return np.asarray(img)
    from ditdata.preprocess import center_crop

    return center_crop(img, resolution)


def _open_shards(p: Path, resolution: int | None) -> Source:
    from ditdata import imageshards
    from ditdata.errors import DitdataError

    if resolution is None:
        raise EvalError(f"{p}: an image-shard reference needs a resolution (--resolution N) for its ADM centre crop")
    try:
        folder = imageshards.read_folder(p)
    except DitdataError as e:
        raise EvalError(_line(e)) from None
    if not folder.shards:
        raise EvalError(f"{p}: no shards in this image-shard folder")
    for tar in folder.shards:
        problem = imageshards.check_shard(tar, folder.expected[tar.name])
        if problem:
            raise EvalError(f"{tar}: {problem}; refetch it (rerun the same `ditdata fetch`)")
    known = [folder.expected[t.name] for t in folder.shards]
    count = sum(known) if all(n is not None for n in known) else None

    def jobs():
        for tar in folder.shards:
            try:
                for s in imageshards.iter_shard(tar):
                    yield partial(_load_sample, s, tar, resolution)
            except DitdataError as e:
                raise EvalError(_line(e)) from None

    return Source(p, "shards", count, (resolution, resolution), jobs=jobs, resolution=resolution)


def _load_sample(s, tar: Path, resolution: int):
    from ditdata.images import BadImageError

    name = f"{tar}:{s.key}"
    try:
        img = s.decode()
    except BadImageError as e:
        raise _Bad(f"{name}: {_line(e)}") from None
    return name, _crop(img, resolution)


class _NpyMember:
    """arr_0 of an .npz read batch by batch from the zip (never the whole array at once)."""

    def __init__(self, path: Path, zf: zipfile.ZipFile, member: str):
        self.path, self.zf, self.member = path, zf, member
        with zf.open(member) as f:
            self.shape, self.dtype, self.offset = _npy_header(f, path, member)

    def batches(self, batch_size: int) -> Iterator[np.ndarray]:
        n, per = self.shape[0], int(np.prod(self.shape[1:])) * self.dtype.itemsize
        with self.zf.open(self.member) as f:
            f.read(self.offset)
            for i in range(0, n, batch_size):
                k = min(batch_size, n - i)
                data = f.read(k * per)
                if len(data) != k * per:
                    raise EvalError(f"{self.path}: {self.member} is truncated ({i + len(data) // per} of {n} images)")
                yield np.frombuffer(data, self.dtype).reshape(k, *self.shape[1:])


def _npy_header(f, path: Path, member: str):
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        reader = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}.get(version)
        if reader is None:
            raise ValueError(f"npy version {version}")
        shape, fortran, dtype = reader(f)
        offset = f.tell()
    except (ValueError, OSError, zipfile.BadZipFile) as e:
        raise EvalError(f"{path}: {member} is not a readable array ({_line(e)})") from None
    if dtype != np.uint8 or len(shape) != 4 or shape[-1] != 3 or fortran:
        raise EvalError(f"{path}: arr_0 must be uint8 images N x H x W x 3 (ADM's format), got {dtype} {shape}"
                        + (" in Fortran order" if fortran else ""))
    return shape, dtype, offset


def _open_npz(p: Path) -> Source:
    try:
        zf = zipfile.ZipFile(p)
        names = zf.namelist()
    except (OSError, zipfile.BadZipFile) as e:
        raise EvalError(f"{p}: not an .npz file ({_line(e)}); give an .npz or a folder of images") from None
    arrays = {n[:-4]: n for n in names if n.endswith(".npy")}
    src = Source(p, "npz", None, None, npz={k: v for k, v in arrays.items() if k != "arr_0"})
    if "arr_0" in arrays:
        src.arr = _NpyMember(p, zf, arrays["arr_0"])
        src.count, src.size = src.arr.shape[0], tuple(src.arr.shape[1:3])
    return src


def _npz_array(src: Source, name: str, shape: tuple) -> np.ndarray:
    try:
        with np.load(src.path, allow_pickle=False) as z:
            a = np.asarray(z[name], dtype=np.float64)
    except Exception as e:
        raise EvalError(f"{src.path}: {name} is not a readable array ({_line(e)})") from None
    if a.shape != shape:
        raise EvalError(f"{src.path}: {name} has shape {a.shape}, expected {shape} (ADM's reference statistics)")
    return a


def _batches(src: Source, batch_size: int, *, workers: int | None = None) -> Iterator[np.ndarray]:
    """The source's images as uint8 (n, H, W, 3) batches. Folder images are decoded on a few
    threads (a bounded number in flight); unusable ones are skipped and counted on `src`.
    All images of one read must have one size (the network would accept any, but one set
    of mixed sizes is a mistake: the message names the odd one)."""
    src.skipped, src.skipped_examples = 0, []
    if src.kind == "npz":
        if src.arr is None:
            raise EvalError(f"{src.path}: no arr_0 (ADM's images array) in this .npz")
        yield from src.arr.batches(batch_size)
        return
    from concurrent.futures import ThreadPoolExecutor

    first: tuple[str, tuple] | None = None
    batch: list[np.ndarray] = []
    workers = workers or max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        inflight: deque = deque()

        def results():
            for job in src.jobs():
                inflight.append(pool.submit(job))
                if len(inflight) >= 2 * batch_size:
                    yield inflight.popleft()
            while inflight:
                yield inflight.popleft()

        for fut in results():
            try:
                name, arr = fut.result()
            except _Bad as e:
                src.skipped += 1
                if len(src.skipped_examples) < 3:
                    src.skipped_examples.append(str(e))
                continue
            if first is None:
                first = (name, arr.shape)
            elif arr.shape != first[1]:
                hint = "" if src.resolution else " (a reference folder can be centre-cropped with --resolution N)"
                raise EvalError(f"{name}: {arr.shape[1]}x{arr.shape[0]} but {first[0]} is "
                                f"{first[1][1]}x{first[1][0]}; all images must have one size{hint}")
            batch.append(arr)
            if len(batch) == batch_size:
                yield np.stack(batch)
                batch = []
        if batch:
            yield np.stack(batch)


def _rebatch(images, batch_size: int) -> Iterator:
    """An array / tensor (sliced) or an iterable of batches (each cut to batch_size)."""
    import torch

    if isinstance(images, (np.ndarray, torch.Tensor)):
        images = [images]
    for b in images:
        for i in range(0, len(b), batch_size):
            yield b[i:i + batch_size]


def image_features(images, inception: Inception, *, batch_size: int = 64, progress: bool = False,
                   desc: str = "features", total: int | None = None) -> dict[str, np.ndarray]:
    """Features of images: a uint8 (N, H, W, 3) array, a (N, 3, H, W) tensor, an iterable of
    such batches, or a path (.npz / folder of images). Only the features are kept."""
    if isinstance(images, (str, Path)):
        return source_features(open_source(images, allow_shards=False), inception, batch_size=batch_size,
                               progress=progress, desc=desc)
    if total is None and hasattr(images, "__len__") and hasattr(images, "shape"):
        total = len(images)
    return _run(_rebatch(images, batch_size), inception, progress=progress, desc=desc, total=total)


def source_features(src: Source, inception: Inception, *, batch_size: int = 64, progress: bool = False,
                    desc: str = "features", keep=FEATURES) -> dict[str, np.ndarray]:
    """Features of a Source's images (unusable ones skipped and counted on it)."""
    return _run(_batches(src, batch_size), inception, progress=progress, desc=f"{desc} {src.path.name}",
                total=src.count, keep=keep)


def _run(batches: Iterable, inception: Inception, *, progress: bool, desc: str, total: int | None,
         keep=FEATURES) -> dict:
    from tqdm import tqdm

    parts: dict[str, list] = {k: [] for k in keep}
    with tqdm(total=total, unit="img", desc=desc, disable=not progress, dynamic_ncols=True) as bar:
        for b in batches:
            feats = inception.features(b)
            for k in keep:
                parts[k].append(feats[k])
            bar.update(len(b))
    if not parts["pool"]:
        raise EvalError(f"{desc}: no usable images")
    return {k: np.concatenate(v) for k, v in parts.items()}


# ----------------------------------------------------------------------------- the reference


@dataclass
class RefStats:
    """What the metrics need of a reference: FID (mu, sigma) and sFID (mu_s, sigma_s)
    statistics, and for precision/recall its pool features and their k=3 radii."""

    mu: np.ndarray
    sigma: np.ndarray
    mu_s: np.ndarray
    sigma_s: np.ndarray
    n: int | None  # reference images
    pool: np.ndarray | None = None  # (n, 2048) float32, for precision/recall
    radii: np.ndarray | None = None  # manifold_radii(pool, PR_K)
    digest: str | None = None  # the reference's content digest (Source.digest)
    source: str | None = None
    precomputed: bool = False  # FID/sFID statistics read from an ADM reference batch
    cache: str | None = None  # the cache file read or written
    cached: bool = False  # read from the cache: the network did not run on the reference
    skipped: int = 0  # unusable reference images


def image_stats(images, inception: Inception, *, batch_size: int = 64, with_pr: bool = True,
                progress: bool = False) -> RefStats:
    """RefStats of images (anything image_features takes), not cached."""
    return stats_from_features(image_features(images, inception, batch_size=batch_size, progress=progress,
                                              desc="reference"), with_pr=with_pr,
                               device=inception.device)


def stats_from_features(feats: dict, *, with_pr: bool = True, device="cpu") -> RefStats:
    mu, sigma = feature_stats(feats["pool"])
    mu_s, sigma_s = feature_stats(feats["spatial"])
    stats = RefStats(mu, sigma, mu_s, sigma_s, len(feats["pool"]))
    if with_pr:
        stats.pool = np.asarray(feats["pool"], np.float32)
        stats.radii = manifold_radii(stats.pool, PR_K, device=device)
    return stats


def cache_key(digest: str, resolution: int | None, inception_sha256: str, with_pool: bool) -> str:
    """The cache key: reference content, crop resolution, Inception weights, feature set."""
    spec = {"version": CACHE_VERSION, "ref": digest, "resolution": resolution, "inception": inception_sha256,
            "features": FEATURE_SET + (f"+pool,radii-k{PR_K}" if with_pool else "")}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def _cache_paths(ref: Path, key: str, cache_dir) -> list[Path]:
    name = f"{STATS_NAME}{key}.npz"
    beside = ref / name if ref.is_dir() else ref.with_name(ref.name + name)
    elsewhere = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / f"{ref.name}{name}"
    return [beside, elsewhere]


def _read_cache(path: Path, with_pool: bool, log) -> RefStats | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            d = {k: z[k] for k in z.files}
        stats = RefStats(d["mu"], d["sigma"], d["mu_s"], d["sigma_s"], int(d["n"]) if int(d["n"]) >= 0 else None,
                         pool=d.get("pool"), radii=d.get("radii"), precomputed=bool(d["precomputed"]),
                         skipped=int(d["skipped"]))
        ok = (stats.mu.shape == (POOL_DIM,) and stats.sigma.shape == (POOL_DIM,) * 2
              and stats.mu_s.shape == (SPATIAL_DIM,) and stats.sigma_s.shape == (SPATIAL_DIM,) * 2
              and (not with_pool or (stats.pool is not None and stats.radii is not None
                                     and stats.pool.shape[1:] == (POOL_DIM,)
                                     and stats.radii.shape == stats.pool.shape[:1])))
        if not ok:
            raise ValueError("unexpected shapes")
    except Exception as e:
        log(f"note: ignoring the unreadable reference cache {path} ({_line(e)[:100]}); recomputing")
        return None
    return stats


def _write_cache(stats: RefStats, paths: list[Path], log) -> Path | None:
    """Write the statistics atomically beside the reference, else (read-only) in the cache
    dir; an eval never fails for want of a cache."""
    from ditdata.common import files

    arrays = {"mu": stats.mu, "sigma": stats.sigma, "mu_s": stats.mu_s, "sigma_s": stats.sigma_s,
              "n": np.int64(-1 if stats.n is None else stats.n), "precomputed": np.bool_(stats.precomputed),
              "skipped": np.int64(stats.skipped)}
    if stats.pool is not None:
        arrays |= {"pool": stats.pool, "radii": stats.radii}
    errors = []
    for p in paths:
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            with files.atomic_file(p, "wb") as f:
                np.savez(f, **arrays)
        except OSError as e:
            errors.append(f"{p}: {files.error_reason(e)}")
            continue
        if errors:
            log(f"note: reference statistics cached in {p} (not beside the reference: {errors[0]})")
        return p
    log(f"note: the reference statistics were not cached ({'; '.join(errors)})")
    return None


def reference_stats(ref, inception: Inception, *, resolution: int | None = None, batch_size: int = 64,
                    cache_dir=None, with_pr: bool = True, progress: bool = False,
                    log: Callable[[str], None] | None = None) -> RefStats:
    """The statistics of a reference: an .npz (ADM's reference batches: precomputed mu, sigma,
    mu_s, sigma_s are used as they are, its images only for precision/recall), a folder of
    images or a `ditdata fetch` image-shard folder (both centre-cropped to `resolution` with
    the encoder's ADM rule when it is given; shards need it). Images at their own size
    otherwise.

    Cached beside the reference (REF.ditkit-stats-KEY.npz for a file, REF/.ditkit-stats-KEY.npz
    for a folder; in `cache_dir`, default ~/.cache/ditkit/eval, where that is read-only),
    KEY = cache_key(content digest, resolution, Inception sha256, feature set). A second
    call with the same reference reads the file instead of running the network."""
    log = log or (lambda line: None)
    src = ref if isinstance(ref, Source) else open_source(ref, resolution=resolution)
    resolution = src.resolution  # the crop applied (None for an .npz: ADM batches are fed as they are)
    given = _precomputed(src)
    if len(given) == len(_PRECOMPUTED) and not with_pr:
        return RefStats(**given, n=src.count, source=str(src.path), precomputed=True)
    digest = src.digest()
    keys = [cache_key(digest, resolution, inception.sha256, True)]
    if not with_pr:
        keys.insert(0, cache_key(digest, resolution, inception.sha256, False))
    for key in keys:
        for p in _cache_paths(src.path, key, cache_dir):
            stats = _read_cache(p, with_pr, log)
            if stats is not None:
                if not with_pr:
                    stats.pool = stats.radii = None
                stats.digest, stats.source, stats.cache, stats.cached = digest, str(src.path), str(p), True
                return stats
    if src.kind == "npz" and src.arr is None:
        raise EvalError(f"{src.path}: no arr_0 (ADM's images array) in this .npz"
                        + (f" and not all of {', '.join(_PRECOMPUTED)}" if len(given) < 4 else ""))
    feats = source_features(src, inception, batch_size=batch_size, progress=progress, desc="reference",
                            keep=("pool", "spatial"))  # no IS for a reference: its logits are not kept
    stats = stats_from_features(feats, with_pr=with_pr, device=inception.device)
    stats.skipped, stats.digest, stats.source = src.skipped, digest, str(src.path)
    if src.skipped:
        log(f"note: skipped {src.skipped} unusable reference images (e.g. {src.skipped_examples[0]})")
    for name, value in given.items():  # an ADM reference batch's own statistics win
        setattr(stats, name, value)
    stats.precomputed = bool(given)
    written = _write_cache(stats, _cache_paths(src.path, keys[-1], cache_dir), log)
    stats.cache = str(written) if written else None
    return stats


def _precomputed(src: Source) -> dict[str, np.ndarray]:
    """The statistics an ADM reference batch carries (those present; checked: float64)."""
    shapes = {"mu": (POOL_DIM,), "sigma": (POOL_DIM,) * 2, "mu_s": (SPATIAL_DIM,), "sigma_s": (SPATIAL_DIM,) * 2}
    return {name: _npz_array(src, name, shapes[name]) for name in _PRECOMPUTED if name in src.npz}


# ----------------------------------------------------------------------------- evaluate


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
        size = sample_src.size if sample_src is not None else _array_size(samples)
        resolution = min(size) if size else None
    if isinstance(ref, (str, Path)):
        ref = open_source(ref, resolution=resolution)  # inputs are checked before the network loads
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
        "versions": _versions(),
    }
    return metrics


def _array_size(images) -> tuple[int, int] | None:
    shape = getattr(images, "shape", None)
    if shape is None or len(shape) != 4:
        return None
    return (shape[1], shape[2]) if shape[-1] == 3 else (shape[2], shape[3])


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("ditkit", "torch", "torch-fidelity", "scipy", "numpy"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


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


# ----------------------------------------------------------------------------- during training


class TrainingEval:
    """`dittrain run --eval-every N`: FID-n (and sFID, IS) of the EMA model against a reference.

    Made at the start of a run on every rank, so a missing Inception file or reference fails
    before the first step; the network (and, on rank 0, the reference statistics, cached
    beside the reference: see reference_stats) load at the first evaluation. Each evaluation
    samples the same n images' classes (balanced, from the seed) and noise: chunk i (the
    `batch_size` samples from i * batch_size) is drawn with seed + i, by rank i % world, so
    the figure does not depend on the number of ranks, and every rank shares the work (the
    others would otherwise wait for rank 0 at their next collective). Images become features
    chunk by chunk and are never all kept; the features meet on rank 0. Precision/recall are
    left to `dittrain eval`. The trainer catches every failure of a call: an evaluation never
    stops a run."""

    def __init__(self, ref, *, n: int, resolution: int | None = None, inception=None, steps: int | None = None,
                 cfg_scale: float | None = None, seed: int = 0, batch_size: int = 64, cache_dir=None,
                 log: Callable[[str], None] | None = None):
        if n < 2:
            raise EvalError(f"--eval-n must be at least 2 (a covariance needs two samples), got {n}")
        self.weights = find_inception(inception)  # fail now, not after hours of training
        self.ref_source = open_source(ref, resolution=resolution)
        self.resolution = resolution
        self.n, self.steps, self.cfg_scale, self.seed, self.batch_size = n, steps, cfg_scale, seed, batch_size
        self.cache_dir, self.log = cache_dir, log or (lambda line: None)
        self.inception: Inception | None = None
        self.ref: RefStats | None = None

    def _reference(self) -> RefStats:
        if self.ref is None:
            self.ref = reference_stats(self.ref_source, self.inception, resolution=self.resolution,
                                       batch_size=self.batch_size, cache_dir=self.cache_dir, with_pr=False,
                                       log=self.log)
        return self.ref

    def __call__(self, model, config: dict, store, *, rank: int = 0, world: int = 1) -> dict | None:
        """{"fid", "sfid", "inception_score", "eval_n", ...} of `model` (the EMA DiT, on its
        device; put back in its mode afterwards) sampled with the run's store, on rank 0 (None
        on the others). With world > 1 every rank must call it."""
        from dittrain import sample
        from dittrain.npz import eval_settings

        t0 = time.time()
        device = next(model.parameters()).device
        if self.inception is None:
            self.inception = load_inception(self.weights, device)
        settings = eval_settings(config["diffusion"]["objective"], steps=self.steps, cfg_scale=self.cfg_scale)
        kind = sample.conditioning_kind(model.config)
        labels = sample.balanced_labels(self.n, model.config.num_classes, self.seed) if kind == "class" else None
        text = sample.store_text(store, self.n) if kind == "text" else None
        autoencoder = sample.kept_autoencoder(store, device)
        mine = {}
        for i, start in enumerate(range(0, self.n, self.batch_size)):
            if i % world != rank:
                continue
            stop = min(start + self.batch_size, self.n)
            images = sample.sample_images(
                model, config, store, labels=None if labels is None else labels[start:stop],
                text=None if text is None else _cycled(text, start, stop), n=stop - start,
                cfg_scale=settings.cfg_scale, steps=settings.steps, seed=self.seed + i, batch_size=self.batch_size,
                autoencoder=autoencoder)
            mine[i] = image_features(images, self.inception, batch_size=self.batch_size)
        chunks = _on_rank0(mine, rank, world)
        if rank != 0:
            return None
        feats = {k: np.concatenate([chunks[i][k] for i in sorted(chunks)]) for k in FEATURES}
        metrics = compute_metrics(feats, self._reference(), with_pr=False)
        return {"fid": metrics["fid"], "sfid": metrics["sfid"], "inception_score": metrics["inception_score"],
                "eval_n": self.n, "eval_steps": settings.steps, "eval_cfg": settings.cfg_scale,
                "eval_seconds": round(time.time() - t0, 3)}


def _cycled(text: dict, start: int, stop: int) -> dict:
    """Rows start..stop of text embeddings, cycled (the store's first captions, over n samples)."""
    import torch

    rows = torch.arange(start, stop) % len(next(iter(text.values())))
    return {k: v[rows] for k, v in text.items()}


def _on_rank0(mine: dict, rank: int, world: int) -> dict:
    """Every rank's {chunk: features} merged on rank 0 ({} elsewhere)."""
    if world == 1:
        return mine
    import torch.distributed as dist

    parts = [None] * world if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    return {i: f for part in parts for i, f in part.items()} if rank == 0 else {}
