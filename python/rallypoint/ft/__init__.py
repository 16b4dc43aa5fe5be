"""Per-step fault tolerance with rallypoint's parts.

The training loop's API (issue 48), torchft's names and meaning without
torchft, so a torchft loop moves over by changing its imports and the
Manager's constructor::

    import rallypoint.ft as ft
    manager = ft.Manager(min_replicas=2, state={"model": model, "optim": opt})
    model = ft.DistributedDataParallel(manager, model)
    opt = ft.Optimizer(manager, opt)
    for x, y in loader:
        opt.zero_grad()                       # the step's quorum starts
        loss_fn(model(x), y).backward()       # gradients averaged across replicas
        opt.step()                            # applied only if the step commits

- :class:`Manager` (``manager.py``): the quorum per step, the average over
  the replicas taking part, ``should_commit``, healing, the step counter;
- :class:`DistributedDataParallel` (``ddp.py``), :class:`Optimizer`
  (``optim.py``), :class:`DistributedSampler` (``data.py``).

For torchft's own ``Manager`` (issue 47), drop-in parts:

- :class:`ProcessGroupRally` (``rallypoint.ft.process_group``): torchft's
  ``ProcessGroup`` contract over the ``rally`` collectives;
- :class:`RallyTransport` (``rallypoint.ft.transport``): torchft's
  ``CheckpointTransport`` contract, healing at link speed;
- ``rally lighthouse``: the quorum service, a drop-in for
  ``torchft_lighthouse``.

Nothing imported by ``import rallypoint.ft`` imports torchft: the two
adapters subclass torchft's classes, so they are imported (and torchft with
them) only when first named; the rest is loaded when first named too (it
needs torch).
"""

__all__ = [
    "DistributedDataParallel",
    "DistributedSampler",
    "Manager",
    "Optimizer",
    "OptimizerWrapper",
    "ProcessGroupRally",
    "PureDistributedDataParallel",
    "RallyTransport",
]

_WHERE = {
    "Manager": "rallypoint.ft.manager",
    "DistributedDataParallel": "rallypoint.ft.ddp",
    "PureDistributedDataParallel": "rallypoint.ft.ddp",
    "Optimizer": "rallypoint.ft.optim",
    "OptimizerWrapper": "rallypoint.ft.optim",
    "DistributedSampler": "rallypoint.ft.data",
    "ProcessGroupRally": "rallypoint.ft.process_group",
    "RallyTransport": "rallypoint.ft.transport",
}


def __getattr__(name):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'rallypoint.ft' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(where), name)


def __dir__():
    return sorted(list(globals()) + __all__)
