"""--caption-mix: which caption set each sample's text is, from a store with several of them
(`ditdata encode --text-encoder T5/Gemma --captions alt,recap,...`, ditdata.store.captions).

    mix = resolve(cfg, store)                 # None: the store's first set, as a plain run reads it
    loader_store = mix.view(store)            # the sets joined per sample (ditdata.store.CaptionsView)
    batch = mix.pick(batch, k, global_batch, rows)   # in the step: each sample's set, its tokens and mask

The loaders carry every mixed set's tokens, one after the other per sample, with each set's length
and CLIP score (caption_lengths, caption_scores); the step draws one set per sample and keeps its
tokens (padded to the batch's longest chosen caption, mask True at real tokens). Caption dropout
then acts on the chosen caption as on a plain run's.

Rules (the --caption-mix value):

  SET=W,...     fixed proportions: set i with probability W_i / sum(W) (SANA's caption_proportion,
                its weighted_sample_fix_prob), e.g. alt=0.2,recap=0.8.
  clip-score[:temperature=T,threshold=S]
                SANA's CLIP-score rule, as its code has it (NVlabs/Sana @ aa1b69a,
                diffusion/data/datasets/sana_data.py, SanaWebDataset.weighted_sample_clipscore):
                the candidates are the sets whose CLIP score of this image is at least S; each is
                drawn with probability score ** (1 / max(T, 0.01)), normalised over them; with no
                candidate the set with the highest score is taken (the first of equal ones), and
                with no score at all the store's first set (SANA's default "prompt"). T and S
                default to SANA's released training configs (clip_thr_temperature 0.1,
                clip_thr 25.0, configs/sana_config/*/Sana_*.yaml @ 28af99f), S on ditdata's cosine
                scale: 25.0 / 100 = 0.25. The sets drawn from are the store's first and every
                scored one; all must be scored by one CLIP model. docs/papers.md has what matches.

Draws: for the loader's batch k (the micro-batches drawn so far, which a resume restores) a
generator on the training device seeded by (run seed, k) draws one uniform u per row of the
GLOBAL micro-batch; this rank keeps its rows (rank x per-rank batch + row), so one process and N
ranks draw alike. The set is the first i with u x total < cumsum(w)_i (random.choices' bisect,
which SANA calls), so a resumed run draws the same sets as an uninterrupted one (on the same device
type: CPU and CUDA generators differ).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ditdata.common.errors import UserError
from ditdata.store import StoreError
from ditdata.store.captions import LENGTHS, SCORES, CaptionsView, caption_sets

CLIP_SCORE = "clip-score"
# SANA's released training configs (configs/sana_config/*/Sana_*.yaml): clip_thr_temperature 0.1,
# clip_thr 25.0 on its 100 x cosine scale, i.e. 0.25 on ditdata's (ditdata score: the cosine)
TEMPERATURE = 0.1
THRESHOLD = 0.25
MIN_TEMPERATURE = 0.01  # SANA: max(clip_thr_temperature, 0.01)
_TAG = 0x6361_7074  # keeps these draws apart from the run's other seeded streams


class CaptionMixError(UserError, ValueError):
    """--caption-mix cannot be read or does not fit the store (one line)."""


@dataclass(frozen=True)
class Rule:
    """A parsed --caption-mix: fixed `weights` {set: w} (in the order given), or the CLIP-score rule."""

    weights: dict | None = None
    temperature: float = TEMPERATURE
    threshold: float = THRESHOLD

    @property
    def clip_score(self) -> bool:
        return self.weights is None


def parse(value: str) -> Rule | None:
    """--caption-mix as given -> a Rule (None for ""); CaptionMixError names what is wrong."""
    value = (value or "").strip()
    if not value:
        return None
    head, _, params = value.partition(":")
    if head.strip() == CLIP_SCORE:
        got = {"temperature": TEMPERATURE, "threshold": THRESHOLD}
        for part in filter(None, (p.strip() for p in params.split(","))):
            key, eq, number = part.partition("=")
            if key.strip() not in got or not eq:
                raise CaptionMixError(f"--caption-mix {value}: {part!r}; clip-score takes temperature=T and "
                                      "threshold=S, e.g. clip-score:temperature=0.1,threshold=0.25")
            got[key.strip()] = _number(value, number)
        if got["temperature"] <= 0 or got["threshold"] < 0:
            raise CaptionMixError(f"--caption-mix {value}: the temperature must be > 0 and the threshold >= 0 (CLIP "
                                  "scores below 0 are never drawn)")
        return Rule(None, got["temperature"], got["threshold"])
    weights = {}
    for part in value.split(","):
        name, eq, number = part.strip().partition("=")
        if not name or not eq:
            raise CaptionMixError(f"--caption-mix {value}: {part.strip()!r} is not SET=WEIGHT; give SET=W,... "
                                  "(alt=0.2,recap=0.8) or clip-score")
        if name in weights:
            raise CaptionMixError(f"--caption-mix {value}: set {name} is named twice")
        weights[name] = _number(value, number)
        if weights[name] < 0:
            raise CaptionMixError(f"--caption-mix {value}: the weight of {name} is negative")
    if not sum(weights.values()) > 0:
        raise CaptionMixError(f"--caption-mix {value}: the weights add up to 0; give at least one set a weight > 0")
    return Rule(weights)


def _number(value: str, text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not math.isfinite(x):
        raise CaptionMixError(f"--caption-mix {value}: {text.strip()!r} is not a finite number")
    return x


class CaptionMix:
    """A run's --caption-mix on its store: the sets it joins (`names`, the view's order), its rule, the
    draws and the pick (module docstring)."""

    def __init__(self, rule: Rule, names: list[str], seed: int, record: dict):
        self.rule, self.names, self.seed, self.record = rule, list(names), int(seed), record
        self._weights: dict = {}  # device -> the fixed weights there
        self._gens: dict = {}  # device -> its generator, seeded again for every batch

    def view(self, store):
        """What the loader reads: `store` with the mixed sets joined (ditdata.store.CaptionsView)."""
        return CaptionsView(store, self.names)

    def describe(self) -> str:
        """The startup line."""
        if self.rule.clip_score:
            return (f"caption mix: SANA's CLIP-score rule over {', '.join(self.names)} (weights = score ** "
                    f"(1/{self.rule.temperature:g}) over the sets scoring >= {self.rule.threshold:g}; else the "
                    f"best-scored set; no score: {self.names[0]})")
        total = sum(self.rule.weights.values())
        return "caption mix: " + ", ".join(f"{n} {self.rule.weights[n] / total:.0%}" for n in self.names) + \
            " of the samples (drawn per sample per step)"

    def uniforms(self, k: int, n: int, device) -> torch.Tensor:
        """(n,) float32 uniforms of the loader's batch k: one per row of the global micro-batch."""
        device = torch.device(device)
        gen = self._gens.get(device)
        if gen is None:
            gen = self._gens[device] = torch.Generator(device=device)
        seed = int(np.random.SeedSequence([self.seed, _TAG, int(k)]).generate_state(1, np.uint64)[0])
        gen.manual_seed(seed)
        return torch.rand(n, generator=gen, device=device)

    def weights(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(w (B, K) the draw's weights, fallback (B,) the set taken where no weight is > 0) of a batch's
        CLIP scores (B, K) (NaN: none)."""
        B, K = scores.shape
        if not self.rule.clip_score:
            dev = scores.device
            if dev not in self._weights:
                self._weights[dev] = torch.tensor([self.rule.weights[n] for n in self.names], dtype=torch.float32,
                                                  device=dev)
            w = self._weights[dev].expand(B, K)
            return w, torch.zeros(B, dtype=torch.long, device=dev)
        finite = torch.isfinite(scores)
        candidate = finite & (scores >= self.rule.threshold)
        power = 1.0 / max(self.rule.temperature, MIN_TEMPERATURE)
        w = torch.where(candidate, scores.clamp_min(0).pow(power), torch.zeros_like(scores))
        # no candidate: the highest score (the first of equal ones, as SANA's strict >); no score: set 0.
        # Candidates whose weights are all 0 (scores of exactly 0 with threshold 0: SANA's 0/0 weights make
        # random.choices fail, and its loader skips to another image) are taken as no candidate.
        best = torch.where(finite, scores, torch.full_like(scores, -math.inf)).argmax(1)
        fallback = torch.where(finite.any(1), best, torch.zeros_like(best))
        return w, torch.where((w > 0).any(1), torch.full_like(best, -1), fallback)

    def choose(self, u: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """(B,) int64: each row's set, from its uniform u (B,) and CLIP scores (B, K)."""
        w, fallback = self.weights(scores)
        cum = torch.cumsum(w, 1)
        x = (u.to(cum.dtype) * cum[:, -1])[:, None]
        drawn = (cum <= x).sum(1)  # bisect_right(cum, u * total)
        # random.choices' hi = n - 1 of the candidates: at most the last set with a weight (u x total rounded up)
        K = w.shape[1]
        last = K - 1 - torch.flip(w > 0, (1,)).to(torch.int32).argmax(1)
        drawn = torch.minimum(drawn, last)
        if not self.rule.clip_score:
            return drawn
        return torch.where(fallback >= 0, fallback, drawn)

    def pick(self, batch: dict, k: int, global_batch: int, rows: slice) -> dict:
        """The batch with each sample's drawn set: text_tokens (B, L, W) and text_mask (B, L), L the
        longest chosen caption, zero at padding; the joined fields (caption_lengths, caption_scores)
        taken out. k: the loader's batch index; rows: this rank's rows of the global micro-batch."""
        out = dict(batch)
        lengths, scores = out.pop(LENGTHS).long(), out.pop(SCORES).float()
        tokens = out["text_tokens"]
        u = self.uniforms(k, global_batch, tokens.device)[rows]
        choice = self.choose(u, scores)
        starts = (torch.cumsum(lengths, 1) - lengths).gather(1, choice[:, None])[:, 0]
        n = lengths.gather(1, choice[:, None])[:, 0]
        L = int(n.max()) if len(n) else 0  # one host read; the loaders' padding already waits for the batch
        pos = torch.arange(L, device=tokens.device)
        mask = pos[None, :] < n[:, None]
        idx = (starts[:, None] + pos[None, :]).clamp_max(max(tokens.shape[1] - 1, 0))
        x = tokens.gather(1, idx[..., None].expand(-1, -1, tokens.shape[-1]))
        out["text_tokens"] = torch.where(mask[..., None], x, torch.zeros((), dtype=x.dtype, device=x.device))
        out["text_mask"] = mask
        return out


def resolve(cfg, store, others=()) -> CaptionMix | None:
    """The run's --caption-mix on `store`: None for "" (the store's first set); else a CaptionMix whose
    `record` the run config keeps. CaptionMixError (one line) for a value that cannot be read, a store
    without caption sets, a set it does not hold, or a CLIP-score rule without comparable scores.
    `others`: the run's other stores (several --latents), which must hold the same sets."""
    mix = _resolve(cfg, store)
    for other in others if mix is not None else ():
        try:
            mix.view(other)
        except StoreError as e:
            raise CaptionMixError(f"--caption-mix {cfg.data.caption_mix}: {e}") from e
    return mix


def _resolve(cfg, store) -> CaptionMix | None:
    rule = parse(cfg.data.caption_mix)
    if rule is None:
        return None
    flag = f"--caption-mix {cfg.data.caption_mix}"
    sets = caption_sets(store)
    if not sets:
        raise CaptionMixError(f"{flag}: {store.location} has no unpadded caption tokens to choose from (ditdata encode "
                              "--text-encoder t5-v1_1-xxl|gemma-2-2b --captions alt,SET,... makes a store with several)")
    held = [s.name for s in sets]
    if not rule.clip_score:
        missing = [n for n in rule.weights if n not in held]
        if missing:
            raise CaptionMixError(f"{flag}: the store has no caption set {', '.join(missing)}; it holds "
                                  f"{', '.join(held)} (ditdata encode --captions names them)")
        names = list(rule.weights)
        total = sum(rule.weights.values())
        record = {"rule": "proportions", "sets": names, "weights": [rule.weights[n] / total for n in names]}
        return CaptionMix(rule, names, cfg.optim.seed, record)
    scored = [s for s in sets if s.clip_score]
    if not scored:
        raise CaptionMixError(f"{flag}: none of the store's caption sets ({', '.join(held)}) has CLIP scores; run "
                              "`ditdata score SHARDS --captions SET` for each before `ditdata encode`, or give "
                              "proportions (SET=W,...)")
    models = {str(s.clip): s.name for s in scored}
    if len(models) > 1:
        raise CaptionMixError(f"{flag}: the sets were scored by different CLIP models ("
                              + "; ".join(f"{s.name}: {(s.clip or {}).get('model')}/{(s.clip or {}).get('pretrained')}"
                                          for s in scored) + "), whose scores do not compare; score them with one")
    names = [sets[0].name] + [s.name for s in scored if s.name != sets[0].name]
    record = {"rule": CLIP_SCORE, "sets": names, "temperature": rule.temperature, "threshold": rule.threshold,
              "scored": [s.name for s in scored], "clip": scored[0].clip}
    return CaptionMix(rule, names, cfg.optim.seed, record)


__all__ = ["CLIP_SCORE", "THRESHOLD", "TEMPERATURE", "CaptionMix", "CaptionMixError", "Rule", "parse", "resolve"]
