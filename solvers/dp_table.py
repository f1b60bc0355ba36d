"""The tables of rotor's dynamic program: opt(m, s, t) for every sub-chain and memory, the
choice that reaches each, and the operations that a choice unrolls into.

The recurrence and its two feasibility conditions are :mod:`solvers.dp`'s design notes; the
sizes here are the chain's, rounded up to the DP's unit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from solvers.bounds import working_set
from solvers.chain import Chain
from solvers.plan import Op, backward, forward_all, forward_checkpoint, forward_none

FORWARD_ALL = 0
"""The choice of the first option, F_all(s); any other positive choice j is the split at j."""

INFEASIBLE = -1
"""The choice of a sub-problem no memory m fits."""


@dataclass(frozen=True)
class Sizes:
    """The chain's sizes in one unit (slots or bytes), 1-based like the papers; index 0 unused
    except for ``activation`` where it is the input a_0."""

    activation: np.ndarray  # x_0..x_L
    grad: np.ndarray  # g_0..g_L, the sizes of δ_0..δ_L
    saved: np.ndarray  # x̄_i
    fwd_tmp: np.ndarray  # F_all's
    nograd_fwd_tmp: np.ndarray  # F_ck's and F_none's
    bwd_tmp: np.ndarray
    held: int  # what the caller holds after B(L)
    # levels[s, j], s < j: what the no-grad forwards of s..j-1 need at their peak, x_s + ntmp_s
    # or x_{k-1} + x_k + ntmp_k for s < k < j (see split_room)
    levels: np.ndarray

    @classmethod
    def of(cls, chain: Chain, unit: float = 1.0) -> Sizes:
        def rounded(values: list[int]) -> np.ndarray:
            return np.array([math.ceil(v / unit) for v in values], dtype=np.int64)

        stages = chain.stages
        activation = rounded([chain.input_bytes] + [s.out_bytes for s in stages])
        nograd_fwd_tmp = rounded([0] + [s.nograd_fwd_tmp_bytes for s in stages])
        return cls(
            activation=activation,
            grad=rounded([chain.input_grad_bytes] + [s.grad_bytes for s in stages]),
            saved=rounded([0] + [s.saved_bytes for s in stages]),
            fwd_tmp=rounded([0] + [s.fwd_tmp_bytes for s in stages]),
            nograd_fwd_tmp=nograd_fwd_tmp,
            bwd_tmp=rounded([0] + [s.bwd_tmp_bytes for s in stages]),
            held=math.ceil(chain.held_bytes / unit),
            levels=_forward_levels(activation, nograd_fwd_tmp),
        )

    def held_after(self, t: int) -> int:
        """What the caller holds during opt(., s, t): after B(L), so when t < L."""
        return self.held if t < len(self.activation) - 1 else 0

    def single_stage_need(self, i: int) -> int:
        """The memory opt(m, i, i) needs besides a_{i-1}."""
        g, xb = self.grad, self.saved
        need = max(g[i] + xb[i] + self.fwd_tmp[i], working_set(g, xb, self.bwd_tmp, i))
        if i == 1 == len(self.activation) - 1:
            # A one-stage chain ends on B(1), which releases a_0: then δ_0 and what the caller
            # holds remain (on longer chains the sub-problems after B(L) count those bytes).
            need = max(need, g[0] + self.held - self.activation[0])
        return int(need + self.held_after(i))

    def split_room(self, s: int, j: int, t: int) -> int:
        """The memory that the no-grad forwards of s..j-1, which a split of (s, t) at j runs
        before its right part, need with δ_t resident (s < j <= t). Rotor counts those of
        s..t-1 for every split: a split before a stage whose no-grad temporary dominates was
        refused room it never uses (a review: least budgets up to 17% too high, and slower
        plans, on 1% of random chains with temporaries)."""
        return int(self.grad[t] + self.levels[s, j] + self.held_after(t))

    def forward_all_need(self, s: int, t: int) -> int:
        """The memory that the F_all(s) and B(s) of the first option need themselves."""
        g, xb = self.grad, self.saved
        # F_all(s) runs before the sub-problem's backwards, B(s) after them (so after B(L)).
        forward = g[t] + xb[s] + self.fwd_tmp[s] + self.held_after(t)
        backward = working_set(g, xb, self.bwd_tmp, s) + self.held_after(s)
        return int(max(forward, backward))


def _forward_levels(x: np.ndarray, ntmp: np.ndarray) -> np.ndarray:
    """levels[s, j] of :class:`Sizes`, each a running maximum over j (O(L^2) in all)."""
    length = len(x) - 1
    levels = np.zeros((length + 2, length + 2), dtype=np.int64)
    for s in range(1, length + 1):
        level = x[s] + ntmp[s]
        for j in range(s + 1, length + 1):
            if j > s + 1:
                level = max(level, x[j - 2] + x[j - 1] + ntmp[j - 1])
            levels[s, j] = level
    return levels


class Table:
    """opt(m, s, t) and the choice that reaches it, for m = 0..capacity."""

    def __init__(self, chain: Chain, sizes: Sizes, capacity: int):
        self.chain = chain
        self.sizes = sizes
        length = chain.length
        self.capacity = capacity
        self.time = np.full((length + 2, length + 1, capacity + 1), np.inf)
        self.choice = np.full((length + 2, length + 1, capacity + 1), INFEASIBLE, dtype=np.int32)
        forward = np.array([0.0] + [s.fwd_s for s in chain.stages])
        backward_s = np.array([0.0] + [s.bwd_s for s in chain.stages])
        self.single = single_stage_times(chain)
        # prefix[j] = f_1 + ... + f_j, so f_s + ... + f_{j-1} = prefix[j-1] - prefix[s-1].
        self.prefix = np.cumsum(forward)
        self.forward = forward
        self.backward = backward_s
        self.memory = np.arange(capacity + 1)
        for t in range(1, length + 1):
            self._fill_column(t)

    def _shifted(self, row: np.ndarray, shift: int) -> np.ndarray:
        """row[m - shift] for each m, infinite where m < shift."""
        out = np.full_like(row, np.inf)
        if shift <= self.capacity:
            out[shift:] = row[: self.capacity + 1 - shift]
        return out

    def _fill_column(self, t: int) -> None:
        """opt(., s, t) for s = t down to 1.

        The second option's right-hand term opt(m - x_{j-1}, j, t) does not depend on s, so
        as soon as opt(., j, t) is final it is offered, as split j, to every s < j at once;
        ``splits`` then holds the best split found so far for each s.
        """
        sizes, m = self.sizes, self.memory
        split_time = np.full((t + 1, len(m)), np.inf)
        split_choice = np.full((t + 1, len(m)), INFEASIBLE, dtype=np.int32)
        for s in range(t, 0, -1):
            if s == t:
                feasible = m >= sizes.single_stage_need(s)
                self.time[s, t] = np.where(feasible, self.single[t], np.inf)
                self.choice[s, t] = np.where(feasible, FORWARD_ALL, INFEASIBLE)
            else:
                # First option: F_all(s), the sub-chain s+1..t with x̄_s resident, then B(s).
                inner = self._shifted(self.time[s + 1, t], sizes.saved[s])
                best = self.forward[s] + self.backward[s] + inner
                best[m < sizes.forward_all_need(s, t)] = np.inf
                split = split_time[s]
                better = split < best
                best = np.where(better, split, best)
                choice = np.where(better, split_choice[s], FORWARD_ALL)
                infeasible = np.isinf(best)
                self.time[s, t] = np.where(infeasible, np.inf, best)
                self.choice[s, t] = np.where(infeasible, INFEASIBLE, choice)
            if s > 1:
                # Split s for every earlier start r < s: F_ck(r), F_none(r+1..s-1), then
                # opt(m - x_{s-1}, s, t), then opt(m, r, s-1).
                right = self._shifted(self.time[s, t], sizes.activation[s - 1])
                forwards = (self.prefix[s - 1] - self.prefix[: s - 1])[:, None]
                cost = forwards + right[None, :] + self.time[1:s, s - 1]
                rooms = sizes.levels[1:s, s] + sizes.grad[t] + sizes.held_after(t)
                cost[m[None, :] < rooms[:, None]] = np.inf
                # Ties go to the smaller split, which is offered later.
                improves = cost <= split_time[1:s]
                split_time[1:s] = np.where(improves, cost, split_time[1:s])
                split_choice[1:s][improves] = s

    def ops(self, s: int, t: int, m: int) -> list[Op]:
        """The operations that reach opt(m, s, t)."""
        return operations(s, t, m, lambda s, t, m: int(self.choice[s, t, m]), self.sizes)


def operations(
    s: int, t: int, m: int, choice_of: Callable[[int, int, int], int], sizes: Sizes
) -> list[Op]:
    """The operations of sub-problem (s, t) with m units, following ``choice_of(s, t, m)``."""
    result: list[Op] = []
    # An explicit stack of pending sub-problems and closing backwards keeps long chains clear
    # of Python's recursion limit.
    stack: list[tuple[int, int, int] | Op] = [(s, t, m)]
    while stack:
        item = stack.pop()
        if isinstance(item, Op):
            result.append(item)
            continue
        s, t, m = item
        choice = choice_of(s, t, m)
        if choice == INFEASIBLE:
            raise AssertionError(f"reconstructing an infeasible sub-problem ({s}, {t}, {m})")
        if s == t:
            result += [forward_all(s), backward(s)]
        elif choice == FORWARD_ALL:
            result.append(forward_all(s))
            stack += [backward(s), (s + 1, t, m - int(sizes.saved[s]))]
        else:
            j = choice
            result.append(forward_checkpoint(s))
            result += [forward_none(k) for k in range(s + 1, j)]
            stack += [(s, j - 1, m), (j, t, m - int(sizes.activation[j - 1]))]
    return result


def single_stage_times(chain: Chain) -> list[float]:
    """opt(t, t)'s time, F_all(t) then B(t), for t = 0..L.

    Every sub-problem (t, t) with t < L is solved after an F_ck or F_none of stage t (only
    the second term of a split, opt(m, r, s - 1), ends before L, and its stages were all run
    forward by then), so its F_all refills the kept graph and takes ``refill_s``
    (:func:`solvers.semantics.refills`); (L, L) follows the first forward of stage L.
    """
    length = chain.length
    return [0.0] + [
        (stage.refill_s if t < length else stage.fwd_s) + stage.bwd_s
        for t, stage in enumerate(chain.stages, start=1)
    ]
