"""A keep-all plan runs as plain autograd: its measured steps are measured through the
backward (offremat._plain_measured), and must not take a step over its budget as within.

Oracle: StepMemory over the whole step (forward and backward) and plain autograd's gradients,
through tests.test_variant_values._measured_steps.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from tests.test_block_values import X
from tests.test_stand_ins import CountedAnnealed, CountedBranching
from tests.test_value_thresholds import WIDTH
from tests.test_variant_values import _measured_steps, _optimized


class GatedMixture(nn.Module):
    """A block whose count ``n`` of 3 or more mixes ``n`` gated copies of its input: the
    mixture's backward holds two n-wide temporaries where its forward holds one."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)
        self.gates = nn.Parameter(torch.randn(16, 1, 1, WIDTH) / 8)

    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        x = x + self.down(torch.tanh(self.up(x)))
        if n >= 3:
            x = x + (x.unsqueeze(0) * self.gates[:n]).sum(0)
        return x


class Mixed(nn.Module):
    """Gated mixtures of ``count`` copies where the batch's first value is positive."""

    def __init__(self, count: int = 12) -> None:
        super().__init__()
        self.count = count
        self.embed = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(GatedMixture() for _ in range(6))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.count if float(x[0, 0, 0]) > 0 else 1
        hidden = self.embed(x)
        for block in self.blocks:
            hidden = block(hidden, n)
        return self.head(hidden).square().mean()


def _few_and_many(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    few, many = X[:rows].clone(), X[:rows].clone()
    few[0, 0, 0], many[0, 0, 0] = -1.0, 1.0
    return few, many


def test_a_backward_growing_faster_than_its_forward_is_said(caplog) -> None:
    # The forward held 1.39 times what the chain predicts, the chain's peak scaled as much
    # 0.99 of the budget: taken as within, the step and every later one ran at 1.08 times
    # the budget, unsaid (a review).
    torch.manual_seed(0)
    few, many = _few_and_many(2)
    om, model, plain = _optimized(Mixed(), {"x": X}, 0.7)
    with caplog.at_level(logging.WARNING, logger="offremat"):
        peaks, _ = _measured_steps(om, model, plain, [{"x": few}, {"x": many}])
        assert "over its budget" in caplog.text
        peaks += _measured_steps(om, model, plain, [{"x": many}] * 3)[0]
    assert peaks[1] > 1 and max(peaks[:1] + peaks[2:]) <= 1


@pytest.mark.parametrize("rows", [1, 2])
def test_a_forward_a_little_past_its_chain_well_within_the_budget_is_not_said(
    rows: int, caplog
) -> None:
    # Any excess of the forward over its chain taken as over said so of steps at 0.38 to
    # 0.77 of the budget, and the next step that "a step measured over its plan's budget"
    # (a review).
    torch.manual_seed(0)
    few, many = _few_and_many(rows)
    om, model, plain = _optimized(Mixed(count=3), {"x": X}, 0.7)
    with caplog.at_level(logging.WARNING, logger="offremat"):
        peaks, _ = _measured_steps(om, model, plain, [{"x": few}] + [{"x": many}] * 3)
    assert max(peaks) <= 1
    assert not caplog.records


class Guarded(CountedBranching):
    """Raises on a batch holding a non-finite value, which a training loop then skips."""

    def forward(self, x: torch.Tensor, value: float, n: int) -> torch.Tensor:
        if not torch.isfinite(x).all():
            raise FloatingPointError("non-finite activations: batch skipped")
        return super().forward(x, value, n)


class GuardedAnnealed(CountedAnnealed):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Guarded() for _ in range(6))


def test_a_step_whose_forward_raises_checks_no_value(caplog) -> None:
    # A count of 3 whose first step on the keep-all plan raised in the blocks was taken as
    # checked: every later step on it ran at 1.2 times the budget, unmeasured (a review).
    torch.manual_seed(0)
    few, many = _few_and_many(2)
    broken = many.clone()
    broken[1, 5, 3] = float("nan")
    om, model, plain = _optimized(GuardedAnnealed(), {"x": X, "temperature": 0.5}, 0.7)
    _measured_steps(om, model, plain, [{"x": few, "temperature": 0.2}])
    with pytest.raises(FloatingPointError):
        om(x=broken, temperature=0.2)
    with caplog.at_level(logging.WARNING, logger="offremat"):
        peaks, _ = _measured_steps(om, model, plain, [{"x": many, "temperature": 0.2}])
        assert peaks[0] <= 1 or "over its budget" in caplog.text
        peaks += _measured_steps(om, model, plain, [{"x": many, "temperature": 0.2}] * 3)[0]
    assert max(peaks[1:]) <= 1
