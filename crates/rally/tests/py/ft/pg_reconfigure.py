"""The ``rally`` backend's torch 2.15 reconfigure API (``dist._supports_reconfigure``,
``_get_reconfigure_handle``, ``_reconfigure``) under real torch, 3 processes
(env://, torch's TCPStore on rank 0), the group made with
``init_process_group("rally", enable_reconfigure=True)``:

- before any reconfigure the group has no members: an op says so;
- 2 members (ranks 0 and 1, a list: ranks by position), then 3 (a set: the
  backend orders it), then 2 again in reversed order; each checked with
  all_reduce and all_gather of who is where;
- bad input: a reused uuid, handles without this rank's, a handle of
  another store: each refused, the group still usable;
- a reconfigure with an op in flight fails that op (aborted).

Each rank writes ``RESULT_DIR/<rank>.json`` (``checks`` by section) and
ends normally after destroy_process_group.
"""

import json
import os

import torch
import torch.distributed as dist

import rallypoint.torch as rt

OUT = os.environ["RESULT_DIR"]
dist.init_process_group("rally", enable_reconfigure=True)
ME = dist.get_rank()
store = dist.distributed_c10d._get_default_store()
result = {"rank": ME, "checks": {}}


def check(section, ok, what):
    if not ok:
        raise AssertionError(f"rank {ME}, {section}: {what}")
    result["checks"][section] = result["checks"].get(section, 0) + 1


def raises(section, call, kind, words):
    try:
        call()
    except kind as e:
        check(section, all(w in str(e) for w in words), f"{e!r} does not say {words}")
        return str(e)
    check(section, False, f"no {kind.__name__}")


def who_is_where():
    """Each member's original rank, by its rank in the current membership."""
    _, n = rt.membership()
    outs = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(outs, torch.tensor([ME]))
    return [int(o.item()) for o in outs]


check("api", dist._supports_reconfigure(), "supports_reconfigure is False")
raises("api", lambda: dist.all_reduce(torch.ones(2)), ValueError, ["enable_reconfigure", "_reconfigure"])
mine = dist._get_reconfigure_handle()
check("api", mine.startswith("rally:") and mine == dist._get_reconfigure_handle(), f"handle {mine!r}")
store.set(f"handle/{ME}", mine)
h = [store.get(f"handle/{r}").decode() for r in range(3)]

# 2 members, a list: ranks by position.
if ME < 2:
    dist._reconfigure(uuid=1, handles=[h[0], h[1]]).wait()
    check("two", rt.membership() == (ME, 2), f"membership {rt.membership()}")
    t = torch.full((4,), float(ME + 1))
    dist.all_reduce(t)
    check("two", t[0].item() == 3.0, f"all_reduce {t[0].item()}")
    check("two", who_is_where() == [0, 1], "who is where")
    result["torch_rank_after"] = [dist.get_rank(), dist.get_world_size()]
store.set(f"two/{ME}", "1")
store.wait([f"two/{r}" for r in range(3)])

# 3 members, a set: the backend orders the handles (sorted).
dist._reconfigure(uuid=2, handles=set(h)).wait()
order = sorted(range(3), key=lambda r: h[r])
check("three", rt.membership() == (order.index(ME), 3), f"membership {rt.membership()}")
t = torch.full((4,), float(ME + 1))
dist.all_reduce(t)
check("three", t[0].item() == 6.0, f"all_reduce {t[0].item()}")
check("three", who_is_where() == order, f"who is where {who_is_where()} != {order}")

# Bad input: refused, the group still usable.
raises("bad", lambda: dist._reconfigure(uuid=2, handles=set(h)), ValueError, ["uuid 2", "used before"])
others = [x for x in h if x != mine]
raises("bad", lambda: dist._reconfigure(uuid=3, handles=others), ValueError, ["not among"])
foreign = "rally:10.9.9.9:1:" + "0" * 32
raises("bad", lambda: dist._reconfigure(uuid=3, handles=[mine, foreign]), ValueError, ["another store"])
t = torch.ones(4)
dist.all_reduce(t)
check("bad", t[0].item() == 3.0, "the group after refused reconfigures")

# A reconfigure with an op in flight fails that op; then 2 members, reversed.
if ME == 2:
    w = dist.all_reduce(torch.ones(4), async_op=True)
    store.set("inflight", "1")
store.wait(["inflight"])
if ME < 2:
    dist._reconfigure(uuid=4, handles=[h[1], h[0]]).wait()
    check("reversed", rt.membership() == (1 - ME, 2), f"membership {rt.membership()}")
    t = torch.full((4,), float(ME + 1))
    dist.all_reduce(t)
    check("reversed", t[0].item() == 3.0 and who_is_where() == [1, 0], "reversed")
else:
    dist._reconfigure(uuid=5, handles=[mine]).wait()
    try:
        w.wait()
        check("reversed", False, "the op in flight survived the reconfigure")
    except dist.DistError as e:
        # Aborted by its own reconfigure, or failed first by a peer that
        # had already left that group for the next one.
        check("reversed", "reconfigured" in str(e) or "dropped the group" in str(e), f"{e!r}")
    t = torch.full((4,), 5.0)
    dist.all_reduce(t)
    check("reversed", t[0].item() == 5.0 and rt.membership() == (0, 1), "alone")
store.set(f"end/{ME}", "1")
store.wait([f"end/{r}" for r in range(3)])
dist.destroy_process_group()
path = os.path.join(OUT, f"{ME}.json")
with open(path + ".tmp", "w") as f:
    json.dump(result, f)
os.rename(path + ".tmp", path)
print(f"ended {ME}", flush=True)
