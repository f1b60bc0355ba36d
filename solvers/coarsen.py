"""Coarse chains: consecutive stages grouped into one, and plans of the group chain expanded.

A long chain (100 to 300 stages) makes the joint MILP too big to build and search in a time a
user waits for. Grouping consecutive stages gives a chain of a few dozen stages whose MILP is
quick; its plan, expanded, is a plan of the original chain. This is the coarse level of a
two-level decomposition: the expanded plan then warm-starts the fine search, or is the answer
when the fine model is too big to build in time.

Design note, conservative groups. A group G = stages p..q is a stage whose output is a_q,
saved set the union of x̄_p..x̄_q, gradient δ_q, times the sums, and temporaries chosen so
that at every instant of the expanded operations the fine chain holds no more than the group
chain does at the matching instant (``docs/plan-format.md``'s rules, worked out per field in
:func:`group_stage`). So, replayed without a budget, an expanded plan's peak is at most the
group plan's and its makespan no later. Under a budget the simulator admits allocations in
list order, and a prefetch listed ahead of a group's later backwards can take the memory
they need: the expanded plan is scored on the fine chain, and :func:`expand` can list the
prefetches after the group's backwards instead. Nothing is taken on trust.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from solvers.chain import Chain, Stage
from solvers.plan import (
    ACTIVATION,
    BACKWARD,
    F_ALL,
    F_CK,
    F_NONE,
    FREE,
    OFFLOAD,
    PREFETCH,
    Op,
    Plan,
    backward,
    forward_all,
    forward_checkpoint,
    forward_none,
)

Groups = tuple[tuple[int, int], ...]


def balanced_groups(chain: Chain, count: int) -> Groups:
    """``count`` runs of consecutive stages (first, last), with about equal f + b each."""
    count = max(1, min(count, chain.length))
    work = [stage.fwd_s + stage.bwd_s for stage in chain.stages]
    total = sum(work) or 1.0
    cumulative = list(itertools.accumulate(work))
    groups, first = [], 1
    for n in range(1, count + 1):
        remaining_groups = count - n
        target = total * n / count
        last = first
        # Take stages while the group's share is not reached, leaving one per later group.
        while last < chain.length - remaining_groups and cumulative[last - 1] < target:
            last += 1
        if n == count:
            last = chain.length
        groups.append((first, last))
        first = last + 1
    return tuple(groups)


def group_stage(chain: Chain, first: int, last: int) -> Stage:
    """Stages first..last as one stage that never holds less than they do (module note)."""
    stages = [chain.stage(i) for i in range(first, last + 1)]
    saved = sum(stage.saved_bytes for stage in stages)
    a, d = chain.activation_bytes, chain.grad_bytes
    running = 0
    forward_need, backward_need = 0, 0
    for i, stage in zip(range(first, last + 1), stages, strict=True):
        running += stage.saved_bytes
        forward_need = max(forward_need, running + stage.fwd_tmp_bytes)
        # After B(L) the caller holds its output: inside the last group, B(i < L) sees it.
        held = chain.held_bytes if last == chain.length and i < last else 0
        # B(i) holds what it starts with, whatever its temporary frees by its peak.
        makes = max(0, d(i - 1) + stage.bwd_tmp_bytes)
        backward_need = max(backward_need, running + d(i) + held + makes)
    no_grad_need = a(first) + stages[0].nograd_fwd_tmp_bytes
    for i in range(first + 1, last + 1):
        no_grad_need = max(no_grad_need, a(i - 1) + a(i) + chain.stage(i).nograd_fwd_tmp_bytes)
    return Stage(
        name=f"{chain.stage(first).name}..{chain.stage(last).name}",
        fwd_s=sum(stage.fwd_s for stage in stages),
        bwd_s=sum(stage.bwd_s for stage in stages),
        out_bytes=a(last),
        saved_bytes=saved,
        fwd_tmp_bytes=max(0, forward_need - saved),
        bwd_tmp_bytes=max(0, backward_need - saved - d(last) - d(first - 1)),
        nograd_fwd_tmp_bytes=max(0, no_grad_need - a(last)),
        grad_bytes=d(last),
    )


def coarsen(chain: Chain, groups: Groups) -> Chain:
    """The chain of ``groups`` (see :func:`group_stage`), for a chain without frozen stages."""
    if chain.frozen_stages:
        raise ValueError("coarsen takes a chain without frozen stages (plan its trained part)")
    stages = tuple(group_stage(chain, first, last) for first, last in groups)
    return replace(
        chain,
        name=f"{chain.name} ({len(groups)} groups)",
        stages=stages,
        input_grad_bytes=chain.grad_bytes(0),
        metadata={},
    )


def expand(plan: Plan, chain: Chain, groups: Groups, prefetch_late: bool = False) -> Plan:
    """A plan of the group chain as a plan of ``chain`` (unscored).

    Each op of group p..q becomes the ops of its stages. An offload during the first pass
    moves each stage's saved set right after the next stage's forward, as soon as it can
    start (and in the MILP's family of plans); any other copy listed after a compute op is
    issued when that op starts, so it is listed after the first op of the op's expansion, to
    start when the group's would. A saved set's stages come back in the order the backward
    reads them. With ``prefetch_late``, prefetches go after the last op of a group's
    backward instead: later copies, but under a budget none is admitted ahead of the
    group's own backwards.
    """
    starts = [1, *(last + 1 for _, last in groups[:-1])]
    if [first for first, _ in groups] != starts or groups[-1][1] != chain.length:
        raise ValueError(f"groups {groups} do not tile stages 1..{chain.length} in order")
    ops: list[Op] = []
    first_pass_offloads: set[tuple[str, int]] = set()
    copies_at = 0  # where the copies listed after the last compute op go
    in_first_pass = True
    for op in plan.ops:
        first, last = groups[op.index - 1] if op.index >= 1 else (0, 0)
        if op.is_compute:
            copies_at = len(ops) + 1
            ops += _compute(op.kind, first, last)
            in_first_pass = in_first_pass and op.kind != BACKWARD
            if prefetch_late and op.kind == BACKWARD:
                copies_at = len(ops)
            continue
        if op.target == ACTIVATION:
            moved = [Op(op.kind, last, ACTIVATION)]
        else:
            order = range(last, first - 1, -1) if op.kind == PREFETCH else range(first, last + 1)
            moved = [Op(op.kind, i, op.target) for i in order]
        if op.kind == FREE:
            ops += moved
        elif op.kind == OFFLOAD and in_first_pass:
            first_pass_offloads.update(o.tensor for o in moved)
        else:
            ops[copies_at:copies_at] = moved
            copies_at += len(moved)
    return Plan(
        _with_offloads(ops, first_pass_offloads),
        chain.stage_names,
        plan.solver,
        chain_name=chain.name,
        info=plan.info,
    )


def _with_offloads(ops: list[Op], offloads: set[tuple[str, int]]) -> tuple[Op, ...]:
    """``ops`` with the offload of stage i's output listed right after the first pass's F(i+1)."""
    result: list[Op] = []
    in_first_pass = True
    for op in ops:
        result.append(op)
        in_first_pass = in_first_pass and op.kind != BACKWARD
        if in_first_pass and op.is_compute:
            result += [Op(OFFLOAD, i, kind) for kind, i in sorted(offloads) if i == op.index - 1]
    return tuple(result)


def _compute(kind: str, first: int, last: int) -> list[Op]:
    if kind == F_ALL:
        return [forward_all(i) for i in range(first, last + 1)]
    if kind == F_CK:
        return [forward_checkpoint(first)] + [forward_none(i) for i in range(first + 1, last + 1)]
    if kind == F_NONE:
        return [forward_none(i) for i in range(first, last + 1)]
    return [backward(i) for i in range(last, first - 1, -1)]
