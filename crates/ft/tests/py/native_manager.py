"""rallypoint._native.FtManager against torchft's own lighthouse.

Two managers (replica groups g0 at step 3 and g1 at step 0, two ranks each)
in this process, their workers speaking the JSON-lines protocol over plain
sockets from threads: one quorum of both, g1 healing from g0 with g0's
metadata for its rank (torchft's lighthouse carries `data` as given);
should_commit; the status dict; bad arguments; shutdown twice. Prints
"ok" at the end; any failure raises.
"""

import json
import socket
import threading
import time

from torchft.coordination import LighthouseServer

from rallypoint._native import FtManager

LIMIT_S = 30.0


class Worker:
    def __init__(self, address, rank, world):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=LIMIT_S)
        self.rd = self.sock.makefile("rb")
        a = self.call({"op": "hello", "group_rank": rank, "group_world_size": world, "pid": 1})
        assert a["ok"], a

    def call(self, req):
        self.sock.sendall((json.dumps(req) + "\n").encode())
        line = self.rd.readline()
        assert line, "the manager closed the connection"
        return json.loads(line)

    def close(self):
        self.rd.close()
        self.sock.close()


def all_at_once(calls):
    """Runs the calls in threads; their answers in order."""
    out = [None] * len(calls)

    def run(i, f):
        out[i] = f()

    ts = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(calls)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(LIMIT_S)
        assert not t.is_alive(), "a call never returned"
    return out


def wait_for(what, ok):
    deadline = time.monotonic() + LIMIT_S
    while not ok():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def main():
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=60000)
    url = "http://127.0.0.1:" + lh.address().rsplit(":", 1)[1]
    try:
        FtManager("g", url, 1, bind="nope")
        raise AssertionError("a bad bind was accepted")
    except ValueError as e:
        assert "nope" in str(e), e
    try:
        FtManager("g", "ftp://x", 1, bind="127.0.0.1:0")
        raise AssertionError("a bad lighthouse was accepted")
    except RuntimeError as e:
        assert "ftp://x" in str(e), e

    try:
        FtManager("g", url, 1, bind="127.0.0.1:0", connect_timeout=-1.0)
        raise AssertionError("a negative connect timeout was accepted")
    except ValueError as e:
        assert "-1" in str(e), e

    # connect_timeout (rallypoint.ft's keyword) and connect_timeout_s.
    ms = [
        FtManager("g0", url, 2, bind="127.0.0.1:0", connect_timeout_s=10.0),
        FtManager(replica_id="g1", lighthouse=url, world_size=2, bind="127.0.0.1:0", connect_timeout=10.0),
    ]
    ws = [[Worker(m.address(), r, 2) for r in range(2)] for m in ms]
    steps = [3, 0]
    calls = [
        (lambda g=g, r=r: ws[g][r].call({"op": "quorum", "step": steps[g],
                                          "metadata": f"g{g}r{r}:1", "timeout_ms": 20000}))
        for g in range(2) for r in range(2)
    ]
    answers = all_at_once(calls)
    for a in answers:
        assert a["ok"], a
    q = [[answers[2 * g + r]["quorum"] for r in range(2)] for g in range(2)]
    ids = {q[g][r]["quorum_id"] for g in range(2) for r in range(2)}
    assert len(ids) == 1, q
    for r in range(2):
        assert q[0][r]["heal"] is False, q
        assert q[0][r]["recover_dst_replica_ranks"] == [1], q
        assert q[1][r]["heal"] is True, q
        assert q[1][r]["recover_src_replica_rank"] == 0, q
        assert q[1][r]["recover_src_metadata"] == f"g0r{r}:1", q
        assert q[1][r]["max_step"] == 3, q
        assert q[1][r]["store_address"] == ms[0].store_address(), q
        assert q[1][r]["replica_ids"] == ["g0", "g1"], q

    votes = all_at_once([
        (lambda g=g, r=r: ws[g][r].call({"op": "should_commit", "step": 3, "vote": True,
                                          "timeout_ms": 20000}))
        for g in range(2) for r in range(2)
    ])
    assert all(v == {"ok": True, "commit": True} for v in votes), votes

    s = ms[1].status()
    assert s["replica_id"] == "g1", s
    assert s["lighthouse"] == url, s
    assert s["quorum_id"] == ids.pop(), s
    assert s["members"] == ["g0", "g1"], s
    assert s["commits"] == 1 and s["max_step"] == 3, s
    wait_for("connected", lambda: ms[1].status()["connected"])

    ms[1].workers_stopped("the test stopped g1")
    wait_for("disconnected", lambda: not ms[1].status()["connected"])

    for g in ws:
        for w in g:
            w.close()
    for m in ms:
        m.shutdown()
        m.shutdown()
    try:
        ms[0].workers_stopped("late")
        raise AssertionError("a call after shutdown was accepted")
    except RuntimeError as e:
        assert "shut down" in str(e), e
    lh.shutdown()
    print("ok")


if __name__ == "__main__":
    main()
