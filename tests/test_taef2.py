"""TAEF2 (our implementation) against the real published weights: strict loading and
reconstruction quality on real photos. Skips when ../shared is absent."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from ditdata.autoencoders.taef2 import DECODER_FILE, ENCODER_FILE, TAEF2, load_state_dict_file
from ditdata.common.files import sha256_file

# From ../shared/models/taef2/ARCHITECTURE.md.
SHA256 = {
    ENCODER_FILE: "10a4e1021e89d7551eaf161352da8dbd0b1aa83872ae28b150c1df1ce2f147b6",
    DECODER_FILE: "0a44a31e1ae59eb9dbf9359d24942fd3ef5928162c1800d97a28c61d51be0ab5",
}
IMAGES = ("astronaut", "chelsea", "coffee")
RES = 256


@functools.lru_cache(maxsize=1)
def _model(weights_dir: str) -> TAEF2:
    return TAEF2.from_dir(weights_dir)


@functools.lru_cache(maxsize=1)
def _photos() -> torch.Tensor:
    """(3, 3, 256, 256) float in [0, 1]: plain centre crops (no resize) of real photos."""
    from skimage import data

    crops = []
    for name in IMAGES:
        img = getattr(data, name)()
        y, x = (img.shape[0] - RES) // 2, (img.shape[1] - RES) // 2
        crops.append(img[y : y + RES, x : x + RES, :3])
    return torch.from_numpy(np.stack(crops)).permute(0, 3, 1, 2).float() / 255.0


def psnr(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    mse = ((a - b) ** 2).mean(dim=(1, 2, 3))
    return (10 * torch.log10(1.0 / mse)).tolist()


def _roundtrip(model: TAEF2, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.decode(model.encode(x)).clamp(0, 1)


def test_weight_files_are_the_documented_ones(taef2_dir: Path):
    for f, sha in SHA256.items():
        assert sha256_file(taef2_dir / f) == sha


def test_state_dicts_match_our_modules_exactly(taef2_dir: Path):
    model = TAEF2()
    for part, f in ((model.encoder, ENCODER_FILE), (model.decoder, DECODER_FILE)):
        sd = load_state_dict_file(taef2_dir / f)
        assert len(sd) == 79
        assert all(v.dtype == torch.float16 for v in sd.values())
        ours = part.state_dict()
        assert list(ours) == list(sd)  # same keys, same order
        assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in sd.items()}
        assert 1.3e6 < sum(v.numel() for v in sd.values()) < 1.4e6
        # Strict: a missing tensor is an error, not a silently random layer.
        del sd["3.conv.2.weight"]
        with pytest.raises(RuntimeError, match="Missing key"):
            part.load_state_dict(sd, strict=True)
    loaded = _model(str(taef2_dir))
    assert all(p.dtype == torch.float32 for p in loaded.parameters())  # fp16 file -> fp32 module


def test_latent_shape_and_range(taef2_dir: Path):
    model = _model(str(taef2_dir))
    x = _photos()[:1, :, :64, :96]
    with torch.no_grad():
        z = model.encode(x)
        y = model.decode(z)
    assert z.shape == (1, 32, 8, 12) and z.dtype == torch.float32
    assert -8 < z.min() and z.max() < 8
    assert y.shape == x.shape


def test_reconstruction_psnr_on_real_photos(taef2_dir: Path):
    x = _photos()
    model = _model(str(taef2_dir))
    # With the horizontal-flip variant the store keeps beside each latent, in one batch.
    both = torch.cat([x, x.flip(-1)])
    scores_all = psnr(both, _roundtrip(model, both))
    scores, scores_flip = scores_all[: len(x)], scores_all[len(x) :]
    print("PSNR", dict(zip(IMAGES, scores, strict=True)), "flip", dict(zip(IMAGES, scores_flip, strict=True)))
    for name, s, sf in zip(IMAGES, scores, scores_flip, strict=True):
        assert s >= 28.0, f"{name}: {s:.2f} dB"
        assert sf >= 28.0, f"{name} flipped: {sf:.2f} dB"


def test_random_weights_score_far_lower(taef2_dir: Path):
    x = _photos()[:, :, 64:192, 64:192]  # 128 px suffice to tell
    torch.manual_seed(0)
    scores = psnr(x, _roundtrip(TAEF2().eval(), x))
    assert max(scores) < 15.0, scores
