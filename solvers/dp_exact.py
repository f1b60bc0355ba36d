"""Rotor's persistent dynamic program in exact bytes, over the sub-problems a plan reaches.

Herrmann, Beaumont, Eyraud-Dubois, Hermenier, Pacheco (2019) round sizes up to slots so that
opt(m, s, t) fits in a table; the rounding hides plans that fit in exact bytes, down to rotor's
exact least memory, where the rounded table may have none. This module evaluates the same
recurrence as :class:`solvers.dp_table.Table` (the same feasibility conditions and the same
tie-breaking) top-down with memoisation on (s, t, m), m in bytes, and so visits only the m
that some plan reaches from the budget.

Design note, which states: below need(s, t), the least memory of the sub-problem
(:func:`solvers.dp._least_memory`), nothing fits, so such states are never visited. At or
above keep(s, t), the memory at which F_all on every stage of s..t fits, the optimum is that
plan's time, the least any plan of s..t takes (a split re-runs forwards), and the table picks
it too (F_all wins ties), so m is clamped to keep(s, t). Chains of repeated blocks reach few
distinct m; chains of many distinct sizes may reach very many, so the search stops at a
number of states and answers None.
"""

from __future__ import annotations

import numpy as np

from solvers.chain import Chain
from solvers.dp_table import FORWARD_ALL, INFEASIBLE, Sizes, operations, single_stage_times
from solvers.plan import Op

State = tuple[int, int, int]
Option = tuple[int, float, State, State | None]


class ExactTable:
    """opt(m, s, t) in exact bytes, for the states that :meth:`solve` reaches; ``sizes`` in
    bytes and ``need`` their least memory (:func:`solvers.dp._least_memory`)."""

    def __init__(self, chain: Chain, sizes: Sizes, need: np.ndarray):
        self.sizes = sizes
        length = chain.length
        self.need = need.tolist()
        self.saved = sizes.saved.tolist()
        self.activation = sizes.activation.tolist()
        self.own = [[0] * (length + 1) for _ in range(length + 2)]  # forward_all_need(s, t)
        self.levels = sizes.levels.tolist()  # Sizes.split_room's, as lists for speed
        self.keep = [[0] * (length + 1) for _ in range(length + 2)]
        for s in range(1, length + 1):
            self.keep[s][s] = self.need[s][s]
        for t in range(1, length + 1):
            for s in range(t - 1, 0, -1):
                self.own[s][t] = sizes.forward_all_need(s, t)
                self.keep[s][t] = max(self.own[s][t], self.saved[s] + self.keep[s + 1][t])
        self.fb = [0.0] + [stage.fwd_s + stage.bwd_s for stage in chain.stages]
        # The same floating-point sums as the table, so that equal times tie alike.
        self.prefix = np.cumsum([0.0] + [stage.fwd_s for stage in chain.stages]).tolist()
        self.single = single_stage_times(chain)
        self.best: dict[State, tuple[float, int]] = {}

    def split_floor(self, t: int) -> int:
        """What every split of a sub-problem ending at t holds beside its forwards: δ_t and
        the held bytes (:meth:`Sizes.split_room` is this plus ``levels``)."""
        return int(self.sizes.grad[t]) + self.sizes.held_after(t)

    def state(self, s: int, t: int, m: int) -> State:
        """The state that answers opt(m, s, t): m clamped to keep(s, t)."""
        keep = self.keep[s][t]
        return (s, t, m if m < keep else keep)

    def _options(self, s: int, t: int, m: int) -> list[Option]:
        """The feasible options of (s, t, m), s < t and m >= need(s, t): the choice, the time
        of its own forwards (and backward), and the sub-problems it adds to that."""
        need, state = self.need, self.state
        found: list[Option] = []
        if m >= self.own[s][t] and m - self.saved[s] >= need[s + 1][t]:
            found.append((FORWARD_ALL, self.fb[s], state(s + 1, t, m - self.saved[s]), None))
        start, above = self.prefix[s - 1], self.split_floor(t)
        for j in range(s + 1, t + 1):
            if m >= above + self.levels[s][j]:
                right = m - self.activation[j - 1]
                if right >= need[j][t] and m >= need[s][j - 1]:
                    forwards = self.prefix[j - 1] - start
                    found.append((j, forwards, state(j, t, right), state(s, j - 1, m)))
        return found

    def _evaluate(self, options: list[Option]) -> tuple[float, int]:
        """The best of ``options`` and its choice, every sub-problem being known."""
        best, choice = np.inf, INFEASIBLE
        for j, own, right, left in options:
            # The table's sums in its order; F_all (listed first), then the smaller split, win
            # ties, as in the table.
            cost = own + self.best[right][0]
            if left is not None:
                cost += self.best[left][0]
            if cost < best:
                best, choice = cost, j
        return best, choice

    def solve(self, s: int, t: int, m: int, limit: int) -> float | None:
        """opt(m, s, t) (inf where nothing fits), or None once more than ``limit`` states are
        known."""
        if m < self.need[s][t]:
            return np.inf
        root = self.state(s, t, m)
        best = self.best
        pending: dict[State, list[Option]] = {}
        # An explicit stack keeps long chains clear of Python's recursion limit.
        stack = [root]
        while stack:
            key = stack[-1]
            if key in best:
                stack.pop()
                continue
            s, t, m = key
            if s == t:
                best[key] = (self.single[t], FORWARD_ALL)
                stack.pop()
                continue
            options = pending.pop(key, None)
            if options is None:
                options = self._options(s, t, m)
                missing = [k for o in options for k in o[2:] if k is not None and k not in best]
                if missing:
                    pending[key] = options
                    stack += missing
                    continue
            stack.pop()
            best[key] = self._evaluate(options)
            if len(best) > limit:
                return None
        return best[root][0]

    def ops(self, s: int, t: int, m: int) -> list[Op]:
        """The operations that reach opt(m, s, t), once :meth:`solve` has answered it."""
        return operations(s, t, m, lambda s, t, m: self.best[self.state(s, t, m)][1], self.sizes)
