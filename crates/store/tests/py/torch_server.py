"""Hosts PyTorch's own TCPStore server (libuv unless argv[1] == "legacy"), prints
"PORT <n>", and serves until stdin closes."""

import sys
from datetime import timedelta

import torch.distributed as dist

use_libuv = not (len(sys.argv) > 1 and sys.argv[1] == "legacy")
port = int(sys.argv[2]) if len(sys.argv) > 2 else 0
store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=30), use_libuv=use_libuv)
print(f"PORT {store.port}", flush=True)
sys.stdin.read()
