"""Gradient checkpointing by part: --grad-checkpointing attn | mlp recompute one branch of
every block in the backward pass, selective recomputes every block but keeps its matmul and
attention outputs. The loss and every gradient equal the plain model's (with DiT's blocks and
with LightningDiT's, whose rotary table every checkpoint passes on), the chosen part (and only
it) runs again during backward, and less is kept for backward."""

from __future__ import annotations

import pytest
import torch
from tiny import assert_grads_close, backward_each

import dittrain.model.dit as model_mod
from dittrain.model.checkpointing import block_recompute, checkpoint_branch, checkpoint_every
from dittrain.model.dit import build_model
from dittrain.model.sizes import LIGHTNING, get_config

TEXT = 24  # a text model: the attention branch holds the cross-attention too
MODES = ["none", "attn", "mlp", "every", 2, "selective"]


def tiny(granularity, **blocks):
    torch.manual_seed(0)  # the same initial weights for every mode
    return build_model("DiT-T/2", **{**dict(input_size=8, in_channels=4, num_classes=10, hidden_size=64, depth=3,
                                            num_heads=4, qk_norm=True, text_token_dim=TEXT), **blocks},
                       grad_checkpointing=granularity).train()


def perturbed(model):
    """`model` with the same noise added to every weight but pos_embed, whatever the mode
    (adaLN-Zero makes a fresh model's block gradients exactly zero, which would compare nothing)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "pos_embed":
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def randomized(granularity, **blocks):
    """The same non-zero weights for every mode."""
    return perturbed(tiny(granularity, **blocks))


def batch():
    g = torch.Generator().manual_seed(1)
    return dict(x=torch.randn(3, 4, 8, 8, generator=g), t=torch.tensor([0.0, 412.5, 999.0]),
                y=torch.tensor([0, 7, 10]), text_tokens=torch.randn(3, 5, TEXT, generator=g),
                text_mask=torch.tensor([[True] * 5, [True, True, False, False, False], [False] * 5]),
                force_drop_ids=torch.tensor([0, 1, 0]))


def loss_of(model):
    return (model(**batch()) ** 2).mean()


def test_knob_validation():
    assert [checkpoint_every(m) for m in MODES] == [0, 0, 0, 1, 2, 0]
    assert [checkpoint_branch(m) for m in MODES] == [None, "attn", "mlp", None, None, None]
    assert [block_recompute(m) for m in MODES] == [None, "attn", "mlp", None, None, "selective"]
    assert get_config("DiT-T/2", grad_checkpointing="mlp").grad_checkpointing == "mlp"
    assert get_config("DiT-T/2", grad_checkpointing="selective").grad_checkpointing == "selective"
    for bad in ("ffn", "Selective", "selective-fc1"):
        with pytest.raises(ValueError, match="'attn', 'mlp' or 'selective'"):
            get_config("DiT-T/2", grad_checkpointing=bad)


@pytest.mark.parametrize("blocks", [{}, LIGHTNING], ids=["dit", "lightning"])
@pytest.mark.parametrize("mode", MODES[1:])
def test_same_loss_and_gradients(mode, blocks):
    ref, ckpt = randomized("none", **blocks), randomized(mode, **blocks)
    losses = backward_each(loss_of, ref, ckpt)
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    grads = assert_grads_close(ref, ckpt, rtol=1e-6, atol=1e-7)
    assert grads > 30  # the comparison covers real gradients of every block


def forward_calls(mode) -> dict[str, tuple[int, int]]:
    """{branch module: (forward calls during forward, during backward)} summed over blocks.
    Counted as the call starts: a recomputation stops as soon as it has rebuilt every saved
    tensor (torch's early stop), which may be inside the region's last module."""
    model = randomized(mode)
    calls = {"attn": [0, 0], "cross_attn": [0, 0], "mlp": [0, 0]}
    phase = [0]
    for block in model.blocks:
        for name in calls:
            getattr(block, name).register_forward_pre_hook(lambda *_, name=name: calls[name].__setitem__(
                phase[0], calls[name][phase[0]] + 1))
    loss = loss_of(model)
    phase[0] = 1
    loss.backward()
    return {k: tuple(v) for k, v in calls.items()}


@pytest.mark.parametrize("mode, recomputed", [
    ("none", ()), ("attn", ("attn", "cross_attn")), ("mlp", ("mlp",)), ("every", ("attn", "cross_attn", "mlp")),
    ("selective", ("attn", "cross_attn", "mlp")),  # every module reruns; its matmuls come from the cache
])
def test_the_branch_is_recomputed_in_backward(mode, recomputed):
    depth = 3
    calls = forward_calls(mode)
    assert calls == {k: (depth, depth if k in recomputed else 0) for k in calls}


def saved_bytes(mode) -> int:
    """Bytes autograd keeps for the backward pass of one forward (distinct storages)."""
    model = randomized(mode)
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_of(model)
    return sum(kept.values())


def test_checkpointing_keeps_less():
    kept = {mode: saved_bytes(mode) for mode in ("none", "attn", "mlp", "every")}
    assert kept["every"] < min(kept["attn"], kept["mlp"])
    assert max(kept["attn"], kept["mlp"]) < kept["none"]


def kept_activation_bytes(mode, recompute_width=None) -> int:
    """Bytes of activations one forward keeps for backward: what autograd saves and what selective
    checkpointing caches (both reach saved_tensors_hooks), plus the inputs every checkpointed
    region holds on to; distinct storages, parameters left out."""
    model = randomized(mode)
    for block in model.blocks:
        block.selective_recompute_width = recompute_width
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    real = model_mod.checkpoint

    def recording(fn, *args, **kwargs):
        for a in args:
            pack(a)
        return real(fn, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mp.setattr(model_mod, "checkpoint", recording)
        loss_of(model)
    return sum(kept.values())


def test_selective_keeps_between_every_and_none():
    kept = {mode: kept_activation_bytes(mode) for mode in ("none", "every", "selective")}
    assert kept["every"] < kept["selective"] < kept["none"]
    # it keeps the matmul outputs: at least qkv (3D), proj, fc1 (4D) and fc2 per token per block
    n, T, D, depth = 3, 16, 64, 3
    assert kept["selective"] - kept["every"] >= depth * n * T * 9 * D * 4
    # the variant that recomputes fc1 too keeps less (its (N, T, 4D) output per block)
    fc1 = kept_activation_bytes("selective", recompute_width=4 * D)
    assert kept["selective"] - fc1 >= depth * n * T * 4 * D * 4


def test_selective_variant_same_gradients():
    ref, sel = randomized("none"), randomized("selective")
    for block in sel.blocks:
        block.selective_recompute_width = block.mlp.fc1.out_features
    for m in (ref, sel):
        loss_of(m).backward()
    for (name, p), q in zip(ref.named_parameters(), sel.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.slow  # inductor compiles one block graph (the blocks share it), forward and backward
def test_compiled_blocks_with_selective_checkpointing():
    """Regional compilation (each DiTBlock compiled, as bench/gpu_train.py plans): the selective
    checkpoint is traced into the compiled block and the gradients stay those of eager "none".
    Cross-attention and QK-norm off, to keep the one compilation short."""
    torch._dynamo.reset()
    models = []
    for mode in ("none", "selective"):
        torch.manual_seed(0)
        m = build_model("DiT-T/2", input_size=8, in_channels=4, num_classes=10, hidden_size=64, depth=2,
                        num_heads=4, grad_checkpointing=mode).train()
        models.append(perturbed(m))
    ref, sel = models
    for block in sel.blocks:
        block.compile(fullgraph=True)  # fullgraph: the checkpoint must not break the graph
    b = batch()
    del b["text_tokens"], b["text_mask"]
    losses = backward_each(lambda m: (m(**b) ** 2).mean(), ref, sel)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(ref.named_parameters(), sel.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
