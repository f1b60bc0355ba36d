"""What an unmeasured step says of its budget: where the tensors its plan held, the sizes its
stages saved, its outputs, or a loss left to the caller show that it passed the budget
unmeasured (the measured steps' checks are in :mod:`offremat._step_budget`)."""

from __future__ import annotations

import logging
from dataclasses import replace
from math import ceil
from typing import TYPE_CHECKING, Any

from offremat._call_checks import in_functorch_transform
from offremat._stage_sizes import Outgrown, StageSizes, most_grown
from offremat._step_budget import grown_beyond_said, in_process_group
from offremat._tensors import storage_bytes
from offremat.measure import tree_leaf_tensors
from solvers.budget import format_bytes
from solvers.simulator import simulate

if TYPE_CHECKING:
    from offremat.executor import PlanExecutor

logger = logging.getLogger(__name__)


def report_held_over_budget(executor: PlanExecutor, held_bytes: int) -> None:
    """Warn, once per plan, where the tensors that the plan itself held in an unmeasured step
    passed its budget: they were alive, so the step passed it too (by at least that). Blocks
    that route tokens by their values held 2.3 times the budget in the tensors the plan kept,
    7.3 times in all, unsaid at every step (a new user's trial)."""
    budget = executor.plan.budget_bytes
    if budget is None or held_bytes <= budget or "held" in executor.reported_over_budget:
        return
    executor.reported_over_budget.add("held")
    logger.warning(
        "this step held %s in the tensors its plan keeps alone, over its budget of %s (its "
        "plan predicted a peak of %s): the model's activation sizes depend on more than the "
        "input's shapes (tokens routed by their values, a padding mask's values). Optimize on "
        "the batch that holds the most, or lower the budget; measure_memory=True measures "
        "every step",
        format_bytes(held_bytes),
        format_bytes(budget),
        format_bytes(executor.plan.predicted_peak_bytes or 0),
    )


def report_grown_sizes(executor: PlanExecutor, sizes: StageSizes) -> None:
    """Warn where the stages of an unmeasured step held more than its chain says (and than a
    step measured within the budget, or said, held) and the plan, simulated on those sizes,
    passes its budget (:mod:`offremat._stage_sizes`): tokens routed by their values
    saved several times the profiled bytes, while the tensors the plan kept stayed within
    the budget, so :func:`report_held_over_budget` said nothing."""
    budget = executor.plan.budget_bytes
    if budget is None:
        return
    if in_process_group():
        return
    # Sizes said once are said again only where a step holds a tenth more still (said once
    # per plan, a step at twice those sizes went unsaid where no plan fitted them:
    # experiments/routed_growth.py).
    grown = grown_beyond_said(executor, sizes)
    if grown is None:
        return
    peak = simulate(executor.plan, grown).peak_bytes
    if peak <= budget:
        executor.checked_sizes.merge(sizes)  # not simulated again at every such step
        return
    executor.outgrown = Outgrown(grown, sizes)
    executor.said_sizes.merge(sizes)
    name, now, profiled = most_grown(executor.chain, grown)
    logger.warning(
        "this step's stages saved more than its plan was made for (stage %r: %s, against %s "
        "profiled): on the sizes this step had, the plan's chain predicts a peak of %s, over "
        "its budget of %s (%s as profiled). The model's activation sizes depend on more than "
        "the input's shapes (tokens routed by their values, a padding mask's values): the "
        "next step runs on a plan made for those sizes, measured. Optimize on the batch that "
        "holds the most to plan for it from the start; measure_memory=True measures every "
        "step",
        name,
        format_bytes(now),
        format_bytes(profiled),
        format_bytes(peak),
        format_bytes(budget),
        format_bytes(executor.plan.predicted_peak_bytes or 0),
    )


def report_grown_outputs(executor: PlanExecutor, output: Any) -> None:
    """Warn, once per plan, where the model's outputs took more than on the example its chain
    was profiled on and the plan, its end code's peak grown as much, passes its budget: a
    head and a loss run on the masked tokens alone (ModernBERT's ``sparse_prediction``) make
    tensors sized by the labels' values, which the budget counted as profiled; at twice the
    masked tokens such a step ran at 1.6 times the budget, unsaid, measured or not (a new
    user's trial), since on CPU the tracker does not watch the code after the blocks."""
    budget = executor.plan.budget_bytes
    outside = executor.chain.metadata.get("outside")
    if budget is None or not outside or "outputs" in executor.reported_over_budget:
        return
    profiled = outside.get("output_bytes", 0)
    if "predicted_from" in executor.chain.metadata or not profiled:
        return  # the outputs of another shape's example
    if in_functorch_transform():
        return  # its wrapped tensors have no storage to count; plain autograd ran
    now = storage_bytes(tree_leaf_tensors(output))
    if now <= max(profiled, executor.checked_output_bytes):
        return
    more = ceil(outside["end_peak_bytes"] * (now / profiled - 1))
    # The end code runs inside B(L) (offremat._model_chain), as part of its temporary.
    *stages, last = executor.chain.stages
    last = replace(last, bwd_tmp_bytes=last.bwd_tmp_bytes + more)
    grown = replace(executor.chain, stages=(*stages, last))
    peak = simulate(executor.plan, grown).peak_bytes
    if peak <= budget:
        executor.checked_output_bytes = now  # not simulated again at every such step
        return
    executor.reported_over_budget.add("outputs")
    logger.warning(
        "this step's outputs took %s, against %s on the batch its plan was profiled on: the "
        "code after the blocks (a head, a loss on the masked tokens) makes tensors sized by "
        "the batch's values, which the plan counted as profiled; grown as much, its peak is "
        "%s, over its budget of %s (it predicted %s). Optimize on the batch that holds the "
        "most, or lower the budget",
        format_bytes(now),
        format_bytes(profiled),
        format_bytes(peak),
        format_bytes(budget),
        format_bytes(executor.plan.predicted_peak_bytes or 0),
    )


# The share of the budget from which the outputs a caller's loss reads are worth a word.
CALLER_LOSS_SHARE = 0.1


def report_loss_left_to_caller(executor: PlanExecutor, output: Any) -> None:
    """Warn, once per plan, where a step returns no loss but tensors that carry a gradient and
    take a tenth of its budget or more: the caller computes the loss from them, outside the
    budget, and a loss over logits holds a few times their size. A Llama's logits with the
    cross-entropy taken outside the model ran at 1.33 times the budget, unsaid, where the
    model given its labels ran within it (a new user's trial)."""
    budget = executor.plan.budget_bytes
    if budget is None or "loss outside" in executor.reported_over_budget:
        return
    if in_functorch_transform():
        return  # its wrapped tensors have no storage to count; plain autograd ran
    carried = [t for t in tree_leaf_tensors(output) if t.requires_grad]
    if not carried:
        return
    # A loss among them, 0-d or of shape (1,) as DataParallel gathers it (taken for none at
    # 0.79 of the budget, a review): the model computes its own. One per example is told
    # from a value head's output by nothing here, and a value head's beside logits whose
    # loss the caller took ran at 1.55 times the budget, unsaid, as a loss (a review).
    if any(t.numel() == 1 for t in carried):
        return
    largest = max(carried, key=lambda t: t.numel() * t.element_size())
    size = storage_bytes(carried)
    if size < CALLER_LOSS_SHARE * budget:
        return
    executor.reported_over_budget.add("loss outside")
    logger.warning(
        "this step returned no loss but %s of tensors that carry a gradient (the largest of "
        "shape %s): the code that computes the loss from them runs outside the budget of %s, "
        "and over logits it holds a few times their size (a cross-entropy keeps their "
        "log-softmax, then makes their gradient). Let the model compute its loss (a Hugging "
        "Face model: pass labels=), or lower the budget by that much",
        format_bytes(size),
        tuple(largest.shape),
        format_bytes(budget),
    )
