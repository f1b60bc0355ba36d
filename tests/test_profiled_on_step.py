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
from offremat.models import RoutedBlock
from tests.test_budget_measured import _routed


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
    profiled = "again on a profile of a batch" in text
    assert profiled or max(peaks[2:]) <= 1


def test_a_plan_for_grown_sizes_is_measured_until_a_step_holds_them(caplog) -> None:
    # Measured within its budget on a smaller batch, a plan made for grown sizes was trusted:
    # later steps of the sizes it was made for, or larger, ran over it unsaid (1.07 to 2.1
    # times the budget, a review).
    model, batches = _routed(8, 24, 8, 24, 24, 24)
    om = offremat.optimize(model, batches[0], budget=0.9, solver="dp")
    caplog.set_level(logging.INFO, logger="offremat")
    peaks, said = [], []
    for batch in batches:
        caplog.clear()
        with StepMemory("cpu", batch) as memory:
            om(batch).backward()
        peaks.append(memory.peak_bytes / om.plan.budget_bytes)
        said.append(any(r.levelno >= logging.WARNING for r in caplog.records))
    assert all(said[k] for k, peak in enumerate(peaks) if peak > 1), (peaks, said)
    assert peaks[1] > 1 and peaks[2] <= 1  # grown at the second step, within at the third
    assert max(peaks[-2:]) <= 1  # planned for the sizes, as the steps that held them showed


def test_the_step_that_checks_a_plan_for_grown_sizes_holds_no_copy_of_its_batch() -> None:
    # Kept for a profile, the batch was copied when the step began: on the host, 128 KiB of
    # the step's own that its measurement did not see (0.997 of the budget, a review).
    model, batches = _routed(8, 24, 24)
    om = offremat.optimize(model, batches[0], budget=0.9, solver="dp")
    for batch in batches[:2]:
        om(batch).backward()
    assert om._executor.outgrown is not None  # the next call plans for the sizes it held
    with StepMemory("cpu", batches[2]) as memory:
        om(batches[2]).backward()
    assert om._executor.sizes_grown and om.stats.budgeted_peak_bytes is not None  # measured
    # The code around the blocks, as profiled (the chain input), is counted in both.
    assert memory.peak_bytes <= om.stats.budgeted_peak_bytes + 1024


class _Dropped(nn.Module):
    """Routed blocks with dropout between them: the profile must not draw from the step's
    random numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(RoutedBlock(), nn.Dropout(0.1)) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def test_gradients_stay_those_of_plain_autograd_across_the_profile() -> None:
    # Seeded once, each run's random numbers follow on from step to step: a profile that
    # drew from them would change every later step's dropout.
    _, (few, many) = _routed(8, 24)
    torch.manual_seed(0)
    model = _Dropped()
    plain = copy.deepcopy(model)
    om = offremat.optimize(model, few, budget=0.9, solver="dp")
    grads = []
    for run in (om, plain):
        torch.manual_seed(1)
        grads.append([])
        for batch in (few, many, many, many, many):
            run.zero_grad(set_to_none=True)
            run(batch).backward()
            grads[-1].append([p.grad.clone() for p in run.parameters()])
    for mine, theirs in zip(*grads, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def test_the_kept_batch_is_not_pickled() -> None:
    model, (few, many) = _routed(8, 24)
    om = offremat.optimize(model, few, budget=0.9, solver="dp")
    for batch in (few, many, many):
        om(batch).backward()
    loaded = pickle.loads(pickle.dumps(om))
    assert loaded._plans.sized_step is None
    loaded(many).backward()


def _steps(om, model: nn.Module, batches, between, caplog) -> list[tuple[float, str]]:
    """Peak ÷ budget and what was logged, per step; ``between(k, batch)`` before step k."""
    caplog.set_level(logging.INFO, logger="offremat")
    found = []
    for k, batch in enumerate(batches):
        between(k, batch)
        caplog.clear()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        with StepMemory("cpu", batch) as memory:
            om(batch).backward()
        found.append((memory.peak_bytes / om.plan.budget_bytes, caplog.text))
    return found


def _said(text: str) -> bool:
    return "WARNING" in text


def test_a_step_kept_across_eval_is_profiled_back_in_training(caplog) -> None:
    # Put aside with the training plans by model.eval(), the step over its budget was
    # dropped, and back in training its plan ran over again, unsaid (a review).
    _, (few, many) = _routed(8, 24)
    torch.manual_seed(0)
    model = _Dropped()
    om = offremat.optimize(model, few, budget=0.9, solver="dp")

    def between(k: int, _) -> None:
        model.train(k not in (3, 4))

    found = _steps(om, model, [few, *[many.clone() for _ in range(6)]], between, caplog)
    assert all(_said(text) for peak, text in found if peak > 1)
    assert found[-1][0] <= 1


def test_a_batch_refilled_in_place_is_profiled_as_its_step_had_it(caplog) -> None:
    # A caller that refills its batch in place hands the next step's values: profiled by
    # reference, the plan was made for other data than the step that passed the budget (a
    # review); the batch is copied when its step starts.
    _, (few, many) = _routed(8, 24)
    model = _routed(8)[0]
    om = offremat.optimize(model, few, budget=0.9, solver="dp")
    batches = [few, *[many.clone() for _ in range(5)]]

    def between(k: int, batch) -> None:
        if k > 1:
            batches[k - 1][..., 0] = -1  # nothing routed: the step before's buffer, refilled

    found = _steps(om, model, batches, between, caplog)
    assert all(_said(text) for peak, text in found if peak > 1)
    assert max(peak for peak, _ in found[-2:]) <= 1


def test_a_profile_that_raises_is_said_not_raised_from_the_next_call(caplog) -> None:
    # The batch is an earlier call's: what profiling it raised came out of the next call,
    # whose own batch was fine, and the plan ran over unsaid after (a review).
    model, (few, many) = _routed(8, 24)
    om = offremat.optimize(model, few, budget=0.9, solver="dp")

    def failing(batch) -> None:
        raise RuntimeError("out of memory while profiling")

    om._plans.profile_call = failing
    found = _steps(om, model, [few, many, many, many], lambda k, batch: None, caplog)
    if found[2][0] > 1:  # the plan made for the grown sizes passed the budget: profiled next
        assert "raised RuntimeError: out of memory while profiling" in found[3][1]


def test_a_copy_made_before_the_profile_profiles_its_own_next_batch() -> None:
    # The kept batch is not copied with the module: the copy's plan for grown sizes, over
    # its budget, ran over at every later step, unsaid (a review); it profiles the batch of
    # its next call of that key.
    model, (few, many) = _routed(8, 24)
    om = offremat.optimize(model, few, budget=0.9, solver="dp")
    for batch in (few, many, many):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        om(batch).backward()
    copied = copy.deepcopy(om)
    peaks = []
    for _ in range(2):
        for p in copied.parameters():
            p.grad = torch.zeros_like(p)
        with StepMemory("cpu", many) as memory:
            copied(many).backward()
        peaks.append(memory.peak_bytes / copied.plan.budget_bytes)
    assert peaks[-1] <= 1
