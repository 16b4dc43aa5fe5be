"""RallyTransport case by case, with real torch: ``python transport_cases.py
CASE`` runs one case and prints ``PASS CASE``. Cases: roundtrip, early, striped,
failover, wrong_step, died, truncated, mismatch, malformed, hostile, timeout,
disallow_midway, stuck_freeze, huge_header, idle_meta, blackholed. (``serve MB`` is the sender process of ``died``.)"""

import copy
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch
from torch.utils._pytree import tree_flatten

from rallypoint.ft import _fetch, _wire
from rallypoint.ft.transport import RallyTransport, TransferError

from transport_common import (
    FakeSource,
    assert_bitwise_equal,
    drain,
    expect_error,
    frame,
    header,
    manager_like_state,
    read_request,
)

T = timedelta(seconds=20)
STEP = 7


def serving(state, step=STEP, timeout=T) -> RallyTransport:
    t = RallyTransport(timeout=timeout)
    t.send_checkpoint([1], step, state, timeout)
    return t


def heals_afterwards(receiver: RallyTransport) -> None:
    """The transport that just failed heals from a good source."""
    state = manager_like_state(seed=5)
    good = serving(state)
    try:
        assert_bitwise_equal(state, receiver.recv_checkpoint(0, good.metadata(), STEP, T))
    finally:
        good.shutdown()


def big_state(mb: int) -> dict:
    n = mb * (1 << 20) // 4 // 4
    return {"user": {"default": {f"t{i}": torch.arange(n, dtype=torch.float32) + i for i in range(4)}}, "torchft": {"step": STEP}}


class Gate:
    """Holds the receiving thread after its first tensor bytes until released."""

    def __init__(self) -> None:
        self.started, self.go = threading.Event(), threading.Event()
        self.orig = _fetch._Source._recv_into
        gate = self

        def recv_into(src, view, what):
            gate.orig(src, view, what)
            if what.startswith("tensor") and not gate.started.is_set():
                gate.started.set()
                assert gate.go.wait(60), "the test never released the receiver"

        _fetch._Source._recv_into = recv_into

    def close(self) -> None:
        _fetch._Source._recv_into = self.orig


def in_thread(fn):
    """Runs ``fn`` in a thread; returns a join() giving (result, error)."""
    out = {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as e:
            out["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()

    def join():
        th.join(60)
        assert not th.is_alive(), "the receive did not end within 60 s"
        return out.get("result"), out.get("error")

    return join


# -- cases -----------------------------------------------------------------------


def roundtrip() -> None:
    state = manager_like_state()
    state["user"]["default"]["extra"]["big"] = torch.randn(3_000_000)  # 12 MB: several chunks
    sender, receiver = serving(state), RallyTransport(timeout=T)
    assert sender.metadata().startswith("127.0.0.1:"), sender.metadata()
    for _ in range(2):  # a source serves any number of receivers
        n = assert_bitwise_equal(state, receiver.recv_checkpoint(0, sender.metadata(), STEP, T))
    assert n >= 20, n
    # an empty state dict, and one without tensors
    for s in ({}, {"torchft": {"step": 1}}):
        sender.send_checkpoint([1], 8, s, T)
        assert receiver.recv_checkpoint(0, sender.metadata(), 8, T) == s
    sender.shutdown()
    receiver.shutdown()
    print(f"roundtrip: {n} tensors bitwise equal")


def striped() -> None:
    state = manager_like_state()
    state["user"]["default"]["extra"]["big"] = torch.randn(4_000_000)  # 16 MB
    a, b = serving(state), serving(state)
    # Source a sends each piece 5 ms late (a throttle, not a wait for an
    # event): b, however late it connects on a loaded machine, finds pieces
    # left to take, so both serving is certain rather than a race.
    send = a._serving()._send_range

    def slow(*args, **kw):
        time.sleep(0.005)
        return send(*args, **kw)

    a._serving()._send_range = slow
    out = _fetch.recv_striped([a.metadata(), b.metadata()], STEP, T, piece=256 << 10)
    assert_bitwise_equal(state, out)
    sa, sb = a._server.served, b._server.served
    assert sa > 0 and sb > 0, (sa, sb)
    out = RallyTransport(timeout=T).recv_striped([b.metadata(), a.metadata()], STEP, T)
    assert_bitwise_equal(state, out)
    print(f"striped: {sa} bytes from one source, {sb} from the other")


def failover() -> None:
    """Sources that refuse, or die mid-piece, hand their pieces to the others."""
    state = manager_like_state()
    state["user"]["default"]["extra"]["big"] = torch.randn(4_000_000)
    good = serving(state)
    other_step = serving(manager_like_state(), step=STEP + 1)
    probe = _fetch._Source(good.metadata(), STEP, 20)
    h, spec = probe.header()
    probe.close()
    head = _wire.encode_header(STEP, h["token"], h["leaves"],
                               [dict(t, dtype=_wire.dtype_name(t["dtype"]), shape=list(t["shape"])) for t in h["tensors"]])

    def dies_mid_piece(conn):
        read_request(conn)
        conn.sendall(frame(b"H", head) + frame(b"S", spec))
        read_request(conn)
        conn.sendall(_wire.FRAME.pack(b"D", 4096) + b"\0" * 100)

    dying = FakeSource(dies_mid_piece)
    out = _fetch.recv_striped([dying.name, other_step.metadata(), good.metadata()], STEP, T, piece=256 << 10)
    assert_bitwise_equal(state, out)
    dying.close()
    # a silent second source (accepts, never answers): the first source
    # serves its share (the case `blackholed` bounds how soon)
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(1)
    silent = f"127.0.0.1:{mute.getsockname()[1]}"
    out = _fetch.recv_striped([good.metadata(), silent], STEP, timedelta(seconds=2), piece=256 << 10)
    assert_bitwise_equal(state, out)
    mute.close()
    # every source failing: one error naming each
    dead = FakeSource(lambda conn: None)
    msg = expect_error(lambda: _fetch.recv_striped([dead.name, other_step.metadata()], STEP, T), dead.name, other_step.metadata(), cls=TransferError)
    dead.close()
    print(f"failover: {msg[:200]}")


def early() -> None:
    """A receiver that asks before the source has staged the step (under
    torchft's Manager both start when the quorum names them) waits for it."""
    state = manager_like_state(seed=3)
    sender = RallyTransport(timeout=T)
    receiver = RallyTransport(timeout=T)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("sd", receiver.recv_checkpoint(0, sender.metadata(), STEP, T)))
    t.start()
    server = sender._serving()
    deadline = time.monotonic() + 20
    while not server._conns:  # the receiver's request is in
        assert time.monotonic() < deadline, "the receiver never connected"
        time.sleep(0.01)
    sender.send_checkpoint([1], STEP, state, T)
    t.join(30)
    assert not t.is_alive(), "the early receiver never got the step"
    assert_bitwise_equal(state, got["sd"])
    sender.shutdown()
    receiver.shutdown()
    print("early: the receiver waited for the step to be staged")


def wrong_step() -> None:
    receiver = RallyTransport(timeout=T)
    # A header request for a step not staged waits the source's timeout
    # (see `early`): short ones here.
    idle = RallyTransport(timeout=timedelta(seconds=1))
    expect_error(lambda: receiver.recv_checkpoint(0, idle.metadata(), STEP, T), idle.metadata(), f"step {STEP}", "serves no step", cls=TransferError)
    sender = serving(manager_like_state(), timeout=timedelta(seconds=1))
    msg = expect_error(lambda: receiver.recv_checkpoint(0, sender.metadata(), STEP + 1, T), sender.metadata(), f"step {STEP + 1}", f"serves step {STEP}", cls=TransferError)
    sender.disallow_checkpoint()
    expect_error(lambda: receiver.recv_checkpoint(0, sender.metadata(), STEP, T), "serves no step", cls=TransferError)
    expect_error(lambda: receiver.recv_checkpoint(0, "no-port-here", STEP, T), "malformed checkpoint source", cls=TransferError)
    heals_afterwards(receiver)
    print(f"wrong_step: {msg}")


def serve(mb: str) -> None:
    t = serving(big_state(int(mb)))
    print(f"SERVING {t.metadata()}", flush=True)
    select.select([sys.stdin], [], [], 120)  # until the test kills us
    t.shutdown()


def died() -> None:
    script = os.path.abspath(__file__)
    proc = subprocess.Popen([sys.executable, script, "serve", "256"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the sender did not start within 60 s"
        line = proc.stdout.readline()
        assert line.startswith("SERVING "), line
        source = line.split()[1]
        receiver = RallyTransport(timeout=T)
        gate = Gate()
        join = in_thread(lambda: receiver.recv_checkpoint(0, source, STEP, T))
        assert gate.started.wait(60), f"no tensor byte arrived within 60 s: {join()}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
        gate.go.set()
        result, err = join()
        gate.close()
        assert result is None and isinstance(err, TransferError), (result, err)
        msg = str(err)
        assert source in msg and "tensor ['user']['default']['t" in msg, msg
        heals_afterwards(receiver)
        print(f"died: {msg}")
    finally:
        proc.kill()
        proc.wait(60)


def _one_tensor_source(behaviour):
    t = torch.zeros(1024)
    spec = pickle.dumps((tree_flatten({"w": t})[1], {}))
    head = header(STEP, [{"leaf": 0, "path": "['w']", "dtype": "float32", "shape": [1024], "nbytes": 4096}], 1)

    def script(conn):
        read_request(conn)
        conn.sendall(frame(b"H", head) + frame(b"S", spec))
        read_request(conn)
        behaviour(conn)

    return FakeSource(script)


def truncated() -> None:
    receiver = RallyTransport(timeout=T)
    cases = [
        (lambda c: c.sendall(_wire.FRAME.pack(b"D", 4096) + b"\1" * 100), ["100 of 4096 bytes of tensor ['w']"]),
        (lambda c: c.sendall(_wire.FRAME.pack(b"D", 8192) + b"\1" * 8192), ["malformed frame", "tensor ['w']"]),
        (lambda c: c.sendall(_wire.FRAME.pack(b"D", 2)), ["0 of 2 bytes", "tensor ['w']"]),
    ]
    for behaviour, needles in cases:
        src = _one_tensor_source(behaviour)
        msg = expect_error(lambda: receiver.recv_checkpoint(0, src.name, STEP, T), src.name, *needles, cls=TransferError)
        src.close()
        print(f"truncated: {msg}")
    heals_afterwards(receiver)


def mismatch() -> None:
    state = manager_like_state(width=64)
    sender = serving(state)
    mine = manager_like_state(seed=3, width=32)
    before = copy.deepcopy(mine)
    like = {"now": mine}
    receiver = RallyTransport(timeout=T, state_dict=lambda: like["now"])
    msg = expect_error(lambda: receiver.recv_checkpoint(0, sender.metadata(), STEP, T),
                       sender.metadata(), "tensor ['user']['default']['model']['0.weight']", "float32[64, 64]", "float32[32, 32]", cls=TransferError)
    assert_bitwise_equal(before, mine)  # untouched
    mine2 = manager_like_state(seed=3, width=64)
    mine2["user"]["default"]["extra"]["f16"] = mine2["user"]["default"]["extra"]["f16"].to(torch.bfloat16)
    receiver2 = RallyTransport(timeout=T, state_dict=lambda: mine2)
    expect_error(lambda: receiver2.recv_checkpoint(0, sender.metadata(), STEP, T), "['f16']", "float16[5, 7]", "bfloat16[5, 7]", cls=TransferError)
    # a fresh replica: same model, an optimizer without state yet -> accepted
    torch.manual_seed(9)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    fresh = {"user": {"default": {"model": m.state_dict(), "optim": torch.optim.AdamW(m.parameters()).state_dict()}}, "torchft": {"step": 0}}
    before = copy.deepcopy(fresh)
    out = RallyTransport(timeout=T, state_dict=lambda: fresh).recv_checkpoint(0, sender.metadata(), STEP, T)
    assert_bitwise_equal(state, out)
    assert_bitwise_equal(before, fresh)  # received into fresh buffers, never in place
    like["now"] = fresh  # the next quorum's source matches this replica's model
    heals_afterwards(receiver)
    print(f"mismatch: {msg}")


def malformed() -> None:
    receiver = RallyTransport(timeout=T)
    spec = pickle.dumps((tree_flatten({"w": torch.zeros(2)})[1], {}))
    ok_entry = {"leaf": 0, "path": "['w']", "dtype": "float32", "shape": [2], "nbytes": 8}
    cases = [
        (frame(b"H", b"{not json"), "header is not JSON"),
        (frame(b"H", header(STEP, [dict(ok_entry, dtype="float99")], 1)), "unknown dtype 'float99'"),
        (frame(b"H", header(STEP, [dict(ok_entry, nbytes=9)], 1)), "tensor ['w']: 9 bytes"),
        (frame(b"H", header(STEP, [dict(ok_entry, shape=[-1])], 1)), "bad shape"),
        (frame(b"H", header(STEP, [dict(ok_entry, leaf=3)], 1)), "leaf index 3"),
        (frame(b"H", header(STEP + 1, [ok_entry], 1)), f"header is for step {STEP + 1}"),
        (frame(b"D", b"xx"), "where the header of step"),
        (_wire.FRAME.pack(b"H", 0xFFFFFFFF), "malformed 4294967295-byte frame"),
        (frame(b"H", header(STEP, [ok_entry], 1)) + frame(b"S", b"not a pickle"), "malformed pytree spec"),
        (frame(b"H", header(STEP, [ok_entry], 2)) + frame(b"S", spec), "malformed pytree spec"),
    ]
    for reply, needle in cases:
        def script(conn, reply=reply):
            read_request(conn)
            conn.sendall(reply)
            drain(conn)

        src = FakeSource(script)
        msg = expect_error(lambda: receiver.recv_checkpoint(0, src.name, STEP, T), src.name, needle, cls=TransferError)
        src.close()
        print(f"malformed: {msg}")
    heals_afterwards(receiver)


def _raw(source: str) -> socket.socket:
    host, port = _fetch.parse_source(source)
    s = socket.create_connection((host, port), timeout=30)
    return s


def hostile() -> None:
    state = big_state(64)
    sender = serving(state)
    garbage = _raw(sender.metadata())
    garbage.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 22)
    kind, n = _wire.FRAME.unpack(garbage.recv(5, socket.MSG_WAITALL))
    reply = garbage.recv(n, socket.MSG_WAITALL)
    assert kind == b"E" and b"not a rallypoint checkpoint request" in reply, (kind, reply)
    half = _raw(sender.metadata())
    half.sendall(_wire.encode_request(_wire.KIND_META, STEP)[:17])
    stalled = _raw(sender.metadata())
    stalled.sendall(_wire.encode_request(_wire.KIND_META, STEP))
    kind, n = _wire.FRAME.unpack(stalled.recv(5, socket.MSG_WAITALL))
    h = _wire.decode_header(stalled.recv(n, socket.MSG_WAITALL), STEP)
    stalled.sendall(_wire.encode_request(_wire.KIND_RANGE, STEP, h["token"], 0, 64 << 20))  # and never reads
    # the others' transfers go on
    assert_bitwise_equal(state, RallyTransport(timeout=T).recv_checkpoint(0, sender.metadata(), STEP, T))
    t0 = time.monotonic()
    sender.disallow_checkpoint()  # cuts the stalled reader's stream
    took = time.monotonic() - t0
    assert took < 15, took
    stalled.settimeout(30)
    got = 0
    try:
        while (k := len(stalled.recv(1 << 20))) > 0:
            got += k
    except ConnectionResetError:
        pass
    assert got < 64 << 20, got
    # and the sender serves the next step
    state2 = manager_like_state()
    sender.send_checkpoint([1], STEP + 1, state2, T)
    assert_bitwise_equal(state2, RallyTransport(timeout=T).recv_checkpoint(0, sender.metadata(), STEP + 1, T))
    for s in (garbage, half, stalled):
        s.close()
    sender.shutdown()
    print(f"hostile: disallow_checkpoint cut a stalled reader in {took:.2f}s after {got} bytes")


def timeout() -> None:
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(1)  # the kernel accepts the connection; nobody answers
    name = f"127.0.0.1:{mute.getsockname()[1]}"
    receiver = RallyTransport(timeout=T)
    t0 = time.monotonic()
    msg = expect_error(lambda: receiver.recv_checkpoint(0, name, STEP, timedelta(seconds=1)),
                       "timed out after 1.0s", f"the header of step {STEP}", name, cls=TimeoutError)
    assert time.monotonic() - t0 < 15
    mute.close()
    heals_afterwards(receiver)
    print(f"timeout: {msg}")


def disallow_midway() -> None:
    state = big_state(64)
    sender, receiver = serving(state), RallyTransport(timeout=T)
    gate = Gate()
    join = in_thread(lambda: receiver.recv_checkpoint(0, sender.metadata(), STEP, T))
    assert gate.started.wait(60), "no tensor byte arrived within 60 s"
    sender.disallow_checkpoint()  # the receiver is not reading: its stream is cut
    for v in tree_flatten(state)[0]:  # the optimizer steps
        if isinstance(v, torch.Tensor):
            v.fill_(-1)
    gate.go.set()
    result, err = join()
    gate.close()
    assert result is None and isinstance(err, TransferError), (result, err)
    assert sender.metadata() in str(err) and "tensor ['user']['default']['t" in str(err), err
    heals_afterwards(receiver)
    print(f"disallow_midway: {err}")


def stuck_freeze() -> None:
    """Review item 3: a transfer that its socket's shutdown does not end
    (a thread stuck outside the socket) must not make disallow_checkpoint
    raise: torchft calls it inside should_commit, outside any try."""
    import logging

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("rallypoint.ft._serve").addHandler(Keep())
    sender = serving(manager_like_state(), timeout=timedelta(seconds=1))
    server = sender._server
    a, b = socket.socketpair()
    with server._lock:
        server._active[a] = "127.0.0.1:9 (stuck)"  # a transfer nobody ends
    t0 = time.monotonic()
    sender.disallow_checkpoint()  # must return, not raise
    took = time.monotonic() - t0
    assert took < 10, took  # CUT_AFTER + the 1 s timeout, well under
    assert any("127.0.0.1:9 (stuck)" in r for r in records), records
    with server._lock:
        server._active.pop(a, None)
    # the step is no longer served; the next one is
    expect_error(lambda: RallyTransport(timeout=T).recv_checkpoint(0, sender.metadata(), STEP, T),
                 "not served here", cls=TransferError)
    state2 = manager_like_state(seed=2)
    sender.send_checkpoint([1], STEP + 1, state2, T)
    assert_bitwise_equal(state2, RallyTransport(timeout=T).recv_checkpoint(0, sender.metadata(), STEP + 1, T))
    a.close(), b.close()
    sender.shutdown()
    print(f"stuck_freeze: returned in {took:.2f}s, logged {records[-1]}")


def huge_header() -> None:
    """Review item 8: a header naming a huge shape is refused naming the source
    and the tensor before anything is allocated; a boolean leaf is refused."""
    allocated = []
    orig = _fetch._Buffers.__init__

    def counting(self, *a, **k):
        allocated.append(a)
        orig(self, *a, **k)

    _fetch._Buffers.__init__ = counting
    spec = pickle.dumps((tree_flatten({"w": torch.zeros(2)})[1], {}))
    huge = {"leaf": 0, "path": "['w']", "dtype": "float32", "shape": [2**40], "nbytes": 4 * 2**40}
    receiver = RallyTransport(timeout=T)
    like = RallyTransport(timeout=T, state_dict=lambda: {"other": torch.zeros(3)})
    for r in (receiver, like):
        def script(conn):
            read_request(conn)
            conn.sendall(frame(b"H", header(STEP, [huge], 1)) + frame(b"S", spec))
            drain(conn)

        src = FakeSource(script)
        msg = expect_error(lambda: r.recv_checkpoint(0, src.name, STEP, T), src.name, "tensor ['w']", "nothing was allocated", cls=TransferError)
        src.close()
        print(f"huge_header: {msg}")
    assert not allocated, allocated
    _fetch._Buffers.__init__ = orig
    ok = {"leaf": 0, "path": "['w']", "dtype": "float32", "shape": [2], "nbytes": 8}
    for bad, needle in ((dict(ok, leaf=False), "leaf index False"), (dict(ok, shape=[True, 2], nbytes=8), "bad shape"),
                        (dict(ok, dtype="int8", shape=[1], nbytes=True), "True bytes")):
        expect_error(lambda: _wire.decode_header(header(STEP, [bad], 1), STEP), needle, cls=_wire.WireError)
    heals_afterwards(receiver)


def idle_meta() -> None:
    """Review item 9: MAX_CONNECTIONS idle header requests for a future step
    do not starve a receiver of the staged one."""
    from rallypoint.ft import _serve

    state = manager_like_state()
    sender = serving(state)
    _serve.MAX_WAITING = _serve.MAX_CONNECTIONS  # so that one more waiter is refused below
    idle = []
    for _ in range(_serve.MAX_CONNECTIONS):
        s = _raw(sender.metadata())
        s.sendall(_wire.encode_request(_wire.KIND_META, STEP + 1))
        idle.append(s)
    deadline = time.monotonic() + 30
    while sender._server._waiting < len(idle):  # every one parked in its wait
        assert time.monotonic() < deadline, f"only {sender._server._waiting} of {len(idle)} requests wait after 30 s"
        time.sleep(0.01)
    extra = _raw(sender.metadata())
    extra.sendall(_wire.encode_request(_wire.KIND_META, STEP + 1))
    kind, n = _wire.FRAME.unpack(extra.recv(5, socket.MSG_WAITALL))
    reply = extra.recv(n, socket.MSG_WAITALL)
    assert kind == b"E" and b"already wait for a step not staged yet" in reply, (kind, reply)
    extra.close()
    t0 = time.monotonic()
    assert_bitwise_equal(state, RallyTransport(timeout=T).recv_checkpoint(0, sender.metadata(), STEP, T))
    took = time.monotonic() - t0
    assert took < T.total_seconds() / 2, took
    # the waiters get the step once it is staged
    state2 = manager_like_state(seed=2)
    sender.send_checkpoint([1], STEP + 1, state2, T)
    for s in idle:
        kind, n = _wire.FRAME.unpack(s.recv(5, socket.MSG_WAITALL))
        assert kind == b"H", (kind, s.recv(n, socket.MSG_WAITALL))
        s.close()
    sender.shutdown()
    print(f"idle_meta: a receiver behind {len(idle)} waiting header requests healed in {took:.2f}s")


def blackholed() -> None:
    """Review item 10: a second source that accepts and never answers does not
    hold its share of a striped receive until its own deadline."""
    state = big_state(16)
    good = serving(state)
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(1)
    silent = f"127.0.0.1:{mute.getsockname()[1]}"
    t0 = time.monotonic()
    alone = _fetch.recv_striped([good.metadata()], STEP, T, piece=256 << 10)
    own = time.monotonic() - t0
    assert_bitwise_equal(state, alone)
    t0 = time.monotonic()
    out = _fetch.recv_striped([good.metadata(), silent], STEP, T, piece=256 << 10)
    took = time.monotonic() - t0
    assert_bitwise_equal(state, out)
    # the timeout is 20 s: the silent source must cost nothing like it
    assert took < own + 5, (took, own)
    mute.close()
    good.shutdown()
    print(f"blackholed: {took:.2f}s with a silent second source, {own:.2f}s from the good one alone")


CASES = {f.__name__: f for f in (roundtrip, early, striped, failover, wrong_step, died, truncated, mismatch, malformed, hostile, timeout, disallow_midway,
                                       stuck_freeze, huge_header, idle_meta, blackholed)}

if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        CASES[sys.argv[1]]()
        print(f"PASS {sys.argv[1]}")
