"""Which scaled_dot_product_attention kernel the DiT's self-attention runs.

    attention_backend(config, batch, dtype, device)             "flash", "efficient", "cudnn", "math",
                                                                "cpu-flash"
    attention_backends_available(config, batch, dtype, device)  every kernel that can run it
    with attention_kernel("efficient"): ...                     force one (timing, tests)

The answers come from torch's own dispatcher on tensors shaped as dittrain.model.dit.Attention
makes them; no kernel runs.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from dittrain.model.parts import POSITIONS
from dittrain.model.sizes import DiTConfig

# torch's SDPBackend -> the name attention_backend reports; on the CPU torch's FLASH_ATTENTION
# is its own fused kernel (not Dao's), reported as "cpu-flash"
_SDPA_NAMES = {
    SDPBackend.FLASH_ATTENTION: "flash",
    SDPBackend.EFFICIENT_ATTENTION: "efficient",
    SDPBackend.CUDNN_ATTENTION: "cudnn",
    SDPBackend.MATH: "math",
    SDPBackend.OVERRIDEABLE: "overrideable",
}
SDPA_BACKENDS = {**{name: backend for backend, name in _SDPA_NAMES.items()}, "cpu-flash": SDPBackend.FLASH_ATTENTION}


def _self_attention_qkv(config: DiTConfig, batch_size: int, dtype: torch.dtype, device, requires_grad: bool):
    # q, k, v as Attention.forward makes them: views of one (N, T, 3D) tensor, (N, heads, T, head_dim)
    # with the strides of that permute (QK-norm and a rotary position part, RoPE, make q and k contiguous copies). torch.empty:
    # the choice looks at shapes, strides, dtype and device, never at values
    N, T, D, H = batch_size, config.num_tokens, config.hidden_size, config.num_heads
    qkv = torch.empty(N, T, 3 * D, dtype=dtype, device=device, requires_grad=requires_grad)
    q, k, v = qkv.reshape(N, T, 3, H, D // H).permute(2, 0, 3, 1, 4).unbind(0)
    if config.qk_norm or POSITIONS[config.pos].rotary is not None:
        q, k = q.contiguous(), k.contiguous()
    return q, k, v


def _sdpa_choice(q, k, v, device) -> str:
    # aten._fused_sdp_choice is the very selection F.scaled_dot_product_attention makes (same
    # checks, same priority order: torch._C._get_sdp_priority_order(), honouring sdpa_kernel)
    with torch.no_grad():
        backend = SDPBackend(torch.ops.aten._fused_sdp_choice(q, k, v))
    name = _SDPA_NAMES.get(backend, str(backend))
    return "cpu-flash" if name == "flash" and torch.device(device).type == "cpu" else name


def attention_backend(config: DiTConfig, batch_size: int, dtype: torch.dtype = torch.float32, device="cpu",
                      requires_grad: bool = True) -> str:
    """The scaled_dot_product_attention kernel the model's self-attention runs for this batch
    size, dtype (the autocast dtype under AMP) and device: "flash", "efficient", "cudnn" or
    "math" on CUDA, "cpu-flash" or "math" on the CPU. Asks torch's own dispatcher (no kernel
    runs; it allocates the (N, T, 3D) qkv tensor uninitialised, once). requires_grad: the
    training case (some kernels lack a backward for some head dims / GPUs). Honours an
    enclosing torch.nn.attention.sdpa_kernel(...)."""
    q, k, v = _self_attention_qkv(config, batch_size, dtype, device, requires_grad)
    return _sdpa_choice(q, k, v, device)


def attention_backends_available(config: DiTConfig, batch_size: int, dtype: torch.dtype = torch.float32,
                                 device="cpu", requires_grad: bool = True) -> list[str]:
    """The kernels that can run the model's self-attention at this shape, in torch's priority
    order (the first is attention_backend's answer unless sdpa_kernel restricts it). Force one
    for timing with `with attention_kernel(name):`."""
    q, k, v = _self_attention_qkv(config, batch_size, dtype, device, requires_grad)
    order = [SDPBackend(i) for i in torch._C._get_sdp_priority_order()]
    available = []
    for backend in order:
        if backend not in _SDPA_NAMES:
            continue
        try:
            with sdpa_kernel([backend]):
                name = _sdpa_choice(q, k, v, device)
        except RuntimeError:  # "No available kernel": this one cannot run these inputs
            continue
        if SDPA_BACKENDS[name] == backend:
            available.append(name)
    return available


def attention_kernel(name: str):
    """A context manager that lets scaled_dot_product_attention use only the named kernel
    (a name attention_backend returns); inside it, an attention that kernel cannot run raises."""
    if name not in SDPA_BACKENDS:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {', '.join(SDPA_BACKENDS)}")
    return sdpa_kernel([SDPA_BACKENDS[name]])


__all__ = ["SDPA_BACKENDS", "attention_backend", "attention_backends_available", "attention_kernel"]
