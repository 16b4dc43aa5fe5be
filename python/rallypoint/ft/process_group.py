"""``ProcessGroupRally``: torchft's reconfigurable ``ProcessGroup`` over the
``rally`` collectives, so that ``torchft.Manager(pg=ProcessGroupRally(...))``
runs torchft's own loop on rallypoint's collectives, nothing else changed::

    from rallypoint.ft import ProcessGroupRally
    pg = ProcessGroupRally(timeout=timedelta(seconds=5))
    manager = Manager(pg=pg, ...)                 # torchft's, unchanged

This module and ``transport.py`` are the only ones of ``rallypoint.ft`` that
import torchft. The work is done by :class:`rallypoint.ft._generations.Generations`
(the generations, their errors, aborts, the lighthouse watch and exit: its
module doc); this class adapts it to torchft's ``ProcessGroup`` contract:
torchft's base class, its ``_DummyWork`` for a collective with no usable
generation, and one method per op.
"""

from datetime import timedelta
from typing import List, Optional, Tuple

from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, BarrierOptions, ReduceOp
from torchft.process_group import ProcessGroup
from torchft.work import _DummyWork

from rallypoint.ft import _registry
from rallypoint.ft._generations import Generations, check_membership, listen_ip, parse_store_addr
from rallypoint.ft._work import _All

__all__ = ["ProcessGroupRally", "check_membership", "listen_ip", "parse_store_addr"]

NAME = "torchft-rally"


class ProcessGroupRally(ProcessGroup):
    """torchft's ``ProcessGroup`` over the ``rally`` collectives (CPU tensors).

    ``timeout``: each op's deadline and how long configure waits for the
    store. ``lighthouse``: ``http://host:port`` of ``rally lighthouse``
    (default: ``TORCHFT_LIGHTHOUSE``), whose drops abort the generation at
    once; ``""`` turns the watch off.
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=60), lighthouse: Optional[str] = None):
        super().__init__(0, 1)
        self._core = Generations(timeout, lighthouse, done_work=_DummyWork, owner="ProcessGroupRally")
        _registry.set_current(self)

    @property
    def lighthouse(self) -> Optional[str]:
        """The lighthouse this group watches (``http://host:port``), or None."""
        return self._core.lighthouse

    @property
    def membership(self) -> Tuple[Optional[str], Optional[int]]:
        """(replica id, quorum id) of the current generation; (None, None) before one."""
        return self._core.membership

    @property
    def _gen(self):
        return self._core._gen

    # -- torchft's contract ----------------------------------------------

    def getBackendName(self) -> str:
        return NAME

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: Optional[int] = None,
        group_rank: Optional[int] = None,
        group_world_size: Optional[int] = None,
        global_ranks: Optional[List[int]] = None,
    ) -> None:
        """Forms the next generation (``Generations.configure``)."""
        self._core.configure(store_addr, replica_id, rank, world_size, quorum_id)

    def abort(self, reason: Optional[str] = None) -> None:
        """Aborts the current generation from any thread (``Generations.abort``)."""
        self._core.abort(reason)

    def shutdown(self) -> None:
        """Ends the watch and the generation; ops then fail at once. Idempotent."""
        self._core.shutdown()

    def errored(self) -> Optional[Exception]:
        """The first error of the current generation, or None."""
        return self._core.errored()

    def set_timeout(self, timeout: timedelta) -> None:
        """The timeout of the next generations (the current one keeps its own)."""
        self._core.set_timeout(timeout)

    def size(self) -> int:
        return self._core.size()

    def rank(self) -> int:
        return self._core.rank()

    def listen_host(self) -> Optional[str]:
        """The address this rank's collectives listen on (for RallyTransport)."""
        return self._core.listen_host()

    @property
    def quorum_id(self):
        return self._core.quorum_id

    def __repr__(self) -> str:
        return repr(self._core)

    # -- ops ---------------------------------------------------------------

    def allreduce(self, tensors, opts):
        if isinstance(opts, (ReduceOp, ReduceOp.RedOpType)):
            op, opts = opts, AllreduceOptions()
            opts.reduceOp = op
        return self._core.collective(tensors, lambda b: b.allreduce(tensors, opts))

    def allreduce_coalesced(self, tensors, opts):
        def each(b):
            works = []
            for t in tensors:
                o = AllreduceOptions()
                o.reduceOp = opts.reduceOp
                o.timeout = opts.timeout
                works.append(b.allreduce([t], o))
            return _All(works, tensors)

        return self._core.collective(tensors, each)

    def allgather(self, output_tensors, input_tensor, opts=None):
        opts = opts or AllgatherOptions()
        return self._core.collective(output_tensors, lambda b: b.allgather(output_tensors, input_tensor, opts))

    def allgather_into_tensor_coalesced(self, output_tensors, input_tensors, opts=None):
        opts = opts or AllgatherOptions()
        return self._core.collective(
            output_tensors,
            lambda b: _All([b.all_gather_single(o, i, opts) for o, i in zip(output_tensors, input_tensors)], output_tensors),
        )

    def alltoall_base(self, output_buffer, input_buffer, output_split_sizes, input_split_sizes, opts):
        return self._core.collective(
            output_buffer,
            lambda b: b.all_to_all_single(output_buffer, input_buffer, output_split_sizes, input_split_sizes, opts),
        )

    def barrier(self, opts=None):
        opts = opts or BarrierOptions()
        return self._core.collective(None, lambda b: b.barrier(opts))

    def broadcast(self, tensor_list, opts):
        return self._core.collective(tensor_list, lambda b: b.broadcast(tensor_list, opts))

    def reduce(self, tensors, opts):
        return self._core.collective(tensors, lambda b: b.reduce(tensors, opts))

    def gather(self, output_tensors, input_tensors, opts):
        return self._core.collective(output_tensors, lambda b: b.gather(output_tensors, input_tensors, opts))

    def scatter(self, output_tensors, input_tensors, opts):
        return self._core.collective(output_tensors, lambda b: b.scatter(output_tensors, input_tensors, opts))

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        return self._core.collective(output_tensors, lambda b: b.reduce_scatter(output_tensors, input_tensors, opts))

    def reduce_scatter_tensor_coalesced(self, output_tensors, input_tensors, opts):
        return self._core.collective(
            output_tensors,
            lambda b: _All([b.reduce_scatter_single(o, i, opts) for o, i in zip(output_tensors, input_tensors)], output_tensors),
        )

    def send(self, tensors, dst_rank: int, tag: int = 0):
        return self._core.collective(tensors, lambda b: b.send(tensors, dst_rank, tag))

    def recv(self, tensors, src_rank: int, tag: int = 0):
        return self._core.message(lambda b: b.recv(tensors, src_rank, tag))
