"""One worker of a complete CPU training loop on ``rallypoint.ft`` alone (no
torchft): its ``Manager``, ``DistributedDataParallel``, ``Optimizer`` and
``DistributedSampler``, under the real replica group manager.

Each replica group starts from its own seed (``100 + group id``), so only the
Manager's ``init_sync`` (every replica takes the primary's state at the first
step) makes the groups train one model. The worker trains until its
manager's step reaches ``STEPS``, recording after every commit a digest of
its parameters, and writes one JSON object to ``RESULT_DIR/<group>.json``
(``<group>.<group rank>.json`` in a group of several processes):
``{"group", "initial", "digests": {step: sha256}, "commits",
"not_committed", "reasons", "heals", "steps_run", "losses"}``. It exits
normally.

The manager is found as the Manager finds it: ``RALLY_FT_MANAGER`` (under
``rally run --ft``), else group rank 0 starts one in-process from
``REPLICA_GROUP_ID`` / ``RALLY_FT_REPLICA_GROUP`` and the lighthouse
(``RALLY_FT_LIGHTHOUSE`` / ``TORCHFT_LIGHTHOUSE``).

Environment: ``RESULT_DIR``, ``STEPS`` (default 20), ``MIN_REPLICAS``
(default 2), ``NUM_REPLICA_GROUPS`` (default 2), ``FT_TIMEOUT`` (seconds,
default 30), ``END_BARRIER=1`` (the groups end together: :func:`end_barrier`).

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
import signal
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


def done(manager, steps: int, joint: int) -> bool:
    """The loop's end: ``STEPS`` reached and, with ``REJOIN_COMMITS``, that
    many steps committed by every group after a step with fewer."""
    return manager.current_step() >= steps and joint >= int(os.environ.get("REJOIN_COMMITS", "0"))


def train(manager, m, opt, sampler, loader, group: str, steps: int, groups: int):
    """The training loop: (digest after each commit by step, losses, joint
    commits after a drop, steps run). With ``KILL_GROUP``/``KILL_AT``, that
    group's first incarnation (``INCARNATION`` 0) SIGKILLs itself right after
    committing a step at or past ``KILL_AT`` that every group took part in
    (so the others see it go, whoever started first), or with
    ``KILL_WHERE=allreduce`` in the backward pass of such a step, as its
    gradient all_reduce is called (the survivors' all_reduce of that step
    then fails: it never sends)."""
    loss_fn = nn.CrossEntropyLoss()
    kill = os.environ.get("KILL_GROUP") == group and os.environ.get("INCARNATION", "0") == "0"
    kill_at = int(os.environ.get("KILL_AT", "-1"))
    if kill and os.environ.get("KILL_WHERE") == "allreduce":
        allreduce = manager.allreduce

        def dying(tensor, *args, **kwargs):
            if manager.current_step() >= kill_at and manager.num_participants() == groups:
                os.kill(os.getpid(), signal.SIGKILL)
            return allreduce(tensor, *args, **kwargs)

        manager.allreduce = dying
        kill = False
    digests, losses, run, epoch = {}, [], 0, 0
    joint, dropped = 0, False
    while not done(manager, steps, joint):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            if done(manager, steps, joint):
                break
            before = manager.current_step()
            opt.zero_grad()
            loss = loss_fn(m(xb), yb)
            loss.backward()
            opt.step()
            run += 1
            if manager.current_step() > before:
                digests[manager.current_step()] = digest(m.module)
                losses.append(float(loss))
                if manager.num_participants() < groups:
                    dropped, joint = True, 0
                elif dropped:
                    joint += 1
                if kill and manager.current_step() >= kill_at and manager.num_participants() == groups:
                    os.kill(os.getpid(), signal.SIGKILL)
        epoch += 1
    return digests, losses, joint, run


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
    rank, width = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    sampler = ft.DistributedSampler(data, replica_rank=int(group), num_replica_groups=groups, group_rank=rank, num_replicas=width, shuffle=True, seed=1)
    loader = DataLoader(data, batch_size=32, sampler=sampler)

    manager = ft.Manager(
        min_replicas=int(os.environ.get("MIN_REPLICAS", "2")),
        state={"model": model, "optim": inner},
        timeout=timedelta(seconds=float(os.environ.get("FT_TIMEOUT", "30"))),
        use_async_quorum=os.environ.get("SYNC_QUORUM") != "1",
    )
    m = ft.DistributedDataParallel(manager, model)
    opt = ft.Optimizer(manager, inner)

    digests, losses, joint, run = train(manager, m, opt, sampler, loader, group, steps, groups)
    if os.environ.get("END_BARRIER") == "1":
        end_barrier(f"{group}.{rank}", groups * width)
    result = {
        "group": group,
        "initial": initial,
        "digests": digests,
        "commits": len(digests),
        "not_committed": manager.not_committed,
        "reasons": manager.reasons,
        "heals": manager.heals,
        "steps_run": run,
        "joint": joint,
        "losses": losses,
        "torchft_imported": any(k == "torchft" or k.startswith("torchft.") for k in sys.modules),
        "manager_status": manager.group_manager_status(),
        "width": width,
    }
    manager.shutdown()
    name = f"{group}.json" if width == 1 else f"{group}.{rank}.json"
    with open(os.path.join(os.environ["RESULT_DIR"], name), "w") as f:
        json.dump(result, f)
    print(f"manager_loop: group {group} done: {len(digests)} commits in {run} steps", flush=True)


def end_barrier(me: str, everyone: int, deadline: float = 120.0) -> None:
    """Stays in the quorum until every worker of every group has trained
    its steps (``RESULT_DIR/*.trained``), as a job's groups end together: a
    group that left right after its last commit would abort the others'
    last step in flight (the lighthouse drops it), and under
    ``min_replicas=2`` they would then wait for a quorum for ever."""
    d = os.environ["RESULT_DIR"]
    open(os.path.join(d, f"{me}.trained"), "w").close()
    end = time.monotonic() + deadline
    while sum(f.endswith(".trained") for f in os.listdir(d)) < everyone:
        if time.monotonic() > end:
            raise SystemExit(f"manager_loop: {me}: the other groups did not finish within {deadline} s")
        time.sleep(0.05)


def summary(r: dict) -> dict:
    """What an assertion shows of a worker's result."""
    return {k: r[k] for k in ("group", "commits", "not_committed", "reasons", "heals", "joint", "steps_run")}


def check(results: list, steps: int) -> None:
    """Every group committed every step and none other, from different
    initial parameters to bitwise-equal ones after each step, with one heal
    in all (init_sync at the first step), and never imported torchft."""
    initial = {r["initial"] for r in results}
    assert len(initial) == len(results), f"the seeds gave equal models: init_sync is untested: {initial}"
    for r in results:
        assert r["commits"] == steps and r["not_committed"] == 0, f"{summary(r)}"
        assert not r["torchft_imported"], f"group {r['group']} imported torchft"
        assert r["digests"] == results[0]["digests"], f"groups {results[0]['group']} and {r['group']} differ after some step"
    heals = sum(r["heals"] for r in results)
    assert heals == len(results) - 1, f"init_sync: every replica but one heals once at the first step; {heals} heals"
    for r in results:
        st = r["manager_status"]
        if st is None or r["width"] > 1:
            continue  # the agent's manager (rally run --ft), or a group's (drive_wide checks it)
        # What the group's manager counted: the commits, and the heal this
        # worker reported to it (contract op 4).
        assert st["commits"] == steps and st["heals"] == r["heals"], f"group {r['group']}'s manager counted {st}"
        assert (st["heal_bytes"] > 0) == (r["heals"] > 0), f"group {r['group']}'s manager counted {st}"


def _spawn(d: str, url: str, group: int, incarnation: int, env: dict, rank: int = 0, width: int = 1, store_port: int = 0):
    env = dict(os.environ, **env, RESULT_DIR=d, REPLICA_GROUP_ID=str(group), TORCHFT_LIGHTHOUSE=url, RANK=str(rank), WORLD_SIZE=str(width))
    env["INCARNATION"] = str(incarnation)
    env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", str(store_port)
    env.pop("RALLY_FT_MANAGER", None)
    log = open(os.path.join(d, f"group{group}.{rank}.{incarnation}.log"), "w")
    return subprocess.Popen([sys.executable, __file__], env=env, stdout=log, stderr=subprocess.STDOUT), log


def _logs(d: str) -> str:
    return "\n".join(f"---- {n}\n" + open(os.path.join(d, n)).read()[-6000:] for n in sorted(os.listdir(d)) if n.endswith(".log"))


def _wait(procs, deadline: float, d: str) -> list:
    """Each process's exit code, killing them all at the deadline."""
    codes = []
    for p, log in procs:
        try:
            codes.append(p.wait(timeout=max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
                q.wait()
            codes.append("timeout")
        log.close()
    return codes


def drive(scenario: str) -> None:
    """The whole test without rally run (module doc). ``plain``: every
    group from the start. ``kill``: group 1 SIGKILLs itself after
    committing a step from 5 on that both groups took part in; group 0
    keeps committing alone (MIN_REPLICAS 1); group 1 is started again, heals
    from group 0 and both commit 5 steps together with bitwise-equal
    parameters. ``kill-allreduce``: the same, group 1 dying as it calls its
    gradient all_reduce: the survivor's step is not committed (its error
    never raises) and it goes on. ``kill-min2``: ``kill`` with the workers'
    ``min_replicas=2`` (the lighthouse's 1): the survivor commits nothing
    alone, and the restarted group's heal, with one replica up to date and
    one healing, must commit."""
    from torchft.coordination import LighthouseServer

    groups = int(os.environ.get("NUM_REPLICA_GROUPS", "2"))
    steps = int(os.environ.get("STEPS", "20"))
    deadline = time.monotonic() + float(os.environ.get("DRIVE_LIMIT_S", "240"))
    if scenario == "wide":
        return drive_wide(groups, steps, deadline)
    if scenario == "retries":
        return drive_retries()
    if scenario == "sync":
        os.environ["SYNC_QUORUM"] = "1"
    kill = scenario in ("kill", "kill-allreduce", "kill-min2")
    env = {"MIN_REPLICAS": "1", "REJOIN_COMMITS": "5", "KILL_GROUP": "1", "KILL_AT": "5"} if kill else {}
    if scenario == "kill-min2":
        env["MIN_REPLICAS"] = "2"
    if scenario == "kill-allreduce":
        env["KILL_WHERE"] = "allreduce"
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1 if kill else groups, join_timeout_ms=60000, heartbeat_timeout_ms=1000)
    url = "http://127.0.0.1:" + lh.address().rsplit(":", 1)[1]
    with tempfile.TemporaryDirectory() as d:
        procs = [_spawn(d, url, g, 0, env) for g in range(groups)]
        if kill:
            killed = _wait(procs[1:2], deadline, d)
            assert killed == [-signal.SIGKILL], f"group 1 did not kill itself: {killed}\n{_logs(d)}"
            procs[1] = _spawn(d, url, 1, 1, env)
        codes = _wait(procs, deadline, d)
        assert codes == [0] * groups, f"workers ended with {codes}\n{_logs(d)}"
        results = [json.load(open(os.path.join(d, f"{g}.json"))) for g in range(groups)]
    lh.shutdown()
    if kill:
        check_rejoin(results, steps)
        if scenario in ("kill-allreduce", "kill-min2"):
            assert results[0]["not_committed"] >= 1, f"the survivor committed a step alone or the step its peer died in: {summary(results[0])}"
    else:
        check(results, steps)
    print(f"drive {scenario}: {[summary(r) for r in results]}")


def drive_wide(groups: int, steps: int, deadline: float) -> None:
    """``wide``: replica groups of 2 processes each (a group's store hosted
    here, as torchrun's agent would): group rank 0 starts the manager and
    publishes its address in the store, rank 1 reads it; each group rank
    trains its own lane, averaged with the same group rank of the other
    groups, so per group rank the groups end bitwise equal."""
    from torch.distributed import TCPStore
    from torchft.coordination import LighthouseServer

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=groups, join_timeout_ms=60000)
    url = "http://127.0.0.1:" + lh.address().rsplit(":", 1)[1]
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)) for _ in range(groups)]
    with tempfile.TemporaryDirectory() as d:
        procs = [_spawn(d, url, g, 0, {}, rank=r, width=2, store_port=stores[g].port) for g in range(groups) for r in range(2)]
        codes = _wait(procs, deadline, d)
        assert codes == [0] * len(procs), f"workers ended with {codes}\n{_logs(d)}"
        results = [[json.load(open(os.path.join(d, f"{g}.{r}.json"))) for r in range(2)] for g in range(groups)]
    for r in range(2):
        check([results[g][r] for g in range(groups)], steps)
    for g in range(groups):
        # Group rank 0 runs the group's manager, which counted every rank's
        # heal (init_sync picks the primary per group rank: each group may heal
        # in some lanes).
        st, heals = results[g][0]["manager_status"], sum(x["heals"] for x in results[g])
        assert st["commits"] == steps and st["heals"] == heals and (st["heal_bytes"] > 0) == (heals > 0), f"group {g}: {heals} heals, its manager counted {st}"
    lh.shutdown()
    print(f"drive wide: {groups} groups x 2 processes, {steps} steps each")


def drive_retries() -> None:
    """``retries``, in this process: one replica group under a lighthouse
    that forms quorums of one, with ``min_replicas=2``: no step commits, the
    parameters never change, each step's reason is counted (logged once) and
    reported to the group's manager, and the step after ``max_retries``
    failures in a row raises, naming it (torchft's rule)."""
    import rallypoint.ft as ft
    from torchft.coordination import LighthouseServer

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    url = "http://127.0.0.1:" + lh.address().rsplit(":", 1)[1]
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    manager = ft.Manager(min_replicas=2, state={"model": model}, replica_group="solo", lighthouse=url, max_retries=2, group_rank=0, group_world_size=1, timeout=10)
    m = ft.DistributedDataParallel(manager, model)
    opt = ft.Optimizer(manager, torch.optim.SGD(model.parameters(), lr=0.1))
    before = digest(model)
    raised = None
    for _ in range(4):
        opt.zero_grad()
        m(torch.randn(8, 4)).sum().backward()
        try:
            opt.step()
        except RuntimeError as e:
            raised = str(e)
            break
    st = manager.group_manager_status()
    manager.shutdown()
    lh.shutdown()
    assert raised is not None and "max_retries=2" in raised and "fewer than min_replicas=2" in raised, f"{raised}"
    assert manager.not_committed == 3 and manager.current_step() == 0, f"{manager.not_committed} {manager.current_step()}"
    assert list(manager.reasons.values()) == [3], f"one reason, three times: {manager.reasons}"
    assert digest(model) == before, "a step not committed changed the parameters"
    assert st["not_committed"] == 3 and "min_replicas=2" in (st["last_not_committed_reason"] or ""), f"the manager counted {st}"
    print(f"drive retries: raised {raised!r}")


def check_rejoin(results: list, steps: int) -> None:
    """The survivor committed past ``steps`` and ended with 5 joint commits;
    the restarted group healed and its parameters equal the survivor's
    after every step it committed."""
    survivor, back = results
    for r in results:
        assert not r["torchft_imported"], f"group {r['group']} imported torchft"
        assert r["joint"] >= 5, f"{summary(r)}: fewer than 5 joint commits after the drop"
    assert survivor["commits"] >= steps, f"the survivor: {summary(survivor)}"
    assert back["heals"] >= 1, f"the restarted group never healed: {summary(back)}"
    assert back["digests"], "the restarted group committed nothing"
    for step, h in back["digests"].items():
        assert survivor["digests"].get(step) == h, f"step {step}: the restarted group's parameters differ from the survivor's"


if __name__ == "__main__":
    if sys.argv[1:2] == ["drive"]:
        scenario = sys.argv[2] if len(sys.argv) > 2 else "plain"
        drive(scenario)
        print(f"PASS drive {scenario}")
    else:
        main()
