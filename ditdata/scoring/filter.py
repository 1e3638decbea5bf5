"""`ditdata filter`: pick the samples to encode from the CLIP scores of `ditdata score`.

The rule is global over every shard of the folder, and every condition must hold (AND):

    --min-clip-score X      clip_score >= X
    --top-fraction F        0 < F <= 1. Among the n samples that HAVE a score, the
                            threshold t is the k-th highest score, k = ceil(F * n)
                            (F*n computed exactly from F's decimal form, so 0.3 * 10 is 3);
                            kept: clip_score >= t. Ties at the cut-off are ALL kept, so
                            the score rule can keep more than k samples, never fewer; the
                            selection is the same as --min-clip-score t.
    --min-width W / --min-height H
                            width >= W / height >= H
    --max-aspect-ratio R    max(width, height) / min(width, height) <= R
    --min-caption-length N  len(caption.strip()) >= N characters
    --min-aesthetic A       aesthetic >= A (the LAION aesthetic predictor's score, from
                            `ditdata score --aesthetic FILE`; LAION-Aesthetics used 5, 6, 6.5)
    --top-aesthetic-fraction F
                            the top F by aesthetic score, the same rule as --top-fraction
    --select SELECTION      only samples of an earlier selection (e.g. `ditdata dedup`'s):
                            the other rules, top fractions included, apply among its samples
    --captions SET          the CLIP scores (and caption lengths) of caption set SET
                            (`ditdata score --captions SET`) instead of the shards' own
                            captions ("alt"); the rule records captions = SET

Any combination works, at least one rule given: every condition must hold. Each top
fraction is resolved on its own score over the candidates (all samples, or those of
--select), so --top-fraction 0.5 --top-aesthetic-fraction 0.5 keeps the samples in both
top halves (about a quarter when the scores are independent), not the top half of the
top half. `ditdata dedup --select` takes a filter's selection the other way round
(duplicates looked for among the filtered samples only; the better order, since a group's
kept image then passes the filter).

A null score (no caption, or an undecodable image) never passes a score rule; a null
aesthetic score never passes an aesthetic rule. Width and
height are those of the SOURCE image before `ditdata fetch` resized it (original_width /
original_height in the sample's json) when recorded, else the stored image's size; a
sample whose size is unknown fails any size or aspect rule. Images are never rewritten.

The selection file (`--out`): ditdata.imageshards.selections.

`rule` records how the selection was made (it goes into a store manifest's "filter"):
clip_model, clip_pretrained, clip_weights_sha256, min_clip_score, top_fraction,
threshold (the score threshold applied: X, or t resolved from F; null with neither),
min_width, min_height, max_aspect_ratio, min_caption_length (null when not set), size
(which size the size rules used), ties, kept, total (samples in the scored shards),
scored (samples with a score), shards_dir, num_shards; with an aesthetic rule also
aesthetic (the predictor: file, sha256, kind, widths), min_aesthetic,
top_aesthetic_fraction and aesthetic_threshold; with --select, select = {path, rule}
(the earlier selection's); a selection of `ditdata dedup` has dedup = {...} (see
ditdata.scoring.dedup).
"""

from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction
from pathlib import Path

from ditdata.config import FilterConfig
from ditdata.errors import DitdataError
from ditdata.imageshards.scores import read_scores
from ditdata.imageshards.selections import Selection, load_selection, write_selection

SIZE_POLICY = "original size recorded by fetch when known, else the stored image size"
TIE_POLICY = "every sample scoring exactly the threshold is kept"


# ----------------------------------------------------------------------------- the rule


def top_fraction_count(fraction: float, n: int) -> int:
    """k = ceil(F * n), exact for the decimal F the user typed (0.3 * 10 -> 3, not 4)."""
    if not 0 < fraction <= 1:
        raise DitdataError(f"--top-fraction must be in (0, 1], got {fraction}")
    return math.ceil(Fraction(repr(float(fraction))) * n)


def resolve_threshold(scores, *, min_clip_score: float | None = None, top_fraction: float | None = None,
                      flags: tuple[str, str] = ("--min-clip-score", "--top-fraction"), what: str = "CLIP score"):
    """The score threshold of the rule: min_clip_score itself, or the k-th highest of the
    non-null (non-NaN) scores for top_fraction; None when neither is given. `flags` and
    `what` name the options and the score in errors (the aesthetic rule uses it too)."""
    import numpy as np

    min_flag, frac_flag = flags
    if min_clip_score is not None and top_fraction is not None:
        raise DitdataError(f"give either {min_flag} or {frac_flag}, not both")
    if min_clip_score is not None:
        if not math.isfinite(min_clip_score):
            raise DitdataError(f"{min_flag} must be a finite number, got {min_clip_score}")
        return float(min_clip_score)
    if top_fraction is None:
        return None
    s = np.asarray(scores, dtype=np.float64)
    s = s[~np.isnan(s)]
    if s.size == 0:
        raise DitdataError(f"{frac_flag}: no sample has a {what}")
    k = top_fraction_count(top_fraction, s.size)
    return float(np.sort(s)[::-1][k - 1])


AESTHETIC_FLAGS = ("--min-aesthetic", "--top-aesthetic-fraction")


def apply_rule(cols: dict, *, threshold: float | None = None, min_width: int | None = None,
               min_height: int | None = None, max_aspect_ratio: float | None = None,
               min_caption_length: int | None = None, aesthetic_threshold: float | None = None,
               candidates=None):
    """(keep: bool array, drops: Counter of the FIRST failed condition per dropped sample).

    `cols` holds equal-length arrays: clip_score (NaN = null), width, height (the sizes
    the size rules apply to; NaN = unknown), caption_length (NaN = no caption) and status
    (to tell a missing caption from an undecodable image), and aesthetic (NaN = null) for
    an aesthetic rule. `candidates` (bool) marks the samples of an earlier selection."""
    import numpy as np

    score = np.asarray(cols["clip_score"], dtype=np.float64)
    n = score.size
    w = np.asarray(cols.get("width", np.full(n, np.nan)), dtype=np.float64)
    h = np.asarray(cols.get("height", np.full(n, np.nan)), dtype=np.float64)
    cap = np.asarray(cols.get("caption_length", np.full(n, np.nan)), dtype=np.float64)
    status = np.asarray(cols.get("status", np.full(n, "ok")), dtype=object)
    conditions = []
    if candidates is not None:
        conditions.append(("not in the --select selection", np.asarray(candidates, bool)))
    if threshold is not None:
        null = np.isnan(score)
        nocap = null & (status == "no caption")
        conditions += [
            ("no score: no caption", ~nocap),
            ("no score: undecodable image", ~(null & ~nocap)),
            ("score below threshold", np.where(null, False, score >= threshold)),
        ]
    with np.errstate(invalid="ignore", divide="ignore"):
        if min_width is not None:
            conditions.append((f"width < {min_width}", w >= min_width))
        if min_height is not None:
            conditions.append((f"height < {min_height}", h >= min_height))
        if max_aspect_ratio is not None:
            ratio = np.maximum(w, h) / np.minimum(w, h)
            conditions.append((f"aspect ratio > {max_aspect_ratio:g}", ratio <= max_aspect_ratio))
        if min_caption_length is not None:
            conditions.append((f"caption shorter than {min_caption_length}", np.nan_to_num(cap, nan=0) >= min_caption_length))
        if aesthetic_threshold is not None:
            a = np.asarray(cols["aesthetic"], dtype=np.float64)
            conditions += [("no aesthetic score", ~np.isnan(a)),
                           ("aesthetic below threshold", np.where(np.isnan(a), False, a >= aesthetic_threshold))]
    keep = np.ones(n, dtype=bool)
    drops: Counter = Counter()
    for name, ok in conditions:  # NaN comparisons are False: unknown fails
        newly = keep & ~ok
        if newly.any():
            drops[name] += int(newly.sum())
        keep &= ok
    return keep, drops


def rule_columns(table) -> dict:
    """Numpy columns for apply_rule from a score table (size rules use the original size
    when recorded, else the stored size)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    def num(name):
        col = table.column(name).cast(pa.float64())
        return pc.fill_null(col, float("nan")).to_numpy()

    ow, oh = num("original_width"), num("original_height")
    w, h = num("width"), num("height")
    known = ~np.isnan(ow) & ~np.isnan(oh)
    return {
        "clip_score": num("clip_score"),
        "width": np.where(known, ow, w),
        "height": np.where(known, oh, h),
        "caption_length": num("caption_length"),
        "status": np.asarray(table.column("status").to_pylist(), dtype=object),
        **({"aesthetic": num("aesthetic")} if "aesthetic" in table.column_names else {}),
    }


# ----------------------------------------------------------------------------- filter


def filter_shards(cfg: FilterConfig) -> tuple[Selection, dict]:
    """Apply the rule of `cfg` (module docstring) to every scored shard of cfg.shards and write
    the selection file cfg.out. Returns (the selection, a summary for `report`)."""
    import numpy as np

    shards_dir, out = cfg.shards, cfg.out
    aesthetic_rule = cfg.min_aesthetic is not None or cfg.top_aesthetic_fraction is not None
    if not (cfg.min_clip_score is not None or cfg.top_fraction is not None or aesthetic_rule
            or cfg.select is not None):
        raise DitdataError("give a rule: --min-clip-score X, --top-fraction F, --min-aesthetic A, "
                           "--top-aesthetic-fraction F or --select SELECTION")
    if cfg.max_aspect_ratio is not None and not cfg.max_aspect_ratio >= 1:
        raise DitdataError(f"--max-aspect-ratio must be >= 1, got {cfg.max_aspect_ratio}")
    table, ident = read_scores(shards_dir, needs=("aesthetic",) if aesthetic_rule else (), captions=cfg.captions)
    keys = unique_keys(table, shards_dir)
    cols = rule_columns(table)
    candidates, picked = candidates_of(cfg.select, keys)
    among = np.ones(len(keys), bool) if candidates is None else candidates
    threshold = resolve_threshold(cols["clip_score"][among], min_clip_score=cfg.min_clip_score,
                                  top_fraction=cfg.top_fraction)
    a_threshold = None if not aesthetic_rule else resolve_threshold(
        cols["aesthetic"][among], min_clip_score=cfg.min_aesthetic, top_fraction=cfg.top_aesthetic_fraction,
        flags=AESTHETIC_FLAGS, what="aesthetic score")
    keep, drops = apply_rule(cols, threshold=threshold, min_width=cfg.min_width, min_height=cfg.min_height,
                             max_aspect_ratio=cfg.max_aspect_ratio, min_caption_length=cfg.min_caption_length,
                             aesthetic_threshold=a_threshold, candidates=candidates)
    scores = cols["clip_score"]
    scored = int((~np.isnan(scores[among])).sum())
    rule = {
        **clip_rule(ident),
        "min_clip_score": None if cfg.min_clip_score is None else float(cfg.min_clip_score),
        "top_fraction": None if cfg.top_fraction is None else float(cfg.top_fraction),
        "threshold": threshold,
        "min_width": cfg.min_width,
        "min_height": cfg.min_height,
        "max_aspect_ratio": None if cfg.max_aspect_ratio is None else float(cfg.max_aspect_ratio),
        "min_caption_length": cfg.min_caption_length,
        "size": SIZE_POLICY,
        "ties": TIE_POLICY,
        "kept": int(keep.sum()),
        "scored": scored,
        **folder_rule(shards_dir, table),
        **_extra_rule(ident, picked, aesthetic_rule and {"aesthetic": ident["aesthetic"],
                                                         "min_aesthetic": cfg.min_aesthetic,
                                                         "top_aesthetic_fraction": cfg.top_aesthetic_fraction,
                                                         "aesthetic_threshold": a_threshold}),
    }
    if rule["kept"] == 0:
        rng = f"scores range {np.nanmin(scores):.4f}..{np.nanmax(scores):.4f}" if scored else "no sample has a score"
        raise DitdataError(f"no sample passes the rule ({rng}); nothing written")
    sel = publish(out, table, keys, scores, keep, rule)
    return sel, {"rule": rule, "drops": dict(drops.most_common()), "scores": scores[among], "keep": keep[among],
                 "out": str(out), "aesthetic": cols["aesthetic"][among] if aesthetic_rule else None}  # candidates only


def _extra_rule(ident: dict, picked: dict | None, aesthetic: dict | bool) -> dict:
    """The rule's entries that are there only when they apply: the aesthetic rule, the
    --select selection, the damaged shards score left out (nothing of them is selected)."""
    extra = dict(aesthetic) if aesthetic else {}
    if picked is not None:
        extra["select"] = picked
    if ident["skipped_shards"]:
        extra["skipped_shards"] = ident["skipped_shards"]
    return extra


def publish(out, table, keys: list[str], scores, keep, rule: dict) -> Selection:
    """Write the kept rows of a score table as the selection file `out` (write_selection)."""
    by_shard, kept_scores = kept_samples(table.column("shard").to_pylist(), keys, scores, keep)
    write_selection(out, by_shard, rule, kept_scores)
    return Selection(keys={k for ks in by_shard.values() for k in ks}, rule=rule, shards=by_shard, path=str(out))


def clip_rule(ident: dict) -> dict:
    """The CLIP model a selection's scores come from, as its rule records it (and the caption
    set scored, when it is not the shards' own captions)."""
    rule = {"clip_model": ident["model"], "clip_pretrained": ident["pretrained"],
            "clip_weights_sha256": ident["weights_sha256"]}
    if ident.get("captions", "alt") != "alt":
        rule["captions"] = ident["captions"]
    return rule


def folder_rule(shards_dir, table) -> dict:
    """The scored folder a selection was made from, as its rule records it."""
    return {"total": table.num_rows, "shards_dir": str(Path(shards_dir).resolve()),
            "num_shards": len(set(table.column("shard").to_pylist()))}


def unique_keys(table, shards_dir) -> list[str]:
    """The key column of a score table; DitdataError when a key occurs twice."""
    keys = table.column("key").to_pylist()
    if len(set(keys)) != len(keys):
        dup = next(k for k, c in Counter(keys).items() if c > 1)
        raise DitdataError(f"{shards_dir}: sample key {dup!r} occurs more than once; keys must be unique")
    return keys


def candidates_of(select, keys: list[str]):
    """(bool mask of `keys` in the selection file `select`, {path, rule} to record), or
    (None, None) without one. DitdataError when the selection picks none of these samples."""
    import numpy as np

    if select is None:
        return None, None
    sel = select if isinstance(select, Selection) else load_selection(select)
    mask = np.fromiter((k in sel.keys for k in keys), bool, len(keys))
    if not mask.any():
        raise DitdataError(f"{sel.path}: the selection holds none of this folder's samples (made from "
                           f"{sel.rule.get('shards_dir', 'another folder')})")
    return mask, {"path": str(Path(sel.path).resolve()) if sel.path else None, "rule": sel.rule}


def kept_samples(shard_col: list[str], keys: list[str], scores, keep) -> tuple[dict[str, list[str]], list]:
    """The kept samples: {shard: keys in stored order} and their scores (None: null)."""
    import numpy as np

    by_shard: dict[str, list[str]] = {}
    kept_scores = []
    for i in np.flatnonzero(keep):
        by_shard.setdefault(shard_col[i], []).append(keys[i])
        kept_scores.append(float(scores[i]) if not np.isnan(scores[i]) else None)
    return by_shard, kept_scores


# ----------------------------------------------------------------------------- printing


def _bin_width(lo: float, hi: float, max_bins: int) -> float:
    span = max(hi - lo, 1e-9)
    for w in (0.001, 0.002, 0.0025, 0.005, 0.01, 0.02, 0.025, 0.05, 0.1, 0.2, 0.25, 0.5, 1.0):
        if span / w <= max_bins:
            return w
    return 2.0


def histogram(scores, keep=None, threshold: float | None = None, *, max_bins: int = 20, bar: int = 40) -> str:
    """A text histogram of the non-null scores: one line per bin with its count, how many
    were kept, and a bar; the bin holding the threshold is marked."""
    import numpy as np

    s = np.asarray(scores, dtype=np.float64)
    k = np.ones(s.size, bool) if keep is None else np.asarray(keep, bool)
    valid = ~np.isnan(s)
    s, k = s[valid], k[valid]
    if s.size == 0:
        return "  (no scores)"
    w = _bin_width(float(s.min()), float(s.max()), max_bins)
    cell = np.floor(np.round(s / w, 9)).astype(np.int64)  # 0.3 / 0.1 is 2.9999999999999996
    start = int(cell.min())
    idx = cell - start
    tcell = None if threshold is None else int(np.floor(np.round(threshold / w, 9))) - start
    nb = int(idx.max()) + 1
    counts = np.bincount(idx, minlength=nb)
    kept = np.bincount(idx[k], minlength=nb)
    top = max(int(counts.max()), 1)
    digits = 3 if w >= 0.01 else 4
    cw = max(len(str(int(counts.max()))), 5)
    lines = [f"  {'score':>{2 * digits + 7}}  {'count':>{cw}}  {'kept':>{cw}}"]
    for b in range(nb):
        lo, hi = (start + b) * w, (start + b + 1) * w
        mark = "  <- threshold" if b == tcell else ""
        n = int(counts[b])
        lines.append(
            f"  [{lo: .{digits}f}, {hi: .{digits}f})  {n:>{cw}}  {int(kept[b]):>{cw}}  "
            f"{'#' * (math.ceil(bar * n / top) if n else 0)}{mark}"
        )
    return "\n".join(lines)


def report(summary: dict) -> str:
    """What `ditdata filter` prints: kept / total, the threshold, why samples were
    dropped, and the score histogram."""
    from ditdata.imageshards.folder import left_out

    r = summary["rule"]
    total, kept = r["total"], r["kept"]
    pct = 100 * kept / total if total else 0.0
    lines = [f"kept {kept} / {total} samples ({pct:.1f}%) -> {summary['out']}"]
    if r.get("select"):
        lines.append(f"  among: the {r['select']['rule'].get('kept', '?')} samples of {r['select']['path']}")
    if r["threshold"] is not None:
        how = (f"top {100 * r['top_fraction']:g}% of {r['scored']} scored -> threshold {r['threshold']:.4f}"
               if r["top_fraction"] is not None else f"clip_score >= {r['threshold']:g}")
        of = f", captions of set {r['captions']!r}" if r.get("captions") else ""
        lines.append(f"  rule: {how} ({r['clip_model']} / {r['clip_pretrained']}{of})")
    if r.get("aesthetic_threshold") is not None:
        how = (f"top {100 * r['top_aesthetic_fraction']:g}% -> threshold {r['aesthetic_threshold']:.3f}"
               if r["top_aesthetic_fraction"] is not None else f"aesthetic >= {r['aesthetic_threshold']:g}")
        lines.append(f"  rule: {how} (predictor {r['aesthetic']['file']})")
    extra = [f"{k} {r[k]:g}" for k in ("min_width", "min_height", "max_aspect_ratio", "min_caption_length")
             if r[k] is not None]
    if extra:
        lines.append("  and: " + ", ".join(extra))
    for b in r.get("skipped_shards", []):
        lines.append(f"  left out: shard {left_out(b['shard'], b['reason'], b['samples_lost'])}")
    if summary["drops"]:
        lines.append("  dropped (first failed condition):")
        lines += [f"    {v:>8}  {k}" for k, v in summary["drops"].items()]
    lines.append(f"  clip_score histogram ({r['scored']} with a score):")
    lines.append(histogram(summary["scores"], summary["keep"], r["threshold"]))
    if r.get("aesthetic_threshold") is not None:
        lines.append("  aesthetic histogram:")
        lines.append(histogram(summary["aesthetic"], summary["keep"], r["aesthetic_threshold"]))
    return "\n".join(lines)
