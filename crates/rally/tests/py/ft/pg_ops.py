"""``rallypoint.ft.ProcessGroupRally`` on its own (no Manager), one scenario
per run (SCENARIO), RANK of WORLD_SIZE processes started by hand; rank 0
hosts the TCPStore at MASTER_PORT that every configure forms through.

- ``errors`` (2): a generation's all_reduce; rank 1 aborts from another
  thread while rank 0's all_reduce waits for it: rank 0's Work completes
  without raising, ``errored()`` names replica r1 and the reason; later
  collectives and sends return at once untouched, recv fails at once; the next
  configure works again. Then rank 1 dies (SIGKILL) while rank 0 waits in
  an all_reduce: rank 0's op completes, errored() naming rank 1 gone.
- ``bad_input`` (2): configure with a rank outside the world, a world of 0,
  the live generation's prefix, a malformed address: each a ValueError, the
  generation still usable. Failures at run time (a store nobody listens on,
  a store that accepts and never answers, a generation whose other member
  never comes) do not raise: errored() names them, collectives return at
  once, the backend formed is aborted, the next configure works. A recv
  racing the retiring of a generation fails with its abort. The address a
  generation listens on (``listen_ip``: the route to the store's host
  unless loopback).
- ``membership`` (3): ROUNDS rounds of configure 3 -> 2 -> 3 members (rank
  2 sits out of the 2-member generations), each followed by an all_reduce
  checked for its value; every rank reports its configure times and
  configure + first all_reduce times, in ms. With APART=1 each rank takes
  its own ``RALLY_HOST_ID`` (TCP, not shared memory), and checks that every
  generation after the first round runs over the same transport (its
  listening address) without a new connection.
- ``register`` (2): torchft's ``register`` (DeviceMesh, functional
  collectives) over a configured group.
- ``watch`` (2): the lighthouse watch, against a fake ``/v1/watch`` that
  rank 0 serves (FakeLighthouse: it drops a member on command; the real
  ``rally lighthouse`` is driven by ``pg_torchft.py``'s replicas).

Each rank writes ``RESULT_DIR/<rank>.json`` (``checks``: how many checks
passed, by section) and ends normally.
"""

import http.server
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllreduceOptions

import rallypoint.ft  # noqa: E402 - before its adapter: it must not need torchft

IMPORTED_TORCHFT = "torchft" in sys.modules
from rallypoint.ft import ProcessGroupRally  # noqa: E402

SCENARIO = os.environ["SCENARIO"]
OUT = os.environ["RESULT_DIR"]
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
PORT = int(os.environ["MASTER_PORT"])
STORE = dist.TCPStore("127.0.0.1", PORT, WORLD, is_master=RANK == 0, timeout=timedelta(seconds=60))
DEADLINE = timedelta(seconds=30)

result = {"rank": RANK, "checks": {}}


def check(section, ok, what):
    if not ok:
        raise AssertionError(f"rank {RANK}, {section}: {what}")
    result["checks"][section] = result["checks"].get(section, 0) + 1


def write():
    path = os.path.join(OUT, f"{RANK}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.rename(path + ".tmp", path)


def addr(prefix):
    return f"127.0.0.1:{PORT}/{prefix}"


def sync(name, n=WORLD):
    """Waits until n ranks have reached `name` (the last one to arrive marks it)."""
    if STORE.add(f"sync/{name}", 1) == n:
        STORE.set(f"sync/{name}/done", "1")
    STORE.wait([f"sync/{name}/done"], DEADLINE)


def all_reduce(pg, value, opts=None):
    t = torch.full((1000,), float(value))
    w = pg.allreduce([t], opts or AllreduceOptions())
    w.wait()
    return t, w


def errors():
    check("import", not IMPORTED_TORCHFT, "import rallypoint.ft imported torchft")
    pg = ProcessGroupRally(timeout=DEADLINE)
    pg.configure(addr("e/1"), f"r{RANK}", RANK, WORLD, 1)
    t, _ = all_reduce(pg, RANK + 1)
    check("errors", t[0].item() == 3 and pg.errored() is None, f"all_reduce gave {t[0].item()}, errored {pg.errored()}")

    # Rank 1 aborts while rank 0 waits in an all_reduce rank 1 never joins.
    if RANK == 0:
        t = torch.ones(1000)
        w = pg.allreduce([t], AllreduceOptions())
        STORE.set("e/inflight", "1")
        t0 = time.monotonic()
        check("errors", w.wait() is True, "wait() of an aborted op did not return True")
        fut = w.get_future()
        fut.wait()
        result["abort_to_done_ms"] = (time.monotonic() - t0) * 1000
        err = pg.errored()
        check("errors", err is not None and "r1" in str(err) and "called abort(): rank 1 says stop" in str(err), f"errored() is {err!r}")
    else:
        STORE.wait(["e/inflight"], DEADLINE)
        th = threading.Thread(target=pg.abort, args=("rank 1 says stop",))
        th.start()
        th.join()
        check("errors", "called abort()" in str(pg.errored()), f"the aborting rank's errored() is {pg.errored()!r}")
    # Rank 1 stays until rank 0 has read the abort (leaving closes its
    # connections, which rank 0 may see before the abort's reason).
    sync("e/read")
    # After the error: collectives return at once, untouched; messages fail.
    t = torch.full((1000,), 5.0)
    w = pg.allreduce([t], AllreduceOptions())
    check("errors", w.wait() is True and t[0].item() == 5.0, "a collective after the error communicated")
    check("errors", pg.send([torch.ones(3)], 1 - RANK, 0).wait() is True, "send after the error did not return")
    try:
        pg.recv([torch.ones(3)], 1 - RANK, 0).wait()
        check("errors", False, "recv after the error did not fail")
    except Exception as e:  # noqa: BLE001
        check("errors", "has failed" in str(e), f"recv after the error failed with {e!r}")
    # The next configure clears it.
    pg.configure(addr("e/2"), f"r{RANK}", RANK, WORLD, 2)
    t, _ = all_reduce(pg, 10 * (RANK + 1))
    check("errors", t[0].item() == 30 and pg.errored() is None, f"after configure: {t[0].item()}, {pg.errored()!r}")
    # Messages work in a healthy generation.
    if RANK == 0:
        pg.send([torch.arange(4.0)], 1, 7).wait()
    else:
        r = torch.zeros(4)
        pg.recv([r], 0, 7).wait()
        check("errors", r.tolist() == [0.0, 1.0, 2.0, 3.0], f"recv got {r.tolist()}")

    # Rank 1 dies while rank 0 waits in an all_reduce (rank 1 never sends
    # its part: had it, rank 0's op could complete, rightly).
    pg.configure(addr("e/3"), f"r{RANK}", RANK, WORLD, 3)
    all_reduce(pg, 1)
    if RANK == 1:
        STORE.wait(["e/dying"], DEADLINE)
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1000)
    w = pg.allreduce([t], AllreduceOptions())
    STORE.set("e/dying", "1")
    t0 = time.monotonic()
    w.wait()
    result["death_to_done_ms"] = (time.monotonic() - t0) * 1000
    err = pg.errored()
    check("errors", err is not None and "rank 1" in str(err) and "timed out" not in str(err), f"after rank 1 died: {err!r}")
    result["death_error"] = str(err)
    pg.shutdown()


def silent_listener():
    """A socket that accepts connections and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


def bad_input():
    pg = ProcessGroupRally(timeout=timedelta(seconds=2))
    pg.configure(addr("b/1"), f"r{RANK}", RANK, WORLD, 1)
    n = [0]

    def still_usable(what):
        n[0] += 1
        sync(f"bad/{n[0]}")
        t, _ = all_reduce(pg, n[0])
        check("bad_input", t[0].item() == 2 * n[0] and pg.errored() is None, f"after {what}: {t[0].item()}, {pg.errored()!r}")

    def refused(what, call, kind, words):
        t0 = time.monotonic()
        try:
            call()
        except kind as e:
            check("bad_input", all(w in str(e) for w in words), f"{what}: {e!r} does not say {words}")
            result.setdefault("errors", {})[what] = [str(e), round(time.monotonic() - t0, 3)]
        else:
            check("bad_input", False, f"{what} was accepted")
        still_usable(what)

    refused("rank outside", lambda: pg.configure(addr("b/x"), "r", WORLD, WORLD, 2), ValueError, ["rank 2", "world of 2"])
    refused("world 0", lambda: pg.configure(addr("b/y"), "r", 0, 0, 2), ValueError, ["world_size is 0"])
    refused("live prefix", lambda: pg.configure(addr("b/1"), "r", RANK, WORLD, 1), ValueError, ["b/1", "live generation"])
    refused("bad address", lambda: pg.configure("nowhere/b/2", "r", RANK, WORLD, 2), ValueError, ["host:port/prefix"])
    # Failures at run time do not raise (torchft's DDP hook would crash on
    # the Work its Manager hands out after a raise): each is errored(), a
    # collective returns at once untouched, and the next configure forms.
    m = [0]

    def recorded(what, call, words):
        t0 = time.monotonic()
        call()
        err = str(pg.errored())
        check("bad_input", all(w in err for w in words), f"{what}: errored() {err!r} does not say {words}")
        result.setdefault("errors", {})[what] = [err, round(time.monotonic() - t0, 3)]
        t = torch.full((10,), 4.0)
        check("bad_input", pg.allreduce([t], AllreduceOptions()).wait() and t[0].item() == 4.0, f"{what}: a collective communicated")
        m[0] += 1
        sync(f"bad/re/{m[0]}")
        pg.configure(addr(f"b/re/{m[0]}"), f"r{RANK}", RANK, WORLD, 2)
        still_usable(f"a configure after {what}")

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = s.getsockname()[1]
    s.close()
    recorded("store not listening", lambda: pg.configure(f"127.0.0.1:{dead}/b/2", "r", RANK, WORLD, 2), [f"127.0.0.1:{dead}"])
    quiet = silent_listener()
    q = quiet.getsockname()[1]
    recorded("store silent", lambda: pg.configure(f"127.0.0.1:{q}/b/2", "r", RANK, WORLD, 2), [f"127.0.0.1:{q}"])
    quiet.close()
    sync("bad/before-lonely")
    # A generation whose other member never comes (rank 0 on rank 1, rank 1
    # on rank 0): configure returns after the timeout, errored() names the
    # member, and no backend is formed (the round needs every member's entry).
    formed = capture_backends()
    t0 = time.monotonic()
    if RANK == 1:
        pg.configure(addr("b/lonely"), "r1", 1, 2, 9)
        words = "group rank(s) 0 of 2 never published their entry"
    else:
        pg.configure(addr("b/alone"), "r0", 0, 2, 9)
        words = "group rank(s) 1 of 2 never published their entry"
    result.setdefault("errors", {})["a member never came"] = [str(pg.errored()), round(time.monotonic() - t0, 3)]
    t = torch.full((10,), 4.0)
    w = pg.allreduce([t], AllreduceOptions())
    check("bad_input", w.wait() and t[0].item() == 4.0 and words in str(pg.errored()), f"ops after a failed configure: {pg.errored()!r}")
    check("bad_input", not formed, f"a backend formed without the other member: {formed}")
    sync("bad/after-lonely")
    pg.configure(addr("b/3"), f"r{RANK}", RANK, WORLD, 3)
    still_usable("a configure after the failures")
    # An op racing the retiring of a generation (here: a recv nobody sends,
    # issued from its close)
    # fails with the generation's abort, never on a missing generation.
    gen, seen = pg._gen, {}
    close = gen.close

    def racing_close(reason):
        seen["work"] = pg.recv([torch.zeros(1)], 1 - RANK, 99)
        close(reason)

    gen.close = racing_close
    sync("bad/retire")
    pg.configure(addr("b/4"), f"r{RANK}", RANK, WORLD, 4)
    try:
        seen["work"].wait()
        raised = None
    except Exception as e:  # noqa: BLE001
        raised = e
    check(
        "bad_input",
        raised is not None and not isinstance(gen.fault.error, AttributeError) and "NoneType" not in str(raised),
        f"a recv racing the retire: raised {raised!r}, the old generation's error {gen.fault.error!r}",
    )
    still_usable("a configure after the race")
    pg.shutdown()
    t = torch.full((10,), 4.0)
    check("bad_input", pg.allreduce([t], AllreduceOptions()).wait() and "shut down" in str(pg.errored()), "ops after shutdown")
    # The address a generation listens on: the route to the store's host,
    # unless that route is loopback (then the collectives' own rule).
    from rallypoint.ft import _registry
    from rallypoint.ft.process_group import listen_ip

    out = _registry._route_to("192.0.2.1")  # TEST-NET-1: routing only, nothing is sent
    check("bad_input", listen_ip("127.0.0.1") is None and listen_ip("localhost") is None, "a loopback store chose an address")
    if out is not None and not out.startswith("127."):
        check("bad_input", listen_ip("192.0.2.1") == out, f"the route to 192.0.2.1 is {out}, chose {listen_ip('192.0.2.1')}")
    else:
        check("bad_input", listen_ip("192.0.2.1") is None, f"no route off this host, chose {listen_ip('192.0.2.1')}")
    check("bad_input", formed and all(b._advertise is None for b in formed), "a loopback store's generation was given an address")


def capture_backends():
    """The rally backends formed from now on, in order."""
    from rallypoint import torch as rally_torch

    formed = []
    base = rally_torch.RallyBackend

    class Capturing(base):
        def __init__(self, *a, advertise=None, **k):
            super().__init__(*a, advertise=advertise, **k)
            self._advertise = advertise
            formed.append(self)

    rally_torch.RallyBackend = Capturing
    return formed


def membership():
    rounds = int(os.environ.get("ROUNDS", "10"))
    if os.environ.get("PG") == "gloo":  # by hand, for comparison
        from torchft.process_group import ProcessGroupGloo

        pg = ProcessGroupGloo(timeout=DEADLINE)
        pg.errored = lambda: None
    else:
        pg = ProcessGroupRally(timeout=DEADLINE)
    apart = os.environ.get("APART") == "1"
    if apart:
        # Read at each generation's round (the collectives' host entry).
        os.environ["RALLY_HOST_ID"] = f"apart-{RANK}"
    times = {"3->2": [], "2->3": []}
    firsts = {"3->2": [], "2->3": []}
    q = 0
    pg.configure(addr(f"m/{q}"), f"r{RANK}", RANK, 3, q)
    all_reduce(pg, 1)
    # (listening address, connections) after each round's generations.
    seen = []
    for i in range(rounds):
        for change, members in (("3->2", 2), ("2->3", 3)):
            q += 1
            sync(f"m/{q}")
            if RANK >= members:
                continue
            t0 = time.perf_counter()
            pg.configure(addr(f"m/{q}"), f"r{RANK}", RANK, members, q)
            t1 = time.perf_counter()
            t, _ = all_reduce(pg, RANK + 1)
            t2 = time.perf_counter()
            want = sum(range(1, members + 1))
            check("membership", t[0].item() == want and pg.errored() is None, f"round {i} {change}: {t[0].item()} != {want}")
            times[change].append((t1 - t0) * 1000)
            firsts[change].append((t2 - t0) * 1000)
        g = pg._gen.group
        seen.append((g.local_addr(), g.handshakes()))
    if apart:
        # Every pair connected in round 0; from then on, one transport and no
        # new connection: the survivors' connections are kept across 3 -> 2
        # and rank 2's, alive while it sat out, across 2 -> 3.
        check("membership", len(set(seen)) == 1, f"transport (address, connections) per round: {seen}")
        check("membership", seen[0][1] > 0, f"no connection at all: {seen}")
    result["transport_per_round"] = [list(x) for x in seen]
    result["configure_ms"] = {k: statistics.median(v) for k, v in times.items() if v}
    result["configure_and_first_all_reduce_ms"] = {k: statistics.median(v) for k, v in firsts.items() if v}
    result["samples"] = {k: [round(x, 2) for x in v] for k, v in firsts.items()}
    result["configure_samples"] = {k: [round(x, 2) for x in v] for k, v in times.items()}
    sync("m/end")
    pg.shutdown()


class FakeLighthouse(http.server.ThreadingHTTPServer):
    """``/v1/watch`` as ``rally lighthouse`` answers it: 204 after
    timeout_ms until the test marks quorum Q (``drop(Q, ...)``) or moves on
    (``supersede``); ``/404`` paths answer 404. It counts the polls."""

    daemon_threads = True

    def __init__(self, no_watch=False):
        self.no_watch = no_watch
        self.cond = threading.Condition()
        self.events = {}
        self.polls = {}
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"

    def drop(self, q, replica, reason):
        with self.cond:
            self.events[q] = {"quorum_id": q, "event": "dropped", "replica_id": replica, "reason": reason}
            self.cond.notify_all()

    def supersede(self, q, current):
        with self.cond:
            self.events[q] = {"quorum_id": q, "event": "superseded", "current": current}
            self.cond.notify_all()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_GET(self):
        from urllib.parse import parse_qs, urlparse

        u = urlparse(self.path)
        srv = self.server
        if u.path != "/v1/watch" or srv.no_watch:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        qs = parse_qs(u.query)
        q, ms = int(qs["quorum_id"][0]), int(qs["timeout_ms"][0])
        with srv.cond:
            srv.polls[q] = srv.polls.get(q, 0) + 1
            srv.cond.wait_for(lambda: q in srv.events, ms / 1000)
            ev = srv.events.get(q)
        if ev is None:
            self.send_response(204)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = json.dumps(ev).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the watch was stopped: it closed its connection


def watch():
    fake = None
    if RANK == 0:
        fake = FakeLighthouse()
        STORE.set("w/url", fake.url())
    url = STORE.get("w/url").decode()
    pg = ProcessGroupRally(timeout=DEADLINE, lighthouse=url)
    pg.configure(addr("w/7"), f"r{RANK}", RANK, WORLD, 7)
    all_reduce(pg, 1)
    # The lighthouse drops a member of quorum 7 while rank 0 waits in an
    # all_reduce that rank 1 never joins: both generations are aborted; rank
    # 0's op fails, rank 1's next op does.
    if RANK == 0:
        t = torch.ones(1000)
        w = pg.allreduce([t], AllreduceOptions())
        t0 = time.monotonic()
        fake.drop(7, "r9:uuid", "its session closed")
        w.wait()
        result["drop_to_done_ms"] = (time.monotonic() - t0) * 1000
    else:
        deadline = time.monotonic() + DEADLINE.total_seconds()
        while not pg._gen.group.aborted() and time.monotonic() < deadline:
            time.sleep(0.005)
        # Nothing of rank 1's was in flight: the drop is not an error of its
        # step (its ops had completed: a group that ends after its last
        # commit must not fail the others'); its next op fails, and is one.
        check("watch", pg.errored() is None, f"a drop with nothing in flight failed the step: {pg.errored()!r}")
        pg.allreduce([torch.ones(10)], AllreduceOptions()).wait()
    err = str(pg.errored())
    check("watch", "dropped replica r9:uuid from quorum 7: its session closed" in err and url in err, f"errored() is {err!r}")
    sync("w/aborted")
    # Quorum 8: healthy; its watch polls; a superseded quorum 7 leaves it be.
    pg.configure(addr("w/8"), f"r{RANK}", RANK, WORLD, 8)
    t, _ = all_reduce(pg, 1)
    check("watch", t[0].item() == 2 and pg.errored() is None, f"quorum 8: {t[0].item()} {pg.errored()!r}")
    gen8 = pg._gen
    if RANK == 0:
        fake.supersede(8, 9)
    deadline = time.monotonic() + DEADLINE.total_seconds()
    while gen8.watch.ended is None and time.monotonic() < deadline:
        time.sleep(0.005)
    check("watch", gen8.watch.ended == "superseded" and pg.errored() is None, f"superseded: {gen8.watch.ended} {pg.errored()!r}")
    t, _ = all_reduce(pg, 1)
    check("watch", t[0].item() == 2, "quorum 8 after superseded")
    sync("w/superseded")
    # Quorum 10's watch, firing after quorum 11 formed, must abort 10 only:
    # it is kept running past configure(11) (detached from its generation,
    # so the retire does not stop it), then the lighthouse drops a member
    # of 10 and the watch delivers it.
    pg.configure(addr("w/10"), f"r{RANK}", RANK, WORLD, 10)
    gen10 = pg._gen
    stale, gen10.watch = gen10.watch, None
    pg.configure(addr("w/11"), f"r{RANK}", RANK, WORLD, 11)
    check("watch", stale.ended is None, f"quorum 10's watch ended before its drop: {stale.ended}")
    sync("w/11")
    if RANK == 0:
        fake.drop(10, "r9", "late")
    deadline = time.monotonic() + DEADLINE.total_seconds()
    while stale.ended is None and time.monotonic() < deadline:
        time.sleep(0.005)
    check("watch", stale.ended == "dropped", f"quorum 10's watch did not deliver its drop: {stale.ended}")
    t, _ = all_reduce(pg, 1)
    sync("w/late")
    check("watch", t[0].item() == 2 and pg.errored() is None, f"quorum 11 after 10's drop: {pg.errored()!r}")
    stale.stop()
    pg.shutdown()
    check("watch", pg._gen is None, "shutdown left a generation")
    # torchft's own lighthouse has no /v1/watch: a 404 ends the watch, once.
    if RANK == 0:
        old = FakeLighthouse(no_watch=True)
        lone = ProcessGroupRally(timeout=DEADLINE, lighthouse=old.url())
        lone.configure(addr("w/lone"), "r0", 0, 1, 12)
        deadline = time.monotonic() + DEADLINE.total_seconds()
        while lone._gen.watch.ended is None and time.monotonic() < deadline:
            time.sleep(0.005)
        t, _ = all_reduce(lone, 3)
        check("watch", lone._gen.watch.ended == "no-endpoint" and t[0].item() == 3, f"404: {lone._gen.watch.ended}")
        lone.shutdown()
    sync("w/end")


def register():
    """torchft's ``register`` path (DeviceMesh, functional collectives): the
    group registered as a backend of a size-1 torch group on each rank, its
    ops still across the configured generation."""
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import DeviceMesh

    dist.init_process_group("gloo", store=dist.PrefixStore("default", STORE), rank=RANK, world_size=WORLD)
    pg = ProcessGroupRally(timeout=DEADLINE)
    pg.configure(addr("r/1"), f"r{RANK}", RANK, WORLD, 1)
    reg = pg.register("ft")
    t = torch.ones(3)
    dist.all_reduce(t, group=reg)
    check("register", t.tolist() == [2.0, 2.0, 2.0], f"dist.all_reduce over the registered group: {t.tolist()}")
    out = fc.all_reduce(torch.full((3,), float(RANK + 1)), "sum", reg)
    check("register", torch.as_tensor(out).tolist() == [3.0, 3.0, 3.0], f"functional all_reduce: {out}")
    mesh = DeviceMesh.from_group(reg, "cpu")
    check("register", mesh.size() == 1, f"DeviceMesh over it: {mesh}")
    pg.shutdown()
    dist.destroy_process_group()


{"errors": errors, "bad_input": bad_input, "membership": membership, "watch": watch, "register": register}[SCENARIO]()
write()
print(f"ended {RANK}", flush=True)
