"""`ditdata score`: the CLIP similarity of every image-caption pair of an image-shard folder.

For each finished image shard NNNNN.tar (see ditdata.imageshards.folder), NNNNN.clip.parquet is
written beside it, one row per sample in stored order (its columns and metadata:
ditdata.imageshards.scores).

Writing is atomic (a hidden temporary, fsync, rename), so a killed run leaves no
NNNNN.clip.parquet that looks finished. A rerun skips a shard whose score file is
readable, has num_samples rows, matches the shard's size in bytes and was made with the
same model, pretrained weights and weights checksum, and that holds what this run asks
for (embeddings with --save-embeddings, scores of the same predictor file with
--aesthetic); an unreadable or truncated one is recomputed. Score files made by a DIFFERENT model or weights are never mixed with new
ones: the run stops before doing any work and names both (rerun with --overwrite to
replace them all); the same holds for aesthetic scores made by another predictor file. One `ditdata score` (or `ditdata fetch`) per folder at a time: the
folder's lock refuses a second writer at once, naming the first's pid.

Damaged shards. Before scoring, each shard to score must read through to its end and
hold the count its stats file records; one that does not stops the run with a one-line
error, or, with skip_bad_shards, gets NNNNN.clip.skipped.json instead of scores (shard,
shard_bytes, reason, samples_lost), which `ditdata filter` reports and selects nothing
from. Samples that cannot be used (undecodable image, no image member, unreadable
metadata) get a row with a null score and the reason as status.

Precision: on CUDA the towers run under bf16 autocast, which moves a score by about 1e-3
from its fp32 value (measured on an H200: at most 0.0011 for ViT-B-32 on four photos);
compare thresholds against scores made the same way.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

from ditdata.common.memory import halved, out_of_memory_hint
from ditdata.common.progress import Batches, progress_bar, run_totals
from ditdata.config import CLIP_MODEL, SCORE_BATCH_SIZE, ScoreConfig
from ditdata.errors import DitdataError
from ditdata.imageshards import folder as shards
from ditdata.imageshards.scores import (
    AESTHETIC,
    EMBEDDING,
    EMBEDDING_DTYPE,
    FORMAT,
    NO_CAPTION,
    OK,
    SKIPPED_FORMAT,
    VERSION,
    captions_record,
    embedding_column,
    read_score_meta,
    schema,
    score_path,
    scored_captions,
    skipped_path,
    write_scores,
)

DEFAULT_MODEL = CLIP_MODEL
_TMP_RE = re.compile(r"^\.\d{5,}\.clip(\.[A-Za-z0-9_-]+)?\.parquet" + re.escape(shards.TMP_MARK))


# ----------------------------------------------------------------------------- scoring


def _prepare(sample, prepare_image, captions=None):
    """Decode + prepare one sample in a worker thread: (prepared image or None, status, w, h).
    `captions`: {key: caption} of a caption set (None: the sample's own caption)."""
    try:
        img = sample.decode()
    except shards.BadImageError as e:
        return None, e.reason, None, None
    w, h = img.size
    caption = (_caption_of(sample, captions) or "").strip()
    if not caption:
        return None, NO_CAPTION, w, h
    return prepare_image(img), OK, w, h


def _caption_of(sample, captions) -> str | None:
    return sample.caption if captions is None else captions.get(sample.key)


def prepared_samples(samples, prepare_image, workers: int, ahead: int, captions=None) -> Iterator[tuple]:
    """(sample, prepared image, status, w, h) in stored order; up to `ahead` samples are
    decoded and resized by `workers` threads while the model runs (PIL releases the GIL;
    ClipModel.prepare_image runs no torch op on the usual transforms, see there)."""
    if workers <= 0:
        for s in samples:
            yield (s, *_prepare(s, prepare_image, captions))
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="ditdata-decode") as pool:
        q: deque = deque()
        for s in samples:
            q.append((s, pool.submit(_prepare, s, prepare_image, captions)))
            if len(q) >= ahead:
                s0, fut = q.popleft()
                yield (s0, *fut.result())
        while q:
            s0, fut = q.popleft()
            yield (s0, *fut.result())


def score_shard(clip, shard_tar, *, batch_size: int = SCORE_BATCH_SIZE, workers: int = 4, progress=None,
                save_embeddings: bool = False, aesthetic=None, captions: str = "alt") -> dict:
    """Score one shard and write its score file; returns the file's metadata. With
    `save_embeddings` the image embeddings are kept; with `aesthetic` (an
    ditdata.scoring.aesthetic.AestheticPredictor) they are also scored by it. `captions`: the
    caption set scored (ditdata.imageshards.captionsets; "alt": the shard's own captions)."""
    import numpy as np

    from ditdata.imageshards.captionsets import ALT

    tar = Path(shard_tar)
    record = captions_record(tar, captions)  # before the captions are read: a file changed meanwhile is stale
    texts = None if captions == ALT else _set_captions(tar, captions)
    info = clip.info
    rows = {f.name: [] for f in schema(aesthetic=aesthetic is not None)}
    embedded: dict[int, np.ndarray] = {}  # row -> float16 embedding
    counts: Counter = Counter()

    def score_batch(batch_idx: list[int], batch_px: list, batch_cap: list[str]) -> None:
        s, emb = clip.score_and_embed_pixels(clip.pixels(batch_px), batch_cap)
        for i, v in zip(batch_idx, s.tolist(), strict=True):
            rows["clip_score"][i] = float(v)
        if aesthetic is not None:
            for i, v in zip(batch_idx, aesthetic(emb).tolist(), strict=True):
                rows[AESTHETIC][i] = float(v)
        if save_embeddings:
            embedded.update(zip(batch_idx, emb.numpy().astype(np.float16), strict=True))

    batches = Batches(batch_size, score_batch, progress)
    samples = shards.iter_shard(tar)
    ahead = 2 * batch_size
    for i, (s, px, status, w, h) in enumerate(prepared_samples(samples, clip.prepare_image, workers, ahead, texts)):
        # the sample's row, its scores null until its batch is scored
        caption = (_caption_of(s, texts) or "").strip()
        for name, v in (("key", s.key), ("clip_score", None), (AESTHETIC, None), ("status", status), ("width", w),
                        ("height", h), ("original_width", _int_or_none(s.meta.get("original_width"))),
                        ("original_height", _int_or_none(s.meta.get("original_height"))),
                        ("caption_length", len(caption) if caption else None)):
            if name in rows:  # AESTHETIC only with a predictor
                rows[name].append(v)
        counts[status] += 1
        if status == OK:
            batches.add(i, px, caption)
        elif progress is not None:
            progress.update(1)
    batches.flush()
    if texts is not None and rows["key"] != list(texts):
        raise DitdataError(f"{tar}: caption set {captions!r} does not hold this shard's keys in its order; "
                           f"rerun `ditdata caption` with --overwrite for it")
    n = len(rows["key"])
    rows["model"] = [info["model"]] * n
    rows["pretrained"] = [info["pretrained"]] * n
    meta = {  # the score file's metadata (module docstring): what it scores and with which weights
        "format": FORMAT,
        "version": VERSION,
        "shard": tar.name,
        "shard_bytes": tar.stat().st_size,
        "num_samples": n,
        "model": info["model"],
        "pretrained": info["pretrained"],
        "weights_sha256": info["weights_sha256"],
        "counts": dict(sorted(counts.items())),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    if captions != ALT:  # files of the shards' own captions stay as they were before caption sets
        meta["captions"] = record
    if save_embeddings:
        rows[EMBEDDING] = embedding_column(embedded, n, info["embed_dim"])
        meta["embeddings"] = {"dim": info["embed_dim"], "dtype": EMBEDDING_DTYPE, "normalized": True}
    if aesthetic is not None:
        meta["aesthetic"] = aesthetic.record()
    write_scores(score_path(tar, captions), rows, meta)
    return meta


def _set_captions(tar: Path, captions: str) -> dict:
    """{key: caption} of the shard's caption set (DitdataError when its file is missing or
    incomplete); score_shard checks that its keys are the shard's, in order."""
    from ditdata.imageshards.captionsets import read_caption_set

    return read_caption_set(tar, captions)


def _int_or_none(v):
    try:
        return None if v is None else int(v)
    except (TypeError, ValueError):
        return None


def score(cfg: ScoreConfig) -> dict:
    """Score every finished shard of cfg.shards (module docstring) with the open_clip model
    cfg.clip (default ViT-B-32; the config's stem with cfg.clip_config), keeping the image
    embeddings (cfg.save_embeddings) and scoring them with the aesthetic predictor in the
    file cfg.aesthetic when asked. Returns a summary:
    {model, pretrained, weights_sha256, shards, scored_shards, skipped_shards, samples,
    scored, counts (status -> n over all shards), seconds, samples_per_s}."""
    from ditdata.common.lock import DirLock

    d = Path(cfg.shards)
    if cfg.batch_size < 1:
        raise DitdataError("--batch-size must be at least 1")
    folder = shards.read_folder(d)  # refuses an unfinished fetch
    if not folder.shards:
        raise DitdataError(f"{d}: no image shards to score")
    with DirLock(d, "ditdata score"):
        from ditdata.clip import load_clip, resolve_pretrained

        d, tars = folder.path, folder.shards
        for p in d.iterdir():  # temporaries of a killed score run
            if _TMP_RE.match(p.name):
                p.unlink(missing_ok=True)

        clip = cfg.clip
        if not clip and not cfg.clip_config:
            clip = DEFAULT_MODEL
        ident = resolve_pretrained(clip, cfg.pretrained, config=cfg.clip_config)
        # the aesthetic predictor of --aesthetic FILE (ditdata.scoring.aesthetic): a bad file
        # stops the run before any work
        predictor = None
        if cfg.aesthetic is not None:
            from ditdata.scoring.aesthetic import load_predictor

            predictor = load_predictor(cfg.aesthetic)
        done = _already_scored(folder, ident, cfg.overwrite, cfg.save_embeddings, predictor, cfg.captions)
        todo, skipped = _leave_out_bad(folder, [t for t in tars if t.name not in done], cfg.skip_bad_shards,
                                       cfg.captions)
        _check_caption_set(d, todo, cfg.captions)
        metas = dict(done)
        t0 = time.perf_counter()
        n_new = 0
        if todo:
            expected = sum(folder.expected[t.name] or 0 for t in todo)
            workers = min(8, os.cpu_count() or 1) if cfg.workers is None else cfg.workers
            if done:
                print(f"resuming: {len(done)} of {len(tars)} shards already scored", file=sys.stderr)
            with _memory_hint(ident["model"], cfg.batch_size, cfg.device):
                model = load_clip(ident["model"], cfg.pretrained, device=cfg.device, config=cfg.clip_config)
                if predictor is not None:
                    predictor.check_width(model.info)
                t0 = time.perf_counter()  # the rate is of scoring, not of loading the model
                with progress_bar(total=expected or None, unit=" samples", enabled=cfg.progress,
                                  desc="clip score") as bar:
                    for tar in todo:
                        m = score_shard(model, tar, batch_size=cfg.batch_size, workers=workers, progress=bar,
                                        save_embeddings=cfg.save_embeddings, aesthetic=predictor,
                                        captions=cfg.captions)
                        skipped_path(tar).unlink(missing_ok=True)  # a refetched shard is whole again
                        metas[tar.name] = m
                        n_new += m["num_samples"]
        seconds = time.perf_counter() - t0
        counts: Counter = Counter()
        for m in metas.values():
            counts.update(m.get("counts", {}))
        return {
            "shards_dir": str(d),
            "captions": cfg.captions,
            "model": ident["model"],
            "pretrained": ident["pretrained"],
            "weights_sha256": ident["weights_sha256"],
            "embeddings": sum("embeddings" in m for m in metas.values()),
            "aesthetic": None if predictor is None else predictor.record(),
            "shards": len(tars),
            "bad_shards": skipped,
            "scored_shards": len(todo),
            "skipped_shards": len(done),
            "scored": counts.get(OK, 0),
            **run_totals(counts, n_new, seconds, "samples_per_s"),
        }


def _memory_hint(model: str, batch_size: int, device):
    """Out of GPU memory while scoring: one line that names the CLIP model, the batch and the
    precision (ditdata.clip: autocast as ditdata.common.devices chooses), and a smaller
    --batch-size (ditdata.common.memory)."""
    from ditdata.common.devices import amp_dtype, resolve_device

    dev = resolve_device(device)
    return out_of_memory_hint(what=f"scoring with CLIP {model}", batch=f"--batch-size {batch_size}",
                              precision=amp_dtype(dev), hints=[halved("--batch-size", batch_size)], device=dev,
                              error=DitdataError)


def _already_scored(folder, ident: dict, overwrite: bool, save_embeddings: bool = False,
                    predictor=None, captions: str = "alt") -> dict[str, dict]:
    """{shard name: score metadata} of the shards whose scores are complete, for this shard
    as it is, made with these weights and holding what this run asks for (embeddings,
    this predictor's aesthetic scores; a shard without them is scored again). Scores made
    with OTHER weights, or aesthetic scores of another predictor file, stop the run (unless
    `overwrite`): the two are never mixed."""
    done, other, other_aesthetic = {}, {}, {}
    for tar, meta in shards.with_meta(folder, lambda t: read_score_meta(score_path(t, captions))):
        rec = meta.get("aesthetic")
        same_weights = (meta.get("model") == ident["model"] and meta.get("pretrained") == ident["pretrained"]
                        and meta.get("weights_sha256") == ident["weights_sha256"])
        if not same_weights:
            other[tar.name] = meta
        elif predictor is not None and rec and rec.get("sha256") != predictor.sha256:
            other_aesthetic[tar.name] = rec
        elif (meta.get("shard_bytes") == tar.stat().st_size and not overwrite
              and (not save_embeddings or "embeddings" in meta) and (predictor is None or rec)
              and _same_captions(tar, captions, meta)):
            done[tar.name] = meta
    refusals = (  # (shards, what they hold instead): the weights first
        (other, lambda m: f"were already scored with {m.get('model')} / {m.get('pretrained')} (weights sha256 "
                          f"{str(m.get('weights_sha256'))[:12]}), not {ident['model']} / {ident['pretrained']}; "
                          "rerun with --overwrite to replace their scores"),
        (other_aesthetic, lambda r: f"hold aesthetic scores of another predictor ({r.get('file')}, sha256 "
                                    f"{str(r.get('sha256'))[:12]}), not {predictor.path}; rerun with --overwrite "
                                    "to replace them"),
    )
    for found, held in refusals:
        if found and not overwrite:
            first = next(iter(found.values()))
            raise DitdataError(f"{folder.path}: {len(found)} shard(s) {held(first)} (or score a copy of the folder)")
    return done


def _same_captions(tar: Path, captions: str, meta: dict) -> bool:
    """Whether a score file scored the captions the shard's set holds now (a caption set
    rewritten since, e.g. by `ditdata caption --overwrite`, is scored again)."""
    if captions == "alt":
        return scored_captions(meta).get("set") == "alt"
    try:
        return scored_captions(meta) == captions_record(tar, captions)
    except OSError:
        return False


def _check_caption_set(d: Path, todo: list[Path], captions: str) -> None:
    """Before the model is loaded: every shard to score has its caption set complete."""
    if captions == "alt" or not todo:
        return
    from ditdata.imageshards.captionsets import caption_set_path, check_set_name, read_caption_meta

    check_set_name(captions)
    missing = [t.name for t in todo if read_caption_meta(caption_set_path(t, captions)) is None]
    if missing:
        raise DitdataError(f"{d}: {len(missing)} of {len(todo)} shards to score have no complete caption set "
                           f"{captions!r} (first: {missing[0]}); run `ditdata caption {d} --captioner NAME "
                           f"--out-name {captions}` first")


def _leave_out_bad(folder, todo: list[Path], skip_bad_shards: bool,
                   captions: str = "alt") -> tuple[list[Path], list[dict]]:
    """Damaged shards are found before the model is loaded: stop now, or (skip_bad_shards)
    leave them out, each with a skip record in place of its scores. Returns the shards to
    score and the records."""
    bad = shards.damaged_shards(folder, todo, skip_bad_shards)
    skipped = []
    for t in todo:
        if t.name in bad:
            rec = {"format": SKIPPED_FORMAT, "shard": t.name, "shard_bytes": t.stat().st_size,
                   "reason": bad[t.name], "samples_lost": folder.expected[t.name]}
            shards.write_json_atomic(skipped_path(t), rec)
            score_path(t, captions).unlink(missing_ok=True)
            skipped.append(rec)
    return [t for t in todo if t.name not in bad], skipped


def report(summary: dict) -> str:
    """The end-of-run lines printed by `ditdata score`."""
    s = summary
    pre = s["pretrained"] if s["pretrained"] is not None else "random init"
    lines = [f"{s['model']} / {pre}: {s['samples']} samples in {s['shards']} shards"
             + (f", captions of set {s['captions']!r}" if s.get("captions", "alt") != "alt" else "")]
    if s["scored_shards"]:
        rate = f" at {s['samples_per_s']:.1f} samples/s" if s["samples_per_s"] else ""
        lines.append(f"  scored {s['scored_shards']} shard(s), {s['new_samples']} samples in {s['seconds']:.1f} s{rate}")
    if s["skipped_shards"]:
        lines.append(f"  skipped {s['skipped_shards']} shard(s) already scored with these weights")
    if s.get("embeddings"):
        lines.append(f"  image embeddings saved in {s['embeddings']} of {s['shards']} shard(s)")
    if s.get("aesthetic"):
        a = s["aesthetic"]
        lines.append(f"  aesthetic scores: {a['kind']} {'-'.join(map(str, a['widths']))} from {a['file']}")
    for b in s.get("bad_shards", []):
        lines.append(f"  left out the damaged shard {shards.left_out(b['shard'], b['reason'], b['samples_lost'])}")
    counts = s["counts"]
    lines.append(f"  with a score:      {counts.get(OK, 0)}")
    lines.append(f"  no caption:        {counts.get(NO_CAPTION, 0)} (null score)")
    lines.append(shards.undecodable_line(counts, (OK, NO_CAPTION), "null score"))
    return "\n".join(lines)
