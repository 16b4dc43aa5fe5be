"""``Optimizer``: an optimizer stepped only when the replicas can commit
(torchft's ``OptimizerWrapper``, also under its name, no torchft).

``zero_grad()`` starts the step's quorum (:meth:`Manager.start_quorum`:
asynchronous, overlapping the forward pass) and zeroes the gradients;
``step()`` steps the wrapped optimizer only if :meth:`Manager.should_commit`
says every live replica can commit this step. Call ``zero_grad`` at the start
of each step and ``step`` after the backward pass. The wrapped optimizer's
state, parameter groups and ``state_dict`` are the wrapper's.
"""

from typing import Any, Dict, List, Mapping, Optional

import torch

__all__ = ["Optimizer", "OptimizerWrapper"]


class Optimizer(torch.optim.Optimizer):
    """``optim`` stepped under ``manager`` (module doc)."""

    def __init__(self, manager, optim: torch.optim.Optimizer) -> None:
        # torch's Optimizer.__init__ is not called: every attribute it would
        # set is the wrapped optimizer's, reached through the properties below.
        self.optim = optim
        self.manager = manager

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def state_dict(self) -> Dict[str, Any]:
        return self.optim.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.start_quorum()
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Optional[object] = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("rallypoint.ft: Optimizer.step does not take a closure (the step may not be committed)")
        if self.manager.should_commit():
            self.optim.step()

    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @property
    def state(self) -> Mapping[torch.Tensor, object]:  # type: ignore[override]
        return self.optim.state

    def __repr__(self) -> str:
        return f"rallypoint.ft.Optimizer({self.optim!r})"


#: torchft's name.
OptimizerWrapper = Optimizer
