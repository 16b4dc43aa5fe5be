"""PyTorch's side of `rallypoint-bench rendezvous`: ONE node, in its own process,
with its own TCPStore client to the benchmark's store server. Same protocol as
our `rdzv-node`: build the c10d DynamicRendezvousHandler, count in at
`bench/ready`, wait for `bench/go`, run one round (min = max = N), print
`RESULT <unix time at the end> <store ops> <rank>` on stderr.

usage: rdzv_bench.py PORT RUN_ID N INDEX"""

import sys
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

port, run_id, n, index = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ops = 0


class Counting(dist.Store):
    """Counts the store operations this node makes."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def _count(self):
        global ops
        ops += 1

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


def client():
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=900))


control = client()
store = Counting(client())
backend = C10dRendezvousBackend(store, run_id)
params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id=run_id,
                              min_nodes=n, max_nodes=n, local_addr="127.0.0.1",
                              join_timeout="900", last_call_timeout="30")
handler = create_handler(store, backend, params)
ops = 0  # count only the round, as our side does
control.add("bench/ready", 1)
control.wait(["bench/go"])
rank = handler.next_rendezvous().rank
end = time.time()
handler._stop_heartbeats()
print(f"RESULT {end:.6f} {ops} {rank}", file=sys.stderr, flush=True)
