"""One replica group (one process) of a tiny torchft 0.2.0 training loop, as
torchft's own `train_ddp.py` sets it up on CPU (its Manager, ProcessGroupGloo
with a 5 s timeout, PGTransport, its DistributedDataParallel and Optimizer
wrappers), pointed at a lighthouse by TORCHFT_LIGHTHOUSE. Run by
crates/rally/tests/run/lighthouse.rs against `rally lighthouse`.

Environment:
  REPLICA      this group's number (its replica id is lighthouse_loop_<n>)
  MASTER_PORT  set here: the port of this group's own TCPStore, which this
               script serves on a port the OS picks (a port picked for it by
               the test could be taken before it binds: EADDRINUSE, seen in a
               full run), for torchft's Manager to read
  STEPS        run until the manager's step reaches this, then exit normally
  PAUSE_AT     optional: after committing this step, write the line and wait
               (the test SIGKILLs the process there, between steps)
  RESULT       a file to append one JSON line to per committed step
  LH_STATUS    the lighthouse's /status URL: the loop starts once REPLICAS
               replicas are healthy there, so that the first quorum has them all
  REPLICAS     how many replicas to wait for before the first step
"""

import json
import os
import signal
import time
import urllib.request
from datetime import timedelta

import torch
from torch import nn
from torch.distributed import TCPStore
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport

START_LIMIT_S = 30.0


def wait_for_replicas(url: str, n: int) -> None:
    """Polls the lighthouse's /status until n replicas are healthy."""
    deadline = time.monotonic() + START_LIMIT_S
    seen = None
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url, timeout=5) as r:
            seen = json.load(r)["healthy"]
        if len(seen) >= n:
            return
        time.sleep(0.02)
    raise TimeoutError(f"{n} replicas never became healthy within {START_LIMIT_S} s: only {seen}")


def main() -> None:
    replica = int(os.environ["REPLICA"])
    steps = int(os.environ["STEPS"])
    pause_at = int(os.environ.get("PAUSE_AT", "-1"))
    # The group's own store, which torchft's Manager joins as a client.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ["MASTER_PORT"] = str(store.port)

    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"lighthouse_loop_{replica}",
        timeout=timedelta(seconds=10),
        rank=0,
        world_size=1,
        hostname="127.0.0.1",
        checkpoint_transport=PGTransport(
            pg, timeout=timedelta(seconds=10), device=torch.device("cpu")
        ),
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    wait_for_replicas(os.environ["LH_STATUS"], int(os.environ["REPLICAS"]))

    g = torch.Generator().manual_seed(replica)
    with open(os.environ["RESULT"], "a", buffering=1) as out:
        while manager.current_step() < steps:
            x = torch.randn(16, 8, generator=g)
            optimizer.zero_grad()
            loss = ddp(x).pow(2).mean()
            loss.backward()
            before = manager.current_step()
            optimizer.step()
            step = manager.current_step()
            if step == before:
                continue  # not committed (an error this step); the next quorum goes on
            out.write(
                json.dumps(
                    {
                        "replica": replica,
                        "step": step,
                        "t": time.time(),
                        "participants": manager.num_participants(),
                    }
                )
                + "\n"
            )
            if step == pause_at:
                # Between steps: wait for the test's SIGKILL.
                signal.pause()
    manager.shutdown(wait=False)
    del store


if __name__ == "__main__":
    main()
