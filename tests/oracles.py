"""The oracles of a training step: plain autograd for the loss and gradients, bit for bit,
and the live storages of the step (``StepMemory``) for its peak."""

from __future__ import annotations

from typing import Any

import torch

from offremat.measure import StepMemory


def step_as_plain_autograd(optimized: Any, model: Any, reference: Any, *args, **kwargs) -> int:
    """One step of ``optimized`` (over ``model``) and of plain autograd on ``reference``, the
    same seed, from gradients allocated as after a first step: the same loss (the output's
    ``loss``, else the output) and gradients, bit for bit. Returns the step's peak, measured
    independently."""
    for parameter in (*model.parameters(), *reference.parameters()):
        if parameter.requires_grad:
            parameter.grad = torch.zeros_like(parameter)
    torch.manual_seed(1)
    with StepMemory("cpu", inputs=(args, kwargs)) as memory:
        loss = _loss(optimized(*args, **kwargs))
        loss.backward()
    torch.manual_seed(1)
    expected = _loss(reference(*args, **kwargs))
    expected.backward()
    assert torch.equal(loss, expected)
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    assert all(p.grad is q.grad is None or torch.equal(p.grad, q.grad) for p, q in pairs)
    return memory.peak_bytes


def step_within_budget(optimized: Any, model: Any, reference: Any, *args, **kwargs) -> None:
    """:func:`step_as_plain_autograd`, its peak within the plan's budget."""
    peak = step_as_plain_autograd(optimized, model, reference, *args, **kwargs)
    assert peak <= optimized.plan.budget_bytes


def _loss(output: Any) -> torch.Tensor:
    return getattr(output, "loss", output)
