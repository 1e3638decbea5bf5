"""attention_backend: which scaled_dot_product_attention kernel the DiT's self-attention runs.
On the CPU the answer is checked against the aten op that really runs; the CUDA answers
(flash / efficient / cudnn) need a GPU and are exercised by the GPU bench."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dittrain.model.attention import SDPA_BACKENDS, attention_backend, attention_backends_available, attention_kernel
from dittrain.model.dit import Attention
from dittrain.model.sizes import get_config

CPU_NAMES = {"cpu-flash", "math"}


class OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def kernel_that_ran(attn: Attention, x) -> str:
    with OpRecorder() as rec:
        attn(x)
    return "cpu-flash" if "_scaled_dot_product_flash_attention_for_cpu" in rec.ops else "math"


def sdpa_state():
    return (torch._C._get_sdp_priority_order(), torch.backends.cuda.flash_sdp_enabled(),
            torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled(),
            torch.backends.cuda.cudnn_sdp_enabled())


@pytest.mark.parametrize("name", ["DiT-S/2", "DiT-B/2", "DiT-L/2", "DiT-XL/2"])  # head dims 64, 64, 64, 72
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_answer_is_a_known_kernel(name, dtype):
    cfg = get_config(name)
    assert attention_backend(cfg, 2, dtype) in CPU_NAMES
    available = attention_backends_available(cfg, 2, dtype)
    assert "math" in available and set(available) <= CPU_NAMES
    assert available[0] == attention_backend(cfg, 2, dtype)  # the first in torch's priority order


@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_answer_is_what_runs(qk_norm):
    cfg = get_config("custom:hidden=128,depth=1,heads=2,patch=2", input_size=8, qk_norm=qk_norm)
    attn = Attention(cfg.hidden_size, cfg.num_heads, qk_norm=qk_norm)
    x = torch.randn(3, cfg.num_tokens, cfg.hidden_size)
    assert attention_backend(cfg, 3) == kernel_that_ran(attn, x)
    with attention_kernel("math"):
        assert attention_backend(cfg, 3) == "math" == kernel_that_ran(attn, x)


def test_math_kernel_gives_the_same_outputs():
    torch.manual_seed(0)
    cfg = get_config("DiT-S/2", input_size=8)
    attn = Attention(cfg.hidden_size, cfg.num_heads)
    x = torch.randn(2, cfg.num_tokens, cfg.hidden_size)
    fused = attn(x)
    with attention_kernel("math"):
        math = attn(x)
    torch.testing.assert_close(fused, math, rtol=1e-5, atol=1e-5)


def test_side_effect_free_and_names():
    before = sdpa_state()
    cfg = get_config("DiT-XL/2")
    attention_backend(cfg, 4, torch.bfloat16)
    attention_backends_available(cfg, 4, torch.bfloat16)
    with attention_kernel("math"):
        pass
    assert sdpa_state() == before
    assert {"flash", "efficient", "cudnn", "math", "cpu-flash"} <= set(SDPA_BACKENDS)
    with pytest.raises(ValueError, match="unknown attention kernel"):
        attention_kernel("xformers")
