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
Python code a node runs (a ``torch.utils.checkpoint`` recomputing its forward) runs with the
compiler's stance ``force_eager``, as under every offremat mode (:mod:`offremat._eager`),
from each node's pre-hook to its post-hook.

What neither sees is the code after the chain (the loss), taken as profiled, as for any step
measured on CPU (:func:`offremat._step_budget.unseen_around_bytes`); a step whose backward
never runs stays unmeasured, and the next one is measured instead.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from offremat._graph_saved import StageReading, sequence_mark
from offremat._plain import run_plainly
from offremat._scan import ModuleScan, fixed_storages
from offremat._stats import StepTiming
from offremat._step_budget import fresh_parameters, gradient_bytes
from offremat._step_settle import settle_measurement
from offremat._tensors import flatten
from offremat.measure import StepMemory

if TYPE_CHECKING:
    from offremat.executor import PlanExecutor


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
        self.memory = StepMemory(device, tensors, gradients_of=fresh)
        self.reading = StageReading(executor._anchor(device), fixed_storages(scans))
        self.verifying = executor.verify_next
        self.sampled, executor.sampling = executor.sampling, False
        self.handles: list[Any] = []
        self.stances: list[Any] = []
        self.ended = False

    def run(self, stages: list[nn.Module], value: Any) -> Any:
        """The stages' output on ``value``, measured through its backward."""
        start = sequence_mark(self.executor._anchor(self.device))
        self.memory.__enter__()
        try:
            value = run_plainly(stages, value, self.device, self._finished, self.reading)
        except BaseException:
            self.memory.discard()
            raise
        self.memory.pause()
        roots = [t.grad_fn for t in flatten(value)[0] if t.grad_fn is not None]
        if not roots:
            self.discard()
        elif self.device.type == "cpu":
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
            self.handles.append(node.register_prehook(self._node_starts))
            self.handles.append(node.register_hook(self._node_ends))
            stack.extend(following for following, _ in node.next_functions)

    def _node_starts(self, *_: Any) -> None:
        stance = torch.compiler.set_stance("force_eager")
        stance.__enter__()
        self.stances.append(stance)
        self.memory.record_within_node()

    def _node_ends(self, *_: Any) -> None:
        if self.stances:
            self.stances.pop().__exit__(None, None, None)

    def _finished(self, timing: StepTiming) -> None:
        """The backward has ended (a callback queued on the engine): settle the step."""
        self._let_go()
        self.ended = True
        self.memory.__exit__(None, None, None)
        executor = self.executor
        executor.plain_measurement = None
        sizes = self.reading.sizes
        budgeted = settle_measurement(
            executor, self.memory, self.new_grad_bytes, sizes, self.verifying, self.sampled
        )
        budget = executor.plan.budget_bytes
        executor._finished(
            replace(timing, memory=self.memory, budgeted_peak_bytes=budgeted, budget_bytes=budget)
        )

    def _let_go(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        while self.stances:  # a node that raised ran no post-hook
            self.stances.pop().__exit__(None, None, None)

    def discard(self) -> None:
        """Drop the measurement: its backward did not run, or raised."""
        if not self.ended:
            self.ended = True
            self._let_go()
            self.memory.discard()
            if self.executor.plain_measurement is self:
                self.executor.plain_measurement = None
