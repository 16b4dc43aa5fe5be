"""The lighthouse's push of a dropped member to one generation of a
``ProcessGroupRally``: a daemon thread long-polling ``GET /v1/watch``.

``rally lighthouse`` serves, beside its gRPC on the same port::

    GET /v1/watch?quorum_id=Q&timeout_ms=T
    200 {"quorum_id":Q,"event":"dropped","replica_id":"...","reason":"..."}
    200 {"quorum_id":Q,"event":"superseded","current":Q2}
    200 {"quorum_id":Q,"event":"unknown"}
    204 (nothing within T ms: ask again)

A :class:`Watch` belongs to one generation (one quorum id): on ``dropped``
it calls that generation's ``on_drop(message)`` once and ends, so a watch of
quorum Q can never abort the generation of Q+1 (which has its own watch and
its own group). ``superseded`` and ``unknown`` end it without a call (no
abort is wanted: the quorum moved on, or the service restarted and forgot
it). A 404 means the lighthouse has no such endpoint (torchft's own): it is
logged once per process and the watch ends. A lighthouse that cannot be
reached (restarting) is asked again after a backoff of up to
:data:`MAX_BACKOFF`, until :meth:`Watch.stop`.

Every call has a deadline: the socket's timeout is the poll's ``timeout_ms``
plus :data:`MARGIN`. The thread is a daemon, so it never keeps a process
alive; :meth:`Watch.stop` wakes it from a backoff and closes its connection
so that it ends without waiting out a poll. Needs neither torch nor torchft.
"""

import http.client
import json
import logging
import threading
from typing import Callable, Optional
from urllib.parse import urlparse

from rallypoint import _auth

log = logging.getLogger(__name__)

POLL_MS = 5000
MARGIN = 5.0
MAX_BACKOFF = 1.0

_no_watch_logged = set()
_logged_lock = threading.Lock()


def parse_lighthouse(url: str):
    """(host, port) of a lighthouse address (``http://host:port`` or
    ``host:port``, as TORCHFT_LIGHTHOUSE is spelled), or ValueError."""
    u = urlparse(url if "://" in url else f"http://{url}")
    if u.scheme not in ("http", "") or not u.hostname:
        raise ValueError(f"rallypoint.ft: lighthouse address {url!r} is not http://host:port")
    try:
        port = u.port
    except ValueError:
        port = None
    if port is None:
        raise ValueError(f"rallypoint.ft: lighthouse address {url!r} has no port")
    return u.hostname, port


class Watch:
    """Watches quorum ``quorum_id`` at the lighthouse ``url`` on a daemon
    thread; calls ``on_drop(message)`` at most once."""

    def __init__(self, url: str, quorum_id: int, on_drop: Callable[[str], None], poll_ms: int = POLL_MS):
        self.url = url
        self.host, self.port = parse_lighthouse(url)
        self.quorum_id = quorum_id
        self.poll_ms = poll_ms
        self._on_drop = on_drop
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._conn: Optional[http.client.HTTPConnection] = None
        # What ended the watch (for logs and tests): "dropped", "superseded",
        # "unknown", "no-endpoint", "stopped".
        self.ended: Optional[str] = None
        self._thread = threading.Thread(target=self._run, name=f"rally-watch-q{quorum_id}", daemon=True)
        self._thread.start()

    def stop(self, wait: float = 0.0) -> None:
        """Ends the watch: no ``on_drop`` call starts after this returns (one
        running is waited for: it holds the lock taken here). The thread ends
        on its own (its poll's connection is shut now, or it sees the flag
        when its poll returns); ``wait`` > 0 joins it for up to that long."""
        self._stop.set()
        with self._lock:
            conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(2)
            except OSError:
                pass
        if wait > 0 and threading.current_thread() is not self._thread:
            self._thread.join(wait)

    def _run(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            try:
                status, body = self._poll()
            except (OSError, http.client.HTTPException) as e:
                if self._stop.is_set():
                    break
                log.debug("lighthouse %s unreachable for the watch of quorum %s: %s", self.url, self.quorum_id, e)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)
                continue
            backoff = 0.05
            if status == 204:
                continue
            if status == 404:
                with _logged_lock:
                    first = self.url not in _no_watch_logged
                    _no_watch_logged.add(self.url)
                if first:
                    log.info(
                        "lighthouse %s has no /v1/watch (torchft's own?): survivors learn of a dropped member"
                        " from their ops and the next quorum, not by push",
                        self.url,
                    )
                self.ended = "no-endpoint"
                return
            if status != 200:
                log.warning("lighthouse %s answered the watch of quorum %s with %s: %s", self.url, self.quorum_id, status, body[:200])
                self._stop.wait(MAX_BACKOFF)
                continue
            if self._event(body):
                return
        self.ended = self.ended or "stopped"

    def _event(self, body: bytes) -> bool:
        """Acts on a 200's body; whether the watch ends."""
        try:
            ev = json.loads(body)
            kind = ev["event"]
        except (ValueError, KeyError, TypeError):
            log.warning("lighthouse %s sent a watch answer that is not one: %r", self.url, body[:200])
            self._stop.wait(MAX_BACKOFF)
            return False
        if kind == "dropped":
            msg = (
                f"the lighthouse at {self.url} dropped replica {ev.get('replica_id', '?')} from quorum"
                f" {self.quorum_id}: {ev.get('reason', 'no reason given')}"
            )
            # Under the lock that stop() takes after setting the flag: once
            # stop() has returned, no call starts.
            with self._lock:
                if not self._stop.is_set():
                    self.ended = "dropped"
                    self._on_drop(msg)
            return True
        if kind in ("superseded", "unknown"):
            self.ended = kind
            return True
        log.warning("lighthouse %s sent an unknown watch event %r", self.url, kind)
        self._stop.wait(MAX_BACKOFF)
        return False

    def _poll(self):
        conn = _auth.HTTPConnection(self.host, self.port, label="lighthouse", timeout=self.poll_ms / 1000 + MARGIN)
        with self._lock:
            if self._stop.is_set():
                raise OSError("stopped")
            self._conn = conn
        try:
            conn.request("GET", f"/v1/watch?quorum_id={self.quorum_id}&timeout_ms={self.poll_ms}")
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            with self._lock:
                self._conn = None
            conn.close()
