"""The FID network: the TF Inception-v3 graph of 2015-12-05 in torch-fidelity's port
(FeatureExtractorInceptionV3), loaded from its weights file and never downloaded.

    pool        pool3, 2048-d                                   -> FID, precision, recall
    spatial     mixed_6/conv (torch-fidelity: Mixed_6d.branch1x1 after its ReLU, 192x17x17),
                first 7 channels, flattened (h, w, c) as TF's NHWC tensor is: 2023-d -> sFID
    logits      pool3 @ softmax weights, no bias (1008 classes)  -> Inception Score

uint8 images go in at any size and are resized to 299 by its TF1-compatible bilinear resize,
as ADM's graph does. torch and torch-fidelity (the eval extra) are imported inside the
functions that need them.
"""

from __future__ import annotations

import os
import warnings
from functools import cached_property
from pathlib import Path

import numpy as np

from ditdata.common.errors import one_line
from dittrain.eval.errors import EvalError
from dittrain.eval.manifold import exact_fp32

INCEPTION_FILES = ("weights-inception-2015-12-05-6726825d.pth",  # torch-fidelity's name
                   "pt_inception-2015-12-05-6726825d.pth")  # pytorch-fid's: same keys and shapes
INCEPTION_ENV = "DITKIT_INCEPTION"
POOL_DIM, SPATIAL_CHANNELS, SPATIAL_DIM, LOGITS_DIM = 2048, 7, 7 * 17 * 17, 1008
FEATURES = ("pool", "spatial", "logits")  # what Inception.features returns
# What the features are, part of a reference cache's key: the two feature sets' definitions.
FEATURE_SET = "tf-inception-2015-12-05:pool3-2048,mixed_6/conv[:7]-nhwc-2023"


def _fidelity():
    """torch-fidelity's Inception module, or EvalError naming the extra that brings it."""
    from ditdata.common.extras import require

    return require("torch_fidelity.feature_extractor_inceptionv3", "the FID Inception (torch-fidelity)",
                   "eval", EvalError)


def inception_url() -> str:
    """Where torch-fidelity downloads the weights from (to fetch them on another machine)."""
    return _fidelity().URL_INCEPTION_V3


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
        reason = one_line(e, 300).split(". ")[0]
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
        class Network(_fidelity().FeatureExtractorInceptionV3):
            def load_state_dict(self, state_dict, strict=True, assign=False):
                try:
                    return super().load_state_dict(state_dict, strict=strict, assign=assign)
                except RuntimeError as e:
                    raise _Mismatch(_describe_mismatch(self.state_dict(), state_dict)
                                    or one_line(e, 300)) from None

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
        with exact_fp32(self.device), torch.inference_mode():
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
