"""A tighter lower bound on the step time: :func:`solvers.bounds.lower_bound_s`'s argument with
whole tensors.

``lower_bound_s`` relaxes the choice of which saved sets are absent when B(L) starts to bytes
(a fractional knapsack). A saved set is absent whole, though: each x̄_i (i < L) is kept, or
recomputed after B(L) starts (at least its refill time f'_i <= f_i more compute, see
:func:`solvers.semantics.refills`), or offloaded before and prefetched after (its bytes on
each channel). With binaries r_i and o_i (r_i + o_i <= 1) covering the absent
bytes E,

    minimise  max(Σf, Σ o_i x̄_i / d2h) + max(Σb + Σ r_i f'_i, Σ o_i x̄_i / h2d),

and, since the copy of x̄_i leaves only once F(i) has run and must be back before B(i) starts,
for every k the first pass lasts at least f_1 + ... + f_k + Σ_{i >= k} o_i x̄_i / d2h and the
rest at least Σ_{i >= k} o_i x̄_i / h2d + b_k + ... + b_1.

Memory is checked when every backward starts, not only B(L). When B(k) starts, beside its
own working set W_k (δ_k, x̄_k, δ_{k-1} and its temporary), the input a_0 and, after B(L), the
caller's held bytes (:func:`solvers.bounds.backward_room`), each x̄_i (i < k) is there unless it
was recomputed after B(L) started (r_i), copied out before B(L) started (o_i), or copied out by
the time B(k) starts (a fraction l_ik, continuous: a relaxation): a copy still under way when
B(L) starts frees its bytes later, and neither recomputation nor o_i pays for that. B(k) reads
a_{k-1}, which x̄_{k-1} contains: when x̄_{k-1} is absent, a_{k-1} is there alone. So for
every k, Σ_{i < k} (1 - r_i - o_i - l_ik) x̄_i + (r_{k-1} + o_{k-1} + l_{k-1,k}) a_{k-1} <=
budget - x_0 - held - W_k, and the copies that leave by B(k) fit on the channel between F(1)'s
end and B(k)'s start, which is at most the step's time less f_1 and b_k + ... + b_1. Early
stages whose saved sets are large (a ResNet's) must be absent when their neighbours' backwards
run, even where B(L)'s constraint alone would leave them. A MILP of 2(L - 1) binaries that
HiGHS closes in milliseconds.

A recomputation reads its stage's input. The refill of an absent x̄_{j+1}, and any forward of
stage j+1 run after B(L) starts, read a_j, which is there only if x̄_j is not absent, or a_j
is resident when B(L) starts, alone or inside an x̄_j recomputed later (its bytes then, at
most x̄_j's: c_j), or is on the host (its bytes on both channels, as an offloaded set's:
h_j), or a forward of stage j runs after B(L) starts, itself reading a_{j-1}: a forward of
its own (f_j more: y_j; also an early refill freed and made again), or x̄_j's refill run
early (f_j - f'_j more), after which x̄_j is whole until B(j), so when B(j+1) starts (e_j),
unless copied out and back after B(L) starts (g_j). A second model adds these 5(L - 2)
binaries (3(L - 2) without copying); a long chain's can be cut short by the time limit
where the first closes, so the bound is the larger of the two and of ``lower_bound_s``. Each
optimum (or, if cut short, its proven dual bound) is a lower bound on every plan's time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pulp

from solvers.bounds import (
    absent_saved_bytes,
    backward_room,
    lower_bound_s,
    trained_part_budget,
)
from solvers.chain import Chain
from solvers.frozen import trained_part
from solvers.milp_bound_intervals import interval_bound_s
from solvers.milp_model import time_unit
from solvers.milp_search import HIGHS_OPTIONS, native_stdout_silenced

INTERVALS_UP_TO = 40
"""The longest chain the interval model is built for: its binaries grow as L², and past about
35 stages HiGHS proves less with it in 30 s than the two models here do."""


def whole_tensor_bound_s(
    chain: Chain,
    budget_bytes: int,
    offload: bool = True,
    time_limit_s: float = 5.0,
    intervals: bool = False,
) -> float:
    """The least step time any plan within ``budget_bytes`` can reach, with whole tensors
    (recomputing only, with ``offload`` False). With ``intervals``, also the bound of
    :mod:`solvers.milp_bound_intervals` on chains of up to INTERVALS_UP_TO stages, in the time
    the two models here leave: it asks where each recomputation's input comes from at every
    backward, and takes seconds where these take milliseconds."""
    fractional = lower_bound_s(chain, budget_bytes)
    if not math.isfinite(fractional):
        return fractional
    if chain.frozen_stages:
        # As in lower_bound_s: the frozen forwards, then the trained part's stages.
        frozen_s = sum(s.fwd_s for s in chain.stages[: chain.frozen_stages])
        budget = trained_part_budget(chain, budget_bytes)
        part = whole_tensor_bound_s(trained_part(chain), budget, offload, time_limit_s, intervals)
        return max(fractional, frozen_s + part)
    if not absent_saved_bytes(chain, budget_bytes):
        return fractional
    if any(backward_room(chain, budget_bytes, k) < 0 for k in range(2, chain.length + 1)):
        return math.inf  # a backward's own working set does not fit: no plan does
    # The model without the inputs of recomputations first: it closes fast, and the larger
    # one, cut short on a long chain, may prove less in the time left.
    deadline = time.monotonic() + time_limit_s
    best = fractional
    for anchored in (False, True):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        best = max(best, _proven_s(chain, budget_bytes, offload, anchored, left))
    # The interval model without copies in flight first: it closes in seconds where the
    # full one, which proves more, may take minutes (ResNet-50 at 35% of keep-all).
    for in_flight in (False, True):
        left = deadline - time.monotonic()
        if intervals and chain.length <= INTERVALS_UP_TO and left > 0:
            best = max(best, interval_bound_s(chain, budget_bytes, offload, left, in_flight))
    return best


@dataclass(frozen=True)
class _Anchors:
    """Where a_j comes from, for j = 1 .. L-2, when something needs it after B(L) starts
    (the module's notes): held alone, on the host, made by a forward of its own, or by x̄_j's
    refill run early and then kept or copied out and back."""

    stages: list[int]
    alone: list[pulp.LpVariable]
    away: list[pulp.LpVariable | int]  # 0 without copying
    own: list[pulp.LpVariable]
    early: list[pulp.LpVariable]
    early_out: list[pulp.LpVariable | int]

    @classmethod
    def add(cls, problem: pulp.LpProblem, chain: Chain, recompute: list, copying: bool) -> _Anchors:
        stages = list(range(1, chain.length - 1))

        def binaries(name: str, present: bool = True) -> list:
            return [
                problem.add_variable(f"{name}{j}", cat=pulp.LpBinary) if present else 0
                for j in stages
            ]

        anchors = cls(
            stages,
            binaries("c"),
            binaries("h", copying),
            binaries("y"),
            binaries("e"),
            binaries("g", copying),
        )
        sources = {
            j: 1 - recompute[j - 1] + anchors.alone[j - 1] + anchors.away[j - 1] + anchors.made(j)
            for j in stages
        }
        for j in stages:
            problem += anchors.early[j - 1] + anchors.early_out[j - 1] <= recompute[j - 1]
            problem += recompute[j] <= sources[j]  # x̄_{j+1}'s refill reads a_j
            if j > 1:
                problem += anchors.made(j) <= sources[j - 1]  # F(j) reads a_{j-1}
        return anchors

    def made(self, j: int) -> pulp.LpAffineExpression:
        """Whether a forward of stage j runs after B(L) starts."""
        return self.own[j - 1] + self.early[j - 1] + self.early_out[j - 1]

    def forward_s(self, chain: Chain) -> pulp.LpAffineExpression:
        """The compute these forwards add to the refills: f_j, or f_j - f'_j for a refill."""
        return pulp.lpSum(
            own * chain.stage(j).fwd_s
            + (early + out) * (chain.stage(j).fwd_s - chain.stage(j).refill_s)
            for j, own, early, out in zip(
                self.stages, self.own, self.early, self.early_out, strict=True
            )
        )


def _proven_s(
    chain: Chain, budget_bytes: int, offload: bool, anchored: bool, time_limit_s: float
) -> float:
    """The model's optimum or, cut short, its proven dual bound, in seconds."""
    earlier = list(enumerate(chain.stages[:-1]))
    scale = time_unit(chain, offload)
    problem = pulp.LpProblem("whole_tensor_bound", pulp.LpMinimize)
    recompute = [problem.add_variable(f"r{i}", cat=pulp.LpBinary) for i, _ in earlier]
    moved = [problem.add_variable(f"o{i}", cat=pulp.LpBinary) for i, _ in earlier]
    first_pass = problem.add_variable("first_pass")
    rest = problem.add_variable("rest")
    problem += first_pass + rest
    forward = sum(s.fwd_s for s in chain.stages) / scale
    backward = sum(s.bwd_s for s in chain.stages) / scale
    problem += first_pass >= forward
    copying = chain.link is not None and offload
    anchors = _Anchors.add(problem, chain, recompute, copying) if anchored else None
    refills = pulp.lpSum(
        r * s.refill_s / scale for r, (_, s) in zip(recompute, earlier, strict=True)
    )
    if anchors is not None:
        refills += anchors.forward_s(chain) / scale
    problem += rest >= backward + refills
    if not copying:
        problem += pulp.lpSum(moved) == 0
    else:
        d2h = chain.link.d2h_bytes_per_s * scale
        h2d = chain.link.h2d_bytes_per_s * scale
        first_forwards = 0.0  # f_1 + ... + f_k
        for k in range(1, len(earlier) + 1):
            # The copies of x̄_i, i >= k: out after F(k) ends, back before B(k) starts.
            later = pulp.lpSum(
                o * s.saved_bytes
                for o, (_, s) in zip(moved[k - 1 :], earlier[k - 1 :], strict=True)
            )
            first_forwards += chain.stage(k).fwd_s / scale
            last_backwards = sum(chain.stage(j).bwd_s for j in range(1, k + 1)) / scale
            if anchors is not None:
                # a_j on the host left after F(j) and is back before x̄_{j+1}'s refill; x̄_j
                # refilled early and copied out leaves and comes back after B(L) starts.
                later += pulp.lpSum(
                    h * chain.stage(j).out_bytes
                    for j, h in zip(anchors.stages, anchors.away, strict=True)
                    if j >= k
                )
                back_early = pulp.lpSum(
                    g * chain.stage(j).saved_bytes
                    for j, g in zip(anchors.stages, anchors.early_out, strict=True)
                    if j >= k
                )
                problem += rest >= (later + back_early) / h2d + last_backwards
                problem += rest >= back_early / d2h + last_backwards
            problem += first_pass >= first_forwards + later / d2h
            problem += rest >= later / h2d + last_backwards
    for r, o in zip(recompute, moved, strict=True):
        problem += r + o <= 1
    unit = max(s.saved_bytes for _, s in earlier) or 1
    for k in range(2, chain.length + 1):
        room = backward_room(chain, budget_bytes, k)
        below = list(zip(recompute, moved, earlier[: k - 1], strict=False))
        late = [0.0] * len(below)
        if copying and k < chain.length:
            late = [problem.add_variable(f"l{i}_{k}", 0, 1) for _, _, (i, _) in below]
            for (r, o, _), gone in zip(below, late, strict=True):
                problem += r + o + gone <= 1
            out = pulp.lpSum(
                (o + gone) * s.saved_bytes for (_, o, (_, s)), gone in zip(below, late, strict=True)
            )
            until_b_k = sum(chain.stage(j).bwd_s for j in range(1, k + 1)) + chain.stage(1).fwd_s
            problem += out / d2h <= first_pass + rest - until_b_k / scale
        # x̄_1 .. x̄_{k-1}: those not absent are on the GPU when B(k) starts, and B(k)'s input
        # a_{k-1} (inside x̄_{k-1}) is, alone, when x̄_{k-1} is absent.
        kept = pulp.lpSum(
            (1 - r - o - gone) * (s.saved_bytes / unit)
            for (r, o, (_, s)), gone in zip(below, late, strict=True)
        )
        r, o, (_, previous) = below[-1]
        gone = late[-1]
        kept += (r + o + gone) * (previous.out_bytes / unit)
        if anchors is not None and k < chain.length:  # x̄_{k-1} refilled early is whole
            kept += anchors.early[k - 2] * (previous.saved_bytes - previous.out_bytes) / unit
        if anchors is not None and k == chain.length:  # a_j held alone when B(L) starts
            kept += pulp.lpSum(
                c * (chain.stage(j).out_bytes / unit)
                for j, c in zip(anchors.stages, anchors.alone, strict=True)
            )
        problem += kept <= room / unit
    with native_stdout_silenced():  # HiGHS prints its banner from C
        problem.solve(pulp.HiGHS(msg=False, timeLimit=time_limit_s, gapRel=0, **HIGHS_OPTIONS))
    info = problem.solverModel.getInfo()
    proven = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else -math.inf
    return proven * scale * (1 - 1e-9)
