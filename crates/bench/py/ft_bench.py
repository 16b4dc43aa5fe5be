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
- ``restart``: a killed replica launched again, from its Manager being
  ready to its first committed step;
- ``lighthouse``: the lighthouse SIGKILLed and started again, from its
  return to every replica's next commit, and replicas crashed;
- ``steady``: the median step (between commits) of the 10M-parameter MLP;
- ``cut`` (across hosts only): the last replica's host taken off the bridge
  (silent loss both ways, no reset), from the moment it is off to the
  survivors' first commit of a step whose quorum left it out.

Across test hosts (``--hosts N``, root): one replica group per host, N
network namespaces on a bridge (``10.77.0.<i>``, hostnames ``node<i>``),
made and torn down by ``crates/testhosts/examples/hold.rs``, which this
script starts in a session of its own and talks to on a pipe (``cut I``,
``heal I``); the hosts go when its standard input closes, so on every exit
of this script, Ctrl-C and crashes included. The lighthouse runs on node1
beside replica 0, each replica's store on its own host, and the victim is
the last replica (on the last host)::

    cargo build --release -p rally -p rallypoint-torch
    cargo build --release -p rallypoint-testhosts --example hold
    .venv/bin/python crates/bench/py/ft_bench.py --hosts 3 --reps 3

Usage on loopback::

    .venv/bin/python crates/bench/py/ft_bench.py --reps 5 --replicas 2 3
    .venv/bin/python crates/bench/py/ft_bench.py --figures steady --reps 3

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
    """torchft's or ours, on a fresh port of place 0 (loopback, or node1)."""

    def __init__(self, side: str, b: Bench, workdir, extra=()):
        self.net = b.net
        self.port = free_port()
        self.etcd = None
        bind = f"{self.net.addr(0)}:{self.port}"
        if side == "rally-state":
            # Its state (the last quorum) in etcd, on the same place.
            self.etcd = Etcd(b, workdir)
            extra = ("--state", f"etcd://{self.net.addr(0)}:{self.etcd.port}", *extra)
        if side.startswith("rally"):
            cmd = [b.rally, "lighthouse", "--bind", bind, "--min_replicas", "1", *extra]
        else:
            hb = "1000" if side == "gloo-tuned" else "5000"
            exe = str(Path(PY).parent / "torchft_lighthouse")
            cmd = [exe, "--bind", bind, "--min_replicas", "1", "--join_timeout_ms", "500",
                   "--quorum_tick_ms", "100", "--heartbeat_timeout_ms", hb, *extra]
        self.cmd = self.net.prefix(0) + cmd
        self.log = open(Path(workdir) / "lighthouse.log", "a")
        self.proc = None
        self.start()

    def start(self):
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=self.log)
        wait_listening(self.net, 0, self.port, self.proc, 20, PY, f"lighthouse {self.cmd}",
                       Path(self.log.name).read_text(errors="replace"))

    @property
    def url(self) -> str:
        return f"http://{self.net.addr(0)}:{self.port}"

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
    port of place 0, for ``rally lighthouse --state``."""

    def __init__(self, b: Bench, workdir):
        self.port = free_port()
        peer = free_port()
        host = b.net.addr(0)
        cmd = b.net.prefix(0) + [
            "etcd", "--data-dir", str(Path(workdir) / "etcd"), "--name", "bench",
            "--listen-client-urls", f"http://{host}:{self.port}", "--advertise-client-urls", f"http://{host}:{self.port}",
            "--listen-peer-urls", f"http://{host}:{peer}", "--initial-advertise-peer-urls", f"http://{host}:{peer}",
            "--initial-cluster", f"bench=http://{host}:{peer}",
        ]
        self.log = open(Path(workdir) / "etcd.log", "a")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log)
        wait_listening(b.net, 0, self.port, self.proc, 20, PY, f"etcd {cmd}", Path(self.log.name).read_text(errors="replace"))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Replica:
    """Replica group ``i`` of ``n`` (one process), on place ``i``."""

    def __init__(self, workdir: Path, i: int, n: int, side: str, lighthouse, env: dict, b: Bench):
        self.i = i
        self.out = workdir / f"replica{i}.{time.monotonic_ns()}.jsonl"
        self.log = open(workdir / f"replica{i}.log", "a")
        e = dict(os.environ)
        # torchft's Manager names itself by socket.gethostname(): the host's.
        e.pop("HOSTNAME", None)
        path = [b.site] + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
        e.update(
            REPLICA_GROUP_ID=str(i), NUM_REPLICA_GROUPS=str(n), MASTER_ADDR=b.net.addr(i),
            FT_SIDE="rally" if side.startswith("rally") else ("gloo" if side.startswith("gloo") else side),
            FT_OUT=str(self.out), PYTHONPATH=":".join(path),
        )
        e["MASTER_PORT"] = str(env.pop("MASTER_PORT", free_port()))
        if lighthouse is not None:
            e["TORCHFT_LIGHTHOUSE"] = lighthouse.url
        e.update({k: str(v) for k, v in env.items()})
        # ip netns exec and nsenter exec the program: proc.pid is Python's.
        cmd = b.net.prefix(i) + [PY, str(WORKER)]
        self.proc = subprocess.Popen(cmd, env=e, stdout=self.log, stderr=self.log)

    def records(self):
        if not self.out.exists():
            return []
        return [json.loads(line) for line in self.out.read_text().splitlines() if line.strip()]

    def committed_step(self) -> int:
        """The last step it committed."""
        return max((x["step"] for x in self.records() if x.get("committed")), default=0)

    def wait(self, limit: float) -> int:
        try:
            return self.proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return -999

    def kill(self):
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.kill()
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
    victim's ready-to-first-commit after it is launched again."""
    with workdir() as d:
        lh = Lighthouse(side, b, d)
        reps = []
        try:
            common = {"FT_MODEL": model, "FT_STEPS": AT + 40}
            reps = [Replica(Path(d), i, n, side, lh, dict(common), b) for i in range(n - 1)]
            victim_env = dict(common, FT_FAULT=fault, FT_FAULT_STEP=AT)
            reps.append(Replica(Path(d), n - 1, n, side, lh, victim_env, b))
            victim = reps[-1]
            t_fault = _wait_for(lambda: _fault_time(victim), 120, f"{side}: the victim's fault at step {AT}")
            survivors = reps[:-1]
            gaps = _gaps(survivors, _without_victim(t_fault, n), t_fault, "a survivor's commit without the victim")
            heal = None
            if restart:
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
            ts = sorted(x["t"] for x in reps[0].records() if x.get("committed"))
            ts = ts[len(ts) // 4:]  # warm-up
            gaps = [y - x for x, y in zip(ts, ts[1:])]
            return {"step": statistics.median(gaps) if gaps else float("nan"), "steps": len(ts)}
        finally:
            for r in reps:
                r.kill()
            if lh:
                lh.close()


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
    return fault_figure(side, n, fig, b)


FAULTS = ["kill-between", "kill-allreduce", "stop-allreduce"]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--replicas", type=int, nargs="+", default=None,
                    help="replica groups per run (default 2 3; with --hosts N, N)")
    ap.add_argument("--hosts", type=int, default=0,
                    help="run across N test hosts (network namespaces, root), one replica group per host")
    ap.add_argument("--sides", nargs="+", default=["gloo", "gloo-tuned", "rally"])
    ap.add_argument("--figures", nargs="+", default=None,
                    help="default: every loopback figure; with --hosts: " + " ".join(FAULTS + ["cut"]))
    ap.add_argument("--steady-seconds", type=float, default=20.0)
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
        net = Hosts(a.hosts, a.hold) if a.hosts else Loopback()
        try:
            b = Bench(rally=a.rally, net=net, site=site, steady_seconds=a.steady_seconds)
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


if __name__ == "__main__":
    sys.exit(main())
