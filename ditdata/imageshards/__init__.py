"""Image shards, and the files that stages hand each other beside them.

    folder.py      SHARDS_DIR as `ditdata fetch` writes it: NNNNN.tar + _stats.json, dataset.json; readers, writers
    scores.py      NNNNN.clip.parquet (`ditdata score` writes it; filter, dedup and encode read it)
    captionsets.py NNNNN.captions.SET.parquet: caption sets (`ditdata caption` writes them; score, filter,
                   encode's text encoders read them; "alt" is the shards' own captions)
    selections.py  selection files (`ditdata filter` and `dedup` write them; encode --select reads them)
    batches.py     decoded, cropped image batches of whole shards (encode's reader, and `ditdata features`')

Every stage imports what it hands on or takes from here, never another stage's module. The
package itself imports nothing.
"""
