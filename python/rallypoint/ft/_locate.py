"""Where a worker's replica group manager is, or starting one (the contract of
issue 48, "Environment a worker sees").

- ``RALLY_FT_MANAGER=host:port`` (``rally run --ft`` sets it: the agent runs
  the manager): that one. ``RALLY_FT_MANAGER=store`` (``rally run --ft``
  with several nodes per group): the address under :data:`AGENT_KEY` of the
  round's job store (``MASTER_ADDR:MASTER_PORT``), which the agent of the
  round's group rank 0 puts there, waited for up to the connect timeout.
- Otherwise the replica group id is ``replica_group=``, else
  ``RALLY_FT_REPLICA_GROUP``, else ``REPLICA_GROUP_ID``; the lighthouse
  ``lighthouse=``, else ``RALLY_FT_LIGHTHOUSE``, else ``TORCHFT_LIGHTHOUSE``.
  Group rank 0 starts a manager in this process
  (``rallypoint._native.FtManager``); in a group of several processes it
  publishes the manager's address under :data:`KEY` ``/<restart count>`` of
  the group's store (``MASTER_ADDR:MASTER_PORT``, a TCPStore client), which
  the other ranks read, waiting up to the connect timeout. The restart count
  (``TORCHELASTIC_RESTART_COUNT``, the same for every worker of one
  incarnation) keeps a restarted group from reading the address of the
  manager that died with its last rank 0 (the launcher's store outlives its
  workers). A group of one process needs no store.

Needs neither torchft nor, unless a manager is started, the extension.
"""

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

log = logging.getLogger(__name__)

#: ``RALLY_FT_MANAGER``'s value under ``rally run --ft`` with several nodes
#: per group: read :data:`AGENT_KEY` of the round's job store.
STORE = "store"
#: The job store's key where ``rally run --ft``'s agent (the round's group
#: rank 0) puts the manager's ``host:port``.
AGENT_KEY = "rally/ft/manager"

#: The group store's key holding the in-process manager's ``host:port``
#: (followed by ``/<restart count>``).
KEY = "rally/ft/manager"


def _key() -> str:
    return f"{KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


@dataclass
class Located:
    """The manager's address, the lighthouse, and the manager if this process runs it."""

    address: str
    lighthouse: Optional[str]
    owned: object = None

    def close(self) -> None:
        owned, self.owned = self.owned, None
        if owned is not None:
            owned.shutdown()


def _first(*values: Optional[str]) -> Optional[str]:
    for v in values:
        if v:
            return v
    return None


def _group_store(timeout: float):
    from torch.distributed import TCPStore

    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port or not port.isdigit():
        raise RuntimeError(
            "rallypoint.ft: a replica group of several processes without RALLY_FT_MANAGER needs the group's store"
            f" (MASTER_ADDR/MASTER_PORT, as torchrun sets them); MASTER_ADDR={host!r} MASTER_PORT={port!r}"
        )
    return TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout)), f"{host}:{port}"


def _start(replica_id: str, lighthouse: str, world_size: int, connect_timeout: float):
    """A manager in this process (``rallypoint._native.FtManager``)."""
    from rallypoint import _native

    cls = getattr(_native, "FtManager", None)
    if cls is None:
        raise RuntimeError(
            "rallypoint.ft: no RALLY_FT_MANAGER, and this build of rallypoint._native has no FtManager to start one"
            " in-process: run under `rally run --ft`, or set RALLY_FT_MANAGER to a running manager"
        )
    return cls(replica_id=replica_id, lighthouse=lighthouse, world_size=world_size, connect_timeout_s=connect_timeout)


def manager_address(replica_group: Optional[str], lighthouse: Optional[str], group_rank: int, world_size: int, connect_timeout: float) -> Located:
    """Finds (or, as group rank 0, starts) this replica group's manager (module doc)."""
    lh = _first(lighthouse, os.environ.get("RALLY_FT_LIGHTHOUSE"), os.environ.get("TORCHFT_LIGHTHOUSE"))
    env = os.environ.get("RALLY_FT_MANAGER")
    if env == STORE:
        # `rally run --ft` with several nodes per group: the agent of the
        # round's group rank 0 puts its manager's address in the round's
        # job store (a fresh store every round: no stale address).
        store, where = _group_store(connect_timeout)
        try:
            return Located(store.get(AGENT_KEY).decode(), lh)
        except Exception as e:  # noqa: BLE001 - torch raises several kinds
            raise TimeoutError(
                f"rallypoint.ft: group rank {group_rank} waited {connect_timeout:g} s for rally run to publish its"
                f" replica group manager's address under {AGENT_KEY} of the job store at {where}: {e}"
            ) from e
    if env:
        return Located(env, lh)
    rid = _first(replica_group, os.environ.get("RALLY_FT_REPLICA_GROUP"), os.environ.get("REPLICA_GROUP_ID"))
    if group_rank == 0:
        if rid is None:
            raise ValueError(
                "rallypoint.ft: no replica group id: pass Manager(replica_group=...), or set RALLY_FT_REPLICA_GROUP"
                " (rally run --ft sets it) or REPLICA_GROUP_ID"
            )
        if lh is None:
            raise ValueError(
                "rallypoint.ft: no lighthouse: pass Manager(lighthouse='http://host:port'), or set RALLY_FT_LIGHTHOUSE"
                " or TORCHFT_LIGHTHOUSE"
            )
        owned = _start(str(rid), lh, world_size, connect_timeout)
        addr = owned.address() if callable(getattr(owned, "address", None)) else owned.address
        if world_size > 1:
            store, where = _group_store(connect_timeout)
            store.set(_key(), addr)
            log.info("rallypoint.ft: replica group %s's manager at %s, published under %s of %s", rid, addr, _key(), where)
        return Located(addr, lh, owned)
    store, where = _group_store(connect_timeout)
    try:
        addr = store.get(_key()).decode()
    except Exception as e:  # noqa: BLE001 - torch raises several kinds
        raise TimeoutError(
            f"rallypoint.ft: group rank {group_rank} waited {connect_timeout:g} s for group rank 0 to publish its"
            f" replica group manager's address under {_key()} of the store at {where}: {e}"
        ) from e
    return Located(addr, lh)
