"""One rank of `rallypoint-bench torch-ddp`: DDP training steps of an MLP
(about 25M parameters, small batch: communication matters) over the backend
named by BACKEND (gloo, or rally through `import rallypoint.torch`; or
"none": DDP with a comm hook that communicates nothing, over gloo: the same
steps, DDP's own bucketing and copies included, with free communication, the
floor no backend can beat), started
by hand (env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE). Prints
`RESULT <seconds per step>` (the mean of STEPS timed steps after WARMUP)
and `PARAMS <count>`.
"""

import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

backend = os.environ["BACKEND"]
if backend == "rally":
    import rallypoint.torch  # noqa: F401 - registers the backend
dist.init_process_group("gloo" if backend == "none" else backend)
rank = dist.get_rank()
width, layers = int(os.environ.get("WIDTH", "2048")), int(os.environ.get("LAYERS", "6"))
torch.manual_seed(0)
mods = []
for _ in range(layers):
    mods += [nn.Linear(width, width), nn.ReLU()]
# BUCKET_MB: DDP's bucket_cap_mb (default 25, torch's); BUCKET_VIEW=1:
# gradient_as_bucket_view (gradients live in the buckets: no copy in or out).
model = DDP(
    nn.Sequential(*mods[:-1]),
    bucket_cap_mb=float(os.environ.get("BUCKET_MB", "25")),
    gradient_as_bucket_view=os.environ.get("BUCKET_VIEW") == "1",
)
if backend == "none":

    def nothing(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    model.register_comm_hook(None, nothing)
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
x, y = torch.randn(8, width), torch.randn(8, width)
warmup, steps = int(os.environ.get("WARMUP", "3")), int(os.environ.get("STEPS", "10"))


def step():
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


for _ in range(warmup):
    step()
dist.barrier()
t0 = time.perf_counter()
for _ in range(steps):
    step()
dist.barrier()
elapsed = (time.perf_counter() - t0) / steps
# The slowest rank's time is the job's.
t = torch.tensor([elapsed], dtype=torch.float64)
dist.all_reduce(t, op=dist.ReduceOp.MAX)
if rank == 0:
    print(f"PARAMS {sum(p.numel() for p in model.parameters())}")
    print(f"RESULT {t.item()}", flush=True)
os._exit(0)
