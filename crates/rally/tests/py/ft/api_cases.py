"""``rallypoint.ft``'s training-loop API (issue 48 §1), the parts that need no
replica group manager, case by case with real torch: ``python api_cases.py
CASE`` runs one case and prints ``PASS CASE``.

- ``sampler``: :class:`rallypoint.ft.DistributedSampler` shards by replica
  group id and group rank: disjoint shards covering the dataset, whatever
  subset of groups is alive, per epoch; torchft's shard rule; bad input.
- ``averaging``: :meth:`Manager.allreduce`'s work (``_Averaged`` over a real
  two-process ``rally`` generation, ``_generations.Generations``): the sum
  divided by the participants, a non-participant's zeros not counted, and
  a failed generation's Work completing without raising.
- ``client``: the JSON-lines client (``_client.py``) against a small
  in-test server that only speaks the framing: hello first, beats (never
  answered) after it, answers in order, an answer split across segments,
  refusals, a silent server (the deadline, naming the op and address), a closed connection and the
  reconnect that follows, an oversized line, connecting before the server
  listens, and the connect timeout.
- ``no_torchft``: with torchft made unimportable, ``import rallypoint.ft``
  and every class of the API load, a DDP step runs through the comm hook,
  and ``ft.Manager(...)`` with no reachable manager fails at construction
  with an error naming the address (never torchft).
"""

import json
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from datetime import timedelta


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


# -- sampler --------------------------------------------------------------------


def case_sampler() -> None:
    import torch.utils.data as tud

    from rallypoint.ft import DistributedSampler

    data = list(range(240))
    groups, per_group = 4, 3
    for shuffle in (False, True):
        for epoch in (0, 1):
            shards = {}
            for g in range(groups):
                for r in range(per_group):
                    s = DistributedSampler(data, replica_rank=g, num_replica_groups=groups, group_rank=r, num_replicas=per_group, shuffle=shuffle, seed=3)
                    s.set_epoch(epoch)
                    check(s.global_rank == r + per_group * g, f"torchft's shard rule: {s.global_rank} for group {g} rank {r}")
                    shards[(g, r)] = list(iter(s))
            every = [i for sh in shards.values() for i in sh]
            check(sorted(every) == data, f"shuffle={shuffle} epoch={epoch}: the shards do not cover the dataset exactly once")
            # Whatever groups are alive, no sample is read twice in a step:
            # a step reads position k of each live shard.
            for alive in ([0, 1, 2, 3], [0, 2], [3], [1, 2, 3]):
                for k in range(len(shards[(0, 0)])):
                    step = [shards[(g, r)][k] for g in alive for r in range(per_group)]
                    check(len(set(step)) == len(step), f"alive {alive}, step {k}: a sample read twice: {step}")
        # Another epoch reorders when shuffling.
    a = list(iter(DistributedSampler(data, 1, groups, 0, per_group, shuffle=True, seed=3)))
    s = DistributedSampler(data, 1, groups, 0, per_group, shuffle=True, seed=3)
    s.set_epoch(1)
    check(a != list(iter(s)), "set_epoch did not reshuffle")
    # drop_last: disjoint even when the length does not divide.
    odd = list(range(250))
    seen = []
    for g in range(groups):
        for r in range(per_group):
            seen += list(iter(DistributedSampler(odd, g, groups, r, per_group, drop_last=True)))
    check(len(seen) == len(set(seen)) == (250 // 12) * 12, f"drop_last: {len(seen)} samples, {len(set(seen))} distinct")
    # Usable by a DataLoader.
    loader = tud.DataLoader(data, batch_size=5, sampler=DistributedSampler(data, 2, groups, 1, per_group))
    check(sum(len(b) for b in loader) == 20, "a DataLoader over one shard")
    # Bad input names the argument.
    for kwargs, word in (
        (dict(replica_rank=4, num_replica_groups=4), "replica_rank"),
        (dict(replica_rank=-1, num_replica_groups=4), "replica_rank"),
        (dict(replica_rank=0, num_replica_groups=0), "num_replica_groups"),
        (dict(replica_rank=0, num_replica_groups=2, group_rank=3, num_replicas=3), "group_rank"),
    ):
        try:
            DistributedSampler(data, **kwargs)
        except ValueError as e:
            check(word in str(e), f"{kwargs}: {e}")
        else:
            raise AssertionError(f"{kwargs} was accepted")
    # Without torch.distributed: group rank 0 of 1.
    s = DistributedSampler(data, 1, 2)
    check((s.global_rank, s.global_world_size) == (1, 2), f"defaults: {s.global_rank}, {s.global_world_size}")


# -- averaging --------------------------------------------------------------------


def _averaging_rank(rank: int, port: int, out) -> None:
    import torch

    from rallypoint.ft._generations import Generations
    from rallypoint.ft.manager import _Averaged

    class Reports:
        """What _Averaged reports to (the Manager's report_error)."""

        def __init__(self):
            self.errors = []

        def report_error(self, e):
            self.errors.append(e)

    g = Generations(timedelta(seconds=20), lighthouse="")
    g.configure(f"127.0.0.1:{port}/avg/1", "r", rank, 2, 1)
    check(g.errored() is None, f"rank {rank}: configure: {g.errored()}")
    rep = Reports()
    from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

    def allreduce(t, divisor, participating=True):
        if not participating:
            t.zero_()
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        return _Averaged(rep, g.collective([t], lambda b: b.allreduce([t], opts)), t, divisor)

    # Both take part: the mean.
    t = torch.full((1000,), float(rank + 1))
    w = allreduce(t, 2)
    got = w.get_future().wait()
    check(w.wait() and torch.equal(got, torch.full((1000,), 1.5)) and got is t, f"rank {rank}: mean {got[:3]}")
    # Rank 1 heals: it sends zeros and does not count (one participant).
    t = torch.full((10,), float(rank + 1) * 4)
    got = allreduce(t, 1, participating=(rank == 0)).get_future().wait()
    check(torch.equal(got, torch.full((10,), 4.0)), f"rank {rank}: with a non-participant {got[:3]}")
    # A failed generation: the Work completes, the error is the group's.
    g.abort("the test aborts")
    t = torch.ones(10)
    w = allreduce(t, 2)
    w.wait()
    w.get_future().wait()
    check(g.errored() is not None and "the test aborts" in str(g.errored()), f"rank {rank}: {g.errored()}")
    g.shutdown()
    out.put((rank, "ok"))


def case_averaging() -> None:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_averaging_rank, args=(r, store.port, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
        check(p.exitcode == 0, f"an averaging rank ended with {p.exitcode}")
    got = sorted(out.get(timeout=5) for _ in procs)
    check(got == [(0, "ok"), (1, "ok")], f"{got}")


# -- client ---------------------------------------------------------------------


class LineServer:
    """A JSON-lines server for the client's framing: ``script(conn_index,
    request)`` returns the bytes to send back (or None: stay silent)."""

    def __init__(self, script, port: int = 0, listen: bool = True):
        self.script = script
        self.port = port
        self.requests = []
        self.beats = 0
        self.connections = 0
        self._sock = None
        if listen:
            self.listen()

    def listen(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen()
        self.port = s.getsockname()[1]
        self._sock = s
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn, self.connections), daemon=True).start()

    def _serve(self, conn, index) -> None:
        buf = b""
        with conn:
            while True:
                try:
                    chunk = conn.recv(65536)
                except OSError:
                    return
                if not chunk:
                    return
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    req = json.loads(line)
                    if req.get("op") == "beat":
                        self.beats += 1
                        continue  # liveness, never answered
                    self.requests.append((index, req))
                    answer = self.script(index, req)
                    if answer == "close":
                        return
                    if answer is not None:
                        conn.sendall(answer)

    def close(self) -> None:
        self._sock.close()


def ok(**kw) -> bytes:
    return json.dumps({"ok": True, **kw}).encode() + b"\n"


def expect(exc_type, call, *words):
    t0 = time.monotonic()
    try:
        call()
    except exc_type as e:
        for w in words:
            check(w in str(e), f"{w!r} not in {e}")
        return time.monotonic() - t0
    raise AssertionError(f"no {exc_type.__name__} (wanted one naming {words})")


def case_client() -> None:
    from rallypoint.ft._client import Client, ManagerError, Quorum

    hello = {"replica_id": "7", "store_address": "127.0.0.1:1", "lighthouse": "http://127.0.0.1:2"}
    quorum = {
        "quorum_id": 3, "replica_id": "7", "replica_rank": 1, "replica_world_size": 2, "recover_src_replica_rank": 0,
        "recover_src_metadata": "127.0.0.1:9", "recover_dst_replica_ranks": [], "store_address": "127.0.0.1:5",
        "max_step": 4, "max_replica_rank": None, "max_world_size": 1, "heal": True, "commit_failures": 0, "replica_ids": ["3", "7"],
    }

    # In order, across split and joined segments.
    def normal(index, req):
        op = req["op"]
        if op == "hello":
            return ok(**hello)
        if op == "quorum":
            a = ok(quorum=quorum)
            return a  # sent whole; split below
        if op == "should_commit":
            return ok(commit=req["vote"])
        if op == "report":
            return ok()
        return json.dumps({"ok": False, "error": f"unknown op {op!r}"}).encode() + b"\n"

    srv = LineServer(normal)
    c = Client(f"127.0.0.1:{srv.port}", 1, 2, connect_timeout=5)
    check(c.connect() == {"ok": True, **hello}, f"hello: {c.hello}")
    first = srv.requests[0][1]
    check(first["op"] == "hello" and first["group_rank"] == 1 and first["group_world_size"] == 2 and first["pid"] == os.getpid(), f"{first}")
    q = c.quorum(step=4, metadata="127.0.0.1:8", shrink_only=False, init_sync=True, commit_failures=2, timeout=3)
    check(isinstance(q, Quorum) and q.heal and q.max_replica_rank is None and q.recover_src_metadata == "127.0.0.1:9", f"{q}")
    sent = srv.requests[-1][1]
    check(sent == {"op": "quorum", "step": 4, "metadata": "127.0.0.1:8", "shrink_only": False, "init_sync": True, "commit_failures": 2, "timeout_ms": 3000, "line": None}, f"{sent}")
    c.quorum(step=4, metadata="127.0.0.1:8", shrink_only=False, init_sync=True, commit_failures=0, timeout=3, line=1796)
    check(srv.requests[-1][1]["line"] == 1796, f"the line: {srv.requests[-1]}")
    check(c.should_commit(4, True, 3) is True and c.should_commit(4, False, 3, line=7) is False, "should_commit")
    sent = srv.requests[-1][1]
    check(sent == {"op": "should_commit", "step": 4, "vote": False, "timeout_ms": 3000, "line": 7}, f"{sent}")
    c.report_heal(4, 100, 0.5, ["127.0.0.1:9"])
    c.report_not_committed(5, "why")
    check(srv.requests[-1][1] == {"op": "report", "kind": "not_committed", "step": 5, "reason": "why"}, f"{srv.requests[-1]}")
    expect(ManagerError, lambda: c.call({"op": "nope"}, 3), "refused nope", "unknown op 'nope'", f"127.0.0.1:{srv.port}")
    deadline = time.monotonic() + 10
    while srv.beats < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    check(srv.beats >= 3, f"{srv.beats} beats within 10 s of the hello")
    c.close()

    srv3 = LineServer(lambda i, r: None)
    c3 = Client(f"127.0.0.1:{srv3.port}", 0, 1, connect_timeout=1)
    # A silent server: hello times out at the connect timeout, naming the op and the address.
    took = expect(ManagerError, c3.connect, "hello", f"127.0.0.1:{srv3.port}", "no answer")
    check(took < 30, f"the silent hello took {took:.1f} s")
    srv3.close()

    # A byte-by-byte answer.
    def byte_server():
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()

        def request(f) -> bytes:
            """The next line that is not a beat (b"" at EOF)."""
            while True:
                line = f.readline()
                if not line or json.loads(line).get("op") != "beat":
                    return line

        def run():
            conn, _ = s.accept()
            f = conn.makefile("rb")
            request(f)
            for b in ok(**hello):
                conn.sendall(bytes([b]))
            request(f)
            conn.sendall(ok(commit=True)[:5])
            conn.sendall(ok(commit=True)[5:])
            request(f)  # a should_commit never answered: the client's deadline
            request(f)  # the client closes: EOF
            conn.close()

        threading.Thread(target=run, daemon=True).start()
        return s

    bs = byte_server()
    c4 = Client(f"127.0.0.1:{bs.getsockname()[1]}", 0, 1, connect_timeout=5)
    check(c4.connect()["replica_id"] == "7", "a byte-by-byte hello")
    check(c4.should_commit(1, True, 5) is True, "a split answer")
    took = expect(ManagerError, lambda: c4.should_commit(2, True, 0.2), "should_commit", "no answer", "5.2 s")
    check(took < 0.2 + 5.0 + 10, f"the deadline took {took:.1f} s")

    # A closed connection: the call fails naming it; the next one reconnects with hello.
    def closer(index, req):
        if req["op"] == "hello":
            return ok(**hello)
        if index == 1:
            return "close"
        return ok(commit=True)

    srv5 = LineServer(closer)
    c5 = Client(f"127.0.0.1:{srv5.port}", 0, 1, connect_timeout=5)
    c5.connect()
    expect(ManagerError, lambda: c5.should_commit(1, True, 5), "closed the connection", "should_commit")
    check(c5.should_commit(1, True, 5) is True, "the call after a closed connection")
    check([r["op"] for i, r in srv5.requests if i == 2][:1] == ["hello"], f"no hello on the new connection: {srv5.requests}")

    # A refused hello (a rank already held): an error naming the reason.
    srv6 = LineServer(lambda i, r: json.dumps({"ok": False, "error": "group rank 0 is held by pid 1"}).encode() + b"\n")
    expect(ManagerError, Client(f"127.0.0.1:{srv6.port}", 0, 1, 5).connect, "refused hello", "held by pid 1")

    # An oversized answer line.
    srv7 = LineServer(lambda i, r: ok(**hello) if r["op"] == "hello" else b"x" * ((1 << 20) + 10))
    c7 = Client(f"127.0.0.1:{srv7.port}", 0, 1, 5)
    expect(ManagerError, lambda: c7.should_commit(0, True, 5), "over 1048576 bytes")
    # Not JSON, and no ok field.
    srv8 = LineServer(lambda i, r: ok(**hello) if r["op"] == "hello" else (b"nope\n" if r["step"] == 0 else b'{"commit":true}\n'))
    c8 = Client(f"127.0.0.1:{srv8.port}", 0, 1, 5)
    expect(ManagerError, lambda: c8.should_commit(0, True, 5), "not JSON")
    expect(ManagerError, lambda: c8.should_commit(1, True, 5), "without an 'ok' field")
    # A malformed quorum answer names what is missing.
    srv9 = LineServer(lambda i, r: ok(**hello) if r["op"] == "hello" else ok(quorum={"quorum_id": 1}))
    expect(ManagerError, lambda: Client(f"127.0.0.1:{srv9.port}", 0, 1, 5).quorum(0, "m", False, True, 0, 1), "malformed", "KeyError")

    # Connecting before the manager listens: retried until it does.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    late = LineServer(normal, port=port, listen=False)
    c10 = Client(f"127.0.0.1:{port}", 0, 1, connect_timeout=20)
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("hello", c10.connect()))
    th.start()
    late.listen()
    th.join(25)
    check(box.get("hello", {}).get("replica_id") == "7", f"a manager listening late: {box}")

    # Nobody listens: the connect timeout, naming the address.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = s.getsockname()[1]
    s.close()
    took = expect(ManagerError, Client(f"127.0.0.1:{dead}", 0, 1, connect_timeout=0.5).connect, f"127.0.0.1:{dead}", "connect timeout (0.5 s)")
    check(took < 10, f"the connect timeout took {took:.1f} s")
    # Bad addresses.
    for bad in ("nowhere", "host:", ":80", "h:99999"):
        expect(ValueError, lambda: Client(bad, 0, 1, 1), "host:port")


# -- without torchft -----------------------------------------------------------------


def case_no_torchft() -> None:
    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name == "torchft" or name.startswith("torchft."):
                raise ImportError(f"torchft is hidden by the test ({name})")
            return None

    sys.meta_path.insert(0, Blocker())
    import torch

    import rallypoint.ft as ft

    for name in ("Manager", "DistributedDataParallel", "PureDistributedDataParallel", "Optimizer", "DistributedSampler"):
        check(getattr(ft, name) is not None, name)
    from rallypoint.ft import _client, _generations, _locate, _work, ddp, manager  # noqa: F401

    try:
        ft.ProcessGroupRally
    except ImportError as e:
        check("hidden by the test" in str(e), f"{e}")
    else:
        raise AssertionError("ProcessGroupRally loaded without torchft")

    # A DDP step through the comm hook: the hook's Work is awaited and its tensor used.
    class Halving:
        """Stands for the Manager's allreduce: halves in place (its contract: a Work)."""

        def allreduce(self, t):
            t.mul_(0.5)
            return _work._Done(t)

    torch.manual_seed(0)
    m = torch.nn.Linear(8, 3)
    ref = torch.nn.Linear(8, 3)
    ref.load_state_dict(m.state_dict())
    x = torch.randn(5, 8)
    model = ft.DistributedDataParallel(Halving(), m)
    model(x).sum().backward()
    ref(x).sum().backward()
    check(torch.allclose(m.weight.grad, ref.weight.grad * 0.5), "the comm hook's result is the gradient")
    try:
        ft.DistributedDataParallel(Halving(), m, process_group=None)
    except ValueError as e:
        check("process_group" in str(e), f"{e}")
    else:
        raise AssertionError("DDP took a process_group")

    # The Manager with no manager listening: an error naming the address, at construction.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = s.getsockname()[1]
    s.close()
    os.environ["RALLY_FT_MANAGER"] = f"127.0.0.1:{dead}"
    expect(_client.ManagerError, lambda: ft.Manager(state={"model": m}, connect_timeout=0.5), f"127.0.0.1:{dead}")
    del os.environ["RALLY_FT_MANAGER"]
    # No manager address, no replica group, no lighthouse: each named.
    for var in ("RALLY_FT_REPLICA_GROUP", "REPLICA_GROUP_ID", "RALLY_FT_LIGHTHOUSE", "TORCHFT_LIGHTHOUSE"):
        os.environ.pop(var, None)
    expect(ValueError, lambda: ft.Manager(state={"model": m}, group_rank=0, group_world_size=1), "replica group id")
    expect(ValueError, lambda: ft.Manager(replica_group="0", group_rank=0, group_world_size=1), "lighthouse")
    expect(ValueError, lambda: ft.Manager(min_replicas=0), "min_replicas")
    expect(ValueError, lambda: ft.Manager(state={"loader": object()}), "'loader'", "state_dict")
    expect(ValueError, lambda: ft.Manager(timeout=-1), "timeout")
    os.environ["TORCHFT_TIMEOUT_SEC"] = "soon"
    expect(ValueError, lambda: ft.Manager(), "TORCHFT_TIMEOUT_SEC")
    del os.environ["TORCHFT_TIMEOUT_SEC"]
    check(not any(k == "torchft" or k.startswith("torchft.") for k in sys.modules), "torchft got imported")


CASES = {"sampler": case_sampler, "averaging": case_averaging, "client": case_client, "no_torchft": case_no_torchft}

if __name__ == "__main__":
    CASES[sys.argv[1]]()
    print(f"PASS {sys.argv[1]}")
