"""What a step measured within budget is checked on the plan it ran on, in the stages'
state it ran in: the plans of another state (a layer frozen, eval mode) are not those.

Oracle: StepMemory over the whole step and plain autograd's gradients, through
tests.test_variant_values._measured_steps.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.test_block_values import X
from tests.test_stand_ins import CountedAnnealed, CountedBranching
from tests.test_variant_values import _measured_steps, _optimized


class _LinearCounted(CountedBranching):
    """A count branch that is linear: what it saves is for its weights' gradients alone."""

    def forward(self, x: torch.Tensor, value: float, n: int) -> torch.Tensor:
        x = self.branching(x, value)
        if n >= 3:
            x = x + self.down(self.up(x))
        return x


def test_a_count_checked_in_one_state_is_not_taken_as_checked_in_another() -> None:
    # A count checked within budget with the count branch frozen was taken as checked on the
    # trainable state's plan of the same key: 4 steps in 4 at 1.34 times the budget,
    # unmeasured (a review).
    torch.manual_seed(0)
    model = CountedAnnealed()
    model.blocks = nn.ModuleList(_LinearCounted() for _ in range(6))
    few, many = X.clone(), X.clone()
    few[0, 0, 0], many[0, 0, 0] = -1.0, 1.0
    om, model, plain = _optimized(model, {"x": few, "temperature": 0.5}, 0.7)

    def freeze(frozen: bool) -> None:
        for block in (*model.blocks, *plain.blocks):
            for parameter in (*block.up.parameters(), *block.down.parameters()):
                parameter.requires_grad_(not frozen)

    _measured_steps(om, model, plain, [{"x": few, "temperature": 0.5}] * 2)
    freeze(True)
    frozen = _measured_steps(om, model, plain, [{"x": few, "temperature": 0.5}] * 2)[0]
    frozen += _measured_steps(om, model, plain, [{"x": many, "temperature": 0.5}] * 2)[0]
    freeze(False)
    peaks, measured = _measured_steps(om, model, plain, [{"x": many, "temperature": 0.5}] * 4)
    assert max(frozen) <= 1
    assert (peaks[0] <= 1 or measured[0]) and max(peaks[1:]) <= 1


def test_plans_of_a_state_kept_before_each_kept_its_checks_still_switch() -> None:
    # A module pickled before each state kept its checks held 5 plans per state: at its
    # next state switch, "not enough values to unpack" (a review).
    torch.manual_seed(0)
    om, model, plain = _optimized(CountedAnnealed(), {"x": X, "temperature": 0.5}, 0.7)
    calls = [{"x": X, "temperature": 0.5}]
    _measured_steps(om, model, plain, calls)
    for frozen in (True, False, True):
        for block in (*model.blocks, *plain.blocks):
            block.up.requires_grad_(not frozen)
        plans = om._plans
        plans.by_state = {
            state: (k.executors, k.profiled, k.provisional, k.variants, k.unprofiled)
            for state, k in plans.by_state.items()
        }
        _measured_steps(om, model, plain, calls)
