"""The serving side of :class:`rallypoint.ft.RallyTransport`: what is staged,
and the server that answers requests for it (wire format: ``_wire.py``).

Serving rules (torchft's, made exact)
-------------------------------------
- Nothing is served until ``send_checkpoint(step, state_dict)`` stages a
  step; then requests for that step, and only that one, are answered.
  Staging holds references to the caller's CPU tensors (no copy, as
  torchft's HTTPTransport); a CUDA or non-contiguous tensor is copied to a
  contiguous CPU tensor at staging.
- ``disallow_checkpoint()`` (:meth:`Server.freeze`) stops serving before the
  optimizer mutates those tensors: new requests are refused at once, and a
  range in progress stops at its next chunk boundary with an ``E`` frame
  naming the step and the tensor. ``freeze`` returns once no transfer
  holds the staged tensors, so no receiver ever gets bytes written after it
  returns: a transfer stuck in a send (a receiver that stopped reading) has
  its socket shut down after :data:`CUT_AFTER` seconds, and its receiver sees
  the stream end. Should a transfer outlive that shutdown by the timeout (a
  thread stuck outside its socket), ``freeze`` logs it and returns rather
  than raise into torchft's ``should_commit``; that transfer can send no
  further chunk (its socket is shut down, and it checks the staging first). Every received byte therefore belongs to one staging (the
  token), and a receiver never assembles a state mixing two steps.
- A header request for a step not staged yet waits for it, up to the
  timeout (under torchft's Manager the receiver asks as soon as the quorum
  names its source, which stages in its own quorum thread); then, as a
  request for another step or for a token no longer staged, it is refused
  with an ``E`` frame saying what this source serves.
- Each connection is served by its own thread with every socket operation
  bounded by the timeout; a malformed request gets an ``E`` frame and the
  connection is closed; a peer that dies mid-transfer ends only its own
  thread. At most :data:`MAX_CONNECTIONS` connections are served at once,
  not counting header requests waiting for a step not staged yet (at most
  :data:`MAX_WAITING` of those; one more is refused at once), so receivers
  idling on a future step never starve the receivers of the staged one.
"""

import logging
import pickle
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path

from rallypoint.ft import _wire

log = logging.getLogger(__name__)

#: Connections served at once, not counting those whose header request waits
#: for a step not staged yet.
MAX_CONNECTIONS = 64
#: Header requests that may wait at once for a step not staged yet.
MAX_WAITING = 256
#: How long ``freeze`` lets a transfer reach its next chunk boundary before
#: shutting its socket down (capped by the transport's timeout).
CUT_AFTER = 1.0


@dataclass
class Staged:
    """One staged step: the header the receivers get and the bytes they fetch."""

    step: int
    token: int
    header: bytes
    spec: bytes
    paths: List[str]
    views: List[memoryview]
    starts: List[int]
    nbytes: List[int]
    total: int
    keep: list  # the CPU tensors `views` point into


def _cpu_bytes(path: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor (a view of it when it already is one)."""
    if t.is_sparse or t.is_quantized or t.layout != torch.strided:
        raise TypeError(f"checkpoint leaf {path}: unsupported tensor layout {t.layout} (only dense tensors travel)")
    if type(t) is not torch.Tensor and type(t.detach()) is not torch.Tensor:
        raise TypeError(f"checkpoint leaf {path}: tensor subclass {type(t).__name__} is not supported (DTensor: not yet)")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # CUDA: copied via CPU at staging
    return t.resolve_conj().resolve_neg().contiguous()


def stage(state_dict: object, step: int) -> Staged:
    """Flattens ``state_dict`` into a header, a pickled spec of its non-tensor
    leaves, and byte views of its tensors."""
    leaves, spec = tree_flatten_with_path(state_dict)
    token = secrets.randbits(63)
    others: Dict[int, object] = {}
    entries, paths, views, nbytes, keep = [], [], [], [], []
    for i, (kp, v) in enumerate(leaves):
        if not isinstance(v, torch.Tensor):
            others[i] = v
            continue
        path = keystr(kp)
        t = _cpu_bytes(path, v)
        n = t.numel() * t.element_size()
        entries.append({"leaf": i, "path": path, "dtype": _wire.dtype_name(t.dtype), "shape": list(t.shape), "nbytes": n})
        flat = t.reshape(-1).view(torch.uint8)
        keep.append(t)
        paths.append(path)
        views.append(memoryview(flat.numpy()).cast("B"))
        nbytes.append(n)
    return Staged(
        step=step,
        token=token,
        header=_wire.encode_header(step, token, len(leaves), entries),
        spec=pickle.dumps((spec, others)),
        paths=paths,
        views=views,
        starts=_wire.offsets(nbytes),
        nbytes=nbytes,
        total=sum(nbytes),
        keep=keep,
    )


class _Abort(Exception):
    """Ends a connection after an ``E`` frame was sent."""


class _Busy(Exception):
    """Too many waiters: refused with an ``E`` frame saying so."""


class Server:
    """Listens on ``host`` (port 0) and serves what is staged."""

    def __init__(self, host: str, timeout: float) -> None:
        self._timeout = timeout
        self._lock = threading.Condition()
        self._staged: Optional[Staged] = None
        self._active: Dict[socket.socket, str] = {}  # connections streaming staged bytes
        self._conns: Dict[socket.socket, str] = {}
        self._closed = False
        self._waiting = 0  # header requests waiting for a step (not held against the cap)
        self.served = 0  # tensor bytes sent, for tests and figures
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(128)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="rally-ckpt-accept", daemon=True)
        self._thread.start()

    # -- the transport's side ------------------------------------------------

    def stage(self, staged: Staged) -> None:
        """Serves ``staged`` from now on (after freezing what was served)."""
        self.freeze()
        with self._lock:
            self._staged = staged
            self._lock.notify_all()

    def _awaited(self, kind: int, step: int) -> Optional[Staged]:
        """What is staged for a request of ``step``. A header request for a
        step not staged yet waits for it (up to the timeout): under torchft's
        Manager the receiver asks as soon as the quorum names its source,
        while the source stages in its own quorum thread (torchft's
        HTTPTransport blocks such a request on its lock in the same way).
        A waiting request does not count against :data:`MAX_CONNECTIONS`
        (idle waiters must not starve receivers of the staged step); at most
        :data:`MAX_WAITING` wait at once, and one more is refused at once."""
        ready = lambda: self._closed or (self._staged is not None and self._staged.step >= step)  # noqa: E731
        with self._lock:
            if kind != _wire.KIND_META or ready():
                return self._staged
            if self._waiting >= MAX_WAITING:
                raise _Busy(f"busy: {MAX_WAITING} receivers already wait for a step not staged yet")
            self._waiting += 1
            try:
                self._lock.wait_for(ready, timeout=self._timeout)
            finally:
                self._waiting -= 1
            return self._staged

    def freeze(self) -> None:
        """Stops serving; returns once no transfer holds the staged tensors,
        or, if a transfer outlives its socket's shutdown by the timeout,
        logs it and returns anyway (never raises: torchft calls
        ``disallow_checkpoint`` in ``should_commit``, outside any try)."""
        with self._lock:
            step = self._staged.step if self._staged is not None else None
            self._staged = None
            if not self._active:
                return
            cut = time.monotonic() + min(CUT_AFTER, self._timeout)
            self._lock.wait_for(lambda: not self._active, timeout=max(cut - time.monotonic(), 0))
            stuck = dict(self._active)
        for s in stuck:  # a receiver not reading: end its stream
            _shutdown(s)
        with self._lock:
            if not self._lock.wait_for(lambda: not self._active, timeout=self._timeout):
                log.warning(
                    "disallow_checkpoint: transfers of step %s to %s did not stop within %ss of their "
                    "sockets being shut down; returning anyway (their sockets are shut down and each "
                    "checks the staging before its next chunk, so they send nothing more)",
                    step,
                    sorted(self._active.values()),
                    self._timeout,
                )

    def close(self, wait: bool = True) -> None:
        with self._lock:
            self._closed = True
            self._staged = None
            self._lock.notify_all()
            conns = list(self._conns)
        _shutdown(self._sock)
        self._sock.close()
        for s in conns:
            _shutdown(s)
        if wait:
            self._thread.join(self._timeout)
            with self._lock:
                self._lock.wait_for(lambda: not self._conns, timeout=self._timeout)

    # -- connections -----------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return  # closed
            peer = _peer_name(addr)
            with self._lock:
                busy, closed = len(self._conns) - self._waiting >= MAX_CONNECTIONS, self._closed
                if not busy and not closed:
                    self._conns[conn] = peer
            if busy or closed:
                conn.settimeout(self._timeout)
                why = "shutting down" if closed else f"busy: {MAX_CONNECTIONS} connections already served"
                _try_error(conn, f"checkpoint source {why}")
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, peer), name=f"rally-ckpt-{peer}", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        conn.settimeout(self._timeout)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while self._answer(conn, peer):
                pass
        except _Abort:
            pass
        except (OSError, socket.timeout) as e:
            log.info("checkpoint receiver %s went away: %s", peer, e)
        except Exception:  # never let one connection harm the others
            log.exception("checkpoint connection from %s failed", peer)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
                self._active.pop(conn, None)
                self._lock.notify_all()
            conn.close()

    def _answer(self, conn: socket.socket, peer: str) -> bool:
        """Answers one request; False when the receiver closed the connection."""
        buf = _recv_request(conn)
        if buf is None:
            return False
        try:
            kind, step, token, offset, length = _wire.decode_request(buf)
        except _wire.WireError as e:
            _refuse(conn, str(e))
        try:
            st = self._awaited(kind, step)
        except _Busy as e:
            _refuse(conn, f"checkpoint source {e}")
        if st is None or st.step != step:
            serving = f"step {st.step}" if st else "no step (none staged since its last commit)"
            waited = f" (waited {self._timeout}s for it)" if kind == _wire.KIND_META else ""
            _refuse(conn, f"step {step} is not served here{waited}: this source serves {serving}")
        if kind == _wire.KIND_META:
            _send_frame(conn, b"H", st.header)
            _send_frame(conn, b"S", st.spec)
            return True
        if token != st.token:
            _refuse(conn, f"step {step} was staged anew since the receiver read its header")
        if length == 0 or offset + length > st.total:
            _refuse(conn, f"range {offset}+{length} outside the {st.total} bytes of step {step}")
        self._send_range(conn, peer, st, offset, length)
        return True

    def _send_range(self, conn: socket.socket, peer: str, st: Staged, offset: int, length: int) -> None:
        with self._lock:
            live = self._staged is st
            if live:
                self._active[conn] = peer
        if not live:
            _refuse(conn, f"step {st.step} stopped being served (disallow_checkpoint: the step committed)")
        try:
            for i, at, n in _wire.segments(st.starts, st.nbytes, offset, length):
                for a in range(at, at + n, _wire.CHUNK):
                    b = min(a + _wire.CHUNK, at + n)
                    if self._staged is not st:
                        _refuse(
                            conn,
                            f"step {st.step} stopped being served while sending tensor {st.paths[i]} "
                            f"(disallow_checkpoint: the step committed)",
                        )
                    conn.sendall(_wire.FRAME.pack(b"D", b - a))
                    conn.sendall(st.views[i][a:b])
                    self.served += b - a  # several threads may race: a count for tests and figures, not an account
        finally:
            with self._lock:
                self._active.pop(conn, None)
                self._lock.notify_all()


def _recv_request(conn: socket.socket) -> Optional[bytes]:
    """The next 40-byte request, or None at a clean end of the connection."""
    buf = bytearray()
    while len(buf) < _wire.REQUEST.size:
        part = conn.recv(_wire.REQUEST.size - len(buf))
        if not part:
            if buf:
                raise OSError(f"connection closed inside a request ({len(buf)} bytes)")
            return None
        buf += part
    return bytes(buf)


def _send_frame(conn: socket.socket, kind: bytes, payload: bytes) -> None:
    conn.sendall(_wire.FRAME.pack(kind, len(payload)))
    conn.sendall(payload)


def _refuse(conn: socket.socket, msg: str) -> None:
    _try_error(conn, msg)
    raise _Abort(msg)


def _try_error(conn: socket.socket, msg: str) -> None:
    try:
        _send_frame(conn, b"E", msg.encode())
    except OSError:
        pass


def _shutdown(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _peer_name(addr) -> str:
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
