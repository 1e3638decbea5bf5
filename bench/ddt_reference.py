"""Our DiT^DH against RAE's own DiTwDDTHead on the same weights (issue 36): outputs, parameter counts.

    python bench/ddt_reference.py --reference RAE_CHECKOUT [--size S|XL|tiny]

RAE_CHECKOUT is a checkout of bytetriper/RAE (read at a4d18c4): its src/ is put on sys.path and
stage2.models.DDT.DiTwDDTHead is built with the released config's fields (configs/stage2/training/
ImageNet256/DiTDH-*_DINOv2-B.yaml), needing timm and einops (pip install timm einops regex). Its
weights, randomised (the adaLN-Zero and zero final layer would make every output 0), are copied into
ours by name (its s_embedder is our x_embedder, its x_embedder our head_embedder, its blocks our blocks
then head_blocks, SwiGLU w12/w3 our fc1/fc2) and both run on the same x_t, t and labels in fp32 on the
CPU. Nothing of the reference ships with this project: the script reads a checkout the user has.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REF_SIZES = {  # the released configs' hidden_size, depth, num_heads ([trunk, head])
    "tiny": dict(hidden_size=[64, 128], depth=[2, 1], num_heads=[4, 4]),
    "S": dict(hidden_size=[384, 2048], depth=[12, 2], num_heads=[6, 16]),
    "XL": dict(hidden_size=[1152, 2048], depth=[28, 2], num_heads=[16, 16]),
}
OURS = {"S": "DiTDH-S/1", "XL": "DiTDH-XL/1",
        "tiny": "custom:hidden=64,depth=2,heads=4,patch=1,mlp=swiglu,norm=rms,pos=sincos+rope,time=fourier,"
                "head_depth=1,head_hidden=128,head_heads=4"}


def their_name_to_ours(name: str, trunk_depth: int) -> str | None:
    """A DiTwDDTHead state-dict key -> ours (None: a buffer we compute, the rotary tables)."""
    if "feat_rope" in name:
        return None
    parts = name.split(".")
    if parts[0] == "s_embedder":
        parts[0] = "x_embedder"
    elif parts[0] == "x_embedder":
        parts[0] = "head_embedder"
    elif parts[0] == "blocks":
        i = int(parts[1])
        parts[:2] = ["blocks", str(i)] if i < trunk_depth else ["head_blocks", str(i - trunk_depth)]
    name = ".".join(parts)
    return name.replace(".mlp.w12.", ".mlp.fc1.").replace(".mlp.w3.", ".mlp.fc2.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", required=True, type=Path, help="a checkout of bytetriper/RAE")
    ap.add_argument("--size", default="tiny", choices=sorted(REF_SIZES))
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(args.reference / "src"))
    from stage2.models.DDT import DiTwDDTHead  # the reference, from the user's checkout

    from dittrain.model.dit import build_model

    C, side, classes = 768 if args.size != "tiny" else 32, 16, 1000
    torch.manual_seed(0)
    theirs = DiTwDDTHead(input_size=side, patch_size=1, in_channels=C, mlp_ratio=4.0, class_dropout_prob=0.1,
                         num_classes=classes, use_qknorm=False, use_swiglu=True, use_rope=True, use_rmsnorm=True,
                         wo_shift=False, use_pos_embed=True, **REF_SIZES[args.size]).eval()
    with torch.no_grad():  # off adaLN-Zero: every weight random, so that every path is compared
        for p in theirs.parameters():
            if p.requires_grad:
                p.normal_(0, 0.02 if p.dim() > 1 else 0.1)
    ours = build_model(OURS[args.size], input_size=side, in_channels=C, num_classes=classes,
                       learn_sigma=False).eval()
    trunk = ours.config.depth
    mine = ours.state_dict()
    copied = set()
    for name, value in theirs.state_dict().items():
        key = their_name_to_ours(name, trunk)
        if key is None:
            continue
        assert mine[key].shape == value.shape, (name, key, mine[key].shape, value.shape)
        mine[key] = value
        copied.add(key)
    missing = sorted(set(mine) - copied)
    ours.load_state_dict(mine)
    x = torch.randn(args.batch, C, side, side)
    t = torch.rand(args.batch)
    y = torch.randint(0, classes, (args.batch,))
    with torch.no_grad():
        a, b = theirs(x, t, y), ours(x, t, y)
    n_theirs = sum(p.numel() for p in theirs.parameters())
    n_ours = sum(p.numel() for p in ours.parameters())
    diff = (a - b).abs().max().item()
    print(f"size {args.size} (ours {OURS[args.size]}): params theirs {n_theirs:,} ours {n_ours:,}; "
          f"ours not in theirs: {missing or 'none'}; max |out diff| {diff:.3g} (|out| max {a.abs().max().item():.3g})")
    return 0 if diff <= 1e-4 * max(1.0, a.abs().max().item()) and not missing else 1


if __name__ == "__main__":
    raise SystemExit(main())
