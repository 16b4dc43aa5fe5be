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

Usage::

    .venv/bin/python crates/bench/py/heal_bench.py --sizes 64 256 1024 --reps 5
"""

import argparse
import os
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024], help="state dict sizes in MB")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="repetitions run first and not counted")
    a = ap.parse_args()
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
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), [int(x) for x in sys.argv[4].split(",")], int(sys.argv[5]))
    else:
        main()
