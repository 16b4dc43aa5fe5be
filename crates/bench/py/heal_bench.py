"""Healing at link speed (issue 47 §2): bytes/s of one state dict moved
between two processes on loopback, ``RallyTransport`` beside torchft 0.2.0's
``HTTPTransport`` (its Manager's default, unchunked) and ``PGTransport`` over
its ``ProcessGroupGloo``, in one run.

A sender and a receiver process share a TCPStore (hosted here). For each
repetition, each size and each transport in turn (interleaved, the order
rotating from one repetition to the next), the sender
stages the state dict (``send_checkpoint``) and the receiver times
``recv_checkpoint`` from the call to its return (the whole state in the
receiver's memory); PGTransport's sender sends during that time (it has no
staging). The state dict is float32 tensors of 8 MiB, as a model's would
be, plus a step counter. The table gives, per size and transport, the median
time over the repetitions, its spread (min-max) and the median rate.

``--heal MB...`` measures instead the issue's figure: a replica started
beside a running one (torchft 0.2.0's Manager, DDP, optimizer wrapper and
in-process lighthouse; ``ProcessGroupGloo``), its model carrying a buffer of
MB megabytes, from its Manager being ready to its first committed step (the
quorum, the heal, loading the state, one step), RallyTransport against the
Manager's default HTTPTransport, interleaved.

Usage::

    .venv/bin/python crates/bench/py/heal_bench.py --sizes 64 256 1024 --reps 5
    .venv/bin/python crates/bench/py/heal_bench.py --heal 64 1024 --reps 3
"""

import argparse
import os
import select
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch
from torch.distributed import TCPStore

TRANSPORTS = ("rally", "http", "pg")
TIMEOUT = timedelta(seconds=120)
TENSOR_MB = 8


def state(mb: int) -> dict:
    n = TENSOR_MB * (1 << 20) // 4
    k = max(mb // TENSOR_MB, 1)
    return {"user": {"default": {f"w{i}": torch.full((n,), float(i)) for i in range(k)}}, "torchft": {"step": 1}}


def make(kind: str, pg):
    if kind == "rally":
        from rallypoint.ft import RallyTransport

        return RallyTransport(timeout=TIMEOUT)
    if kind == "http":
        from torchft.checkpointing.http_transport import HTTPTransport

        return HTTPTransport(timeout=TIMEOUT, num_chunks=0)
    from torchft.checkpointing.pg_transport import PGTransport

    return PGTransport(pg, timeout=TIMEOUT, device=torch.device("cpu"))


def loopback(kind: str, metadata: str) -> str:
    """HTTPTransport advertises the hostname (torchft #329); reach it on loopback."""
    if kind != "http":
        return metadata
    import socket

    return metadata.replace(f"//{socket.gethostname()}:", "//127.0.0.1:")


def worker(rank: int, port: int, sizes: list, reps: int) -> None:
    from torchft.process_group import ProcessGroupGloo

    store = TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    pg = ProcessGroupGloo(timeout=TIMEOUT)
    pg.configure(f"127.0.0.1:{port}/heal_bench", f"r{rank}", rank, 2)
    transports = {k: make(k, pg) for k in TRANSPORTS}
    step = 0
    for rep in range(reps):
        for mb in sizes:
            sd = state(mb) if rank == 0 else None
            for kind in TRANSPORTS[rep % 3 :] + TRANSPORTS[: rep % 3]:  # each goes first in turn
                step += 1
                t = transports[kind]
                if rank == 0:
                    if kind != "pg":
                        t.send_checkpoint([1], step, sd, TIMEOUT)
                    store.set(f"go/{step}", t.metadata())
                    if kind == "pg":
                        t.send_checkpoint([1], step, sd, TIMEOUT)
                    store.wait([f"done/{step}"])
                    t.disallow_checkpoint()
                else:
                    meta = loopback(kind, store.get(f"go/{step}").decode())
                    t0 = time.perf_counter()
                    got = t.recv_checkpoint(0, meta, step, TIMEOUT)
                    took = time.perf_counter() - t0
                    w = got["user"]["default"]
                    assert len(w) == max(mb // TENSOR_MB, 1) and float(w["w1" if len(w) > 1 else "w0"][0]) in (0.0, 1.0)
                    del got, w
                    print(f"RESULT {rep} {kind} {mb} {took:.6f}", flush=True)
                    store.set(f"done/{step}", "1")
    for t in transports.values():
        t.shutdown()
    store.set(f"exit/{rank}", "1")
    store.wait(["exit/0", "exit/1"])


def heal_replica(rid: int, lighthouse: str, kind: str, mb: int) -> None:
    """One replica of ``--heal``: trains until it has committed two steps
    beside its peer; replica 1 prints HEAL_TIME."""
    from torchft import Manager
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    torch.manual_seed(rid)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    model.register_buffer("ballast", torch.full((mb << 18,), float(rid)))
    inner = torch.optim.AdamW(model.parameters())
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    if kind == "rally":
        from rallypoint.ft import RallyTransport

        transport = RallyTransport(timeout=TIMEOUT)
    else:
        from torchft.checkpointing.http_transport import HTTPTransport

        transport = HTTPTransport(timeout=TIMEOUT, num_chunks=0)  # the Manager's default
    spent = {"recv": 0.0, "load": 0.0}
    recv = transport.recv_checkpoint

    def timed_recv(*args, **kw):
        t0 = time.perf_counter()
        try:
            return recv(*args, **kw)
        finally:
            spent["recv"] += time.perf_counter() - t0

    def load(sd):
        t0 = time.perf_counter()
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])
        spent["load"] += time.perf_counter() - t0

    transport.recv_checkpoint = timed_recv
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT), min_replica_size=1,
        load_state_dict=load,
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=f"heal_{rid}", store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=lighthouse, hostname="127.0.0.1", timeout=TIMEOUT, checkpoint_transport=transport,
    )
    ddp = DistributedDataParallel(manager, model, broadcast_buffers=False)
    opt = OptimizerWrapper(manager, inner)
    ready = time.perf_counter()
    together, first = 0, None
    while together < 2:
        before = manager.current_step()
        opt.zero_grad()
        ddp(torch.randn(8, 32)).sum().backward()
        opt.step()
        if manager.current_step() == before:
            continue
        first = first or time.perf_counter()
        print(f"COMMITTED {manager.current_step()}", flush=True)
        together += manager.num_participants() == 2
    assert float(model.ballast[0]) == 0.0  # healed (replica 1) or never changed (replica 0)
    if rid == 1:
        print(f"HEAL_TIME {first - ready:.4f} {spent['recv']:.4f} {spent['load']:.4f}", flush=True)
    manager.shutdown()


def heal(sizes: list, reps: int) -> None:
    from torchft._torchft import LighthouseServer

    times: dict = {}
    for rep in range(reps):
        for mb in sizes:
            for kind in ("rally", "http")[rep % 2 :] + ("rally", "http")[: rep % 2]:
                lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=50)
                address = f"http://127.0.0.1:{lh.address().rsplit(':', 1)[1]}"  # address() names the hostname
                cmd = lambda rid: [sys.executable, __file__, "heal-replica", str(rid), address, kind, str(mb)]
                r0 = subprocess.Popen(cmd(0), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                deadline = time.monotonic() + 300
                while True:
                    ready, _, _ = select.select([r0.stdout], [], [], max(deadline - time.monotonic(), 0))
                    assert ready, "replica 0 committed no 2 steps within 300 s"
                    line = r0.stdout.readline()
                    assert line, "replica 0 ended early"
                    if line.startswith("COMMITTED 2"):
                        break
                r1 = subprocess.check_output(cmd(1), stderr=subprocess.DEVNULL, text=True, timeout=300)
                took = [float(x) for x in next(l for l in r1.splitlines() if l.startswith("HEAL_TIME")).split()[1:]]
                times.setdefault((mb, kind), []).append(took)
                r0.stdout.read()
                assert r0.wait(300) == 0
                lh.shutdown()
    print(f"a replica joining a running one: its Manager ready -> its first committed step; {reps} reps interleaved")
    print("(of which recv_checkpoint, and the user's load_state_dict, medians)")
    print(f"{'MB':>6} {'transport':>10} {'median s':>10} {'min-max s':>17} {'recv s':>8} {'load s':>8}")
    for mb in sizes:
        for kind in ("rally", "http"):
            ts = [t[0] for t in times[(mb, kind)]]
            rv, ld = (statistics.median(t[i] for t in times[(mb, kind)]) for i in (1, 2))
            print(f"{mb:>6} {kind:>10} {statistics.median(ts):>10.4f} {min(ts):>8.4f}-{max(ts):<8.4f} {rv:>8.4f} {ld:>8.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024], help="state dict sizes in MB")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="repetitions run first and not counted")
    ap.add_argument("--heal", type=int, nargs="+", help="measure healing a joining replica instead (sizes in MB)")
    a = ap.parse_args()
    if a.heal:
        return heal(a.heal, a.reps)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1")
    args = [str(store.port), ",".join(map(str, a.sizes)), str(a.warmup + a.reps)]
    procs = [
        subprocess.Popen([sys.executable, __file__, "worker", str(r), *args], env=env, stdout=subprocess.PIPE if r else None, text=True)
        for r in (0, 1)
    ]
    times: dict = {}
    for line in procs[1].stdout:
        if line.startswith("RESULT "):
            _, rep, kind, mb, took = line.split()
            if int(rep) >= a.warmup:
                times.setdefault((int(mb), kind), []).append(float(took))
    for p in procs:
        assert p.wait(600) == 0
    print(f"state dict of float32 tensors of {TENSOR_MB} MiB, loopback, {a.reps} reps interleaved (+{a.warmup} warm-up); receiver-side time")
    print(f"{'MB':>6} {'transport':>10} {'median s':>10} {'min-max s':>17} {'MB/s':>8}")
    for mb in a.sizes:
        for kind in TRANSPORTS:
            ts = times[(mb, kind)]
            med = statistics.median(ts)
            print(f"{mb:>6} {kind:>10} {med:>10.4f} {min(ts):>8.4f}-{max(ts):<8.4f} {mb / med:>8.0f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "heal-replica":
        heal_replica(int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
    elif len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), [int(x) for x in sys.argv[4].split(",")], int(sys.argv[5]))
    else:
        main()
