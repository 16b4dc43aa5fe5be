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

import threading
from datetime import timedelta
from typing import Callable, List, Optional, Sequence, TypeVar, Union

from torchft.checkpointing.transport import CheckpointTransport

from rallypoint.ft import _registry
from rallypoint.ft._fetch import TransferError, recv_striped
from rallypoint.ft._serve import Server, stage

__all__ = ["RallyTransport", "TransferError", "recv_striped"]

T = TypeVar("T")


class RallyTransport(CheckpointTransport[T]):
    """torchft's ``CheckpointTransport`` over raw TCP; see the module docs."""

    def __init__(self, timeout: Union[timedelta, float], state_dict: Optional[Callable[[], object]] = None) -> None:
        self._timeout = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        self._state_dict = state_dict
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
        return recv_striped(sources, step, timeout, like=like)

    def shutdown(self, wait: bool = True) -> None:
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.close(wait)
