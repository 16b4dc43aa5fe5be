"""PyTorch's TCPStore client against a server at argv[1]:argv[2]: every method it
exposes, with PyTorch's own semantics as the expected result. Prints OK at the end."""

import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

host, port = sys.argv[1], int(sys.argv[2])

# world_size=2 makes the client ADD "init/" 1, as every PyTorch worker does.
store = dist.TCPStore(host, port, world_size=2, is_master=False,
                      timeout=timedelta(seconds=10))
other = store.clone()  # second connection: VALIDATE + PING again, no init/ add

store.set("k1", "v1")
assert store.get("k1") == b"v1"
store.set("bin", b"\x00\xff")
assert other.get("bin") == b"\x00\xff"

assert store.add("cnt", 5) == 5
assert store.add("cnt", -7) == -2
assert store.get("cnt") == b"-2"
store.set("junky", " 12xyz")
assert store.add("junky", 1) == 13  # stoll semantics

assert store.compare_set("cs", "expected", "desired") == b"expected"
assert not store.check(["cs"])
assert store.compare_set("cs", "", "first") == b"first"
assert store.compare_set("cs", "first", "second") == b"second"
assert store.compare_set("cs", "nope", "third") == b"second"

assert store.check(["k1", "cnt"])
assert not store.check(["k1", "missing"])

assert store.delete_key("k1") is True
assert store.delete_key("k1") is False

store.multi_set(["m1", "m2"], ["a", "bb"])
assert store.multi_get(["m2", "m1"]) == [b"bb", b"a"]

store.append("ap", "ab")
store.append("ap", "cd")
assert store.get("ap") == b"abcd"

keys = sorted(store.list_keys())
assert keys == ["ap", "bin", "cnt", "cs", "junky", "m1", "m2"], keys
# num_keys counts init/ too (1 from this client's world_size)
assert store.num_keys() == len(keys) + 1, store.num_keys()

# wait: immediate, then released by another connection, then a timeout
store.wait(["ap"])
def later():
    time.sleep(0.2)
    other.set("late", "x")
threading.Thread(target=later).start()
store.wait(["late"], timedelta(seconds=5))
t0 = time.time()
try:
    store.wait(["never"], timedelta(milliseconds=200))
    raise AssertionError("wait should have timed out")
except dist.DistStoreError as e:
    assert "wait timeout" in str(e) or "timeout" in str(e).lower(), e
assert time.time() - t0 >= 0.19
# the connection is still in sync after CANCEL_WAIT
assert store.get("late") == b"x"

# blocking get released by a set
threading.Thread(target=lambda: (time.sleep(0.2), other.set("lateget", "y"))).start()
assert store.get("lateget") == b"y"

# timeouts
store.set_timeout(timedelta(seconds=3))
assert store.timeout == timedelta(seconds=3)

# queues
assert store.queue_len("q") == 0
store.queue_push("q", "i1")
store.queue_push("q", "i2")
assert store.queue_len("q") == 2
assert store.queue_pop("q") == b"i1"
assert store.queue_pop("q", block=False) == b"i2"
try:
    store.queue_pop("q", block=False)
    raise AssertionError("pop of an empty queue should fail")
except dist.QueueEmptyError:
    pass
threading.Thread(target=lambda: (time.sleep(0.2), other.queue_push("q", "i3"))).start()
assert store.queue_pop("q", block=True) == b"i3"

# BARRIER (command 18) through two connections
done = []
t = threading.Thread(target=lambda: (other.barrier("bar", 2), done.append(1)))
t.start()
time.sleep(0.1)
assert not done
store.barrier("bar", 2)
t.join(5)
assert done

assert store.libuvBackend in (True, False)
assert store.port == port
assert store.host == host
assert store.has_extended_api()
print("OK")
