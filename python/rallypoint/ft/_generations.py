"""The cross-replica group of fault-tolerant training, without torchft:
:class:`Generations`, one ``rally`` group reconfigured per quorum.

Both users of it are thin: :class:`rallypoint.ft.ProcessGroupRally` adapts it
to torchft's ``ProcessGroup`` (torchft's own ``Manager`` calls ``configure``),
and :class:`rallypoint.ft.Manager` calls it itself at each new quorum. Nothing
here imports torchft.

# Generations

Each ``configure(store_addr, replica_id, rank, world_size, quorum_id, ...)``
(a Manager calls it when the quorum changes, with a fresh
``host:port/<prefix>/<quorum id>/<group rank>``) forms the next generation:
a ``rally`` backend (:class:`rallypoint.torch.RallyBackend`, whose op code
every op here goes through) over ``PrefixStore(prefix, TCPStore(host,
port))``, formed as the next generation of the last one
(``ProcessGroup::next_generation``, one store round: every member
publishes an entry and waits, the store's wait, for every other's). A
member that took part in the last generation keeps its connections to the
others that did: only a newcomer connects, once to each member, at the
first op that needs it. Shared memory (every member on this host) is laid
out per generation.

A configure first checks its arguments (a rank outside the world, a world
of 0, a prefix that a live generation of this process uses, a malformed
address): bad input raises ``ValueError`` and leaves the current generation
**as it was, usable**. Any later failure (the store not answering, forming
failing, a member that never joins within the timeout, named) does **not**
raise: torchft's Manager would record it and then hand its DDP hook a Work
the hook asserts on, crashing ``backward()``. The failure is logged once
and becomes the error of a group with no generation: :meth:`errored`
reports it, collectives return completed Works, send/recv fail, torchft's
``should_commit`` votes no and its next quorum configures again. The
current generation is retired either way (the quorum has moved on); no
backend is formed unless every member published its entry.

The generation's collectives listen on the route to the store's host
(every member reaches the quorum's store), or, when that route is
loopback, on the collectives' own choice (the route to ``MASTER_ADDR``).

# Errors

torchft's DDP comm hook asserts on the future of a failed all_reduce
(``torchft/ddp.py``: its ``_ManagedWork.wait`` swallows the error before the
future chain exists), so a failure reaching it crashes ``backward()``.
Here a failed **collective's** Work completes without raising (``wait()``
returns, its future carries the op's tensors), and the error is reported by
:meth:`errored`: the generation's first error, recorded the moment the op
fails (not when it is waited for). torchft's Manager reads it in
``should_commit``, votes no, and reconfigures at the next quorum. After an
error every collective returns at once, without communicating, a completed
Work, until the next configure.

**recv** (torchft's ``PGTransport`` heals through send and recv) is the
exception: its Work fails (``wait()`` raises), and after an error it fails
at once. A swallowed failed receive would hand the checkpoint transport
garbage lengths and tensors, which torchft would load. (torchft then
records the failure before backward, and its DDP hook crashes on the Work
its Manager hands out: a failed heal of the receiver is fatal to torchft's
loop over any group.) A **send** is swallowed as a collective is: the
sender's state is untouched, the receiver's recv fails on its side, and a
failing send would crash the sender's loop the same way.

:meth:`abort` (from any thread) aborts the generation: every op in flight
fails at once here and on every member, each told which replica aborted and
why. A member that dies fails every survivor's op at once (the collectives
see its connection end, or its pid go, within a few ms).

# Push abort from the lighthouse

With ``lighthouse=URL`` (or ``TORCHFT_LIGHTHOUSE`` set) each generation
long-polls ``rally lighthouse``'s ``GET /v1/watch?quorum_id=Q`` on a daemon
thread (``_watch.py``): when the lighthouse drops a member of quorum Q the
generation is aborted at once, naming the replica and the lighthouse's
reason, so no survivor waits for an op to notice. torchft's own lighthouse
has no such endpoint (a 404: logged once, the watch ends).

# Exit

:meth:`shutdown` ends the watch and the generation. A process that exits
with a generation configured exits normally: ``rallypoint.torch``'s atexit
hook aborts what is in flight and keeps the extension's threads out of the
finalizing interpreter (``crates/torch/src/life.rs``).
"""

import ipaddress
import logging
import threading
import time
import os
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from rallypoint import torch as _rally
from rallypoint.ft import _registry
from rallypoint.ft._watch import Watch, parse_lighthouse
from rallypoint.ft._work import _Done, _Failed, _Fault, _Swallowing

__all__ = ["Generations", "parse_store_addr", "check_membership", "listen_ip"]

log = logging.getLogger(__name__)

# Store addresses ("host:port/prefix") of this process's live generations,
# by every ProcessGroupRally: a second generation under one prefix would
# find the first one's keys.
_live: Dict[str, str] = {}
_live_lock = threading.Lock()


def parse_store_addr(store_addr: str) -> Tuple[str, int, str]:
    """(host, port, prefix) of torchft's ``host:port/prefix`` (``[v6]:port/...``
    too), or ValueError."""
    if not isinstance(store_addr, str):
        raise ValueError(f"rallypoint.ft: store_addr must be 'host:port/prefix', not {store_addr!r}")
    addr, _, prefix = store_addr.partition("/")
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"rallypoint.ft: store_addr {store_addr!r} is not 'host:port/prefix'")
    if not prefix:
        raise ValueError(
            f"rallypoint.ft: store_addr {store_addr!r} has no prefix; each configure needs a fresh one"
            " (torchft's Manager passes host:port/torchft/<quorum id>/<group rank>)"
        )
    return host, int(port), prefix


def check_membership(rank, world_size) -> None:
    """ValueError unless ``0 <= rank < world_size``."""
    for what, v in (("rank", rank), ("world_size", world_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"rallypoint.ft: configure's {what} must be an int, not {v!r}")
    if world_size < 1:
        raise ValueError(f"rallypoint.ft: configure's world_size is {world_size}; a group has at least one member")
    if not 0 <= rank < world_size:
        raise ValueError(f"rallypoint.ft: configure's rank {rank} is outside a world of {world_size} (0..{world_size - 1})")


def listen_ip(store_host: str) -> Optional[str]:
    """The address a generation's collectives listen on: the route to the
    quorum's store (every member reaches it), or None (the collectives'
    own rule: the route to ``MASTER_ADDR``) when that route is loopback or
    there is none."""
    ip = _registry._route_to(store_host)
    if ip is None or ipaddress.ip_address(ip).is_loopback:
        return None
    return ip


def _within(deadline: float, call):
    """(True, call()) if it returns by ``deadline`` (monotonic), else (False,
    the exception it raised, or None if it is still running). It runs on a
    daemon thread, abandoned at the deadline."""
    box = {}

    def run():
        try:
            box["ok"] = call()
        except Exception as e:  # noqa: BLE001 - torch raises several kinds
            box["error"] = e

    th = threading.Thread(target=run, name="rally-store-connect", daemon=True)
    th.start()
    th.join(max(deadline - time.monotonic(), 0))
    if "ok" in box:
        return True, box["ok"]
    return False, box.get("error")


class _Generation:
    """One configure's group: its backend, store address, quorum and watch."""

    def __init__(self, backend, addr: str, quorum_id, replica_id: str, fault: _Fault):
        self.backend = backend
        self.addr = addr
        self.quorum_id = quorum_id
        self.replica_id = replica_id
        self.fault = fault
        self.watch: Optional[Watch] = None

    @property
    def group(self):
        return self.backend._group

    def who(self) -> str:
        q = f" of quorum {self.quorum_id}" if self.quorum_id is not None else ""
        return f"replica {self.replica_id} (rank {self.backend.rank()} of {self.backend.size()}{q})"

    def abort(self, reason: str) -> None:
        """Fails every op in flight at once, here and on every member."""
        self.group.abort(reason)
        why = self.group.aborted()
        self.fault.record(dist.DistBackendError(why or reason))

    def member_dropped(self, reason: str) -> None:
        """The lighthouse dropped a member (the watch): ops in flight fail at
        once, here and on every member, and so do later ones; but a step
        whose ops had all completed keeps its result (an error only if an
        op was in flight: a group that ended after its last commit must not
        fail the others' step, whose all_reduce it had finished)."""
        in_flight = self.group.in_flight()
        self.group.abort(reason)
        if in_flight:
            why = self.group.aborted()
            self.fault.record(dist.DistBackendError(why or reason))

    def close(self, reason: str) -> None:
        """Ends the watch, aborts ops still in flight, and releases the prefix;
        the group's connections close when its last op has ended."""
        if self.watch is not None:
            self.watch.stop()
        if self.group.in_flight():
            self.abort(reason)
        self.fault.record(RuntimeError(f"rallypoint.ft: generation {self.addr} was closed: {reason}"))
        with _live_lock:
            _live.pop(self.addr, None)


class Generations:
    """The generations of one cross-replica group (CPU tensors): ``configure``
    forms the next, ops run on the current one.

    ``timeout``: each op's deadline and how long configure waits for the
    store. ``lighthouse``: ``http://host:port`` of ``rally lighthouse``
    (default: ``TORCHFT_LIGHTHOUSE``), whose drops abort the generation at
    once; ``""`` turns the watch off. ``done_work(result)`` makes the
    completed Work a collective returns without a usable generation.
    ``owner`` names the user in errors.
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=60), lighthouse: Optional[str] = None, done_work=_Done, owner: str = "Generations"):
        if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(f"rallypoint.ft: {owner}'s timeout must be a positive timedelta, not {timeout!r}")
        self._owner = owner
        self._done_work = done_work
        self._timeout = timeout
        url = os.environ.get("TORCHFT_LIGHTHOUSE", "") if lighthouse is None else lighthouse
        if url:
            parse_lighthouse(url)
        self._lighthouse = url or None
        self._configure_lock = threading.Lock()
        # The native group of the last generation formed: the next one keeps
        # its connections to the members that stay (even after a failed
        # configure in between).
        self._lineage = None
        # The TCPStore client of the last generation, by (host, port).
        self._stores: Dict[Tuple[str, int], TCPStore] = {}
        # (the current fault, the current generation), swapped as one: an
        # op on another thread never pairs a generation with another's fault.
        self._state: Tuple[_Fault, Optional[_Generation]] = (
            _Fault(RuntimeError(f"rallypoint.ft: {owner} is not configured yet")),
            None,
        )

    @property
    def lighthouse(self) -> Optional[str]:
        """The lighthouse this group watches (``http://host:port``), or None."""
        return self._lighthouse

    @property
    def membership(self) -> Tuple[Optional[str], Optional[int]]:
        """(replica id, quorum id) of the current generation, as torchft's
        Manager passed them to ``configure``; (None, None) before one."""
        gen = self._gen
        if gen is None:
            return None, None
        return gen.replica_id, gen.quorum_id

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
        """Forms the next generation (see the module's doc for what a failure
        leaves). ``group_rank``, ``group_world_size`` and ``global_ranks`` are
        torchft's bookkeeping, accepted and unused."""
        host, port, prefix = parse_store_addr(store_addr)
        check_membership(rank, world_size)
        with self._configure_lock:
            self._claim(store_addr, quorum_id)
            try:
                gen = self._form(store_addr, host, port, prefix, rank, world_size, quorum_id, str(replica_id))
            except Exception as e:  # noqa: BLE001 - recorded, see the module doc
                with _live_lock:
                    _live.pop(store_addr, None)
                self._retire(f"the configure at {store_addr} failed")
                self._state = (_Fault(e), None)
                log.error("%s", e)
                return
            self._state = (gen.fault, gen)

    def _form(self, store_addr: str, host: str, port: int, prefix: str, rank: int, world_size: int, quorum_id, replica_id: str):
        """The next generation: the store reached, the current generation
        retired, the backend formed and every member seen; raises otherwise
        (the backend formed is then aborted and dropped)."""
        store = self._connect(host, port, prefix)
        # The point of no return: the current generation goes.
        self._retire(f"replaced by the generation at {store_addr}")
        fault = _Fault()
        try:
            # Over the last generation's connections to the members that
            # stay; forming waits for every member (one store round).
            backend = _rally.RallyBackend(
                store,
                rank,
                world_size,
                self._timeout,
                prefix,
                done=fault.done,
                fresh_prefix=True,
                advertise=listen_ip(host),
                lineage=True,
                prev=self._lineage,
            )
        except Exception as e:
            raise RuntimeError(f"rallypoint.ft: forming the generation at {store_addr} as rank {rank} of {world_size} failed: {e}") from e
        self._lineage = backend._group
        gen = _Generation(backend, store_addr, quorum_id, replica_id, fault)
        if self._lighthouse and quorum_id is not None:
            gen.watch = Watch(self._lighthouse, int(quorum_id), gen.member_dropped)
        return gen

    def _claim(self, store_addr: str, quorum_id) -> None:
        with _live_lock:
            held = _live.get(store_addr)
            if held is not None:
                raise ValueError(
                    f"rallypoint.ft: the prefix {store_addr!r} is used by a live generation ({held});"
                    " each configure needs a fresh prefix (torchft's quorum id makes one)"
                )
            _live[store_addr] = f"quorum {quorum_id}" if quorum_id is not None else "a configure without a quorum id"

    def _connect(self, host: str, port: int, prefix: str):
        """A client of the store at host:port, answering within the timeout.

        The client of the last generation is kept and reused when the store
        is the same (torchft's Manager keeps using one replica's store while
        it lives): one round to see that it still answers instead of a new
        connection. (torch 2.15's TCPStore client takes 5 s for one
        connection in 26 on loopback, every 26th, measured; a fresh client
        per configure, as torchft's ProcessGroupGloo makes, pays it.)

        Each attempt runs on a daemon thread given up at the deadline: torch's
        client retries for up to about three times its timeout (a listener
        that never answers: two tries and a backoff); torch ends the attempt
        on its own, and its result is dropped."""
        t = self._timeout
        deadline = time.monotonic() + t.total_seconds()
        key = (host, port)
        cached = self._stores.get(key)
        if cached is not None:
            ok, _ = _within(deadline, lambda: cached.check(["rallypoint/ft/alive"]))
            if ok:
                return PrefixStore(prefix, cached)
            self._stores.pop(key, None)

        def connect():
            return TCPStore(host_name=host, port=port, is_master=False, wait_for_workers=False, timeout=t)

        ok, got = _within(deadline, connect)
        if ok:
            self._stores = {key: got}
            return PrefixStore(prefix, got)
        why = f"{type(got).__name__}: {got}" if got is not None else "no answer"
        raise TimeoutError(
            f"rallypoint.ft: configure could not reach the store at {host}:{port} within"
            f" {t.total_seconds():g} s ({why})"
        )

    def _retire(self, reason: str) -> None:
        """Closes the current generation, then publishes that there is none:
        its fault records the closing first, so an op racing this one finds
        either the generation (failing with its abort) or its error."""
        fault, gen = self._state
        if gen is not None:
            gen.close(reason)
        self._state = (fault, None)

    @property
    def _gen(self) -> Optional[_Generation]:
        return self._state[1]

    def abort(self, reason: Optional[str] = None) -> None:
        """Aborts the current generation from any thread: every op in flight
        fails at once on every member, naming this replica and ``reason``.
        Ops then fail at once until the next configure."""
        gen = self._gen
        if gen is None:
            return
        gen.abort(f"{gen.who()} called abort(){': ' + reason if reason else ''}")

    def shutdown(self) -> None:
        """Ends the watch and the generation; ops then fail at once. Idempotent."""
        with self._configure_lock:
            self._retire(f"{self._owner}.shutdown()")
            self._state = (_Fault(RuntimeError(f"rallypoint.ft: {self._owner} was shut down")), None)

    def errored(self) -> Optional[Exception]:
        """The first error of the current generation (an op's failure, an
        ``abort()`` here, a member dropped by the lighthouse while an op was
        in flight), or None. A member's abort, or a drop, when no op of
        this rank was in flight is not an error of the step: its ops had
        completed, and the next op fails (and is recorded)."""
        return self._state[0].error

    def set_timeout(self, timeout: timedelta) -> None:
        """The timeout of the next generations (the current one keeps its own)."""
        self._timeout = timeout

    def size(self) -> int:
        gen = self._gen
        return gen.backend.size() if gen is not None else 1

    def rank(self) -> int:
        gen = self._gen
        return gen.backend.rank() if gen is not None else 0

    def listen_host(self) -> Optional[str]:
        """The address this rank's collectives listen on (for RallyTransport)."""
        gen = self._gen
        if gen is None:
            return None
        host, _, _ = gen.group.local_addr().rpartition(":")
        return host.strip("[]") or None

    @property
    def quorum_id(self):
        gen = self._gen
        return gen.quorum_id if gen is not None else None

    def __repr__(self) -> str:
        gen = self._gen
        return f"{self._owner}({gen.addr if gen is not None else 'not configured'})"


    # -- ops ---------------------------------------------------------------

    def collective(self, result, call):
        """Runs ``call(backend)``; a failure, now or later, is recorded and
        its Work completes without raising (with ``result``)."""
        fault, gen = self._state
        if fault.error is not None or gen is None:
            return self._done_work(result)
        try:
            return _Swallowing(call(gen.backend), fault, result)
        except Exception as e:  # noqa: BLE001 - reported by errored()
            fault.record(e)
            return self._done_work(result)

    def message(self, call):
        """Runs a send or recv: its Work fails on failure (see the module doc)."""
        fault, gen = self._state
        if fault.error is not None:
            return _Failed(RuntimeError(f"rallypoint.ft: the generation has failed: {fault.error}"))
        if gen is None:
            return _Failed(RuntimeError("rallypoint.ft: no generation is configured"))
        try:
            return call(gen.backend)
        except Exception as e:  # noqa: BLE001
            fault.record(e)
            return _Failed(e)
