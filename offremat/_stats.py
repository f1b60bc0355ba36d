"""What one training step measured, and what an out-of-memory error during it should say."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from offremat.measure import StepMemory
from solvers.budget import format_bytes
from solvers.plan import Plan


@dataclass(frozen=True)
class StepStats:
    """What the executor measured during one training step.

    - ``measured_peak_bytes``: the step's activation peak measured independently, as the budget
      counts it (:class:`offremat.measure.StepMemory`, the step's input included); None
      unless the executor measures (``measure_memory=True``, or the first step of a plan
      whose chain was read from a plan cache or predicted, see :mod:`offremat.executor`).
      On CUDA the allocator counts everything from the forward's start to the backward's
      end, the caller's loss included; on CPU the tracker watches the plan's forward and
      backward halves only, since a dispatch mode left on between them would run under the
      caller's code. Wrap the whole step in ``StepMemory`` to see the same on both. Where
      the chain is a model's run of blocks, its budget also counts the code around them,
      which the CPU tracker does not see: the check adds it as profiled, and a warning of a
      step over its budget gives both parts.
    - ``budgeted_peak_bytes``: the measured peak as the budget counts it: without the
      parameters' gradients the step made (on CUDA, less all their bytes), plus what the
      tracker does not see of the code around a model's blocks, as profiled; and
      ``over_budget``, whether it passed the plan's budget (None unless measured, or
      without a budget). A warning says the first step over, these say every one.
    - ``bookkept_peak_bytes``: a diagnostic, the most bytes of the distinct storages that the
      executor itself held at once, counted the way the simulator counts; it does not see
      temporaries, what other code holds, or the saved tensors of a direct forward (their
      graph holds them, see :mod:`offremat.executor`); 0 for a keep-all plan run as plain
      autograd (:mod:`offremat._plain`). Never use it as the measurement.
    - ``reserved_peak_bytes``: on CUDA when measuring, the allocator's reserved peak.
    - ``step_time_s``: ``forward_time_s`` + ``backward_time_s``, the plan's forward and backward
      halves (the caller's loss in between is not counted), timed with CUDA events on a GPU.
    """

    measured_peak_bytes: int | None
    bookkept_peak_bytes: int
    reserved_peak_bytes: int | None
    step_time_s: float
    forward_time_s: float
    backward_time_s: float
    device: str
    budgeted_peak_bytes: int | None = None
    over_budget: bool | None = None


@dataclass
class StepTiming:
    """Clock readings and memory figures of one step, resolved into :class:`StepStats`."""

    device: torch.device
    bookkept_peak_bytes: int
    marks: list[Any]
    memory: StepMemory | None
    budgeted_peak_bytes: int | None = None
    budget_bytes: int | None = None

    def resolve(self) -> StepStats:
        if self.device.type == "cuda":
            self.marks[-1].synchronize()
            forward = self.marks[0].elapsed_time(self.marks[1]) / 1000
            backward = self.marks[2].elapsed_time(self.marks[3]) / 1000
        else:
            forward = self.marks[1] - self.marks[0]
            backward = self.marks[3] - self.marks[2]
        memory = self.memory
        return StepStats(
            measured_peak_bytes=None if memory is None else memory.peak_bytes,
            bookkept_peak_bytes=self.bookkept_peak_bytes,
            reserved_peak_bytes=None if memory is None else memory.reserved_peak_bytes,
            step_time_s=forward + backward,
            forward_time_s=forward,
            backward_time_s=backward,
            device=str(self.device),
            budgeted_peak_bytes=self.budgeted_peak_bytes,
            over_budget=None
            if self.budgeted_peak_bytes is None or self.budget_bytes is None
            else self.budgeted_peak_bytes > self.budget_bytes,
        )


class OutOfMemoryAdvice:
    """Re-raise a device out-of-memory error with the plan's figures and what to do."""

    def __init__(self, plan: Plan):
        self.plan = plan

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> bool:
        if isinstance(error, torch.OutOfMemoryError):
            plan = self.plan
            peak = plan.predicted_peak_bytes
            budget = plan.budget_bytes
            raise torch.OutOfMemoryError(
                f"out of device memory while running the {plan.solver} plan "
                f"(predicted activation peak {format_bytes(peak) if peak is not None else '?'}, "
                f"budget {format_bytes(budget) if budget is not None else 'none'}). The chain no "
                f"longer matches the model (another batch or sequence size?) or the rest of the "
                f"memory (weights, gradients, optimizer state) leaves less than the budget: "
                f"profile again with the input you train on (offremat.optimize(model, x, ...)) "
                f"and lower the budget. Original error: {error}"
            ) from error
        return False
