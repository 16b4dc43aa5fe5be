"""PyTorch's side of `rallypoint-bench launch`: the same work with
torch.distributed.elastic.multiprocessing.start_processes. Prints one line
`RESULT <name> <seconds>` per measurement on stderr (stdout may be /dev/null)."""

import signal
import sys
import tempfile
import time

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

mode = sys.argv[1]
log_dir = tempfile.mkdtemp(prefix="torch_launch_bench_")


def ctx_for(entry, args, n, tee=Std.NONE, redirects=Std.NONE):
    return start_processes(
        name="bench",
        entrypoint=entry,
        args={i: args for i in range(n)},
        envs={i: {} for i in range(n)},
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, redirects=redirects, tee=tee),
    )


def result(name, seconds):
    print(f"RESULT {name} {seconds:.6f}", file=sys.stderr, flush=True)


if mode == "start":
    n, rounds, period = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    for _ in range(rounds):
        t = time.perf_counter()
        ctx = ctx_for("true", (), n)
        # "default" is PyTorch's own wait() (it polls once a second).
        r = ctx.wait() if period == "default" else ctx.wait(timeout=120, period=float(period))
        assert r is not None and not r.is_failed(), r
        result("start", time.perf_counter() - t)
elif mode == "tee":
    nbytes, producer = int(sys.argv[2]), sys.argv[3]
    t = time.perf_counter()
    ctx = ctx_for(producer, ("produce", str(nbytes)), 1, tee=Std.OUT)
    r = ctx.wait(timeout=600, period=0.001)
    assert r is not None and not r.is_failed(), r
    result("tee", time.perf_counter() - t)
elif mode == "inherit":
    nbytes, producer = int(sys.argv[2]), sys.argv[3]
    t = time.perf_counter()
    ctx = ctx_for(producer, ("produce", str(nbytes)), 1)
    r = ctx.wait(timeout=600, period=0.001)
    assert r is not None and not r.is_failed(), r
    result("inherit", time.perf_counter() - t)
elif mode == "stop":
    n, rounds = int(sys.argv[2]), int(sys.argv[3])
    for _ in range(rounds):
        ctx = ctx_for("sleep", ("30",), n)
        time.sleep(0.3)
        t = time.perf_counter()
        ctx.close(death_sig=signal.SIGTERM, timeout=30)
        result("stop", time.perf_counter() - t)
else:
    raise SystemExit(f"unknown mode {mode}")
