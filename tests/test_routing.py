"""dittrain.model.routing and `dittrain run --route RATE:START:END` (TREAD): the routed forward against
one built by hand with TREAD's own index convention (CompVis/tread fccf77cc735a dit.py: gather before
block start_layer_idx, scatter back after block end_layer_idx, 0-based), its full-precision block after
the rejoin, RATE 0 against the plain model, which tokens the blocks see in training and in sampling,
REPA on routed blocks, exact resume, the record and its convention (half-open for runs recorded before
it), the one-line refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from cliutil import assert_has, losses, one_error_line, resume_after_sigkill, run_args
from cliutil import dittrain as cli
from storeutil import add_features
from tiny import nudged

from dittrain.model.dit import DiT, DiTBlock, rope_table
from dittrain.model.routing import (
    Route,
    RouteError,
    TokenRoute,
    block_tokens,
    draw,
    gather_tokens,
    kept_targets,
    parse_route,
    rejoin_tokens,
    routed,
)
from dittrain.model.sizes import flops_per_forward, get_config
from dittrain.rundir import latest_checkpoint, load_checkpoint
from dittrain.train.repa import Alignment, alignment_loss, build_projector

pytestmark = pytest.mark.usefixtures("one_thread")
# the tests' store is 3x8x8: patch 2 gives a 4x4 grid, 16 tokens; 4 blocks
MODEL = "custom:hidden=64,depth=4,heads=2,patch=2"
ROUTE = ["--route", "0.5:1:2"]  # 8 of 16 tokens skip blocks 1-2 (0-based, both included)


LIGHTNING = f"{MODEL},mlp=swiglu,norm=rms,pos=rope,qk_norm=1"  # LightningDiT's blocks: RoPE rows follow the tokens


def _model(name: str = MODEL, **overrides) -> DiT:
    torch.manual_seed(0)
    return nudged(DiT(get_config(name, input_size=8, in_channels=3, num_classes=3, **overrides)), 0.05)


def _drawn(rate: float) -> TokenRoute:
    """The kept tokens of _inputs' 3 samples under RATE:1:2 (blocks 1-2 routed), seed 0."""
    return draw(Route(rate, 1, 2), 3, 16, torch.Generator().manual_seed(0), "cpu")


def _inputs(n: int = 3):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 8, 8, generator=g), torch.tensor([10.0, 500.0, 900.0][:n]), torch.arange(n) % 3


def _routed_setup(rate: float, name: str = MODEL) -> tuple[DiT, torch.Tensor, torch.Tensor, torch.Tensor, TokenRoute]:
    """_model(name) in eval mode, _inputs() and _drawn(rate): model, x, t, y, route."""
    return _model(name).eval(), *_inputs(), _drawn(rate)


def _by_hand(model: DiT, x, t, y, start: int, end: int, idx, *, full_after: bool = False) -> torch.Tensor:
    """The routed forward as TREAD's reference loops: embed; for each block idx, gather the kept
    tokens (plain indexing) before block `start`, run the block, put them back after block `end`
    (0-based, both ends routed); full_after: the block after the rejoin in fp32 with autocast off
    (its fp32_next)."""
    cfg, rope, kept_rope = model.config, None, None
    h = model.x_embedder(x)
    rows = torch.arange(h.shape[0])[:, None]
    if cfg.pos == "sincos":
        h = h + model.pos_embed
    else:  # the kept tokens rotate by their own positions
        rope = rope_table(cfg.head_dim, cfg.input_size // cfg.patch_size, device=x.device)
        kept_rope = (rope[0][idx], rope[1][idx])
    c = model.t_embedder(t) + model.y_embedder(y, False)
    fp32_next = False
    for i, block in enumerate(model.blocks):
        if i == start:
            before, h = h, h[rows, idx]
        if fp32_next:
            with torch.autocast("cpu", enabled=False):
                h = block(h.float(), c.float(), rope=rope)
            fp32_next = False
        else:
            h = block(h, c, rope=kept_rope if start <= i <= end else rope)
        if i == end:
            full = before.clone()
            full[rows, idx] = h.to(full.dtype)
            h, fp32_next = full, full_after
    return model.unpatchify(model.final_layer(h, c))


@pytest.mark.parametrize("name", [MODEL, LIGHTNING])
@pytest.mark.parametrize(("start", "end"), [(1, 2), (0, 1), (2, 3), (1, 1)])
def test_the_routed_forward_equals_one_built_by_hand(name, start, end):
    model = _model(name).eval()
    x, t, y = _inputs()
    idx = torch.tensor([[0, 3, 5, 6, 9, 10, 12, 15], [1, 2, 4, 7, 8, 11, 13, 14], [0, 1, 2, 3, 4, 5, 6, 7]])
    with torch.no_grad():
        out = model(x, t, y=y, route=TokenRoute(start, end, idx))
        plain = model(x, t, y=y)
        torch.testing.assert_close(out, _by_hand(model, x, t, y, start, end, idx), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(out, plain, atol=1e-4)  # routing changes what the model computes


def test_rate_zero_is_the_plain_model_bit_for_bit():
    model, x, t, y, route = _routed_setup(0.0)
    assert torch.equal(route.idx, torch.arange(16).expand(3, 16))
    with torch.no_grad():
        assert torch.equal(model(x, t, y=y, route=route), model(x, t, y=y))


def test_treads_own_numbers_route_the_blocks_its_code_routes():
    """TREAD's configs/model/tread.yaml (DiT-B/2: selection_ratio 0.5, start_layer_idx 2, end_layer_idx 8)
    and its paper's XL/2 rule (i = 2, j = depth - 4): the blocks its loop runs on the kept tokens are
    start_layer_idx <= idx <= end_layer_idx."""
    def reference_blocks(start, end, depth):  # the reference's loop: gather at idx == start, scatter after end
        routed, inside = [], False
        for idx in range(depth):
            inside = inside or idx == start
            routed.append(inside)
            inside = inside and idx != end
        return routed

    for text, depth in (("0.5:2:8", 12), ("0.5:2:24", 28), ("0.25:0:0", 4), ("0.5:3:11", 12)):
        route = parse_route(text)
        want = reference_blocks(route.start, route.end, depth)
        keep = 256 - int(256 * route.rate)  # the reference's num_keep = num_patches - int(num_patches * rate)
        assert block_tokens(route, depth, 256) == [keep if r else 256 for r in want]
        assert str(route) == text and route.full_after
    assert block_tokens(parse_route("0.5:2:8"), 12, 256) == [256] * 2 + [128] * 7 + [256] * 3


def test_half_open_is_the_old_meaning_of_the_same_numbers():
    """--route-convention half-open (runs recorded before the convention): START <= i < END, no
    full-precision block; the same forward as TREAD's counting of START:END-1 without it."""
    old = parse_route("0.5:1:3", "half-open")
    assert old == Route(0.5, 1, 2, "half-open") and str(old) == "0.5:1:3" and not old.full_after
    assert block_tokens(old, 4, 16) == block_tokens(parse_route("0.5:1:2"), 4, 16) == [16, 8, 8, 16]
    model = _model().eval()
    x, t, y = _inputs()
    gen = torch.Generator().manual_seed(0)
    r = draw(old, 3, 16, gen, "cpu")
    assert (r.start, r.end, r.full_after) == (1, 2, False)
    with torch.no_grad():  # fp32 without autocast: no full-precision block either way
        assert torch.equal(model(x, t, y=y, route=r), _by_hand(model, x, t, y, 1, 2, r.idx))
    with pytest.raises(RouteError, match="half-open.*START 2 must be >= 0 and below END 2"):
        parse_route("0.5:2:2", "half-open")
    with pytest.raises(RouteError, match="--route-convention 'paper'"):
        parse_route("0.5:1:2", "paper")


def _block_precision(monkeypatch) -> list[tuple[torch.dtype, bool]]:
    """Every DiTBlock forward from now on appends (its input's dtype, whether CPU autocast is on)."""
    seen: list = []
    forward = DiTBlock.forward

    def recording(self, x, *args, **kwargs):
        seen.append((x.dtype, torch.is_autocast_enabled("cpu")))
        return forward(self, x, *args, **kwargs)

    monkeypatch.setattr(DiTBlock, "forward", recording)
    return seen


@pytest.mark.parametrize("name", [MODEL, LIGHTNING])
def test_the_block_after_the_rejoin_runs_with_autocast_off(name, monkeypatch):
    """TREAD's reference runs the block after each rejoin under autocast(enabled=False) (fp32_next in
    dit.py DiT.forward): under bf16 autocast, block END+1 sees fp32 inputs with autocast off, the
    others autocast; a half-open route (the old meaning) has no such block; without autocast nothing
    changes."""
    model, x, t, y, route = _routed_setup(0.5, name)  # blocks 1-2 routed: block 3 is the one after the rejoin
    seen = _block_precision(monkeypatch)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, t, y=y, route=route)
        assert [on for _, on in seen] == [True, True, True, False] and seen[3][0] == torch.float32
        want = _by_hand(model, x, t, y, 1, 2, route.idx, full_after=True)
        torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-3)
        assert not torch.allclose(out, _by_hand(model, x, t, y, 1, 2, route.idx), rtol=1e-3, atol=1e-3)
        seen.clear()
        model(x, t, y=y, route=route._replace(full_after=False))
        assert [on for _, on in seen] == [True] * 4
    seen.clear()
    with torch.no_grad():
        model(x, t, y=y, route=route)
    assert seen == [(torch.float32, False)] * 4


def test_the_block_after_the_rejoin_keeps_its_gradients_under_checkpointing():
    """The full-precision block under block checkpointing recomputes with autocast off too: the
    same gradients as without checkpointing."""
    x, t, y = _inputs()
    route = _drawn(0.5)
    grads = []
    for knob in ("none", "every"):
        model = _model(grad_checkpointing=knob).train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, t, y=y, force_drop_ids=torch.zeros(3), route=route).float().square().mean()
        loss.backward()
        grads.append(model.blocks[3].mlp.fc1.weight.grad)
    torch.testing.assert_close(grads[1], grads[0])


def test_draw_keeps_a_sorted_random_subset_from_the_generator():
    route = Route(0.75, 1, 3)
    a = draw(route, 5, 16, torch.Generator().manual_seed(7), "cpu")
    b = draw(route, 5, 16, torch.Generator().manual_seed(7), "cpu")
    assert torch.equal(a.idx, b.idx) and a.idx.shape == (5, 4) == (5, route.kept(16))
    assert all(len(set(row.tolist())) == 4 and row.tolist() == sorted(row.tolist()) for row in a.idx)
    assert len({tuple(row.tolist()) for row in a.idx}) > 1  # each sample its own subset
    assert (a.start, a.end, a.full_after) == (1, 3, True) and Route(0.999, 0, 1).kept(4) == 1


@pytest.mark.parametrize("name", ["DiT-XL/2", "LightningDiT-XL/1"])
def test_routed_flops_are_what_the_forward_computes(name):
    """flops_per_forward(tokens=) against torch's own count of a routed forward (on meta: free)."""
    from torch.utils.flop_counter import FlopCounterMode

    latent = (4, 32, 32) if name.startswith("DiT") else (32, 16, 16)
    route = parse_route("0.5:2:24")  # TREAD's i = 2, j = depth - 4 on 28 blocks
    with torch.device("meta"):
        m = DiT(get_config(name, input_size=latent[-1], in_channels=latent[0], num_classes=1000)).eval()
        idx = torch.zeros(2, route.kept(m.config.num_tokens), dtype=torch.long)
        with FlopCounterMode(display=False) as counted:
            m(torch.empty(2, *latent), torch.ones(2), torch.zeros(2, dtype=torch.long), route=TokenRoute(2, 24, idx))
    tokens = block_tokens(route, m.config.depth, m.config.num_tokens)
    assert tokens == [256] * 2 + [128] * 23 + [256] * 3  # blocks 2..24 routed, 25-27 see every token
    assert counted.get_total_flops() == 2 * 2 * flops_per_forward(m.config, tokens=tokens)
    assert 0.5 < flops_per_forward(m.config, tokens=tokens) / flops_per_forward(m.config) < 0.6


def test_gradients_reach_every_token_and_checkpointing_changes_nothing():
    """The loss covers all tokens: the routed tokens' inputs get a gradient through the skip; and
    block checkpointing under routing gives the same gradients as none."""
    x, t, y = _inputs()
    route = _drawn(0.5)
    grads = []
    for knob in ("none", "every", "attn", "selective"):
        model = _model(LIGHTNING, grad_checkpointing=knob).train()
        xi = x.clone().requires_grad_(True)
        model(xi, t, y=y, force_drop_ids=torch.zeros(3), route=route).square().mean().backward()
        grads.append((xi.grad, model.blocks[1].mlp.fc1.weight.grad))
    assert (grads[0][0].abs().sum(dim=1) > 0).all()  # every pixel of every token
    for g in grads[1:]:
        torch.testing.assert_close(g[0], grads[0][0], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(g[1], grads[0][1], rtol=1e-5, atol=1e-7)


def test_repa_on_a_routed_block_aligns_the_kept_tokens():
    model, x, t, y, route = _routed_setup(0.5)
    with torch.no_grad():
        _, inside = model(x, t, y=y, route=route, return_hidden=2)  # block 2: routed
        _, after = model(x, t, y=y, route=route, return_hidden=4)  # block 4: all tokens again
    assert inside.shape == (3, 8, 64) and after.shape == (3, 16, 64)
    assert [routed(route, k) for k in (1, 2, 3, 4)] == [False, True, True, False]
    feat = torch.randn(3, 16, 5)
    proj = build_projector(64, 16, 5, seed=0)
    align = Alignment(proj, proj, depth=2, weight=0.5, grid=(4, 4), target_grid=(4, 4))
    loss, _ = align.loss(inside, feat, route)
    by_hand, _ = alignment_loss(proj(inside), torch.stack([feat[n, route.idx[n]] for n in range(3)]))
    torch.testing.assert_close(loss, by_hand)
    assert torch.equal(kept_targets(route, 4, feat), feat)


def test_gather_and_rejoin_are_inverse_where_they_should_be():
    full = torch.randn(2, 6, 3)
    idx = torch.tensor([[0, 2, 5], [1, 3, 4]])
    kept = gather_tokens(full, idx)
    assert torch.equal(kept[1, 2], full[1, 4])
    assert torch.equal(rejoin_tokens(full, kept, idx), full)
    moved = rejoin_tokens(full, kept + 1, idx)
    assert torch.equal(moved[0, 1], full[0, 1]) and torch.equal(moved[0, 2], full[0, 2] + 1)


@pytest.mark.parametrize(("text", "says"), [
    ("0.5:2", "give RATE:START:END"),
    ("half:1:3", "give RATE:START:END"),
    ("0:1:3", "RATE 0 is outside (0, 1)"),
    ("1:1:3", "RATE 1 is outside (0, 1)"),
    ("nan:1:3", "is outside (0, 1)"),
    ("0.5:3:2", "START 3 must be >= 0 and at most END 2 (the routed blocks are START..END, 0-based, both included"),
    ("0.5:-1:3", "START -1 must be >= 0"),
])
def test_values_that_do_not_parse(text, says):
    with pytest.raises(RouteError) as e:
        parse_route(text)
    assert says in str(e.value) and "\n" not in str(e.value)
    assert parse_route("") is None and parse_route(" 0.25:0:4 ") == Route(0.25, 0, 4)
    assert parse_route("0.5:3:3") == Route(0.5, 3, 3)  # one block, as TREAD allows


# ----------------------------------------------------------------------------- runs


def _count_tokens(monkeypatch) -> list[int]:
    """Every DiTBlock forward from now on appends its sequence length to the returned list."""
    seen: list[int] = []
    forward = DiTBlock.forward

    def counting(self, x, *args, **kwargs):
        seen.append(x.shape[1])
        return forward(self, x, *args, **kwargs)

    monkeypatch.setattr(DiTBlock, "forward", counting)
    return seen


def test_a_routed_run_routes_in_training_only(store, tmp_path, monkeypatch):
    """Training: blocks 1-2 (0-based) of every forward see 8 of the 16 tokens, blocks 0 and 3 all 16;
    the startup line, config.json and `dittrain runs` say so, and which counting. Sampling and
    exporting the run use every token."""
    seen = _count_tokens(monkeypatch)
    out = tmp_path / "r"
    r = cli(*run_args(store, out, "--max-steps", 2, "--logger", "jsonl", *ROUTE, model=MODEL))
    assert r.exit_code == 0, r.output
    assert_has(r.output, "route: 0.5:1:2, TREAD's counting (0-based, START and END both routed): 8 of 16 tokens "
                         "(50%) skip blocks 1-2 of 0-3 and rejoin after block 2; those blocks see 8 tokens; block 3 "
                         "runs with autocast off (as TREAD's reference); training only")
    assert seen and seen == [16, 8, 8, 16] * (len(seen) // 4)
    assert json.loads((out / "config.json").read_text())["train"]["routing"] == {"route": "0.5:1:2",
                                                                                 "route_convention": "tread"}
    assert_has(cli("runs", out).output, "custom:hidden=64,depth=4,heads=2,patch=2, route 0.5:1:2 (tread)")

    seen.clear()
    r = cli("sample", "--ckpt", out, "--out", tmp_path / "g.png", "--n", 2, "--steps", 2, "--device", "cpu",
            "--class", 0)
    assert r.exit_code == 0, r.output
    assert seen and set(seen) == {16}
    plain = tmp_path / "plain"
    assert cli(*run_args(store, plain, "--max-steps", 2, "--logger", "jsonl", model=MODEL)).exit_code == 0
    assert load_checkpoint(latest_checkpoint(out))["model"].keys() == load_checkpoint(latest_checkpoint(plain))["model"].keys()
    assert losses(out) != losses(plain)


def test_route_with_repa_on_a_routed_block(store, tmp_path):
    root = tmp_path / "s"
    import shutil

    shutil.copytree(store, root)
    add_features(root, "feats", tokens=16, dims=8)
    out = tmp_path / "r"
    r = cli(*run_args(root, out, "--max-steps", 3, "--logger", "jsonl", *ROUTE, "--repa", "feats",
                      "--repa-depth", 2, "--repa-projector-dim", 16, model=MODEL))
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(np.isfinite(row["repa_loss"]) and -1 <= row["repa_cos"] <= 1 for row in rows)


def test_exact_resume_with_routing(store, tmp_path):
    steps, half = 20, 10
    common = ["--loader", "resident", "--max-steps", steps, "--save-every", half, "--lr", "1e-3", "--ema", "0.9",
              "--logger", "jsonl", "--model", MODEL, *ROUTE]
    resume_after_sigkill(store, tmp_path, common, steps=steps, half=half)
    a, b = (load_checkpoint(latest_checkpoint(tmp_path / n)) for n in ("straight", "killed"))
    for part in ("model", "ema"):
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part


def test_another_route_on_resume_is_a_learned_change(store, tmp_path):
    out = tmp_path / "r"
    assert cli(*run_args(store, out, "--max-steps", 1, "--logger", "jsonl", *ROUTE, model=MODEL)).exit_code == 0
    r = cli("run", "--resume", "--out", out, "--max-steps", 2, "--route", "0.25:1:2")
    assert r.exit_code != 0 and "--route" in one_error_line(r.output), r.output
    r = cli("run", "--resume", "--out", out, "--max-steps", 2, "--route-convention", "half-open")
    assert r.exit_code != 0 and "--route-convention 'tread' -> 'half-open'" in one_error_line(r.output), r.output
    r = cli("run", "--resume", "--out", out, "--max-steps", 2, "--route", "0.25:1:2", "--allow-changes")
    assert r.exit_code == 0, r.output
    history = json.loads((out / "config.json").read_text())["history"]
    assert history[-1]["changes"]["--route"] == {"from": "0.5:1:2", "to": "0.25:1:2"}


def test_a_run_recorded_before_the_convention_resumes_with_the_old_meaning(store, tmp_path, monkeypatch):
    """A record without route_convention (every run before it) reads --route half-open, and keeps it:
    0.5:1:2 routes block 1 only, as it trained, not blocks 1-2; the startup line, the rewritten
    record and `dittrain runs` say half-open. The same numbers in a new run mean TREAD's blocks 1-2."""
    out = tmp_path / "r"
    assert cli(*run_args(store, out, "--max-steps", 1, "--logger", "jsonl", *ROUTE, model=MODEL)).exit_code == 0
    record = json.loads((out / "config.json").read_text())
    del record["train"]["routing"]["route_convention"]  # as an older dittrain wrote it
    (out / "config.json").write_text(json.dumps(record))
    assert_has(cli("runs", out).output, "route 0.5:1:2 (half-open)")
    seen = _count_tokens(monkeypatch)
    r = cli("run", "--resume", "--out", out, "--max-steps", 2)
    assert r.exit_code == 0, r.output
    assert_has(r.output, "route: 0.5:1:2, --route-convention half-open (as recorded before TREAD's counting: "
                         "blocks 1 <= i < 2): 8 of 16 tokens (50%) skip block 1 of 0-3 and rejoin after block 1")
    assert "autocast off" not in r.output
    assert seen == [16, 8, 16, 16] * (len(seen) // 4) and seen
    routing = json.loads((out / "config.json").read_text())["train"]["routing"]
    assert routing == {"route": "0.5:1:2", "route_convention": "half-open"}


def test_the_recorded_fixture_reads_half_open(tmp_path):
    """tests/fixtures/recorded_run (0.5:1:2 on 2 blocks, trained as block 1 routed) would be refused
    in TREAD's counting (END 2 is beyond block 1): its record reads half-open."""
    import shutil

    from test_recorded_run import FIXTURE

    from dittrain.config import TrainConfig, recorded

    record = json.loads((FIXTURE / "run" / "config.json").read_text())
    assert "route_convention" not in record["train"]["routing"]
    routing = TrainConfig.from_record(record["train"]).routing
    assert (routing.route, routing.route_convention) == ("0.5:1:2", "half-open") == (
        record["train"]["routing"]["route"], recorded(record, "route_convention"))
    assert recorded({"train": {"routing": {"route": ""}}}, "route_convention") == "half-open"
    assert recorded({}, "route_convention", "x") == "x"  # weights without a run record
    shutil.copytree(FIXTURE, tmp_path / "rec")
    r = cli("run", "--resume", "--out", tmp_path / "rec" / "run", "--latents", tmp_path / "rec" / "store",
            "--max-steps", 5, "--device", "cpu", "--print-config")
    assert r.exit_code == 0 and 'route = "0.5:1:2"\nroute-convention = "half-open"' in r.output, r.output


@pytest.mark.parametrize(("route", "says"), [
    (["0.5:1:4"], f"--route 0.5:1:4: END 4 is beyond {MODEL}'s last block, 3 (0-based, blocks 0..3); choose "
                  "END <= 3"),
    (["1.5:1:3"], "RATE 1.5 is outside (0, 1)"),
    (["0.5:3:1"], "START 3 must be >= 0 and at most END 1"),
    (["0.5:1:5", "--route-convention", "half-open"],
     f"--route 0.5:1:5 (--route-convention half-open): END 5 is beyond {MODEL}'s 4 blocks; choose END <= 4"),
    (["", "--route-convention", "half-open"], "--route-convention without --route"),
    (["0.5:1:2", "--route-convention", "paper"], "Invalid value for '--route-convention'"),
])
def test_refusals_are_one_line_and_write_nothing(store, tmp_path, route, says):
    r = cli(*run_args(store, tmp_path / "r", "--max-steps", 1, "--route", *route, model=MODEL))
    assert r.exit_code != 0 and says in one_error_line(r.output), r.output
    assert not (tmp_path / "r").exists()


def test_print_config_carries_the_route(store, tmp_path):
    r = cli(*run_args(store, tmp_path / "r", *ROUTE, "--print-config", model=MODEL))
    assert r.exit_code == 0, r.output
    assert '[routing]\nroute = "0.5:1:2"\nroute-convention = "tread"' in r.output



def test_compiled_blocks_with_routing_match_eager(store, tmp_path):
    """--compile blocks under --route: each block compiled once for the full and once for the kept
    sequence; the losses of eager within test_compile's stated tolerance."""
    from test_compile import RTOL

    common = ["--max-steps", 2, "--lr", "1e-3", "--loader", "resident", "--logger", "jsonl", *ROUTE]
    for out, flags in (("eager", ["--no-compile"]), ("blocks", ["--compile", "blocks"])):
        r = cli(*run_args(store, tmp_path / out, *common, *flags, model=MODEL))
        assert r.exit_code == 0, r.output
    a, b = losses(tmp_path / "eager"), losses(tmp_path / "blocks")
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2]
    np.testing.assert_allclose([loss for _, loss in b], [loss for _, loss in a], rtol=RTOL)


# ----------------------------------------------------------------------------- route guidance at sampling


def _hand_draw(gen: torch.Generator, n: int, tokens: int, rate: float) -> torch.Tensor:
    """The reference's Router.get_mask (num_keep = T - int(T * rate) of a uniform argsort), kept in
    ascending order as training keeps them."""
    keep = tokens - int(tokens * rate)
    return torch.rand(n, tokens, generator=gen).argsort(dim=1)[:, :keep].sort(dim=1).values


def test_route_guidance_is_sample_treads_combination_by_hand():
    """TREAD's rf.py sample_tread: v = v(gamma2) + s (v(gamma1) - v(gamma2)), each pass routed through
    the run's blocks with its own random kept tokens, both passes with the null class; the guided
    channels are x's, ddpm's variance channels come from the strong pass."""
    from dittrain.inference.route_guidance import route_guided

    model = _model().eval()
    x, t, y = _inputs()
    null = {"y": torch.full_like(y, 3)}
    fn = route_guided(model, Route(0.5, 1, 2), (0.25, 0.75), 1.5, null, generator=torch.Generator().manual_seed(4))
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        out = fn(x, t)
        strong, weak = _hand_draw(gen, 3, 16, 0.25), _hand_draw(gen, 3, 16, 0.75)
        assert strong.shape == (3, 12) and weak.shape == (3, 4)
        v1 = _by_hand(model, x, t, null["y"], 1, 2, strong)
        v2 = _by_hand(model, x, t, null["y"], 1, 2, weak)
        want = torch.cat([(v2 + 1.5 * (v1 - v2))[:, :3], v1[:, 3:]], dim=1)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        assert out.shape == (3, 6, 8, 8) and not torch.allclose(fn(x, t), out)  # new tokens every call


def _count_forwards(monkeypatch) -> list[tuple]:
    """Every DiT forward from now on appends (its labels, the kept tokens per sample or None)."""
    seen: list = []
    forward = DiT.forward

    def counting(self, x, t, y=None, *args, route=None, **kwargs):
        seen.append((y.tolist(), None if route is None else route.idx.shape[1]))
        return forward(self, x, t, y, *args, route=route, **kwargs)

    monkeypatch.setattr(DiT, "forward", counting)
    return seen


@pytest.mark.parametrize(("cond", "labels"), [("null", [3, 3]), ("cond", [1, 1])])
def test_dittrain_sample_route_guidance(store, tmp_path, monkeypatch, cond, labels):
    out = tmp_path / "r"
    assert cli(*run_args(store, out, "--max-steps", 1, "--logger", "jsonl", *ROUTE, model=MODEL)).exit_code == 0
    seen = _count_forwards(monkeypatch)
    r = cli("sample", "--ckpt", out, "--out", tmp_path / "g.png", "--n", 2, "--steps", 3, "--device", "cpu",
            "--class", 1, "--route-guidance", "0.3,0.7", "--route-guidance-cond", cond)  # --cfg: TREAD's 1.5
    assert r.exit_code == 0, r.output
    assert_has(r.output, f"route guidance 0.3 (strong) / 0.7 (weak) at 1.5 on the run's route 0.5:1:2 (tread: "
                         f"blocks 1-2), {cond} condition in both passes")
    # 3 ddpm steps, each a strong pass (16 - int(16 x 0.3) = 12 tokens kept) then a weak one (5), no CFG pair
    assert seen == [(labels, 12), (labels, 5)] * 3
    meta = json.loads((tmp_path / "g" / "samples.json").read_text())
    assert meta["route_guidance"] == {"rates": [0.3, 0.7], "scale": 1.5, "route": "0.5:1:2",
                                      "route_convention": "tread", "cond": cond}


def test_route_guidance_refusals_are_one_line(store, tmp_path):
    plain, routed_run = tmp_path / "plain", tmp_path / "routed"
    assert cli(*run_args(store, plain, "--max-steps", 1, "--logger", "jsonl", model=MODEL)).exit_code == 0
    assert cli(*run_args(store, routed_run, "--max-steps", 1, "--logger", "jsonl", *ROUTE, model=MODEL)).exit_code == 0
    common = ["sample", "--out", tmp_path / "g.png", "--n", 1, "--steps", 2, "--device", "cpu", "--class", 0]
    for run, extra, says in (
        (plain, ["--route-guidance", "0.3,0.7"], "this run has no --route"),
        (routed_run, ["--route-guidance", "0.3"], "give STRONG,WEAK, two selection rates in [0, 1)"),
        (routed_run, ["--route-guidance", "1,0.5"], "give STRONG,WEAK"),
        (routed_run, ["--route-guidance", "nan,0.5"], "give STRONG,WEAK"),
        (routed_run, ["--route-guidance", "0.3,0.7", "--npz", tmp_path / "s.npz"], "not --npz"),
    ):
        r = cli(*common, "--ckpt", run, *extra)
        assert r.exit_code != 0 and says in one_error_line(r.output), r.output
    assert not (tmp_path / "g.png").exists()
