"""The Work adapters of :class:`rallypoint.ft.ProcessGroupRally`, and the
record of a generation's first error they report to.

- :class:`_Fault`: a generation's first error (``errored()`` reads it); its
  ``done`` is the op-completion callback the generation's backend is given,
  so a failure is recorded the moment the op fails, not when it is waited for.
- :class:`_Swallowing`: a collective's Work that completes without raising
  (torchft's DDP hook asserts on a failed future); the failure goes to the
  fault, the future carries the op's tensors.
- :class:`_Failed`: a send or recv refused at once; ``wait()`` raises.
- :class:`_All`: the Works of a coalesced call as one.
- :class:`_Done`: a Work already complete with a result (torchft's
  ``_DummyWork``, without torchft): what a collective returns when the
  generation has failed or there is none.

Nothing here imports torchft.
"""

import threading
from typing import Optional

import torch
import torch.distributed as dist

from rallypoint import torch as _rally


class _Fault:
    """The first error of one generation (or of the time without one)."""

    def __init__(self, error: Optional[Exception] = None):
        self._lock = threading.Lock()
        self.error: Optional[Exception] = error

    def record(self, e: Exception) -> None:
        with self._lock:
            if self.error is None:
                self.error = e

    def done(self, token, kind, message) -> None:
        """The generation's op completion (``rallypoint.torch._done``'s
        contract): records a failure the moment the op fails, then completes
        the op's future as the rally backend does."""
        if kind is not None:
            self.record(_rally._ERRORS.get(kind, dist.DistBackendError)(message))
        _rally._done(token, kind, message)


class _Swallowing(dist._Work):
    """A collective's Work that completes without raising: a failure is
    recorded in the generation's fault, and the future carries ``result``."""

    def __init__(self, work, fault: _Fault, result):
        super().__init__()
        self._work, self._fault, self._result = work, fault, result

    def wait(self, timeout=None):
        try:
            self._work.wait()
        except Exception as e:  # noqa: BLE001 - reported by errored()
            self._fault.record(e)
        return True

    def get_future(self):
        fault, result = self._fault, self._result

        def swallow(f):
            try:
                return f.value()
            except Exception as e:  # noqa: BLE001 - reported by errored()
                fault.record(e)
                return result

        return self._work.get_future().then(swallow)


class _Failed(dist._Work):
    """A send or recv refused at once: ``wait()`` raises ``error``."""

    def __init__(self, error: Exception):
        super().__init__()
        self._error = error

    def wait(self, timeout=None):
        raise self._error

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_exception(self._error)
        return fut.then(_rally._value)


class _All(dist._Work):
    """The Works of a coalesced call, one per tensor, as one."""

    def __init__(self, works, result):
        super().__init__()
        self._works, self._result = works, result

    def wait(self, timeout=None):
        for w in self._works:
            w.wait()
        return True

    def get_future(self):
        result = self._result
        return torch.futures.collect_all([w.get_future() for w in self._works]).then(lambda _: result)


class _Done(dist._Work):
    """A Work already complete: ``wait()`` returns, the future holds ``result``."""

    def __init__(self, result):
        super().__init__()
        self._result = result
        self._fut = torch.futures.Future()
        self._fut.set_result(result)

    def wait(self, timeout=None):
        return True

    def get_future(self):
        return self._fut
