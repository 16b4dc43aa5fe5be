"""A Python worker that waits in a named function until it is stopped:
touches $BENCH_DIR/ready.<LOCAL_RANK> once it is there."""
import os
import time


def wait_forever():
    open(os.path.join(os.environ["BENCH_DIR"], "ready." + os.environ["LOCAL_RANK"]), "w").close()
    while True:
        time.sleep(3600)


wait_forever()
