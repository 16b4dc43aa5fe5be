"""A small DDP training job over gloo, for `rally run` end-to-end tests.

Every rank trains the same tiny model on random data; DDP averages gradients, so
the parameters must be identical across ranks at the end (checked with an
all_gather). Knobs (environment):
  STEPS          training steps (default 20)
  STEP_SLEEP     seconds to sleep per step (default 0), to keep a job running
  KILL_RANK      global rank that SIGKILLs itself at step 3 of attempt 0
  RESULT_DIR     where each rank writes <rank>.json describing how it ended
  PROGRESS_DIR   where each rank writes <rank>.step, its last step done
  BACKEND        torch.distributed backend (default gloo; "rally" imports
                 rallypoint.torch, which registers it)
"""
import json
import os
import signal
import socket
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

BACKEND = os.environ.get("BACKEND", "gloo")
if BACKEND == "rally":
    import rallypoint.torch  # noqa: F401 - registers the backend
dist.init_process_group(BACKEND)
rank, world = dist.get_rank(), dist.get_world_size()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
steps = int(os.environ.get("STEPS", "20"))
kill_rank = os.environ.get("KILL_RANK")
for step in range(steps):
    torch.manual_seed(1000 * rank + step)
    x = torch.randn(16, 8)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if kill_rank is not None and int(kill_rank) == rank and attempt == 0 and step == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("PROGRESS_DIR"):
        with open(os.path.join(os.environ["PROGRESS_DIR"], f"{rank}.step"), "w") as f:
            f.write(str(step))
    time.sleep(float(os.environ.get("STEP_SLEEP", "0")))

w = torch.cat([p.detach().flatten() for p in model.parameters()])
everyone = [torch.zeros_like(w) for _ in range(world)]
dist.all_gather(everyone, w)
assert all(torch.equal(everyone[0], v) for v in everyone), "replicas diverged"
out = os.environ.get("RESULT_DIR")
if out:
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(
            {
                "rank": rank,
                "world_size": world,
                "attempt": attempt,
                "group_rank": int(os.environ["GROUP_RANK"]),
                "group_world_size": int(os.environ["GROUP_WORLD_SIZE"]),
                "loss": float(loss.detach()),
                "host": socket.gethostname(),
                "master_addr": os.environ["MASTER_ADDR"],
            },
            f,
        )
# Leave together, so no rank tears down connections another is still using.
dist.barrier()
dist.destroy_process_group()
