"""PyTorch's FileStore on a file shared with rallypoint.

  torch_filestore.py layout PATH     -- write the reference sequence, print the file as hex
  torch_filestore.py share PATH      -- read what Rust wrote, write for Rust, then exit
"""

import sys
from datetime import timedelta

import torch.distributed as dist

mode, path = sys.argv[1], sys.argv[2]
if mode == "layout":
    s = dist.FileStore(path, 2)
    s.set("a", "xy")
    s.add("c", 3)
    s.add("c", 4)
    s.delete_key("a")
    s.compare_set("cs", "", "v")
    with open(path, "rb") as f:
        print(f.read().hex())
elif mode == "share":
    s = dist.FileStore(path, 2)
    s.set_timeout(timedelta(seconds=10))
    assert s.get("from_rust") == b"hello", s.get("from_rust")
    assert s.add("counter", 10) == 15  # Rust added 5
    assert not s.check(["deleted_by_rust"])
    assert s.compare_set("cas", "r1", "p1") == b"p1"
    s.set("from_py", "world")
    s.set("to_delete", "x")
    print("OK", flush=True)
    # Destructor: cleanup/ += 1, refcount/ -= 1; Rust is still open, so no removal.
else:
    raise SystemExit(f"unknown mode {mode}")
