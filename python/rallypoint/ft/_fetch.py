"""The receiving side of :class:`rallypoint.ft.RallyTransport`:
:func:`recv_striped` fetches one step's state dict from one or several
sources (wire format: ``_wire.py``).

How a receive goes
------------------
1. The header of the step is read from the first source that answers
   (sources are tried in order). It is checked entry by entry, and, when the
   receiver passes its own state dict (``like``), every tensor both sides
   have must agree in dtype and shape: a mismatch is refused before a byte of
   tensor data moves.
2. Fresh CPU buffers are allocated for every tensor, once the header's
   total is known to fit in the memory available here (else the receive is
   refused naming the tensor that does not fit; an allocation that fails
   anyway is a :class:`TransferError` naming it too). The receiver's own
   model is never written: the caller (torchft's Manager) loads the result
   with its ``load_state_dict`` only once the whole state has arrived, so a
   failure at any point leaves the model as it was.
3. The flat byte space is cut into pieces of :data:`PIECE` bytes; one thread
   per source (the first source's is the calling thread) takes pieces, keeping
   :data:`AHEAD` requests in flight, and reads each straight into
   the destination buffers (``recv_into``, :data:`_wire.CHUNK` at a time).
   Pieces are dealt round robin; a source done with its share steals from
   the others' (a source still connecting or silent included, sparing its
   first piece while there is other work), so faster sources take more and a
   silent one delays nothing. A source that fails (dies, refuses, sends
   a malformed frame, times out) gives its piece back and stops; the others
   take it over. The receive ends once every piece has arrived, without
   waiting for a source that is still connecting. Every source must serve the same tensors (the header's
   layout is compared), since ranges of two sources are mixed.
4. The pytree is rebuilt (non-tensor leaves unpickled, tensors as views of
   their buffers) before any data moves, so a malformed spec costs no
   transfer; it is returned once every piece has arrived. The receiver
   trusts its sources' pickled spec and non-tensor leaves (sources are the
   job's own replicas, as with torchft's transports); only the header is
   checked field by field.

Every socket operation has the timeout as its deadline; errors name the
source, the step and the tensor whose bytes were awaited.
"""

import functools
import os
import pickle
import socket
import threading
from collections import deque
from datetime import timedelta
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

from rallypoint.ft import _wire

#: Bytes per request of a receive: the unit by which sources share the work.
PIECE = 16 << 20
#: Requests a receiver keeps in flight per source.
AHEAD = 2


class TransferError(RuntimeError):
    """A checkpoint could not be received; the message names the source(s),
    the step and the tensor."""


def parse_source(metadata: str) -> Tuple[str, int]:
    """``"host:port"`` / ``"[v6]:port"`` (what ``metadata()`` returns)."""
    host, sep, port = metadata.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise TransferError(f"malformed checkpoint source {metadata!r} (expected host:port)")
    return host.strip("[]"), int(port)


def _seconds(timeout: Union[timedelta, float]) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class _Source:
    """One connection to one source."""

    def __init__(self, name: str, step: int, timeout: float) -> None:
        self.name, self.step, self.timeout = name, step, timeout
        host, port = parse_source(name)
        self.sock: Optional[socket.socket] = None
        self.token = 0
        self.sock = self._io(lambda: socket.create_connection((host, port), timeout=timeout), "a connection")
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()

    def _io(self, op, what: str):
        try:
            return op()
        except TimeoutError:
            raise TimeoutError(f"timed out after {self.timeout}s waiting for {what} from checkpoint source {self.name}") from None
        except OSError as e:
            raise TransferError(f"checkpoint source {self.name}: {e} (waiting for {what})") from None

    def _recv_into(self, view: memoryview, what: str) -> None:
        want = len(view)
        while view:
            k = self._io(lambda: self.sock.recv_into(view, min(len(view), _wire.CHUNK)), what)
            if k == 0:
                raise TransferError(
                    f"checkpoint source {self.name} closed the connection after {want - len(view)} of {want} "
                    f"bytes of {what} (it died or stopped serving step {self.step})"
                )
            view = view[k:]

    def _frame(self, what: str) -> Tuple[bytes, int]:
        head = bytearray(_wire.FRAME.size)
        self._recv_into(memoryview(head), what)
        kind, n = _wire.FRAME.unpack(head)
        if kind == b"E":
            msg = self._payload(n, what).decode(errors="replace")
            raise TransferError(f"checkpoint source {self.name} refused {what}: {msg}")
        return kind, n

    def _payload(self, n: int, what: str) -> bytes:
        if n > _wire.MAX_META:
            raise TransferError(f"checkpoint source {self.name} sent a malformed {n}-byte frame for {what}")
        buf = bytearray(n)
        self._recv_into(memoryview(buf), what)
        return bytes(buf)

    def _expect(self, kind: bytes, what: str) -> bytes:
        got, n = self._frame(what)
        if got != kind:
            raise TransferError(f"checkpoint source {self.name} sent a {got!r} frame where {what} ({kind!r}) was due")
        return self._payload(n, what)

    def header(self) -> Tuple[dict, bytes]:
        what = f"the header of step {self.step}"
        self._io(lambda: self.sock.sendall(_wire.encode_request(_wire.KIND_META, self.step)), f"sending a request for {what}")
        payload = self._expect(b"H", what)
        try:
            h = _wire.decode_header(payload, self.step)
        except _wire.WireError as e:
            raise TransferError(f"checkpoint source {self.name} sent a malformed header for step {self.step}: {e}") from None
        self.token = h["token"]  # this source's staging; ranges name it
        return h, self._expect(b"S", f"the pytree spec of step {self.step}")

    def request(self, offset: int, length: int) -> None:
        """Asks for ``[offset, offset+length)`` of the flat byte space."""
        req = _wire.encode_request(_wire.KIND_RANGE, self.step, self.token, offset, length)
        self._io(lambda: self.sock.sendall(req), f"sending a request for bytes {offset}+{length} of step {self.step}")

    def receive(self, bufs: "_Buffers", offset: int, length: int, tick) -> None:
        """Reads the answer to :meth:`request` straight into ``bufs``."""
        for i, at, n in _wire.segments(bufs.starts, bufs.nbytes, offset, length):
            pos, end = at, at + n
            while pos < end:
                what = f"tensor {bufs.paths[i]} (bytes {pos}..{end} of {bufs.nbytes[i]}, step {self.step})"
                kind, k = self._frame(what)
                if kind != b"D" or not 0 < k <= end - pos:
                    raise TransferError(
                        f"checkpoint source {self.name} sent a malformed frame ({kind!r}, {k} bytes) "
                        f"where {end - pos} bytes of {what} were due"
                    )
                self._recv_into(bufs.views[i][pos : pos + k], what)
                pos += k
                tick()


def available_memory() -> int:
    """Bytes of memory this host can still give (``MemAvailable``; the free
    pages where /proc/meminfo is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_room(header: dict, source: str, room: Optional[int] = None) -> None:
    """Refuses a header whose tensors, laid end to end, need more than the
    memory available here, naming the first tensor that does not fit: a
    malformed or hostile header must not make the receiver allocate
    terabytes (or fail with a bare allocator error)."""
    room = available_memory() if room is None else room
    at = 0
    for t in header["tensors"]:
        at += t["nbytes"]
        if at > room:
            raise TransferError(
                f"tensor {t['path']} from checkpoint source {source} (step {header['step']}) is "
                f"{_wire.dtype_name(t['dtype'])}{list(t['shape'])} ({t['nbytes']} bytes): the header's tensors "
                f"need {sum(x['nbytes'] for x in header['tensors'])} bytes, this host has {room} available; "
                f"nothing was allocated"
            )


class _Buffers:
    """Fresh destination buffers for the tensors a header names."""

    def __init__(self, header: dict, source: str) -> None:
        ts = header["tensors"]
        self.paths = [t["path"] for t in ts]
        self.nbytes = [t["nbytes"] for t in ts]
        self.starts = _wire.offsets(self.nbytes)
        self.total = sum(self.nbytes)
        self.raw = []
        for t in ts:
            try:
                self.raw.append(torch.empty(t["nbytes"], dtype=torch.uint8))
            except (RuntimeError, MemoryError) as e:
                raise TransferError(
                    f"could not allocate {t['nbytes']} bytes for tensor {t['path']} from checkpoint source "
                    f"{source} (step {header['step']}, {self.total} bytes in all): {e}"
                ) from None
        self.views = [memoryview(b.numpy()).cast("B") for b in self.raw]

    def tensors(self, header: dict) -> List[torch.Tensor]:
        return [b.view(t["dtype"]).reshape(t["shape"]) for b, t in zip(self.raw, header["tensors"])]


class _Plan:
    """The pieces still to fetch, shared by the sources' threads.

    Pieces are dealt round robin, one queue per source; a source takes from
    the front of its own queue, and, when that is empty, steals from the back
    of another's (:meth:`_queue_for`). Fast sources thus take over the slow,
    failed or silent ones' share: a source that never answers delays the
    receive by nothing but the pieces it holds in flight (none, if it never
    sent a header)."""

    def __init__(self, total: int, piece: int, names: List[str], timeout: float) -> None:
        workers = len(names)
        self.names = names
        self.cond = threading.Condition()
        pieces = [(o, min(piece, total - o)) for o in range(0, total, piece)]
        self.queues: List[Deque[Tuple[int, int]]] = [deque(pieces[i::workers]) for i in range(workers)]
        self.started: set = set()
        self.in_flight = 0
        self.alive = workers
        self.progress = 0
        self.errors: Dict[str, BaseException] = {}
        self.timeout = timeout

    def tick(self) -> None:
        """A chunk arrived. No lock, no wake-up: waiters only need to see the
        count change by the time their wait expires."""
        self.progress += 1

    def pending(self) -> int:
        return sum(len(q) for q in self.queues)

    def _wait_progress(self, done) -> bool:
        """Waits until ``done()``; False when nothing moved (no chunk, no piece
        taken or settled, no source leaving) for three timeouts: long enough
        for a source still connecting (connect, header) to fail or start."""
        while not done():
            seen = self.progress
            if not self.cond.wait_for(done, timeout=3 * self.timeout) and self.progress == seen:
                return False
        return True

    def _queue_for(self, me: int) -> Optional[Deque[Tuple[int, int]]]:
        """Where ``me`` takes its next piece: its own queue; else the longest
        of a source that started or left; else that of a source not started
        yet (still connecting, or silent), sparing its first piece while
        another can be taken, so a source that is merely slower to connect
        still serves a share; else that first piece."""
        if self.queues[me]:
            return self.queues[me]
        started = [q for i, q in enumerate(self.queues) if q and i in self.started]
        if started:
            return max(started, key=len)
        waiting = [q for q in self.queues if q]
        spare = [q for q in waiting if len(q) > 1]
        return max(spare or waiting, key=len) if waiting else None

    def take(self, me: int, wait: bool = True) -> Optional[Tuple[int, int]]:
        """Source ``me``'s next piece; None when none is left (or none moves,
        or, without ``wait``, none is free right now)."""
        with self.cond:
            if wait:
                self._wait_progress(lambda: self._queue_for(me) is not None or not (self.in_flight or self.pending()))
            q = self._queue_for(me)
            if q is None:
                return None
            self.started.add(me)
            self.in_flight += 1
            self.progress += 1
            return q.popleft() if q is self.queues[me] else q.pop()

    def settle(self, me: int, piece: Tuple[int, int], ok: bool) -> None:
        with self.cond:
            self.in_flight -= 1
            self.progress += 1
            if not ok:
                self.queues[me].appendleft(piece)
            self.cond.notify_all()

    def leave(self, me: int, name: str, err: Optional[BaseException]) -> None:
        with self.cond:
            self.alive -= 1
            self.progress += 1
            self.started.add(me)
            if err is not None:
                self.errors[name] = err
            self.cond.notify_all()


def _work(plan: _Plan, me: int, src: Union[_Source, Callable[[], _Source]], bufs: _Buffers) -> None:
    """Fetches pieces from ``src`` (or the source ``src()`` opens, here, so
    the others need not wait for it to connect), keeping :data:`AHEAD`
    requests in flight so the stream does not drain between pieces."""
    err: Optional[BaseException] = None
    held: Deque[Tuple[int, int]] = deque()  # requested from src, oldest first
    try:
        src = src if isinstance(src, _Source) else src()
        while True:
            while len(held) < AHEAD and (piece := plan.take(me, wait=not held)) is not None:
                held.append(piece)
                src.request(*piece)
            if not held:
                break
            src.receive(bufs, *held[0], plan.tick)
            plan.settle(me, held.popleft(), ok=True)
    except BaseException as e:  # reported by recv_striped
        err = e
        for piece in held:
            plan.settle(me, piece, ok=False)
    finally:
        if isinstance(src, _Source):
            src.close()
        plan.leave(me, getattr(src, "name", None) or plan.names[me], err)


def _open(name: str, step: int, timeout: float, first: Optional[dict]) -> Tuple[_Source, dict, bytes]:
    src = _Source(name, step, timeout)
    try:
        h, spec = src.header()
        if first is not None and not _wire.same_layout(h, first):
            raise TransferError(f"checkpoint source {name} serves step {step} with other tensors than the first source")
        return src, h, spec
    except BaseException:
        src.close()
        raise


def _open_like(name: str, step: int, timeout: float, first: dict) -> _Source:
    return _open(name, step, timeout, first)[0]


def check_like(header: dict, like: object, source: str) -> None:
    """Refuses a header whose tensors disagree in dtype or shape with the
    tensors of the receiver's own state dict at the same paths."""
    mine = {keystr(kp): v for kp, v in tree_flatten_with_path(like)[0] if isinstance(v, torch.Tensor)}
    for t in header["tensors"]:
        m = mine.get(t["path"])
        if m is not None and (m.dtype != t["dtype"] or tuple(m.shape) != t["shape"]):
            raise TransferError(
                f"tensor {t['path']} from checkpoint source {source} (step {header['step']}) is "
                f"{_wire.dtype_name(t['dtype'])}{list(t['shape'])}, this replica's model has "
                f"{_wire.dtype_name(m.dtype)}{list(m.shape)}; nothing was received"
            )


def _rebuild(header: dict, spec: bytes, bufs: _Buffers, source: str) -> object:
    bad = f"checkpoint source {source} sent a malformed pytree spec for step {header['step']}"
    try:
        treespec, others = pickle.loads(spec)
        leaves = treespec.num_leaves
    except Exception as e:
        raise TransferError(f"{bad}: {e!r}") from None
    if not isinstance(others, dict) or leaves != header["leaves"]:
        raise TransferError(f"{bad}: {leaves} leaves where its header names {header['leaves']}")
    values: List[object] = [None] * header["leaves"]
    for t, v in zip(header["tensors"], bufs.tensors(header)):
        values[t["leaf"]] = v
    tensor_leaves = {t["leaf"] for t in header["tensors"]}
    if set(others) != set(range(header["leaves"])) - tensor_leaves:
        raise TransferError(f"checkpoint source {source} sent non-tensor leaves that do not fill its pytree (step {header['step']})")
    for i, v in others.items():
        values[i] = v
    return tree_unflatten(values, treespec)


def _first(sources: Sequence[str], step: int, timeout: float) -> Tuple[int, _Source, dict, bytes, Dict[str, BaseException]]:
    errors: Dict[str, BaseException] = {}
    for i, name in enumerate(sources):
        try:
            return (i, *_open(name, step, timeout, None), errors)
        except (TransferError, TimeoutError) as e:
            errors[name] = e
    raise _combined(step, errors)


def _combined(step: int, errors: Dict[str, BaseException]) -> BaseException:
    if len(errors) == 1:
        return next(iter(errors.values()))
    text = "; ".join(f"{name}: {e}" for name, e in errors.items())
    cls = TimeoutError if all(isinstance(e, TimeoutError) for e in errors.values()) else TransferError
    return cls(f"step {step} could not be received from any of {len(errors)} sources: {text}")


def recv_striped(
    sources: Sequence[str],
    step: int,
    timeout: Union[timedelta, float],
    like: Optional[object] = None,
    piece: int = PIECE,
) -> object:
    """The state dict of ``step``, its bytes split across ``sources`` (each a
    ``metadata()`` string of a transport serving that step) in parallel.

    ``like``: the receiver's own state dict, to refuse a dtype or shape that
    does not match it before any byte moves. Raises :class:`TransferError` or
    :class:`TimeoutError` naming the sources and the tensor; nothing of the
    receiver's is written in any case."""
    if not sources:
        raise TransferError(f"no checkpoint source given for step {step}")
    t = _seconds(timeout)
    first, src, header, spec, errors = _first(sources, step, t)
    try:
        if like is not None:
            check_like(header, like, sources[first])
        check_room(header, sources[first])
        bufs = _Buffers(header, sources[first])
        # Tensors are views of `bufs`, filled below; a malformed spec fails before data moves.
        state = _rebuild(header, spec, bufs, sources[first])
    except BaseException:
        src.close()
        raise
    others = list(sources[first + 1 :])
    plan = _Plan(bufs.total, piece, [sources[first], *others], t)
    for i, name in enumerate(others, start=1):
        opener = functools.partial(_open_like, name, step, t, header)
        threading.Thread(target=_work, args=(plan, i, opener, bufs), name=f"rally-fetch-{name}", daemon=True).start()
    _work(plan, 0, src, bufs)  # the first source in the calling thread
    with plan.cond:
        # Done once every piece has arrived: a source still connecting (or
        # silent) holds no piece and writes nothing; its thread finds no work
        # left and ends on its own deadline.
        moving = plan._wait_progress(lambda: plan.alive == 0 or not (plan.pending() or plan.in_flight))
        errors.update(plan.errors)
        missing = plan.pending() or plan.in_flight
    if not moving:
        raise TimeoutError(f"nothing of step {step} arrived from any of {list(sources)} for {3 * t}s")
    if missing:
        raise _combined(step, errors)
    return state


