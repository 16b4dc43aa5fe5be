"""One replica group (of one process) of a fault-tolerant training loop:
torchft's own ``Manager``, ``DistributedDataParallel`` and ``Optimizer``
wrappers, unchanged, with one of two sets of parts (issue 47):

- ``FT_SIDE=gloo``: torchft's ``ProcessGroupGloo`` and its default transport
  (torchft's ``train_ddp.py`` on CPU), against ``torchft_lighthouse``;
- ``FT_SIDE=rally``: ``rallypoint.ft.ProcessGroupRally`` and
  ``rallypoint.ft.RallyTransport``, against ``rally lighthouse``;

or rallypoint's own loop with no torchft at all (issue 48):

- ``FT_SIDE=ft``: ``rallypoint.ft``'s ``Manager``, ``DistributedDataParallel``
  and ``Optimizer``, run by ``rally run --ft`` (the group's manager and store
  in the agent; its environment names the group and the lighthouse);

and, for the floor without fault tolerance, plain torch DDP across the
replicas (``FT_SIDE=ddp-rally`` or ``ddp-gloo``: one process group of
``NUM_REPLICA_GROUPS`` ranks through replica 0's store; ``ddp-gloo-local``:
the same with every step under DDP's ``no_sync()``, no gradient all_reduce,
so its step is the loop's computation alone).

The same script serves the benchmark (``ft_bench.py``) and the tests across
test hosts (``crates/rally/tests/run/ft_hosts.rs``): the driver reads what it
writes. Every line of ``FT_OUT`` is one JSON record:

- ``{"event": "ready", "pid", "t"}`` once the Manager exists;
- ``{"step", "committed", "participants", "t", "pid", "digest"?}`` after each
  optimizer step (``step`` is the Manager's step after it; ``participants``
  the replica groups in that step's quorum, so a commit without a failed
  replica is told from one it still took part in; ``digest`` the SHA-256 of
  every parameter's and optimizer tensor's bytes when ``FT_DIGEST=1``);
- ``{"event": "done", "pid", "t", "steps", "commits"}`` at a normal end.

Environment (besides torchft's ``TORCHFT_LIGHTHOUSE``):

- ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``; ``MASTER_ADDR``/``MASTER_PORT``:
  this replica's own store, served here (as torchrun would);
- ``FT_MODEL``: ``small`` (a 2-layer MLP, ~70k parameters) or ``10m`` (an MLP
  of hidden width 3072, 10.3M parameters);
- ``FT_STEPS`` (stop after this many committed steps), ``FT_SECONDS``
  (stop after this long) and ``FT_STOP_FILE`` (stop once it exists),
  whichever first;
- ``FT_MIN_REPLICAS`` (default 1), ``FT_PG_TIMEOUT`` (seconds, default 5,
  torchft's example), ``FT_BATCH`` (default 32);
- ``FT_FAULT`` at ``FT_FAULT_STEP``: ``kill-between`` (SIGKILL after that
  step's commit is recorded), ``kill-allreduce`` or ``stop-allreduce`` (SIGKILL
  or SIGSTOP just after the step's gradient all_reduce has started); the
  moment is recorded first (``{"event": "fault", "signal", "t"}``). Under
  ``rally run`` only the first incarnation faults
  (``TORCHELASTIC_RESTART_COUNT`` 0): the restarted worker trains;
- ``FT_LOSS=1``: each committed step's record carries ``loss``, this
  replica's loss on its batch of that step (the chaos figure's loss curve);
- ``FT_TEACHER=1``: labels from a fixed random linear teacher (the same in
  every replica and incarnation) instead of random ones, so that the loss
  falls and a loss curve means something; each replica group's process
  draws its own inputs (seeded with its group id and pid);
- ``FT_PROFILE=1``: each step's record carries ``prof``, seconds spent in
  ``zero_grad`` (which starts the quorum), the forward pass, the backward
  pass (the DDP comm hook's all_reduce and its wait included) and
  ``step`` (``should_commit`` and the optimizer), and on side ``ft`` also
  ``quorum_wait`` (in ``Manager.wait_quorum``, from the comm hook) and
  ``commit_rtt`` (the ``should_commit`` round trip to the group's manager);
- ``FT_DDP_UNUSED=1`` (sides ``ddp-*``): torch DDP with
  ``find_unused_parameters=True``, as the fault-tolerant sides' DDP has it,
  to measure that traversal alone.
"""

import datetime
import hashlib
import json
import os
import signal
import sys
import time

import torch
import torch.nn as nn


def _log(out, **rec):
    rec.setdefault("t", time.time())
    rec.setdefault("pid", os.getpid())
    out.write(json.dumps(rec) + "\n")
    out.flush()


def _model(kind: str) -> nn.Module:
    torch.manual_seed(int(os.environ.get("FT_SEED", "0")) + int(os.environ.get("REPLICA_GROUP_ID", "0")))
    if kind == "10m":
        return nn.Sequential(nn.Linear(256, 3072), nn.ReLU(), nn.Linear(3072, 3072), nn.ReLU(), nn.Linear(3072, 10))
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def _digest(model, optim) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    for state in optim.state_dict()["state"].values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _store():
    from torch.distributed import TCPStore

    return TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=30),
    )


def _fault(out, sig) -> None:
    """Records the moment, then sends ``sig`` to this process."""
    _log(out, event="fault", signal=int(sig))
    os.kill(os.getpid(), sig)


def _fault_kind() -> str:
    """``FT_FAULT``, on the first incarnation only, and (with
    ``FT_FAULT_RANK``) on that group rank only."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return ""
    if os.environ.get("FT_FAULT_RANK", os.environ.get("RANK", "0")) != os.environ.get("RANK", "0"):
        return ""
    return os.environ.get("FT_FAULT", "")


def _fault_hook(out, pg, step_of):
    """Wraps ``pg.allreduce`` (an object with one) so that at
    ``FT_FAULT_STEP`` this process kills or stops itself right after its
    all_reduce has started."""
    fault = _fault_kind()
    if fault not in ("kill-allreduce", "stop-allreduce"):
        return
    at = int(os.environ["FT_FAULT_STEP"])
    sig = signal.SIGKILL if fault == "kill-allreduce" else signal.SIGSTOP
    inner = pg.allreduce
    fired = []

    def allreduce(*args, **kw):
        work = inner(*args, **kw)
        if step_of() >= at and not fired:
            fired.append(True)
            _fault(out, sig)
        return work

    pg.allreduce = allreduce


def _parts(side: str, timeout: datetime.timedelta):
    if side == "rally":
        from rallypoint.ft import ProcessGroupRally, RallyTransport

        return ProcessGroupRally(timeout=timeout), (lambda pg: RallyTransport(timeout=timeout * 2))
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.process_group import ProcessGroupGloo

    # torchft's train_ddp.py on CPU: gloo with a 5 s timeout, PGTransport.
    return ProcessGroupGloo(timeout=timeout), (lambda pg: PGTransport(pg, timeout=timeout * 2, device=torch.device("cpu")))


def _batches(seed: int, batch: int, width: int):
    teacher = None
    if os.environ.get("FT_TEACHER") == "1":
        teacher = torch.randn(width, 10, generator=torch.Generator().manual_seed(1234))
        # Each replica group (and each incarnation of one) its own data, as
        # a DistributedSampler would give it: with one seed for all, the
        # groups of a fault-free run would train on the same batches and a
        # restarted one on others, making the runs' losses unlike.
        seed = seed * 1009 + int(os.environ.get("REPLICA_GROUP_ID", "0")) * 7919 + os.getpid()
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(batch, width, generator=g)
        if teacher is not None:
            yield x, (x @ teacher).argmax(dim=1)
        else:
            yield x, torch.randint(0, 10, (batch,), generator=g)


def run_ft(out, side: str) -> None:
    from torchft import DistributedDataParallel, Manager, Optimizer

    rid = int(os.environ["REPLICA_GROUP_ID"])
    # A replica group of one process, as torchrun would describe it.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    timeout = datetime.timedelta(seconds=float(os.environ.get("FT_PG_TIMEOUT", "5")))
    store = _store()  # noqa: F841 - serves this replica group's store for the Manager
    model = _model(os.environ.get("FT_MODEL", "small"))
    width = model[0].in_features
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pg, transport_of = _parts(side, timeout)

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    manager = Manager(
        pg=pg,
        min_replica_size=int(os.environ.get("FT_MIN_REPLICAS", "1")),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"ft_worker_{rid}",
        timeout=datetime.timedelta(seconds=30),
        checkpoint_transport=transport_of(pg),
    )
    _fault_hook(out, pg, manager.current_step)
    m = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner)
    _log(out, event="ready")
    limit_steps = int(os.environ.get("FT_STEPS", "1000000"))
    deadline = time.monotonic() + float(os.environ.get("FT_SECONDS", "1e9"))
    digest = os.environ.get("FT_DIGEST") == "1"
    kill_between = int(os.environ["FT_FAULT_STEP"]) if _fault_kind() == "kill-between" else None
    batches = _batches(1000 + manager.current_step(), int(os.environ.get("FT_BATCH", "32")), width)
    stop_file = os.environ.get("FT_STOP_FILE")
    _loop(out, manager, m, opt, inner, model, batches, limit_steps, deadline, digest, kill_between, stop_file)
    manager.shutdown(wait=False)


def run_rally_ft(out) -> None:
    """rallypoint's own loop (``FT_SIDE=ft``): ``rallypoint.ft`` alone, no
    torchft, under ``rally run --ft`` (which names the group, the lighthouse
    and the group's manager in the environment)."""
    import rallypoint.ft as ft

    model = _model(os.environ.get("FT_MODEL", "small"))
    width = model[0].in_features
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = ft.Manager(
        min_replicas=int(os.environ.get("FT_MIN_REPLICAS", "1")),
        state={"model": model, "optim": inner},
        timeout=datetime.timedelta(seconds=float(os.environ.get("FT_PG_TIMEOUT", "30"))),
    )
    _fault_hook(out, manager, manager.current_step)
    m = ft.DistributedDataParallel(manager, model)
    opt = ft.Optimizer(manager, inner)
    _log(out, event="ready", restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    limit_steps = int(os.environ.get("FT_STEPS", "1000000"))
    deadline = time.monotonic() + float(os.environ.get("FT_SECONDS", "1e9"))
    digest = os.environ.get("FT_DIGEST") == "1"
    kill_between = int(os.environ["FT_FAULT_STEP"]) if _fault_kind() == "kill-between" else None
    batches = _batches(1000 + manager.current_step(), int(os.environ.get("FT_BATCH", "32")), width)
    stop_file = os.environ.get("FT_STOP_FILE")
    _loop(out, manager, m, opt, inner, model, batches, limit_steps, deadline, digest, kill_between, stop_file)
    manager.shutdown()


class _Timer:
    """Seconds spent in the wrapped methods, per name, since the last
    ``take`` (``FT_PROFILE``)."""

    def __init__(self):
        self.spent = {}

    def wrap(self, obj, attr: str, name: str) -> None:
        inner = getattr(obj, attr)

        def timed(*args, **kw):
            t = time.perf_counter()
            try:
                return inner(*args, **kw)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - t

        setattr(obj, attr, timed)

    def take(self) -> dict:
        spent, self.spent = self.spent, {}
        return spent


def _loop(out, manager, m, opt, inner, model, batches, limit_steps, deadline, digest, kill_between, stop_file) -> None:
    """The training loop both fault-tolerant sides run, and its records."""
    loss_fn = nn.CrossEntropyLoss()
    record_loss = os.environ.get("FT_LOSS") == "1"
    timer = _Timer() if os.environ.get("FT_PROFILE") == "1" else None
    if timer is not None and type(manager).__module__.startswith("rallypoint"):
        timer.wrap(manager, "wait_quorum", "quorum_wait")
        timer.wrap(manager._client, "should_commit", "commit_rtt")
    clock = time.perf_counter
    steps, commits = 0, 0
    while commits < limit_steps and time.monotonic() < deadline:
        if stop_file and os.path.exists(stop_file):
            break
        x, y = next(batches)
        before = manager.current_step()
        t0 = clock()
        opt.zero_grad()
        t1 = clock()
        loss = loss_fn(m(x), y)
        t2 = clock()
        loss.backward()
        t3 = clock()
        opt.step()
        t4 = clock()
        steps += 1
        committed = manager.current_step() > before
        commits += committed
        rec = {"step": manager.current_step(), "committed": committed, "participants": manager.num_participants()}
        if record_loss and committed:
            rec["loss"] = loss.item()
        if timer is not None:
            rec["prof"] = {"zero_grad": t1 - t0, "forward": t2 - t1, "backward": t3 - t2, "step": t4 - t3, **timer.take()}
        if digest and committed:
            rec["digest"] = _digest(model, inner)
        _log(out, **rec)
        if kill_between is not None and manager.current_step() >= kill_between:
            kill_between = None
            _fault(out, signal.SIGKILL)
    _log(out, event="done", steps=steps, commits=commits)


def run_ddp(out, backend: str) -> None:
    """The floor: plain torch DDP across the replicas, no fault tolerance
    (``<backend>-local``: no gradient all_reduce at all)."""
    import contextlib

    import torch.distributed as dist

    backend, _, local = backend.partition("-")

    if backend == "rally":
        import rallypoint.torch  # noqa: F401 - registers the backend

    rid = int(os.environ["REPLICA_GROUP_ID"])
    n = int(os.environ["NUM_REPLICA_GROUPS"])
    dist.init_process_group(backend, rank=rid, world_size=n, timeout=datetime.timedelta(seconds=30))
    model = _model(os.environ.get("FT_MODEL", "small"))
    m = nn.parallel.DistributedDataParallel(model, find_unused_parameters=os.environ.get("FT_DDP_UNUSED") == "1")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    _log(out, event="ready")
    limit_steps = int(os.environ.get("FT_STEPS", "1000000"))
    deadline = time.monotonic() + float(os.environ.get("FT_SECONDS", "1e9"))
    batches = _batches(1000, int(os.environ.get("FT_BATCH", "32")), model[0].in_features)
    profile = os.environ.get("FT_PROFILE") == "1"
    clock = time.perf_counter
    step = 0
    while step < limit_steps and time.monotonic() < deadline:
        x, y = next(batches)
        t0 = clock()
        opt.zero_grad()
        t1 = clock()
        with m.no_sync() if local else contextlib.nullcontext():
            loss = loss_fn(m(x), y)
            t2 = clock()
            loss.backward()
        t3 = clock()
        opt.step()
        t4 = clock()
        step += 1
        rec = {"step": step, "committed": True}
        if profile:
            rec["prof"] = {"zero_grad": t1 - t0, "forward": t2 - t1, "backward": t3 - t2, "step": t4 - t3}
        _log(out, **rec)
    _log(out, event="done", steps=step, commits=step)
    dist.destroy_process_group()


def main() -> None:
    side = os.environ.get("FT_SIDE", "gloo")
    # A group of several processes: one file per group rank.
    with open(os.environ["FT_OUT"].replace("{rank}", os.environ.get("RANK", "0")), "a") as out:
        if side.startswith("ddp-"):
            run_ddp(out, side[4:])
        elif side == "ft":
            run_rally_ft(out)
        else:
            run_ft(out, side)


if __name__ == "__main__":
    sys.exit(main())
