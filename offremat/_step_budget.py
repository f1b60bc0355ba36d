"""The budget check of a measured step: the first step of a plan whose chain was not profiled
at its shape, and every step with ``measure_memory=True`` (see :mod:`offremat.executor`).

The budget leaves out the parameters' gradients (:mod:`offremat.measure`), but a step whose
parameters' .grad is None allocates them, and the measurement sees them. On CPU the tracker
stops counting each one once accumulated (:class:`offremat.measure.StepMemory`,
``gradients_of``), so one step decides. The CUDA allocator cannot tell them apart: a step over
its budget by no more than their bytes leaves the check to the next, which may find them made
(the caller keeps them between steps); found over by as little again, its shape is profiled, so
that a training loop that drops its gradients every step is not measured forever."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from offremat._pinned_grads import backward_gradient_bytes
from offremat._scan import ModuleScan
from offremat._stage_sizes import Outgrown, StageSizes, grown_chain
from offremat._tensors import allocated_bytes
from offremat.measure import StepMemory
from solvers.budget import format_bytes
from solvers.chain import Chain

if TYPE_CHECKING:
    from offremat.executor import PlanExecutor

logger = logging.getLogger(__name__)

_UNSEEN_HOOKS = (
    "one on a parameter's accumulation node, grad_fn.next_functions, added after optimize, "
    "or a gradient hook that makes several new gradients inside"
)
"""The hooks whose memory a plan can miss (the README, on parameters' hooks): a measured step
over its budget names them beside the input's values."""


def fresh_parameters(scans: list[ModuleScan]) -> list[torch.Tensor]:
    """The parameters a step makes gradients for: the leaves that train and whose .grad is
    None (a weight computed from others gets none)."""
    fresh = {id(p): p for scan in scans for p in scan.trainable if p.is_leaf and p.grad is None}
    return list(fresh.values())


def gradient_bytes(parameters: list[torch.Tensor]) -> int:
    """The bytes the gradients of ``parameters`` take."""
    return sum(allocated_bytes(p.numel() * p.element_size(), p.device) for p in parameters)


def unseen_around_bytes(executor: PlanExecutor, memory: StepMemory) -> int:
    """What a measured step (``memory``) does not see of the code around the chain, which its
    plan counts (:mod:`offremat._model_chain`): the tensors alive at the chain's start besides
    its input (the batch, what the code before the blocks saves); and on CPU, where the
    tracker pauses between the chain's forward and its backward, what the code after the
    chain holds through the backward, or, where more, its own peak (a loss, the logits'
    gradient) on what the chain held at its forward's end; all as the plan's chain has them
    (for a length predicted from others, as predicted). Compared with the budget without
    them, a step past it by less passed; without that end peak, a tiny Llama's measured
    steps read 0.08 of the budget below an outside tracker's (a review)."""
    chain = executor.chain
    if "outside" not in chain.metadata:
        return 0
    kept = chain.metadata.get("kept_by_modules_bytes", 0)
    before = chain.input_bytes - kept - memory.input_bytes
    after = 0
    if memory.device.type == "cpu":
        after = chain.held_bytes - backward_gradient_bytes(chain)
        if memory.paused_bytes is not None:
            # The end code's peak as the plan has it: folded into B(L)'s temporary, which
            # a chain predicted for another length has at that length (its "outside"
            # figures are the profiled length's: at a shorter one, read as they are, they
            # said steps at 0.87 of the budget over it, a review).
            end = chain.stages[-1].bwd_tmp_bytes
            after = max(after, memory.paused_bytes + end - memory.step_peak_bytes)
    return max(before, 0) + max(after, 0)


def end_verification(executor: PlanExecutor, memory: StepMemory, new_grad_bytes: int) -> None:
    """Mark the plan over its budget, measured without the gradients the step made, or clear
    it; where that cannot be told, check the next step as well, once."""
    budget = executor.plan.budget_bytes
    exact = memory.peak_less_gradients_bytes
    around = unseen_around_bytes(executor, memory)
    if budget is None:
        executor.over_budget = executor.verify_next = False
        executor.over_within_gradients = False
    elif exact is not None:
        executor.over_budget = exact + around > budget
        executor.over_within_gradients = executor.verify_next = False
    else:
        measured = memory.peak_bytes + around
        within_gradients = budget < measured <= budget + new_grad_bytes
        unsure = within_gradients and not executor.verify_again
        executor.over_budget = measured > budget and not unsure
        executor.over_within_gradients = executor.over_budget and within_gradients
        executor.verify_next = unsure
    executor.verify_again = executor.verify_next


def budgeted_peak_bytes(executor: PlanExecutor, memory: StepMemory, new_grad_bytes: int) -> int:
    """A measured step's peak as its budget counts it: the tracker's, without the parameters'
    gradients the step made (on CUDA, where the allocator cannot tell them apart, less all
    their bytes), plus what it does not see of the code around the chain, as profiled
    (:func:`unseen_around_bytes`)."""
    around = unseen_around_bytes(executor, memory)
    less = memory.peak_less_gradients_bytes
    return memory.peak_bytes + around - new_grad_bytes if less is None else less + around


SAID_AGAIN = 1.1
"""How many times what a step said to pass the budget held a later one must hold to be said
again: at any more, growth by a few percent a step was said at every step (a review)."""


def report_over_budget(
    executor: PlanExecutor,
    memory: StepMemory,
    new_grad_bytes: int,
    replanned: bool,
    profiled: bool = False,
) -> None:
    """Warn when the independent measurement (with what it does not see of the code around
    the chain, as profiled: :func:`unseen_around_bytes`) exceeds the budget: by the
    parameters' gradients the step made, which the budget leaves out, or by more; once per
    plan and reason, but at every ``replanned`` step (one that checked what its plan was not
    profiled on, which the next step on it plans anew; ``profiled``: its batch is profiled at
    the next call, :func:`note_profile_due`) and every step over by
    :data:`SAID_AGAIN` times the most said before. At the step's end, not when its plan's key
    comes back (a step found over on a shape that never came back went unsaid)."""
    budget = executor.plan.budget_bytes
    around = unseen_around_bytes(executor, memory)
    measured = memory.peak_bytes + around
    if budget is None or measured <= budget:
        return
    less = budgeted_peak_bytes(executor, memory, new_grad_bytes)
    reason = "gradients" if less <= budget else "activations"
    # Each step over on values its plan was not profiled on is said: it replans them. So is
    # one over by a tenth more than any said before (said once per plan, measure_memory=True
    # ran routed tokens at 2.4 and 3.5 times the budget unsaid after a step at 1.08, a
    # review).
    more = less > executor.said_over_bytes * SAID_AGAIN
    again = reason == "activations" and (replanned or more)
    if reason in executor.reported_over_budget and not again:
        return
    executor.reported_over_budget.add(reason)
    if reason == "activations":
        executor.said_over_bytes = max(executor.said_over_bytes, less)
    if reason == "gradients":
        logger.warning(
            "this step measured %s, over its budget of %s by no more than the %s of "
            "parameters' gradients it allocated (their .grad was None): the budget leaves "
            "those out, and steps that keep them (optimizer.zero_grad(set_to_none=False)) "
            "stay within it",
            format_bytes(measured),
            format_bytes(budget),
            format_bytes(new_grad_bytes),
        )
        return
    # As stats.budgeted_peak_bytes has it; stats.measured_peak_bytes is the tracker's alone.
    unseen = (
        f" ({format_bytes(less - around)} seen by the tracker and {format_bytes(around)} that "
        "the code around the blocks holds as profiled, which it does not see)"
        if around
        else ""
    )
    logger.warning(
        "this step measured %s of activations%s, over its budget of %s (its plan predicted %s). %s",
        format_bytes(less),
        unseen,
        format_bytes(budget),
        format_bytes(executor.plan.predicted_peak_bytes or 0),
        "It ran on what its plan was not profiled on (numbers or strings of other values, "
        "a chain read from cache_dir, given to optimize or predicted from other shapes): "
        "the next step on them is planned anew"
        if replanned
        else "The model's activation sizes depend on more than the input's shapes (the "
        "values of a padding mask, a routing decision, the experts its tokens reach), or a "
        f"hook holds more than its plan counted ({_UNSEEN_HOOKS}): the next call profiles "
        "this step's batch and plans again to hold it"
        if profiled
        else "The model's activation sizes depend on more than the input's shapes (the "
        "values of a padding mask, a routing decision) or differ from the sizes predicted "
        f"for this shape, or a hook holds more than its plan counted ({_UNSEEN_HOOKS}): "
        "lower the budget given to offremat.optimize by that margin, or optimize on the "
        "batch that holds the most (the most tokens routed, no padding)",
    )


def grown_beyond_said(executor: PlanExecutor, sizes: StageSizes) -> Chain | None:
    """``executor``'s chain grown to the stage ``sizes`` a step held, where they pass what
    was said before by :data:`SAID_AGAIN` and what steps were checked on; else None."""
    known = executor.said_sizes.scaled(SAID_AGAIN)
    known.merge(executor.checked_sizes)
    return grown_chain(executor.chain, sizes, known)


def note_measured_growth(
    executor: PlanExecutor, memory: StepMemory, new_grad_bytes: int, sizes: StageSizes
) -> None:
    """A step measured because every step is (``measure_memory=True``), over its budget,
    whose stages held more than its chain says, leaves the chain grown to its sizes, which
    the next step plans (:mod:`offremat._outgrown`), as an unmeasured step's would: said and
    kept, routed tokens ran at 1.52 times the budget at every step (a review). A step
    measured to check values its plan was not profiled on is left to those checks."""
    budget = executor.plan.budget_bytes
    if budget is None or budgeted_peak_bytes(executor, memory, new_grad_bytes) <= budget:
        return
    if in_process_group():
        return
    # As for an unmeasured step (report_grown_sizes): sizes said once are planned for again
    # only where a step holds a tenth more (a plan for them tried at every measured step said
    # at each that none fits, a review).
    grown = grown_beyond_said(executor, sizes)
    if grown is not None:
        executor.outgrown = Outgrown(grown, sizes)
        executor.said_sizes.merge(sizes)  # said with the step (report_over_budget)


PROFILED_EVERY = 32
"""At most one profile of a step's batch in this many steps on a plan
(:func:`note_profile_due`): a batch no plan fits, profiled at each measured step, said so at
each (a review)."""


def note_profile_due(executor: PlanExecutor, memory: StepMemory, new_grad_bytes: int) -> None:
    """Where a measured step passed its budget, have the next call profile its batch
    (:func:`offremat._outgrown.profiled_on_step`), unless one was profiled for this plan
    within :data:`PROFILED_EVERY` steps: the backward's temporaries can grow with the values
    where no stage's sizes do (mixtures of experts at 1.3 times the budget, a new user's
    trial)."""
    budget = executor.plan.budget_bytes
    if budget is None or in_process_group():
        return
    if budgeted_peak_bytes(executor, memory, new_grad_bytes) <= budget:
        return
    last = executor.profiled_at
    if last is None or executor.steps_run - last >= PROFILED_EVERY:
        executor.profile_due = True
        executor.profiled_at = executor.steps_run


def in_process_group() -> bool:
    """Whether the step runs in a process group, where stage sizes are not compared: FSDP2
    saves the parameters it gathers, storages of the step's own that no profile counts as
    the stage's (offremat._stage_profile)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def warn_unsure(executor: PlanExecutor, shape: str) -> None:
    """Say once that a plan (for input ``shape``) was kept although two steps measured over
    its budget by no more than the gradients they made, which CUDA cannot tell apart."""
    if "unsure" in executor.reported_over_budget:
        return
    executor.reported_over_budget.add("unsure")
    logger.warning(
        "input %s: two steps measured over the plan's budget by no more than the parameters' "
        "gradients they made (their .grad was None), which the budget leaves out; the CUDA "
        "allocator cannot tell those from activations, so the plan is kept, and an overrun of "
        "activations that small would go unseen. optimizer.zero_grad(set_to_none=False) "
        "makes the check exact",
        shape,
    )
