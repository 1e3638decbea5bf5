"""dittrain: a lean single-GPU Diffusion Transformer trainer over a ditdata latent store."""

__version__ = "0.1.0"
