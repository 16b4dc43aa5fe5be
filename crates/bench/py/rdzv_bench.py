"""PyTorch's side of `rallypoint-bench rendezvous`: N DynamicRendezvousHandlers
(c10d backend), one thread and one TCPStore client each, through one round with
min = max = N. Prints `RESULT <seconds> <store ops per node>` on stderr."""

import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

n = int(sys.argv[1])
master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                       timeout=timedelta(seconds=900))
port = master.port
ops = [0] * n
ranks = [None] * n
errors = []


class Counting(dist.Store):
    """Counts the store operations one node makes."""

    def __init__(self, inner, i):
        super().__init__()
        self.inner, self.i = inner, i

    def _count(self):
        ops[self.i] += 1

    def set(self, k, v):
        self._count(); return self.inner.set(k, v)

    def get(self, k):
        self._count(); return self.inner.get(k)

    def add(self, k, v):
        self._count(); return self.inner.add(k, v)

    def compare_set(self, k, e, d):
        self._count(); return self.inner.compare_set(k, e, d)

    def check(self, keys):
        self._count(); return self.inner.check(keys)

    def wait(self, keys, timeout=None):
        self._count()
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def multi_get(self, keys):
        self._count(); return self.inner.multi_get(keys)

    def multi_set(self, keys, values):
        self._count(); return self.inner.multi_set(keys, values)

    def delete_key(self, k):
        self._count(); return self.inner.delete_key(k)

    def num_keys(self):
        self._count(); return self.inner.num_keys()

    def set_timeout(self, t):
        return self.inner.set_timeout(t)

    @property
    def timeout(self):
        return self.inner.timeout


start = threading.Barrier(n + 1)


def node(i):
    try:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=900))
        store = Counting(client, i)
        backend = C10dRendezvousBackend(store, "bench")
        params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="bench",
                                      min_nodes=n, max_nodes=n, local_addr="127.0.0.1",
                                      join_timeout="900", last_call_timeout="30")
        handler = create_handler(store, backend, params)
        start.wait()
        ranks[i] = handler.next_rendezvous().rank
        handler._stop_heartbeats()
    except Exception as e:  # report, do not hang the barrier
        errors.append(repr(e))
        start.abort()


threads = [threading.Thread(target=node, args=(i,), daemon=True) for i in range(n)]
for t in threads:
    t.start()
start.wait()
t0 = time.perf_counter()
for t in threads:
    t.join()
took = time.perf_counter() - t0
if errors:
    raise SystemExit(f"errors: {errors[:3]}")
assert sorted(ranks) == list(range(n)), ranks
print(f"RESULT {took:.6f} {sum(ops) / n:.1f}", file=sys.stderr, flush=True)
