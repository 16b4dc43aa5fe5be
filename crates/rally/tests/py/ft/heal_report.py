"""A heal under torchft 0.2.0's own Manager and loop, reported to
``rally lighthouse`` (issue 47 §3: heal times in its status and metrics).

``ProcessGroupRally`` and ``RallyTransport`` under torchft's ``Manager``,
``DistributedDataParallel`` and ``OptimizerWrapper``, pointed at the
lighthouse in ``LIGHTHOUSE`` (``http://127.0.0.1:PORT``, started by
``crates/rally/tests/run/lighthouse.rs``). Replica 0 trains alone; once it
has committed two steps replica 1 starts (another seed), heals from replica 0
through ``RallyTransport`` (which reports the heal to the lighthouse's
``POST /v1/heal``), and both train on together for a few steps and end
normally.

Prints ``HEAL step S bytes B`` (B: the tensor bytes of replica 1's state
dict as torchft's Manager sends it, counted here from its own state at the
end, which has the same tensors as the state it received) and ``PASS``; the
Rust test then reads ``/status`` and ``/metrics``.

``python heal_report.py`` runs both replicas; ``... replica ID DIR`` is one.
"""

import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
from transport_common import Replica

TOGETHER = 3
LIMIT = 120.0


def net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def replica(rid: int, out: str) -> None:
    from torch.distributed import TCPStore
    from torch.utils._pytree import tree_leaves
    from torchft import Manager
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper

    from rallypoint.ft import ProcessGroupRally, RallyTransport

    lighthouse = os.environ["LIGHTHOUSE"]
    model = net(seed=100 + rid)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = None

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])
        print(f"HEALED {manager.current_step()}", flush=True)

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupRally(timeout=timedelta(seconds=10), lighthouse=lighthouse)
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"heal_{rid}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        hostname="127.0.0.1",
        timeout=timedelta(seconds=20),
        quorum_timeout=timedelta(seconds=60),
        checkpoint_transport=RallyTransport(timeout=timedelta(seconds=20)),
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = OptimizerWrapper(manager, inner)
    together = 0
    while together < TOGETHER:
        before = manager.current_step()
        optimizer.zero_grad()
        g = torch.Generator().manual_seed(1000 * rid + before)
        ddp(torch.randn(8, 32, generator=g)).pow(2).mean().backward()
        optimizer.step()
        step, n = manager.current_step(), manager.num_participants()
        if step == before:
            continue  # not committed
        print(f"COMMITTED {step} participants {n}", flush=True)
        together += n == 2
    sent = manager._manager_state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in tree_leaves(sent) if isinstance(t, torch.Tensor))
    print(f"STATE_BYTES {nbytes}", flush=True)
    manager.shutdown()
    pg.shutdown()



def torchfts_lighthouse_is_logged_once() -> None:
    """torchft's own lighthouse has no heal endpoint: the first report is
    logged once, the next is not even sent, and nothing raises."""
    import logging

    from torchft._torchft import LighthouseServer

    from rallypoint.ft import _report

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    url = f"http://127.0.0.1:{lh.address().rsplit(':', 1)[1]}"
    seen = []
    handler = logging.Handler()
    handler.emit = lambda r: seen.append(r.getMessage())
    logging.getLogger("rallypoint.ft._report").addHandler(handler)
    logging.getLogger("rallypoint.ft._report").setLevel(logging.INFO)
    for _ in range(2):
        _report.heal(url, "heal_9", 1, 10, 0.1, ["127.0.0.1:1"], None)
        assert _report.wait(10.0), "a report still on its way after 10 s"
    assert _report.last_outcome[url] == "no-endpoint", _report.last_outcome
    said = [m for m in seen if "has no heal endpoint" in m]
    assert len(said) == 1, seen
    lh.shutdown()
    print("torchft's lighthouse: no heal endpoint, logged once")


def main() -> None:
    torchfts_lighthouse_is_logged_once()
    deadline = time.monotonic() + LIMIT
    with tempfile.TemporaryDirectory() as out:
        r0 = Replica(__file__, 0, [out], out)
        try:
            r0.until("COMMITTED 2 ", deadline)
            r1 = Replica(__file__, 1, [out], out)
            try:
                healed = int(r1.until("HEALED", deadline).split()[1])
                r1.finish(deadline)
            finally:
                r1.proc.kill()
            r0.finish(deadline)
        finally:
            r0.proc.kill()
        print(f"HEAL step {healed} bytes {r1.value('STATE_BYTES')}")
    print("PASS")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "replica":
        replica(int(sys.argv[2]), sys.argv[3])
    else:
        main()
