"""The torch.distributed process group that qformats' model-level tools share work over.

One class, :class:`Ranks`: this process's rank and the world size of the default process group
(one process when torch.distributed is not initialized), and the few collectives the tools use
(barrier, exact gathers and broadcasts). Nothing here reduces floating-point values: the tools
that split sums over ranks gather the partial sums and add them in an order that does not depend
on the number of ranks, so that any world size gives the bytes of one process.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

import torch

__all__ = ["Ranks"]


class Ranks:
    """The default process group (``torch.distributed``), or one process.

    Args:
        init_from_env: when no group is initialized and torchrun's environment says
            ``WORLD_SIZE`` > 1, initialize one (``env://``) with ``backend`` and own it
            (:meth:`close` destroys it).
        backend: the backend of a group made here: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA).
        device: where the collectives' tensors live: a CUDA device for NCCL; None = CUDA's
            current device under NCCL, else the CPU.
    """

    def __init__(self, init_from_env: bool = False, backend: str = "gloo",
                 device: Optional[torch.device] = None):
        import torch.distributed as dist

        self.dist, self.owned = dist, False
        if init_from_env and not (dist.is_available() and dist.is_initialized()) \
                and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # env://: MASTER_ADDR, RANK... set by torchrun; NCCL told its device (no guessing)
            dev = {"device_id": torch.device(device)} if backend == "nccl" and device is not None else {}
            dist.init_process_group(backend, **dev)
            self.owned = True
        self.active = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.active else 0
        self.world = dist.get_world_size() if self.active else 1
        if device is None:
            nccl = self.active and dist.get_backend() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = torch.device(device)

    @property
    def several(self) -> bool:
        """More than one process shares the work."""
        return self.world > 1

    def barrier(self, wait: Optional[Callable[[], None]] = None) -> None:
        """All ranks here; ``wait()`` is called every half second meanwhile (progress)."""
        if not self.active:
            return
        work = self.dist.barrier(async_op=True)
        while wait is not None and not work.is_completed():
            wait()
            time.sleep(0.5)
        work.wait()

    def gather(self, t: torch.Tensor) -> list:
        """Every rank's ``t`` (same shape and dtype on every rank), in rank order, on the
        tensor's device. One process: ``[t]``."""
        if not self.several:
            return [t]
        x = t.to(self.device).contiguous()
        out = [torch.empty_like(x) for _ in range(self.world)]
        self.dist.all_gather(out, x)
        return [o.to(t.device) for o in out]

    def gather_objects(self, obj: Any) -> list:
        """Every rank's picklable ``obj``, in rank order."""
        if not self.several:
            return [obj]
        out: list = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Rank ``src``'s ``t`` on every rank (other ranks pass a tensor of the same shape and
        dtype to receive into); returned on ``t``'s device."""
        if not self.several:
            return t
        x = t.to(self.device).contiguous()
        self.dist.broadcast(x, src)
        return x.to(t.device)

    def close(self) -> None:
        """Destroy the group if this object made it."""
        if self.owned:
            self.dist.destroy_process_group()
            self.owned = False
