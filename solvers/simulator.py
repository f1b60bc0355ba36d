"""Replay a plan on the cost model: one compute stream and two FIFO copy channels.

This is the single source of truth for every time and peak that a solver reports. The rules
(issue times, when bytes are allocated and released, the memory admission wait) are those of
``docs/plan-format.md``.

Design note, memory admission: an offload frees GPU memory only when its copy ends, which may
be later than the compute stream would otherwise reach the next allocation. Rather than let the
peak depend on copy speed, an allocation (a compute op's output and temporaries, or a prefetch)
waits until the bytes already committed, counting every release and allocation scheduled so far,
stay within the budget from then on. The executor implements this wait with stream events, so
the simulated peak is the one the GPU sees. Plans without offloads never wait.
"""

from __future__ import annotations

from dataclasses import dataclass

from solvers.chain import Chain
from solvers.chain_limits import SHORTEST_SECONDS
from solvers.host import HostAction, OpTimes, host_actions
from solvers.plan import (
    BACKWARD,
    FREE,
    OFFLOAD,
    PREFETCH,
    Op,
    Plan,
    PlanError,
    copies,
    validate,
)
from solvers.semantics import (
    GRAD,
    Tensor,
    duration_s,
    effect,
    initial_residency,
    refills,
    released,
    stage_input,
    temporary_bytes,
    tensor_bytes,
)

COMPUTE_LANE, D2H_LANE, H2D_LANE = "compute", "d2h", "h2d"


@dataclass(frozen=True)
class Interval:
    """One operation's span on its lane."""

    op_index: int
    label: str
    lane: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Simulation:
    """What :func:`simulate` predicts for a plan, and the host actions that realise it
    (:mod:`solvers.host`), which the executor follows as given."""

    makespan_s: float
    peak_bytes: int
    budget_bytes: int | None
    timeline: tuple[Interval, ...]
    memory_curve: tuple[tuple[float, int], ...]
    wait_s: float
    host_actions: tuple[HostAction, ...] = ()

    @property
    def feasible(self) -> bool:
        """Whether the peak is within the budget (always true without a budget)."""
        return self.budget_bytes is None or self.peak_bytes <= self.budget_bytes


class _Memory:
    """Resident GPU bytes as a list of timed changes, with the admission query.

    Changes before ``horizon`` can no longer be overtaken by a new allocation, so they are folded
    into ``settled``; only the few still-pending copy events are scanned by :meth:`admit`.
    """

    def __init__(self) -> None:
        self.changes: list[tuple[float, int, int, int]] = []
        self.pending: list[tuple[float, int, int, int]] = []
        self.settled = 0

    def add(self, time: float, delta: int, in_order: bool = False) -> None:
        """Record a change; ``in_order`` keeps it in the order it happened (an op's start, and
        the end of an op that took no time) even where it frees bytes."""
        # At one instant, releases by ops that took time go first (an op may start the instant
        # another ends); allocations, an op's start and the end of a zero-length op follow in
        # the order they happened.
        phase = 1 if delta > 0 or in_order else 0
        event = (time, phase, len(self.changes), delta)
        self.changes.append(event)
        self.pending.append(event)

    def settle(self, horizon: float) -> None:
        keep = []
        for event in self.pending:
            if event[0] < horizon:
                self.settled += event[3]
            else:
                keep.append(event)
        self.pending = keep

    def admit(self, ready: float, size: int, budget: int | None) -> float:
        """The earliest time >= ready from which ``size`` more bytes stay within the budget."""
        if budget is None or not self.pending:
            return ready
        levels = _levels(self.pending, self.settled)
        at_ready = self.settled + sum(e[3] for e in self.pending if e[0] <= ready)
        candidates = [(ready, at_ready)] + [(t, lv) for t, lv in levels if t > ready]
        suffix_max = [0] * len(candidates)
        running = -(1 << 62)
        for k in range(len(candidates) - 1, -1, -1):
            running = max(running, candidates[k][1])
            suffix_max[k] = running
        for (time, _), highest in zip(candidates, suffix_max, strict=True):
            if highest + size <= budget:
                return time
        return ready


def simulate(
    plan: Plan | list[Op] | tuple[Op, ...], chain: Chain, budget: int | None = None
) -> Simulation:
    """Replay ``plan`` on ``chain``: makespan, peak, timeline and memory curve.

    Raises :class:`PlanError` listing every broken rule if the plan is not valid, and
    ``ValueError`` if it copies on a chain without a link.
    """
    ops = plan.ops if isinstance(plan, Plan) else tuple(plan)
    problems = validate(plan if isinstance(plan, Plan) else ops, chain)
    if problems:
        raise PlanError(problems)
    if chain.link is None and copies(ops):
        raise ValueError("the plan copies tensors but the chain has no link; add a 'link'")

    def size(tensor: Tensor) -> int:
        return tensor_bytes(tensor, chain)

    refilled = refills(ops)
    memory = _Memory()
    start_state = initial_residency(chain.length)
    memory.add(0.0, sum(size(tensor) for tensor in start_state))
    timeline: list[Interval] = []
    compute_free = 0.0
    last_compute_start = 0.0
    channel_free = {D2H_LANE: 0.0, H2D_LANE: 0.0}
    host_ready_at: dict[Tensor, float] = {}
    # What is resident and from when: a_0 and δ_L from the start, like any computed tensor.
    gpu_ready_at: dict[Tensor, float] = dict.fromkeys(start_state, 0.0)
    last_reader_end: dict[Tensor, float] = {}
    times: dict[int, OpTimes] = {}
    wait_total = 0.0

    def release(tensor: Tensor) -> int:
        del gpu_ready_at[tensor]
        last_reader_end.pop(tensor, None)
        return -size(tensor)

    for n, op in enumerate(ops):
        label = str(op)
        if op.is_compute:
            i = op.index
            change = effect(op)
            inputs = [*change.reads, stage_input(i, gpu_ready_at)]
            ready = max([compute_free] + [gpu_ready_at[t] for t in inputs if t is not None])
            assert change.allocates is not None
            persistent, transient = size(change.allocates), temporary_bytes(op, chain)
            memory.settle(last_compute_start)
            start = memory.admit(ready, persistent + transient, budget)
            end = start + max(duration_s(op, chain, n in refilled), SHORTEST_SECONDS)
            wait_total += start - compute_free
            memory.add(start, persistent + transient, in_order=True)
            for tensor in inputs:
                if tensor is not None and tensor[0] != GRAD:
                    last_reader_end[tensor] = end
            gone = released(op, gpu_ready_at)
            gpu_ready_at[change.allocates] = end
            # At its end the op gives back its temporary (bytes back, when it is negative: a
            # backward that freed part of x̄_i by its peak) and its releases; after B(L) the
            # caller holds its output and seed. Decreases first, as for an op that took time.
            ending = [-transient, *(release(tensor) for tensor in gone)]
            if op.kind == BACKWARD and i == chain.length:
                ending.append(chain.held_bytes)
            instant = end == start
            for delta in sorted(ending, key=lambda delta: delta > 0):
                memory.add(end, delta, in_order=instant)
            timeline.append(Interval(n, label, COMPUTE_LANE, start, end))
            times[n] = OpTimes(ready, start, end)
            compute_free = end
            last_compute_start = start
        elif op.kind == OFFLOAD:
            tensor = op.tensor
            # Copy once the op that produced the tensor (a forward or a prefetch) has ended.
            issue = max(last_compute_start, gpu_ready_at[tensor])
            start = max(issue, channel_free[D2H_LANE])
            end = start + size(tensor) / chain.link.d2h_bytes_per_s
            channel_free[D2H_LANE] = end
            host_ready_at[tensor] = end
            released_at = max(end, last_reader_end.get(tensor, 0.0))
            del gpu_ready_at[tensor]
            memory.add(released_at, -size(tensor))
            timeline.append(Interval(n, label, D2H_LANE, start, end))
            times[n] = OpTimes(start, start, end)
        elif op.kind == PREFETCH:
            tensor = op.tensor
            ready = max(last_compute_start, channel_free[H2D_LANE], host_ready_at[tensor])
            start = memory.admit(ready, size(tensor), budget)
            end = start + size(tensor) / chain.link.h2d_bytes_per_s
            channel_free[H2D_LANE] = end
            memory.add(start, size(tensor))
            gpu_ready_at[tensor] = end
            last_reader_end.pop(tensor, None)
            timeline.append(Interval(n, label, H2D_LANE, start, end))
            times[n] = OpTimes(ready, start, end)
        elif op.kind == FREE:
            # A tensor still arriving is freed once its prefetch has ended.
            freed_at = max(compute_free, gpu_ready_at[op.tensor])
            memory.add(freed_at, release(op.tensor))

    curve = _levels(memory.changes)
    peak = max(level for _, level in curve)
    return Simulation(
        makespan_s=compute_free,
        peak_bytes=peak,
        budget_bytes=budget,
        timeline=tuple(timeline),
        memory_curve=tuple(curve),
        wait_s=wait_total,
        host_actions=host_actions(ops, times),
    )


def _levels(changes: list[tuple[float, int, int, int]], start: int = 0) -> list[tuple[float, int]]:
    """Resident bytes over time: per instant, the highest level reached within it."""
    level = start
    curve: list[tuple[float, int]] = []
    for time, phase, _, delta in sorted(changes):
        level += delta
        if curve and curve[-1][0] == time:
            # Phase 0 releases come first in an instant; after them, keep the highest level.
            curve[-1] = (time, max(curve[-1][1], level) if phase == 1 else level)
        else:
            curve.append((time, level))
    return curve


def compute_time_s(plan: Plan, chain: Chain) -> float:
    """The sum of ``plan``'s compute durations, as :func:`simulate` times them: its makespan
    is at least this (one compute stream runs one op at a time), and equal where no op waits
    for memory or a copy, as in a plan that copies nothing and has no budget."""
    refilled = refills(plan.ops)
    return sum(
        max(duration_s(op, chain, n in refilled), SHORTEST_SECONDS)
        for n, op in enumerate(plan.ops)
        if op.is_compute
    )


def score(plan: Plan, chain: Chain, budget: int | None) -> Plan:
    """The plan with its budget, predicted time and predicted peak filled in by :func:`simulate`."""
    result = simulate(plan, chain, budget)
    return Plan(
        ops=plan.ops,
        stage_names=chain.stage_names,
        solver=plan.solver,
        budget_bytes=budget,
        predicted_time_s=result.makespan_s,
        predicted_peak_bytes=result.peak_bytes,
        chain_name=chain.name,
        info=plan.info,
    )


def least_fitting_budget(plan: Plan, chain: Chain, above: int = 0) -> int:
    """The least budget greater than ``above`` at which the fixed ``plan`` fits.

    Without copies the peak does not depend on the budget, so it is the answer. With copies the
    simulator delays allocations until offloads free memory, so a tighter budget can still fit
    at the cost of waiting: bisect between ``above`` (taken not to fit) and the unconstrained
    peak (which fits).
    """
    peak = simulate(plan, chain).peak_bytes
    if not any(op.kind == OFFLOAD for op in plan.ops) or peak <= above:
        return max(peak, above + 1)
    low, high = above, peak
    while high - low > 1:
        middle = (low + high) // 2
        if simulate(plan, chain, middle).feasible:
            high = middle
        else:
            low = middle
    return high
