"""What the end of a measured step decides, whoever ran it.

A step is measured (:class:`offremat.measure.StepMemory`) where its plan was not profiled on
its values or shape (``verify_next``), now and then for a check alone (``sampled``,
:func:`offremat._outgrown.checked_now_and_then`), or at every step (``measure_memory``). Its
end is the same whether the executor ran the step (:class:`offremat._step._Step`) or plain
autograd did, for a keep-all plan (:mod:`offremat._plain_measured`): said over its budget or
not, the plan marked over or checked, the batch profiled at the next call where it passed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from offremat._stage_sizes import StageSizes
from offremat._step_budget import (
    budgeted_peak_bytes,
    end_verification,
    note_measured_growth,
    note_profile_due,
    report_over_budget,
)
from offremat.measure import StepMemory

if TYPE_CHECKING:
    from offremat.executor import PlanExecutor


def settle_measurement(
    executor: PlanExecutor,
    memory: StepMemory,
    new_grad_bytes: int,
    sizes: StageSizes,
    verifying: bool,
    sampled: bool,
) -> int:
    """Take in a measured step on ``executor`` that held ``sizes`` and made gradients of
    ``new_grad_bytes``; its peak as the budget counts it."""
    budgeted = budgeted_peak_bytes(executor, memory, new_grad_bytes)
    # Not a step measured for values or a shape its plan was not profiled on: their checks
    # plan those anew. Over, its batch is profiled (offremat._outgrown).
    profiled = executor.measure_memory or sampled or executor.sizes_grown
    if executor.measure_memory or verifying:  # said now: see report_over_budget
        # A second check of CUDA's uncertainty alone replans nothing.
        anew = verifying and not executor.verify_again
        # A plan made for the sizes a step held is not planned anew when over.
        anew = anew and not (executor.sized_by_step or sampled)
        report_over_budget(executor, memory, new_grad_bytes, anew, profiled)
        # A plan made for a step's sizes is checked for no values: its growth replans.
        if not verifying or executor.sized_by_step:
            note_measured_growth(executor, memory, new_grad_bytes, sizes)
    if verifying:
        end_verification(executor, memory, new_grad_bytes)
        if not (executor.over_budget or executor.verify_next):
            executor.checked_sizes.merge(sizes)
    if profiled:
        note_profile_due(executor, memory, new_grad_bytes)
    unreached = executor.unreached_sizes
    budget = executor.plan.budget_bytes
    within = budget is None or budgeted <= budget
    if unreached is not None and within and sizes.reaches(unreached):
        executor.unreached_sizes = None  # its plan checked at its sizes
    return budgeted
