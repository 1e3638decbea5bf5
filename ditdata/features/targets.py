"""What a feature set stores for a batch of images, and the measurements that describe it.

    targets = Targets(encoder, flip=True, dtype="int8", device=device, pca=None)
    stored = targets(images_u8, keys)      # {"feat", "feat_scale", "feat_flip", ...} numpy
    storage = calibrate(targets, first_images, dims=None)   # the manifest's "storage"

The encoder runs on the store's centre crops (uint8 (B, N, N, 3)) and, when the store has
flips, on their mirror images in the same pass (the flipped image's features go to
feat_flip, as the flipped latent goes to latent_flip). Its fp32 tokens are projected by the
PCA when there is one, then stored as int8 with a per-token scale (ditdata.store.quantize,
the contract's definition) or as float16.

calibrate() measures, before anything is written, what the storage loses: the mean cosine
between the stored targets (dequantized and, with a PCA, reconstructed) and the fp32
encoder output over the first COSINE_SAMPLES samples, and fits the PCA on tokens sampled
from the first PCA_FIT_IMAGES images. Both are recorded in the feature set's manifest.
With a PCA the cosine is that of the rebuilt tokens, which is what a REPA run aligns to:
dittrain rebuilds y = coords @ components + mean on the device and projects to the encoder's
width (dittrain.train.repa), as REPA aligns to the encoder's own features.
"""

from __future__ import annotations

import numpy as np
import torch

from ditdata.common.devices import amp_dtype, autocast
from ditdata.common.usercode import check_output
from ditdata.config import FEATURE_COSINE_SAMPLES, PCA_FIT_IMAGES, PCA_TOKENS_PER_IMAGE
from ditdata.errors import DitdataError
from ditdata.store import encode_array
from ditdata.store.schema import dequantize, quantize

from . import pca as pca_

COSINE_SAMPLES = FEATURE_COSINE_SAMPLES  # "the first batch": the samples the cosine is measured on
PCA_SEED = 0  # of the tokens sampled for the PCA
NOTE_COSINE = 0.999  # int8 rounding that keeps less than this is worth a note
# what a non-finite encoder output leaves behind (passes.py writes a shard only when all of it is in)
STOPPED = ("; nothing of that shard was stored and the feature set is not published: fix the encoder and rerun "
           "(finished shards are kept)")


class Targets:
    """Images -> stored targets (module docstring). `pca`: the decoded storage["pca"]
    ({"components", "mean"} arrays) or None."""

    def __init__(self, encoder, *, flip: bool, dtype: str, device: torch.device, pca: dict | None = None):
        self.encoder, self.flip, self.dtype, self.device = encoder, flip, dtype, device
        self.amp = amp_dtype(device)  # bf16 autocast on GPUs that have it, fp32 on the CPU
        self.pca = pca
        self._pca_t = None if pca is None else (
            torch.as_tensor(pca["mean"], device=device), torch.as_tensor(pca["components"], device=device))

    @property
    def dims(self) -> int:
        return self.encoder.dim if self.pca is None else int(self.pca["components"].shape[0])

    def fields(self) -> list[str]:
        return ["feat", "feat_flip"] if self.flip else ["feat"]

    def raw(self, images_u8, *, fp32: bool = False, flip: bool | None = None) -> dict[str, torch.Tensor]:
        """(B, N, N, 3) uint8 -> {"feat": (B, T, dim) float32, ["feat_flip"]} on the device:
        the encoder's tokens, in the run's precision (fp32: without autocast); flip: whether
        to include the flipped view (default: as the store)."""
        x = torch.as_tensor(images_u8).to(self.device).permute(0, 3, 1, 2).float().div_(255.0)
        b = x.shape[0]
        flip = self.flip if flip is None else flip
        if flip:
            x = torch.cat([x, x.flip(-1)])  # one pass for both views
        with torch.inference_mode(), autocast(self.device, None if fp32 else self.amp):
            y = self.encoder(x).float()
        return {"feat": y[:b], "feat_flip": y[b:]} if flip else {"feat": y}

    def projected(self, y: torch.Tensor) -> np.ndarray:
        """Tokens (B, T, dim) -> what is stored before rounding: (B, T, dims) float32 numpy."""
        if self._pca_t is not None:
            mean, comps = self._pca_t
            y = (y - mean) @ comps.T
        return y.cpu().numpy().astype(np.float32, copy=False)

    def check(self, raw: dict[str, torch.Tensor], keys, shard: str | None) -> None:
        """Stop on an encoder output that is not finite (ditdata.common.usercode), before any
        of it is stored: the message names the encoder, the field, the shard and the first key."""
        for field, y in raw.items():
            check_output(y, source=self.encoder.source, field=field, keys=keys, shard=shard, then=STOPPED)

    def store(self, raw: dict[str, torch.Tensor], keys, shard: str | None = None) -> dict[str, np.ndarray]:
        """The stored arrays of a batch: feat (int8 with feat_scale, or float16), and the flips."""
        self.check(raw, keys, shard)
        out = {}
        for field, y in raw.items():
            v = self.projected(y)
            if self.dtype == "int8":
                out[field], out[f"{field}_scale"] = quantize(v)
            else:
                out[field] = v.astype(np.float16)
        # finite tokens beyond float16's range (65504) are stored as inf: stop, naming the sample
        for field, v in out.items():
            bad = ~np.isfinite(v.astype(np.float32).reshape(len(v), -1)).all(axis=1)
            if bad.any():
                key = list(keys)[int(np.argmax(bad))]
                raise DitdataError(f"{self.encoder.source} gave {field} values beyond float16's range for "
                                   f"{int(bad.sum())} sample(s), e.g. {key!r}; store --features-dtype int8")
        return out

    def __call__(self, images_u8, keys, shard: str | None = None) -> dict[str, np.ndarray]:
        return self.store(self.raw(images_u8), keys, shard)


def stored_to_fp32(stored: dict[str, np.ndarray], field: str, pca: dict | None) -> np.ndarray:
    """The float32 tokens (B, T, dim) that stored targets stand for (dequantized, and
    reconstructed through the PCA when there is one)."""
    x = dequantize(stored[field], stored.get(f"{field}_scale"))
    return pca_.reconstruct(x, pca) if pca is not None else x


def mean_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over tokens of cos(a, b) along the last axis (a zero token counts as 1 when both are)."""
    a, b = a.reshape(-1, a.shape[-1]).astype(np.float64), b.reshape(-1, b.shape[-1]).astype(np.float64)
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    cos = np.where((na > 0) & (nb > 0), (a * b).sum(1) / np.maximum(na * nb, 1e-30), (na == nb).astype(float))
    return float(cos.mean())


# --------------------------------------------------------------------------- calibration


def calibrate(targets: Targets, images, dims: int | None) -> dict:
    """The manifest's "storage" of the feature set: dtype, dims, pca (fitted first when
    `dims` is below the encoder's width), the measured cosines. `targets`: without a PCA.
    `images` yields (images uint8 (B, N, N, 3), keys, shard name) in the store's order; no more is read
    than is needed. Make the Targets that store with Targets(..., pca=decoded_pca(storage))."""
    enc = targets.encoder
    if dims is not None and not 0 < dims <= enc.dim:
        raise DitdataError(f"--features-dims {dims}: {enc.name} has {enc.dim} dims; use 1 to {enc.dim}")
    want_pca = dims is not None and dims < enc.dim
    need = max(COSINE_SAMPLES, PCA_FIT_IMAGES if want_pca else 0)
    rng = np.random.default_rng(PCA_SEED)
    first, sample, seen = [], [], 0
    for imgs, keys, shard in images:
        imgs, keys = imgs[:need - seen], list(keys)[:need - seen]
        taken = sum(len(k) for _, k, _ in first)
        if taken < COSINE_SAMPLES:
            first.append((imgs[:COSINE_SAMPLES - taken], keys[:COSINE_SAMPLES - taken], shard))
        if want_pca:
            raw = targets.raw(imgs, flip=False)
            targets.check(raw, keys, shard)  # a NaN token would make the whole PCA NaN
            y = raw["feat"].cpu().numpy()
            k = min(PCA_TOKENS_PER_IMAGE, y.shape[1])
            sample += [t[np.sort(rng.choice(t.shape[0], k, replace=False))] for t in y]
        seen += len(keys)
        if seen >= need:
            break
    if not first:
        raise DitdataError("no images to compute features of: the store is empty")
    pca = None
    if want_pca:
        tokens = np.concatenate(sample)
        if tokens.shape[0] < dims:
            raise DitdataError(f"--features-dims {dims}: the PCA sample holds only {tokens.shape[0]} tokens "
                               f"({seen} images); use at most {tokens.shape[0]} dims")
        pca = {**pca_.fit(tokens, dims), "fit_samples": seen, "fit_tokens": int(tokens.shape[0])}
    fitted = Targets(enc, flip=False, dtype=targets.dtype, device=targets.device, pca=pca)
    return _storage(fitted, first, pca)


def _storage(targets: Targets, first: list, pca: dict | None) -> dict:
    """Storage info with the cosines measured on the `first` samples ((images, keys, shard) chunks)."""
    full, rounding, n = [], [], 0
    for imgs, keys, shard in first:
        reference = targets.raw(imgs, fp32=True)
        targets.check(reference, keys, shard)
        run = targets.raw(imgs) if targets.amp is not None else reference
        stored = targets.store(run, keys, shard)
        full.append(mean_cosine(stored_to_fp32(stored, "feat", pca), reference["feat"].cpu().numpy()) * len(keys))
        unrounded = targets.projected(run["feat"])
        rounding.append(mean_cosine(dequantize(stored["feat"], stored.get("feat_scale")), unrounded) * len(keys))
        n += len(keys)
    out = {"dtype": targets.dtype, "dims": targets.dims, "pca": None,
           "cosine_to_fp32": round(sum(full) / n, 6), "rounding_cosine": round(sum(rounding) / n, 6),
           "cosine_samples": n}
    if pca is not None:
        out["pca"] = {"components": encode_array(pca["components"]), "mean": encode_array(pca["mean"]),
                      "explained_variance": round(float(pca["explained_variance"]), 6),
                      "fit_samples": pca["fit_samples"], "fit_tokens": pca["fit_tokens"],
                      "tokens_per_image": PCA_TOKENS_PER_IMAGE, "seed": PCA_SEED}
    return out


def decoded_pca(storage: dict) -> dict | None:
    """storage["pca"] with its arrays decoded (what Targets takes), or None."""
    from ditdata.store import decode_array

    p = storage.get("pca")
    if not p:
        return None
    return {**p, "components": decode_array(p["components"]), "mean": decode_array(p["mean"])}


def storage_notes(storage: dict) -> list[str]:
    """What the user should know about how the targets are stored (printed as notes)."""
    notes = []
    if storage["dtype"] == "int8" and storage.get("rounding_cosine", 1.0) < NOTE_COSINE:
        notes.append(f"int8 rounding keeps a mean cosine of {storage['rounding_cosine']:.5f} (< {NOTE_COSINE}) "
                     "to the unrounded targets; --features-dtype fp16 stores them exactly")
    return notes
