"""The ``rally`` backend for ``torch.distributed`` (CPU tensors).

``import rallypoint.torch`` registers it; then::

    dist.init_process_group("rally")                # every CPU collective
    dist.init_process_group("cpu:rally,cuda:nccl")  # NCCL keeps the GPU tensors

The group forms through the store torch hands every backend (the job's
TCPStore, FileStore or HashStore, under the group's prefix): no second
rendezvous and no extra environment variables. Its collectives are the
``rallypoint-collectives`` crate's (``rallypoint._native``): shared memory when
every rank is on one host, TCP otherwise, and failures named:

- a dead rank fails every survivor's operation, naming the rank
  (``DistNetworkError``), instead of hanging until the 30-minute timeout;
- ranks that call different collectives (operation, dtype, count, root or
  reduce op) each get an error naming both calls (``DistBackendError``),
  without ``TORCH_DISTRIBUTED_DEBUG``;
- a timeout says which rank it waited for (``DistBackendError``);
- :func:`monitored_barrier` names every rank that did not arrive.

torch 2.15's reconfigure API works too (``init_process_group("rally",
enable_reconfigure=True)``, ``dist._get_reconfigure_handle``,
``dist._reconfigure``): each reconfigure forms the next membership under
``<group>/reconfigure/<uuid>`` of the backend's store; :func:`membership`
tells this process's rank and size in it (torch's own ``get_rank`` keeps
the first ones). See docs/torch-backend.md.

Tensors must be CPU and contiguous, of a dtype in ``DTYPES``; anything else
raises ``ValueError`` before anything is sent (nothing is copied silently).
How a call reaches Rust and how its future completes:
``crates/torch/src/lib.rs``.
"""

import atexit
import datetime
import itertools
import os
import threading
import time
import uuid
from typing import List, Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch._C._distributed_c10d import ReduceOp

from rallypoint import _native

__all__ = ["RallyBackend", "monitored_barrier", "membership", "DTYPES"]

NAME = "rally"

# torch dtype -> the crate's DType code (bool travels as uint8).
DTYPES = {
    torch.uint8: 1,
    torch.int8: 2,
    torch.int16: 4,
    torch.int32: 6,
    torch.int64: 8,
    torch.float16: 9,
    torch.bfloat16: 10,
    torch.float32: 11,
    torch.float64: 12,
    torch.bool: 1,
}

_R = ReduceOp.RedOpType
# torch ReduceOp -> the crate's ReduceOp code.
_OPS = {_R.SUM: 1, _R.PRODUCT: 2, _R.MIN: 3, _R.MAX: 4, _R.AVG: 5, _R.BAND: 6, _R.BOR: 7, _R.BXOR: 8}
# On bool, as torch's other backends: SUM is or, PRODUCT is and.
_BOOL_OPS = {_R.SUM: 4, _R.PRODUCT: 3, _R.MIN: 3, _R.MAX: 4, _R.BAND: 6, _R.BOR: 7, _R.BXOR: 8}

# Which torch class each failure raises (see the guide's table).
_ERRORS = {
    "gone": dist.DistNetworkError,
    "timeout": dist.DistBackendError,
    "mismatch": dist.DistBackendError,
    "aborted": dist.DistBackendError,
    "backend": dist.DistBackendError,
    "invalid": ValueError,
}


def _done(token, kind, message):
    """Completes an op's future; called by the crate's thread, with the GIL."""
    fut, result, _keep, after = token
    if kind is None:
        if after is not None:
            try:
                after()
            except Exception as e:  # noqa: BLE001 - the future carries it
                fut.set_exception(e)
                return
        fut.set_result(result)
    else:
        fut.set_exception(_ERRORS.get(kind, dist.DistBackendError)(message))


def _value(fut):
    return fut.value()


class _Work(dist._Work):
    """An op's handle. Not ``_create_work_from_future``: torch's Python
    ``Future.set_exception`` completes the C++ future *successfully* with the
    exception as its value (torch/futures/__init__.py), and the Work that
    function makes ignores a failed future's error in ``wait()``, so a failed
    op would pass as done. Here ``wait()`` raises the op's error as its torch
    class, and ``get_future()`` (DDP, comm hooks) is a future that fails at
    the C++ level (``then`` turns the raise into an error there)."""

    def __init__(self, fut):
        super().__init__()
        self._fut = fut
        self._failing = None

    def wait(self, timeout=None):
        # torch.futures.Future.wait releases the GIL while it blocks. The op
        # has its own deadline (the group's timeout), so `timeout` is unused.
        self._fut.wait()
        return True

    def get_future(self):
        if self._failing is None:
            self._failing = self._fut.then(_value)
        return self._failing


def _check(t: torch.Tensor, what: str) -> int:
    """The dtype code of a tensor the backend can use, or ValueError."""
    if t.device.type != "cpu":
        raise ValueError(f"rally: {what} is on {t.device}; the rally backend takes CPU tensors (use cpu:rally,cuda:nccl for GPU ones)")
    if t.layout != torch.strided:
        raise ValueError(f"rally: {what} has layout {t.layout}; only dense tensors are supported")
    if not t.is_contiguous():
        raise ValueError(f"rally: {what} is not contiguous; call .contiguous() first (rally does not copy)")
    code = DTYPES.get(t.dtype)
    if code is None:
        names = ", ".join(str(d).replace("torch.", "") for d in DTYPES)
        raise ValueError(f"rally: {what} has dtype {t.dtype}; supported: {names}")
    return code


def _one(tensors: List[torch.Tensor], what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"rally: {what} takes one tensor per call, got {len(tensors)}")
    return tensors[0]


def _same(ts: List[torch.Tensor], t: torch.Tensor, what: str) -> None:
    for i, o in enumerate(ts):
        _check(o, f"{what}[{i}]")
        if o.dtype != t.dtype or o.numel() != t.numel():
            raise ValueError(
                f"rally: {what}[{i}] is {o.dtype} x {o.numel()}, but the input is {t.dtype} x {t.numel()}"
                " (every rank's part must have the input's dtype and size)"
            )


def _timeout(opts) -> Optional[float]:
    s = opts.timeout.total_seconds()
    return s if s > 0 else None


class RallyBackend(_C10dBackend):
    """A ``torch.distributed`` Backend over rallypoint's collectives (CPU)."""

    def __init__(
        self,
        store,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        name: str,
        ranks=None,
        *,
        done=None,
        fresh_prefix: bool = False,
        reconfigurable: bool = False,
        advertise: Optional[str] = None,
        lineage: bool = False,
        prev=None,
    ):
        if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
            # torch 2.15 wraps a plugin backend in its ProcessGroupWrapper
            # under DETAIL (distributed_c10d._new_process_group_helper), and
            # the wrapper's first call fails with an internal assert
            # ("getBackendName is not implemented"), for any Python backend.
            raise ValueError(
                "rally: TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the backend in torch's ProcessGroupWrapper,"
                " which fails on its first call in torch 2.15; rally compares every call across ranks"
                " without it: unset it, or use INFO"
            )
        super().__init__(rank, size)
        self._store = store
        self._timeout = timeout
        self._name = name
        self._rank, self._size = rank, size
        self._ranks = list(ranks) if ranks else list(range(size))
        self._options = _C10dBackend.Options(NAME, timeout=timeout)
        # `done(token, kind, message)` completes an op's future; the
        # fault-tolerant group (rallypoint.ft) passes one that never fails it.
        self._done = done or _done
        self._monitored = itertools.count(1)
        self._lock = threading.Lock()
        self._reconfigure = _Reconfigure(store)
        self._group = None
        self._prefix = name
        if reconfigurable:
            # torch's enable_reconfigure: no members until reconfigure().
            return
        if not fresh_prefix:
            # torch may hand the same prefix again after destroy_process_group
            # (group names restart at 0), where an earlier group's keys are:
            # each rank counts the groups it formed under this prefix, the
            # same count on every rank, and the group forms under a fresh
            # sub-prefix. (A caller whose every prefix is fresh, as torchft's
            # quorum ids make them, skips that store round.)
            again = store.add(f"rallypoint/formed/{rank}", 1)
            self._prefix = name if again == 1 else f"{name}.{again}"
        # `advertise`: the IP address its collectives listen on (default:
        # the route to MASTER_ADDR); rallypoint.ft passes the route to the
        # quorum's store, which every member reaches.
        if lineage:
            # A generation of a group whose members change: over `prev`'s
            # (a native group of this process's last generation) connections
            # to the members that survive (see `ProcessGroup::next_generation`).
            self._group = _native.Group.next_generation(
                prev, store, rank, size, timeout.total_seconds(), self._prefix, self._done, advertise
            )
        else:
            self._group = _native.Group(store, rank, size, timeout.total_seconds(), self._prefix, self._done, advertise)

    @property
    def _g(self):
        g = self._group
        if g is None:
            raise ValueError(
                "rally: this group was made with enable_reconfigure=True and has no members yet:"
                " call dist._reconfigure(uuid, handles) first"
            )
        return g

    # torch 2.15's ProcessGroup reads rank and size from the C++ Backend's
    # fields, set at construction; after a reconfigure the Python backend's
    # own answers are the current ones (see `membership`).
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    # -- reconfigure (torch 2.15's fault-tolerance API) -------------------

    @property
    def supports_reconfigure(self):
        return True

    def get_reconfigure_handle(self) -> str:
        return self._reconfigure.handle

    def reconfigure(self, opts):
        """Forms the next membership: ``opts.handles`` (one handle per member,
        a list in rank order, or a set this backend orders) under
        ``opts.uuid`` (fresh each time) through the store this backend was
        made with. The current members' group, if any, is replaced: its ops
        in flight fail (aborted, naming the reconfigure). Blocks until this
        rank has joined: every member's entry read (one store round), the
        connections to members that stay kept; the returned Work is complete."""
        rank, size, prefix = self._reconfigure.next(opts, self._name)
        timeout = opts.timeout if opts.timeout is not None else self._timeout
        # Over the last membership's connections to the members that stay
        # (see `ProcessGroup::next_generation`).
        old = self._group
        group = _native.Group.next_generation(old, self._store, rank, size, max(timeout.total_seconds(), 0.001), prefix, self._done)
        with self._lock:
            self._group, self._rank, self._size, self._prefix = group, rank, size, prefix
            self._ranks = list(range(size))
        if old is not None and old.in_flight():
            old.abort(f"the group was reconfigured (uuid {opts.uuid}) with ops in flight")
        fut = torch.futures.Future()
        fut.set_result(None)
        return _Work(fut)

    @property
    def options(self):
        return self._options

    # torch's batch_isend_irecv reads this; the C++ default recurses through
    # the trampoline. Each op of a batch runs on its own here.
    @property
    def supports_coalescing(self):
        return False

    @property
    def supports_splitting(self):
        return False

    def getBackendName(self):
        return NAME

    def _work(self, call, result, keep, *args, after=None, **kw):
        fut = torch.futures.Future()
        call((fut, result, keep, after), *args, **kw)
        return _Work(fut)

    def _op(self, opts, t):
        op = opts.reduceOp.op
        table = _BOOL_OPS if t.dtype == torch.bool else _OPS
        code = table.get(op)
        if code is None:
            raise ValueError(f"rally: reduce op {op} is not supported on {t.dtype}")
        if code == 5 and not t.dtype.is_floating_point:
            raise ValueError(f"rally: AVG takes floating-point tensors, not {t.dtype}")
        if code in (6, 7, 8) and t.dtype.is_floating_point:
            raise ValueError(f"rally: {op} takes integer tensors, not {t.dtype}")
        return code

    # -- collectives -----------------------------------------------------

    def allreduce(self, tensors, opts):
        t = _one(tensors, "all_reduce")
        code = _check(t, "all_reduce's tensor")
        return self._work(self._g.all_reduce, tensors, t, t.data_ptr(), t.numel(), code, self._op(opts, t), _timeout(opts), now=not opts.asyncOp)

    def broadcast(self, tensors, opts):
        t = _one(tensors, "broadcast")
        code = _check(t, "broadcast's tensor")
        return self._work(self._g.broadcast, tensors, t, t.data_ptr(), t.numel(), code, opts.rootRank, _timeout(opts), now=not opts.asyncOp)

    def reduce(self, tensors, opts):
        t = _one(tensors, "reduce")
        code = _check(t, "reduce's tensor")
        return self._work(self._g.reduce, tensors, t, t.data_ptr(), t.numel(), code, opts.rootRank, self._op(opts, t), _timeout(opts), now=not opts.asyncOp)

    def allgather(self, output_tensors, input_tensors, opts):
        t = _one(input_tensors, "all_gather")
        outs = _one(output_tensors, "all_gather's output")
        code = _check(t, "all_gather's input")
        if len(outs) != self.size():
            raise ValueError(f"rally: all_gather needs {self.size()} output tensors, got {len(outs)}")
        _same(outs, t, "all_gather's output")
        return self._work(
            self._g.all_gather, output_tensors, (t, outs), t.data_ptr(), t.numel(), code,
            outs=[o.data_ptr() for o in outs], timeout=_timeout(opts), now=not opts.asyncOp,
        )

    def all_gather_single(self, output, input, opts):
        code = _check(input, "all_gather_into_tensor's input")
        _check(output, "all_gather_into_tensor's output")
        if output.dtype != input.dtype or output.numel() != input.numel() * self.size():
            raise ValueError(
                f"rally: all_gather_into_tensor's output is {output.dtype} x {output.numel()};"
                f" it must be {input.dtype} x {input.numel() * self.size()} (input x world size)"
            )
        return self._work(
            self._g.all_gather, [output], (input, output), input.data_ptr(), input.numel(), code,
            out=output.data_ptr(), timeout=_timeout(opts), now=not opts.asyncOp,
        )

    def gather(self, output_tensors, input_tensors, opts):
        t = _one(input_tensors, "gather")
        code = _check(t, "gather's input")
        root = opts.rootRank
        outs = None
        if self.rank() == root:
            outs = _one(output_tensors, "gather's output")
            if len(outs) != self.size():
                raise ValueError(f"rally: gather needs {self.size()} output tensors at the root, got {len(outs)}")
            _same(outs, t, "gather's output")
        result = outs if outs is not None else []
        return self._work(
            self._g.gather, result, (t, outs), t.data_ptr(), t.numel(), code, root,
            outs=[o.data_ptr() for o in outs] if outs is not None else None, timeout=_timeout(opts), now=not opts.asyncOp,
        )

    def scatter(self, output_tensors, input_tensors, opts):
        t = _one(output_tensors, "scatter")
        code = _check(t, "scatter's output")
        root = opts.rootRank
        ins = None
        if self.rank() == root:
            ins = _one(input_tensors, "scatter's input")
            if len(ins) != self.size():
                raise ValueError(f"rally: scatter needs {self.size()} input tensors at the root, got {len(ins)}")
            _same(ins, t, "scatter's input")
        return self._work(
            self._g.scatter, output_tensors, (t, ins), t.data_ptr(), t.numel(), code, root,
            ins=[i.data_ptr() for i in ins] if ins is not None else None, timeout=_timeout(opts), now=not opts.asyncOp,
        )

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        t = _one(output_tensors, "reduce_scatter")
        ins = _one(input_tensors, "reduce_scatter's input")
        code = _check(t, "reduce_scatter's output")
        if len(ins) != self.size():
            raise ValueError(f"rally: reduce_scatter needs {self.size()} input tensors, got {len(ins)}")
        _same(ins, t, "reduce_scatter's input")
        flat = torch.cat([i.reshape(-1) for i in ins])
        return self._work(
            self._g.reduce_scatter, output_tensors, (t, flat), flat.data_ptr(), t.data_ptr(), t.numel(), code,
            self._op(opts, t), _timeout(opts), now=not opts.asyncOp,
        )

    def reduce_scatter_single(self, output, input, opts):
        code = _check(output, "reduce_scatter_tensor's output")
        _check(input, "reduce_scatter_tensor's input")
        if output.dtype != input.dtype or input.numel() != output.numel() * self.size():
            raise ValueError(
                f"rally: reduce_scatter_tensor's input is {input.dtype} x {input.numel()};"
                f" it must be {output.dtype} x {output.numel() * self.size()} (output x world size)"
            )
        return self._work(
            self._g.reduce_scatter, [output], (input, output), input.data_ptr(), output.data_ptr(), output.numel(),
            code, self._op(opts, output), _timeout(opts), now=not opts.asyncOp,
        )

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        code = _check(input, "all_to_all_single's input")
        _check(output, "all_to_all_single's output")
        if output.dtype != input.dtype:
            raise ValueError(f"rally: all_to_all_single's output is {output.dtype}, its input {input.dtype}")
        ins = self._splits(input, input_split_sizes, "input")
        outs = self._splits(output, output_split_sizes, "output")
        return self._work(
            self._g.all_to_all, [output], (input, output), input.data_ptr(), ins, output.data_ptr(), outs, code,
            _timeout(opts), now=not opts.asyncOp,
        )

    def _splits(self, t, sizes, what):
        n = self.size()
        row = t.numel() // t.shape[0] if t.dim() > 0 and t.shape[0] > 0 else 1
        if not sizes:
            if t.numel() % n:
                raise ValueError(f"rally: all_to_all_single's {what} has {t.numel()} elements, not a multiple of {n}")
            return [t.numel() // n] * n
        if len(sizes) != n or sum(sizes) != (t.shape[0] if t.dim() > 0 else 1):
            raise ValueError(f"rally: all_to_all_single's {what} splits {list(sizes)} do not cut its {t.shape[0]} rows into {n}")
        return [s * row for s in sizes]

    def alltoall(self, output_tensors, input_tensors, opts):
        n = self.size()
        if len(output_tensors) != n or len(input_tensors) != n:
            raise ValueError(f"rally: all_to_all needs {n} input and {n} output tensors")
        code = _check(input_tensors[0], "all_to_all's input[0]")
        for i, t in enumerate(input_tensors + output_tensors):
            _check(t, f"all_to_all's tensor {i}")
            if t.dtype != input_tensors[0].dtype:
                raise ValueError("rally: all_to_all's tensors must share one dtype")
        flat_in = torch.cat([t.reshape(-1) for t in input_tensors])
        flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=flat_in.dtype)

        def after():
            for o, part in zip(output_tensors, flat_out.split([t.numel() for t in output_tensors])):
                o.view(-1).copy_(part)

        return self._work(
            self._g.all_to_all, output_tensors, (flat_in, flat_out), flat_in.data_ptr(),
            [t.numel() for t in input_tensors], flat_out.data_ptr(), [t.numel() for t in output_tensors], code,
            _timeout(opts), after=after, now=not opts.asyncOp,
        )

    def send(self, tensors, dst, tag=0):
        t = _one(tensors, "send")
        code = _check(t, "send's tensor")
        return self._work(self._g.send, tensors, t, t.data_ptr(), t.numel(), code, dst, tag)

    def recv(self, tensors, src, tag=0):
        t = _one(tensors, "recv")
        code = _check(t, "recv's tensor")
        return self._work(self._g.recv, tensors, t, t.data_ptr(), t.numel(), code, src, tag)

    def recv_anysource(self, tensors, tag=0):
        raise ValueError("rally: recv from any source is not supported; name the source rank")

    def barrier(self, opts):
        return self._work(self._g.barrier, [], None, _timeout(opts), now=not opts.asyncOp)

    # -- monitored barrier -----------------------------------------------

    def _monitored_barrier(self, timeout: datetime.timedelta, wait_all_ranks: bool) -> None:
        with self._lock:
            n = next(self._monitored)
        # Under the group's own prefix: after destroy_process_group torch may
        # hand the same store prefix again, where an earlier group's keys are.
        base = f"rallypoint/monitored_barrier/{self._prefix}/{n}"
        me = self.rank()
        self._store.set(f"{base}/{me}", b"1")
        done = f"{base}/done"
        if me == 0:
            deadline = time.monotonic() + timeout.total_seconds()
            missing = []
            for r in range(1, self.size()):
                if not self._arrived(f"{base}/{r}", deadline):
                    missing.append(r)
                    if not wait_all_ranks:
                        break
            if missing:
                who = ", ".join(self._who(r) for r in missing)
                verdict = f"monitored_barrier on group {self._name!r}: {len(missing)} rank(s) did not arrive within {timeout.total_seconds():g} s: {who}"
                self._store.set(done, verdict.encode())
                raise dist.DistBackendError(verdict)
            self._store.set(done, b"ok")
            return
        try:
            self._store.wait([done], timeout * 2)
        except dist.DistStoreError:
            raise dist.DistBackendError(
                f"monitored_barrier on group {self._name!r}: rank {self._who(0)} gave no verdict within {2 * timeout.total_seconds():g} s"
            ) from None
        verdict = self._store.get(done)
        if verdict != b"ok":
            raise dist.DistBackendError(verdict.decode(errors="replace"))

    def _arrived(self, key: str, deadline: float) -> bool:
        """Whether the rank's key is there by the deadline. One deadline for
        all: each wait gets what is left of it, and once it has passed a rank
        is looked for without waiting (a wait of almost nothing can time out
        on a busy machine before the store's answer is read, naming a rank
        that had arrived)."""
        if self._store.check([key]):
            return True
        left = deadline - time.monotonic()
        if left > 0:
            try:
                self._store.wait([key], datetime.timedelta(seconds=left))
                return True
            except dist.DistStoreError:
                pass
        return self._store.check([key])

    def _who(self, r: int) -> str:
        g = self._ranks[r] if r < len(self._ranks) else r
        return f"{r}" if g == r else f"{r} (global rank {g})"


class _Reconfigure:
    """This backend's reconfigure handle and the uuids it has formed under.

    A handle is ``rally:<store>:<token>``: the store every member forms
    through (the TCPStore's ``host:port``, or the store's kind) and a token
    unique to this backend. It does not change across reconfigures."""

    def __init__(self, store):
        self.store = _store_id(store)
        self.handle = f"rally:{self.store}:{uuid.uuid4().hex}"
        self.used = set()

    def next(self, opts, name: str):
        """(rank, size, prefix) of the membership ``opts`` names, or ValueError."""
        handles = opts.handles
        ordered = isinstance(handles, list)
        hs = list(handles) if ordered else sorted(handles)
        if not hs:
            raise ValueError("rally: reconfigure needs at least one handle (this rank's)")
        if ordered and len(set(hs)) != len(hs):
            dup = sorted({h for h in hs if hs.count(h) > 1})
            raise ValueError(f"rally: reconfigure's handles name a member twice: {dup}")
        for h in hs:
            parts = h.split(":")
            if len(parts) < 3 or parts[0] != "rally":
                raise ValueError(f"rally: {h!r} is not a rally reconfigure handle (from dist._get_reconfigure_handle on a rally group)")
            if ":".join(parts[1:-1]) != self.store:
                raise ValueError(
                    f"rally: handle {h!r} forms through another store than this rank's ({self.store});"
                    " every member must use the job's one store"
                )
        if self.handle not in hs:
            raise ValueError(f"rally: this rank's handle {self.handle!r} is not among reconfigure's {len(hs)} handles")
        if opts.uuid in self.used:
            raise ValueError(f"rally: reconfigure uuid {opts.uuid} was used before on this group; pass a fresh one")
        self.used.add(opts.uuid)
        return hs.index(self.handle), len(hs), f"{name}/reconfigure/{opts.uuid}"


def _store_id(store) -> str:
    s = store
    while isinstance(s, dist.PrefixStore):
        s = s.underlying_store
    if isinstance(s, dist.TCPStore):
        return f"{s.host}:{s.port}"
    return f"{type(s).__name__}@{id(s):x}"


def membership(group=None):
    """(rank, size) of this process in ``group``'s rally backend now.

    After ``dist._reconfigure`` changed them, torch's ``dist.get_rank`` and
    ``get_world_size`` still answer with the values the group was made with:
    torch 2.15 reads them from the C++ Backend's fields, which a Python
    backend cannot change."""
    be = _backend_of(group)
    return be.rank(), be.size()


def _backend_of(group) -> RallyBackend:
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    be = pg._get_backend(torch.device("cpu"))
    if not isinstance(be, RallyBackend):
        raise ValueError(f"rally: the group's CPU backend is {type(be).__name__}, not rally")
    return be


def monitored_barrier(group=None, timeout: Optional[datetime.timedelta] = None, wait_all_ranks: bool = True) -> None:
    """A barrier that names every rank that did not arrive within ``timeout``
    (default: the group's timeout). Rank 0 waits for every rank and raises
    ``DistBackendError`` naming the missing ones; the others raise the same
    message. torch's ``dist.monitored_barrier`` works only on gloo."""
    be = _backend_of(group)
    be._monitored_barrier(timeout or be._timeout, wait_all_ranks)


def _create(dist_opts, backend_opts):
    return RallyBackend(
        dist_opts.store,
        dist_opts.group_rank,
        dist_opts.group_size,
        dist_opts.timeout,
        str(dist_opts.group_id),
        dist_opts.global_ranks_in_group,
        reconfigurable=bool(getattr(dist_opts, "enable_reconfigure", False)),
    )


def _register() -> None:
    # register_backend refuses a name twice (torch/distributed/distributed_c10d.py).
    if hasattr(dist.Backend, NAME.upper()):
        return
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])


_register()
# At exit, before the interpreter tears itself down: the extension's threads
# finish with Python (ops in flight are aborted and their futures completed),
# and never enter it again (crates/torch/src/life.rs).
atexit.register(_native.shutdown)
