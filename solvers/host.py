"""What the host does, in order, to run a simulated plan: the simulator's issue decisions.

The simulator (``docs/plan-format.md``) issues a copy listed after compute op k when op k
starts, and releases an offloaded tensor's GPU bytes when its copy ends. The host cannot act
at GPU times; it can only act between enqueuing compute ops. :func:`host_actions` turns the
simulator's record of each op (when it was ready, when it started and ended) into that order:

- a prefetch listed after op k is allocated and issued *before* op k is enqueued, its copy
  waiting on an event recorded just then, so that it runs beside op k as simulated; but one
  that the simulator starts only once op k (or a later op) has ended, because it waited for the
  memory that op releases, is issued after the last compute op that ends by its start, and
  every later op of the same tensor (a free, an offload) waits for it, in list order; and one
  that starts after an offload listed before it beside op k has ended is issued after op k,
  once that offload is released (memory first: its copy may then start later than simulated);
- an offload listed after op k is issued once op k is enqueued (its tensor may be op k's
  output), its copy waiting only on the op that produced the tensor;
- the GPU bytes of an offload are released before the first later compute op that the
  simulator starts at or after the copy's end: the compute stream waits on the copy's event
  there, which is the simulator's memory admission wait; when the simulator held a prefetch
  back for memory, the offloads it waited for are released before that prefetch; a copy
  that ends after the last compute op starts is released at the end, after it.

Every comparison is between times the simulator computed along the same path (an admission
time is the time of the release it waited for), so they are exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from solvers.ops import FREE, OFFLOAD, PREFETCH, Op
from solvers.semantics import effect, input_holders

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
    pending: list[tuple[int, int]] = []  # offloads issued, not yet released: (group, position)
    deferred: dict[int, list[int]] = {}  # turn -> memory ops issued right after it
    waiting: dict[tuple[str, int], int] = {}  # tensor -> the turn an op of it is deferred to

    def release_until(time: float, before_group: int, turn: int) -> None:
        due = [n for group, n in pending if group < before_group and times[n].end_s <= time]
        actions.extend(HostAction(RELEASE, n, turn) for n in due)
        pending[:] = [(group, n) for group, n in pending if n not in due]

    def issue(n: int, turn: int, group: int) -> None:
        if ops[n].tensor in waiting:  # an earlier op of its tensor is deferred: follow it
            deferred[waiting[ops[n].tensor]].append(n)
            return
        actions.append(HostAction(ISSUE, n, turn))
        if ops[n].kind == OFFLOAD:
            pending.append((group, n))

    for k, position in enumerate(computes):
        early, late = _split_group(ops, position, groups[k])
        # A prefetch the simulator starts only after op k ends waits for what op k releases:
        # issue it after the last compute op that ends by its start.
        for n in [n for n in early if times[n].start_s >= times[position].end_s]:
            last = max(
                m for m in range(k, len(computes)) if times[computes[m]].end_s <= times[n].start_s
            )
            # Never past a compute op that reads, makes or frees its tensor (a plan no solver
            # makes, where the simulator's times leave list order).
            touching = (
                m for m in range(k + 1, last + 1) if ops[n].tensor in _touched(ops[computes[m]])
            )
            last = next(touching, last + 1) - 1
            turn = max(last, waiting.get(ops[n].tensor, last))
            deferred.setdefault(turn, []).append(n)
            waiting[ops[n].tensor] = turn
            early = tuple(e for e in early if e != n)
        # A prefetch that the simulator starts once an offload listed before it in the same
        # group has released its bytes waits for that release, which the host makes only
        # after op k: issue it then, or op k would run with both tensors resident.
        after_release = [
            n
            for n in early
            if any(
                ops[m].kind == OFFLOAD and times[m].end_s <= times[n].start_s
                for m in groups[k]
                if m < n
            )
        ]
        for n in after_release:
            turn = max(k, waiting.get(ops[n].tensor, k))
            deferred.setdefault(turn, []).append(n)
            waiting[ops[n].tensor] = turn
        early = tuple(n for n in early if n not in after_release)
        threshold = times[position].start_s
        for n in early:
            if times[n].start_s > times[n].ready_s:  # the simulator held it back for memory
                threshold = max(threshold, times[n].start_s)
        release_until(threshold, k, k)
        for n in leading if k == 0 else ():
            issue(n, k, -1)
        for n in early:
            issue(n, k, k)
        actions.append(HostAction(COMPUTE, position, k))
        for n in late:
            issue(n, k, k)
        for n in sorted(deferred.pop(k, [])):
            if ops[n].kind == PREFETCH:
                release_until(times[n].start_s, k + 1, k)
            actions.append(HostAction(ISSUE, n, k))
            if ops[n].kind == OFFLOAD:
                pending.append((k, n))
        waiting = {tensor: turn for tensor, turn in waiting.items() if turn != k}
    # A copy that ends after the last compute op starts: released at the end of the step.
    actions.extend(HostAction(RELEASE, n, len(computes) - 1) for _, n in pending)
    return tuple(actions)


def _touched(compute: Op) -> set[tuple[str, int]]:
    """The tensors a compute op reads, makes or frees."""
    change = effect(compute)
    inputs = input_holders(compute.index) if change.reads_input else ()
    return {*change.reads, *change.releases, *inputs} | (
        {change.allocates} if change.allocates else set()
    )


def _split_group(
    ops: Sequence[Op], compute: int, group: tuple[int, ...]
) -> tuple[tuple[int, ...], ...]:
    """Prefetches that can be issued ahead of their compute op, and everything else, in order.

    A prefetch of a tensor that the compute op or the group before it reads, makes, offloads
    or frees must wait its turn.
    """
    early: list[int] = []
    late: list[int] = []
    touched = _touched(ops[compute])
    for n in group:
        op = ops[n]
        if op.kind == PREFETCH and op.tensor not in touched:
            early.append(n)
        else:
            late.append(n)
        if op.kind in (OFFLOAD, FREE):
            touched.add(op.tensor)
    return tuple(early), tuple(late)
