"""LoRA (Hu et al., 2021) on a DiT, through peft: which linears take an adapter, the adapter put in
(the base frozen), the adapter's tensors alone as a state dict, and the merged plain weights. No I/O.

    names = target_names(model, "attn.qkv,mlp.fc1")   the nn.Linear modules the patterns match
    inject(model, LoraSettings(rank=16, ...))          peft's LoRA layers on them; only they train
    adapter_state(model) / load_adapter(model, s)      {"blocks.0.attn.qkv.lora_A.weight": ...}
    merged_state(model)                                 the DiT's own keys, W + (alpha / r) B A folded in

The layers are peft's own (peft.inject_adapter_in_model: the module stays our DiT, its forward,
checkpointing and regional compile unchanged; each targeted nn.Linear becomes peft's lora.Linear,
whose base weights sit under `.base_layer`). The adapter keys are peft's saved names without
PeftModel's "base_model.model." prefix and without the adapter name, so `dittrain export --merge-lora`
writes them as peft's adapter_model.safetensors by adding that prefix (dittrain.inference.export).

Targets (--lora-targets): comma-separated patterns, each matched against the full names of the
model's nn.Linear modules as peft matches a target_modules list (the name itself, or a name ending in
"." + pattern), or, when it holds regular-expression characters, as peft matches a target_modules
string (re.fullmatch of the full name), e.g. `blocks\\.(2[0-7])\\.attn\\.qkv`. peft receives the
resolved full names, so what trains is exactly what the patterns listed.

The default adapts every block's attention (self and cross) and MLP linears: what diffusers' LoRA
scripts for DiT-family transformers target (the SD3/Flux/SANA DreamBooth LoRA scripts: attention's
q/k/v/out, and the feed-forward's linears in Flux's), in our names: DiT's fused qkv and its
projection, the cross-attention's q, kv and projection (text runs), and the MLP's fc1 and fc2.
Not targeted: adaLN modulation, the embedders and the final layer (the conditioning paths the
pretrained model's calibration lives in; name them to adapt them too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ditdata.common.errors import UserError
from dittrain.config import LORA_TARGETS as DEFAULT_TARGETS  # attention (self and cross) and MLP linears

ADAPTER = "default"  # peft's adapter name (the one it gives when none is named)
_REGEX = re.compile(r"[\\^$*+?()\[\]{}|]")  # a pattern with any of these is a regular expression


class LoraError(UserError, ValueError):
    """LoRA settings that cannot apply to this model (one line)."""


@dataclass(frozen=True)
class LoraSettings:
    """One adapter: rank r, alpha (0: r, so the scale alpha / r is 1, as diffusers' scripts set it),
    dropout on the adapter's input, and the target patterns."""

    rank: int
    alpha: float = 0.0
    dropout: float = 0.0
    targets: str = DEFAULT_TARGETS

    @property
    def scale_alpha(self) -> float:
        return float(self.alpha or self.rank)


def settings_of(section) -> LoraSettings | None:
    """The LoraSettings of a run config's lora section (dittrain.config.LoraSection, or a recorded
    dict of it); None when LoRA is off (rank 0)."""
    get = section.get if isinstance(section, dict) else lambda k, d=None: getattr(section, k, d)
    rank = get("lora", 0) or 0
    if not rank:
        return None
    return LoraSettings(int(rank), float(get("lora_alpha", 0.0) or 0.0), float(get("lora_dropout", 0.0) or 0.0),
                        str(get("lora_targets", DEFAULT_TARGETS) or DEFAULT_TARGETS))


def check(settings: LoraSettings) -> None:
    """LoraError for a rank, alpha or dropout that cannot be (before any model is built)."""
    if settings.rank < 0:
        raise LoraError(f"--lora {settings.rank}: the rank must be a positive integer (0: no LoRA)")
    if settings.alpha < 0:
        raise LoraError(f"--lora-alpha {settings.alpha:g}: must be > 0 (0: the rank)")
    if not 0 <= settings.dropout < 1:
        raise LoraError(f"--lora-dropout {settings.dropout:g}: must be in [0, 1)")


def _patterns(targets: str) -> list[str]:
    return [p.strip() for p in str(targets).split(",") if p.strip()]


def _matches(pattern: str, name: str) -> bool:
    if _REGEX.search(pattern):
        return re.fullmatch(pattern, name) is not None
    return name == pattern or name.endswith("." + pattern)


def target_names(model, targets: str = DEFAULT_TARGETS) -> list[str]:
    """The full names of the nn.Linear modules of `model` the patterns match, in the model's order.
    LoraError: no pattern, a broken regular expression, nothing matched at all, or (patterns other
    than the default) a pattern that matches no linear."""
    import torch.nn as nn

    patterns = _patterns(targets)
    if not patterns:
        raise LoraError("--lora-targets is empty: name the linears to adapt (e.g. attn.qkv,mlp.fc1)")
    for p in patterns:
        if _REGEX.search(p):
            try:
                re.compile(p)
            except re.error as e:
                raise LoraError(f"--lora-targets {p!r}: not a regular expression ({e})") from None
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    names = [n for n in linears if any(_matches(p, n) for p in patterns)]
    if targets != DEFAULT_TARGETS:  # the default names parts a model may lack (cross-attention)
        idle = [p for p in patterns if not any(_matches(p, n) for n in linears)]
        if idle:
            raise LoraError(f"--lora-targets: {', '.join(idle)} match(es) no linear of this model; its linears are "
                            f"named like {', '.join(_examples(linears))}")
    if not names:
        raise LoraError(f"--lora-targets {targets}: no linear of this model matches; its linears are named like "
                        f"{', '.join(_examples(linears))}")
    return names


def _examples(linears: list[str]) -> list[str]:
    """One name of each kind of linear (blocks.0's, and those outside the blocks)."""
    seen, out = set(), []
    for n in linears:
        kind = re.sub(r"^(head_)?blocks\.\d+\.", "", n)
        if kind not in seen:
            seen.add(kind)
            out.append(n)
    return out[:12]


def check_rank(model, settings: LoraSettings, names: list[str]) -> None:
    """LoraError where the rank exceeds the smallest targeted linear's min(in, out): a product
    B A of that rank cannot have it, so the extra rows only cost memory."""
    smallest = min(names, key=lambda n: min(model.get_submodule(n).in_features, model.get_submodule(n).out_features))
    layer = model.get_submodule(smallest)
    most = min(layer.in_features, layer.out_features)
    if settings.rank > most:
        raise LoraError(f"--lora {settings.rank}: above the rank of {smallest} ({layer.out_features}x"
                        f"{layer.in_features}, at most {most}); choose --lora <= {most} or other --lora-targets")


def import_peft():
    """peft, imported quietly: its import brings transformers and bitsandbytes, whose optional-kernel and
    pytree notes (torchao's enums) are noise for a run; LoraError naming the extra when it is missing."""
    from ditdata.common.extras import BITSANDBYTES_LOGGERS, require

    return require("peft", "--lora", "train", LoraError, quiet=("torch.utils._pytree", *BITSANDBYTES_LOGGERS))


def peft_config(settings: LoraSettings, names: list[str]):
    """peft's LoraConfig of `settings` on the modules `names` (full names: nothing else matches)."""
    LoraConfig = import_peft().LoraConfig  # noqa: N806 - peft's class

    return LoraConfig(r=settings.rank, lora_alpha=settings.scale_alpha, lora_dropout=settings.dropout,
                      target_modules=list(names), bias="none", init_lora_weights=True)


def inject(model, settings: LoraSettings) -> list[str]:
    """Put peft's LoRA layers on the targeted linears of `model` (in place, on their device: A
    drawn from torch's generator as peft initialises it, B zero, so the model starts as its base);
    every other parameter frozen. Returns the targeted names."""
    inject_adapter_in_model = import_peft().inject_adapter_in_model

    check(settings)
    names = target_names(model, settings.targets)
    check_rank(model, settings, names)
    inject_adapter_in_model(peft_config(settings, names), model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_key(name))
    return names


def is_adapter_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def is_adapter(state: dict) -> bool:
    """Whether a state dict holds an adapter alone (adapter_state's keys)."""
    return bool(state) and all(is_adapter_key(k) for k in state)


def adapter_state(model) -> dict:
    """The adapter's tensors, keyed as peft saves them (the adapter name dropped)."""
    tag = f".{ADAPTER}."
    return {k.replace(tag, "."): v for k, v in model.state_dict().items() if is_adapter_key(k)}


def load_adapter(model, state: dict) -> None:
    """Load adapter_state's tensors into a model inject() made, strictly (LoraError naming what
    differs: another rank or other targets)."""
    tag = f".{ADAPTER}."
    own = {k.replace(tag, "."): k for k in model.state_dict() if is_adapter_key(k)}
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise LoraError(f"the adapter does not fit this model's LoRA layers (missing {len(missing)}: "
                        f"{', '.join(missing[:2]) or '-'}; unexpected {len(unexpected)}: {', '.join(unexpected[:2]) or '-'})")
    mine = model.state_dict()
    for k, full in own.items():
        if tuple(state[k].shape) != tuple(mine[full].shape):
            raise LoraError(f"the adapter's {k} is {tuple(state[k].shape)}, this model's {tuple(mine[full].shape)} "
                            "(another --lora rank)")
    model.load_state_dict({own[k]: v for k, v in state.items()}, strict=False)


def merged_state(model) -> dict:
    """The plain state dict of the DiT under the adapter: each LoRA layer's base weight plus peft's
    delta (get_delta_weight: scale x B A), under the DiT's own names; every other tensor as it is."""
    LoraLayer = import_peft().tuners.lora.LoraLayer  # noqa: N806 - peft's class

    state = {}
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    for k, v in model.state_dict().items():
        if is_adapter_key(k):
            continue
        owner, _, leaf = k.rpartition(".base_layer.")
        if owner in layers:
            if leaf == "weight":
                v = v + layers[owner].get_delta_weight(ADAPTER).to(v.dtype)
            k = f"{owner}.{leaf}"
        state[k] = v.detach()
    return state


def describe(settings: LoraSettings, names: list[str], model) -> str:
    """The startup line of a LoRA run: rank, scale, what it is on, trainable parameters of all."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    kinds = sorted({re.sub(r"^(head_)?blocks\.\d+\.", "", n) for n in names})
    return (f"LoRA rank {settings.rank}, alpha {settings.scale_alpha:g} (scale {settings.scale_alpha / settings.rank:g}), "
            f"dropout {settings.dropout:g}, on {len(names)} linears ({', '.join(kinds)}): {trainable / 1e6:.2f} M "
            f"trainable of {total / 1e6:.1f} M parameters ({100 * trainable / total:.2f}%), the base frozen")


def counts(model, names: list[str], rank: int) -> tuple[int, int]:
    """(adapter parameters, base parameters) of `model` (a plain DiT, meta tensors will do) with a
    rank-`rank` adapter on `names`: r (in + out) per linear."""
    adapter = sum(rank * (model.get_submodule(n).in_features + model.get_submodule(n).out_features) for n in names)
    return adapter, sum(p.numel() for p in model.parameters())


__all__ = ["ADAPTER", "DEFAULT_TARGETS", "LoraError", "LoraSettings", "adapter_state", "check", "check_rank",
           "counts", "describe", "import_peft", "inject", "is_adapter", "is_adapter_key", "load_adapter", "merged_state", "peft_config",
           "settings_of", "target_names"]
