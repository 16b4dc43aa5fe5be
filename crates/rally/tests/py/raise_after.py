"""Sleeps $RAISE_AFTER seconds, then raises under torch's @record, so the
error file carries the exception (the root cause every node must name)."""
import os
import time

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    time.sleep(float(os.environ.get("RAISE_AFTER", "1")))
    raise RuntimeError("the host's worker broke on purpose")


main()
