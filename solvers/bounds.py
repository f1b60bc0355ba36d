"""Bounds every plan obeys: the memory a backward needs, the least budget, the least time.

One place for them, read by the DP, the MILP and the registry. The reasoning follows the model
of ``docs/plan-format.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from solvers.chain import Chain
from solvers.frozen import least_budget, trained_part

MEETS_BOUND = "optimal (meets the lower bound)"
"""A solver's status for a plan whose time meets a bound that holds for every plan the solver
was asked for (every plan; every plan that only recomputes, with offloading off)."""


def working_set(grad: Sequence[float], saved: Sequence[float], tmp: Sequence[float], k: int):
    """The bytes (or units) B(k) itself holds: δ_k and x̄_k in, δ_{k-1} and its temporary out.

    Its input a_{k-1}, a_0 and whatever else the plan keeps come on top. A temporary can be
    negative (the backward frees part of x̄_k by its peak), but not before B(k) starts: δ_k
    and x̄_k are there then, whatever else comes on top (after B(L), the caller's bytes).
    """
    return grad[k] + saved[k] + max(0, grad[k - 1] + tmp[k])


def backward_working_set(chain: Chain, k: int) -> int:
    """:func:`working_set` of B(k) on ``chain``, in bytes."""
    stage = chain.stage(k)
    grads = [chain.grad_bytes(k - 1), chain.grad_bytes(k)]
    saved = [0, stage.saved_bytes]
    return working_set(grads, saved, [0, stage.bwd_tmp_bytes], 1)


def necessary_budget_bytes(chain: Chain) -> int:
    """Bytes that every plan of the family needs: the largest bare working set of a B(k).

    B(k) holds a_0, δ_k, x̄_k, a_{k-1} and allocates δ_{k-1} and its temporary, whatever else
    the plan does; the first pass's F(q) holds a_0, δ_L, a_{q-1} and its output and temporary.
    """
    if chain.frozen_stages:
        return least_budget(chain, necessary_budget_bytes)
    length = chain.length
    x = [chain.activation_bytes(j) for j in range(length + 1)]
    g = [chain.grad_bytes(j) for j in range(length + 1)]
    need = 0
    for k in range(1, length + 1):
        stage = chain.stage(k)
        a_previous = x[k - 1] if k >= 2 else 0
        held = chain.held_bytes if k < length else 0
        need = max(need, x[0] + held + a_previous + backward_working_set(chain, k))
        output = stage.saved_bytes if k == length else x[k]
        # Whichever forward the plan runs first: F_all for the last stage, else the cheaper.
        temporary = stage.fwd_tmp_bytes
        if k < length:
            temporary = min(temporary, stage.nograd_fwd_tmp_bytes)
        need = max(need, x[0] + g[length] + a_previous + output + temporary)
    # After B(1), which releases a_0, the step still holds δ_0 and what the caller keeps.
    return max(need, g[0] + chain.held_bytes)


def backward_room(chain: Chain, budget_bytes: int, k: int) -> int:
    """The bytes left for the saved sets x̄_i (i < k) when B(k) starts (no frozen stages).

    Besides its working set, the GPU holds a_0 (the caller's input, resident all step) and,
    once B(L) has run, the caller's ``held_bytes``.
    """
    held = chain.held_bytes if k < chain.length else 0
    return budget_bytes - chain.activation_bytes(0) - held - backward_working_set(chain, k)


def absent_saved_bytes(chain: Chain, budget_bytes: int) -> int | None:
    """E, the bytes of saved sets x̄_i (i < L, no frozen stages) that cannot be on the GPU when
    B(L) runs (see :func:`lower_bound_s`); None when B(L)'s own working set does not fit."""
    room = backward_room(chain, budget_bytes, chain.length)
    if room < 0:
        return None
    return max(0, sum(s.saved_bytes for s in chain.stages[:-1]) - room)


def trained_part_budget(chain: Chain, budget_bytes: int) -> int:
    """The budget at which a bound of :func:`solvers.frozen.trained_part` holds for ``chain``.

    A plan of the whole chain holds a_0 all step, and may drop a_p, which the trained part
    takes as its input and counts as resident all along: so a_0 is taken and a_p given back.
    """
    p = chain.frozen_stages
    return budget_bytes - chain.activation_bytes(0) + chain.activation_bytes(p)


def lower_bound_s(chain: Chain, budget_bytes: int | None) -> float:
    """A time no plan within ``budget_bytes`` can beat: max(Σf + Σb, what the budget forces).

    Reasoning, on the model of design.md. Every forward runs at least once before the first
    backward B(L) starts, and every backward once after, so the compute stream spends at least
    Σf before that instant and Σb after it. When B(L) runs, the GPU holds a_0, δ_L, x̄_L, the
    δ_{L-1} that B(L) allocates and its temporary, plus every saved set x̄_i (i < L) that is
    kept; so at most C = budget - (x_0 + g_L + x̄_L + g_{L-1} + btmp_L) bytes of them are kept,
    and E = Σ_{i<L} x̄_i - C bytes of saved sets are absent. Each absent x̄_i is either
    recomputed by an extra F_all(i) after B(L) starts (≥ r_i more compute, r_i the refill
    time of solvers.semantics.refills, at most f_i), or offloaded
    before B(L) starts (the d2h channel moves its bytes before then) and prefetched after (the
    h2d channel moves them after). Relaxing the choice to bytes, with recomputation costed by
    the fractional knapsack over r_i / x̄_i, the step takes at least

        min over E_O in [0, E] of max(Σf, E_O / d2h) + max(Σb + R(E - E_O), E_O / h2d),

    where R(e) is the least recompute time that covers e bytes. The function is convex and
    piecewise linear, so the minimum is at an end, a kink, or a crossing; all are evaluated.
    Without a link E_O is 0. Returns ``math.inf`` when even C < 0 (no plan fits) and Σf + Σb
    without a budget.
    """
    compute = chain.compute_time_s
    if budget_bytes is None:
        return compute
    if chain.frozen_stages:
        # The frozen forwards run at least once, then the trained part's stages.
        frozen_s = sum(s.fwd_s for s in chain.stages[: chain.frozen_stages])
        budget = trained_part_budget(chain, budget_bytes)
        return frozen_s + lower_bound_s(trained_part(chain), budget)
    excess = absent_saved_bytes(chain, budget_bytes)
    if excess is None:
        return math.inf
    if excess == 0:
        return compute
    earlier = chain.stages[:-1]
    forward = sum(s.fwd_s for s in chain.stages)
    backward = sum(s.bwd_s for s in chain.stages)
    # Recompute cost curve R(e): cheapest seconds per byte first. x̄_i takes at least a
    # refill to recompute (solvers.semantics.refills), which is at most a forward.
    pieces = sorted(
        ((s.refill_s / s.saved_bytes, s.saved_bytes) for s in earlier if s.saved_bytes > 0),
        key=lambda piece: piece[0],
    )
    kinks = [0.0]
    for _, size in pieces:
        kinks.append(kinks[-1] + size)

    def recompute(covered: float) -> float:
        total, left = 0.0, covered
        for rate, size in pieces:
            part = min(size, left)
            total += rate * part
            left -= part
            if left <= 0:
                break
        return total

    if chain.link is None:
        return forward + backward + recompute(excess)
    d2h, h2d = chain.link.d2h_bytes_per_s, chain.link.h2d_bytes_per_s

    def step_time(moved: float) -> float:
        return max(forward, moved / d2h) + max(backward + recompute(excess - moved), moved / h2d)

    candidates = {0.0, float(excess), forward * d2h}
    candidates.update(excess - k for k in kinks)
    # Crossing of the backward terms within each linear piece of R, moved = excess - covered.
    covered_start = 0.0
    for rate, size in pieces:
        # backward + R(covered_start) + rate * (c - covered_start) = (excess - c) / h2d
        c = (excess / h2d - backward - recompute(covered_start) + rate * covered_start) / (
            rate + 1 / h2d
        )
        if covered_start <= c <= covered_start + size:
            candidates.add(excess - c)
        covered_start += size
    return min(step_time(m) for m in candidates if 0 <= m <= excess)
