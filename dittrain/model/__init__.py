"""The network: the DiT and everything it is made of, with no I/O and no diffusion math.

    dit.py            DiT (adaLN-Zero blocks, Peebles & Xie 2023); parameter counts, `dittrain models` rows
    parts.py          the block parts' registries (MLP, norm, position): per part its module, width rule,
                      matmul count and place in the memory model; no torch, so the CLI can read the names
    layers.py         the block parts' torch code: GELU MLP, SwiGLU, the norms, sin-cos table, 2-D RoPE
    sizes.py          DiTConfig, the one registry of named sizes, custom sizes, FLOPs
    pixart.py         PixArt (adaln=single) in diffusers' PixArtTransformer2DModel layout: config, names both ways
    routing.py        TREAD token routing inside the forward (--route)
    attention.py      which attention kernel SDPA runs (flash, memory-efficient, math)
    checkpointing.py  the --grad-checkpointing modes (what the backward recomputes)
    lora.py           LoRA through peft (--lora): target linears by pattern, the adapter put in, its state, the merge

The package itself imports nothing.
"""
