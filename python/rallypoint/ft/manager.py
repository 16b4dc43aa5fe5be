"""``Manager``: per-step fault tolerance for a training loop, without torchft
(torchft's ``torchft.Manager``: same names and meaning; the differences are
listed at the end).

One ``Manager`` per worker process. The worker's replica group (one or more
processes, group ranks 0..W-1) has one *replica group manager* (Rust,
``crates/ft``), which speaks to the lighthouse for the group; this class
speaks to it over a local TCP connection (``_client.py``, the JSON-lines
protocol). Each step:

1. ``start_quorum()`` (from ``Optimizer.zero_grad``) submits the quorum to a
   one-thread executor, so it runs beside the forward pass: the manager
   answers once every group rank asked and the lighthouse issued a quorum.
   On a new quorum id, the cross-replica group (``_generations.py``: one
   ``rally`` group per group rank, across the replica groups) is configured
   at ``<store_address>/rally/ft/<quorum id>/<group rank>``. If peers must
   recover from this replica, its state (``state_dict()`` of every
   registered object, plus the step) is staged on this process's transport
   server (``_serve.py``); if this replica must heal, it fetches the state
   of the step from its source (``_fetch.py``), reports the heal to the
   manager, and parks it, to be loaded on the training thread.
2. ``allreduce(tensor)`` (from the DDP comm hook) waits for the quorum, then
   sums the tensor across the replicas of the quorum and divides by the
   number that take part. A replica that is healing (asynchronous quorum)
   takes part with zeros and does not count. Its Work never raises.
3. ``should_commit()`` (from ``Optimizer.step``) votes yes if nothing
   failed in the step and at least ``min_replicas`` take part, and returns
   the replica group's decision (the AND of its ranks' votes). A parked
   healed state is loaded only on a commit, so a heal that failed on one
   rank of a group is dropped on all of them. It then freezes the staged
   state (the optimizer is about to change those tensors). A commit counts
   the step; a step not committed counts a failure, its reason logged once
   per distinct reason (numbers aside), counted in :attr:`not_committed`
   and reported to the manager.
   After more than ``max_retries`` failures in a row it raises (torchft's
   rule against live locks); otherwise nothing in a step ever raises.

Where the replica group manager is: ``RALLY_FT_MANAGER`` (``host:port``: set
by ``rally run --ft``, whose agent runs it). Without it, group rank 0 starts
one in this process (``rallypoint._native.FtManager``) and, in a group of
several processes, publishes its address under the key ``rally/ft/manager/<restart count>``
of the group's store (``MASTER_ADDR:MASTER_PORT``), which the other ranks
read (waiting up to the connect timeout).

Timeouts (seconds or ``timedelta``): ``timeout`` (collectives, healing,
``should_commit``), ``quorum_timeout``, ``connect_timeout``; the
environment's ``TORCHFT_TIMEOUT_SEC``, ``TORCHFT_QUORUM_TIMEOUT_SEC`` and
``TORCHFT_CONNECT_TIMEOUT_SEC`` override them, as torchft's.

Differences from torchft's ``Manager``: no ``pg``/``checkpoint_transport``
arguments (the ``rally`` group and the raw-TCP transport are built in); the
state is ``state={name: object}`` (or torchft's ``state_dict``/
``load_state_dict`` pair); the replica group id is sent as given (no uuid);
the replica group manager is found or started as above; ``should_commit``
and ``allreduce`` never raise for a failed step (torchft's raise when the
manager cannot be reached); CPU tensors only; no ``WorldSizeMode`` (always
torchft's ``DYNAMIC``), no quantised all_reduce.
"""

import ipaddress
import logging
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Callable, Dict, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp
from torch.utils._pytree import tree_leaves

from rallypoint.ft import _registry
from rallypoint.ft._client import Client, ManagerError, Quorum
from rallypoint.ft._fetch import recv_striped
from rallypoint.ft._generations import Generations
from rallypoint.ft._locate import manager_address
from rallypoint.ft._serve import Server, stage
from rallypoint.ft._watch import parse_lighthouse
from rallypoint.ft._work import _Done

__all__ = ["Manager"]

log = logging.getLogger(__name__)

Seconds = Union[float, int, timedelta]


def _seconds(name: str, value: Seconds, env: Optional[str] = None) -> float:
    """``value`` in seconds, unless the environment variable ``env`` is set
    (torchft's rule: whole seconds)."""
    raw = os.environ.get(env) if env else None
    if raw is not None:
        try:
            value = float(int(raw))
        except ValueError:
            raise ValueError(f"rallypoint.ft: {env}={raw!r} is not a whole number of seconds") from None
    s = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0:
        raise ValueError(f"rallypoint.ft: Manager's {name} must be a positive number of seconds or a timedelta, not {value!r}")
    return float(s)


def _group() -> "tuple[int, int]":
    """(group rank, group world size): torch.distributed's if initialised,
    else ``RANK``/``WORLD_SIZE``, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ValueError(f"rallypoint.ft: RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} are not integers") from None


def _transport_host(lighthouse: str) -> str:
    """The address this process serves its state on: the route to the
    lighthouse's host (every replica reaches the lighthouse) unless that is
    loopback, else the transport's rule (the route to ``MASTER_ADDR``)."""
    if lighthouse:
        try:
            host, _ = parse_lighthouse(lighthouse)
        except ValueError:
            host = None
        ip = _registry._route_to(host) if host else None
        if ip and not ipaddress.ip_address(ip).is_loopback:
            return ip
    return _registry.advertise_host()


class _Averaged(dist._Work):
    """The Work of :meth:`Manager.allreduce`: the sum's Work, then the
    division by the participants, once; never raises."""

    def __init__(self, manager: "Manager", work, tensor: torch.Tensor, divisor: Optional[int]):
        super().__init__()

        def finish(fut):
            try:
                fut.value()
                if divisor:
                    tensor.div_(divisor)
            except Exception as e:  # noqa: BLE001 - the step is not committed instead
                manager.report_error(e)
            return tensor

        self._fut = work.get_future().then(finish)

    def wait(self, timeout=None):
        self._fut.wait()
        return True

    def get_future(self):
        return self._fut


class Manager:
    """Per-step fault tolerance for one worker process (module doc)."""

    def __init__(
        self,
        min_replicas: int = 1,
        state: Optional[Dict[str, object]] = None,
        state_dict: Optional[Callable[[], object]] = None,
        load_state_dict: Optional[Callable[[object], None]] = None,
        replica_group: Optional[str] = None,
        lighthouse: Optional[str] = None,
        timeout: Seconds = timedelta(seconds=60),
        quorum_timeout: Seconds = timedelta(seconds=60),
        connect_timeout: Seconds = timedelta(seconds=60),
        init_sync: bool = True,
        max_retries: Optional[int] = None,
        use_async_quorum: bool = True,
        group_rank: Optional[int] = None,
        group_world_size: Optional[int] = None,
    ) -> None:
        if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
            raise ValueError(f"rallypoint.ft: Manager's min_replicas must be an int >= 1, not {min_replicas!r}")
        if max_retries is not None and (isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0):
            raise ValueError(f"rallypoint.ft: Manager's max_retries must be None or an int >= 0, not {max_retries!r}")
        self._min_replicas = min_replicas
        self._timeout = _seconds("timeout", timeout, "TORCHFT_TIMEOUT_SEC")
        self._quorum_timeout = _seconds("quorum_timeout", quorum_timeout, "TORCHFT_QUORUM_TIMEOUT_SEC")
        self._connect_timeout = _seconds("connect_timeout", connect_timeout, "TORCHFT_CONNECT_TIMEOUT_SEC")
        self._init_sync = bool(init_sync)
        self._max_retries = max_retries
        self._use_async_quorum = bool(use_async_quorum)
        rank, world = _group()
        self._group_rank = rank if group_rank is None else group_rank
        self._group_world_size = world if group_world_size is None else group_world_size
        if not 0 <= self._group_rank < self._group_world_size:
            raise ValueError(f"rallypoint.ft: group rank {self._group_rank} is outside a replica group of {self._group_world_size}")

        self._state_fns: Dict[str, Callable[[], object]] = {}
        self._load_fns: Dict[str, Callable[[object], None]] = {}
        for name, obj in (state or {}).items():
            if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None)):
                raise ValueError(f"rallypoint.ft: state {name!r} ({type(obj).__name__}) has no state_dict/load_state_dict")
            self.register_state_dict_fn(name, obj.load_state_dict, obj.state_dict)
        if (state_dict is None) != (load_state_dict is None):
            raise ValueError("rallypoint.ft: Manager needs both state_dict and load_state_dict, or neither")
        if state_dict is not None:
            self.register_state_dict_fn("default", load_state_dict, state_dict)

        # The step's bookkeeping (torchft's names).
        self._step = 0
        self._batches_committed = 0
        # The id of the quorum this replica's state was committed in (None:
        # not known, a fresh start). It travels with the state (heals,
        # checkpoints: state_dict), so that two histories at one step are
        # told apart: the later quorum's wins (crates/ft/src/results.rs).
        self._line: Optional[int] = None
        self._commit_failures = 0
        self._quorum_id: Optional[int] = None
        self._quorum_future: Optional[Future] = None
        self._errored: Optional[Exception] = None
        self._healing = False
        self._pending_state: Optional[dict] = None
        self._pending_step = 0
        self._participating_rank: Optional[int] = None
        self._participating_world_size = 0
        # The replicas up to date and those healing in this quorum: what
        # min_replicas counts (see should_commit).
        self._quorum_world_size = 0
        #: Steps not committed, and how many times each reason (numbers aside) was seen.
        self.not_committed = 0
        self.reasons: Dict[str, int] = {}
        self.heals = 0

        self._located = manager_address(replica_group, lighthouse, self._group_rank, self._group_world_size, self._connect_timeout)
        self._client = Client(self._located.address, self._group_rank, self._group_world_size, self._connect_timeout)
        try:
            hello = self._client.connect()
        except BaseException:
            self._located.close()  # a manager this process started goes too
            raise
        self._replica_id = str(hello.get("replica_id", replica_group or "0"))
        self._lighthouse = lighthouse or hello.get("lighthouse") or self._located.lighthouse or ""
        self._pg = Generations(timedelta(seconds=self._timeout), self._lighthouse, owner="Manager")
        _registry.set_current(self._pg)
        self._server = Server(_transport_host(self._lighthouse), self._timeout)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rally-ft-quorum")
        log.info(
            "rallypoint.ft: replica group %s, group rank %d of %d, manager at %s, transport at %s",
            self._replica_id, self._group_rank, self._group_world_size, self._located.address, self.metadata(),
        )

    # -- state ---------------------------------------------------------------

    def register_state_dict_fn(self, key: str, load_state_dict: Callable[[object], None], state_dict: Callable[[], object]) -> None:
        """Adds one object's state (torchft's method)."""
        if key in self._state_fns:
            raise ValueError(f"rallypoint.ft: state {key!r} is registered twice")
        self._state_fns[key] = state_dict
        self._load_fns[key] = load_state_dict

    def _manager_state_dict(self) -> dict:
        return {"user": {k: fn() for k, fn in self._state_fns.items()}, "manager": self.state_dict()}

    def state_dict(self) -> Dict[str, Optional[int]]:
        """The Manager's own state (step, batches committed, and the quorum
        the state was committed in), for checkpoints."""
        return {"step": self._step, "batches_committed": self._batches_committed, "line": self._line}

    def load_state_dict(self, state_dict: Dict[str, Optional[int]]) -> None:
        self._step = int(state_dict["step"])
        self._batches_committed = int(state_dict["batches_committed"])
        line = state_dict.get("line")  # absent from torchft's and older checkpoints
        self._line = None if line is None else int(line)

    def metadata(self) -> str:
        """``host:port`` of this process's transport server (what peers heal from)."""
        h = self._server.host
        return f"[{h}]:{self._server.port}" if ":" in h else f"{h}:{self._server.port}"

    # -- the step --------------------------------------------------------------

    def start_quorum(self, allow_heal: bool = True, shrink_only: bool = False, timeout: Optional[Seconds] = None) -> None:
        """Starts this step's quorum (asynchronously unless
        ``use_async_quorum=False``); never raises for a failed quorum."""
        if self._quorum_future is not None:
            self._quorum_future.result()
        self._errored = None
        self._healing = False
        t = self._quorum_timeout if timeout is None else _seconds("timeout", timeout)
        self._quorum_future = self._executor.submit(self._async_quorum, allow_heal, shrink_only, t)
        if not self._use_async_quorum:
            self.wait_quorum()
            if self._healing:
                self._apply_pending_state()
                self._healing = False

    def wait_quorum(self) -> None:
        """Waits for the quorum started by :meth:`start_quorum`."""
        if self._quorum_future is None:
            raise RuntimeError("rallypoint.ft: wait_quorum before start_quorum (call Optimizer.zero_grad or start_quorum first)")
        self._quorum_future.result()

    def _async_quorum(self, allow_heal: bool, shrink_only: bool, timeout: float) -> None:
        """The quorum thread's work for one step; records errors, never raises."""
        try:
            q = self._client.quorum(self._step, self.metadata(), shrink_only, self._init_sync, self._commit_failures, timeout, self._line)
        except Exception as e:  # noqa: BLE001 - the step is not committed
            self._participating_rank, self._participating_world_size = None, 0
            self._quorum_world_size = 0
            self.report_error(e)
            return
        # A replica behind that does not heal (allow_heal=False) counts not.
        self._quorum_world_size = q.max_world_size + (q.healing_world_size if allow_heal else 0)
        if self._use_async_quorum or not allow_heal:
            self._participating_rank, self._participating_world_size = q.max_replica_rank, q.max_world_size
        else:
            self._participating_rank, self._participating_world_size = q.replica_rank, q.replica_world_size
        if q.quorum_id != self._quorum_id:
            addr = f"{q.store_address}/rally/ft/{q.quorum_id}/{self._group_rank}"
            try:
                # A runtime failure is recorded by the group (errored()), not raised.
                self._pg.configure(addr, self._replica_id, q.replica_rank, q.replica_world_size, q.quorum_id)
            except Exception as e:  # noqa: BLE001 - bad input from the quorum
                # The id stays the old one, so the next step configures again
                # rather than running on the last quorum's members.
                self.report_error(e)
                return
            self._quorum_id = q.quorum_id
        if allow_heal:
            try:
                self._recover(q)
            except Exception as e:  # noqa: BLE001 - the step is not committed
                self.report_error(e)

    def _recover(self, q: Quorum) -> None:
        """Serves this replica's state to those that heal from it, and heals
        this replica if it must (into fresh tensors, loaded later)."""
        if q.recover_dst_replica_ranks:
            self._server.stage(stage(self._manager_state_dict(), q.max_step))
        if not q.heal:
            return
        self._healing = True
        # The step it heals to, what its vote names even if the heal fails.
        self._pending_step = q.max_step
        if not q.recover_src_metadata:
            raise ManagerError(f"rallypoint.ft: quorum {q.quorum_id} says heal but names no source's metadata")
        t0 = time.perf_counter()
        got = recv_striped([q.recover_src_metadata], q.max_step, self._timeout, like=self._manager_state_dict())
        seconds = time.perf_counter() - t0
        if not isinstance(got, dict) or "user" not in got or "manager" not in got:
            raise ManagerError(f"rallypoint.ft: the state healed from {q.recover_src_metadata} is not a Manager's (no 'user'/'manager')")
        self._pending_state = got
        self.heals += 1
        nbytes = sum(t.numel() * t.element_size() for t in tree_leaves(got) if isinstance(t, torch.Tensor))
        log.info("rallypoint.ft: healed step %d from %s: %d bytes in %.3f s", q.max_step, q.recover_src_metadata, nbytes, seconds)
        try:
            self._client.report_heal(q.max_step, nbytes, seconds, [q.recover_src_metadata])
        except ManagerError as e:
            log.warning("rallypoint.ft: the heal of step %d was not reported: %s", q.max_step, e)

    def _apply_pending_state(self) -> bool:
        """Loads a healed state into the registered objects, then takes its
        step (training thread); whether it did. A state that fails to load
        is an error of the step, and this rank's step stays behind: the
        group's manager then counts the group as not whole, and every rank
        of it heals from a whole group at the next quorum
        (``crates/ft/src/results.rs``)."""
        self.wait_quorum()
        pending, self._pending_state = self._pending_state, None
        if pending is None:
            return False  # the heal failed: the error is recorded
        user = pending["user"]
        missing = [k for k in self._load_fns if k not in user]
        if missing:
            self.report_error(ManagerError(f"rallypoint.ft: the healed state lacks {missing} (the source registered {sorted(user)})"))
            return False
        try:
            for key, load in self._load_fns.items():
                load(user[key])
            self.load_state_dict(pending["manager"])
        except Exception as e:  # noqa: BLE001 - the step is not committed
            self.report_error(RuntimeError(f"rallypoint.ft: loading the state healed at step {self._pending_step} failed: {type(e).__name__}: {e}"))
            return False
        self._step = self._pending_step
        return True

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: ReduceOp = ReduceOp.AVG):
        """Sums ``tensor`` in place across the quorum's replicas and, for
        ``AVG``, divides by the participants; a Work that never raises.
        torchft's signature: ``should_quantize`` (torchft's FP8 path) is not
        provided and must be false."""
        if should_quantize:
            raise ValueError("rallypoint.ft: Manager.allreduce has no quantized path (should_quantize=True)")
        if self._errored is not None:
            return _Done(tensor)
        self.wait_quorum()
        if self._errored is not None:
            return _Done(tensor)
        if reduce_op not in (ReduceOp.AVG, ReduceOp.SUM):
            raise ValueError(f"rallypoint.ft: Manager.allreduce takes ReduceOp.AVG or SUM, not {reduce_op}")
        if reduce_op == ReduceOp.AVG and not torch.is_floating_point(tensor):
            raise ValueError(f"rallypoint.ft: averaging needs a floating-point tensor, not {tensor.dtype}")
        n = self.num_participants()
        if not self.is_participating():
            tensor.zero_()
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        work = self._pg.collective([tensor], lambda b: b.allreduce([tensor], opts))
        return _Averaged(self, work, tensor, n if reduce_op == ReduceOp.AVG else None)

    def report_error(self, e: Exception) -> None:
        """Marks this step as failed (it will not be committed)."""
        if self._errored is None:
            self._errored = e

    def errored(self) -> Optional[Exception]:
        """The error of this step, or None."""
        return self._errored

    def should_commit(self, timeout: Optional[Seconds] = None) -> bool:
        """Whether to step the optimizer (module doc, step 3)."""
        if self._quorum_future is None:
            self.report_error(RuntimeError("rallypoint.ft: should_commit before any start_quorum"))
        else:
            self._quorum_future.result()
        err = self._pg.errored() if self._quorum_id is not None else None
        if err is not None:
            self.report_error(err)
        n = self.num_participants()
        # A healing replica counts: its heal loads only if this step
        # commits, so counting only the replicas up to date (as torchft,
        # which loads the heal whatever the vote) would leave one up-to-date
        # replica and one healing under min_replicas=2 failing every step.
        # (A heal that then fails is known to its replica only: the others
        # commit without it.)
        enough = self._quorum_world_size >= self._min_replicas
        vote = enough and self._errored is None
        t = self._timeout if timeout is None else _seconds("timeout", timeout)
        # A healing rank (asynchronous quorum; the synchronous one loaded
        # its heal in start_quorum) votes on the step it heals to, and loads
        # the healed state only once its whole group voted to commit: a heal
        # that failed on another rank of the group is dropped on every rank,
        # so the group's ranks stay at one step (torchft loads it first).
        healing = self._healing
        line = self._line
        if healing and self._pending_state is not None:
            line = self._pending_state["manager"].get("line")
        try:
            commit = self._client.should_commit(self._pending_step if healing else self._step, vote, t, line)
        except ManagerError as e:
            self.report_error(e)
            commit = False
        self._server.freeze()
        if healing:
            if commit:
                commit = self._apply_pending_state()
            else:
                self._pending_state = None
        if commit:
            self._step += 1
            self._batches_committed += n
            # A replica behind that did not heal (allow_heal=False) applied
            # the others' average to its own older state: no line's state.
            self._line = self._quorum_id if (healing or self._participating_rank is not None) else None
            self._commit_failures = 0
            return True
        self._commit_failures += 1
        self._not_committed(self._reason(vote, enough, n))
        if self._max_retries is not None and self._commit_failures > self._max_retries:
            raise RuntimeError(
                f"rallypoint.ft: should_commit failed {self._commit_failures} times in a row,"
                f" exceeding max_retries={self._max_retries}; last: {self._reason(vote, enough, n)}"
            )
        return False

    def _reason(self, vote: bool, enough: bool, n: int) -> str:
        if self._errored is not None:
            return f"{type(self._errored).__name__}: {self._errored}"
        if not enough:
            return f"{self._quorum_world_size} replica(s) in the quorum, fewer than min_replicas={self._min_replicas}"
        return "another rank of this replica group voted not to commit"

    def _not_committed(self, reason: str) -> None:
        """Counts a step not committed, logs its reason once, reports it."""
        self.not_committed += 1
        key = re.sub(r"\d+", "#", reason)[:300]
        seen = self.reasons.get(key, 0)
        self.reasons[key] = seen + 1
        if seen == 0:
            log.warning("rallypoint.ft: replica group %s step %d not committed: %s (logged once)", self._replica_id, self._step, reason)
        try:
            self._client.report_not_committed(self._step, reason)
        except ManagerError as e:
            log.debug("rallypoint.ft: not reported: %s", e)

    # -- what the step sees ----------------------------------------------------

    def current_step(self) -> int:
        """The number of steps committed (torchft's name)."""
        return self._step

    def batches_committed(self) -> int:
        """The batches committed over every step and replica."""
        return self._batches_committed

    def commit_failures(self) -> int:
        """Steps not committed in a row."""
        return self._commit_failures

    def num_participants(self) -> int:
        """Replicas taking part in this step (waits for the quorum); 0 before one."""
        if self._quorum_future is None:
            return 0
        self.wait_quorum()
        return self._participating_world_size

    def participating_rank(self) -> Optional[int]:
        """This replica's rank among the participants, or None."""
        if self._quorum_future is None:
            return None
        self.wait_quorum()
        return self._participating_rank

    def is_participating(self) -> bool:
        """False while healing (asynchronous quorum) or outside the participants."""
        return self._participating_rank is not None and not self._healing

    def group_manager_status(self) -> Optional[dict]:
        """The status of the replica group's manager when this process runs
        it (group rank 0 without ``RALLY_FT_MANAGER``), else None."""
        owned = self._located.owned
        return owned.status() if owned is not None else None

    @property
    def replica_id(self) -> str:
        return self._replica_id

    @property
    def quorum_id(self) -> Optional[int]:
        return self._quorum_id

    def shutdown(self, wait: bool = True) -> None:
        """Ends the quorum thread, the cross-replica group, the transport, the
        connection to the replica group manager (and the manager, if this
        process started it). Idempotent."""
        self._client.close()  # first: a quorum call in flight ends at once
        self._executor.shutdown(wait=wait)
        self._pg.shutdown()
        self._server.close(wait)
        self._located.close()
