"""torchft's own lighthouse (``torchft._torchft.LighthouseServer``) for the
``pg_torchft.py`` replicas, with a TCPStore beside it for the test's own
coordination (which step the victim dies in, when it died).

Knobs (environment): MIN_REPLICAS, JOIN_TIMEOUT_MS, HEARTBEAT_TIMEOUT_MS;
OWN=0 runs the coordination store alone (the test runs ``rally lighthouse``).
Writes ``RESULT_DIR/lighthouse.json`` = {"address", "coord_port"} once both
listen, then serves until its standard input closes (the test's end), and
ends normally.
"""

import json
import os
import sys
from datetime import timedelta

import torch.distributed as dist
from torchft._torchft import LighthouseServer

OUT = os.environ["RESULT_DIR"]
# OWN=0: only the coordination store (the test runs `rally lighthouse`).
lh = None
if os.environ.get("OWN", "1") == "1":
    lh = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=int(os.environ.get("MIN_REPLICAS", "1")),
        join_timeout_ms=int(os.environ.get("JOIN_TIMEOUT_MS", "1000")),
        heartbeat_timeout_ms=int(os.environ.get("HEARTBEAT_TIMEOUT_MS", "500")),
    )
coord = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
path = os.path.join(OUT, "lighthouse.json")
with open(path + ".tmp", "w") as f:
    # It names itself by hostname; it listens on loopback.
    address = f"http://127.0.0.1:{lh.address().rsplit(':', 1)[1]}" if lh is not None else ""
    json.dump({"address": address, "coord_port": coord.port}, f)
os.rename(path + ".tmp", path)
sys.stdin.read()
if lh is not None:
    lh.shutdown()
