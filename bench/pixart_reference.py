"""Our PixArt (adaln=single) against diffusers' PixArtTransformer2DModel at full size (issue 37, part C):
parameter counts, outputs on the same random weights, forward time on this machine.

    python bench/pixart_reference.py [--preset PixArt-XL/2|PixArt-XL/2-1024|PixArt-Sigma-XL/2-1024]
                                     [--latent 64] [--tokens 120] [--batch 1]

A PixArtTransformer2DModel with the released checkpoints' config (num_layers 28, 16 heads of 72,
caption_channels 4096, sample_size 64 or 128, interpolation_scale and use_additional_conditions as the preset),
every weight drawn N(0, 0.02) (the zero-initialised projections would hide the blocks), goes through the real
`--init-from` path (save_pretrained into a temporary folder, dittrain.inference.weights.init_model) into
get_config(PRESET); both run in fp32 on the CPU on the same latents, timesteps and T5-width tokens with a padded
caption (and, on a non-square latent, the other grid). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

PRESETS = {  # diffusers' config of the released checkpoints (sample_size, interpolation_scale, micro-conditions)
    "PixArt-XL/2": (64, 1, False),
    "PixArt-XL/2-1024": (128, 2, True),
    "PixArt-Sigma-XL/2-1024": (128, 2, False),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="PixArt-XL/2", choices=sorted(PRESETS))
    ap.add_argument("--latent", type=int, default=None, help="latent side (default: the preset's sample_size)")
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    from diffusers import PixArtTransformer2DModel

    from dittrain.inference.weights import init_model
    from dittrain.model.dit import DiT
    from dittrain.model.sizes import get_config

    sample, scale, micro = PRESETS[args.preset]
    side = args.latent or sample
    torch.manual_seed(0)
    ref = PixArtTransformer2DModel(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8,
                                   num_layers=28, sample_size=sample, patch_size=2, caption_channels=4096,
                                   interpolation_scale=scale, use_additional_conditions=micro).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.02)
    dit = DiT(get_config(args.preset, input_size=sample, in_channels=4, num_classes=0, text_token_dim=4096)).eval()
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_pretrained(tmp, safe_serialization=True)
        t0 = time.perf_counter()
        init_model(dit, Path(tmp))
        load_s = time.perf_counter() - t0
    theirs = sum(p.numel() for p in ref.parameters())
    ours = dit.num_params()
    print(f"{args.preset}: parameters ours {ours:,}, diffusers {theirs:,}; --init-from load {load_s:.1f} s")
    N, L = args.batch, args.tokens
    for h, w in ((side, side), (side, side * 3 // 4)):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(N, 4, h, w, generator=g)
        t = torch.full((N,), 500.0)
        tokens = torch.randn(N, L, 4096, generator=g)
        mask = torch.ones(N, L, dtype=torch.bool)
        mask[:, L // 3:] = False  # a caption of L/3 tokens, the rest padding
        added = None
        if micro:
            added = {"resolution": torch.tensor([[h * 8.0, w * 8.0]]).repeat(N, 1),
                     "aspect_ratio": torch.tensor([[h / w]]).repeat(N, 1)}
        with torch.no_grad():
            t0 = time.perf_counter()
            want = ref(x, encoder_hidden_states=tokens, timestep=t, encoder_attention_mask=mask.float(),
                       added_cond_kwargs=added).sample
            t1 = time.perf_counter()
            got = dit(x, t, text_tokens=tokens, text_mask=mask)
            t2 = time.perf_counter()
        diff = float((got - want).abs().max())
        print(f"latent {h}x{w}, batch {N}, {L} tokens: max |ours - diffusers| {diff:.2e} (outputs up to "
              f"{float(want.abs().max()):.2f}); forward diffusers {t1 - t0:.1f} s, ours {t2 - t1:.1f} s")


if __name__ == "__main__":
    main()
