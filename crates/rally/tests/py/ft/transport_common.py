"""Helpers of the ``transport_*.py`` scripts: a state dict like torchft's
Manager sends (model, AdamW state, non-tensor leaves, several dtypes), a
bitwise comparison, and a scripted fake source for malformed streams."""

import json
import os
import select
import socket
import threading
import time

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path

from rallypoint.ft import _wire


def model_and_optimizer(seed: int = 0, width: int = 64):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 8))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        m(torch.randn(16, width)).pow(2).mean().backward()
        opt.step()
    return m, opt


def manager_like_state(seed: int = 0, width: int = 64, step: int = 7) -> dict:
    """``{"user": {"default": ...}, "torchft": ...}`` as torchft's Manager
    stages it, with extra dtypes and non-tensor leaves."""
    m, opt = model_and_optimizer(seed, width)
    extra = {
        "bf16": torch.linspace(-3, 3, 1001).to(torch.bfloat16),
        "f16": torch.randn(5, 7).to(torch.float16),
        "f64_scalar": torch.tensor(2.718281828459045, dtype=torch.float64),
        "i64": torch.arange(-50, 50, dtype=torch.int64).reshape(10, 10),
        "i8": torch.arange(-128, 128, dtype=torch.int8),
        "bool": torch.tensor([True, False, True]),
        "c64": torch.randn(3, dtype=torch.complex64),
        "empty": torch.empty(0, 4),
        "strided": torch.arange(24.0).reshape(4, 6).t(),
        "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
        "name": "lr-schedule", "epoch": 3, "betas": (0.9, 0.999), "none": None,
    }
    return {
        "user": {"default": {"model": m.state_dict(), "optim": opt.state_dict(), "extra": extra}},
        "torchft": {"step": step, "batches_committed": 2 * step},
    }


def assert_bitwise_equal(a: object, b: object) -> int:
    """Same pytree paths, same non-tensor leaves, tensors of the same dtype,
    shape and bytes; the number of tensors compared."""
    la, _ = tree_flatten_with_path(a)
    lb, _ = tree_flatten_with_path(b)
    assert [keystr(k) for k, _ in la] == [keystr(k) for k, _ in lb], "pytree paths differ"
    n = 0
    for (k, x), (_, y) in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor), keystr(k)
            assert (x.dtype, x.shape) == (y.dtype, y.shape), (keystr(k), x.dtype, x.shape, y.dtype, y.shape)
            xb = x.contiguous().reshape(-1).view(torch.uint8)
            yb = y.contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(xb, yb), f"{keystr(k)} differs"
            n += 1
        else:
            assert x == y, (keystr(k), x, y)
    return n


def expect_error(fn, *needles, cls=Exception) -> str:
    """Runs ``fn``; it must raise ``cls`` whose message holds every needle."""
    try:
        fn()
    except cls as e:
        msg = str(e)
        for n in needles:
            assert n in msg, f"{n!r} not in error: {msg}"
        return msg
    raise AssertionError(f"no {cls.__name__} raised (expected one naming {needles})")


def frame(kind: bytes, payload: bytes) -> bytes:
    return _wire.FRAME.pack(kind, len(payload)) + payload


def header(step: int, tensors: list, leaves: int, token: int = 1) -> bytes:
    return json.dumps({"format": 1, "step": step, "token": token, "leaves": leaves, "tensors": tensors}).encode()


class FakeSource:
    """A listening socket whose connections are answered by ``script(conn)``
    (raw bytes, to produce what a real source never sends)."""

    def __init__(self, script) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.name = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.script = script
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(30)
            try:
                self.script(conn)
            except OSError:
                pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(30)
        assert not self.thread.is_alive()


def read_request(conn: socket.socket):
    buf = b""
    while len(buf) < _wire.REQUEST.size:
        part = conn.recv(_wire.REQUEST.size - len(buf))
        if not part:
            raise OSError("closed")
        buf += part
    return _wire.decode_request(buf)


def drain(conn: socket.socket) -> None:
    """Reads until the peer closes (bounded by the socket's timeout)."""
    while conn.recv(1 << 16):
        pass


class Replica:
    """Replica ``rid``: ``script replica <rid> <args...>`` in its own process,
    its stdout read line by line (the scripts print ``KEY value`` lines), its
    stderr in ``<out>/r<rid>.log``."""

    def __init__(self, script: str, rid: int, args: list, out: str) -> None:
        import subprocess
        import sys

        self.rid = rid
        self.log = os.path.join(out, f"r{rid}.log")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(script), "replica", str(rid), *args],
            stdout=subprocess.PIPE,
            stderr=open(self.log, "w"),
            text=True,
        )
        self.lines = []

    def until(self, prefix: str, deadline: float) -> str:
        """Reads stdout until a line starting with ``prefix`` (or the deadline)."""
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            if not ready:
                raise TimeoutError(f"replica {self.rid} printed no {prefix!r} by the deadline; log:\n{self.tail()}")
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"replica {self.rid} ended before {prefix!r}; log:\n{self.tail()}")
            self.lines.append(line.strip())
            if line.startswith(prefix):
                return line.strip()

    def finish(self, deadline: float) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.strip())
        code = self.proc.wait(max(deadline - time.monotonic(), 0))
        assert code == 0, f"replica {self.rid} exited {code}; log:\n{self.tail()}"

    def tail(self) -> str:
        return "".join(open(self.log).readlines()[-40:])

    def value(self, prefix: str) -> str:
        return next(l for l in self.lines if l.startswith(prefix)).split()[1]
