"""Gradient checkpointing by part: --grad-checkpointing attn | mlp recompute one branch of
every block in the backward pass. The loss and every gradient equal the plain model's, the
chosen branch (and only it) runs again during backward, and less is kept for backward."""

from __future__ import annotations

import pytest
import torch

from dittrain.model import build_model, checkpoint_branch, checkpoint_every, get_config

TEXT = 24  # a text model: the attention branch holds the cross-attention too
MODES = ["none", "attn", "mlp", "every", 2]


def tiny(granularity):
    torch.manual_seed(0)  # the same initial weights for every mode
    return build_model("DiT-T/2", input_size=8, in_channels=4, num_classes=10, hidden_size=64, depth=3,
                       num_heads=4, qk_norm=True, text_token_dim=TEXT, grad_checkpointing=granularity).train()


def randomized(granularity):
    """The same non-zero weights for every mode (adaLN-Zero makes a fresh model's block
    gradients exactly zero, which would compare nothing)."""
    model = tiny(granularity)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "pos_embed":
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    return dict(x=torch.randn(3, 4, 8, 8, generator=g), t=torch.tensor([0.0, 412.5, 999.0]),
                y=torch.tensor([0, 7, 10]), text_tokens=torch.randn(3, 5, TEXT, generator=g),
                text_mask=torch.tensor([[True] * 5, [True, True, False, False, False], [False] * 5]),
                force_drop_ids=torch.tensor([0, 1, 0]))


def loss_of(model):
    return (model(**batch()) ** 2).mean()


def test_knob_validation():
    assert [checkpoint_every(m) for m in MODES] == [0, 0, 0, 1, 2]
    assert [checkpoint_branch(m) for m in MODES] == [None, "attn", "mlp", None, None]
    assert get_config("DiT-T/2", grad_checkpointing="mlp").grad_checkpointing == "mlp"
    with pytest.raises(ValueError, match="'attn' or 'mlp'"):
        get_config("DiT-T/2", grad_checkpointing="ffn")


@pytest.mark.parametrize("mode", MODES[1:])
def test_same_loss_and_gradients(mode):
    ref, ckpt = randomized("none"), randomized(mode)
    losses = []
    for m in (ref, ckpt):
        loss = loss_of(m)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    grads = 0
    for (name, p), q in zip(ref.named_parameters(), ckpt.parameters(), strict=True):
        if p.grad is None:
            assert q.grad is None, name
            continue
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)
        grads += bool(p.grad.abs().sum() > 0)
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
