"""Rank 0 blocks in a gloo all_reduce whose peer died.

Both ranks finish one all_reduce (connected). Rank 0 then enters a second
one in `exchange_gradients`; rank 1 never does: it leaves a child holding its
sockets open (as a dead host leaves its connections: no FIN, gloo keeps
waiting) and, once `SYNC_DIR/go` exists, exits with code 3.
"""
import os
import time

import torch
import torch.distributed as dist


def exchange_gradients(t):
    dist.all_reduce(t)


def main():
    sync_dir = os.environ["SYNC_DIR"]
    dist.init_process_group("gloo")
    t = torch.ones(4)
    dist.all_reduce(t)
    if dist.get_rank() == 0:
        # Written whole, then renamed: the test never reads half of it.
        tmp = os.path.join(sync_dir, "pid0.tmp")
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.rename(tmp, os.path.join(sync_dir, "pid0"))
        exchange_gradients(t)
        os._exit(0)
    if os.fork() == 0:
        time.sleep(3600)
        os._exit(0)
    while not os.path.exists(os.path.join(sync_dir, "go")):
        time.sleep(0.01)
    os._exit(3)


main()
