"""Where models run and in which precision: one rule for every command of both packages.

    device = resolve_device("auto")            # cuda:LOCAL_RANK when there is a GPU, else cpu
    dtype = amp_dtype(device, "auto")          # bf16 / fp16 / None (fp32)
    with autocast(device, dtype): ...

`auto` precision is bf16 on GPUs that have it, `without_bf16` (fp16 by default) on older
GPUs, and fp32 on the CPU: CPU bf16 autocast is very slow on many processors (measured on
this project's development machine), and fp32 is what tests compare against.

    gpu_named("NVIDIA H100 80GB HBM3")         # GPUS["H100"]: its memory and dense bf16 peak
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ditdata.common.dist import launch_env
from ditdata.common.errors import UserError

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class DeviceError(UserError, ValueError):
    """An unusable --device or --precision; the message is one line that says what works."""


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """auto (or None) -> cuda:LOCAL_RANK when CUDA is available, else cpu; anything else is
    parsed and checked (DeviceError for a name torch does not know, or CUDA without a GPU)."""
    if isinstance(device, torch.device):
        return device
    if device in (None, "", "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda", launch_env().local_rank)
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise DeviceError(f"--device {device!r}: not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
    return dev


def amp_dtype(device: torch.device, precision: str = "auto", *, without_bf16: str = "fp16") -> torch.dtype | None:
    """The autocast dtype for `precision` on `device`, None for fp32 (module docstring)."""
    if precision not in PRECISIONS:
        raise DeviceError(f"precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    if precision == "auto":
        if device.type != "cuda":
            return None
        precision = "bf16" if torch.cuda.is_bf16_supported() else without_bf16
    return _DTYPES[precision]


def autocast(device: torch.device, dtype: torch.dtype | None):
    """torch.autocast for `dtype` on `device`, or a no-op for fp32 (None)."""
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def gpu_memory(device=None) -> tuple[int, int] | None:
    """(free, total) bytes of a CUDA device (default: the current one), as the driver counts them
    (torch.cuda.mem_get_info); None for other devices, without CUDA, or when the driver cannot say.
    The one place free GPU memory is read: out-of-memory lines, the loaders' budget, `dittrain plan`."""
    try:
        if not torch.cuda.is_available():
            return None
        dev = torch.device("cuda") if device is None else torch.device(device)
        if dev.type != "cuda":
            return None
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return torch.cuda.mem_get_info(dev)
    except Exception:  # the driver is in no state to answer
        return None


# ----------------------------------------------------------------------------- known GPUs


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float  # nominal memory (a "24 GB" card shows about 24,560 MiB to CUDA)
    peak_flops: float  # dense bf16/fp16 tensor-core FLOP/s (the vendor's figure)
    bf16: bool = True  # has bf16 (else --precision auto trains in fp16 with a grad scaler)


# Known cards: the dense bf16 peaks the trainer's MFU reads (dittrain.train.log) and `dittrain plan`
# sizes runs with, and the nominal memory of the usual model of each.
GPUS = {g.name: g for g in (
    Gpu("H200", 141, 989e12), Gpu("H100", 80, 989e12), Gpu("A100-80GB", 80, 312e12), Gpu("A100", 40, 312e12),
    Gpu("L40S", 48, 362e12), Gpu("RTX 4090", 24, 165e12), Gpu("RTX 3090", 24, 71e12), Gpu("A6000", 48, 155e12),
    Gpu("V100", 32, 125e12, bf16=False),
)}


def gpu_named(name: str | None) -> Gpu | None:
    """The card a device name ("NVIDIA H100 80GB HBM3") or a --gpu value ("rtx4090") names: the
    longest table name found in it, spaces and case aside."""
    if not name:
        return None
    squeezed = name.replace(" ", "").replace("-", "").lower()
    found = [g for key, g in GPUS.items() if all(part.replace(" ", "") in squeezed for part in key.lower().split("-"))]
    return max(found, key=lambda g: len(g.name)) if found else None
