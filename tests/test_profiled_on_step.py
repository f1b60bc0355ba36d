"""A plan made for the sizes a step held, measured over its budget, is planned again on a
profile of that step's batch (offremat._outgrown.profiled_on_step)."""

from __future__ import annotations

import copy
import logging
import pickle

import torch
from torch import nn

import offremat
from offremat.measure import StepMemory
from tests.test_budget_measured import _Routed, _routed


def test_a_plan_for_grown_sizes_over_its_budget_is_planned_on_a_profile(caplog) -> None:
    # Re-made for the sizes a step held, with its temporaries grown as its saved sets, the
    # plan ran at 1.07 times the budget at every later step, though a plan made on a profile
    # of the batch fits (a review).
    model, (few, many) = _routed(8, 24)
    om = offremat.optimize(model, few, budget=0.9, solver="dp")
    caplog.set_level(logging.INFO, logger="offremat")
    peaks, said, text = [], [], ""
    for batch in (few, many, many, many, many):
        caplog.clear()
        with StepMemory("cpu", batch) as memory:
            om(batch).backward()
        peaks.append(memory.peak_bytes / om.plan.budget_bytes)
        said.append(any(r.levelno >= logging.WARNING for r in caplog.records))
        text += caplog.text
    assert all(said[k] for k, peak in enumerate(peaks) if peak > 1)
    assert peaks[0] <= 1 and max(peaks[-2:]) <= 1
    # dp's plans follow measured times: where the plan for the grown sizes fits, no profile.
    profiled = "on a profile of the batch of a step over its budget" in text
    assert profiled or max(peaks[2:]) <= 1


class _Dropped(nn.Module):
    """Routed blocks with dropout between them: the profile must not draw from the step's
    random numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(_Routed(), nn.Dropout(0.1)) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def test_gradients_stay_those_of_plain_autograd_across_the_profile() -> None:
    _, (few, many) = _routed(8, 24)
    torch.manual_seed(0)
    model = _Dropped()
    plain = copy.deepcopy(model)
    om = offremat.optimize(model, few, budget=0.9, solver="dp")
    for batch in (few, many, many, many, many):
        for m in (model, plain):
            for p in m.parameters():
                p.grad = None
        torch.manual_seed(1)
        om(batch).backward()
        torch.manual_seed(1)
        plain(batch).backward()
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)


def test_the_kept_batch_is_not_pickled() -> None:
    model, (few, many) = _routed(8, 24)
    om = offremat.optimize(model, few, budget=0.9, solver="dp")
    for batch in (few, many, many):
        om(batch).backward()
    loaded = pickle.loads(pickle.dumps(om))
    assert loaded._plans.sized_step is None
    loaded(many).backward()
