"""``DistributedSampler``: torch's sampler sharded across replica groups and
the ranks inside each (torchft's ``torchft.data.DistributedSampler``, same
arguments, no torchft).

The dataset is split into ``num_replicas * num_replica_groups`` shards; the
process of group rank ``g`` in replica group ``r`` reads shard
``g + num_replicas * r``. The shard depends only on the replica group's id
and the rank inside it, never on which groups are in the quorum, so no sample
is read by two processes in one step whatever the membership (a group that
is down leaves its shard unread meanwhile: the sampler is lossy, as
torchft's). ``num_replica_groups`` is the most groups the job may have; every
process must pass the same one, and the same ``seed`` and ``shuffle``.

As torch's, the sampler pads the index list (repeating its head) so that
every shard has the same length unless ``drop_last=True``; a dataset whose
length is a multiple of the shard count, or ``drop_last=True``, gives
disjoint shards. ``set_epoch(e)`` reshuffles, as torch's.
"""

from typing import Optional

import torch.distributed as dist
from torch.utils import data

__all__ = ["DistributedSampler"]


def _check(name: str, v: object, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"rallypoint.ft: DistributedSampler's {name} must be an int >= {low}, not {v!r}")
    return v


class DistributedSampler(data.distributed.DistributedSampler):
    """A shard of ``dataset`` by replica group and group rank (module doc).

    ``replica_rank``: this replica group's id (0..num_replica_groups-1);
    ``group_rank`` / ``num_replicas``: this process's rank in its group and
    the group's size (default: torch.distributed's rank and world size if
    initialised, else 0 and 1). Other keywords go to torch's sampler
    (``shuffle``, ``seed``, ``drop_last``).
    """

    def __init__(
        self,
        dataset: data.Dataset,
        replica_rank: int,
        num_replica_groups: int,
        group_rank: Optional[int] = None,
        num_replicas: Optional[int] = None,
        **kwargs: object,
    ) -> None:
        initialised = dist.is_available() and dist.is_initialized()
        if group_rank is None:
            group_rank = dist.get_rank() if initialised else 0
        if num_replicas is None:
            num_replicas = dist.get_world_size() if initialised else 1
        _check("num_replica_groups", num_replica_groups, 1)
        _check("num_replicas", num_replicas, 1)
        _check("replica_rank", replica_rank, 0)
        _check("group_rank", group_rank, 0)
        if replica_rank >= num_replica_groups:
            raise ValueError(
                f"rallypoint.ft: DistributedSampler's replica_rank {replica_rank} is outside"
                f" num_replica_groups={num_replica_groups} (0..{num_replica_groups - 1})"
            )
        if group_rank >= num_replicas:
            raise ValueError(f"rallypoint.ft: DistributedSampler's group_rank {group_rank} is outside num_replicas={num_replicas}")
        self.global_rank: int = group_rank + num_replicas * replica_rank
        self.global_world_size: int = num_replicas * num_replica_groups
        super().__init__(dataset, num_replicas=self.global_world_size, rank=self.global_rank, **kwargs)
