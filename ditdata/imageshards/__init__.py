"""Image shards, and the files that stages hand each other beside them.

    folder.py      SHARDS_DIR as `ditdata fetch` writes it: NNNNN.tar + _stats.json, dataset.json; readers, writers
    scores.py      NNNNN.clip.parquet (`ditdata score` writes it; filter, dedup and encode read it)
    selections.py  selection files (`ditdata filter` and `dedup` write them; encode --select reads them)
    batches.py     decoded, cropped image batches of whole shards (encode's reader, and `ditdata features`')

Every stage imports what it hands on or takes from here, never another stage's module. The
package itself imports nothing.
"""
