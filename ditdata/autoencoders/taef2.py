"""TAEF2: the tiny autoencoder for the FLUX.2 latent space, written from the architecture
facts in ``../shared/models/taef2/ARCHITECTURE.md`` (weights by Ollin Boer Bohan, MIT).

Both halves are plain ``nn.Sequential`` stacks so that the published state dicts
(``taef2_encoder.pth``, ``taef2_decoder.pth``; keys ``0.weight``, ``1.conv.0.weight``, ...)
load strictly. Conventions:

- encoder input: images (B, 3, H, W) in [0, 1], H and W multiples of 8;
- latent: (B, 32, H/8, W/8), scaling factor 1, shift 0 (roughly in [-6, 5]);
- decoder output: (B, 3, H, W), approximately [0, 1] (clamp for images).

The weights are fp16; load them into an fp32 module on the CPU (``load_state_dict``
converts). The module itself has no hub or download logic: see ``ditdata.autoencoders.kinds``; the weight
file names come from ``ditdata.autoencoders.presets`` (torch-free, shared with the loader).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ditdata.autoencoders.presets import TAEF2_FILES

LATENT_CHANNELS = 32
DOWNSAMPLE = 8
WIDTH = 64
ENCODER_FILE, DECODER_FILE = TAEF2_FILES


def _conv(cin: int, cout: int, *, stride: int = 1, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=bias)


def _pool(channels: int = WIDTH, hidden: int = 4 * WIDTH, groups: int = 4) -> nn.Sequential:
    """The mid-block global norm ("pool"): 1x1 conv 64->256 (no bias), GroupNorm(4, 256),
    ReLU, 1x1 conv 256->64 (no bias). Keys ``pool.0``, ``pool.1``, ``pool.3``."""
    return nn.Sequential(
        nn.Conv2d(channels, hidden, kernel_size=1, bias=False),
        nn.GroupNorm(groups, hidden),
        nn.ReLU(),
        nn.Conv2d(hidden, channels, kernel_size=1, bias=False),
    )


class Block(nn.Module):
    """Residual block: ``relu(body(x) + x)`` with body = conv, ReLU, conv, ReLU, conv.
    With ``pool=True`` the input first becomes ``x + pool(x)``."""

    def __init__(self, channels: int = WIDTH, *, pool: bool = False):
        super().__init__()
        self.conv = nn.Sequential(
            _conv(channels, channels),
            nn.ReLU(),
            _conv(channels, channels),
            nn.ReLU(),
            _conv(channels, channels),
        )
        self.pool = _pool(channels) if pool else None
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pool is not None:
            x = x + self.pool(x)
        return self.act(self.conv(x) + x)


class SoftClamp(nn.Module):
    """x -> 3 * tanh(x / 3): keeps decoder inputs in (-3, 3) without a hard edge."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3.0) * 3.0


def _blocks(n: int, *, pool: bool = False) -> list[nn.Module]:
    return [Block(WIDTH, pool=pool) for _ in range(n)]


def _down() -> nn.Conv2d:
    return _conv(WIDTH, WIDTH, stride=2, bias=False)


def _up(blocks: int) -> list[nn.Module]:
    """Nearest x2, a conv without bias, then `blocks` residual blocks."""
    return [nn.Upsample(scale_factor=2, mode="nearest"), _conv(WIDTH, WIDTH, bias=False), *_blocks(blocks)]


def build_encoder() -> nn.Sequential:
    """Encoder, indices as in the state dict:
    0 conv 3->64 | 1 Block | 2 down | 3-5 Block | 6 down | 7-9 Block | 10 down |
    11-13 Block+pool | 14 conv 64->32 (down = 3x3 conv stride 2, no bias)."""
    return nn.Sequential(
        _conv(3, WIDTH),
        *_blocks(1),
        _down(),
        *_blocks(3),
        _down(),
        *_blocks(3),
        _down(),
        *_blocks(3, pool=True),
        _conv(WIDTH, LATENT_CHANNELS),
    )


def build_decoder() -> nn.Sequential:
    """Decoder, indices as in the state dict:
    0 soft clamp | 1 conv 32->64 | 2 ReLU | 3-5 Block+pool | 6 up | 7 conv | 8-10 Block |
    11 up | 12 conv | 13-15 Block | 16 up | 17 conv | 18 Block | 19 conv 64->3
    (up = nearest x2; the convs after an upsample have no bias)."""
    return nn.Sequential(
        SoftClamp(),
        _conv(LATENT_CHANNELS, WIDTH),
        nn.ReLU(),
        *_blocks(3, pool=True),
        *_up(3),
        *_up(3),
        *_up(1),
        _conv(WIDTH, 3),
    )


def load_state_dict_file(path: str | Path) -> dict[str, torch.Tensor]:
    return torch.load(Path(path), map_location="cpu", weights_only=True)


class TAEF2(nn.Module):
    """Encoder + decoder pair. ``encode`` takes images in [0, 1]; ``decode`` returns images
    approximately in [0, 1] (not clamped here; ``ditdata.autoencoders.kinds`` clamps)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = build_encoder()
        self.decoder = build_decoder()

    @classmethod
    def from_dir(cls, weights_dir: str | Path) -> TAEF2:
        """Build the module and load both state dicts strictly (fp16 files -> fp32 module)."""
        d = Path(weights_dir)
        model = cls()
        model.encoder.load_state_dict(load_state_dict_file(d / ENCODER_FILE), strict=True)
        model.decoder.load_state_dict(load_state_dict_file(d / DECODER_FILE), strict=True)
        return model.eval()

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        return self.encoder(images)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.decoder(latents)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(images))
