"""Rank 1 waits forever in a named function; rank 0 fails once rank 1 is in it.

SYNC_DIR: rank 1 writes `in_wait` there from inside `wait_forever`.
"""
import os
import sys
import time


def wait_forever(sync_dir):
    open(os.path.join(sync_dir, "in_wait"), "w").close()
    while True:
        time.sleep(3600)


def main():
    sync_dir = os.environ["SYNC_DIR"]
    if os.environ["LOCAL_RANK"] == "0":
        while not os.path.exists(os.path.join(sync_dir, "in_wait")):
            time.sleep(0.01)
        if os.environ.get("FAIL", "1") == "1":
            sys.exit(3)
        time.sleep(3600)
    wait_forever(sync_dir)


main()
