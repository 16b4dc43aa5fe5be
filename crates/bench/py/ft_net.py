"""Where ``ft_bench.py`` runs its lighthouse and replicas: on loopback, or on
test hosts (network namespaces on a bridge).

Both kinds answer the same three questions for place ``i`` (replica ``i``'s
host; the lighthouse is at place 0): the argv prefix that runs a program
there, the address things there listen on, and whether something listens
at an address as seen from there.

``Hosts(n)`` starts ``crates/testhosts/examples/hold.rs`` (``hold N``) in a
session of its own, so that a Ctrl-C reaches this script first, and reads
the hosts it made from its first line (name, address, namespace, argv
prefix). ``cut(i)`` and ``heal(i)`` send it ``cut I`` / ``heal I`` and return
its time of the fault (unix seconds, taken once the ``ip`` command
returned). ``close()`` closes its standard input, on which it tears every
host down (processes, links, namespaces, ``/etc/netns`` files) and exits;
since the pipe also closes when this process ends, however it ends, the
hosts never outlive the benchmark.
"""

import json
import select
import socket
import subprocess
import time

# A client that connects to ADDR:PORT (argv), retrying for up to DEADLINE
# seconds; exit status 0 once connected. Run inside a host's namespace.
_PROBE = """
import socket, sys, time
addr, port, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + limit
while True:
    try:
        socket.create_connection((addr, port), timeout=0.2).close()
        sys.exit(0)
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(1)
        time.sleep(0.02)
"""


class Loopback:
    """Everything in this network namespace, on 127.0.0.1."""

    name = "loopback"

    def prefix(self, i: int) -> list:
        return []

    def addr(self, i: int) -> str:
        return "127.0.0.1"

    def listening(self, i: int, port: int, limit: float, py: str) -> bool:
        deadline = time.monotonic() + limit
        while True:
            try:
                socket.create_connection((self.addr(i), port), timeout=0.2).close()
                return True
            except OSError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.02)

    def close(self):
        pass


class Hosts:
    """``n`` test hosts held by ``hold``; place ``i`` is host ``node<i+1>``."""

    def __init__(self, n: int, hold: str, limit: float = 60.0):
        self.name = f"{n} namespace hosts"
        try:
            self.proc = subprocess.Popen(
                [hold, str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                start_new_session=True,
            )
        except OSError as e:
            raise RuntimeError(
                f"cannot start {hold} ({e}): build it with `cargo build --release "
                "-p rallypoint-testhosts --example hold`"
            ) from None
        line = self._line(limit, f"the description of {n} hosts")
        self.hosts = json.loads(line)["hosts"]
        if len(self.hosts) != n:
            self.close()
            raise RuntimeError(f"hold made {len(self.hosts)} hosts, not {n}")

    def _line(self, limit: float, what: str) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], limit)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            code = self.proc.poll()
            self.close()
            raise RuntimeError(
                f"hold (pid {self.proc.pid}) gave no {what} within {limit:g} s "
                f"(exit status {code}; its reason is on stderr above)"
            )
        return line.strip()

    def prefix(self, i: int) -> list:
        return list(self.hosts[i]["prefix"])

    def addr(self, i: int) -> str:
        return self.hosts[i]["addr"]

    def listening(self, i: int, port: int, limit: float, py: str) -> bool:
        cmd = self.prefix(i) + [py, "-S", "-c", _PROBE, self.addr(i), str(port), str(limit)]
        return _run_probe(cmd, limit)

    def _command(self, verb: str, i: int) -> float:
        self.proc.stdin.write(f"{verb} {i}\n")
        self.proc.stdin.flush()
        answer = self._line(10.0, f"answer to `{verb} {i}`")
        if not answer.startswith("ok "):
            raise RuntimeError(f"hold: `{verb} {i}`: {answer}")
        return float(answer.split()[1])

    def cut(self, i: int) -> float:
        """Takes host ``i`` off the bridge; the moment it was off."""
        return self._command("cut", i)

    def heal(self, i: int) -> float:
        return self._command("heal", i)

    def close(self, limit: float = 30.0):
        """Tears the hosts down and waits (``limit``) for ``hold`` to end."""
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            self.proc.terminate()  # its signal thread tears down too
            self.proc.wait(timeout=limit)


def _run_probe(cmd: list, limit: float) -> bool:
    try:
        return subprocess.run(cmd, timeout=limit + 10).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def wait_listening(net, i: int, port: int, proc, limit: float, py: str, what: str, log: str):
    """Waits up to ``limit`` for ``what`` (``proc``) to listen on place
    ``i``'s ``port``; raises naming it, with its log's tail, if it does not
    or exits first."""
    t0 = time.monotonic()
    if net.listening(i, port, limit, py):
        return
    state = f"exited with {proc.poll()}" if proc.poll() is not None else "still running"
    raise RuntimeError(
        f"{what} did not listen on {net.addr(i)}:{port} within {time.monotonic() - t0:.1f} s "
        f"({state}); its log: {log[-2000:]}"
    )
