"""Token routing (TREAD, Krause et al., 2025): `dittrain run --route RATE:START:END`.

During training a random fraction RATE of each sample's T tokens leaves the sequence after
block START, skips the blocks up to END and rejoins there, carrying the value it had when it
left; the other K = T - floor(RATE T) tokens go through those blocks as a shorter sequence.
Blocks are counted as the paper does, 1-based: with 0.5:2:26 on DiT-XL/2's 28 blocks, blocks 1-2
see every token, blocks 3-26 see half of them, blocks 27-28 every token again. The final layer
and so the loss see all T tokens. In DiT.forward's 0-based loop: the blocks i with
START <= i < END run on the kept tokens.

Why it is cheap: the routed blocks cost about K/T of a full block (the attention (K/T)^2), and
so do their activations, while every token still takes part in the loss at every step.

Routing is a training setting only: the sampler, evaluation and every export call the model
without a route, so they always use every token. Which tokens stay is drawn per micro-batch
from the run's noise generator (the same device generator as the noise and the timesteps, in
every checkpoint), so a resumed run draws the same selections: exact resume holds.

    route = parse_route("0.5:2:26")            Route(rate, start, end), or None for ""
    block_tokens(route, depth, tokens)         the tokens each block sees (flops_per_forward, memory model)
    check(route, depth)                        RouteError: START >= END, END beyond the model
    r = draw(route, n, tokens, gen, device)    TokenRoute(start, end, idx (n, K) sorted)
    model(x, t, y=y, route=r)                  the routed forward (dittrain.model.dit.DiT)

With --repa, the alignment covers the tokens that reach the REPA block: when that block is
among the routed ones, the targets of the kept tokens only (`kept_targets`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ditdata.common.errors import UserError

ROUTE_GRAMMAR = "RATE:START:END, e.g. 0.5:2:26 (RATE in (0, 1), 0 <= START < END <= the model's blocks)"


class RouteError(UserError, ValueError):
    """A --route value that does not parse or does not fit the model (one line)."""


@dataclass(frozen=True)
class Route:
    """--route RATE:START:END: the fraction of tokens routed around blocks START+1..END (1-based)."""

    rate: float
    start: int
    end: int

    def kept(self, tokens: int) -> int:
        """K: the tokens that go through the routed blocks (at least one: RATE < 1)."""
        return tokens - math.floor(self.rate * tokens)

    def __str__(self) -> str:
        return f"{self.rate:g}:{self.start}:{self.end}"


class TokenRoute(NamedTuple):
    """One forward's routing (what DiT.forward takes as route=): blocks start <= i < end (0-based)
    run on the tokens idx (N, K), ascending per sample; the others skip them. A NamedTuple, so
    DDP passes it through to the module as it is."""

    start: int
    end: int
    idx: torch.Tensor  # (N, K) int64


def parse_route(text: str) -> Route | None:
    """"RATE:START:END" -> Route; "" -> None (no routing); RouteError otherwise."""
    text = (text or "").strip()
    if not text:
        return None
    parts = text.split(":")
    if len(parts) != 3:
        raise RouteError(f"--route {text!r}: give {ROUTE_GRAMMAR}")
    try:
        rate, start, end = float(parts[0]), int(parts[1]), int(parts[2])
    except ValueError:
        raise RouteError(f"--route {text!r}: give {ROUTE_GRAMMAR}") from None
    if not (math.isfinite(rate) and 0 < rate < 1):
        raise RouteError(f"--route {text}: RATE {parts[0]} is outside (0, 1); the fraction of tokens that skips "
                         "the routed blocks, e.g. 0.5")
    if start < 0 or start >= end:
        raise RouteError(f"--route {text}: START {start} must be >= 0 and below END {end} (the routed blocks are "
                         "START+1..END)")
    return Route(rate, start, end)


def check(route: Route | None, depth: int, model: str) -> None:
    """RouteError when END lies beyond the model's blocks."""
    if route is not None and route.end > depth:
        raise RouteError(f"--route {route}: END {route.end} is beyond {model}'s {depth} blocks; choose END <= {depth}")


def draw(route: Route, n: int, tokens: int, generator: torch.Generator, device) -> TokenRoute:
    """The kept tokens of n samples: a uniformly random K-subset of 0..T-1 per sample, in
    ascending order (the sequence keeps its row-major order), drawn from `generator`."""
    scores = torch.rand(n, tokens, generator=generator, device=device)  # (n, T)
    idx = scores.argsort(dim=1)[:, : route.kept(tokens)].sort(dim=1).values  # (n, K)
    return TokenRoute(route.start, route.end, idx)


def keep_rows(route: TokenRoute, rows: slice) -> TokenRoute:
    """The route of some of the samples (a rank's part of the global micro-batch)."""
    return route._replace(idx=route.idx[rows])


def gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (N, T, D), idx (N, K) -> (N, K, D): the kept tokens."""
    return x.gather(1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def rejoin_tokens(full: torch.Tensor, kept: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """full (N, T, D) as the tokens left, kept (N, K, D) after the routed blocks -> (N, T, D):
    the kept tokens back in their places, the routed ones as they left (out of place, so the
    gradient reaches both)."""
    return full.scatter(1, idx.unsqueeze(-1).expand(-1, -1, full.shape[-1]), kept)


def routed(route: TokenRoute | None, block: int) -> bool:
    """Whether the tokens after `block` (1-based, as --repa-depth counts) are the kept ones only."""
    return route is not None and route.start < block <= route.end


def kept_targets(route: TokenRoute | None, block: int, target: torch.Tensor) -> torch.Tensor:
    """--repa under routing: the targets (N, T, Dy) of the tokens that reached `block`."""
    return gather_tokens(target, route.idx) if routed(route, block) else target


def block_tokens(route: Route | None, depth: int, tokens: int) -> list[int]:
    """The tokens each of `depth` blocks sees: K in the routed blocks, all `tokens` elsewhere."""
    if route is None:
        return [tokens] * depth
    return [route.kept(tokens) if route.start <= i < route.end else tokens for i in range(depth)]


def describe(route: Route, depth: int, tokens: int) -> str:
    """The startup line of a routed run."""
    k = route.kept(tokens)
    return (f"route: {route}: {tokens - k} of {tokens} tokens ({route.rate:.0%}) skip blocks {route.start + 1}-{route.end} "
            f"of {depth} and rejoin {'before block ' + str(route.end + 1) if route.end < depth else 'before the final layer'}"
            f"; those blocks see {k} tokens; training only (sampling and exports use every token)")


__all__ = ["ROUTE_GRAMMAR", "Route", "RouteError", "TokenRoute", "block_tokens", "check", "describe", "draw", "gather_tokens",
           "keep_rows", "kept_targets", "parse_route", "rejoin_tokens", "routed"]
