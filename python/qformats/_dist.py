"""The torch.distributed process group that qformats' model-level tools share work over.

:func:`several_processes` (and :func:`world_size`): whether this process is one of several,
the one test the tools make (without importing torch, so that the command line checks its
arguments first). :func:`rank_device`: the device a process works on. :class:`Ranks`: this
process's rank and the world size of a process group (the default one; one process when
torch.distributed is not initialized), and the few collectives the tools use (barrier, exact
gathers and broadcasts). Nothing here reduces floating-point values: the tools that split sums
over ranks gather the partial sums and add them in an order that does not depend on the number
of ranks, so that any world size gives the bytes of one process.
"""
from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

if TYPE_CHECKING:
    import torch

__all__ = ["Ranks", "several_processes", "world_size", "rank_device"]


def world_size() -> int:
    """How many processes share the work: the size of the default process group when one is
    initialized (by the caller, or by a :class:`Ranks`), else torchrun's ``WORLD_SIZE`` (1
    when unset)."""
    # A group exists only once torch.distributed is imported: not importing it here keeps
    # torch (seconds to import) out of the command line's argument checks.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def several_processes() -> bool:
    """Whether this process is one of several: under torchrun (``WORLD_SIZE`` > 1), or in an
    initialized process group of more than one rank."""
    return world_size() > 1


def rank_device(device: Union[str, torch.device]) -> torch.device:
    """The device this process works on for ``device``: as given, except a bare ``"cuda"``,
    which is this process's GPU under several processes (torchrun's ``LOCAL_RANK``: one GPU per
    process of a machine) and CUDA's current device in one.

    Raises:
        ValueError: a CUDA device when torch sees no CUDA GPU.
    """
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: torch sees no CUDA GPU")
    if dev.index is None:
        local = os.environ.get("LOCAL_RANK")
        dev = torch.device("cuda", int(local) if local is not None and several_processes()
                           else torch.cuda.current_device())
    return dev


class Ranks:
    """A process group (``torch.distributed``'s default one, or ``group``), or one process.

    Args:
        init_from_env: when no group is initialized and torchrun's environment says
            ``WORLD_SIZE`` > 1, initialize one (``env://``) with ``backend`` and own it
            (:meth:`close` destroys it).
        backend: the backend of a group made here: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA).
        device: where the collectives' tensors live: a CUDA device for NCCL; None = CUDA's
            current device under NCCL, else the CPU.
        group: the process group (None: the default one).
    """

    def __init__(self, init_from_env: bool = False, backend: str = "gloo",
                 device: Optional[torch.device] = None, group: Any = None):
        import torch
        import torch.distributed as dist

        self.dist, self.group, self.owned = dist, group, False
        if init_from_env and not (dist.is_available() and dist.is_initialized()) \
                and several_processes():
            # env://: MASTER_ADDR, RANK... set by torchrun; NCCL told its device (no guessing)
            dev = {"device_id": torch.device(device)} if backend == "nccl" and device is not None else {}
            dist.init_process_group(backend, **dev)
            self.owned = True
        self.active = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.active else 0
        self.world = dist.get_world_size(group) if self.active else 1
        if device is None:
            nccl = self.active and dist.get_backend(group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = torch.device(device)

    def with_backend(self, backend: str, device: torch.device) -> "Ranks":
        """These ranks with their collectives on ``device`` through ``backend`` (``"gloo"``:
        CPU tensors, ``"nccl"``: CUDA ones): over this group when its backend is ``backend``
        (or there is one process), else over a new group of the same ranks made with it, which
        the result owns (:meth:`close` it before this one). Every rank must call it (making a
        group is a collective)."""
        import torch

        if not self.several or self.dist.get_backend(self.group) == backend:
            return Ranks(device=device, group=self.group)
        ranks = None if self.group is None else self.dist.get_process_group_ranks(self.group)
        kw = {"device_id": torch.device(device)} if backend == "nccl" else {}
        sub = Ranks(device=device, group=self.dist.new_group(ranks, backend=backend, **kw))
        sub.owned = True
        return sub

    @property
    def several(self) -> bool:
        """More than one process shares the work."""
        return self.world > 1

    def barrier(self, wait: Optional[Callable[[], None]] = None) -> None:
        """All ranks here; ``wait()`` is called every half second meanwhile (progress)."""
        if not self.active:
            return
        work = self.dist.barrier(group=self.group, async_op=True)
        while wait is not None and not work.is_completed():
            wait()
            time.sleep(0.5)
        work.wait()

    def gather(self, t: torch.Tensor) -> list:
        """Every rank's ``t`` (same shape and dtype on every rank), in rank order, on the
        tensor's device. One process: ``[t]``."""
        if not self.several:
            return [t]
        import torch

        x = t.to(self.device).contiguous()
        out = [torch.empty_like(x) for _ in range(self.world)]
        self.dist.all_gather(out, x, group=self.group)
        return [o.to(t.device) for o in out]

    def gather_objects(self, obj: Any) -> list:
        """Every rank's picklable ``obj``, in rank order."""
        if not self.several:
            return [obj]
        out: list = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Rank ``src``'s ``t`` on every rank (other ranks pass a tensor of the same shape and
        dtype to receive into); returned on ``t``'s device."""
        if not self.several:
            return t
        x = t.to(self.device).contiguous()
        self.dist.broadcast(x, self._global(src), group=self.group)
        return x.to(t.device)

    def _global(self, rank: int) -> int:
        """The default group's rank of this group's ``rank`` (what broadcast's ``src`` names)."""
        return rank if self.group is None else self.dist.get_global_rank(self.group, rank)

    def close(self) -> None:
        """Destroy the group if this object made it."""
        if self.owned:
            self.dist.destroy_process_group(self.group)
            self.owned = False
