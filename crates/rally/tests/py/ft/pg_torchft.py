"""One replica group (one process) of torchft's own loop, as its
``train_ddp.py`` sets it up on CPU: torchft's ``Manager``,
``DistributedDataParallel``, ``Optimizer`` and ``PGTransport``, unchanged,
over ``ProcessGroupRally`` (PG=rally) or torchft's ``ProcessGroupGloo``
(PG=gloo); a small ``nn.Linear`` model; its own TCPStore at MASTER_PORT
(is_master here, as torchrun would provide it).

Knobs (environment):
  REPLICA        this replica's number (0, 1)
  REPLICAS       how many replicas the run has (all wait for each other
                 before the first step, through the coordination store)
  TORCHFT_LIGHTHOUSE, COORD_PORT   the lighthouse and the test's TCPStore
  STEPS          stop once this many steps are committed (and, when a kill
                 is expected, AFTER_KILL more after it)
  KILL_AT        the victim's first all_reduce at a step >= KILL_AT: it
                 waits until the other replica's all_reduce of that step has
                 started, then SIGKILLs itself from inside its allreduce call
                 (never sending its part); -1: nobody dies
                 -2: the victim dies on entering its first configure of a
                 quorum of both (the survivor's configure waits for it);
                 each step waits for its quorum before backward
  VICTIM         1 on the replica that dies
  HOW            kill (SIGKILL, default) or stop (SIGSTOP: it hangs there
                 until the test kills it)
  PG_TIMEOUT     the group's timeout in seconds (torchft's example: 5)

Writes ``RESULT_DIR/<replica>.json``: every step it tried (step, committed,
wall time, participants), the parameters' bytes (hex), and, on the
survivor, the time from the kill to its next commit. Ends normally.
"""

import json
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torchft import DistributedDataParallel, Manager, Optimizer
from torchft.checkpointing.pg_transport import PGTransport
from torchft.process_group import ProcessGroupGloo

from rallypoint.ft import ProcessGroupRally

REPLICA = int(os.environ["REPLICA"])
REPLICAS = int(os.environ.get("REPLICAS", "2"))
OUT = os.environ["RESULT_DIR"]
STEPS = int(os.environ.get("STEPS", "10"))
KILL_AT = int(os.environ.get("KILL_AT", "-1"))
VICTIM = os.environ.get("VICTIM") == "1"
STOP = os.environ.get("HOW") == "stop"
AFTER_KILL = int(os.environ.get("AFTER_KILL", "3"))
PG = os.environ.get("PG", "rally")
TIMEOUT = timedelta(seconds=float(os.environ.get("PG_TIMEOUT", "5")))
DEADLINE = time.monotonic() + float(os.environ.get("RUN_DEADLINE", "60"))
WAIT = timedelta(seconds=60)

own_store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 1, is_master=True, wait_for_workers=False)
coord = dist.TCPStore("127.0.0.1", int(os.environ["COORD_PORT"]), is_master=False, wait_for_workers=False, timeout=WAIT)
manager = None


def kill_hook(base):
    """``base`` whose allreduce can kill this process (the victim) or mark
    that this replica's op of a step has started (the survivor)."""

    class Hooked(base):
        def allreduce(self, tensors, opts):
            step = manager.current_step() if manager is not None else -1
            if KILL_AT < 0 or step < KILL_AT or coord.check(["killed_at"]):
                return super().allreduce(tensors, opts)
            if VICTIM:
                coord.wait([f"started/{step}"], WAIT)
                coord.set("killed_at", repr(time.time()))
                coord.set("killed_step", str(step))
                os.kill(os.getpid(), signal.SIGSTOP if STOP else signal.SIGKILL)
            work = super().allreduce(tensors, opts)
            coord.set(f"started/{step}", "1")
            return work

        def configure(self, store_addr, replica_id, rank, world_size, *args, **kwargs):
            # KILL_AT == -2: the victim dies on entering its first configure
            # of a quorum of both replicas (it never joins that generation).
            if KILL_AT == -2 and VICTIM and world_size == 2:
                step = manager.current_step()
                coord.set("killed_at", repr(time.time()))
                coord.set("killed_step", str(step))
                os.kill(os.getpid(), signal.SIGKILL)
            return super().configure(store_addr, replica_id, rank, world_size, *args, **kwargs)

    return Hooked


torch.manual_seed(0)
model = nn.Linear(8, 4)
inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

if PG == "rally":
    pg = kill_hook(ProcessGroupRally)(timeout=TIMEOUT)
else:
    pg = kill_hook(ProcessGroupGloo)(timeout=TIMEOUT)


def state_dict():
    return {"model": model.state_dict(), "optim": inner.state_dict()}


def load_state_dict(sd):
    model.load_state_dict(sd["model"])
    inner.load_state_dict(sd["optim"])


manager = Manager(
    pg=pg,
    min_replica_size=1,
    load_state_dict=load_state_dict,
    state_dict=state_dict,
    replica_id=f"pg_torchft_{REPLICA}",
    timeout=timedelta(seconds=10),
    quorum_timeout=timedelta(seconds=30),
    checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu")),
    hostname="127.0.0.1",
    rank=0,
    world_size=1,
    store_addr="127.0.0.1",
    store_port=int(os.environ["MASTER_PORT"]),
)
m = DistributedDataParallel(manager, model)
opt = Optimizer(manager, inner)

# Every replica is up (its Manager heartbeats) before the first step.
if coord.add("ready", 1) == REPLICAS:
    coord.set("ready/all", "1")
coord.wait(["ready/all"], WAIT)

steps = []
after_kill = 0
while time.monotonic() < DEADLINE:
    opt.zero_grad()
    step = manager.current_step()
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    loss = ((m(x) - y) ** 2).mean()
    if KILL_AT == -2:
        # As a loop whose forward outlasts the quorum: the configure has
        # ended (or failed) before backward's all_reduce starts.
        manager.wait_quorum()
    loss.backward()
    opt.step()
    committed = manager.current_step() > step
    err = manager.errored()
    steps.append(
        {
            "step": step,
            "committed": committed,
            "t": time.time(),
            "participants": manager.num_participants(),
            "error": str(err.original_exception) if err is not None else None,
        }
    )
    killed = coord.check(["killed_at"])
    if committed and killed:
        after_kill += 1
    if manager.current_step() >= STEPS and (KILL_AT == -1 or after_kill >= AFTER_KILL):
        break

result = {
    "replica": REPLICA,
    "pg": PG,
    "steps": steps,
    "final_step": manager.current_step(),
    "params": [p.detach().contiguous().numpy().tobytes().hex() for p in model.parameters()],
    "errored": str(pg.errored()) if hasattr(pg, "errored") else None,
}
if KILL_AT != -1 and coord.check(["killed_at"]):
    t_kill = float(coord.get("killed_at"))
    result["killed_step"] = int(coord.get("killed_step"))
    later = [s for s in steps if s["committed"] and s["t"] > t_kill]
    if later:
        result["kill_to_commit_ms"] = (later[0]["t"] - t_kill) * 1000
# Every replica has its results before any shuts its manager down.
path = os.path.join(OUT, f"{REPLICA}.json")
with open(path + ".tmp", "w") as f:
    json.dump(result, f)
os.rename(path + ".tmp", path)
manager.shutdown(wait=False)
print(f"ended {REPLICA}", flush=True)
