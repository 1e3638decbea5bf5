"""Gradient checkpointing: which activations the DiT recomputes in the backward pass.

The knob (DiTConfig.grad_checkpointing, `dittrain run --grad-checkpointing`):

    "none"                 keep everything
    "every" | k            checkpoint whole blocks: every block, or every k-th (DiT.forward)
    "attn" | "mlp"         recompute that branch of every block (DiTBlock.forward)
    "selective"            every block, keeping its matmul and attention outputs: only
                           element-wise work is recomputed (the policy below)

checkpoint_every / checkpoint_branch / block_recompute read the knob; the selective policy
is a torch.utils.checkpoint context. The checkpoint calls themselves are in dittrain.model.dit.
"""

from __future__ import annotations

import inspect

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ditdata.common.errors import UserError
from dittrain.config import CHECKPOINT_BRANCHES, CHECKPOINT_SELECTIVE

# checkpoint(respect_saved_tensors_hooks=True) (newer torch): saved-tensors hooks (save_on_cpu,
# bench/activation_memory.py's counter) see what a selective policy keeps; older torch has no
# such argument, and the policy works the same without it.
SAC_HOOKS = ({"respect_saved_tensors_hooks": True}
             if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters else {})


class GradCheckpointingError(UserError, ValueError):
    """A grad_checkpointing value that is none of the knob's (one line)."""


def checkpoint_every(granularity: str | int | None) -> int:
    """The grad_checkpointing knob as "checkpoint every k-th block" (0 = never; a branch
    knob, "attn" or "mlp", and "selective" checkpoint no whole block: see block_recompute)."""
    if granularity in (None, "none", 0, False) or granularity in (*CHECKPOINT_BRANCHES, CHECKPOINT_SELECTIVE):
        return 0
    if granularity == "every":
        return 1
    if isinstance(granularity, int) and granularity > 0:
        return granularity
    if isinstance(granularity, str) and granularity.isdigit() and int(granularity) > 0:
        return int(granularity)
    raise GradCheckpointingError(f"grad_checkpointing must be 'none', 'every', k >= 1, 'attn', 'mlp' or 'selective', "
                     f"got {granularity!r}")


def checkpoint_branch(granularity: str | int | None) -> str | None:
    """The branch every block recomputes in the backward pass: "attn" (norm1, modulate,
    self-attention and the text cross-attention), "mlp" (norm2, modulate, MLP), or None."""
    checkpoint_every(granularity)  # validates the knob
    return granularity if granularity in CHECKPOINT_BRANCHES else None


def block_recompute(granularity: str | int | None) -> str | None:
    """What DiTBlock.forward's `recompute` gets for this knob: "attn", "mlp", "selective" or None
    (whole-block checkpointing, "every" / k, is done around the block by DiT.forward)."""
    if granularity == CHECKPOINT_SELECTIVE:
        return CHECKPOINT_SELECTIVE
    return checkpoint_branch(granularity)


# -----------------------------------------------------------------------------
# Selective activation checkpointing

_aten = torch.ops.aten
# The ops whose outputs selective checkpointing keeps: the matmuls (nn.Linear reaches the
# dispatcher as addmm / mm, batched products as bmm / baddbmm) and every fused SDPA kernel
# (their outputs include the logsumexp the attention backward needs). Recomputing these
# would cost as much as the forward itself; what is left to recompute (LayerNorm, modulate,
# GELU, gates, residual adds, chunk/views) is element-wise, cheap in FLOPs.
SELECTIVE_SAVE_OPS = frozenset(
    op.default
    for op in (
        _aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten._scaled_mm,
        _aten._scaled_dot_product_flash_attention,
        _aten._scaled_dot_product_efficient_attention,
        _aten._scaled_dot_product_cudnn_attention,
        _aten._scaled_dot_product_flash_attention_for_cpu,
        _aten._scaled_dot_product_fused_attention_overrideable,
    )
)


def selective_checkpoint_policy(recompute_width: int | None = None):
    """The policy of grad_checkpointing="selective": MUST_SAVE the outputs of SELECTIVE_SAVE_OPS,
    PREFER_RECOMPUTE everything else (PREFER: torch.compile's partitioner may still choose to
    keep a fused element-wise result; MUST: it may not drop a matmul output).

    recompute_width: also recompute the matmuls whose output's last dim is this width (the
    MLP's fc1, mlp_ratio * D wide: 4 of the ~10 D-wide tensors kept per token and block;
    matched by width, so with mlp_ratio 3 it would catch qkv as well).

    The knob keeps EVERY matmul output (recompute_width=None), measured on DiT-S/2, 32x32
    latents, batch 16, fp32 (bench/activation_memory.py; bench/RESULTS.md, issue 17): it keeps
    0.56x the activations of "none" (814 of 1463 MiB), about what checkpointing every 2nd
    block keeps (0.53x), but recomputes no matmul at all where "2" recomputes half the model's
    forward (+17% of the step's FLOPs): the same memory for only element-wise recompute.
    Recomputing fc1 too keeps 0.36x (526 MiB) for +10% of the step's FLOPs (fc1 is a third of
    a block's forward); that is a different trade, below "mlp" in both memory (0.46x) and
    recompute (+20%), and stays a bench variant (DiTBlock.selective_recompute_width) until a
    GPU measurement says whether it earns a knob value of its own.
    An SDPA output includes its logsumexp ((N, heads, T) fp32), which the backward needs.
    """

    def policy(ctx, func, *args, **kwargs):
        if func in SELECTIVE_SAVE_OPS:
            out = getattr(ctx, "op_output", None)
            if recompute_width is not None and isinstance(out, torch.Tensor) and out.shape[-1] == recompute_width:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_checkpoint_context(recompute_width: int | None = None):
    """A `context_fn` for torch.utils.checkpoint.checkpoint with the selective policy."""
    return create_selective_checkpoint_contexts(selective_checkpoint_policy(recompute_width))


__all__ = ["CHECKPOINT_BRANCHES", "CHECKPOINT_SELECTIVE", "GradCheckpointingError", "SAC_HOOKS", "SELECTIVE_SAVE_OPS", "block_recompute",
           "checkpoint_branch", "checkpoint_every", "selective_checkpoint_context", "selective_checkpoint_policy"]
