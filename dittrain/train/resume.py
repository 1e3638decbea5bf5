"""A run's own record: what `dittrain run --resume --out RUN` continues with.

config.json (written by every start and resume, dittrain.config's docstring) is the record.
A resume takes its "train" settings and lays over them only what the user set this time (on
the command line or in a --config file), so `--resume --out RUN` alone continues the run as
it was started. A setting that differs from the record is one of three kinds:

- safe: it does not change what is learned (how long, how often to save, log, sample or
  evaluate, where logs go, loader processes, compilation, the device): applied;
- learned: the optimisation itself (lr and its schedule, EMA, clipping, batch, accumulation,
  the seed, data window and bucket remainder, the repeats of mixed stores, loss and timestep options, CFG dropout, precision, REPA's block
  and weight, token routing, LoRA's alpha and dropout): refused with the list of differences unless --allow-changes says so;
- fixed: what the weights or the optimizer state are made of (the model, the objective, the
  optimizer, latent normalisation, REPA's feature set and projector width, which make the
  projector's tensors, LoRA's rank and targets, which make the adapter's): never, a new run is the way (--init-from RUN);
- start: how this command starts (--out, --resume, --init-from), not a setting of the run.

Each field declares its class where it is defined (dittrain.config.setting; a field without one
fails tests/test_train_config.py), with its exceptions: a rule that makes a safe change learned
for this run (--max-steps under a cosine schedule), the field it needs (--repa-depth means
nothing without --repa: refused alone), and whether the start resolves its "auto"
(--latent-norm: the record holds none or channel, so auto given again is no change).

Every applied change is appended to config.json's "history" with the step it took effect
at, so the record says what the run's weights were really trained with.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from ditdata.common.errors import UserError, one_line
from ditdata.common.files import read_json
from dittrain import config
from dittrain.config import SECTION_OF, SECTIONS, TrainConfig


def _meta(name: str) -> dict:
    return _FIELDS[name].metadata


_FIELDS = {f.name: f for cls in SECTIONS.values() for f in fields(cls)}
# the fields of each class, as the definitions in dittrain.config declare them
LEARNED = frozenset(n for n in _FIELDS if _meta(n).get("resume") == config.LEARNED)
FIXED = frozenset(n for n in _FIELDS if _meta(n).get("resume") == config.FIXED)
IGNORED = frozenset(n for n in _FIELDS if _meta(n).get("resume") == config.START)
RESOLVED_AUTO = frozenset(n for n in _FIELDS if _meta(n).get("resolves_auto"))

RECORD = "config.json"


class RecordError(UserError, ValueError):
    """A resume whose settings differ from the run's record in a way it cannot take."""


@dataclass
class Resumption:
    """What a resume changes against the record: {field: (recorded, now)}; `allowed`: the
    learned ones the user let through (--allow-changes)."""

    changes: dict = field(default_factory=dict)
    allowed: frozenset = frozenset()
    history: list = field(default_factory=list)  # the record's history so far

    def entry(self, step: int) -> dict | None:
        """The history entry of this resume, taking effect at `step` (None: nothing changed)."""
        if not self.changes:
            return None
        return {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "changes": {flag(k): {"from": a, "to": b} for k, (a, b) in sorted(self.changes.items())},
                "learned": sorted(flag(k) for k in self.allowed)}

    def history_at(self, step: int) -> list:
        new = self.entry(step)
        return [*self.history, new] if new is not None else list(self.history)


def flag(name: str) -> str:
    """A field's flag as the user types it: --field-name, unless its definition names another
    (--amp is --precision since the flags were named alike)."""
    named = _meta(name).get("flag") if name in _FIELDS else ""
    return named or "--" + name.replace("_", "-")


def config_toml(cfg: TrainConfig) -> str:
    """A TrainConfig as the TOML file `dittrain run --config` reads: its sections as tables, the
    flag names as keys (`dittrain run --print-config`, `dittrain plan --write-config`)."""
    from ditdata.common import configfile

    tables = {section: {flag(f.name)[2:]: getattr(getattr(cfg, section), f.name) for f in fields(cls)}
              for section, cls in SECTIONS.items()}
    return configfile.to_toml(tables, header="dittrain run --config FILE: the settings of one run, by section")


def kind(name: str, recorded: TrainConfig, value=None) -> str:
    """safe | learned | fixed | start (module docstring): the class the field's definition
    declares, learned where its learned_if rule holds for the recorded run, or its learned_when
    rule for the recorded value and `value`, the new one (--latents: other repeats of mixed stores)."""
    meta = _meta(name)
    resume = meta.get("resume")
    if resume is None:
        raise TypeError(f"TrainConfig.{name} declares no resume class (dittrain.config.setting)")
    rule, when = meta.get("learned_if"), meta.get("learned_when")
    if resume == config.SAFE and when is not None and value is not None and when(recorded.flat()[name], value):
        return config.LEARNED
    return config.LEARNED if resume == config.SAFE and rule is not None and rule(recorded) else resume


def load(out: str | Path) -> dict | None:
    """The run's config.json, or None where the directory has none (a new run)."""
    path = Path(out) / RECORD
    try:
        record = read_json(path) if path.exists() else None
    except (OSError, ValueError) as e:
        raise RecordError(f"{path}: cannot read the run's record ({one_line(e)}); restore it (every "
                          "checkpoint holds a copy, under 'config') or start a new --out") from e
    if record is not None and not isinstance(record, dict):
        raise RecordError(f"{path}: not a run record (a JSON object was expected)")
    return record


def settle(options: dict, chosen: set[str], *, allow_changes: bool = False) -> tuple[TrainConfig, Resumption | None]:
    """The TrainConfig of this start (module docstring): the options as given for a new run;
    for a resume of a recorded run, the record with `chosen` options laid over it, refused
    where a change is not allowed. options: every field's value (the command line's);
    chosen: the fields the user set."""
    record = load(options["out"]) if options.get("resume") and options.get("out") else None
    if record is None:
        return _needs_given(TrainConfig.from_flat(**options), chosen), None
    base = TrainConfig.from_record(record.get("train") or {})
    values = base.flat()
    for name in chosen & set(SECTION_OF):
        if not (name in RESOLVED_AUTO and options[name] == "auto"):
            values[name] = options[name]
    values["resume"], values["out"] = True, options["out"]
    if "latents" not in chosen and (record.get("store") or {}).get("path"):
        # the store where the run found it (absolute, or its URL): a resume from another
        # directory than the start's finds it too (several mixed: each, with its repeats)
        values["latents"] = config.latents_of_record(record["store"])
    changes = {n: (base.flat()[n], values[n]) for n in chosen & set(SECTION_OF) - IGNORED
               if base.flat()[n] != values[n]}
    by_kind = {k: sorted(n for n in changes if kind(n, base, values[n]) == k) for k in ("fixed", "learned")}
    if by_kind["fixed"]:
        raise RecordError(f"{options['out']}: {_listed(changes, by_kind['fixed'])} cannot change on a resume (the "
                          "checkpoint's weights and optimizer state are made for the recorded value); leave "
                          "them out to continue, or start a new --out with --init-from " + str(options["out"]))
    if by_kind["learned"] and not allow_changes:
        raise RecordError(f"{options['out']}: this resume changes what is learned: {_listed(changes, by_kind['learned'])}"
                          "; leave them out to continue as recorded, or pass --allow-changes to apply them "
                          "(recorded in config.json's history)")
    cfg = _needs_given(TrainConfig.from_flat(**values), chosen)
    return cfg, Resumption(changes, frozenset(by_kind["learned"]), list(record.get("history") or []))


def _needs_given(cfg: TrainConfig, chosen: set[str]) -> TrainConfig:
    """cfg, unless an option set to other than its default needs another that is not set (e.g.
    --repa-depth without --repa: it would silently do nothing; --print-config's file holds the
    defaults, which are fine)."""
    default, values = TrainConfig().flat(), cfg.flat()
    stray: dict[str, list[str]] = {}
    for n in sorted(chosen & set(_FIELDS)):
        needs = _meta(n).get("needs")
        if needs and values[n] != default[n] and not values[needs]:
            stray.setdefault(needs, []).append(flag(n))
    for needs, flags in stray.items():
        hint = NEEDS_HINT.get(needs, f"set {flag(needs)}")
        raise RecordError(f"{', '.join(flags)} without {flag(needs)}: {hint}, or leave them out")
    return cfg


# what the one line says to do when an option comes without the field it needs
NEEDS_HINT = {"repa": "name the feature set to align to (--repa SET, from `ditdata features`)",
              "lora": "give the adapter's rank (--lora RANK, with --init-from the weights to adapt)"}


def _listed(changes: dict, names: list[str]) -> str:
    return ", ".join(f"{flag(n)} {changes[n][0]!r} -> {changes[n][1]!r}" for n in names)


__all__ = ["FIXED", "LEARNED", "RecordError", "Resumption", "flag", "kind", "load", "settle"]
