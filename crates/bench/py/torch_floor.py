"""The floor of a Python torch.distributed backend: all_reduce of one float
in a group of one (a HashStore), over a backend that does nothing and
returns a done Work, over rally, and over gloo. What the no-op backend takes
is torch's own dispatch (its Python wrapper, the C++ ProcessGroup, the
trampoline into Python), which every Python backend pays.

usage: PYTHONPATH=target/rallypoint-bench-torch .venv/bin/python crates/bench/py/torch_floor.py
(`rallypoint-bench torch-ddp` or `collectives --sides torch-rally` stages that directory.)
"""
import time, torch, torch.distributed as dist
from torch._C._distributed_c10d import Backend as B
import rallypoint.torch as rt
class Nop(B):
    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
    def getBackendName(self): return "nop"
    def allreduce(self, tensors, opts):
        f = torch.futures.Future(); f.set_result(tensors); return rt._Work(f)
dist.Backend.register_backend("nop", lambda o, b: Nop(o.store, o.group_rank, o.group_size, o.timeout), extended_api=True, devices=["cpu"])
for be in ["nop", "rally", "gloo"]:
    store = dist.HashStore()
    dist.init_process_group(be, store=store, rank=0, world_size=1)
    t = torch.zeros(1)
    for _ in range(200): dist.all_reduce(t)
    N = 5000; t0 = time.perf_counter()
    for _ in range(N): dist.all_reduce(t)
    print(be, "world 1: us per all_reduce", (time.perf_counter() - t0) / N * 1e6)
    dist.destroy_process_group()
import os; os._exit(0)
