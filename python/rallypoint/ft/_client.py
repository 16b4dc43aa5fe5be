"""The worker's side of the replica group manager's protocol: JSON lines over
TCP (the contract of issue 48, "The workers' protocol"), in pure Python.

One :class:`Client` per worker process holds one connection to its replica
group's manager. Every request is one JSON object on one ``\\n``-terminated
line; the manager answers requests in order with ``{"ok": true, ...}`` or
``{"ok": false, "error": "..."}``. The first request on a connection is
``hello`` (this process's group rank, the group's world size, its pid).

Deadlines: connecting (and saying hello) is retried until the connect
timeout, so a manager that is still starting is waited for; every later call
has its own deadline, which is the timeout sent to the manager plus
:data:`MARGIN` (the manager's own timeout answer, naming who never came,
arrives first). A call that fails on the connection (refused, reset, closed,
or no answer by its deadline) closes it: an answer arriving late would
otherwise be read as the next call's; the next call reconnects and says hello
again. Every failure raises :class:`ManagerError` naming the manager's
address, the op and what was waited for. Calls are serialised by a lock (the
quorum thread and the training thread share the connection).

Liveness: once hello is answered, a daemon thread writes ``{"op":"beat"}``
every :data:`BEAT_INTERVAL` seconds (never answered; writes share a second
lock with the calls, so lines never interleave). The manager closes a
connection that beat and then fell silent for its worker keep-alive (1 s):
a worker that is stopped (SIGSTOP) or hung with the GIL held takes its group
out of the quorum, although the manager, in the agent, heartbeats on.

Needs neither torch nor torchft.
"""

import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

from rallypoint import _auth

#: Longest line either side sends (the contract's limit).
MAX_LINE = 1 << 20
#: Seconds a call waits beyond the timeout it sends to the manager.
MARGIN = 5.0
#: Deadline of a ``report`` call, in seconds (it is answered at once).
REPORT_TIMEOUT = 5.0
#: Seconds between two beats (a tenth of the manager's default keep-alive).
BEAT_INTERVAL = 0.1
_BEAT = b'{"op":"beat"}\n'


class ManagerError(RuntimeError):
    """A call to the replica group's manager failed (its text says why)."""


def parse_address(address: str) -> Tuple[str, int]:
    """(host, port) of ``host:port`` (``[v6]:port`` too), or ValueError."""
    if not isinstance(address, str):
        raise ValueError(f"rallypoint.ft: the manager's address must be 'host:port', not {address!r}")
    host, _, port = address.strip().rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"rallypoint.ft: the manager's address {address!r} is not 'host:port'")
    return host, int(port)


@dataclass
class Quorum:
    """One rank's result of a quorum round (contract op 2)."""

    quorum_id: int
    replica_id: str
    replica_rank: Optional[int]
    replica_world_size: int
    recover_src_replica_rank: Optional[int]
    recover_src_metadata: Optional[str]
    recover_dst_replica_ranks: List[int]
    store_address: str
    max_step: int
    max_replica_rank: Optional[int]
    max_world_size: int
    heal: bool
    commit_failures: int
    replica_ids: List[str]
    #: Participants that heal in this quorum (ours; 0 from older managers).
    healing_world_size: int = 0

    @classmethod
    def parse(cls, q: object) -> "Quorum":
        if not isinstance(q, dict):
            raise ManagerError(f"rallypoint.ft: the manager's quorum answer is not an object: {q!r}")
        try:
            return cls(
                quorum_id=int(q["quorum_id"]),
                replica_id=str(q["replica_id"]),
                replica_rank=None if q.get("replica_rank") is None else int(q["replica_rank"]),
                replica_world_size=int(q["replica_world_size"]),
                recover_src_replica_rank=None if q.get("recover_src_replica_rank") is None else int(q["recover_src_replica_rank"]),
                recover_src_metadata=q.get("recover_src_metadata"),
                recover_dst_replica_ranks=[int(r) for r in q.get("recover_dst_replica_ranks") or []],
                store_address=str(q["store_address"]),
                max_step=int(q["max_step"]),
                max_replica_rank=None if q.get("max_replica_rank") is None else int(q["max_replica_rank"]),
                max_world_size=int(q["max_world_size"]),
                heal=bool(q["heal"]),
                commit_failures=int(q.get("commit_failures", 0)),
                replica_ids=[str(r) for r in q.get("replica_ids") or []],
                healing_world_size=int(q.get("healing_world_size") or 0),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ManagerError(f"rallypoint.ft: the manager's quorum answer is malformed ({type(e).__name__}: {e}): {q!r}") from e


class Client:
    """One worker's connection to its replica group's manager (module doc)."""

    def __init__(self, address: str, group_rank: int, group_world_size: int, connect_timeout: float):
        self.host, self.port = parse_address(address)
        self.address = address
        self.group_rank = group_rank
        self.group_world_size = group_world_size
        self.connect_timeout = float(connect_timeout)
        self._lock = threading.Lock()
        #: Held while writing a line (a call's or a beat), never while waiting.
        self._send_lock = threading.Lock()
        self._beating = False
        self._beat_thread: Optional[threading.Thread] = None
        self._sock: Optional[socket.socket] = None
        self._buf = b""
        self._closed = False
        #: The manager's hello answer (replica_id, store_address, lighthouse).
        self.hello: dict = {}

    # -- connection ----------------------------------------------------------

    def connect(self) -> dict:
        """Connects and says hello, retrying until the connect timeout; the
        hello answer. Raises ManagerError naming the address."""
        with self._lock:
            self._ensure()
            return self.hello

    def _ensure(self) -> None:
        if self._closed:
            raise ManagerError(f"rallypoint.ft: the connection to the replica group's manager at {self.address} was closed (shutdown)")
        if self._sock is not None:
            return
        deadline = time.monotonic() + self.connect_timeout
        last: Optional[BaseException] = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ManagerError(
                    f"rallypoint.ft: could not reach the replica group's manager at {self.address}"
                    f" within the connect timeout ({self.connect_timeout:g} s): {last}"
                )
            try:
                sock = socket.create_connection((self.host, self.port), timeout=min(left, 5.0))
                break
            except OSError as e:
                last = e
                # The manager may not listen yet: retry, at most until the deadline.
                time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        secret = _auth.job_secret()
        if secret is not None:
            try:
                _auth.prove(sock, secret, "ft-manager", self.address, max(deadline - time.monotonic(), 1.0))
            except (_auth.AuthError, OSError) as e:
                sock.close()
                raise ManagerError(f"rallypoint.ft: the replica group's manager at {self.address}: {e}") from e
        self._sock, self._buf = sock, b""
        hello = {"op": "hello", "group_rank": self.group_rank, "group_world_size": self.group_world_size, "pid": os.getpid()}
        self.hello = self._exchange(hello, max(deadline - time.monotonic(), 1.0))
        self._beating = True
        if self._beat_thread is None:
            self._beat_thread = threading.Thread(target=self._beat, name="rallypoint-ft-beat", daemon=True)
            self._beat_thread.start()

    def _beat(self) -> None:
        """Tells the manager this process is alive, until the client closes."""
        while not self._closed:
            time.sleep(BEAT_INTERVAL)
            with self._send_lock:
                sock = self._sock if self._beating else None
                if sock is None:
                    continue
                try:
                    sock.sendall(_BEAT)
                except OSError:
                    pass  # the next call finds the connection broken and reconnects

    def close(self) -> None:
        """Closes the connection (the manager sees this worker leave); a call
        in flight on another thread fails at once. Later calls fail."""
        self._closed = True
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        with self._send_lock:
            self._beating = False
            sock, self._sock, self._buf = self._sock, None, b""
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    # -- calls ---------------------------------------------------------------

    def call(self, request: dict, timeout: float) -> dict:
        """Sends ``request`` and returns the answer (``ok: true``) within
        ``timeout`` seconds; ManagerError otherwise."""
        with self._lock:
            self._ensure()
            return self._exchange(request, timeout)

    def _exchange(self, request: dict, timeout: float) -> dict:
        op = request.get("op")
        line = json.dumps(request, separators=(",", ":")).encode() + b"\n"
        if len(line) > MAX_LINE:
            raise ManagerError(f"rallypoint.ft: the {op} request is {len(line)} bytes, over the protocol's {MAX_LINE}")
        deadline = time.monotonic() + timeout
        try:
            assert self._sock is not None
            self._sock.settimeout(max(timeout, 0.001))
            with self._send_lock:
                self._sock.sendall(line)
            answer = self._read_line(deadline, op)
        except (OSError, ManagerError) as e:
            self._drop()
            if isinstance(e, ManagerError):
                raise
            what = "no answer" if isinstance(e, socket.timeout) else f"{type(e).__name__}: {e}"
            raise ManagerError(
                f"rallypoint.ft: the {op} call to the replica group's manager at {self.address} failed"
                f" after waiting up to {timeout:g} s: {what}"
            ) from e
        try:
            msg = json.loads(answer)
        except ValueError as e:
            self._drop()
            raise ManagerError(f"rallypoint.ft: the manager at {self.address} answered {op} with a line that is not JSON: {answer[:200]!r}") from e
        if not isinstance(msg, dict) or not isinstance(msg.get("ok"), bool):
            self._drop()
            raise ManagerError(f"rallypoint.ft: the manager at {self.address} answered {op} without an 'ok' field: {answer[:200]!r}")
        if not msg["ok"]:
            if op == "hello":
                self._drop()
            raise ManagerError(f"rallypoint.ft: the manager at {self.address} refused {op}: {msg.get('error', '(no error given)')}")
        return msg

    def _read_line(self, deadline: float, op) -> bytes:
        assert self._sock is not None
        while True:
            nl = self._buf.find(b"\n")
            if nl >= 0:
                line, self._buf = self._buf[:nl], self._buf[nl + 1 :]
                return line
            if len(self._buf) > MAX_LINE:
                raise ManagerError(f"rallypoint.ft: the manager at {self.address} answered {op} with a line over {MAX_LINE} bytes")
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("no answer by the deadline")
            self._sock.settimeout(left)
            chunk = self._sock.recv(65536)
            if not chunk:
                raise ManagerError(f"rallypoint.ft: the manager at {self.address} closed the connection before answering {op}")
            self._buf += chunk

    def quorum(
        self, step: int, metadata: str, shrink_only: bool, init_sync: bool, commit_failures: int, timeout: float, line: Optional[int] = None
    ) -> Quorum:
        """This rank's result of the next quorum round (contract op 2);
        ``line``: the quorum its state was committed in, if known."""
        msg = self.call(
            {
                "op": "quorum",
                "step": int(step),
                "metadata": metadata,
                "shrink_only": bool(shrink_only),
                "init_sync": bool(init_sync),
                "commit_failures": int(commit_failures),
                "timeout_ms": int(timeout * 1000),
                "line": None if line is None else int(line),
            },
            timeout + MARGIN,
        )
        return Quorum.parse(msg.get("quorum"))

    def should_commit(self, step: int, vote: bool, timeout: float, line: Optional[int] = None) -> bool:
        """The replica group's decision for ``step`` (the AND of its ranks'
        votes), voted from a state of ``line``."""
        req = {"op": "should_commit", "step": int(step), "vote": bool(vote), "timeout_ms": int(timeout * 1000)}
        req["line"] = None if line is None else int(line)
        msg = self.call(req, timeout + MARGIN)
        commit = msg.get("commit")
        if not isinstance(commit, bool):
            raise ManagerError(f"rallypoint.ft: the manager at {self.address} answered should_commit without a boolean 'commit': {msg!r}")
        return commit

    def report_heal(self, step: int, nbytes: int, seconds: float, sources: List[str]) -> None:
        self.call({"op": "report", "kind": "heal", "step": int(step), "bytes": int(nbytes), "seconds": float(seconds), "sources": list(sources)}, REPORT_TIMEOUT)

    def report_not_committed(self, step: int, reason: str) -> None:
        self.call({"op": "report", "kind": "not_committed", "step": int(step), "reason": str(reason)}, REPORT_TIMEOUT)
