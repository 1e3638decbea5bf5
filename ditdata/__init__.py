"""ditdata: images -> (CLIP-filtered) WebDataset shards -> a cached latent store."""

__version__ = "0.1.0"
