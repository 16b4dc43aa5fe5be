"""One worker of a complete CPU training loop on ``rallypoint.ft`` alone (no
torchft): its ``Manager``, ``DistributedDataParallel``, ``Optimizer`` and
``DistributedSampler``, under the real replica group manager.

Each replica group starts from its own seed (``100 + group id``), so only the
Manager's ``init_sync`` (every replica takes the primary's state at the first
step) makes the groups train one model. The worker trains until its
manager's step reaches ``STEPS``, recording after every commit a digest of
its parameters, and writes one JSON object to ``RESULT_DIR/<group>.json``:
``{"group", "initial", "digests": {step: sha256}, "commits",
"not_committed", "reasons", "heals", "steps_run", "losses"}``. It exits
normally.

The manager is found as the Manager finds it: ``RALLY_FT_MANAGER`` (under
``rally run --ft``), else group rank 0 starts one in-process from
``REPLICA_GROUP_ID`` / ``RALLY_FT_REPLICA_GROUP`` and the lighthouse
(``RALLY_FT_LIGHTHOUSE`` / ``TORCHFT_LIGHTHOUSE``).

Environment: ``RESULT_DIR``, ``STEPS`` (default 20), ``MIN_REPLICAS``
(default 2), ``NUM_REPLICA_GROUPS`` (default 2), ``FT_TIMEOUT`` (seconds,
default 30).

``python manager_loop.py drive`` runs the whole test without ``rally run``:
torchft's own lighthouse (``torchft.coordination.LighthouseServer``, in the
driver only), and ``NUM_REPLICA_GROUPS`` workers of one process each, each
starting its group's manager in-process (``_native.FtManager``); it checks
what :func:`check` says and prints ``PASS drive``. The workers run with
torchft made unimportable.
"""

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def group_id() -> str:
    for var in ("RALLY_FT_REPLICA_GROUP", "REPLICA_GROUP_ID"):
        if os.environ.get(var):
            return os.environ[var]
    raise SystemExit("manager_loop.py: no RALLY_FT_REPLICA_GROUP nor REPLICA_GROUP_ID")


class _NoTorchft:
    """Makes torchft unimportable in a worker: the loop must not need it."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchft" or name.startswith("torchft."):
            raise ImportError(f"manager_loop.py hides torchft ({name})")
        return None


def main() -> None:
    sys.meta_path.insert(0, _NoTorchft())
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import rallypoint.ft as ft

    group = group_id()
    steps = int(os.environ.get("STEPS", "20"))
    groups = int(os.environ.get("NUM_REPLICA_GROUPS", "2"))
    torch.manual_seed(100 + int(group))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    initial = digest(model)

    # The same data on every group (seed 0), sharded by group.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=g)
    y = (x[:, :4].sum(dim=1) > 0).long() + 2 * (x[:, 4:8].sum(dim=1) > 0).long()
    data = TensorDataset(x, y)
    sampler = ft.DistributedSampler(data, replica_rank=int(group), num_replica_groups=groups, shuffle=True, seed=1)
    loader = DataLoader(data, batch_size=32, sampler=sampler)

    manager = ft.Manager(
        min_replicas=int(os.environ.get("MIN_REPLICAS", "2")),
        state={"model": model, "optim": inner},
        timeout=timedelta(seconds=float(os.environ.get("FT_TIMEOUT", "30"))),
    )
    m = ft.DistributedDataParallel(manager, model)
    opt = ft.Optimizer(manager, inner)
    loss_fn = nn.CrossEntropyLoss()

    digests, losses, run = {}, [], 0
    epoch = 0
    while manager.current_step() < steps:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            if manager.current_step() >= steps:
                break
            before = manager.current_step()
            opt.zero_grad()
            loss = loss_fn(m(xb), yb)
            loss.backward()
            opt.step()
            run += 1
            if manager.current_step() > before:
                digests[manager.current_step()] = digest(model)
                losses.append(float(loss))
        epoch += 1
    result = {
        "group": group,
        "initial": initial,
        "digests": digests,
        "commits": len(digests),
        "not_committed": manager.not_committed,
        "reasons": manager.reasons,
        "heals": manager.heals,
        "steps_run": run,
        "losses": losses,
        "torchft_imported": any(k == "torchft" or k.startswith("torchft.") for k in sys.modules),
    }
    manager.shutdown()
    with open(os.path.join(os.environ["RESULT_DIR"], f"{group}.json"), "w") as f:
        json.dump(result, f)
    print(f"manager_loop: group {group} done: {len(digests)} commits in {run} steps", flush=True)


def check(results: list, steps: int) -> None:
    """Every group committed every step and none other, from different
    initial parameters to bitwise-equal ones after each step, with one heal
    in all (init_sync at the first step), and never imported torchft."""
    initial = {r["initial"] for r in results}
    assert len(initial) == len(results), f"the seeds gave equal models: init_sync is untested: {initial}"
    for r in results:
        assert r["commits"] == steps and r["not_committed"] == 0, f"group {r['group']}: {r['commits']} commits, {r['not_committed']} not committed: {r['reasons']}"
        assert not r["torchft_imported"], f"group {r['group']} imported torchft"
        assert r["digests"] == results[0]["digests"], f"groups {results[0]['group']} and {r['group']} differ after some step"
    heals = sum(r["heals"] for r in results)
    assert heals == len(results) - 1, f"init_sync: every replica but one heals once at the first step; {heals} heals"


def drive() -> None:
    """The whole test without rally run (module doc)."""
    from torchft.coordination import LighthouseServer

    groups = int(os.environ.get("NUM_REPLICA_GROUPS", "2"))
    steps = int(os.environ.get("STEPS", "20"))
    limit = float(os.environ.get("DRIVE_LIMIT_S", "240"))
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=groups, join_timeout_ms=60000)
    url = "http://127.0.0.1:" + lh.address().rsplit(":", 1)[1]
    with tempfile.TemporaryDirectory() as d:
        procs = []
        for g in range(groups):
            env = dict(os.environ, RESULT_DIR=d, REPLICA_GROUP_ID=str(g), TORCHFT_LIGHTHOUSE=url, RANK="0", WORLD_SIZE="1")
            env.pop("RALLY_FT_MANAGER", None)
            log = open(os.path.join(d, f"group{g}.log"), "w")
            procs.append((subprocess.Popen([sys.executable, __file__], env=env, stdout=log, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + limit
        codes = []
        for p, log in procs:
            try:
                codes.append(p.wait(timeout=max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                for q, _ in procs:
                    q.kill()
                codes.append("timeout")
            log.close()
        logs = "\n".join(f"---- group {g}\n" + open(os.path.join(d, f"group{g}.log")).read()[-6000:] for g in range(groups))
        assert codes == [0] * groups, f"workers ended with {codes} (limit {limit:g} s)\n{logs}"
        results = [json.load(open(os.path.join(d, f"{g}.json"))) for g in range(groups)]
    lh.shutdown()
    check(results, steps)
    first_loss, last_loss = results[0]["losses"][0], results[0]["losses"][-1]
    print(f"drive: {groups} groups x {steps} steps, loss {first_loss:.3f} -> {last_loss:.3f}")


if __name__ == "__main__":
    if sys.argv[1:] == ["drive"]:
        drive()
        print("PASS drive")
    else:
        main()
