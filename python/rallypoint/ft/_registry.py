"""Which ``ProcessGroupRally`` this process runs, and the address its
collectives use, so that ``RallyTransport`` needs no argument to find them.

Owned by ``process_group.py`` (which calls :func:`set_current` when a group is
made); read by ``transport.py`` through :func:`current`,
:func:`advertise_host`, :func:`lighthouse` and :func:`replica`. Needs neither
torch nor torchft.
"""

import os
import socket
import threading
import weakref
from typing import Optional
from urllib.parse import urlparse

_lock = threading.Lock()
_current: Optional["weakref.ref"] = None


def set_current(pg) -> None:
    """Records ``pg`` as this process's fault-tolerant group (the latest one wins)."""
    global _current
    with _lock:
        _current = weakref.ref(pg)


def current():
    """This process's ``ProcessGroupRally``, or None if none was made (or it is gone)."""
    with _lock:
        return _current() if _current is not None else None


def _route_to(host: str) -> Optional[str]:
    """The local address on the route to ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def advertise_host() -> str:
    """The address peers reach this process on: the one its collectives listen
    on when a group exists (``pg.listen_host()``), else the one they would use
    (the route to ``MASTER_ADDR``, else to the lighthouse's host), never what
    the hostname resolves to (torchft #329)."""
    pg = current()
    if pg is not None:
        host = pg.listen_host()
        if host:
            return host
    for name in ("MASTER_ADDR",):
        h = os.environ.get(name)
        if h:
            ip = _route_to(h)
            if ip:
                return ip
    lh = os.environ.get("TORCHFT_LIGHTHOUSE") or os.environ.get("RALLY_LIGHTHOUSE")
    if lh:
        host = urlparse(lh if "://" in lh else f"http://{lh}").hostname
        if host:
            ip = _route_to(host)
            if ip:
                return ip
    return "127.0.0.1"


def lighthouse() -> Optional[str]:
    """The lighthouse this process reports to (``http://host:port``): the
    ``ProcessGroupRally``'s ``lighthouse=`` when a group exists (``""``
    there turns reports off too), else ``TORCHFT_LIGHTHOUSE``, else
    ``RALLY_LIGHTHOUSE``; None if none."""
    pg = current()
    if pg is not None and hasattr(pg, "lighthouse"):
        return pg.lighthouse or None
    return os.environ.get("TORCHFT_LIGHTHOUSE") or os.environ.get("RALLY_LIGHTHOUSE") or None


def replica():
    """(replica id, quorum id) of the current generation of this process's
    ``ProcessGroupRally``, as torchft's Manager passed them to ``configure``
    (its replica name, without the ``:uuid`` the lighthouse knows), or
    (None, None) before one."""
    pg = current()
    if pg is None or not hasattr(pg, "membership"):
        return None, None
    return pg.membership
