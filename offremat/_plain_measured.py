"""A keep-all plan's step, run as plain autograd, measured from its forward to its backward's end.

Design note. A keep-all plan runs as plain autograd (:mod:`offremat._plain`), and plain
autograd's backward is run by the engine, not by the executor. Its measured steps (a check now
and then, values or a shape its plan was not profiled on) had their forward measured alone,
and a backward holding more than its forward told passed unsaid: a mixture of experts whose
backward makes a gradient of every expert's weights per expert reached ran a keep-all plan at
1.07 to 1.15 times the budget at every step (a review).

On CUDA the allocator's peak statistics see the whole step: reset when the forward starts,
read when the engine's queued callback says the backward has ended. On CPU the step's
tracker (:class:`offremat.measure.StepMemory`) is a dispatch mode, and the engine runs every
node under the thread's state as it was when ``backward()`` was called, restored when the
node ends: a mode left on at the forward's end would stay on for the caller's code after the
backward, and one entered by a hook is gone when its node ends. So the tracker is paused at
the forward's end and pushed again by a pre-hook on every node the chain's forward made (and
on the leaves' gradient accumulators), and left for the engine to take off when the node
ends; that is after the node has summed the gradients it hands on, which it allocates too.
Nothing of it outlives a node that raises (:class:`offremat._live_storages.WithinNode`).

A backward that keeps its graph (``retain_graph=True``) holds every activation past its end,
which plain autograd allows and no other plan does (:mod:`offremat._plan_function`): such a
step is said once and not checked, and the plan is not made again, which would give one that
refuses the caller's next such step (a review: a training loop that ran stopped at the
check); its other steps are checked, and one over the budget is said
(``PlanExecutor.retains_graph``).

What neither sees is the code after the chain (the loss), taken as profiled, as for any step
measured on CPU (:func:`offremat._step_budget.unseen_around_bytes`); a step whose backward
never runs stays unmeasured, and the next one is measured instead.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from offremat._graph_saved import StageReading, saved_values, sequence_mark
from offremat._plain import run_plainly
from offremat._scan import ModuleScan, fixed_storages
from offremat._stats import StepTiming
from offremat._step_budget import budgeted_peak_bytes, fresh_parameters, gradient_bytes
from offremat._step_settle import settle_measurement
from offremat._tensors import flatten
from offremat.measure import StepMemory
from solvers.budget import format_bytes

if TYPE_CHECKING:
    from offremat.executor import PlanExecutor

logger = logging.getLogger(__name__)


class PlainMeasurement:
    """The measurement of one keep-all step run as plain autograd (module notes)."""

    def __init__(
        self,
        executor: PlanExecutor,
        tensors: list[torch.Tensor],
        device: torch.device,
        scans: list[ModuleScan],
    ):
        self.executor = executor
        self.device = device
        fresh = fresh_parameters(scans)
        self.new_grad_bytes = gradient_bytes(fresh)
        self.memory = StepMemory(device, tensors, gradients_of=fresh, allocator=False)
        self.reading = StageReading(executor._anchor(device), fixed_storages(scans))
        self.verifying = executor.verify_next
        self.sampled, executor.sampling = executor.sampling, False
        self.handles: list[Any] = []
        self.ran: list[Any] = []  # the hooked nodes the backward has run, in order
        self.ended = False
        self.timing: StepTiming | None = None
        self.budgeted: int | None = None  # the settled step's peak as its budget counts it

    def run(self, stages: list[nn.Module], value: Any) -> Any:
        """The stages' output on ``value``, measured through its backward."""
        start = sequence_mark(self.executor._anchor(self.device))
        self.memory.__enter__()
        try:
            value = run_plainly(stages, value, self.device, self._timed, self.reading)
        except BaseException:
            self.discard()  # a check falls to the next step, as where no backward runs
            raise
        self.memory.pause()
        roots = [t.grad_fn for t in flatten(value)[0] if t.grad_fn is not None]
        if not roots:
            self.discard()
        else:
            self._watch_nodes(roots, start)
        return value

    def _watch_nodes(self, roots: list[Any], start: int) -> None:
        """Hook every node behind ``roots`` made from ``start`` on (module notes)."""
        seen: set[Any] = set()
        stack = list(roots)
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            # Made before the chain (the code before it): not the chain's backward.
            if node._sequence_nr() < start:
                continue
            self.handles.append(node.register_prehook(partial(self._node_starts, node)))
            stack.extend(following for following, _ in node.next_functions)

    def _node_starts(self, node: Any, *_: Any) -> None:
        if not self.ran:  # the first node of the chain the backward reaches
            torch.autograd.Variable._execution_engine.queue_callback(self._settle)
        self.ran.append(node)
        self.memory.record_within_node()  # on CPU; the CUDA allocator sees it all

    def _settle(self) -> None:
        """The backward has ended (a callback queued on the engine): take in the step. Queued
        from the chain's nodes, not from its output's: a loss that reads some of its outputs
        alone left the step measured and unsettled at every call (a review)."""
        self._let_go()
        self.ended = True
        self.memory.__exit__(None, None, None)
        executor = self.executor
        executor.plain_measurement = None
        ran, self.ran = self.ran, []
        kept = _graph_kept(ran)
        if kept and not executor.retains_graph:
            executor.retains_graph = True
            logger.warning(
                "a step of a keep-all plan, run as plain autograd, kept its graph through "
                "its backward (retain_graph=True), which holds every activation past its end "
                "and which no other plan allows: such steps are not checked against the "
                "budget, and a later step measured over it is said, not planned again"
            )
        if kept or executor.retains_graph:
            executor.verify_next = executor.verify_again = False
            if not kept:
                self.budgeted = budgeted_peak_bytes(executor, self.memory, self.new_grad_bytes)
                _said_kept(executor, self.budgeted)
        else:
            self.budgeted = settle_measurement(
                executor,
                self.memory,
                self.new_grad_bytes,
                self.reading.sizes,
                self.verifying,
                self.sampled,
            )
        if self.timing is not None:
            self._timed(self.timing)

    def _timed(self, timing: StepTiming) -> None:
        """The step's clock readings (:func:`offremat._plain.run_plainly`), given to the
        executor's stats with the measurement once it is settled."""
        self.timing = timing
        if not self.ended:
            return
        measured = self.budgeted is not None
        self.executor._finished(
            replace(
                timing,
                memory=self.memory if measured else None,
                budgeted_peak_bytes=self.budgeted,
                budget_bytes=self.executor.plan.budget_bytes if measured else None,
            )
        )

    def _let_go(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def discard(self) -> None:
        """Drop the measurement: its backward did not run, or raised."""
        if not self.ended:
            self.ended = True
            self._let_go()
            self.ran = []
            self.memory.discard()
            # The check falls to the next step (a dropped output lost it, a review).
            self.executor.sampling |= self.sampled
            if self.executor.plain_measurement is self:
                self.executor.plain_measurement = None


def _said_kept(executor: PlanExecutor, budgeted: int) -> None:
    """Say, once, that a step of a plan whose steps have kept their graph passed its budget:
    made again, the plan would recompute, and refuse the caller's next ``retain_graph`` (a
    review: a loop that ran stopped), and unchecked, one such step left a mixture of experts
    over its budget at every later step, unsaid (a review)."""
    budget = executor.plan.budget_bytes
    if budget is None or budgeted <= budget or "kept graph" in executor.reported_over_budget:
        return
    executor.reported_over_budget.add("kept graph")
    logger.warning(
        "this step measured %s, over its budget of %s; its plan, whose steps have kept their "
        "graph (retain_graph=True), which a plan that recomputes refuses, is not planned "
        "again. Lower the batch, or raise the budget",
        format_bytes(budgeted),
        format_bytes(budget),
    )


def _graph_kept(ran: list[Any]) -> bool:
    """Whether the backward that ran the nodes ``ran`` kept their graph (``retain_graph``):
    autograd releases what each node saved once it has run, unless told to keep it."""
    for node in ran:
        try:
            values = saved_values(node)
        except RuntimeError:  # a custom Function's, released: it raises where read
            continue
        for value in values:
            if isinstance(value, (tuple, list)) or value is None or value.unpack_hook:
                continue
            if value.data is not None:
                return True
    return False
