"""Score files: what `ditdata score` writes beside each image shard and `ditdata filter`,
`ditdata dedup` and `ditdata encode` read (encode takes each sample's clip_score into its store).

For each finished image shard NNNNN.tar (see ditdata.imageshards.folder), NNNNN.clip.parquet is
written beside it, one row per sample in stored order:

    key              string   the sample key
    clip_score       float64  cosine similarity of the L2-normalised open_clip image and
                              text embeddings (computed in fp32 on the CPU, under bf16
                              autocast on CUDA); null when the sample has no caption
                              (absent, empty or only whitespace) or its image cannot be
                              decoded
    model            string   open_clip model name, e.g. ViT-B-32
    pretrained       string   the pretrained tag (e.g. laion2b_s34b_b79k), the absolute
                              path of the weights file, or null (random init)
    status           string   "ok", "no caption", or why the image could not be decoded
                              (BadImageError.reason, e.g. "truncated image")
    width, height    int32    size of the stored image (null if undecodable)
    original_width,  int32    size of the source image before `ditdata fetch` resized it,
    original_height           as recorded in the sample's json (null if unknown)
    caption_length   int32    characters of the stripped caption (null: no caption)

and, when asked for:

    image_embedding  fixed_size_list<float16>[D]   (--save-embeddings) the L2-normalised
                              open_clip image embedding the score was computed from, stored
                              in float16 (null where clip_score is null); `ditdata dedup`
                              searches these
    aesthetic        float64  (--aesthetic FILE) the LAION aesthetic predictor's score of
                              that embedding (ditdata.scoring.aesthetic; null where clip_score is)

The parquet's schema metadata holds b"ditdata" = JSON {format: "ditdata-clip-scores",
version, shard, shard_bytes, num_samples, model, pretrained, weights_sha256, counts,
created_at}, plus embeddings = {dim, dtype, normalized} (the CLIP model is the file's) and
aesthetic = {file, sha256, kind, widths} when those columns are there. `ditdata filter` reads only these files, never the images again.

Caption sets (`ditdata score --captions SET`, ditdata.imageshards.captionsets): the scores of
set SET's captions go to NNNNN.clip.SET.parquet beside the shard, in the same format, row for row
with the shard and with its caption file (so the scores of several sets can be compared per
sample: the SANA-style pick of the best caption), caption_length being the set's caption's;
their metadata adds captions = {set, sha256 of the caption file scored}. A score file without
"captions" scored the shard's own captions ("alt"), as does NNNNN.clip.parquet.

Writing is atomic (ditdata.imageshards.folder.write_parquet_atomic); read_score_meta trusts
only a complete file of this format and version. read_scores gathers a whole folder's files,
refusing a folder scored by several models or missing what the reader needs.
"""

from __future__ import annotations

import json
from pathlib import Path

from ditdata.common.files import read_json
from ditdata.errors import DitdataError
from ditdata.imageshards import folder as shards
from ditdata.imageshards.captionsets import ALT, check_set_name

FORMAT = "ditdata-clip-scores"
VERSION = 1
SUFFIX = ".clip.parquet"
SKIPPED_SUFFIX = ".clip.skipped.json"  # a damaged shard left out by score --skip-bad-shards
SKIPPED_FORMAT = "ditdata-clip-skipped"
META_KEY = b"ditdata"
OK = "ok"
NO_CAPTION = "no caption"


def score_path(shard_tar, captions: str = ALT) -> Path:
    """NNNNN.tar -> NNNNN.clip.parquet beside it: the scores of the shard's own captions; for
    the caption set `captions` (ditdata.imageshards.captionsets) NNNNN.clip.SET.parquet, the
    same format, its metadata's "captions" naming the set and the caption file it scored."""
    if captions == ALT:
        return shards.beside(shard_tar, SUFFIX)
    check_set_name(captions)
    return shards.beside(shard_tar, f".clip.{captions}.parquet")


def captions_record(shard_tar, captions: str) -> dict:
    """What a score file of caption set `captions` records of the captions it scored: {set,
    sha256 of the shard's caption file} ({set: "alt"} for the shard's own)."""
    if captions == ALT:
        return {"set": ALT}
    from ditdata.common.files import sha256_file
    from ditdata.imageshards.captionsets import caption_set_path

    return {"set": captions, "sha256": sha256_file(caption_set_path(shard_tar, captions))}


def scored_captions(meta: dict) -> dict:
    """The "captions" record of a score file's metadata (files from before caption sets: alt)."""
    return meta.get("captions") or {"set": ALT}


def skipped_path(shard_tar) -> Path:
    """NNNNN.tar -> NNNNN.clip.skipped.json beside it."""
    return shards.beside(shard_tar, SKIPPED_SUFFIX)


def read_skipped(shard_tar) -> dict | None:
    """The record of a shard that score left out, if it is about the shard as it is now."""
    try:
        rec = read_json(skipped_path(shard_tar))
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("format") != SKIPPED_FORMAT:
        return None
    return rec if rec.get("shard_bytes") == Path(shard_tar).stat().st_size else None


EMBEDDING = "image_embedding"
AESTHETIC = "aesthetic"
EMBEDDING_DTYPE = "float16"


def schema(embed_dim: int | None = None, aesthetic: bool = False):
    """The score file's columns; the embedding column (of width embed_dim) and the aesthetic
    column only when asked for."""
    import pyarrow as pa

    columns = [("key", pa.string()), ("clip_score", pa.float64())]
    columns += [(name, pa.string()) for name in ("model", "pretrained", "status")]
    columns += [(name, pa.int32()) for name in ("width", "height", "original_width", "original_height", "caption_length")]
    if aesthetic:
        columns.append((AESTHETIC, pa.float64()))
    if embed_dim is not None:
        columns.append((EMBEDDING, pa.list_(pa.float16(), embed_dim)))
    return pa.schema(columns)


def embedding_column(embedded: dict, n: int, dim: int):
    """{row: (D,) embedding} of n rows -> a float16 fixed-size-list pyarrow column (null
    where a row has none; its slots hold zeros)."""
    import numpy as np
    import pyarrow as pa

    emb = np.zeros((n, dim), np.float16)
    valid = np.zeros(n, bool)
    for i, e in embedded.items():
        emb[i], valid[i] = e, True
    values = pa.array(emb.reshape(-1), type=pa.float16())
    return pa.FixedSizeListArray.from_arrays(values, dim, mask=pa.array(~valid))


def read_embeddings(path, num_rows: int, dim: int):
    """(N, D) float16 embeddings of a score file (zeros where null) and the (N,) bool mask of
    the rows that have one."""
    import numpy as np
    import pyarrow.parquet as pq

    col = pq.read_table(path, columns=[EMBEDDING]).column(EMBEDDING).combine_chunks()
    valid = ~np.asarray(col.is_null().to_numpy(zero_copy_only=False), bool)
    flat = col.values.to_numpy(zero_copy_only=False)  # null slots hold the zeros written there
    return np.asarray(flat, np.float16).reshape(num_rows, dim), valid


def read_score_meta(path) -> dict | None:
    """The metadata of a complete score file, or None when it is missing, unreadable,
    truncated or not ours (a killed or damaged file is never trusted)."""
    return shards.read_parquet_meta(path, META_KEY, FORMAT, VERSION)


def write_scores(path, rows: dict, meta: dict) -> None:
    """Write one score file atomically: `rows` maps the schema's columns to lists."""
    import pyarrow as pa

    path = Path(path)
    dim = meta.get("embeddings", {}).get("dim") if EMBEDDING in rows else None
    sch = schema(dim, AESTHETIC in rows).with_metadata({META_KEY: json.dumps(meta, sort_keys=True).encode()})
    table = pa.Table.from_pydict({f.name: rows[f.name] for f in sch}, schema=sch)
    shards.write_parquet_atomic(path, table)

COLUMNS = ("key", "clip_score", "status", "width", "height", "original_width", "original_height",
           "caption_length")


# ----------------------------------------------------------------------------- a folder's scores


NEEDS = {  # what a reader may need beyond COLUMNS: (score file metadata key, the score flag that makes it)
    "aesthetic": ("aesthetic", "--aesthetic FILE"),
    "embeddings": ("embeddings", "--save-embeddings"),
}


def read_scores(shards_dir, needs: tuple[str, ...] = (), captions: str = ALT):
    """All score files of a scored image-shard folder as one pyarrow Table (COLUMNS plus
    `shard`, and the aesthetic column when "aesthetic" is in `needs`), and the shared
    {model, pretrained, weights_sha256, aesthetic, embeddings, tars}. DitdataError when a
    finished shard has no (or a stale) score file, shards were scored by different models
    or predictors, or a shard lacks what `needs` names ("aesthetic", "embeddings": the one
    line says which `ditdata score` flag to rerun with). `captions`: the scores of that caption
    set (NNNNN.clip.SET.parquet; stale when its caption file changed since)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = Path(shards_dir)
    tars = shards.read_folder(d).shards
    if not tars:
        raise DitdataError(f"{d}: no image shards")
    missing, stale, idents, skipped = [], [], {}, []
    metas: dict[str, dict] = {}
    flag = "" if captions == ALT else f" --captions {captions}"
    for tar in tars:
        sp = score_path(tar, captions)
        meta = read_score_meta(sp)
        if meta is None:
            rec = read_skipped(tar)  # left out by `ditdata score --skip-bad-shards`
            if rec is not None:
                skipped.append({k: rec.get(k) for k in ("shard", "reason", "samples_lost")})
            else:
                missing.append(tar.name)
            continue
        if meta.get("shard_bytes") != tar.stat().st_size or not _captions_current(tar, captions, meta):
            stale.append(tar.name)
            continue
        ident = (meta.get("model"), meta.get("pretrained"), meta.get("weights_sha256"))
        idents.setdefault(ident, []).append(tar.name)
        metas[tar.name] = meta
    if missing:
        raise DitdataError(
            f"{d}: {len(missing)} of {len(tars)} shards have no complete CLIP scores (first: {missing[0]}); "
            f"run `ditdata score {d} --clip MODEL --pretrained TAG_OR_FILE{flag}` first"
        )
    if stale:
        raise DitdataError(
            f"{d}: the scores of {len(stale)} shard(s) (first: {stale[0]}) were made for a different "
            f"version of the shard or of its captions; rerun `ditdata score{flag}` on the folder"
        )
    if len(idents) > 1:
        desc = "; ".join(f"{m} / {p} ({len(v)} shards)" for (m, p, _), v in idents.items())
        raise DitdataError(f"{d}: shards were scored by different CLIP models: {desc}; rescore with one model (--overwrite)")
    if not idents:
        raise DitdataError(f"{d}: every shard was left out as damaged by `ditdata score`; refetch them")
    predictor = _check_needs(d, metas, needs)
    tables = []
    for name in metas:
        t = pq.read_table(score_path(d / name, captions), columns=list(COLUMNS) + (["aesthetic"] if "aesthetic" in needs else []))
        tables.append(t.append_column("shard", pa.array([name] * t.num_rows, pa.string())))
    (model, pretrained, sha), = idents
    first = next(iter(metas.values()))
    return pa.concat_tables(tables), {"model": model, "pretrained": pretrained, "weights_sha256": sha,
                                      "skipped_shards": skipped, "aesthetic": predictor,
                                      "embeddings": first.get("embeddings"), "metas": metas,
                                      "captions": captions}


def score_file_current(tar: Path, captions: str, meta: dict) -> bool:
    """Whether a score file (its metadata `meta`) of caption set `captions` was made for shard `tar`
    as it is now and for the captions the set holds now (what read_scores calls not stale)."""
    return meta.get("shard_bytes") == Path(tar).stat().st_size and _captions_current(Path(tar), captions, meta)


def _captions_current(tar: Path, captions: str, meta: dict) -> bool:
    """Whether a score file scored the captions the shard has now (always, for "alt": they
    are in the tar, whose size is checked)."""
    if captions == ALT:
        return True
    try:
        return scored_captions(meta) == captions_record(tar, captions)
    except OSError:  # the caption file is gone
        return False


def _check_needs(d: Path, metas: dict[str, dict], needs: tuple[str, ...]) -> dict | None:
    """DitdataError when a scored shard lacks what `needs` names (the line names the flag to
    rerun `ditdata score` with) or shards hold aesthetic scores of different predictors;
    returns the one predictor's record (None without "aesthetic" in `needs`)."""
    for n in needs:
        key, flag = NEEDS[n]
        names = [name for name, meta in metas.items() if not meta.get(key)]
        if names:
            raise DitdataError(
                f"{d}: {len(names)} of {len(metas)} scored shards were scored without {flag} (first: "
                f"{names[0]}); rerun `ditdata score {d} --clip MODEL --pretrained TAG_OR_FILE {flag}` "
                f"(the same model; only those shards are scored again)"
            )
    if "aesthetic" not in needs:
        return None
    predictors = {m["aesthetic"].get("sha256"): m["aesthetic"] for m in metas.values()}
    if len(predictors) > 1:
        files = ", ".join(sorted(str(p.get("file")) for p in predictors.values()))
        raise DitdataError(f"{d}: shards hold aesthetic scores of different predictors ({files}); rescore with "
                           f"one (ditdata score --aesthetic FILE --overwrite)")
    return next(iter(predictors.values()))
