"""Caption sets in a store: several captions per image, each embedded unpadded.

`ditdata encode --text-encoder NAME --captions alt,recap,...` embeds every named caption set of
the image shards (ditdata.imageshards.captionsets; "alt" is the shards' own captions). The
FIRST set keeps the fields a store with one set has; each further set NAME gets the same fields
with ".NAME" after them:

    first set           set NAME
    text_tokens         text_tokens.NAME         ragged (W,), the first set's dtype
    text_tokens_scale   text_tokens_scale.NAME   ragged (), float32: int8 tokens' per-token scales
    text_length         text_length.NAME         () int32: its captions' token counts
    caption             caption.NAME             string column: the caption embedded ("" for none)
    clip_score          clip_score.NAME          float64 column: its CLIP score (null: none), only
                                                 where score files existed (ditdata score --captions)

The manifest's conditioning.text.caption_sets lists them in order, each as {name, tokens, scale
(null unless int8), length, caption, clip_score (null: no scores), clip: {model, pretrained,
weights_sha256} of the scores (null: none), scored_shards: how many image shards had scores}. A
store without that list (no --captions) holds one set: its first fields, named by
conditioning.text.caption_set, else "alt". `caption_sets(store)` reads either.

CaptionsView is a store read with several of its sets joined (what dittrain's --caption-mix
hands its loaders, `open_store(..., captions=("alt", "recap"))`): its ragged `text_tokens`
(and `text_tokens_scale`) hold, per sample, the named sets' tokens one after the other,
`text_length` their sum, `caption_lengths` (K,) int32 each set's count and `caption_scores` (K,)
float32 each set's CLIP score (NaN: none), K the number of sets named, in the order named. Every
other field reads as in the store. A loader takes it like any store with unpadded text; the
trainer picks one set per sample from the joined tokens (dittrain.train.captionmix).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .errors import StoreError
from .reader import Store, StoreView
from .schema import TEXT_LENGTH, RaggedSpec, Schema, TensorSpec, offsets_of, scale_field

TOKENS = "text_tokens"
CAPTION = "caption"
CLIP_SCORE = "clip_score"
ALT = "alt"  # the shards' own captions (ditdata.imageshards.captionsets.ALT)
# the CaptionsView's per-sample fields beside its joined tokens
LENGTHS = "caption_lengths"
SCORES = "caption_scores"
MIX_FIELDS = (LENGTHS, SCORES)


def set_field(field: str, name: str, first: bool) -> str:
    """The store field or column `field` (text_tokens, text_length, caption, ...) of caption set
    `name`: the field itself for the first set, FIELD.NAME for the others."""
    return field if first else f"{field}.{name}"


def set_fields(name: str, first: bool, *, int8: bool, scored: bool) -> dict:
    """The manifest's record of set `name` without its CLIP model: where its values live."""
    tokens = set_field(TOKENS, name, first)
    return {"name": name, "tokens": tokens, "scale": scale_field(tokens) if int8 else None,
            "length": set_field(TEXT_LENGTH, name, first), "caption": set_field(CAPTION, name, first),
            "clip_score": set_field(CLIP_SCORE, name, first) if scored else None}


@dataclass(frozen=True)
class CaptionSet:
    """One caption set of a store, as its manifest records it (module docstring)."""

    name: str
    tokens: str
    length: str
    caption: str
    scale: str | None = None
    clip_score: str | None = None
    clip: dict | None = None
    scored_shards: int = 0


def caption_sets(store: Store) -> list[CaptionSet]:
    """The store's caption sets in order (the first is the one a plain loader reads); [] for a
    store without unpadded text tokens."""
    text = store.conditioning.text or {}
    if store.conditioning.kind != "text" or TOKENS not in store.schema.ragged:
        return []
    listed = text.get("caption_sets")
    if listed:
        return [CaptionSet(**{k: v for k, v in s.items() if k in CaptionSet.__dataclass_fields__}) for s in listed]
    ragged = store.schema.ragged
    scale = scale_field(TOKENS)
    return [CaptionSet(text.get("caption_set") or ALT, TOKENS, TEXT_LENGTH, CAPTION,
                       scale if scale in ragged else None,
                       CLIP_SCORE if CLIP_SCORE in store.schema.columns else None)]


def caption_set_faults(store: Store) -> list[str]:
    """What verify finds wrong with the caption sets the manifest lists: a field or column it names
    that the store does not hold (with the right kind), or the first set not on the plain fields."""
    listed = ((store.conditioning.text or {}).get("caption_sets")) or []
    schema, faults, where = store.schema, [], store.location
    for i, s in enumerate(caption_sets(store) if listed else []):
        if (i == 0) != (s.tokens == TOKENS):
            faults.append(f"{where}: caption set {s.name!r} is listed {'first' if i == 0 else 'later'} but its tokens "
                          f"are {s.tokens!r}")
        checks = [(s.tokens, s.tokens in schema.ragged), (s.length, schema.tensors.get(s.length) == TensorSpec((), "int32")),
                  (s.caption, schema.columns.get(s.caption) == "string")]
        if s.scale:
            checks.append((s.scale, s.scale in schema.ragged))
        if s.clip_score:
            checks.append((s.clip_score, schema.columns.get(s.clip_score) == "float64"))
        faults += [f"{where}: the manifest's caption set {s.name!r} names {f!r}, which the store's fields do not "
                   "hold as such" for f, ok in checks if not ok]
        if s.tokens in schema.ragged and schema.ragged[s.tokens].length != s.length:
            faults.append(f"{where}: caption set {s.name!r}: {s.tokens!r} is counted by "
                          f"{schema.ragged[s.tokens].length!r}, not by its length field {s.length!r}")
    return faults


def describe_caption_sets(store: Store) -> list[str]:
    """`ditdata inspect`'s lines for a store with several caption sets (none for one set): each set
    with its caption lengths and whether (by which CLIP model, on how many shards) it is scored."""
    listed = ((store.conditioning.text or {}).get("caption_sets")) or []
    if len(listed) < 2:
        return []
    lengths = store.manifest.get("ragged") or {}
    lines = [f"  caption sets: {len(listed)} per image, each embedded (the first on the plain text fields; "
             "dittrain run --caption-mix draws one per sample)"]
    for s in caption_sets(store):
        ln = lengths.get(s.length) or {}
        tokens = f"tokens mean {ln['mean']}, p95 {ln['p95']}, max {ln['max']}" if ln.get("count") else "no tokens"
        clip = s.clip or {}
        scored = (f"CLIP scores ({s.clip_score}) by {clip.get('model')}/{clip.get('pretrained')} on "
                  f"{s.scored_shards} shard(s)" if s.clip_score else "no CLIP scores")
        lines.append(f"    {s.name:<12} {s.tokens}: {tokens}; {scored}")
    return lines


class CaptionsView(StoreView):
    """A store read with caption sets `names` joined per sample (module docstring). The same store
    (shards, identity, conditioning's encoder and empty caption); its schema's text fields are the
    joined ones, and its manifest's caption length statistics and tokens_shape are those of the
    joined tokens (what a loader sizes its memory by). A bucketed store's buckets are viewed alike."""

    def __init__(self, base: Store, names):
        super().__init__(base)
        names = tuple(names)
        have = {s.name: s for s in caption_sets(base)}
        if not have:
            raise StoreError(f"{base.location}: no unpadded text tokens (ditdata encode --text-encoder T5/Gemma), "
                             "so no caption sets to join")
        missing = [n for n in names if n not in have]
        if missing or not names or len(set(names)) != len(names):
            what = f"no caption set {', '.join(missing)}" if missing else f"caption sets {list(names)}: name each once"
            raise StoreError(f"{base.location}: {what}; it holds {', '.join(have)}")
        self.caption_names = names
        self.sets = [have[n] for n in names]
        first = base.schema.ragged[TOKENS]
        for s in self.sets:  # a store's sets are made in one pass: the same width and dtype
            spec = base.schema.ragged.get(s.tokens)
            if spec is None or spec.shape != first.shape or spec.dtype != first.dtype:
                raise StoreError(f"{base.location}: caption set {s.name}'s field {s.tokens} is missing or unlike "
                                 f"{TOKENS} (recorded in the manifest, not in its fields)")
        K = len(self.sets)
        tensors = {k: v for k, v in base.schema.tensors.items() if k not in {s.length for s in have.values()}}
        tensors |= {TEXT_LENGTH: TensorSpec((), "int32"), LENGTHS: TensorSpec((K,), "int32"),
                    SCORES: TensorSpec((K,), "float32")}
        ragged = {TOKENS: RaggedSpec(first.shape, first.dtype, TEXT_LENGTH)}
        if first.dtype == "int8":
            ragged[scale_field(TOKENS)] = RaggedSpec((), "float32", TEXT_LENGTH)
        rest = {k: v for k, v in base.schema.ragged.items() if v.length not in {s.length for s in have.values()}}
        self.schema = Schema(tensors=tensors, columns=dict(base.schema.columns), ragged={**rest, **ragged})
        self.manifest = self._joined_manifest(base.manifest)
        self._conditioning = None  # the base's decoded one came with its __dict__: decode the joined manifest
        if base.buckets:  # each bucket's plain store, viewed alike
            self.buckets = tuple(replace(b, store=CaptionsView(b.store, names)) for b in base.buckets)

    def _joined_manifest(self, m: dict) -> dict:
        """The manifest with the joined tokens' length statistics and tokens_shape (what the loaders
        size slots and budgets by); the store's own is `base.manifest`."""
        stats = [(m.get("ragged") or {}).get(s.length) or {} for s in self.sets]
        joined = {"count": min((int(s.get("count") or 0) for s in stats), default=0)}
        if all(s.get("count") for s in stats):
            joined |= {"mean": round(sum(float(s["mean"]) for s in stats), 2), "min": sum(int(s["min"]) for s in stats),
                       "max": sum(int(s["max"]) for s in stats)}
        text = dict((m.get("conditioning") or {}).get("text") or {})
        if text.get("tokens_shape"):
            text["tokens_shape"] = [int(text["tokens_shape"][0]) * len(self.sets), int(text["tokens_shape"][1])]
        return {**m, "ragged": {**(m.get("ragged") or {}), TEXT_LENGTH: joined},
                "conditioning": {**m["conditioning"], "text": text}}

    @property
    def identity(self) -> str:
        return self.base.identity

    def open_args(self) -> dict:
        return {**self.base.open_args(), "captions": list(self.caption_names)}

    def read(self, shard, fields=None, start: int = 0, stop: int | None = None) -> dict[str, np.ndarray]:
        s = self.base.shard(shard)
        fields = self._fields(fields)  # checked against the joined schema
        mine = {TOKENS, scale_field(TOKENS), TEXT_LENGTH, LENGTHS, SCORES}
        rest = [f for f in fields if f not in mine]
        want = [f for f in fields if f in mine]
        tokens = TOKENS in want or scale_field(TOKENS) in want
        if tokens:  # the joined tokens come with their length field
            want.append(TEXT_LENGTH)
        base_fields = [s_.length for s_ in self.sets]
        if tokens:
            base_fields += [s_.tokens for s_ in self.sets] + [s_.scale for s_ in self.sets if s_.scale]
        if SCORES in want:
            base_fields += [s_.clip_score for s_ in self.sets if s_.clip_score]
        data = self.base.read(s, list(dict.fromkeys(rest + base_fields)), start, stop) if rest or want else {}
        out = {f: data[f] for f in rest}
        if not want:
            return out
        lengths = np.stack([np.asarray(data[s_.length], dtype=np.int64) for s_ in self.sets], axis=1)
        if LENGTHS in want:
            out[LENGTHS] = lengths.astype(np.int32)
        if TEXT_LENGTH in want:
            out[TEXT_LENGTH] = lengths.sum(axis=1).astype(np.int32)
        if tokens:
            order = _joined_order(lengths)
            out[TOKENS] = np.concatenate([data[s_.tokens] for s_ in self.sets])[order]
            if self.sets[0].scale:
                out[scale_field(TOKENS)] = np.concatenate([data[s_.scale] for s_ in self.sets])[order]
        if SCORES in want:
            n = len(lengths)
            out[SCORES] = np.stack([np.asarray(data[s_.clip_score], dtype=np.float64) if s_.clip_score
                                    else np.full(n, np.nan) for s_ in self.sets], axis=1).astype(np.float32)
        return out


def _joined_order(lengths: np.ndarray) -> np.ndarray:
    """(n, K) token counts of K sets -> the rows of the K sets' token arrays concatenated (set
    after set, each sample after sample) that give every sample's K sets one after the other."""
    n, K = lengths.shape
    per_set = [offsets_of(lengths[:, k]) for k in range(K)]
    base = np.cumsum([0] + [int(o[-1]) for o in per_set])[:-1]  # where set k's rows start
    starts = np.stack([base[k] + per_set[k][:-1] for k in range(K)], axis=1).reshape(-1)
    counts = lengths.reshape(-1)
    total = int(counts.sum())
    return np.repeat(starts - offsets_of(counts)[:-1], counts) + np.arange(total, dtype=np.int64)


__all__ = ["CAPTION", "CLIP_SCORE", "LENGTHS", "MIX_FIELDS", "SCORES", "CaptionSet", "CaptionsView",
           "caption_set_faults", "caption_sets", "describe_caption_sets", "set_field", "set_fields"]
