"""``DistributedDataParallel``: torch's DDP whose gradient all_reduce goes
through the :class:`rallypoint.ft.Manager` (torchft's
``torchft.ddp.DistributedDataParallel``, no torchft).

torch's DDP is built over :class:`_Dummy`, a process group of one process
that completes every op at once without communicating: it absorbs DDP's
start-up checks and broadcast (the replicas' states are made equal by the
Manager instead, at the first step: ``init_sync``). Each gradient bucket then
goes through a comm hook calling ``manager.allreduce(bucket.buffer())``, the
average over the replicas taking part in the step, whose future never fails
(a failed step is not committed by ``should_commit`` instead).

``find_unused_parameters=True`` is passed, as torchft does: it keeps the
reducer from rebuilding its buckets after the first step, which a healed
replica would do differently from the others (their buckets, and so their
all_reduce calls, would no longer match). ``PureDistributedDataParallel``
(torchft's too) does one all_reduce per parameter, without a reducer.

Inside a replica group of several processes, gradients are averaged across
the replica groups per group rank (one cross-replica group per group rank,
torchft's HSDP "replicate" dimension); a model sharded inside the group is
the user's (FSDP over the group's own process group), as with torchft.
"""

from typing import List

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import parallel

from rallypoint.ft._work import _Done

__all__ = ["DistributedDataParallel", "PureDistributedDataParallel"]


class _Dummy(dist.ProcessGroup):
    """A process group of one process whose ops complete at once (module doc)."""

    def __init__(self) -> None:
        super().__init__(0, 1)

    def getBackendName(self) -> str:
        return "rallypoint-ft-dummy"

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def allgather(self, output_tensors: List[List[torch.Tensor]], input_tensor: List[torch.Tensor], opts=None):
        for o, i in zip(output_tensors[0], input_tensor):
            o.copy_(i)
        return _Done(output_tensors)

    def allgather_into_tensor_coalesced(self, output_tensors, input_tensors, opts=None):
        for o, i in zip(output_tensors, input_tensors):
            o.copy_(i)
        return _Done(output_tensors)

    def _allgather_base(self, output, input, opts=None):
        output.copy_(input)
        return _Done([output])

    def allreduce(self, tensors, opts=None):
        return _Done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return _Done(tensors)

    def broadcast(self, tensor_list, opts=None):
        return _Done(tensor_list)

    def barrier(self, opts=None):
        return _Done(None)


class DistributedDataParallel(parallel.DistributedDataParallel):
    """``module`` under torch's DDP, its gradients averaged by ``manager``."""

    def __init__(self, manager, module: nn.Module, **kwargs: object) -> None:
        for key in ("process_group", "find_unused_parameters", "device_mesh"):
            if key in kwargs:
                raise ValueError(f"rallypoint.ft: DistributedDataParallel sets {key} itself (see rallypoint.ft.ddp's doc)")
        super().__init__(module, process_group=_Dummy(), find_unused_parameters=True, **kwargs)
        self.register_comm_hook(manager, self._comm_hook)

    @staticmethod
    def _comm_hook(manager, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return manager.allreduce(bucket.buffer()).get_future()


class PureDistributedDataParallel(nn.Module):
    """One ``manager.allreduce`` per gradient as it is accumulated (no reducer;
    slow for real models, as torchft says of its own)."""

    def __init__(self, manager, module: nn.Module) -> None:
        super().__init__()
        self.module = module

        def hook(p: torch.Tensor) -> None:
            if p.grad is not None:
                manager.allreduce(p.grad).wait()

        for p in module.parameters():
            p.register_post_accumulate_grad_hook(hook)

    def forward(self, *args: object, **kwargs: object) -> object:
        return self.module(*args, **kwargs)
