"""PyTorch's side of `rallypoint-bench collectives`: one gloo rank (or, with
RALLY_BENCH_BACKEND=rally, one rank of our torch.distributed backend), in its
own process, on the benchmark's store server (a TCPStore client). Same loop as our
`coll-rank`: per op and size, a warm-up, a barrier, then ITERS timed ops; every
rank prints `RESULT <op> <bytes> <seconds per op>` and the driver takes the
slowest rank.

usage: coll_bench.py PORT PREFIX N RANK OPS SIZES"""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

port, prefix, n, rank = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if os.environ.get("RALLY_BENCH_PIN") == "1":
    # As our side does: this rank on CPU rank mod CPUs, threads included.
    os.sched_setaffinity(0, {rank % os.cpu_count()})
ops, sizes = sys.argv[5].split(","), [int(s) for s in sys.argv[6].split(",")]
dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[
    os.environ.get("RALLY_BENCH_DTYPE", "f32")
]

store_host = os.environ.get("RALLY_BENCH_STORE_HOST", "127.0.0.1")
store = dist.TCPStore(store_host, port, n, is_master=False, timeout=timedelta(seconds=600))
store = dist.PrefixStore(prefix, store)
backend = os.environ.get("RALLY_BENCH_BACKEND", "gloo")
if backend == "rally":
    import rallypoint.torch  # noqa: F401 - registers the backend
dist.init_process_group(backend, store=store, rank=rank, world_size=n, timeout=timedelta(seconds=600))


def iters_for(nbytes):
    # A positive integer overrides (as on our side); anything else is ignored.
    n = os.environ.get("RALLY_BENCH_ITERS", "")
    if n.isdigit() and int(n) > 0:
        return int(n)
    return max(5, min(1000, (512 << 20) // max(nbytes, 1)))


def check(op, count):
    """One op on inputs that differ by rank, its result checked (as ours)."""
    # As ours: sums exact in every type (bf16 holds integers up to 256).
    m = 7 if n <= 18 else 2
    mine = lambda r: (torch.arange(count) + r).remainder(m).to(dtype)
    if op == "all_reduce":
        t = mine(rank)
        dist.all_reduce(t)
        want = sum(mine(q) for q in range(n))
    elif op == "broadcast":
        t = mine(rank)
        dist.broadcast(t, 0)
        want = mine(0)
    elif op == "all_gather":
        t = torch.empty(count * n, dtype=dtype)
        dist.all_gather_into_tensor(t, mine(rank))
        want = torch.cat([mine(q) for q in range(n)])
    else:
        return
    if not torch.equal(t, want):
        raise SystemExit(f"{backend} {op} of {count} {dtype} on rank {rank} returned a wrong result")


def run(op, nbytes):
    count = max(nbytes // dtype.itemsize, 1)
    check(op, count)
    # Zeros: repeated sums into one tensor stay exact.
    t = torch.zeros(count, dtype=dtype)
    if op == "all_reduce":
        f = lambda: dist.all_reduce(t)
    elif op == "broadcast":
        f = lambda: dist.broadcast(t, 0)
    elif op == "all_gather":
        out = torch.empty(count * n, dtype=dtype)
        f = lambda: dist.all_gather_into_tensor(out, t)
    elif op == "barrier":
        f = lambda: dist.barrier()
    else:
        raise SystemExit(f"unknown op {op}")
    iters = iters_for(nbytes)
    for _ in range(max(2, iters // 10)):
        f()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        f()
    dt = (time.perf_counter() - t0) / iters
    if t.any() or (op == "all_gather" and out.any()):
        raise SystemExit(f"{backend} {op} of {nbytes} bytes: the timed ops corrupted the tensor")
    print(f"RESULT {op} {nbytes} {dt:.9f}", flush=True)


for op in ops:
    for nbytes in [4] if op == "barrier" else sizes:
        run(op, nbytes)
dist.barrier()
dist.destroy_process_group()
# The PyPI wheel sometimes aborts at exit after destroy_process_group.
sys.stdout.flush()
os._exit(0)
