"""What the host does, in order, to run a simulated plan: the simulator's issue decisions.

The simulator (``docs/plan-format.md``) issues a copy listed after compute op k when op k
starts, and releases an offloaded tensor's GPU bytes when its copy ends. The host cannot act
at GPU times; it can only act between enqueuing compute ops. :func:`host_actions` turns the
simulator's record of each op (when it was ready, when it started and ended) into that order:

- a prefetch listed after op k is allocated and issued *before* op k is enqueued, its copy
  waiting on an event recorded just then, so that it runs beside op k as simulated; but one
  that the simulator starts only once op k (or a later op) has ended, because it waited for the
  memory that op releases, is issued after the last compute op that ends by its start;
- an offload listed after op k is issued once op k is enqueued (its tensor may be op k's
  output), its copy waiting only on the op that produced the tensor;
- the GPU bytes of an offload are released before the first later compute op that the
  simulator starts at or after the copy's end: the compute stream waits on the copy's event
  there, which is the simulator's memory admission wait; when the simulator held a prefetch
  back for memory, the offloads it waited for are released before that prefetch.

Every comparison is between times the simulator computed along the same path (an admission
time is the time of the release it waited for), so they are exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from solvers.ops import FREE, OFFLOAD, PREFETCH, Op

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


@dataclass(frozen=True)
class OpTimes:
    """When the simulator found an op ready (but for memory), started it and ended it."""

    ready_s: float
    start_s: float
    end_s: float


def host_actions(ops: Sequence[Op], times: dict[int, OpTimes]) -> tuple[HostAction, ...]:
    """The host's actions for a valid plan, from the simulator's ``times`` of each op.

    ``times`` has every compute and copy op; a ``free`` needs none.
    """
    computes = [n for n, op in enumerate(ops) if op.is_compute]
    leading = tuple(n for n in range(computes[0]) if not ops[n].is_compute) if computes else ()
    groups = []
    for k, position in enumerate(computes):
        stop = computes[k + 1] if k + 1 < len(computes) else len(ops)
        groups.append(tuple(range(position + 1, stop)))

    actions: list[HostAction] = []
    pending: list[tuple[int, int]] = [(-1, n) for n in leading if ops[n].kind == OFFLOAD]
    deferred: dict[int, list[int]] = {}

    def release_until(time: float, before_group: int, turn: int) -> None:
        due = [n for group, n in pending if group < before_group and times[n].end_s <= time]
        actions.extend(HostAction(RELEASE, n, turn) for n in due)
        pending[:] = [(group, n) for group, n in pending if n not in due]

    for k, position in enumerate(computes):
        early, late = _split_group(ops, groups[k])
        # A prefetch the simulator starts only after op k ends waits for what op k releases:
        # issue it after the last compute op that ends by its start.
        for n in [n for n in early if times[n].start_s >= times[position].end_s]:
            last = max(
                m for m in range(k, len(computes)) if times[computes[m]].end_s <= times[n].start_s
            )
            deferred.setdefault(last, []).append(n)
            early = tuple(e for e in early if e != n)
        threshold = times[position].start_s
        for n in early:
            if times[n].start_s > times[n].ready_s:  # the simulator held it back for memory
                threshold = max(threshold, times[n].start_s)
        release_until(threshold, k, k)
        actions.extend(HostAction(ISSUE, n, k) for n in (leading if k == 0 else ()) + early)
        actions.append(HostAction(COMPUTE, position, k))
        actions.extend(HostAction(ISSUE, n, k) for n in late)
        pending += [(k, n) for n in groups[k] if ops[n].kind == OFFLOAD]
        for n in sorted(deferred.pop(k, [])):
            release_until(times[n].start_s, k + 1, k)
            actions.append(HostAction(ISSUE, n, k))
    return tuple(actions)


def _split_group(ops: Sequence[Op], group: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
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
