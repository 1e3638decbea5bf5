"""Token routing (TREAD, Krause et al., 2025): `dittrain run --route RATE:START:END`.

During training a random fraction RATE of each sample's T tokens leaves the sequence before
block START, skips blocks START..END and rejoins after block END, carrying the value it had when
it left; the other K = T - floor(RATE T) tokens go through those blocks as a shorter sequence.
The final layer and so the loss see all T tokens.

The numbers mean what TREAD's own do (github.com/CompVis/tread at fccf77cc735a, dit.py DiT.forward
and configs/model/tread.yaml: a route {selection_ratio, start_layer_idx, end_layer_idx} gathers the
kept tokens before block start_layer_idx and scatters them back after block end_layer_idx, blocks
counted from 0): START and END are 0-based and both routed, so a route copied from its configs is
the same network. Its DiT-B/2 config is 0.5:2:8 of 12 blocks; its paper's rule, i = 2 and
j = depth - 4, gives 0.5:2:24 on DiT-XL/2's 28 blocks: blocks 0-1 and 25-27 see every token.
As the reference does, the block right after the rejoin runs with autocast off (in the weights'
precision, fp32), when autocast is on at all.

--route-convention says how START:END read (dittrain.config.ROUTE_CONVENTIONS): tread (the above,
the default) or half-open, the meaning dittrain recorded runs with before: blocks START <= i < END
routed and no full-precision block. A run recorded without the field is half-open and stays so on
resume, so it trains, samples and exports as it did. Both parse into the same Route (START and END
of the blocks routed, 0-based inclusive), which knows its convention to print itself as written.

Why it is cheap: the routed blocks cost about K/T of a full block (the attention (K/T)^2), and
so do their activations, while every token still takes part in the loss at every step.

Routing is a training setting: sampling, evaluation and every export call the model without a
route (every token), except `dittrain sample --route-guidance` (dittrain.inference.route_guidance,
TREAD's rf.py sample_tread). Which tokens stay is drawn per micro-batch from the run's noise
generator (the same device generator as the noise and the timesteps, in every checkpoint), so a
resumed run draws the same selections: exact resume holds. TREAD's own draw is a torch.rand argsort
of the global generator whose first K stay in that random order; here they are sorted ascending,
the same network (attention and the blocks' token-wise parts do not see the order; RoPE tables
follow the tokens).

    route = parse_route("0.5:2:24")             Route(rate, start, end), or None for ""
    route = route_of(cfg.routing)               the run's, read with its recorded convention
    block_tokens(route, depth, tokens)          the tokens each block sees (flops_per_forward, memory model)
    check(route, depth, model)                  RouteError: END beyond the model's last block
    r = draw(route, n, tokens, gen, device)     TokenRoute(start, end, idx (n, K) sorted, full_after)
    model(x, t, y=y, route=r)                   the routed forward (dittrain.model.dit.DiT)

With --repa, the alignment covers the tokens that reach the REPA block: when that block is
among the routed ones, the targets of the kept tokens only (`kept_targets`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ditdata.common.errors import UserError
from dittrain.config import ROUTE_CONVENTIONS

TREAD, HALF_OPEN = ROUTE_CONVENTIONS
ROUTE_GRAMMAR = ("RATE:START:END, e.g. 0.5:2:24 (RATE in (0, 1) of the tokens skips blocks START..END, 0-based, "
                 "both included, as TREAD counts: 0 <= START <= END < the model's blocks)")


class RouteError(UserError, ValueError):
    """A --route value that does not parse or does not fit the model (one line)."""


@dataclass(frozen=True)
class Route:
    """A route in TREAD's terms: RATE of the tokens skips blocks start..end (0-based, both included:
    its start_layer_idx and end_layer_idx). convention: how the user's text wrote it (str() gives
    that text back); tread routes also run the block after the rejoin in full precision."""

    rate: float
    start: int  # the first routed block, 0-based
    end: int  # the last routed block, 0-based, inclusive
    convention: str = TREAD

    def kept(self, tokens: int) -> int:
        """K: the tokens that go through the routed blocks (at least one: RATE < 1)."""
        return tokens - math.floor(self.rate * tokens)

    @property
    def full_after(self) -> bool:
        """Whether the block after the rejoin runs with autocast off (TREAD's reference does)."""
        return self.convention == TREAD

    def routes(self, block: int) -> bool:
        """Whether `block` (0-based) runs on the kept tokens."""
        return self.start <= block <= self.end

    def __str__(self) -> str:
        end = self.end + 1 if self.convention == HALF_OPEN else self.end
        return f"{self.rate:g}:{self.start}:{end}"


class TokenRoute(NamedTuple):
    """One forward's routing (what DiT.forward takes as route=): blocks start..end (0-based, both
    included) run on the tokens idx (N, K), ascending per sample; the others skip them and rejoin
    after block end. full_after: the next block runs with autocast off (TREAD). A NamedTuple, so
    DDP passes it through to the module as it is."""

    start: int
    end: int
    idx: torch.Tensor  # (N, K) int64
    full_after: bool = True


def parse_route(text: str, convention: str = TREAD) -> Route | None:
    """"RATE:START:END" -> Route; "" -> None (no routing); RouteError otherwise. convention: how
    START:END read (module docstring); half-open is converted to the blocks it routes."""
    if convention not in ROUTE_CONVENTIONS:
        raise RouteError(f"--route-convention {convention!r}: one of {', '.join(ROUTE_CONVENTIONS)}")
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
    if convention == HALF_OPEN:  # as recorded before --route-convention: blocks START <= i < END
        if start < 0 or start >= end:
            raise RouteError(f"--route {text} (--route-convention half-open): START {start} must be >= 0 and below "
                             f"END {end} (the routed blocks are START <= i < END, 0-based)")
        return Route(rate, start, end - 1, HALF_OPEN)
    if start < 0 or start > end:
        raise RouteError(f"--route {text}: START {start} must be >= 0 and at most END {end} (the routed blocks are "
                         "START..END, 0-based, both included, as TREAD counts)")
    return Route(rate, start, end, TREAD)


def route_of(routing) -> Route | None:
    """The route of a run's settings (dittrain.config.RoutingSection: route, route_convention)."""
    return parse_route(routing.route, routing.route_convention)


def check(route: Route | None, depth: int, model: str) -> None:
    """RouteError when the route's last block lies beyond the model's blocks."""
    if route is None or route.end < depth:
        return
    if route.convention == HALF_OPEN:
        raise RouteError(f"--route {route} (--route-convention half-open): END {route.end + 1} is beyond {model}'s "
                         f"{depth} blocks; choose END <= {depth}")
    hint = f" (TREAD's j = depth - 4 is {depth - 4})" if depth - 4 >= route.start else ""
    raise RouteError(f"--route {route}: END {route.end} is beyond {model}'s last block, {depth - 1} (0-based, "
                     f"blocks 0..{depth - 1}); choose END <= {depth - 1}{hint}")


def draw(route: Route, n: int, tokens: int, generator: torch.Generator, device) -> TokenRoute:
    """The kept tokens of n samples: a uniformly random K-subset of 0..T-1 per sample, in
    ascending order (the sequence keeps its row-major order), drawn from `generator`."""
    scores = torch.rand(n, tokens, generator=generator, device=device)  # (n, T)
    idx = scores.argsort(dim=1)[:, : route.kept(tokens)].sort(dim=1).values  # (n, K)
    return TokenRoute(route.start, route.end, idx, route.full_after)


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
    """Whether the tokens after `block` (1-based, as --repa-depth counts) are the kept ones only:
    block - 1 is a routed block (the last one's too: DiT.forward hands its output out before the
    rejoin)."""
    return route is not None and route.start < block <= route.end + 1


def kept_targets(route: TokenRoute | None, block: int, target: torch.Tensor) -> torch.Tensor:
    """--repa under routing: the targets (N, T, Dy) of the tokens that reached `block`."""
    return gather_tokens(target, route.idx) if routed(route, block) else target


def block_tokens(route: Route | None, depth: int, tokens: int) -> list[int]:
    """The tokens each of `depth` blocks sees: K in the routed blocks, all `tokens` elsewhere."""
    if route is None:
        return [tokens] * depth
    return [route.kept(tokens) if route.routes(i) else tokens for i in range(depth)]


def full_precision_block(route: Route | None, depth: int) -> int | None:
    """The block (0-based) that runs with autocast off under this route, or None."""
    return route.end + 1 if route is not None and route.full_after and route.end + 1 < depth else None


def describe(route: Route, depth: int, tokens: int) -> str:
    """The startup line of a routed run: what is routed, counted as the route is written."""
    k = route.kept(tokens)
    blocks = f"block {route.start}" if route.start == route.end else f"blocks {route.start}-{route.end}"
    if route.convention == HALF_OPEN:
        how = (f"--route-convention half-open (as recorded before TREAD's counting: blocks {route.start} <= i < "
               f"{route.end + 1})")
    else:
        how = "TREAD's counting (0-based, START and END both routed)"
    after = f"rejoin after block {route.end}" if route.end + 1 < depth else "rejoin before the final layer"
    full = full_precision_block(route, depth)
    fp = f"; block {full} runs with autocast off (as TREAD's reference)" if full is not None else ""
    return (f"route: {route}, {how}: {tokens - k} of {tokens} tokens ({route.rate:.0%}) skip {blocks} of 0-{depth - 1} "
            f"and {after}; those blocks see {k} tokens{fp}; training only (sampling and exports use every token)")


__all__ = ["HALF_OPEN", "ROUTE_GRAMMAR", "Route", "RouteError", "TREAD", "TokenRoute", "block_tokens", "check",
           "describe", "draw", "full_precision_block", "gather_tokens", "keep_rows", "kept_targets", "parse_route",
           "rejoin_tokens", "route_of", "routed"]
