"""The rally backend under real torch, one scenario per run (SCENARIO):

- ``ops``: every operation on every dtype against values computed here,
  async and not; new_group over subsets; the object collectives; DDP (default,
  gradient_as_bucket_view, find_unused_parameters, no_sync, a Python comm hook)
  against gradients averaged by hand; DeviceMesh; init again after destroy with
  each device string; bad input.
- ``dead``: the last rank kills itself before an all_reduce; the others
  time their error (run it with processes started by hand: a launcher would
  stop them first).
- ``mismatch``: rank 0 calls all_reduce SUM, the others MAX.
- ``monitored``: every rank arrives at monitored_barrier; then, in a new
  group after destroy, the odd ranks never arrive.
- ``detail``: init under TORCH_DISTRIBUTED_DEBUG=DETAIL.

Each rank writes ``RESULT_DIR/<rank>.json`` and ends normally, as users'
scripts do. In ``ops`` every section counts its own checks (``sections``);
the Rust side asserts each count, so a section that stops checking (a loop
over nothing, a skipped group) fails the test.
"""

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import rallypoint.torch as rt

SCENARIO = os.environ.get("SCENARIO", "ops")
OUT = os.environ["RESULT_DIR"]
BACKEND = os.environ.get("BACKEND", "rally")


def write(result):
    path = os.path.join(OUT, f"{result['rank']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.rename(path + ".tmp", path)


def init(backend=BACKEND, **kw):
    dist.init_process_group(backend, **kw)
    return dist.get_rank(), dist.get_world_size()


checks = 0
# Section name -> the checks made in it (see `section`).
sections = {}


class section:
    """Counts the checks made inside ``with section(name):``."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        self.start = checks

    def __exit__(self, *exc):
        sections[self.name] = sections.get(self.name, 0) + checks - self.start


def check(ok, what):
    global checks
    checks += 1
    if not ok:
        raise AssertionError(what)


# The values here are small integers, and so are their sums, products and
# extremes: float32 and float64 hold every result exactly, and so must the
# backend. float16 and bfloat16 round a product or a mean; they may differ
# from the float64 reference rounded once by one unit in the last place.
ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def same(got, want, what, rtol=None):
    """``got`` equals ``want``: exactly, or within one unit in the last place
    of a half-width dtype, or within ``rtol`` where the caller sums floats
    that are not small integers (the order of a sum moves its last bits)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        check(False, f"{what}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}")
    if rtol is not None:
        ok = torch.allclose(got.double(), want.double(), rtol=rtol, atol=rtol * want.abs().max().item())
    elif got.dtype in ULP:
        ok = torch.allclose(got.double(), want.double(), rtol=ULP[got.dtype], atol=0)
    else:
        ok = torch.equal(got, want)
    check(ok, f"{what}: got {got.tolist()} want {want.tolist()}")


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int32, torch.int64, torch.bool]


def value(r, dt, n=5):
    """Rank r's tensor: small values every dtype holds."""
    if dt == torch.bool:
        return torch.tensor([(r + i) % 2 == 0 for i in range(n)])
    return (torch.arange(n) % 3 + r + 1).to(dt)


def reduce_all(vals, op, dt):
    stack = torch.stack([v.to(torch.float64) if dt.is_floating_point else v.to(torch.int64) for v in vals])
    if dt == torch.bool:
        b = torch.stack(vals)
        return {"SUM": b.any(0), "MAX": b.any(0), "MIN": b.all(0), "PRODUCT": b.all(0), "BOR": b.any(0), "BAND": b.all(0), "BXOR": b.sum(0) % 2 == 1}[op]
    if op == "SUM":
        out = stack.sum(0)
    elif op == "PRODUCT":
        out = stack.prod(0)
    elif op == "MIN":
        out = stack.min(0).values
    elif op == "MAX":
        out = stack.max(0).values
    elif op == "AVG":
        out = stack.mean(0)
    elif op == "BAND":
        out = vals[0].clone()
        for v in vals[1:]:
            out &= v
        return out
    elif op == "BOR":
        out = vals[0].clone()
        for v in vals[1:]:
            out |= v
        return out
    elif op == "BXOR":
        out = vals[0].clone()
        for v in vals[1:]:
            out ^= v
        return out
    return out.to(dt)


def ops_for(dt):
    ops = ["SUM", "PRODUCT", "MIN", "MAX"]
    if dt.is_floating_point:
        ops.append("AVG")
    else:
        ops += ["BAND", "BOR", "BXOR"]
    return ops


def every_op(r, n, group=None, ranks=None):
    """Every operation on every dtype, in group `group` (ranks `ranks`)."""
    ranks = ranks or list(range(n))
    me = ranks.index(dist.get_rank())
    k = len(ranks)
    for dt in DTYPES:
        vals = [value(i, dt) for i in range(k)]
        for op in ops_for(dt):
            for async_op in (False, True):
                t = vals[me].clone()
                w = dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group, async_op=async_op)
                if async_op:
                    w.wait()
                same(t, reduce_all(vals, op, dt), f"all_reduce {op} {dt}")
        for root in range(k):
            t = vals[me].clone() if me == root else torch.zeros_like(vals[me])
            dist.broadcast(t, src=ranks[root], group=group)
            same(t, vals[root], f"broadcast {dt} root {root}")
        outs = [torch.zeros_like(vals[0]) for _ in range(k)]
        dist.all_gather(outs, vals[me], group=group)
        for i in range(k):
            same(outs[i], vals[i], f"all_gather {dt}")
        flat = torch.zeros(5 * k, dtype=dt)
        dist.all_gather_into_tensor(flat, vals[me], group=group)
        same(flat, torch.cat(vals), f"all_gather_into_tensor {dt}")
        # reduce_scatter: rank i's input is k parts; part j of the result
        # lands on rank j.
        parts = [[value(i + j, dt) for j in range(k)] for i in range(k)]
        out = torch.zeros_like(vals[0])
        op = "SUM" if dt != torch.bool else "MAX"
        dist.reduce_scatter(out, [p.clone() for p in parts[me]], op=getattr(dist.ReduceOp, op), group=group)
        same(out, reduce_all([parts[i][me] for i in range(k)], op, dt), f"reduce_scatter {dt}")
        out = torch.zeros_like(vals[0])
        dist.reduce_scatter_tensor(out, torch.cat(parts[me]), op=getattr(dist.ReduceOp, op), group=group)
        same(out, reduce_all([parts[i][me] for i in range(k)], op, dt), f"reduce_scatter_tensor {dt}")
        root = k - 1
        t = vals[me].clone()
        dist.reduce(t, dst=ranks[root], op=getattr(dist.ReduceOp, op), group=group)
        if me == root:
            same(t, reduce_all(vals, op, dt), f"reduce {dt}")
        g = [torch.zeros_like(vals[0]) for _ in range(k)] if me == 0 else None
        dist.gather(vals[me], gather_list=g, dst=ranks[0], group=group)
        if me == 0:
            for i in range(k):
                same(g[i], vals[i], f"gather {dt}")
        out = torch.zeros_like(vals[0])
        dist.scatter(out, scatter_list=[v.clone() for v in vals] if me == 0 else None, src=ranks[0], group=group)
        same(out, vals[me], f"scatter {dt}")
        # all_to_all_single, even and with splits (rank i sends i+j+1 rows to j).
        inp = torch.cat([value(me * 10 + j, dt, 2) for j in range(k)])
        out = torch.zeros(2 * k, dtype=dt)
        dist.all_to_all_single(out, inp, group=group)
        same(out, torch.cat([value(j * 10 + me, dt, 2) for j in range(k)]), f"all_to_all_single {dt}")
        ins = [me + j + 1 for j in range(k)]
        outs_ = [j + me + 1 for j in range(k)]
        inp = torch.cat([value(me * 10 + j, dt, s) for j, s in enumerate(ins)])
        out = torch.zeros(sum(outs_), dtype=dt)
        dist.all_to_all_single(out, inp, output_split_sizes=outs_, input_split_sizes=ins, group=group)
        same(out, torch.cat([value(j * 10 + me, dt, s) for j, s in enumerate(outs_)]), f"all_to_all_single splits {dt}")
        outl = [torch.zeros(me + j + 1, dtype=dt) for j in range(k)]
        dist.all_to_all(outl, [value(me * 10 + j, dt, me + j + 1) for j in range(k)], group=group)
        for j in range(k):
            same(outl[j], value(j * 10 + me, dt, me + j + 1), f"all_to_all {dt}")
    # send/recv with tags, in a ring, and batch_isend_irecv.
    nxt, prv = ranks[(me + 1) % k], ranks[(me - 1) % k]
    for tag in (0, 7):
        got = torch.zeros(3)
        s = dist.isend(torch.full((3,), float(me + tag)), nxt, group=group, tag=tag)
        dist.recv(got, prv, group=group, tag=tag)
        s.wait()
        same(got, torch.full((3,), float((me - 1) % k + tag)), f"send/recv tag {tag}")
    got = torch.zeros(4, dtype=torch.int64)
    reqs = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, torch.full((4,), me, dtype=torch.int64), nxt, group),
        dist.P2POp(dist.irecv, got, prv, group),
    ])
    for q in reqs:
        q.wait()
    same(got, torch.full((4,), (me - 1) % k, dtype=torch.int64), "batch_isend_irecv")
    dist.barrier(group=group)
    dist.barrier(group=group, async_op=True).wait()


def objects(r, n):
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r, "pad": "x" * r * 100})
    check(objs == [{"rank": i, "pad": "x" * i * 100} for i in range(n)], f"all_gather_object: {objs}")
    lst = [{"from": 0}, [1, 2]] if r == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    check(lst == [{"from": 0}, [1, 2]], f"broadcast_object_list: {lst}")
    g = [None] * n if r == 0 else None
    dist.gather_object(("r", r), g, dst=0)
    if r == 0:
        check(g == [("r", i) for i in range(n)], f"gather_object: {g}")
    out = [None]
    dist.scatter_object_list(out, [f"for {i}" for i in range(n)] if r == 0 else None, src=0)
    check(out == [f"for {r}"], f"scatter_object_list: {out}")


class Net(nn.Module):
    def __init__(self, unused=False):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.unused = nn.Linear(16, 4) if unused else None

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def local_grads(model, x, y):
    m = Net(unused=model.unused is not None)
    m.load_state_dict(model.state_dict())
    nn.functional.mse_loss(m(x), y).backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in m.parameters()]


def ddp(r, n, **kw):
    """One DDP configuration: gradients must equal the mean of each rank's
    own, computed here without DDP (and gathered over rally)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = Net(unused=kw.pop("unused", False))
    hook = kw.pop("hook", False)
    no_sync = kw.pop("no_sync", False)
    m = DDP(model, **kw)
    if hook:
        def avg(state, bucket):
            fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
            return fut.then(lambda f: f.value()[0].div_(n))

        m.register_comm_hook(None, avg)
    torch.manual_seed(100 + r)
    batches = [(torch.randn(4, 8), torch.randn(4, 4)) for _ in range(2 if no_sync else 1)]
    want_local = [local_grads(model, x, y) for x, y in batches]
    mine = [sum(g) for g in zip(*want_local)]
    if no_sync:
        with m.no_sync():
            nn.functional.mse_loss(m(batches[0][0]), batches[0][1]).backward()
        nn.functional.mse_loss(m(batches[1][0]), batches[1][1]).backward()
    else:
        nn.functional.mse_loss(m(batches[0][0]), batches[0][1]).backward()
    unused = {id(p) for p in model.unused.parameters()} if model.unused is not None else set()
    for p, g in zip(model.parameters(), mine):
        if p.grad is None:
            # Only the layer forward() never uses has no gradient.
            check(id(p) in unused, f"DDP {kw}: a used parameter of shape {tuple(p.shape)} has no gradient")
            continue
        every = [torch.zeros_like(g) for _ in range(n)]
        dist.all_gather(every, g)
        # Random gradients: two levels (across hosts) sum them in another
        # order than this reference does; float32 rounds each sum.
        same(p.grad, sum(every) / n, f"DDP grad {kw} hook={hook} no_sync={no_sync}", rtol=n * 2.0**-22)


def device_mesh(r, n):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (n,))
    t = torch.ones(2)
    dist.all_reduce(t, group=mesh.get_group())
    same(t, torch.full((2,), float(n)), "DeviceMesh 1-D group")
    if n == 4:
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        t = torch.ones(2)
        dist.all_reduce(t, group=mesh2.get_group("tp"))
        same(t, torch.full((2,), 2.0), "DeviceMesh 2-D tp group")


def bad_input(r, n):
    for what, call, needle in [
        ("a transposed tensor", lambda: dist.all_reduce(torch.ones(4, 4).t()), "not contiguous"),
        ("a float8 tensor", lambda: dist.all_reduce(torch.ones(2).to(torch.float8_e5m2)), "dtype"),
        ("BAND on floats", lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND), "integer"),
    ]:
        try:
            call()
        except ValueError as e:
            check(needle in str(e), f"all_reduce of {what}: {e}")
        else:
            check(False, f"all_reduce of {what} did not raise ValueError")


def scenario_ops():
    r, n = init(timeout=datetime.timedelta(seconds=60))
    check(dist.get_backend() == BACKEND, f"get_backend: {dist.get_backend()}")
    with section("every_op"):
        every_op(r, n)
    with section("objects"):
        objects(r, n)
    with section("bad_input"):
        bad_input(r, n)
    # new_group over subsets of at least two ranks: every rank, the even
    # ranks and all but rank 0 (at 2 ranks the last two have one member and
    # only the first runs ops).
    for ranks in (list(range(n)), [i for i in range(n) if i % 2 == 0], list(range(1, n))):
        g = dist.new_group(ranks)
        if len(ranks) > 1 and r in ranks:
            with section(f"subgroup {ranks}"):
                check(dist.get_backend(g) == BACKEND, f"get_backend of subgroup {ranks}: {dist.get_backend(g)}")
                every_op(r, n, group=g, ranks=ranks)
    for kw in ({}, {"gradient_as_bucket_view": True}, {"find_unused_parameters": True, "unused": True}, {"no_sync": True}, {"hook": True}):
        with section(f"ddp {sorted(kw)}"):
            ddp(r, n, **kw)
    with section("device_mesh"):
        device_mesh(r, n)
    dist.destroy_process_group()
    # Again, with each device string this machine can run (no GPU here:
    # cuda's backend in the mixed string is gloo; NCCL's form is the same).
    for backend in ("cpu:rally", "cpu:rally,cuda:gloo"):
        with section(f"reinit {backend}"):
            init(backend, timeout=datetime.timedelta(seconds=30))
            t = torch.ones(3)
            dist.all_reduce(t)
            same(t, torch.full((3,), float(n)), f"all_reduce after re-init with {backend}")
            be = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
            check(isinstance(be, rt.RallyBackend), f"the CPU backend after re-init is {type(be)}")
            dist.destroy_process_group()
    write({"rank": r, "world_size": n, "checks": checks, "sections": sections, "ok": True})


def scenario_dead():
    r, n = init()
    dist.all_reduce(torch.ones(1))
    if r == n - 1:
        os.kill(os.getpid(), 9)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1 << 16))
        res = {"error": None}
    except Exception as e:  # noqa: BLE001
        res = {"error": str(e), "class": type(e).__name__, "is_dist_error": isinstance(e, dist.DistError)}
    res.update(rank=r, seconds=time.monotonic() - t0)
    write(res)


def scenario_mismatch():
    r, n = init(timeout=datetime.timedelta(seconds=60))
    dist.all_reduce(torch.ones(1))
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(8), op=dist.ReduceOp.SUM if r == 0 else dist.ReduceOp.MAX)
        res = {"error": None}
    except Exception as e:  # noqa: BLE001
        res = {"error": str(e), "class": type(e).__name__}
    res.update(rank=r, seconds=time.monotonic() - t0)
    write(res)


def scenario_monitored():
    # First a group where every rank arrives; then, under the same store
    # prefix (torch reuses it after destroy), one where the odd ranks do not:
    # the first group's keys must not count for the second.
    r, n = init(timeout=datetime.timedelta(seconds=60))
    rt.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    dist.destroy_process_group()
    r, n = init(timeout=datetime.timedelta(seconds=60))
    dist.barrier()
    if r % 2 == 1:  # ranks 1, 3, ...: never arrive
        write({"rank": r, "error": None, "skipped": True})
        # Away while the others wait; then an ordinary end.
        time.sleep(5)
        return
    t0 = time.monotonic()
    try:
        rt.monitored_barrier(timeout=datetime.timedelta(seconds=2))
        res = {"error": None}
    except Exception as e:  # noqa: BLE001
        res = {"error": str(e), "class": type(e).__name__}
    res.update(rank=r, seconds=time.monotonic() - t0)
    write(res)


def scenario_detail():
    # Run with TORCH_DISTRIBUTED_DEBUG=DETAIL: a clear error at init, not
    # torch's internal assert at the first call.
    r = int(os.environ["RANK"])
    try:
        init()
        res = {"error": None}
    except ValueError as e:
        res = {"error": str(e), "class": type(e).__name__}
    res.update(rank=r)
    write(res)


{
    "ops": scenario_ops,
    "dead": scenario_dead,
    "mismatch": scenario_mismatch,
    "monitored": scenario_monitored,
    "detail": scenario_detail,
}[SCENARIO]()
