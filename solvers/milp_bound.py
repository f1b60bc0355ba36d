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
HiGHS closes in milliseconds. Its optimum (or, if cut short, its proven dual bound) is a lower
bound on every plan's time, never below ``lower_bound_s``.
"""

from __future__ import annotations

import math

import pulp

from solvers.bounds import (
    absent_saved_bytes,
    backward_room,
    lower_bound_s,
    trained_part_budget,
)
from solvers.chain import Chain
from solvers.frozen import trained_part
from solvers.milp_model import time_unit
from solvers.milp_search import native_stdout_silenced


def whole_tensor_bound_s(
    chain: Chain, budget_bytes: int, offload: bool = True, time_limit_s: float = 5.0
) -> float:
    """The least step time any plan within ``budget_bytes`` can reach, with whole tensors
    (recomputing only, with ``offload`` False)."""
    fractional = lower_bound_s(chain, budget_bytes)
    if not math.isfinite(fractional):
        return fractional
    if chain.frozen_stages:
        # As in lower_bound_s: the frozen forwards, then the trained part's stages.
        frozen_s = sum(s.fwd_s for s in chain.stages[: chain.frozen_stages])
        budget = trained_part_budget(chain, budget_bytes)
        part = whole_tensor_bound_s(trained_part(chain), budget, offload, time_limit_s)
        return max(fractional, frozen_s + part)
    excess = absent_saved_bytes(chain, budget_bytes)
    if not excess:
        return fractional
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
    problem += rest >= backward + pulp.lpSum(
        r * s.refill_s / scale for r, (_, s) in zip(recompute, earlier, strict=True)
    )
    if chain.link is None or not offload:
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
            problem += first_pass >= first_forwards + later / d2h
            problem += rest >= later / h2d + last_backwards
    for r, o in zip(recompute, moved, strict=True):
        problem += r + o <= 1
    unit = max(s.saved_bytes for _, s in earlier) or 1
    copying = chain.link is not None and offload
    for k in range(2, chain.length + 1):
        room = backward_room(chain, budget_bytes, k)
        if room < 0:
            return math.inf  # B(k)'s own working set does not fit: no plan does
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
        problem += kept <= room / unit
    with native_stdout_silenced():  # HiGHS prints its banner from C
        problem.solve(pulp.HiGHS(msg=False, timeLimit=time_limit_s))
    info = problem.solverModel.getInfo()
    proven = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else -math.inf
    return max(fractional, proven * scale * (1 - 1e-9))
