"""What a worker sees of its terminal: whether each standard stream is a tty,
then a tqdm-style progress update ended by "\r" only, then a line read from
stdin (the test types it once it has seen the progress update)."""
import sys


def tty(f):
    return "T" if f.isatty() else "F"


print(f"PROBE stdin={tty(sys.stdin)} stdout={tty(sys.stdout)} stderr={tty(sys.stderr)}", flush=True)
sys.stdout.write("PROGRESS 50%\r")
sys.stdout.flush()
line = sys.stdin.readline()
print(f"GOT {line.strip()}", flush=True)
