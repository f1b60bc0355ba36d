"""From a plan and its simulation to the order in which the host issues work.

The simulator (``docs/plan-format.md``) issues a copy listed after compute op k when op k
starts, and releases an offloaded tensor's GPU bytes when its copy ends. The host cannot act at
GPU times; it can only act between enqueuing compute ops. So:

- a prefetch listed after op k is allocated and issued *before* op k is enqueued, its copy
  waiting on an event recorded just then, so that it runs beside op k as simulated; but one
  that the simulator starts only once op k (or a later op) has ended, because it waited for
  the memory that op releases, is issued after that op;
- an offload listed after op k is issued once op k is enqueued (its tensor may be op k's
  output), its copy waiting only on the op that produced the tensor;
- the GPU bytes of an offload are released before the first later compute op that the
  simulator starts at or after the copy's end. The compute stream waits on the copy's event
  there, which is the simulator's memory admission wait; when the simulator delayed a
  prefetch for memory, the offloads it waited for are released before that prefetch.

Nothing here needs torch: this is bookkeeping over ``solvers`` objects.
"""

from __future__ import annotations

from dataclasses import dataclass

from solvers.plan import FREE, OFFLOAD, PREFETCH, Op
from solvers.simulator import D2H_LANE, H2D_LANE, Simulation

RELEASE, ISSUE, COMPUTE = "release", "issue", "compute"


@dataclass(frozen=True)
class HostAction:
    """One thing the host does, naming an op by its position in the plan's op list.

    ``release`` frees the device bytes of the offload at ``position``; ``issue`` performs a
    memory op (offload, prefetch, free); ``compute`` enqueues a compute op. ``turn`` counts the
    compute ops: the action is taken on the way to, at or right after the turn-th one.
    """

    kind: str
    position: int
    turn: int


def host_schedule(ops: tuple[Op, ...], simulation: Simulation) -> tuple[HostAction, ...]:
    """The host's actions for a valid plan, in the order it takes them."""
    start: dict[int, float] = {}
    end: dict[int, float] = {}
    for interval in simulation.timeline:
        start[interval.op_index] = interval.start_s
        end[interval.op_index] = interval.end_s
    tolerance = 1e-9 * max(simulation.makespan_s, 1e-6)

    computes = [n for n, op in enumerate(ops) if op.is_compute]
    leading = tuple(n for n in range(computes[0]) if not ops[n].is_compute) if computes else ()
    groups = []
    for k, position in enumerate(computes):
        stop = computes[k + 1] if k + 1 < len(computes) else len(ops)
        groups.append(tuple(range(position + 1, stop)))
    ready_h2d = _prefetch_ready_times(ops, simulation, start)

    actions: list[HostAction] = []
    pending: list[tuple[int, int]] = [(-1, n) for n in leading if ops[n].kind == OFFLOAD]
    deferred: dict[int, list[int]] = {}

    def release_until(time: float, before_group: int, turn: int) -> None:
        nonlocal pending
        due = [n for group, n in pending if group < before_group and end[n] <= time + tolerance]
        actions.extend(HostAction(RELEASE, n, turn) for n in due)
        pending = [(group, n) for group, n in pending if n not in due]

    for k, position in enumerate(computes):
        early, late = _split_group(ops, groups[k])
        # A prefetch the simulator starts only after op k ends waits for what op k releases:
        # issue it after the last compute op that ends by its start.
        for n in [n for n in early if start[n] >= end[position] - tolerance]:
            last = max(
                m for m in range(k, len(computes)) if end[computes[m]] <= start[n] + tolerance
            )
            deferred.setdefault(last, []).append(n)
            early = tuple(e for e in early if e != n)
        threshold = start[position]
        for n in early:
            if start[n] > max(ready_h2d[n], start[position]) + tolerance:
                threshold = max(threshold, start[n])  # the simulator held it back for memory
        release_until(threshold, k, k)
        actions.extend(HostAction(ISSUE, n, k) for n in (leading if k == 0 else ()) + early)
        actions.append(HostAction(COMPUTE, position, k))
        actions.extend(HostAction(ISSUE, n, k) for n in late)
        pending += [(k, n) for n in groups[k] if ops[n].kind == OFFLOAD]
        for n in sorted(deferred.pop(k, [])):
            release_until(start[n], k + 1, k)
            actions.append(HostAction(ISSUE, n, k))
    return tuple(actions)


def _split_group(
    ops: tuple[Op, ...], group: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Prefetches that can be issued ahead of their compute op, and everything else, in order.

    A prefetch of a tensor that the same group offloads or frees first must wait its turn.
    """
    early: list[int] = []
    late: list[int] = []
    touched: set[tuple[str, int]] = set()
    for n in group:
        op = ops[n]
        if op.kind == PREFETCH and op.tensor not in touched:
            early.append(n)
        else:
            late.append(n)
        if op.kind in (OFFLOAD, FREE):
            touched.add(op.tensor)
    return tuple(early), tuple(late)


def _prefetch_ready_times(
    ops: tuple[Op, ...], simulation: Simulation, start: dict[int, float]
) -> dict[int, float]:
    """For each prefetch, when it could start but for memory: its channel and its offload."""
    copies = sorted(
        (i for i in simulation.timeline if i.lane in (D2H_LANE, H2D_LANE)),
        key=lambda interval: interval.op_index,
    )
    channel_free = 0.0
    offload_end: dict[tuple[str, int], float] = {}
    ready: dict[int, float] = {}
    for interval in copies:
        op = ops[interval.op_index]
        if interval.lane == D2H_LANE:
            offload_end[op.tensor] = interval.end_s
            continue
        ready[interval.op_index] = max(channel_free, offload_end.get(op.tensor, 0.0))
        channel_free = interval.end_s
    return {n: ready.get(n, start.get(n, 0.0)) for n, op in enumerate(ops) if op.kind == PREFETCH}
