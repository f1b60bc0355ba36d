"""What the checks on a step's outputs take for a loss and for the end code's growth.

Oracle: StepMemory over the step; the warnings are compared with what it measured.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import offremat
from offremat.measure import StepMemory
from tests.test_budget_measured import _labels, _MaskedHeadNet, _ResidualMLP


class _AllTokensHead(_MaskedHeadNet):
    """A head and a loss over every token, whatever the labels; it also returns the
    predictions on the labelled tokens (an accuracy metric), sized by the labels."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return loss, logits.detach().argmax(-1)[labels >= 0]


def test_outputs_carrying_no_gradient_do_not_grow_the_end_code(caplog) -> None:
    # 256 more bytes of predictions scaled the end code's peak as if its head had doubled:
    # "over its budget" on a step at 0.81 of it (a review).
    torch.manual_seed(0)
    x = torch.randn(4, 64, 32)
    om = offremat.optimize(_AllTokensHead(), {"x": x, "labels": _labels(8)}, budget=0.8)
    with caplog.at_level(logging.WARNING, logger="offremat"):
        om(x, _labels(8))[0].backward()
        with StepMemory("cpu", (x, _labels(40))) as memory:
            om(x, _labels(40))[0].backward()
    assert memory.peak_bytes <= om.plan.budget_bytes
    assert "outputs took" not in caplog.text


class _OwnLoss(nn.Module):
    """Computes its loss and returns it beside its logits, as ``shape``: (1,) as
    DataParallel gathers it, or one per example."""

    def __init__(self, shape: str) -> None:
        super().__init__()
        self.shape = shape
        self.blocks = nn.Sequential(*(_ResidualMLP() for _ in range(4)))
        self.head = nn.Linear(32, 2048)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.blocks(x))
        if self.shape == "one":
            loss = nn.functional.cross_entropy(logits, target).reshape(1)
        else:
            loss = nn.functional.cross_entropy(logits, target, reduction="none")
        return {"loss": loss, "logits": logits}


@pytest.mark.parametrize("shape", ["one", "per-example"])
def test_a_loss_of_one_element_or_one_per_example_is_a_loss(shape: str, caplog) -> None:
    # Taken for no loss, "the code that computes the loss runs outside the budget" was said
    # of a step at 0.79 of it (a review).
    torch.manual_seed(0)
    x, target = torch.randn(256, 32), torch.randint(0, 2048, (256,))
    om = offremat.optimize(_OwnLoss(shape), {"x": x, "target": target}, budget=0.9)
    with (
        caplog.at_level(logging.WARNING, logger="offremat"),
        StepMemory("cpu", (x, target)) as memory,
    ):
        om(x, target)["loss"].mean().backward()
    assert memory.peak_bytes <= om.plan.budget_bytes
    assert "returned no loss" not in caplog.text
