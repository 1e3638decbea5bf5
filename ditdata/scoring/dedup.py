"""`ditdata dedup`: near-duplicate images of a scored image-shard folder, found over the
CLIP image embeddings `ditdata score --save-embeddings` kept, one image kept per group,
written as a selection (ditdata.scoring.filter's file, so `ditdata encode --select` and
`ditdata filter --select` take it).

    pairs   every two images whose embeddings have cosine similarity >= threshold
            (default 0.95), found with faiss (the dedup extra) by range search:
            - exact (IndexFlatIP over all embeddings, queried in blocks of QUERY_BLOCK so
              the result lists held at once stay small) up to DEDUP_EXACT_MAX embeddings
              (ditdata/config.py) or with --exact;
            - above it (or with --approximate) an inverted-file (IVF) self-join: a
              spherical k-means (faiss.Kmeans) of ivf_cells(n) cells fitted on a seeded
              sample of TRAIN_PER_CELL points per cell, each image put in its
              CELLS_PER_IMAGE nearest cells, and the exact range search above run within
              each cell. A pair is found when its two images share a cell, so a pair
              whose images fall in cells far apart can be missed (bench/dedup.py measures
              how many on planted pairs, bench/RESULTS.md); a pair found is never a
              false one. The cost is about n * cells * D for the assignment plus
              CELLS_PER_IMAGE^2 * n^2 * D / cells for the joins (very unequal cells, as
              with one huge cluster of near-identical images, cost more); memory is the
              float16 embeddings plus one cell in float32.
            The stored float16 embeddings are renormalised in float32 before the search.
    groups  the connected components of the pairs (union-find): a chain a~b~c is one
            group even when a and c are below the threshold.
    kept    one image per group: the highest CLIP score (a null score lowest), ties by the
            smallest key; every image in no group is kept. Images without an embedding (no
            caption, undecodable: their score is null too) are left out of the selection.

With --select SELECTION only that selection's images are compared and selected (filter
first, then dedup: a group's kept image then passes the filter). The selection's rule
records dedup = {threshold, search, groups, images_in_groups, removed, group_sizes,
embeddings} beside the CLIP model. A grid PNG of the largest groups (one row each, the
kept image first with a green frame, the others red with their cosine to it) lets a
person check the threshold.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from pathlib import Path

from ditdata.config import DEDUP_EXACT_MAX, DedupConfig
from ditdata.errors import DitdataError

QUERY_BLOCK = 4096  # queries per range search: bounds the result lists held at once
ASSIGN_BLOCK = 65536  # embeddings converted to float32 at a time while assigning cells
CELLS_PER_IMAGE = 2  # IVF: each image joins its this many nearest cells
TRAIN_PER_CELL = 32  # k-means training points per IVF cell
KMEANS_ITERATIONS = 10
SEED = 0  # of the k-means training sample and initialisation
THUMB = 112  # grid thumbnail side, px
GRID_COLUMNS = 8  # images shown per group in the grid


def ivf_cells(n: int) -> int:
    """IVF cells for n embeddings: about 2 sqrt(n) (1M -> 2048), a power of two, at most n."""
    return max(1, min(n, 2 ** round(math.log2(max(2 * math.sqrt(n), 1)))))


def _f32(block):
    """A block of stored embeddings as float32 rows of unit length (zero rows stay zero)."""
    import numpy as np

    x = np.asarray(block, dtype=np.float32)
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return np.ascontiguousarray(x / np.where(norm > 0, norm, 1))


def search_plan(n: int, exact: bool | None = None) -> dict:
    """How n embeddings are searched: {"kind": "exact"} or {"kind": "ivf", "cells", "cells_per_image"}."""
    if exact or (exact is None and n <= DEDUP_EXACT_MAX):
        return {"kind": "exact", "index": "IndexFlatIP range search"}
    cells = ivf_cells(n)
    return {"kind": "ivf", "index": "k-means cells + IndexFlatIP range search per cell", "cells": cells,
            "cells_per_image": min(CELLS_PER_IMAGE, cells)}


def _pairs_within(faiss, x, t32):
    """(a, b, cos) local row pairs a < b of the unit float32 rows x with cos >= t32: an exact
    IndexFlatIP range search of x against itself, QUERY_BLOCK queries at a time."""
    import numpy as np

    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    radius = float(np.nextafter(t32, np.float32(-np.inf)))  # faiss keeps inner products > radius
    out_a, out_b, out_s = [], [], []
    for s in range(0, len(x), QUERY_BLOCK):
        lims, sims, ids = index.range_search(x[s:s + QUERY_BLOCK], radius)
        rows = s + np.repeat(np.arange(len(lims) - 1), np.diff(lims.astype(np.int64)))
        ok = (ids > rows) & (sims >= t32)  # each pair once, never an image with itself
        out_a.append(rows[ok])
        out_b.append(ids[ok])
        out_s.append(sims[ok])
    return np.concatenate(out_a), np.concatenate(out_b), np.concatenate(out_s)


def _cells(faiss, emb, plan: dict):
    """(rows, bounds): the rows of each IVF cell c, rows[bounds[c]:bounds[c + 1]]; every row is
    in its cells_per_image nearest cells of a spherical k-means (faiss.Kmeans) fitted on a
    seeded sample."""
    import numpy as np

    n, d = emb.shape
    cells, k = plan["cells"], plan["cells_per_image"]
    sample = np.sort(np.random.default_rng(SEED).choice(n, min(n, cells * TRAIN_PER_CELL), replace=False))
    km = faiss.Kmeans(d, cells, niter=KMEANS_ITERATIONS, spherical=True, seed=SEED, verbose=False,
                      min_points_per_centroid=1)  # TRAIN_PER_CELL is below faiss' advice (39); fewer is fine here
    km.train(_f32(emb[sample]))
    quantizer = faiss.IndexFlatIP(d)
    quantizer.add(km.centroids)
    assign = np.empty((n, k), np.int64)
    for s in range(0, n, ASSIGN_BLOCK):
        assign[s:s + ASSIGN_BLOCK] = quantizer.search(_f32(emb[s:s + ASSIGN_BLOCK]), k)[1]
    flat = assign.reshape(-1)
    order = np.argsort(flat, kind="stable")
    bounds = np.searchsorted(flat[order], np.arange(cells + 1))
    return order // k, bounds


def neighbour_pairs(emb, threshold: float, *, exact: bool | None = None, threads: int | None = None,
                    progress: bool = False):
    """(a, b, cos, plan): every pair a < b of rows of `emb` (N, D) with cosine >= threshold
    (int64, int64, float32 arrays; approximate above DEDUP_EXACT_MAX, module docstring) and how
    they were searched (search_plan, with build_seconds and search_seconds)."""
    import numpy as np

    from ditdata.common.extras import require
    from ditdata.common.progress import progress_bar

    faiss = require("faiss", "ditdata dedup (vector search with faiss)", "dedup", DitdataError)
    if threads:
        faiss.omp_set_num_threads(int(threads))
    n = len(emb)
    plan = search_plan(n, exact)
    t32 = np.float32(threshold)
    t0 = time.perf_counter()
    if plan["kind"] == "exact":
        plan["build_seconds"] = 0.0
        a, b, cos = _pairs_within(faiss, _f32(emb), t32)
    else:
        rows, bounds = _cells(faiss, emb, plan)
        plan["build_seconds"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        found_a, found_b, found_s = [], [], []
        with progress_bar(total=plan["cells"], unit=" cells", enabled=progress, desc="dedup search") as bar:
            for c in range(plan["cells"]):
                members = rows[bounds[c]:bounds[c + 1]]
                if len(members) > 1:
                    i, j, s = _pairs_within(faiss, _f32(emb[members]), t32)
                    gi, gj = members[i], members[j]
                    found_a.append(np.minimum(gi, gj))
                    found_b.append(np.maximum(gi, gj))
                    found_s.append(s)
                bar.update(1)
        a, b, cos = (np.concatenate(x) if x else np.zeros(0) for x in (found_a, found_b, found_s))
        pair = a.astype(np.int64) * n + b  # a pair two cells share is found twice
        _, first = np.unique(pair, return_index=True)
        a, b, cos = a[first], b[first], cos[first]
    plan["search_seconds"] = time.perf_counter() - t0
    return a.astype(np.int64), b.astype(np.int64), cos.astype(np.float32), plan


def groups_of(n: int, a, b):
    """(N,) group label of each of n items given the pairs (a[i], b[i]): union-find with path
    halving; the label is the smallest index of the group."""
    import numpy as np

    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for x, y in zip(a.tolist(), b.tolist(), strict=True):
        rx, ry = find(x), find(y)
        if rx != ry:
            parent[max(rx, ry)] = min(rx, ry)
    labels = np.asarray(parent, dtype=np.int64)
    while True:  # every item straight to its root
        up = labels[labels]
        if np.array_equal(up, labels):
            return labels
        labels = up


def keep_one(labels, scores, keys: list[str]):
    """(N,) bool: the one image kept per group (highest score, NaN lowest; ties: smallest key)."""
    import numpy as np

    n = len(labels)
    key_rank = np.empty(n, np.int64)
    key_rank[np.argsort(np.asarray(keys, dtype=object), kind="stable")] = np.arange(n)
    score = np.nan_to_num(np.asarray(scores, np.float64), nan=-np.inf)
    order = np.lexsort((key_rank, -score, labels))  # by group, best first
    first = np.ones(n, bool)
    first[1:] = labels[order][1:] != labels[order][:-1]
    keep = np.zeros(n, bool)
    keep[order[first]] = True
    return keep


def _embeddings(shards_dir: Path, table, ident: dict):
    """(N, D) float16 embeddings in the table's row order and the (N,) mask of rows with one."""
    import numpy as np

    from ditdata.imageshards.scores import read_embeddings, score_path

    dim = int(ident["embeddings"]["dim"])
    shard_col = table.column("shard").to_pylist()
    order = list(dict.fromkeys(shard_col))
    counts = Counter(shard_col)
    emb = np.zeros((len(shard_col), dim), np.float16)
    has = np.zeros(len(shard_col), bool)
    at = 0
    for name in order:
        meta = ident["metas"][name]
        if int(meta["embeddings"]["dim"]) != dim:
            raise DitdataError(f"{shards_dir}: shard {name} holds {meta['embeddings']['dim']}-wide embeddings, "
                               f"others {dim}-wide; rescore with one model (ditdata score --overwrite)")
        e, v = read_embeddings(score_path(shards_dir / name), counts[name], dim)
        emb[at:at + counts[name]], has[at:at + counts[name]] = e, v
        at += counts[name]
    return emb, has


def dedup(cfg: DedupConfig) -> dict:
    """Find the near-duplicate groups of cfg.shards, write the selection cfg.out and the grid;
    returns the summary `report` prints (module docstring)."""
    import numpy as np

    from ditdata.imageshards.scores import read_scores
    from ditdata.scoring.filter import candidates_of, clip_rule, folder_rule, publish, unique_keys

    if not 0 < cfg.threshold <= 1:
        raise DitdataError(f"--threshold must be in (0, 1], got {cfg.threshold}")
    d = Path(cfg.shards)
    table, ident = read_scores(d, needs=("embeddings",))
    keys = unique_keys(table, d)
    scores = table.column("clip_score").to_numpy(zero_copy_only=False).astype(np.float64)
    emb, has = _embeddings(d, table, ident)
    candidates, picked = candidates_of(cfg.select, keys)
    idx = np.flatnonzero(has if candidates is None else has & candidates)
    if idx.size == 0:
        raise DitdataError(f"{d}: no image has an embedding (every sample lacks a caption or is undecodable)")
    sub, sub_keys = emb[idx], [keys[i] for i in idx]
    a, _, _, plan = pairs = neighbour_pairs(sub, cfg.threshold, exact=cfg.exact, threads=cfg.threads,
                                            progress=cfg.progress)
    labels = groups_of(len(idx), pairs[0], pairs[1])
    keep_sub = keep_one(labels, scores[idx], sub_keys)
    keep = np.zeros(len(keys), bool)
    keep[idx[keep_sub]] = True
    record = _record(cfg, plan, len(a), labels, keep_sub, ident)
    rule = {**clip_rule(ident), "threshold": None, "dedup": record, "kept": int(keep.sum()),
            "compared": int(idx.size), "without_embedding": int((~has).sum()), **folder_rule(d, table)}
    if picked is not None:
        rule["select"] = picked
    publish(cfg.out, table, keys, scores, keep, rule)
    grid = None if cfg.grid == "" else (cfg.grid or str(Path(cfg.out).with_suffix(".groups.png")))
    shown = 0
    if grid and cfg.grid_groups > 0 and record["groups"]:
        shard_col = table.column("shard").to_pylist()
        sub_shards = [shard_col[i] for i in idx]
        rows = []  # (shard, key, kept, cosine to the kept image) of each group's first GRID_COLUMNS images
        for g in _largest_groups(labels, keep_sub, scores[idx], sub_keys, cfg.grid_groups):
            g = g[:GRID_COLUMNS]
            cos_to_kept = _f32(sub[g]) @ _f32(sub[g[:1]])[0]
            rows.append([(sub_shards[i], sub_keys[i], bool(keep_sub[i]), float(c))
                         for i, c in zip(g, cos_to_kept, strict=True)])
        shown = sample_grid(grid, d, rows)
    return {"rule": rule, "out": str(cfg.out), "grid": grid if shown else None, "grid_rows": shown}


def _record(cfg: DedupConfig, plan: dict, pairs: int, labels, keep, ident: dict) -> dict:
    """The selection rule's dedup entry (module docstring)."""
    import numpy as np

    sizes = np.bincount(labels, minlength=len(labels))
    group_sizes = Counter(sizes[sizes >= 2].tolist())
    return {
        "threshold": float(cfg.threshold),
        "search": plan,
        "pairs": int(pairs),
        "groups": int(sum(group_sizes.values())),
        "images_in_groups": int(sum(s * c for s, c in group_sizes.items())),
        "removed": int(len(labels) - keep.sum()),
        "group_sizes": {str(s): c for s, c in sorted(group_sizes.items())},
        "embeddings": ident["embeddings"],
        "kept_per_group": "highest clip_score, ties by smallest key",
    }


def _largest_groups(labels, keep, scores, keys: list[str], count: int) -> list[list[int]]:
    """The `count` largest groups (ties: the smallest label), each as member indices with the
    kept one first, then by score."""
    import numpy as np

    sizes = np.bincount(labels)
    roots = [r for r in np.argsort(-sizes, kind="stable")[:count] if sizes[r] >= 2]
    out = []
    for r in roots:
        m = np.flatnonzero(labels == r).tolist()
        m.sort(key=lambda i: (not keep[i], -np.nan_to_num(scores[i], nan=-np.inf), keys[i]))
        out.append(m)
    return out


def sample_grid(path, shards_dir: Path, rows: list[list[tuple]]) -> int:
    """A PNG with one row per group: (shard, key, kept, cosine to the kept image) per image;
    the kept image framed green, the others red with their cosine. Returns the rows drawn."""
    import io

    from PIL import Image, ImageDraw, ImageOps

    from ditdata.common.files import write_bytes_atomic
    from ditdata.imageshards import folder as imageshards

    wanted = {(s, k) for row in rows for s, k, _, _ in row}
    thumbs: dict[tuple, Image.Image] = {}
    for shard in sorted({s for s, _ in wanted}):
        for sample in imageshards.iter_shard(shards_dir / shard):
            if (shard, sample.key) in wanted:
                try:
                    thumbs[(shard, sample.key)] = ImageOps.pad(sample.decode(), (THUMB, THUMB), color=(32, 32, 32))
                except imageshards.BadImageError:
                    pass
    label, pad = 14, 4
    cell = THUMB + 2 * pad
    canvas = Image.new("RGB", (cell * max(len(r) for r in rows), (cell + label) * len(rows)), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for y, row in enumerate(rows):
        for x, (shard, key, kept, cos) in enumerate(row):
            x0, y0 = x * cell, y * (cell + label)
            draw.rectangle([x0, y0, x0 + cell - 1, y0 + cell - 1], fill=(0, 160, 0) if kept else (200, 0, 0))
            if (shard, key) in thumbs:
                canvas.paste(thumbs[(shard, key)], (x0 + pad, y0 + pad))
            text = f"kept {key}" if kept else f"{cos:.3f} {key}"
            draw.text((x0 + 2, y0 + cell), text[:20], fill=(0, 0, 0))
    buf = io.BytesIO()
    canvas.save(buf, "PNG")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(Path(path), buf.getvalue())
    return len(rows)


def report(summary: dict) -> str:
    """What `ditdata dedup` prints: groups, the group-size histogram, images removed."""
    r = summary["rule"]
    dd = r["dedup"]
    plan = dd["search"]
    how = (f"exact ({plan['index']})" if plan["kind"] == "exact"
           else f"approximate ({plan['index']}, {plan['cells']} cells, {plan['cells_per_image']} per image)")
    lines = [
        f"kept {r['kept']} / {r['total']} samples -> {summary['out']}",
        f"  compared {r['compared']} images" + (f" (of the selection {r['select']['path']})" if r.get("select") else "")
        + (f"; {r['without_embedding']} without an embedding (no caption or undecodable) left out"
           if r["without_embedding"] else ""),
        f"  cosine >= {dd['threshold']:g}: {dd['groups']} groups holding {dd['images_in_groups']} images; "
        f"removed {dd['removed']} (kept the highest CLIP score of each)",
        f"  search: {how}, {dd['pairs']} pairs, built in {plan['build_seconds']:.1f} s, "
        f"searched in {plan['search_seconds']:.1f} s",
    ]
    if dd["group_sizes"]:
        top = max(dd["group_sizes"].values())
        lines.append("  group sizes:")
        lines += [f"    {s:>6} images: {c:>7}  {'#' * math.ceil(30 * c / top)}" for s, c in dd["group_sizes"].items()]
    if summary["grid"]:
        lines.append(f"  grid of the {summary['grid_rows']} largest groups: {summary['grid']}")
    return "\n".join(lines)
