"""A rank that used a torch.distributed backend and then ends as users' scripts
end: normally, through the interpreter's own exit (never ``os._exit``).

Run by ``crates/rally/tests/run/torch_exit.rs``, two ranks started by hand
(env://, torch's TCPStore on rank 0). Knobs (environment):
  BACKEND   rally (default) or gloo
  MODE      how the script ends:
            destroy    20 all_reduces, then destroy_process_group()
            keep       20 all_reduces, no destroy_process_group()
            error      20 all_reduces, then an uncaught exception (exit 1)
            inflight   8 async all_reduces on each rank, never waited for
            unmatched  rank 0 starts an all_reduce that rank 1 never joins;
                       rank 1 ends first, rank 0 then ends without waiting
            subgroups  ops on new_group()s (one of both ranks, one of each
                       rank alone), no destroy_process_group()

Each rank prints ``ended <rank>`` as its last line, so the test can tell the
script's end from the process's.
"""
import os
import sys

import torch
import torch.distributed as dist

BACKEND = os.environ.get("BACKEND", "rally")
MODE = os.environ["MODE"]
if BACKEND == "rally":
    import rallypoint.torch  # noqa: F401 - registers the backend

dist.init_process_group(BACKEND)
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.ones(1000)
for _ in range(20):
    dist.all_reduce(t)
assert t[0].item() == world**20, t[0].item()

if MODE == "destroy":
    dist.destroy_process_group()
elif MODE == "keep":
    pass
elif MODE == "error":
    print(f"ended {rank}", flush=True)
    raise RuntimeError("the training script failed on purpose")
elif MODE == "inflight":
    works = [dist.all_reduce(torch.ones(1 << 16), async_op=True) for _ in range(8)]
elif MODE == "unmatched":
    # Both ranks have done the same ops; now rank 0 starts one more, alone.
    dist.barrier()
    if rank == 0:
        pending = dist.all_reduce(torch.ones(1 << 10), async_op=True)
        # Rank 1 is gone (or going) once its store key is there.
        dist.distributed_c10d._get_default_store().wait(["left/1"])
else:
    assert MODE == "subgroups", MODE
    both = dist.new_group([0, 1])
    alone = [dist.new_group([r]) for r in range(world)]
    s = torch.ones(10)
    dist.all_reduce(s, group=both)
    assert s[0].item() == world
    one = torch.ones(10)
    dist.all_reduce(one, group=alone[rank])
    assert one[0].item() == 1
    dist.broadcast(s, src=1, group=both)

if MODE == "unmatched" and rank == 1:
    dist.distributed_c10d._get_default_store().set("left/1", "1")
print(f"ended {rank}", flush=True)
