"""`dittrain sample --route-guidance STRONG,WEAK`: TREAD's guidance by selection rates.

What the reference does (github.com/CompVis/tread at fccf77cc735a, rf.py RF.sample_tread and the
call in inference.py): each model evaluation of the sampler is two forwards of the trained model
with its routes forced on (force_routing=True) and every route's selection rate overwritten
(overwrite_selection_ratio), gamma1 for the first ("strong": fewer tokens skip) and gamma2 for the
second ("weak"), combined like classifier-free guidance with its cfg_scale:

    out = out(gamma2) + s * (out(gamma1) - out(gamma2))          inference.py: gamma 0.3, 0.7; s 1.5

Both passes drop the class (class_drop_prob=1.0: the null class), each draws its own random kept
tokens (Router.get_mask), and the routed forward is the training one: the run's blocks START..END,
the block after the rejoin with autocast off (dit.py). Here:

- the route is the run's own (its recorded --route and --route-convention: a half-open run routes
  the blocks it trained with and has no full-precision block), the rates are STRONG,WEAK in [0, 1),
  the scale is --cfg, by default sample_tread's 1.5 (dittrain.config.ROUTE_GUIDANCE_CFG; it then adds
  no classifier-free guidance: the two routed passes replace CFG's pair, as in the reference; the
  reference asserts a scale above 1, here 1 is allowed and samples the strong pass alone);
- --route-guidance-cond null (the default) gives both passes the null class or the empty caption,
  as the reference; cond gives both the sample's own class or prompt (the README's "instead of
  dropping the class label" read the other way; not in the reference's code);
- the kept tokens are drawn per pass and per model call from the sampler's CPU generator (seeded
  with --seed: the same images for the same seed and batch size), in ascending order like
  training's (dittrain.model.routing.draw); the reference draws from torch's global generator;
- the guided channels are the first C (or --cfg-channels) as classifier-free guidance's, the rest
  (ddpm's learned variance) from the strong pass; the reference's flow models have no such channels.

The guided callable is what Diffusion.sample calls in place of the model (with cfg_scale 1), so it
works with every sampler of the run's objective; the reference shows it with its Euler flow sampler.
Not in any other path (--npz, serve, exports), and torch engines only: an ONNX file has no routes.

    fn = route_guided(model, route, (0.3, 0.7), 1.5, kwargs, generator=gen)    fn(x, t) -> out
"""

from __future__ import annotations

from dataclasses import replace

import torch

from dittrain.config import recorded
from dittrain.inference.open_run import SampleError
from dittrain.model.routing import Route, RouteError, draw, parse_route


def run_route(config: dict) -> Route:
    """The route a run trained with, read with its recorded convention (SampleError without one)."""
    text = recorded(config, "route") or ""
    if not text:
        raise SampleError("--route-guidance routes the passes through the blocks the run trained routed: this run "
                          "has no --route (train with e.g. --route 0.5:2:24, TREAD's DiT-XL/2 route)")
    try:
        return parse_route(text, recorded(config, "route_convention") or "tread")
    except RouteError as e:
        raise SampleError(f"the run's record: {e}") from None


def check_rates(rates) -> tuple[float, float]:
    """(strong, weak): two selection rates in [0, 1) (SampleError otherwise)."""
    rates = tuple(float(r) for r in rates)
    if len(rates) != 2 or not all(0 <= r < 1 for r in rates):  # NaN too
        raise SampleError(f"--route-guidance {','.join(f'{r:g}' for r in rates)}: give STRONG,WEAK, two selection "
                          "rates in [0, 1) (the fraction of tokens that skips the routed blocks; TREAD: 0.3,0.7)")
    return rates


def route_guided(model, route: Route, rates: tuple[float, float], scale: float, kwargs: dict, *,
                 generator: torch.Generator | None = None, channels: int | None = None):
    """The guided model callable (x, t) -> out of TREAD's sample_tread (module docstring).

    model: the DiT (in eval mode); route: the run's; rates: (strong, weak); kwargs: the inputs both
    passes take (the null ones for --route-guidance-cond null); generator: where the kept tokens
    are drawn (CPU); channels: guide only the first `channels` of C, the rest from the strong pass."""
    strong, weak = (replace(route, rate=r) for r in rates)
    p = model.config.patch_size

    def one(x, t, r: Route):
        n, tokens = x.shape[0], (x.shape[-2] // p) * (x.shape[-1] // p)
        kept = draw(r, n, tokens, generator, "cpu" if generator is None else generator.device)
        return model(x, t, route=kept._replace(idx=kept.idx.to(x.device)), **kwargs)

    def fn(x, t):
        C = x.shape[1] if channels is None else min(channels, x.shape[1])
        a = one(x, t, strong)  # the reference's unet1, gamma1
        b = one(x, t, weak)  # unet2, gamma2
        g = b[:, :C] + scale * (a[:, :C] - b[:, :C])
        return torch.cat([g, a[:, C:]], dim=1)

    return fn


def describe(route: Route, rates: tuple[float, float], scale: float, cond: str) -> str:
    """What the sampling line says of it."""
    return (f"route guidance {rates[0]:g} (strong) / {rates[1]:g} (weak) at {scale:g} on the run's route {route} "
            f"({route.convention}: blocks {route.start}-{route.end}), {cond} condition in both passes")


__all__ = ["check_rates", "describe", "route_guided", "run_route"]
