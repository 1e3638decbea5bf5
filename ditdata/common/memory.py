"""Out of GPU memory as one line: what ran, at which batch and precision, how full the device
was, and the options that lower it.

    with out_of_memory_hint(what="training DiT-XL/2", batch="global batch 256 (micro-batch 64 x 4
                            accumulation)", precision=torch.bfloat16, device=device,
                            hints=["--grad-checkpointing selective", "--optimizer adamw8bit"]):
        ...                                   # torch.OutOfMemoryError -> OutOfGpuMemory (a UserError):

    out of GPU memory (cuda:0, 79.1 of 80.0 GiB in use, 2.00 GiB more asked for) training DiT-XL/2
    at global batch 256 (micro-batch 64 x 4 accumulation), bf16: lower it with
    --grad-checkpointing selective or --optimizer adamw8bit

An out-of-memory error that no such block names (ditdata.common.cli) gets the same first part
and a general hint. torch is never imported here: an error can only be torch's when torch is
already loaded (sys.modules).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ditdata.common.errors import UserError

_ASKED = re.compile(r"Tried to allocate ([0-9.]+ ?[KMGTP]?i?B)")
GENERAL_HINT = "use a smaller --batch-size or a smaller model"


class OutOfGpuMemory(UserError):
    """The device ran out of memory; the message names what ran and what lowers it."""


def is_out_of_memory(e: BaseException) -> bool:
    """Whether `e` is torch's out-of-memory error (torch.OutOfMemoryError, alias
    torch.cuda.OutOfMemoryError); False when torch is not loaded."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                              getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)) if isinstance(t, type))
    return bool(types) and isinstance(e, types)


def precision_name(dtype) -> str:
    """An autocast dtype (None: fp32) or a name as the flags write it: bf16, fp16, fp32."""
    if dtype is None:
        return "fp32"
    if isinstance(dtype, str):
        return dtype
    return {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}.get(str(dtype), str(dtype))


def memory_in_use(device=None) -> str | None:
    """'cuda:0, 79.1 of 80.0 GiB in use' for a CUDA device (default: the current one); None
    for other devices, without torch or CUDA, or when the driver cannot say."""
    if "torch" not in sys.modules:  # nothing ran on a GPU: do not import torch for a message
        return None
    from ditdata.common.devices import gpu_memory

    torch = sys.modules["torch"]
    memory = gpu_memory(device)
    if memory is None:
        return None
    dev = torch.device("cuda") if device is None else torch.device(device)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    free, total = memory
    return f"{dev}, {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use"


def out_of_memory_message(e: BaseException, *, what: str | None = None, batch: str | None = None,
                          precision="", hints: Sequence[str] = (), device=None, see: str = "") -> str:
    """The one line (module docstring). precision: an autocast dtype (None: fp32) or a name;
    "" (unknown) leaves it out. Without `hints`, GENERAL_HINT. see: a last clause after "; "
    (where to find more, e.g. the command that plans what fits)."""
    asked = _ASKED.search(str(e))
    facts = [f for f in (memory_in_use(device), asked and f"{asked.group(1)} more asked for") if f]
    line = "out of GPU memory" + (f" ({', '.join(facts)})" if facts else "")
    if what:
        line += f" {what}"
    if batch:
        line += f" at {batch}"
    if precision != "":
        line += f", {precision_name(precision)}"
    hints = [h for h in hints if h]
    tail = f"; {see}" if see else ""
    if not hints:
        return f"{line}: {GENERAL_HINT}{tail}"
    listed = hints[0] if len(hints) == 1 else f"{', '.join(hints[:-1])} or {hints[-1]}"
    return f"{line}: lower it with {listed}{tail}"


@contextmanager
def out_of_memory_hint(*, what: str, batch: str | None = None, precision="", hints: Sequence[str] = (),
                       device=None, see: str = "", error: type[UserError] = OutOfGpuMemory) -> Iterator[None]:
    """Inside the block, torch's out-of-memory error becomes `error` with the one line of
    out_of_memory_message (the original is its __cause__: DITKIT_DEBUG=1 shows it); anything
    else passes unchanged. precision: the autocast dtype (None: fp32) or its name."""
    try:
        yield
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        raise error(out_of_memory_message(e, what=what, batch=batch, precision=precision, hints=hints,
                                          device=device, see=see)) from e


def halved(flag: str, value: int) -> str | None:
    """'--batch-size 16' for value 32: the flag at half its value; None when it is already 1."""
    return f"{flag} {value // 2}" if value > 1 else None


__all__ = ["GENERAL_HINT", "OutOfGpuMemory", "halved", "is_out_of_memory", "memory_in_use",
           "out_of_memory_hint", "out_of_memory_message", "precision_name"]
