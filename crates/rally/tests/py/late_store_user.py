"""A worker that uses the job store (MASTER_ADDR:MASTER_PORT) late: rank 0
exits at once; the other ranks wait $LATE seconds, then set and read a key, as a
final barrier or a checkpoint handshake would. A job store shut when rank 0's
node finished fails them."""
import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist

rank = int(os.environ["RANK"])
if rank == 0:
    sys.exit(0)
time.sleep(float(os.environ.get("LATE", "3")))
store = dist.TCPStore(
    os.environ["MASTER_ADDR"],
    int(os.environ["MASTER_PORT"]),
    is_master=False,
    timeout=timedelta(seconds=10),
)
store.set(f"late/{rank}", b"done")
assert store.get(f"late/{rank}") == b"done"
print(f"rank {rank} used the job store after rank 0 exited", flush=True)
