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
- ``ddp-rally`` / ``ddp-gloo``: plain torch DDP across the replicas, no fault
  tolerance (the floor of the steady state).

Sides are interleaved within each repetition; the table gives medians and
the spread (min-max). Figures:

- ``kill-between``, ``kill-allreduce``, ``stop-allreduce``: from the fault
  (the victim records the moment, then signals itself) to the survivors'
  next committed step, and how many survivors crashed;
- ``restart``: a killed replica launched again, from its Manager being
  ready to its first committed step;
- ``lighthouse``: the lighthouse SIGKILLed and started again, from its
  return to every replica's next commit, and replicas crashed;
- ``steady``: the median step (between commits) of the 10M-parameter MLP.

Usage::

    .venv/bin/python crates/bench/py/ft_bench.py --reps 5 --replicas 2 3
    .venv/bin/python crates/bench/py/ft_bench.py --figures steady --reps 3

``--rally`` names the ``rally`` binary (default: ``target/release/rally``).
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
WORKER = HERE / "ft_worker.py"
PY = os.environ.get("RALLY_PYTHON", str(ROOT / ".venv/bin/python"))


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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lighthouse:
    """torchft's or ours, on a fresh port of loopback."""

    def __init__(self, side: str, rally: str, extra=()):
        self.port = free_port()
        bind = f"127.0.0.1:{self.port}"
        if side == "rally":
            cmd = [rally, "lighthouse", "--bind", bind, "--min_replicas", "1", *extra]
        else:
            hb = "1000" if side == "gloo-tuned" else "5000"
            exe = str(Path(PY).parent / "torchft_lighthouse")
            cmd = [exe, "--bind", bind, "--min_replicas", "1", "--join_timeout_ms", "500",
                   "--quorum_tick_ms", "100", "--heartbeat_timeout_ms", hb, *extra]
        self.cmd = cmd
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".lighthouse.log", delete=False)
        self.proc = None
        self.start()

    def start(self):
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"lighthouse exited: {Path(self.log.name).read_text()[-2000:]}")
                time.sleep(0.02)
        raise RuntimeError(f"lighthouse {self.cmd} did not listen on {self.port} within 20 s")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Replica:
    def __init__(self, workdir: Path, i: int, n: int, side: str, lighthouse, env: dict):
        self.i = i
        self.out = workdir / f"replica{i}.{time.monotonic_ns()}.jsonl"
        self.log = open(workdir / f"replica{i}.log", "a")
        e = dict(os.environ)
        e.update(
            REPLICA_GROUP_ID=str(i), NUM_REPLICA_GROUPS=str(n), MASTER_ADDR="127.0.0.1",
            FT_SIDE="rally" if side == "rally" else ("gloo" if side.startswith("gloo") else side),
            FT_OUT=str(self.out), PYTHONPATH=os.environ.get("PYTHONPATH", ""),
        )
        e["MASTER_PORT"] = str(env.pop("MASTER_PORT", free_port()))
        if lighthouse is not None:
            e["TORCHFT_LIGHTHOUSE"] = lighthouse.url
        e.update({k: str(v) for k, v in env.items()})
        self.proc = subprocess.Popen([PY, str(WORKER)], env=e, stdout=self.log, stderr=self.log)

    def records(self):
        if not self.out.exists():
            return []
        return [json.loads(line) for line in self.out.read_text().splitlines() if line.strip()]

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


def fault_figure(side: str, n: int, fault: str, rally: str, model="small", restart=False):
    """From the victim's fault to the survivors' next committed step (the
    slowest survivor), survivors crashed, and with ``restart`` the victim's
    ready-to-first-commit after it is launched again."""
    at = 20
    with workdir() as d:
        lh = Lighthouse(side, rally)
        reps = []
        try:
            common = {"FT_MODEL": model, "FT_STEPS": at + 40}
            reps = [Replica(Path(d), i, n, side, lh, dict(common)) for i in range(n - 1)]
            victim_env = dict(common, FT_FAULT=fault, FT_FAULT_STEP=at)
            reps.append(Replica(Path(d), n - 1, n, side, lh, victim_env))
            victim = reps[-1]
            t_fault = _wait_for(lambda: _fault_time(victim), 120, f"{side}: the victim's fault at step {at}")
            survivors = reps[:-1]

            # The survivors' first commit of a step begun after the fault. A
            # record's step is the Manager's after it, so the commit of the
            # fault's own step (which a survivor may still make: the victim
            # sent its part before it died, and torchft's should_commit is
            # local to a replica group) reads at + 1 for a fault inside it.
            past = at if fault == "kill-between" else at + 1

            def next_commit(r):
                t = next((x["t"] for x in r.records() if x.get("committed") and x["step"] > past), None)
                if t is None and r.proc.poll() is not None:
                    return float("inf")  # it exited (crashed) without one
                return t

            gaps, crashed = [], 0
            for r in survivors:
                try:
                    gaps.append(_wait_for(lambda: next_commit(r), 60, "a survivor's next commit") - t_fault)
                except TimeoutError:
                    gaps.append(float("inf"))
            heal = None
            if restart:
                victim.kill()
                again = Replica(Path(d), n - 1, n, side, lh, dict(common, FT_STEPS=5))
                reps.append(again)
                ready = _wait_for(lambda: next((x["t"] for x in again.records() if x.get("event") == "ready"), None), 60, "the restarted replica's ready")
                first = _wait_for(lambda: next((x["t"] for x in again.records() if x.get("committed")), None), 60, "its first commit")
                heal = first - ready
            for r in survivors:
                code = r.wait(120)
                crashed += code != 0
            return {"gap": max(gaps), "crashed": crashed, "heal": heal}
        finally:
            for r in reps:
                r.kill()
            lh.stop()


# torchft's manager sleeps quorum_timeout / (retries + 1) between tries of a
# failed quorum call (manager.rs, _quorum_with_retries): 60 s / 121, ~0.5 s.
RETRIES = 120


def lighthouse_figure(side: str, n: int, rally: str, model="small"):
    """The lighthouse SIGKILLed at step 20 and started again on its port
    0.5 s later, ``TORCHFT_QUORUM_RETRIES`` the same on both sides
    (``RETRIES``): from its return to every replica's next commit, and how
    many replicas crashed."""
    with workdir() as d:
        lh = Lighthouse(side, rally)
        reps = []
        try:
            env = {"FT_MODEL": model, "FT_STEPS": 80, "TORCHFT_QUORUM_RETRIES": RETRIES}
            reps = [Replica(Path(d), i, n, side, lh, dict(env)) for i in range(n)]

            def step_of(r):
                return max((x["step"] for x in r.records() if x.get("committed")), default=0)

            _wait_for(lambda: all(step_of(r) >= 20 for r in reps), 120, "step 20 everywhere")
            lh.stop()
            time.sleep(0.5)
            lh.start()
            t_back = time.time()
            last = max(step_of(r) for r in reps)

            def after(r):
                return next((x["t"] for x in r.records() if x.get("committed") and x["step"] > last), None)

            gaps = []
            for r in reps:
                try:
                    gaps.append(_wait_for(lambda: after(r), 60, "a commit after the lighthouse came back") - t_back)
                except TimeoutError:
                    gaps.append(float("inf"))
            crashed = sum(r.wait(120) != 0 for r in reps)
            return {"gap": max(gaps), "crashed": crashed}
        finally:
            for r in reps:
                r.kill()
            lh.stop()


def steady_figure(side: str, n: int, rally: str, seconds=20.0, model="10m"):
    """The median interval between committed steps after a warm-up."""
    with workdir() as d:
        lh = None if side.startswith("ddp-") else Lighthouse(side, rally)
        reps = []
        try:
            env = {"FT_MODEL": model, "FT_SECONDS": seconds}
            if side.startswith("ddp-"):
                env["MASTER_PORT"] = free_port()
            reps = [Replica(Path(d), i, n, side, lh, dict(env)) for i in range(n)]
            for r in reps:
                r.wait(seconds + 120)
            ts = sorted(x["t"] for x in reps[0].records() if x.get("committed"))
            ts = ts[len(ts) // 4:]  # warm-up
            gaps = [b - a for a, b in zip(ts, ts[1:])]
            return {"step": statistics.median(gaps) if gaps else float("nan"), "steps": len(ts)}
        finally:
            for r in reps:
                r.kill()
            if lh:
                lh.stop()


def spread(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    med = statistics.median(xs)
    return f"{med:.3f} ({min(xs):.3f}-{max(xs):.3f})"


def one_figure(fig: str, side: str, n: int, a):
    if fig == "steady":
        return steady_figure(side, n, a.rally, a.steady_seconds)
    if fig == "lighthouse":
        return lighthouse_figure(side, n, a.rally)
    if fig == "restart":
        return fault_figure(side, n, "kill-between", a.rally, restart=True)
    return fault_figure(side, n, fig, a.rally)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--sides", nargs="+", default=["gloo", "gloo-tuned", "rally"])
    ap.add_argument("--figures", nargs="+", default=["kill-between", "kill-allreduce", "stop-allreduce", "restart", "lighthouse", "steady"])
    ap.add_argument("--steady-seconds", type=float, default=20.0)
    ap.add_argument("--rally", default=str(ROOT / "target/release/rally"))
    a = ap.parse_args()
    results = {}
    for rep in range(a.reps):
        for n in a.replicas:
            for fig in a.figures:
                sides = list(a.sides)
                if fig == "steady":
                    sides = ["ddp-rally", "ddp-gloo"] + [s for s in sides if s != "gloo-tuned"]
                for side in sides if rep % 2 == 0 else reversed(sides):
                    try:
                        r = one_figure(fig, side, n, a)
                    except (TimeoutError, RuntimeError) as e:
                        # A run that did not get as far as its figure: said,
                        # counted, and the others go on.
                        r = {"error": str(e)}
                    results.setdefault((fig, n, side), []).append(r)
                    print(json.dumps({"rep": rep, "figure": fig, "replicas": n, "side": side, **r}), flush=True)
    print("\n| figure | replicas | side | median (min-max) | survivors crashed | runs that failed before the figure |")
    print("|---|---|---|---|---|---|")
    for (fig, n, side), rs in results.items():
        key = {"steady": "step", "restart": "heal"}.get(fig, "gap")
        ok = [r for r in rs if "error" not in r]
        crashed = sum(r.get("crashed", 0) for r in ok)
        at_risk = n if fig == "lighthouse" else n - 1
        failed = len(rs) - len(ok)
        print(f"| {fig} | {n} | {side} | {spread([r[key] for r in ok])} s | {crashed} of {len(ok) * at_risk} | {failed} |")


if __name__ == "__main__":
    sys.exit(main())
