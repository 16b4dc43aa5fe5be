"""PyTorch's side of `rallypoint-bench rpc`: one TensorPipe RPC worker, on the
benchmark's store server (env:// with TORCHELASTIC_USE_AGENT_STORE=True, so
every worker is a client). The same loop as our `rpc-worker`.

usage: rpc_bench.py MODE   (MODE: calls | init; RANK and WORLD_SIZE in the env)

calls: worker 0 measures, against worker 1: the round trip of an empty call,
       calls per second with WINDOW calls in flight, and a 256 MiB payload.
init:  every worker prints wall-clock times around init_rpc + shutdown."""

import os
import sys
import time

import torch
import torch.distributed.rpc as rpc

WINDOW = 64


def nothing():
    return None


def size_of(t):
    return t.numel()


def main():
    mode = sys.argv[1]
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    opts = rpc.TensorPipeRpcBackendOptions(init_method="env://", rpc_timeout=600, num_worker_threads=16)
    if mode == "init":
        t0 = time.time()
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=n, rpc_backend_options=opts)
        rpc.shutdown()
        t1 = time.time()
        print(f"RESULT start {t0:.6f}\nRESULT end {t1:.6f}", flush=True)
        return
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=n, rpc_backend_options=opts)
    if rank == 0:
        rounds = int(os.environ.get("RALLY_BENCH_ROUNDS", "2000"))
        for _ in range(200):
            rpc.rpc_sync("w1", nothing)
        t0 = time.perf_counter()
        for _ in range(rounds):
            rpc.rpc_sync("w1", nothing)
        print(f"RESULT rtt {(time.perf_counter() - t0) / rounds:.9f}", flush=True)

        batches = max(1, rounds * 5 // WINDOW)
        t0 = time.perf_counter()
        for _ in range(batches):
            torch.futures.wait_all([rpc.rpc_async("w1", nothing) for _ in range(WINDOW)])
        print(f"RESULT calls_per_s {batches * WINDOW / (time.perf_counter() - t0):.3f}", flush=True)

        size = int(os.environ.get("RALLY_BENCH_PAYLOAD", str(256 << 20)))
        t = torch.ones(size, dtype=torch.uint8)
        assert rpc.rpc_sync("w1", size_of, args=(t,)) == size
        reps = 3
        t0 = time.perf_counter()
        for _ in range(reps):
            rpc.rpc_sync("w1", size_of, args=(t,))
        print(f"RESULT payload_bytes_per_s {size * reps / (time.perf_counter() - t0):.3f}", flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    main()
