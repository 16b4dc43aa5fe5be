"""Writes its pid to $MARKER_DIR/<RANK>.pid, then records SIGTERM in
$MARKER_DIR/<RANK>.term and keeps running (so only SIGKILL ends it)."""
import os
import signal
import time

d = os.environ["MARKER_DIR"]
rank = os.environ["RANK"]


def on_term(signum, frame):
    open(os.path.join(d, rank + ".term"), "w").close()


signal.signal(signal.SIGTERM, on_term)
with open(os.path.join(d, rank + ".pid.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.rename(os.path.join(d, rank + ".pid.tmp"), os.path.join(d, rank + ".pid"))
while True:
    time.sleep(0.05)
