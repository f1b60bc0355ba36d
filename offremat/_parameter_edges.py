"""The chain's parameters as inputs of its autograd function (see ``_PlanFunction``'s design
note in :mod:`offremat.executor`): which get an edge, and the backwards refused because of
them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch.autograd.graph import get_gradient_edge

if TYPE_CHECKING:
    from offremat._step import _Step


def _has_gradient_hooks(parameter: torch.Tensor) -> bool:
    return bool(parameter._backward_hooks or parameter._post_accumulate_grad_hooks)


def unhooked_parameters(step: _Step) -> list[torch.Tensor]:
    """The stages' trainable leaf parameters without gradient hooks, each once.

    A weight computed for the call (``functional_call`` with weights made from others) is no
    leaf: an edge to it would run its graph again after B(i) has freed it."""
    found: dict[int, torch.Tensor] = {}
    for parameters in step.parameters:
        for p in parameters:
            if p.requires_grad and p.is_leaf and not _has_gradient_hooks(p):
                found.setdefault(id(p), p)
    return list(found.values())


def refuse_hooks_since_the_forward(step: _Step, edged: Sequence[torch.Tensor]) -> None:
    """Refuse a full backward if a parameter given an edge got gradient hooks since the
    forward: the engine would run them again after B(i), with no gradient."""
    late = [p for p in edged if _has_gradient_hooks(p)]
    if late:
        step.abandon()
        raise RuntimeError(
            f"a gradient hook was registered on a parameter of the chain (shape "
            f"{tuple(late[0].shape)}) between the forward and the backward of an "
            "offremat-optimized model; it would run a second time, with no gradient. "
            "Register parameter hooks before the forward"
        )


def refuse_parameters_asked_for(step: _Step) -> None:
    """Refuse ``backward(inputs=...)`` or ``torch.autograd.grad`` asking for a parameter of
    the chain: B(i) can only accumulate into every parameter's ``.grad`` or into none."""
    runs = torch._C._will_engine_execute_node
    for parameters in step.parameters:
        for p in parameters:
            if not (p.requires_grad and p.is_leaf):
                continue
            try:
                asked = runs(get_gradient_edge(p).node)
            except RuntimeError:
                # torch.autograd.grad: torch raises for a leaf it captures ("not supported").
                asked = True
            if asked:
                step.abandon()
                raise RuntimeError(
                    f"backward(inputs=...) or torch.autograd.grad asked for the gradient of "
                    f"a parameter of an offremat-optimized model (shape {tuple(p.shape)}): "
                    "its plan's backward can accumulate into every parameter's .grad or into "
                    "none, not one alone. Call loss.backward() and read .grad (save and put "
                    "back the .grad of the parameters that must stay as they were), or compute "
                    "this gradient on the model without offremat (or with a keep-all budget, "
                    "which runs as plain autograd)"
                )
