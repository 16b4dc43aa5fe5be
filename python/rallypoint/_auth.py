"""The job secret's handshake, client side, for rallypoint's own Python clients.

With a job secret on (``rally run --job-secret-file PATH``, which gives its
workers ``RALLY_JOB_SECRET_FILE``), the listeners rallypoint serves (the
replica group's manager, ``rally lighthouse``) admit a connection only after
it proved it holds the secret. This is the same protocol as the Rust crate
``rallypoint-auth`` (its ``handshake`` module documents it), from the standard
library only (``hmac``, ``hashlib``, ``os.urandom``):

    client -> server   HELLO     magic, label, client nonce Nc (32 bytes)
    server -> client   CHALLENGE magic, 0, server nonce Ns, HMAC(K, "rally server" label Nc Ns), key id
    client -> server   PROOF     HMAC(K, "rally client" label Ns Nc), key id
    server -> client   VERDICT   0 admitted, 1 refused

Fresh nonces on both sides: nothing recorded can be replayed. Without the
variable, nothing changes: no handshake is made. PyTorch's own clients never
make one (they reach a protected store through the agent's loopback proxy).
"""

import hashlib
import hmac
import http.client
import os
import socket
import stat
import threading
import time
from typing import Optional, Tuple

__all__ = ["ENV_VAR", "AuthError", "job_secret", "prove", "HTTPConnection"]

ENV_VAR = "RALLY_JOB_SECRET_FILE"
MAGIC = b"RALLYAU1"
NONCE_LEN = 32
PROOF_LEN = 32
KEY_ID_LEN = 4
MIN_LEN = 16
MAX_LEN = 4096
#: How long a handshake may take, as the Rust clients' default.
DEADLINE = 10.0

_lock = threading.Lock()
_cached: Optional[Tuple[str, bytes]] = None


class AuthError(ConnectionError):
    """The job-secret handshake failed: another secret, none, or a broken peer."""


def _load(path: str) -> bytes:
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise AuthError(f"{ENV_VAR}: {path} is not a regular file")
        if st.st_mode & 0o077:
            raise AuthError(
                f"{ENV_VAR}: the job secret file {path} is readable or writable by others"
                f" (mode {st.st_mode & 0o777:o}): chmod 600 {path}"
            )
        with open(path, "rb") as f:
            data = f.read(MAX_LEN + 3)
    except OSError as e:
        raise AuthError(f"{ENV_VAR}: cannot read the job secret file {path}: {e}") from e
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    if len(data) < MIN_LEN:
        raise AuthError(f"{ENV_VAR}: the job secret in {path} is {len(data)} bytes, under the minimum of {MIN_LEN}")
    if len(data) > MAX_LEN:
        raise AuthError(f"{ENV_VAR}: the job secret file {path} is over {MAX_LEN} bytes")
    return data


def job_secret() -> Optional[bytes]:
    """The secret in the file ``RALLY_JOB_SECRET_FILE`` names (read once per path), or None."""
    global _cached
    path = os.environ.get(ENV_VAR, "")
    if not path:
        return None
    with _lock:
        if _cached is None or _cached[0] != path:
            _cached = (path, _load(path))
        return _cached[1]


def key_id(secret: bytes) -> bytes:
    """The secret's public fingerprint (as the Rust crate's ``KeyId``)."""
    return hmac.new(secret, b"rallypoint key id", hashlib.sha256).digest()[:KEY_ID_LEN]


def _recv_exact(sock: socket.socket, n: int, deadline: float, what: str, server: str) -> bytes:
    buf = b""
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AuthError(f"the server at {server} sent no complete job-secret {what} in time (got {len(buf)} of {n} bytes)")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except socket.timeout:
            continue
        if not chunk:
            raise AuthError(
                f"the server at {server} closed the connection during the job-secret handshake"
                f" (waiting for its {what}): does it run without a job secret?"
            )
        buf += chunk
    return buf


def prove(sock: socket.socket, secret: bytes, label: str, server: str, timeout: float = DEADLINE) -> None:
    """Runs the client's side of the handshake for service ``label`` over ``sock``
    (connected to ``server``, named in errors). Returns once admitted; the
    socket's timeout is restored."""
    deadline = time.monotonic() + timeout
    before = sock.gettimeout()
    lab = label.encode()
    nc = os.urandom(NONCE_LEN)
    ours = key_id(secret)
    try:
        sock.sendall(MAGIC + bytes([len(lab)]) + lab + nc)
        head = _recv_exact(sock, len(MAGIC) + 1, deadline, "challenge", server)
        if head[: len(MAGIC)] != MAGIC:
            raise AuthError(f"the server at {server} does not speak the job-secret handshake: does it run without a job secret?")
        if head[-1] == 1:
            n = _recv_exact(sock, 1, deadline, "reply", server)[0]
            theirs = _recv_exact(sock, n, deadline, "reply", server).decode(errors="replace")
            raise AuthError(f"the server at {server} is a {theirs!r} service, not {label!r}")
        if head[-1] != 0:
            raise AuthError(f"the server at {server} sent a malformed job-secret challenge")
        body = _recv_exact(sock, NONCE_LEN + PROOF_LEN + KEY_ID_LEN, deadline, "challenge", server)
        ns, ps, theirs = body[:NONCE_LEN], body[NONCE_LEN : NONCE_LEN + PROOF_LEN], body[NONCE_LEN + PROOF_LEN :]
        want = hmac.new(secret, b"rally server" + lab + nc + ns, hashlib.sha256).digest()
        pc = hmac.new(secret, b"rally client" + lab + ns + nc, hashlib.sha256).digest()
        # Sent even to a server whose proof is wrong, so that it logs a wrong
        # secret rather than a hang-up (as the Rust client does).
        sock.sendall(pc + ours)
        if not hmac.compare_digest(want, ps):
            raise AuthError(f"the server at {server} holds a different job secret (its key id {theirs.hex()}, ours {ours.hex()})")
        verdict = _recv_exact(sock, 1, deadline, "verdict", server)[0]
        if verdict != 0:
            raise AuthError(f"the server at {server} refused our proof: it holds a different job secret (ours {ours.hex()})")
    finally:
        sock.settimeout(before)


class HTTPConnection(http.client.HTTPConnection):
    """``http.client.HTTPConnection`` that proves the job secret (when one is
    configured) right after it connects, for service ``label``."""

    def __init__(self, host: str, port: int, *, label: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._label = label

    def connect(self) -> None:
        super().connect()
        secret = job_secret()
        if secret is not None:
            prove(self.sock, secret, self._label, f"{self.host}:{self.port}", min(self.timeout or DEADLINE, DEADLINE))
