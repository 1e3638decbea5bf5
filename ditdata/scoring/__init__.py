"""Scoring and choosing image-caption pairs, over the image shards (`ditdata score`, `filter`, `dedup`).

    score.py      `ditdata score`: the CLIP similarity of every pair (and its image embedding, aesthetic score)
    aesthetic.py  the LAION aesthetic predictor (score --aesthetic)
    filter.py     `ditdata filter`: the rules over the scores -> a selection
    dedup.py      `ditdata dedup`: near-duplicates over the saved embeddings (faiss) -> a selection

The files these commands write and the later stages read (score files, selections) are
ditdata.imageshards.scores and ditdata.imageshards.selections: encode reads those, never this room.
The package itself imports nothing.
"""
