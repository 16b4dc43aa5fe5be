"""``RallyTransport``: torchft's ``CheckpointTransport`` contract, healing at
link speed.

Use it as torchft's own transports::

    transport = RallyTransport(timeout=timedelta(seconds=10))
    manager = Manager(pg=..., checkpoint_transport=transport, ...)

It takes no address: it listens (port 0) on, and advertises, the address this
process's collectives use (``rallypoint.ft._registry.advertise_host``: the
``ProcessGroupRally``'s listen address, else the route to ``MASTER_ADDR`` or
the lighthouse), never what the hostname resolves to (torchft #329). The
server starts at the first ``metadata()`` or ``send_checkpoint``.

- ``metadata()``: ``"host:port"`` of that server.
- ``send_checkpoint(dst_ranks, step, state_dict, timeout)``: stages the
  state dict of the committed ``step`` and serves it (``_serve.py``: the
  serving rules); returns at once.
- ``disallow_checkpoint()``: stops serving before the optimizer mutates the
  staged tensors; returns once no transfer holds them.
- ``recv_checkpoint(src_rank, metadata, step, timeout)``: fetches the state
  dict of ``step`` from the source ``metadata`` names into fresh CPU
  tensors (``_fetch.py``); :func:`recv_striped` does the same from several
  sources serving the same step, splitting the bytes across them.
- ``shutdown(wait)``: closes the server and its connections.

After a receive, the heal (replica, step, tensor bytes, seconds, sources) is
reported to the lighthouse's ``POST /v1/heal`` for its ``/status`` and
``/metrics`` (``_report.py``: on a daemon thread, never delaying the heal nor
raising; a lighthouse without the endpoint is logged once). The lighthouse
is ``lighthouse=``, else the ``ProcessGroupRally``'s, else
``TORCHFT_LIGHTHOUSE`` / ``RALLY_LIGHTHOUSE`` (``_registry.lighthouse``); the
replica is ``replica_id=``, else the name torchft's Manager gave the group's
``configure`` (the lighthouse resolves it to its ``name:uuid``). With
neither a lighthouse nor a replica id, nothing is reported.

The wire format (``_wire.py``): raw tensor bytes in 4 MiB chunks, with a JSON
header naming each tensor's pytree path, dtype and shape; only the pytree spec
and non-tensor leaves are pickled. The sender writes straight from the
tensor's memory (``sendall`` of a memoryview; CUDA tensors are copied to CPU
at staging), the receiver reads straight into the destination tensor
(``recv_into``).

Receiving in place is deliberately not offered: a transfer failing half way
would leave the model half overwritten. The receiver allocates fresh
buffers, and torchft's Manager loads them with the user's ``load_state_dict``
only once all has arrived. Pass ``state_dict=`` (a callable returning this
replica's state dict in the shape the Manager sends, e.g.
``manager._manager_state_dict``) to have a tensor whose dtype or shape differs
from the local one refused before any byte moves; tensors the receiver does
not have yet (a fresh optimizer's state) are accepted.
"""

import logging
import threading
import time
from datetime import timedelta
from typing import Callable, List, Optional, Sequence, TypeVar, Union

from torchft.checkpointing.transport import CheckpointTransport

import torch
from torch.utils._pytree import tree_leaves

from rallypoint.ft import _registry, _report
from rallypoint.ft._fetch import TransferError, recv_striped
from rallypoint.ft._serve import Server, stage

__all__ = ["RallyTransport", "TransferError", "recv_striped"]

T = TypeVar("T")

log = logging.getLogger(__name__)


class RallyTransport(CheckpointTransport[T]):
    """torchft's ``CheckpointTransport`` over raw TCP; see the module docs."""

    def __init__(
        self,
        timeout: Union[timedelta, float],
        state_dict: Optional[Callable[[], object]] = None,
        lighthouse: Optional[str] = None,
        replica_id: Optional[str] = None,
    ) -> None:
        self._timeout = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        self._state_dict = state_dict
        self._lighthouse = lighthouse
        self._replica_id = replica_id
        self._lock = threading.Lock()
        self._server: Optional[Server] = None

    def _serving(self) -> Server:
        with self._lock:
            if self._server is None:
                self._server = Server(_registry.advertise_host(), self._timeout)
            return self._server

    def metadata(self) -> str:
        s = self._serving()
        return f"[{s.host}]:{s.port}" if ":" in s.host else f"{s.host}:{s.port}"

    def send_checkpoint(self, dst_ranks: List[int], step: int, state_dict: T, timeout: timedelta) -> None:
        self._serving().stage(stage(state_dict, step))

    def disallow_checkpoint(self) -> None:
        with self._lock:
            server = self._server
        if server is not None:
            server.freeze()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        return self.recv_striped([metadata], step, timeout)

    def recv_striped(self, sources: Sequence[str], step: int, timeout: Union[timedelta, float]) -> T:
        """The state dict of ``step`` from several sources at once (:func:`recv_striped`)."""
        like = self._state_dict() if self._state_dict is not None else None
        t0 = time.perf_counter()
        state = recv_striped(sources, step, timeout, like=like)
        self._report(sources, step, state, time.perf_counter() - t0)
        return state

    def _report(self, sources: Sequence[str], step: int, state: object, seconds: float) -> None:
        """Hands the heal to the lighthouse's reporter; never raises."""
        try:
            url = self._lighthouse if self._lighthouse is not None else _registry.lighthouse()
            name, quorum_id = _registry.replica()
            replica_id = self._replica_id or name
            if not url or not replica_id:
                return
            nbytes = sum(t.numel() * t.element_size() for t in tree_leaves(state) if isinstance(t, torch.Tensor))
            _report.heal(url, replica_id, step, nbytes, seconds, sources, quorum_id)
        except Exception as e:  # noqa: BLE001 - a report must never fail a heal
            log.warning("rallypoint.ft: not reporting the heal of step %s: %s", step, e)

    def shutdown(self, wait: bool = True) -> None:
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.close(wait)
