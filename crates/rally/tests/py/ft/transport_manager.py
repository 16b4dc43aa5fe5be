"""RallyTransport under torchft 0.2.0's own Manager, training loop and
lighthouse, on loopback: replica 0 trains alone; once it has committed two
steps replica 1 starts (another seed, so its weights differ), heals from
replica 0 through RallyTransport, and both train on together.

Checked: replica 1's state right after healing (model and AdamW state) is
bitwise replica 0's at the same step; at every later step both replicas'
states are bitwise equal; replica 0 served the bytes through RallyTransport;
both runs end normally. Prints ``HEAL_TIME`` (replica 1's Manager ready ->
its first committed step) and ``PASS``.

``python transport_manager.py`` runs the whole thing (lighthouse in this
process, replicas as subprocesses); ``... replica ID LIGHTHOUSE DIR`` is one
replica.
"""

import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
from transport_common import Replica

# Enough two-replica steps to see them agree after healing.
TOGETHER = 3
LIMIT = 120.0


def net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def replica(rid: int, lighthouse: str, out: str) -> None:
    from torch.distributed import TCPStore
    from torchft import Manager
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    from rallypoint.ft import RallyTransport

    model = net(seed=100 + rid)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = None

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])
        torch.save(state_dict(), os.path.join(out, f"r{rid}_healed_{manager.current_step()}.pt"))
        print(f"HEALED {manager.current_step()}", flush=True)

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    transport = RallyTransport(timeout=timedelta(seconds=20))
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=20)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"transport_{rid}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        hostname="127.0.0.1",
        timeout=timedelta(seconds=20),
        quorum_timeout=timedelta(seconds=60),
        checkpoint_transport=transport,
    )
    ready = time.perf_counter()
    ddp = DistributedDataParallel(manager, model)
    optimizer = OptimizerWrapper(manager, inner)
    together, first = 0, None
    while together < TOGETHER:
        before = manager.current_step()
        optimizer.zero_grad()
        g = torch.Generator().manual_seed(1000 * rid + before)
        ddp(torch.randn(8, 32, generator=g)).pow(2).mean().backward()
        optimizer.step()
        step, n = manager.current_step(), manager.num_participants()
        if step == before:
            continue  # not committed
        first = first or time.perf_counter()
        torch.save(state_dict(), os.path.join(out, f"r{rid}_{step}.pt"))
        print(f"COMMITTED {step} participants {n}", flush=True)
        together += n == 2
    if rid == 1:
        print(f"HEAL_TIME {first - ready:.4f}", flush=True)
    served = transport._server.served if transport._server else 0
    print(f"SERVED {served}", flush=True)
    manager.shutdown()


def bitwise_equal(a: dict, b: dict, what: str) -> None:
    from torch.utils._pytree import keystr, tree_flatten_with_path

    la, lb = tree_flatten_with_path(a)[0], tree_flatten_with_path(b)[0]
    assert [keystr(k) for k, _ in la] == [keystr(k) for k, _ in lb], f"{what}: different keys"
    for (k, x), (_, y) in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, f"{what}: {keystr(k)}"
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), f"{what}: {keystr(k)} differs"
        else:
            assert x == y, f"{what}: {keystr(k)}: {x} != {y}"



def main() -> None:
    from torchft._torchft import LighthouseServer

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=50, heartbeat_timeout_ms=2000)
    # address() names the hostname; the lighthouse listens on loopback only
    address = f"http://127.0.0.1:{lh.address().rsplit(':', 1)[1]}"
    deadline = time.monotonic() + LIMIT
    with tempfile.TemporaryDirectory() as out:
        r0 = Replica(__file__, 0, [address, out], out)
        try:
            r0.until("COMMITTED 2 ", deadline)
            r1 = Replica(__file__, 1, [address, out], out)
            try:
                healed = int(r1.until("HEALED", deadline).split()[1])
                r1.finish(deadline)
            finally:
                r1.proc.kill()
            r0.finish(deadline)
        finally:
            r0.proc.kill()
        load = lambda name: torch.load(os.path.join(out, name), weights_only=True)
        assert not torch.equal(net(100)[0].weight, net(101)[0].weight)  # healing had something to do
        bitwise_equal(load(f"r0_{healed}.pt"), load(f"r1_healed_{healed}.pt"), f"replica 1 healed at step {healed}")
        later = sorted(int(f[3:-3]) for f in os.listdir(out) if f.startswith("r1_") and f[3:-3].isdigit())
        assert later and later[0] == healed + 1, later
        for s in later:
            bitwise_equal(load(f"r0_{s}.pt"), load(f"r1_{s}.pt"), f"step {s}")
        served = int(r0.value("SERVED"))
        assert served > 0, "replica 0 served nothing through RallyTransport"
        print(f"healed at step {healed}; steps {later} bitwise equal on both replicas; {served} bytes served")
        print(f"HEAL_TIME {r1.value('HEAL_TIME')}")
    lh.shutdown()
    print("PASS")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "replica":
        replica(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        main()
