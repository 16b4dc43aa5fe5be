"""A gloo worker: env:// rendezvous against the store at MASTER_ADDR:MASTER_PORT
(TORCHELASTIC_USE_AGENT_STORE=True, so every rank is a client), then a real
all_reduce and a barrier."""

import os

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method="env://")
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
expected = world * (world + 1) / 2
assert t.item() == expected, (t.item(), expected)
g = dist.new_group(list(range(world)))
t2 = torch.ones(3)
dist.all_reduce(t2, group=g)
assert t2.tolist() == [float(world)] * 3
dist.barrier()
dist.destroy_process_group()
print(f"rank {rank} OK sum={t.item()}", flush=True)
# The PyPI wheel sometimes aborts at exit after destroy_process_group.
os._exit(0)
