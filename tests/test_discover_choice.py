"""Which run of blocks a model's chain is: of an encoder and a decoder as deep, the one whose
blocks save the most activations (the one that reads the longer sequence, unless frozen).

Before, the run with the most parameters won, a decoder's (its cross-attention) whatever the
lengths: a BART summarising 48 tokens into 8 planned its decoder and kept every activation of
its encoder, and its least feasible budget was 1.42 times the one with the encoder planned.
Oracles: the least budget each choice fits, named by the solver, and the step's memory
measured independently (``StepMemory``) with plain autograd's gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch

import offremat
from offremat.measure import StepMemory
from solvers.budget import InfeasibleBudgetError
from tests import model_zoo as zoo


def least_budget(model, batch, blocks: str | None) -> int:
    with pytest.raises(InfeasibleBudgetError) as refused:
        offremat.optimize(model, batch, budget=1024, blocks=blocks)
    return refused.value.min_budget_bytes


@pytest.mark.parametrize(
    ("source", "target", "frozen", "planned", "other"),
    [
        (48, 8, False, "encoder", "decoder"),
        (8, 48, False, "decoder", "encoder"),
        (48, 8, True, "decoder", "encoder"),
    ],
    ids=["longer-source", "longer-target", "frozen-encoder"],
)
def test_the_run_that_saves_the_most_is_planned(source, target, frozen, planned, other) -> None:
    """A frozen encoder saves nothing, however long its input (a review: chosen for the bytes
    its blocks handed on, it needed 1.52 times the decoder's least budget)."""
    model = zoo.bart()
    if frozen:
        model.model.encoder.requires_grad_(False)
        model.model.shared.requires_grad_(False)
    generator = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(3, 96, (4, source), generator=generator),
        "labels": torch.randint(3, 96, (4, target), generator=generator),
    }
    least = least_budget(model, batch, None)
    assert least < least_budget(model, batch, f"model.{other}.layers")
    reference = copy.deepcopy(model)
    optimized = offremat.optimize(model, batch, budget=least)
    assert optimized.chain.metadata["blocks"][0].startswith(f"model.{planned}.layers")
    for parameter in (*model.parameters(), *reference.parameters()):
        parameter.grad = torch.zeros_like(parameter)
    torch.manual_seed(1)
    with StepMemory("cpu", batch) as memory:
        optimized(**batch).loss.backward()
    torch.manual_seed(1)
    reference(**batch).loss.backward()
    assert memory.peak_bytes <= least
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    assert all(torch.equal(p.grad, q.grad) for p, q in pairs)
