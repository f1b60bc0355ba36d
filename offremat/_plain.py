"""A keep-all plan run as what it is: plain autograd over the stages.

Design note. A plan that runs F_all(1), ..., F_all(L) and then B(L), ..., B(1), with no
offload and no recomputation, is the schedule plain autograd follows, and its peak is plain
autograd's. The executor's machinery (one autograd function for the chain, a boundary per
stage, a backward call per stage, RNG capture) exists to change that schedule; with nothing
to change it only costs time, a few percent of a small model's step. So such a step runs the
stages as the model would, and autograd does the rest: saved tensors, in-place checks and
frozen stages (no backward for what needs no gradient) are its own.

What is kept of the executor: autocast's weight cache off (offremat._stage), and the stats'
step times, read from marks when the forward starts and ends, when the backward reaches the
chain's output (a pre-hook on its node) and when the backward ends (a callback queued on the
engine), and the stages' sizes, read from autograd's graph (:mod:`offremat._graph_saved`).
Measuring memory (``measure_memory=True``) needs the executor's halves, so a measured step
runs through them.
What differs from a plan run by the executor is what plain autograd allows: the backward time
runs to the end of the whole backward (code before the chain included), an out-of-memory error
in the backward comes without the plan's advice, and ``retain_graph``, ``create_graph`` and
``torch.autograd.grad`` with respect to parameters work, as they do without offremat.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from offremat._clock import mark
from offremat._graph_saved import StageReading
from offremat._stage import AutocastState
from offremat._stats import StepTiming
from offremat._tensors import flatten


def run_plainly(
    stages: Sequence[nn.Module],
    value: Any,
    device: torch.device,
    finished: Any,
    reading: StageReading | None = None,
) -> Any:
    """The stages' output on ``value``, with autograd's own graph; ``finished(timing)`` is
    called with the step's :class:`StepTiming` once its backward has run, and ``reading``
    reads the stages' sizes from the graph."""
    marks: list[Any] = [mark(device)]
    with ExitStack() as stack:
        # The caller's autocast, with its weight cache off as in every executor forward: the
        # cache would hold low-precision weight copies that no plan counts.
        for state in AutocastState.of_step(device):
            state.enter(stack)
        for stage in stages:
            if reading is not None:
                reading.before(value)
            value = stage(value)
            if reading is not None:
                reading.after(value)
    marks.append(mark(device))
    tensors = flatten(value)[0]
    if reading is not None:
        reading.read(tensors)
    roots = [t.grad_fn for t in tensors if t.grad_fn is not None]
    if not roots:
        return value

    def backward_started(_: Any) -> None:
        for handle in handles:  # the first of the roots that the backward reaches
            handle.remove()
        marks.append(mark(device))
        torch.autograd.Variable._execution_engine.queue_callback(backward_ended)

    def backward_ended() -> None:
        marks.append(mark(device))
        finished(StepTiming(device, 0, marks, None))

    handles = [root.register_prehook(backward_started) for root in roots]
    return value
