"""Per-step fault tolerance, ours beside torchft's, in one run (issue 47 §5).

Each side runs torchft 0.2.0's own ``Manager``, ``DistributedDataParallel``
and ``Optimizer`` on the same loop (``ft_worker.py``), one process per
replica group, on loopback:

- ``gloo``: torchft's ``ProcessGroupGloo`` (5 s timeout, its ``train_ddp.py``),
  ``PGTransport`` and ``torchft_lighthouse`` at its defaults
  (``--heartbeat_timeout_ms 5000``);
- ``gloo-tuned``: the same with the lighthouse's heartbeat timeout as low as
  ours (1 s);
- ``rally``: ``ProcessGroupRally``, ``RallyTransport`` and ``rally lighthouse``
  at its defaults;
- ``rally-state``: the same with the lighthouse's state in a real etcd
  (``--state etcd://``), so a restarted lighthouse re-issues the saved
  quorum as soon as its members are back instead of waiting its startup
  grace (figure ``lighthouse``);
- ``ft``: rallypoint's own loop with no torchft (issue 48): each replica
  group is ``rally run --ft --standalone --nproc-per-node 1
  --ft-replica-group I --ft-lighthouse HOST:PORT --max-restarts R`` running
  ``ft_worker.py`` with ``FT_SIDE=ft`` (``rallypoint.ft``'s ``Manager``,
  ``DistributedDataParallel``, ``Optimizer``; its timeout 5 s, as the gloo
  side's), against ``rally lighthouse`` at its defaults; ``R`` is 0, 1 for
  the figure ``restart`` (the group's agent restarts the worker itself),
  10^6 in the chaos run. Its records carry the worker's pid, not ``rally
  run``'s; its ``--events`` go beside them;
- ``ddp-rally`` / ``ddp-gloo``: plain torch DDP across the replicas, no fault
  tolerance (the floor of the steady state).
- ``ddp-gloo-local``: the same over gloo with every step under DDP's
  ``no_sync()`` (no gradient all_reduce): the loop's computation alone, so
  that ``1 - local / ddp-gloo`` is the share of plain DDP's step spent
  communicating (steady only).

Sides are interleaved within each repetition; the table gives medians and
the spread (min-max). Figures:

- ``kill-between``, ``kill-allreduce``, ``stop-allreduce``: from the fault
  (the victim records the moment, then signals itself) to the survivors'
  first commit of a step whose quorum left the victim out (the slowest
  survivor's), and how many survivors crashed;
- ``restart``: a killed replica launched again (side ``ft``: restarted by
  its own agent), from its Manager being ready to its first committed step;
- ``lighthouse``: the lighthouse SIGKILLed and started again, from its
  return to every replica's next commit, and replicas crashed;
- ``steady``: the median step (between commits) of the 10M-parameter MLP
  (with ``FT_PROFILE=1`` in the environment, also the median of each part
  of the step, ``ft_worker.py``'s ``prof``);
- ``chaos`` (only when named; ``ChaosRun``): 3 (``--replicas``) groups for
  ``--chaos-seconds`` with a seeded random fault every ~``--chaos-every``
  seconds (SIGKILL of a worker, SIGSTOP for 3 s, the lighthouse killed and
  back after 0.5 s; across hosts also a 3 s cut and a power-off), then the
  fault-free run of the same length: committed steps per group as a share
  of the fault-free run's, the steps reached, and the loss at equal steps
  against the fault-free run's noise (``FT_LOSS``, ``FT_TEACHER``). A
  replica whose process ended is launched again by the harness (torchft's
  as its users' Slurm runner would; side ``ft`` only if ``rally run``
  itself ended). With ``FT_BENCH_KEEP=1`` the faults are in
  ``faults.jsonl`` of the kept directory;
- ``cut`` (across hosts only): the last replica's host taken off the bridge
  (silent loss both ways, no reset), from the moment it is off to the
  survivors' first commit of a step whose quorum left it out.

Across test hosts (``--hosts N``, root): one replica group per host, N
network namespaces on a bridge (``10.77.0.<i>``, hostnames ``node<i>``),
made and torn down by ``crates/testhosts/examples/hold.rs``, which this
script starts in a session of its own and talks to on a pipe (``cut I``,
``heal I``); the hosts go when its standard input closes, so on every exit
of this script, Ctrl-C and crashes included. The lighthouse runs on node1
beside replica 0 (with ``--lighthouse-apart``, on one more host of its
own, so that a power-off of node1 does not take it away too), each
replica's store on its own host, and the victim is the last replica (on the
last host)::

    cargo build --release -p rally -p rallypoint-torch
    cargo build --release -p rallypoint-testhosts --example hold
    .venv/bin/python crates/bench/py/ft_bench.py --hosts 3 --reps 3

Usage on loopback::

    .venv/bin/python crates/bench/py/ft_bench.py --reps 5 --replicas 2 3
    .venv/bin/python crates/bench/py/ft_bench.py --figures steady --reps 3
    .venv/bin/python crates/bench/py/ft_bench.py --figures steady --sides ft gloo --replicas 2 --reps 3
    .venv/bin/python crates/bench/py/ft_bench.py --figures chaos --chaos-seconds 600 --sides ft gloo --replicas 3

The ``rallypoint`` package the workers import is laid out for the run from
``--python-src`` (default: the checkout's ``python/rallypoint``) with
``--native`` as its extension module (default:
``target/release/lib_native.so``); ``--rally`` names the ``rally`` binary
(default: ``target/release/rally``).
"""

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ft_net import Hosts, Loopback, wait_listening

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
WORKER = HERE / "ft_worker.py"
PY = os.environ.get("RALLY_PYTHON", str(ROOT / ".venv/bin/python"))


@dataclass
class Bench:
    """What every run of a figure shares: the ``rally`` binary, where the
    replicas run (``ft_net``), and the ``rallypoint`` package's directory."""

    rally: str
    net: object
    site: str
    steady_seconds: float = 20.0
    chaos: object = None  # a Chaos, for the figure ``chaos``
    lh_place: int = 0  # where the lighthouse (and etcd) run: replica 0's place, or a host apart


def lay_out_package(dest: Path, src: Path, native: Path) -> str:
    """``rallypoint/`` as ``pip install .`` lays it out, under ``dest``: the
    ``.py`` files of ``src`` (subpackages included) and ``native`` as its
    extension module. Returns the directory to put on ``PYTHONPATH``."""
    if not native.exists():
        raise SystemExit(
            f"no extension module at {native}: build it with `cargo build --release -p rallypoint-torch`"
        )
    if not (src / "ft" / "__init__.py").exists():
        raise SystemExit(f"{src} is not the rallypoint package (no ft/__init__.py)")
    pkg = dest / "rallypoint"
    shutil.copytree(src, pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    os.symlink(native.resolve(), pkg / "_native.abi3.so")
    return str(dest)


def workdir():
    """A temporary directory for one run's records and logs; kept (and
    named on stderr) when ``FT_BENCH_KEEP=1``."""
    if os.environ.get("FT_BENCH_KEEP") == "1":
        d = tempfile.mkdtemp(prefix="ft_bench.")
        print(f"keeping {d}", file=sys.stderr)

        class Kept:
            def __enter__(self):
                return d

            def __exit__(self, *a):
                return False

        return Kept()
    return tempfile.TemporaryDirectory()


def free_port() -> int:
    """A port free on loopback here; on a test host (a fresh namespace)
    every port is free, so the number serves there too."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lighthouse:
    """torchft's or ours, on a fresh port of ``b.lh_place`` (loopback, node1,
    or with ``--lighthouse-apart`` a host of its own)."""

    def __init__(self, side: str, b: Bench, workdir, extra=()):
        self.net = b.net
        self.place = b.lh_place
        self.port = free_port()
        self.etcd = None
        bind = f"{self.net.addr(self.place)}:{self.port}"
        if side == "rally-state":
            # Its state (the last quorum) in etcd, on the same place.
            self.etcd = Etcd(b, workdir)
            extra = ("--state", f"etcd://{self.net.addr(self.place)}:{self.etcd.port}", *extra)
        if side.startswith("rally") or side == "ft":
            cmd = [b.rally, "lighthouse", "--bind", bind, "--min_replicas", "1", *extra]
        else:
            hb = "1000" if side == "gloo-tuned" else "5000"
            exe = str(Path(PY).parent / "torchft_lighthouse")
            cmd = [exe, "--bind", bind, "--min_replicas", "1", "--join_timeout_ms", "500",
                   "--quorum_tick_ms", "100", "--heartbeat_timeout_ms", hb, *extra]
        self.cmd = self.net.prefix(self.place) + cmd
        self.log = open(Path(workdir) / "lighthouse.log", "a")
        self.proc = None
        self.start()

    def start(self):
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=self.log)
        wait_listening(self.net, self.place, self.port, self.proc, 20, PY, f"lighthouse {self.cmd}",
                       Path(self.log.name).read_text(errors="replace"))

    @property
    def url(self) -> str:
        return f"http://{self.net.addr(self.place)}:{self.port}"

    @property
    def hostport(self) -> str:
        return f"{self.net.addr(self.place)}:{self.port}"

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self):
        self.stop()
        if self.etcd is not None:
            self.etcd.stop()


class Etcd:
    """A real etcd (``/usr/bin/etcd``, as ``.ci/run`` installs it) on a fresh
    port of the lighthouse's place, for ``rally lighthouse --state``."""

    def __init__(self, b: Bench, workdir):
        self.port = free_port()
        peer = free_port()
        host = b.net.addr(b.lh_place)
        cmd = b.net.prefix(b.lh_place) + [
            "etcd", "--data-dir", str(Path(workdir) / "etcd"), "--name", "bench",
            "--listen-client-urls", f"http://{host}:{self.port}", "--advertise-client-urls", f"http://{host}:{self.port}",
            "--listen-peer-urls", f"http://{host}:{peer}", "--initial-advertise-peer-urls", f"http://{host}:{peer}",
            "--initial-cluster", f"bench=http://{host}:{peer}",
        ]
        self.log = open(Path(workdir) / "etcd.log", "a")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log)
        wait_listening(b.net, b.lh_place, self.port, self.proc, 20, PY, f"etcd {cmd}", Path(self.log.name).read_text(errors="replace"))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Replica:
    """Replica group ``i`` of ``n`` (one worker process), on place ``i``.

    Side ``ft``: ``rally run --ft --standalone --nproc-per-node 1`` with
    ``max_restarts`` (its agent restarts the worker; the group's manager and
    store live in the agent), run in a session of its own so that
    ``power_off`` takes the agent and its worker at once. Every other side:
    the worker itself (``ip netns exec`` and ``nsenter`` exec the program,
    so ``proc.pid`` is Python's). The records carry the worker's pid
    (``worker_pid``), under ``rally run`` not ``proc.pid``."""

    def __init__(self, workdir: Path, i: int, n: int, side: str, lighthouse, env: dict, b: Bench,
                 max_restarts: int = 0):
        self.i = i
        self.side = side
        self.out = workdir / f"replica{i}.{time.monotonic_ns()}.jsonl"
        self.log = open(workdir / f"replica{i}.log", "a")
        e = dict(os.environ)
        # torchft's Manager names itself by socket.gethostname(): the host's.
        e.pop("HOSTNAME", None)
        path = [b.site] + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
        if side == "ft":
            ft_side = "ft"
        else:
            ft_side = "rally" if side.startswith("rally") else ("gloo" if side.startswith("gloo") else side)
        e.update(
            REPLICA_GROUP_ID=str(i), NUM_REPLICA_GROUPS=str(n), MASTER_ADDR=b.net.addr(i),
            FT_SIDE=ft_side, FT_OUT=str(self.out), PYTHONPATH=":".join(path),
        )
        e["MASTER_PORT"] = str(env.pop("MASTER_PORT", free_port()))
        if lighthouse is not None:
            e["TORCHFT_LIGHTHOUSE"] = lighthouse.url
        if side == "ft":
            # Its Manager's timeout as torchft's train_ddp.py's gloo (5 s).
            e["FT_PG_TIMEOUT"] = "5"
        e.update({k: str(v) for k, v in env.items()})
        if side == "ft":
            # rally run sets the group's MASTER_ADDR/PORT (its own store).
            e.pop("MASTER_ADDR")
            e.pop("MASTER_PORT")
            cmd = b.net.prefix(i) + [
                b.rally, "run", "--ft", "--standalone", "--nproc-per-node", "1",
                "--ft-replica-group", str(i), "--ft-lighthouse", lighthouse.hostport,
                "--max-restarts", str(max_restarts), "--events", str(self.out.with_suffix(".events")),
                PY, str(WORKER),
            ]
        else:
            cmd = b.net.prefix(i) + [PY, str(WORKER)]
        self.proc = subprocess.Popen(cmd, env=e, stdout=self.log, stderr=self.log, start_new_session=True)

    def records(self):
        if not self.out.exists():
            return []
        out = []
        for line in self.out.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line being written, or cut short by a kill
        return out

    def worker_pid(self):
        """The pid of the worker that wrote the last record (None before
        its first)."""
        rs = self.records()
        return rs[-1]["pid"] if rs else None

    def committed_step(self) -> int:
        """The last step it committed."""
        return max((x["step"] for x in self.records() if x.get("committed")), default=0)

    def wait(self, limit: float) -> int:
        try:
            return self.proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            self.kill()
            return -999

    def kill(self):
        """The whole session (under ``rally run``, the agent and its
        worker), continued first if stopped."""
        pids = [self.worker_pid()] if self.side == "ft" else []
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            for pid in pids:  # its own session; PR_SET_PDEATHSIG too
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, TypeError):
                    pass
        self.proc.wait()


def _wait_for(pred, limit: float, what: str):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise TimeoutError(f"waited {limit:g} s for {what}")


def _fault_time(r: Replica):
    return next((x["t"] for x in r.records() if x.get("event") == "fault"), None)


def _first_commit(r: Replica, pred):
    """The time of ``r``'s first commit that ``pred`` accepts; infinity once
    it exited (crashed) without one; None while it may still come."""
    t = next((x["t"] for x in r.records() if x.get("committed") and pred(x)), None)
    if t is None and r.proc.poll() is not None:
        return float("inf")
    return t


def _without_victim(t0: float, n: int):
    """A commit after ``t0`` of a step whose quorum left a replica out: the
    survivors' recovery from a fault at ``t0``. (A commit after the fault in
    which the victim still took part, which a survivor may make when the
    victim sent its part of the all_reduce before it died, or before its
    host was cut off, does not count; torchft's should_commit is local to a
    replica group.)"""
    return lambda x: x["t"] > t0 and x.get("participants", n) < n


def _step_before(r: Replica, t: float):
    """The median interval between ``r``'s last 10 commits before ``t``:
    the step a fault's figure is to be read against."""
    ts = [x["t"] for x in r.records() if x.get("committed") and x["t"] < t][-11:]
    gaps = [y - x for x, y in zip(ts, ts[1:])]
    return statistics.median(gaps) if gaps else None


def _gaps(survivors, pred, t0: float, what: str):
    """Each survivor's first commit that ``pred`` accepts, less ``t0``."""
    gaps = []
    for r in survivors:
        try:
            gaps.append(_wait_for(lambda: _first_commit(r, pred), 60, what) - t0)
        except TimeoutError:
            gaps.append(float("inf"))
    return gaps


AT = 20  # the step a fault comes at


def fault_figure(side: str, n: int, fault: str, b: Bench, model="small", restart=False):
    """From the victim's fault to the survivors' first commit without it
    (the slowest survivor), survivors crashed, and with ``restart`` the
    victim's ready-to-first-commit after it is launched again (side ``ft``:
    after its group's agent restarted it)."""
    with workdir() as d:
        lh = Lighthouse(side, b, d)
        reps = []
        try:
            common = {"FT_MODEL": model, "FT_STEPS": AT + 40}
            reps = [Replica(Path(d), i, n, side, lh, dict(common), b) for i in range(n - 1)]
            victim_env = dict(common, FT_FAULT=fault, FT_FAULT_STEP=AT)
            reps.append(Replica(Path(d), n - 1, n, side, lh, victim_env, b,
                                max_restarts=1 if restart else 0))
            victim = reps[-1]
            t_fault = _wait_for(lambda: _fault_time(victim), 120, f"{side}: the victim's fault at step {AT}")
            survivors = reps[:-1]
            gaps = _gaps(survivors, _without_victim(t_fault, n), t_fault, "a survivor's commit without the victim")
            heal = None
            if restart and side == "ft":
                heal = _agent_restart_heal(victim)
            elif restart:
                victim.kill()
                again = Replica(Path(d), n - 1, n, side, lh, dict(common, FT_STEPS=5), b)
                reps.append(again)
                ready = _wait_for(lambda: next((x["t"] for x in again.records() if x.get("event") == "ready"), None), 60, "the restarted replica's ready")
                first = _wait_for(lambda: next((x["t"] for x in again.records() if x.get("committed")), None), 60, "its first commit")
                heal = first - ready
            crashed = sum(r.wait(120) != 0 for r in survivors)
            step = _step_before(survivors[0], t_fault)
            return {"gap": max(gaps), "crashed": crashed, "heal": heal, "step": step}
        finally:
            for r in reps:
                r.kill()
            lh.close()


def _agent_restart_heal(victim: Replica) -> float:
    """Under ``rally run --ft`` the group's agent restarts the killed
    worker itself: from the new worker's ``ready`` record (a pid other than
    the killed one's) to its first commit."""
    first_pid = next(x["pid"] for x in victim.records())

    def ready():
        return next((x for x in victim.records() if x.get("event") == "ready" and x["pid"] != first_pid), None)

    r = _wait_for(ready, 60, "the worker its agent restarted to be ready")
    first = _wait_for(
        lambda: next((x["t"] for x in victim.records() if x.get("committed") and x["pid"] == r["pid"]), None),
        60, "the restarted worker's first commit")
    return first - r["t"]


def cut_figure(side: str, n: int, b: Bench, model="small"):
    """The last replica's host taken off the bridge once every replica has
    committed step ``AT``: from the moment it is off to each survivor's
    first commit of a step without it (the slowest survivor), and survivors
    crashed. The host is put back once the run is over."""
    if not isinstance(b.net, Hosts):
        raise SystemExit("the figure `cut` needs test hosts (--hosts N)")
    with workdir() as d:
        lh = Lighthouse(side, b, d)
        reps, cut = [], False
        try:
            env = {"FT_MODEL": model, "FT_STEPS": AT + 40}
            reps = [Replica(Path(d), i, n, side, lh, dict(env), b) for i in range(n)]
            _wait_for(lambda: all(r.committed_step() >= AT for r in reps), 120, f"{side}: step {AT} everywhere")
            survivors = reps[:-1]
            cut = True
            t_cut = b.net.cut(n - 1)
            gaps = _gaps(survivors, _without_victim(t_cut, n), t_cut, "a survivor's commit without the cut-off replica")
            crashed = sum(r.wait(120) != 0 for r in survivors)
            return {"gap": max(gaps), "crashed": crashed, "step": _step_before(survivors[0], t_cut)}
        finally:
            for r in reps:
                r.kill()
            lh.close()
            if cut:
                b.net.heal(n - 1)


# torchft's manager sleeps quorum_timeout / (retries + 1) between tries of a
# failed quorum call (manager.rs, _quorum_with_retries): 60 s / 121, ~0.5 s.
RETRIES = 120


def lighthouse_figure(side: str, n: int, b: Bench, model="small"):
    """The lighthouse SIGKILLed at step 20 and started again on its port
    0.5 s later, ``TORCHFT_QUORUM_RETRIES`` the same on both sides
    (``RETRIES``): from its return to every replica's next commit, and how
    many replicas crashed."""
    with workdir() as d:
        lh = Lighthouse(side, b, d)
        reps = []
        try:
            env = {"FT_MODEL": model, "FT_STEPS": 80, "TORCHFT_QUORUM_RETRIES": RETRIES}
            reps = [Replica(Path(d), i, n, side, lh, dict(env), b) for i in range(n)]
            _wait_for(lambda: all(r.committed_step() >= AT for r in reps), 120, "step 20 everywhere")
            lh.stop()
            time.sleep(0.5)  # the outage itself, not a synchronisation
            lh.start()
            t_back = time.time()
            last = max(r.committed_step() for r in reps)
            gaps = _gaps(reps, lambda x: x["step"] > last, t_back, "a commit after the lighthouse came back")
            crashed = sum(r.wait(120) != 0 for r in reps)
            return {"gap": max(gaps), "crashed": crashed}
        finally:
            for r in reps:
                r.kill()
            lh.close()


def steady_figure(side: str, n: int, b: Bench, model="10m"):
    """The median interval between committed steps after a warm-up."""
    seconds = b.steady_seconds
    with workdir() as d:
        lh = None if side.startswith("ddp-") else Lighthouse(side, b, d)
        reps = []
        try:
            env = {"FT_MODEL": model, "FT_SECONDS": seconds}
            if side.startswith("ddp-"):
                # One process group through replica 0's store.
                env["MASTER_PORT"] = free_port()
                env["MASTER_ADDR"] = b.net.addr(0)
            reps = [Replica(Path(d), i, n, side, lh, dict(env), b) for i in range(n)]
            for r in reps:
                r.wait(seconds + 120)
            recs = sorted((x for x in reps[0].records() if x.get("committed")), key=lambda x: x["t"])
            recs = recs[len(recs) // 4:]  # warm-up
            ts = [x["t"] for x in recs]
            gaps = [y - x for x, y in zip(ts, ts[1:])]
            r = {"step": statistics.median(gaps) if gaps else float("nan"), "steps": len(ts)}
            profs = [x["prof"] for x in recs if "prof" in x]
            if profs:  # FT_PROFILE=1: the median of each part of the step
                r["prof"] = {k: round(statistics.median(p.get(k, 0.0) for p in profs), 4) for k in profs[-1]}
            return r
        finally:
            for r in reps:
                r.kill()
            if lh:
                lh.close()


CHAOS_FAULTS = ["kill", "stop", "lighthouse"]
CHAOS_HOST_FAULTS = ["cut", "power-off"]
OUTAGE = 3.0  # seconds a SIGSTOP, a cut and a power-off last
MIN_ALIVE = 1  # the lighthouse's min_replicas: a fault never leaves fewer groups up


@dataclass
class Chaos:
    seconds: float = 600.0
    seed: int = 0
    every: float = 10.0  # the mean interval between faults


class ChaosRun:
    """``n`` replica groups of ``side`` for ``c.seconds`` (``FT_STOP_FILE``
    ends them), with a seeded random fault every ~``c.every`` seconds when
    ``faults``, else none (the baseline). A group whose process ended is
    launched again at once by this harness (torchft: as its users' Slurm
    runner relaunches a replica; side ``ft``: only when its ``rally run``
    itself ended, since its agent restarts the worker). A group is
    *up* once it committed a step since its last fault; a fault on a group
    comes only when it leaves at least ``MIN_ALIVE`` other groups up."""

    def __init__(self, side: str, n: int, b: Bench, c: Chaos, faults: bool, d: Path):
        import random

        self.side, self.n, self.b, self.c, self.d = side, n, b, c, d
        self.rng = random.Random(c.seed)
        self.faults = faults
        self.lh = Lighthouse(side, b, d)
        self.stop_file = d / "stop"
        self.env = {"FT_MODEL": "small", "FT_STEPS": 10**9, "FT_LOSS": 1, "FT_TEACHER": 1,
                    "FT_STOP_FILE": str(self.stop_file), "TORCHFT_QUORUM_RETRIES": RETRIES}
        self.groups = [[] for _ in range(n)]  # every incarnation of each group
        self.last_fault = [0.0] * n
        self.off = set()  # groups powered off (not relaunched)
        self.pending = []  # (due, what, action): a fault's end
        self.log = []  # the faults: {"t", "kind", "group"}
        self.launches = [0] * n
        self.deferred = 0
        kinds = list(CHAOS_FAULTS) + (CHAOS_HOST_FAULTS if isinstance(b.net, Hosts) else [])
        self.kinds = kinds

    def launch(self, i: int):
        r = Replica(self.d, i, self.n, self.side, self.lh, dict(self.env), self.b,
                    max_restarts=10**6 if self.side == "ft" else 0)
        self.groups[i].append(r)
        self.launches[i] += 1

    def up(self, i: int) -> bool:
        if i in self.off or any(w == i for _, w, _ in self.pending):
            return False
        rs = self.groups[i][-1].records()
        if not (rs and rs[-1].get("committed", False) and rs[-1]["t"] > self.last_fault[i]):
            return False
        try:
            os.kill(rs[-1]["pid"], 0)
        except ProcessLookupError:
            return False
        return True

    def fault(self, now: float) -> bool:
        """One fault, the kind and victim drawn; False when none may come
        now (too few groups up, or a fault still lasting)."""
        if self.pending:
            return False
        kind = self.rng.choice(self.kinds)
        victim = self.rng.randrange(self.n)
        if kind != "lighthouse":
            up = [i for i in range(self.n) if self.up(i)]
            if victim not in up or len(up) - 1 < MIN_ALIVE:
                return False
        r = self.groups[victim][-1]
        pid = r.worker_pid()
        if kind == "kill":
            _signal(pid, signal.SIGKILL)
        elif kind == "stop":
            _signal(pid, signal.SIGSTOP)
            self.pending.append((now + OUTAGE, victim, lambda: _signal(pid, signal.SIGCONT)))
        elif kind == "cut":
            self.b.net.cut(victim)
            self.pending.append((now + OUTAGE, victim, lambda: self.b.net.heal(victim)))
        elif kind == "power-off":
            self.b.net.cut(victim)
            r.kill()
            self.off.add(victim)

            def back():
                self.b.net.heal(victim)
                self.off.discard(victim)
                self.launch(victim)

            self.pending.append((now + OUTAGE, victim, back))
        else:
            self.lh.stop()
            self.pending.append((now + 0.5, None, self.lh.start))
        if kind != "lighthouse":
            # After the fault: a record the victim wrote before it does not
            # count as its recovery.
            self.last_fault[victim] = time.time()
        self.log.append({"t": now, "kind": kind, "group": None if kind == "lighthouse" else victim})
        with open(self.d / "faults.jsonl", "a") as f:  # kept with FT_BENCH_KEEP=1
            f.write(json.dumps(self.log[-1]) + "\n")
        return True

    def run(self) -> dict:
        try:
            for i in range(self.n):
                self.launch(i)
            _wait_for(lambda: all(g[-1].committed_step() > 0 for g in self.groups), 120,
                      f"{self.side}: every group's first commit")
            t0 = time.time()
            end = t0 + self.c.seconds
            next_fault = t0 + self.rng.uniform(0.5, 1.5) * self.c.every
            while time.time() < end:
                now = time.time()
                for due, w, action in [p for p in self.pending if p[0] <= now]:
                    self.pending.remove((due, w, action))
                    action()
                for i in range(self.n):
                    if i not in self.off and self.groups[i][-1].proc.poll() is not None:
                        self.launch(i)
                if self.faults and now >= next_fault:
                    if self.fault(now):
                        next_fault = now + self.rng.uniform(0.5, 1.5) * self.c.every
                    else:
                        self.deferred += 1
                        next_fault = now + 0.5
                time.sleep(0.05)  # the harness's poll, not a synchronisation
            for _, _, action in self.pending:
                action()
            self.pending = []
            self.stop_file.touch()
            for g in self.groups:
                g[-1].wait(60)
            return self.figures(t0, end)
        finally:
            for g in self.groups:
                for r in g:
                    r.kill()
            self.lh.close()

    def figures(self, t0: float, end: float) -> dict:
        commits, losses, top, times = [], [], 0, []
        for g in self.groups:
            recs = [x for r in g for x in r.records() if x.get("committed") and t0 <= x["t"] <= end]
            commits.append(len(recs))
            losses += [(x["step"], x["loss"]) for x in recs if "loss" in x]
            top = max([top] + [x["step"] for x in recs])
            times.append(sorted(x["t"] for x in recs))
        kinds = {}
        for f in self.log:
            kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
        return {"commits": commits, "max_step": top, "faults": kinds, "launches": self.launches,
                "deferred": self.deferred, "losses": losses, "idle": _idle(times, end - t0)}


def _idle(times: list, span: float) -> dict:
    """Where the job went without commits, a figure the CPU does not sway:
    the gaps between consecutive commits of any group (all merged) longer
    than ten median steps (each group's own steps), summed, as a share of
    the run; and each group's own. On a machine with a core per group, the
    job commits about ``1 - job`` of a fault-free run's steps (faults free
    CPU for the others on fewer cores, which the share of commits counts)."""
    steps = [b - a for t in times for a, b in zip(t, t[1:])]
    if not steps or span <= 0:
        return {}
    limit = max(10 * statistics.median(steps), 0.1)

    def idle(t):
        return sum(g for g in (b - a for a, b in zip(t, t[1:])) if g > limit)

    merged = sorted(x for t in times for x in t)
    gaps = [b - a for a, b in zip(merged, merged[1:])]
    return {"limit_s": limit, "job": idle(merged) / span, "longest_s": max(gaps, default=0.0),
            "groups": [idle(t) / span for t in times]}


def _signal(pid: int, sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _loss_figures(chaos: list, free: list, windows: int = 10) -> dict:
    """The chaos run's loss against the fault-free run's at the same steps:
    over the last 10% of the steps both reached, each run's mean loss, and
    the fault-free run's noise there (the min-max of its means over
    ``windows`` equal windows of those steps); ``within`` when the chaos
    run's mean lies inside that spread. Also each run's mean over the last
    10% of its own steps."""
    top = min(max((s for s, _ in chaos), default=0), max((s for s, _ in free), default=0))
    lo = int(top * 0.9)

    def mean(xs):
        return statistics.fmean(xs) if xs else float("nan")

    c = [v for s, v in chaos if lo < s <= top]
    f = [(s, v) for s, v in free if lo < s <= top]
    width = max(1, (top - lo) // windows)
    means = [mean([v for s, v in f if lo + k * width < s <= lo + (k + 1) * width]) for k in range(windows)]
    means = [m for m in means if m == m]
    own = {}
    for name, xs in (("chaos_own_end", chaos), ("free_own_end", free)):
        last = max((s for s, _ in xs), default=0)
        own[name] = mean([v for s, v in xs if s > last * 0.9])
    return {"steps": [lo, top], "chaos": mean(c), "free": mean([v for _, v in f]),
            "free_noise": [min(means, default=float("nan")), max(means, default=float("nan"))],
            "within": bool(means) and min(means) <= mean(c) <= max(means), **own}


def chaos_figure(side: str, n: int, b: Bench, c: Chaos) -> dict:
    """The chaos run and the fault-free run of the same length, one after
    the other: committed steps per group as a share of the fault-free
    run's (goal >= 95%), and the loss at equal steps (``_loss_figures``)."""
    runs = {}
    for faults in (True, False):
        with workdir() as d:
            runs[faults] = ChaosRun(side, n, b, c, faults, Path(d)).run()
    chaos, free = runs[True], runs[False]
    share = [x / y if y else float("nan") for x, y in zip(chaos["commits"], free["commits"])]
    return {
        "share": min(share), "shares": share, "commits": chaos["commits"], "free_commits": free["commits"],
        "max_step": chaos["max_step"], "free_max_step": free["max_step"], "faults": chaos["faults"],
        "launches": chaos["launches"], "deferred": chaos["deferred"],
        "loss": _loss_figures(chaos["losses"], free["losses"]),
        "idle": chaos["idle"], "free_idle": free["idle"],
    }



def spread(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    med = statistics.median(xs)
    return f"{med:.3f} ({min(xs):.3f}-{max(xs):.3f})"


def one_figure(fig: str, side: str, n: int, b: Bench):
    if fig == "steady":
        return steady_figure(side, n, b)
    if fig == "lighthouse":
        return lighthouse_figure(side, n, b)
    if fig == "restart":
        return fault_figure(side, n, "kill-between", b, restart=True)
    if fig == "cut":
        return cut_figure(side, n, b)
    if fig == "chaos":
        return chaos_figure(side, n, b, b.chaos)
    return fault_figure(side, n, fig, b)


FAULTS = ["kill-between", "kill-allreduce", "stop-allreduce"]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--replicas", type=int, nargs="+", default=None,
                    help="replica groups per run (default 2 3; with --hosts N, N)")
    ap.add_argument("--hosts", type=int, default=0,
                    help="run across N test hosts (network namespaces, root), one replica group per host")
    ap.add_argument("--lighthouse-apart", action="store_true",
                    help="with --hosts N: one more host, for the lighthouse alone (default: beside replica 0)")
    ap.add_argument("--sides", nargs="+", default=["gloo", "gloo-tuned", "rally"])
    ap.add_argument("--figures", nargs="+", default=None,
                    help="default: every loopback figure; with --hosts: " + " ".join(FAULTS + ["cut"]))
    ap.add_argument("--steady-seconds", type=float, default=20.0)
    ap.add_argument("--chaos-seconds", type=float, default=600.0,
                    help="figure chaos: how long each run (with faults, and fault-free) lasts")
    ap.add_argument("--chaos-seed", type=int, default=0, help="figure chaos: the faults' random seed")
    ap.add_argument("--chaos-every", type=float, default=10.0,
                    help="figure chaos: the mean interval between faults, s (drawn from 0.5x-1.5x)")
    ap.add_argument("--rally", default=str(ROOT / "target/release/rally"))
    ap.add_argument("--native", default=str(ROOT / "target/release/lib_native.so"))
    ap.add_argument("--python-src", default=str(ROOT / "python/rallypoint"))
    ap.add_argument("--hold", default=str(ROOT / "target/release/examples/hold"))
    a = ap.parse_args()
    if a.hosts:
        if not 2 <= a.hosts <= 15:
            ap.error("--hosts takes 2 to 15 hosts")
        if a.replicas not in (None, [a.hosts]):
            ap.error(f"across hosts there is one replica group per host: --replicas {a.hosts} or none")
        a.replicas = [a.hosts]
        a.figures = a.figures or FAULTS + ["cut"]
    else:
        a.replicas = a.replicas or [2, 3]
        a.figures = a.figures or FAULTS + ["restart", "lighthouse", "steady"]
        if "cut" in a.figures:
            ap.error("the figure `cut` needs test hosts (--hosts N)")
    return a


def main():
    a = parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="ft_bench_site.") as site_dir:
        site = lay_out_package(Path(site_dir), Path(a.python_src), Path(a.native))
        apart = bool(a.hosts and a.lighthouse_apart)
        net = Hosts(a.hosts + apart, a.hold) if a.hosts else Loopback()
        try:
            b = Bench(rally=a.rally, net=net, site=site, steady_seconds=a.steady_seconds,
                      chaos=Chaos(seconds=a.chaos_seconds, seed=a.chaos_seed, every=a.chaos_every),
                      lh_place=a.hosts if apart else 0)
            print(json.dumps({"network": net.name, "python_src": a.python_src, "native": a.native, "rally": a.rally}), flush=True)
            for rep in range(a.reps):
                for n in a.replicas:
                    for fig in a.figures:
                        run_sides(results, rep, n, fig, a.sides, b)
        finally:
            net.close()
    print_table(results)


def run_sides(results: dict, rep: int, n: int, fig: str, sides: list, b: Bench):
    """One figure at ``n`` replicas, every side, in an order that flips
    each repetition."""
    sides = list(sides)
    if fig == "steady":
        sides = ["ddp-rally", "ddp-gloo", "ddp-gloo-local"] + [s for s in sides if s != "gloo-tuned"]
    for side in sides if rep % 2 == 0 else reversed(sides):
        try:
            r = one_figure(fig, side, n, b)
        except (TimeoutError, RuntimeError) as e:
            # A run that did not get as far as its figure: said, counted,
            # and the others go on.
            r = {"error": str(e)}
        results.setdefault((fig, n, side), []).append(r)
        print(json.dumps({"rep": rep, "figure": fig, "replicas": n, "side": side, **r}), flush=True)


def print_table(results: dict):
    chaos = {k: v for k, v in results.items() if k[0] == "chaos"}
    results = {k: v for k, v in results.items() if k[0] != "chaos"}
    if chaos:
        print_chaos(chaos)
    if not results:
        return
    print("\n| figure | replicas | side | median (min-max) | survivors crashed | runs that failed before the figure | step before the fault |")
    print("|---|---|---|---|---|---|---|")
    for (fig, n, side), rs in results.items():
        key = {"steady": "step", "restart": "heal"}.get(fig, "gap")
        ok = [r for r in rs if "error" not in r]
        crashed = sum(r.get("crashed", 0) for r in ok)
        at_risk = n if fig == "lighthouse" else n - 1
        failed = len(rs) - len(ok)
        step = spread([r.get("step") for r in ok if fig not in ("steady", "lighthouse")])
        unit = "" if step == "-" else " s"
        print(f"| {fig} | {n} | {side} | {spread([r[key] for r in ok])} s | {crashed} of {len(ok) * at_risk} | {failed} | {step}{unit} |")


def print_chaos(results: dict):
    print("\n| side | groups | committed steps / fault-free's, per group | steps reached (fault-free) | faults | launches per group | "
          "loss at steps (fault-free; its window spread) | within | job without commits (fault-free), per group |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (_, n, side), rs in results.items():
        for r in rs:
            if "error" in r:
                print(f"| {side} | {n} | failed: {r['error'][:200]} |")
                continue
            lo = r["loss"]
            shares = " ".join(f"{x:.3f}" for x in r["shares"])
            faults = " ".join(f"{k} {v}" for k, v in sorted(r["faults"].items()))
            print(f"| {side} | {n} | {shares} | {r['max_step']} ({r['free_max_step']}) | {faults} | "
                  f"{' '.join(map(str, r['launches']))} | {lo['chaos']:.4f} ({lo['free']:.4f}; "
                  f"{lo['free_noise'][0]:.4f}-{lo['free_noise'][1]:.4f}) at {lo['steps'][0]}-{lo['steps'][1]} | {lo['within']} | "
                  f"{_idle_cell(r.get('idle', {}), r.get('free_idle', {}))} |")


def _idle_cell(idle: dict, free: dict) -> str:
    if not idle:
        return "-"
    groups = " ".join(f"{x:.1%}" for x in idle["groups"])
    return f"{idle['job']:.1%} ({free.get('job', float('nan')):.1%}), longest {idle['longest_s']:.2f} s; {groups}"


if __name__ == "__main__":
    sys.exit(main())
