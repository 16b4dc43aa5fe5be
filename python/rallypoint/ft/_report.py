"""Heals reported to ``rally lighthouse`` (``POST /v1/heal``), for its
``/status`` and ``/metrics``: best-effort, off the training loop.

:func:`heal` hands the report to a daemon thread and returns at once, so a
heal is never delayed and nothing here ever raises into torchft's loop. The
thread posts one JSON object::

    {"replica_id": "...", "step": S, "bytes": N, "seconds": T,
     "sources": ["host:port", ...], "quorum_id": Q}

with a deadline of :data:`TIMEOUT` seconds per post. A lighthouse without the
endpoint (torchft's own: 404, 405 or 501) is logged once per process and
address, and not asked again; any other failure (a refusal, the lighthouse
restarting) is logged as a warning and the report dropped. At exit, reports
still on their way get up to :data:`EXIT_WAIT` seconds to land, so that a
process which ends right after healing still shows its heal. Needs neither
torch nor torchft.
"""

import atexit
import http.client
import json
import logging
import threading
from typing import Dict, List, Optional, Sequence

from rallypoint import _auth
from rallypoint.ft._watch import parse_lighthouse

log = logging.getLogger(__name__)

#: Deadline of one post, in seconds.
TIMEOUT = 5.0
#: The longest an exiting process waits for reports still on their way.
EXIT_WAIT = 2.0

_lock = threading.Lock()
# Lighthouse addresses without the endpoint: not asked again.
_no_endpoint: set = set()
_pending: List[threading.Thread] = []
# What the last post to each address got (for tests): "recorded",
# "no-endpoint", "refused", "unreachable".
last_outcome: Dict[str, str] = {}


def heal(lighthouse: str, replica_id: str, step: int, nbytes: int, seconds: float, sources: Sequence[str], quorum_id: Optional[int]) -> None:
    """Reports a heal to ``lighthouse`` (``http://host:port``) on a daemon
    thread; returns at once and never raises."""
    try:
        host, port = parse_lighthouse(lighthouse)
        with _lock:
            if lighthouse in _no_endpoint:
                return
            _pending[:] = [t for t in _pending if t.is_alive()]
        body = json.dumps(
            {
                "replica_id": str(replica_id),
                "step": int(step),
                "bytes": int(nbytes),
                "seconds": float(seconds),
                "sources": [str(s) for s in sources],
                "quorum_id": None if quorum_id is None else int(quorum_id),
            }
        ).encode()
        t = threading.Thread(target=_post, args=(lighthouse, host, port, body), name="rally-heal-report", daemon=True)
        with _lock:
            _pending.append(t)
        t.start()
    except Exception as e:  # noqa: BLE001 - best-effort by design
        log.warning("rallypoint.ft: not reporting the heal of step %s to %s: %s", step, lighthouse, e)


def _post(url: str, host: str, port: int, body: bytes) -> None:
    conn = _auth.HTTPConnection(host, port, label="lighthouse", timeout=TIMEOUT)
    try:
        conn.request("POST", "/v1/heal", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        text = r.read(4096).decode("utf-8", "replace").strip()
        if r.status == 200:
            last_outcome[url] = "recorded"
        elif r.status in (404, 405, 501):
            last_outcome[url] = "no-endpoint"
            with _lock:
                first = url not in _no_endpoint
                _no_endpoint.add(url)
            if first:
                log.info("rallypoint.ft: the lighthouse at %s has no heal endpoint (HTTP %s; torchft's own?): heals are not reported to it", url, r.status)
        else:
            last_outcome[url] = "refused"
            log.warning("rallypoint.ft: the lighthouse at %s refused a heal report: HTTP %s: %s", url, r.status, text)
    except Exception as e:  # noqa: BLE001 - best-effort by design
        last_outcome[url] = "unreachable"
        log.warning("rallypoint.ft: could not report a heal to the lighthouse at %s: %s", url, e)
    finally:
        conn.close()


def wait(timeout: float) -> bool:
    """Waits up to ``timeout`` seconds for reports on their way; whether all landed."""
    import time

    deadline = time.monotonic() + timeout
    with _lock:
        pending = list(_pending)
    for t in pending:
        t.join(max(deadline - time.monotonic(), 0))
    return not any(t.is_alive() for t in pending)


atexit.register(wait, EXIT_WAIT)
