"""Per-step fault tolerance with rallypoint's parts.

Part 1 (issue 47) gives torchft users drop-in parts for torchft's own
``Manager`` and training loop:

- :class:`ProcessGroupRally` (``rallypoint.ft.process_group``): torchft's
  ``ProcessGroup`` contract over the ``rally`` collectives;
- :class:`RallyTransport` (``rallypoint.ft.transport``): torchft's
  ``CheckpointTransport`` contract, healing at link speed;
- ``rally lighthouse``: the quorum service, a drop-in for
  ``torchft_lighthouse``.

``import rallypoint.ft`` does not need torchft: the two adapters subclass
torchft's classes, so they are imported (and torchft with them) only when
first named.
"""

__all__ = ["ProcessGroupRally", "RallyTransport"]


def __getattr__(name):
    if name == "ProcessGroupRally":
        from rallypoint.ft.process_group import ProcessGroupRally

        return ProcessGroupRally
    if name == "RallyTransport":
        from rallypoint.ft.transport import RallyTransport

        return RallyTransport
    raise AttributeError(f"module 'rallypoint.ft' has no attribute {name!r}")
