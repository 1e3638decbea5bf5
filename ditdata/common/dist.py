"""torchrun's environment, read in one place, and the process group's join and leave.

    env = launch_env()                 # rank, world_size, local_rank, local_world_size
    with process_group(device) as joined:   # joined only when WORLD_SIZE > 1 and none exists
        ...
"""

from __future__ import annotations

import datetime as dt
import os
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place among those torchrun started (see launch_env)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


# torchrun's variables (LaunchEnv's fields, upper-cased) and their values in a single process
_TORCHRUN = {"RANK": 0, "WORLD_SIZE": 1, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 1}


def launch_env() -> LaunchEnv:
    """RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE as torchrun sets them (a single
    process without them)."""
    return LaunchEnv(**{name.lower(): int(os.environ.get(name, default)) for name, default in _TORCHRUN.items()})


def join(device, timeout: dt.timedelta | None = None) -> bool:
    """Join the process group (nccl on CUDA, gloo elsewhere) when torchrun started several
    processes and none is joined yet; True when this call created it (and so must leave it)."""
    import torch.distributed as dist

    if not launch_env().distributed or not dist.is_available() or dist.is_initialized():
        return False
    backend = "nccl" if getattr(device, "type", str(device)).startswith("cuda") else "gloo"
    kwargs = {"timeout": timeout} if timeout is not None else {}
    dist.init_process_group(backend, **kwargs)
    return True


def leave(created: bool) -> None:
    """Leave the group this process created: a gloo rank that exits with the group open can
    die at shutdown when its peer closes first."""
    import torch.distributed as dist

    if created and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def process_group(device, timeout: dt.timedelta | None = None):
    """join() for the block, leave() after it; yields whether this process created the group."""
    created = join(device, timeout)
    try:
        yield created
    finally:
        leave(created)
