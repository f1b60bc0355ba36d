"""Baseline plans that every solver is compared against, each scored by the same simulator.

- keep-all: plain autograd.
- chen: √L evenly spaced checkpoints, as Chen, Xu, Zhang, Guestrin, "Training deep nets with
  sublinear memory cost" (2016) and ``torch.utils.checkpoint.checkpoint_sequential`` do it.
- checkpoint-every-stage: every stage input is a checkpoint, every stage recomputed once.
- offload-all: every saved set goes to the host during the forward and comes back just before
  it is needed, in the style of Rhu et al., "vDNN: virtualized deep neural networks for
  scalable, memory-efficient neural network design" (2016).
- min-peak: the checkpoints of least peak memory, Hong et al., "GPU memory usage optimization
  for backward propagation in deep network training" (JPDC 2025).

The functions return unscored plans; :func:`solvers.registry.solve` scores them. On a chain
whose first stages are frozen, each plans the trained stages (:mod:`solvers.frozen`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection

from solvers.chain import Chain
from solvers.frozen import lift, plans_trained_part, trained_part
from solvers.min_peak import least_peak_segments
from solvers.plan import (
    SAVED,
    Op,
    Plan,
    backward,
    forward_all,
    forward_checkpoint,
    forward_none,
    offload,
    prefetch,
)
from solvers.simulator import simulate


def _plan(chain: Chain, ops: list[Op], solver: str, **info: object) -> Plan:
    return Plan(
        ops=tuple(ops),
        stage_names=chain.stage_names,
        solver=solver,
        chain_name=chain.name,
        info=dict(info),
    )


@plans_trained_part
def keep_all(chain: Chain) -> Plan:
    """Plain autograd: F_all for every stage, then every backward."""
    length = chain.length
    ops = [forward_all(i) for i in range(1, length + 1)]
    ops += [backward(i) for i in range(length, 0, -1)]
    return _plan(chain, ops, "keep-all")


def sequential_segments(length: int, count: int) -> list[tuple[int, int]]:
    """``count`` segments of stages 1..``length`` as (first, last), cut the way
    ``torch.utils.checkpoint.checkpoint_sequential(functions, count)`` cuts them:
    ``length // count`` stages each, and whatever remains to the last one."""
    if not 1 <= count <= length:
        raise ValueError(f"cannot cut {length} stages into {count} segments; pick 1..{length}")
    size = length // count
    segments = [(1 + n * size, (n + 1) * size) for n in range(count - 1)]
    segments.append((1 + (count - 1) * size, length))
    return segments


def chen_segments(length: int) -> list[tuple[int, int]]:
    """Chen et al.'s √L segments: :func:`sequential_segments` with round(√L) of them."""
    return sequential_segments(length, max(1, round(math.sqrt(length))))


def segmented_ops(segments: list[tuple[int, int]]) -> list[Op]:
    """Forward: each segment but the last runs without autograd, keeping only its input (F_ck
    on its first stage, F_none on the rest); the last segment runs with autograd. Backward:
    the last segment's backwards, then each earlier segment is recomputed with F_all from its
    checkpoint and followed by its backwards."""
    ops: list[Op] = []
    for first, last in segments[:-1]:
        ops.append(forward_checkpoint(first))
        ops += [forward_none(i) for i in range(first + 1, last + 1)]
    for first, last in reversed(segments):
        ops += [forward_all(i) for i in range(first, last + 1)]
        ops += [backward(i) for i in range(last, first - 1, -1)]
    return ops


@plans_trained_part
def checkpoint_sequential_plan(chain: Chain, segments: int) -> Plan:
    """The plan ``torch.utils.checkpoint.checkpoint_sequential(model, segments, x)`` runs.

    ``segments`` is clamped to 1..L; the plan's ``info["segments"]`` is the count used.
    """
    count = max(1, min(segments, chain.length))
    ops = segmented_ops(sequential_segments(chain.length, count))
    return _plan(chain, ops, f"checkpoint_sequential({count})", segments=count)


@plans_trained_part
def chen(chain: Chain) -> Plan:
    """Chen et al. (2016) √L checkpointing, as ``checkpoint_sequential`` runs it."""
    segments = chen_segments(chain.length)
    return _plan(chain, segmented_ops(segments), "chen", segments=[list(s) for s in segments])


@plans_trained_part
def checkpoint_every_stage(chain: Chain) -> Plan:
    """Every stage input kept as a checkpoint, every stage recomputed right before its backward.

    This is ``checkpoint_sequential`` with one segment per stage: the last stage runs with
    autograd straight away, since recomputing it at once would only cost time.
    """
    segments = [(i, i) for i in range(1, chain.length + 1)]
    return _plan(chain, segmented_ops(segments), "checkpoint-every-stage")


@plans_trained_part
def offload_all(chain: Chain) -> Plan:
    """vDNN-style offloading (Rhu et al. 2016): every saved set the backward does not need at
    once goes to the host during the forward and is prefetched one backward before use.

    The copy of x̄_i is listed after F_all(i+1), so it is issued the moment F_all(i) ends and
    runs beside F_all(i+1), which still reads a_i from x̄_i. B(i+1) reads a_i from x̄_i, so
    x̄_i must be back before B(i+1): its prefetch is issued when B(i+2) starts. x̄_L and
    x̄_{L-1} are what B(L) reads first, so they stay on the GPU; with L <= 2 the plan is
    keep-all.

    Raises ``ValueError`` on a chain without a link.
    """
    if chain.link is None:
        raise ValueError(
            f"chain {chain.name!r} has no link, so nothing can be offloaded: give one "
            "(--bandwidth 25GB/s, or bandwidth= in the API; or a 'link' with d2h_bytes_per_s "
            "and h2d_bytes_per_s in the chain), or pick a recompute solver"
        )
    return _plan(chain, offload_ops(chain.length, range(1, chain.length - 1)), "offload-all")


def offload_ops(length: int, offloaded: Collection[int]) -> list[Op]:
    """:func:`offload_all`'s schedule for the saved sets ``offloaded`` (each below L - 1),
    the others kept."""
    ops: list[Op] = [forward_all(1)]
    for i in range(2, length + 1):
        ops.append(forward_all(i))
        if i - 1 in offloaded:
            ops.append(offload(SAVED, i - 1))
    for i in range(length, 0, -1):
        ops.append(backward(i))
        if i - 2 in offloaded:
            ops.append(prefetch(SAVED, i - 2))
    return ops


def min_peak(chain: Chain) -> Plan:
    """Hong et al.'s (2025) checkpoints of least peak memory (:mod:`solvers.min_peak`)."""
    p = chain.frozen_stages
    if p:  # the trained part's segments, after the frozen forwards
        plan = lift(min_peak(trained_part(chain)), chain)
        segments = [[first + p, last + p] for first, last in plan.info["segments"]]
        peak = simulate(plan, chain).peak_bytes
        info = {"segments": segments, "least_peak_bytes": peak}
        return dataclasses.replace(plan, info={**plan.info, **info})
    peak, segments = least_peak_segments(chain)
    info = {"segments": [list(s) for s in segments], "least_peak_bytes": peak}
    return _plan(chain, segmented_ops(segments), "min-peak", **info)


BASELINES = {
    "keep-all": keep_all,
    "chen": chen,
    "checkpoint-every-stage": checkpoint_every_stage,
    "offload-all": offload_all,
    "min-peak": min_peak,
}
