"""A joint warm start: rotor's DP (Herrmann, Beaumont et al. 2019) whose first pass may send a
checkpoint to the host, with POFO's copy channels (Beaumont, Eyraud-Dubois, Shilova 2021).

Rotor's first pass holds the input a_{s-1} of a split's left part while the right part runs.
Here, along the first pass, the split at one chosen stage s may instead offload a_{s-1} once
F(s) has read it and prefetch it ``lead`` backwards before the right part ends: the right part
runs with x_{s-1} more bytes, less a ``reserve`` for the copies in flight. The recurrence, in
exact bytes and with rotor's own sub-problems (:class:`solvers.dp_exact.ExactTable`) for
everything off the first pass, is

    T(m, s) = min(opt(m, s, L),
                  f_s + T(m - x̄_s, s+1) + b_s                          (F_all(s)),
                  Σ f_s..f_{j-1} + T(m - x_{j-1}, j) + opt(m, s, j-1)      (rotor's split),
                  the same with T(m + x_{s-1} - reserve - x_{j-1}, j)       (a_{s-1} on the host)).

T ignores the copies' time, so it would always host the checkpoint that frees the most bytes,
however long its copies take: each stage s is tried in turn, from the input on, with every
(reserve, lead), each plan simulated (the simulator judges time and peak), and the fastest
that fits is kept. The plans are persistent, with one offload in the first pass and one
prefetch: in the MILP's family, whose search starts from them.
"""

from __future__ import annotations

import time

import numpy as np

from solvers.chain import Chain
from solvers.dp import _least_memory
from solvers.dp_exact import ExactTable
from solvers.plan import (
    ACTIVATION,
    BACKWARD,
    Op,
    Plan,
    backward,
    forward_all,
    forward_checkpoint,
    forward_none,
    offload,
    prefetch,
)
from solvers.simulator import score

RESERVES = (0.0, 0.25, 0.5)
"""The bytes held back from the right part for the copies in flight, in units of x_{s-1}."""
LEADS = (4, 6, 3, 2)
"""How many backwards before the right part's last one a hosted checkpoint is prefetched."""
STATES = 200_000
"""The most sub-problems rotor's exact table may hold."""

Choice = tuple[str, int]  # ("plain" | "all" | "split" | "host", j)


class _HostSplit:
    """T(m, s) for one hosted stage and one reserve, memoised, over rotor's exact table."""

    def __init__(
        self, chain: Chain, table: ExactTable, reserve: float, stage: int, deadline: float
    ):
        self.chain = chain
        self.table = table
        self.reserve = reserve
        self.stage = stage  # the stage whose input may go to the host
        self.deadline = deadline
        self.best: dict[tuple[int, int, bool, int], tuple[float, Choice]] = {}

    def opt(self, s: int, t: int, m: int) -> float:
        value = self.table.solve(s, t, m, STATES)
        if value is None or time.monotonic() > self.deadline:
            raise TimeoutError("out of time, or rotor's exact table grew too large")
        return float(value)

    def solve(self, m: int, s: int, alone: bool, hosts: int) -> float:
        """T(m, s) with at most ``hosts`` (0 or 1) checkpoints still to send to the host:
        ``alone`` says a_{s-1} is a tensor of its own (not inside x̄_{s-1})."""
        key = (m, s, alone, hosts)
        if key in self.best:
            return self.best[key][0]
        table, length = self.table, self.chain.length
        options: list[tuple[float, Choice]] = [(self.opt(s, length, m), ("plain", 0))]
        if s < length and m >= table.need[s][length]:
            if m >= table.own[s][length] and m - table.saved[s] >= table.need[s + 1][length]:
                rest = self.solve(m - table.saved[s], s + 1, False, hosts)
                options.append((table.fb[s] + rest, ("all", 0)))
            if m >= table.room[s][length]:
                hosted = int(self.chain.activation_bytes(s - 1) * (1 - self.reserve))
                for j in range(s + 1, length + 1):
                    if m < table.need[s][j - 1]:
                        continue
                    own = table.prefix[j - 1] - table.prefix[s - 1] + self.opt(s, j - 1, m)
                    right = m - table.activation[j - 1]
                    for kind, room in (("split", right), ("host", right + hosted)):
                        if kind == "host" and not (alone and s == self.stage and hosts > 0):
                            continue
                        if room >= table.need[j][length]:
                            left = hosts - (kind == "host")
                            options.append((own + self.solve(room, j, True, left), (kind, j)))
        best = min(options, key=lambda option: option[0])
        self.best[key] = best
        return best[0]

    def ops(self, m: int, s: int, alone: bool, hosts: int, lead: int) -> list[Op]:
        """The operations that reach T(m, s), each hosted checkpoint prefetched ``lead``
        backwards before its right part's last."""
        kind, j = self.best[m, s, alone, hosts][1]
        table, length = self.table, self.chain.length
        if kind == "plain":
            return table.ops(s, length, m)
        if kind == "all":
            rest = self.ops(m - table.saved[s], s + 1, False, hosts, lead)
            return [forward_all(s), *rest, backward(s)]
        right_room = m - table.activation[j - 1]
        if kind == "host":
            right_room += int(self.chain.activation_bytes(s - 1) * (1 - self.reserve))
        right = self.ops(right_room, j, True, hosts - (kind == "host"), lead)
        first = [forward_checkpoint(s)]
        if kind == "host":
            first.append(offload(ACTIVATION, s - 1))
            after = min(j + lead, length)
            at = next(n for n, op in enumerate(right) if op.kind == BACKWARD and op.index == after)
            right.insert(at + 1, prefetch(ACTIVATION, s - 1))
        first += [forward_none(i) for i in range(s + 1, j)]
        return first + right + table.ops(s, j - 1, m)


def host_split_plan(chain: Chain, budget_bytes: int, deadline: float) -> tuple[str, Plan] | None:
    """The fastest plan of the module's recurrence that fits ``budget_bytes``, over the
    reserves and leads tried before ``deadline`` (``time.monotonic()``); None if none that
    hosts a checkpoint fits, the chain has no link or frozen stages."""
    if chain.link is None or chain.frozen_stages or chain.length < 3:
        return None
    sizes, need, _ = _least_memory(chain)
    room = budget_bytes - int(sizes.activation[0])
    best: Plan | None = None
    table = ExactTable(chain, sizes, need)  # rotor's sub-problems, shared by every reserve
    # T ignores the copies' time, so it would host the checkpoint that frees the most bytes,
    # however long its copies take: each stage's input is tried alone, the simulator judging.
    for stage, reserve in [(s, r) for s in range(2, chain.length) for r in RESERVES]:
        split = _HostSplit(chain, table, reserve, stage, deadline)
        try:
            if not np.isfinite(split.solve(room, 1, True, 1)):
                return None
        except TimeoutError:
            return _named(best)
        for lead in LEADS:
            if time.monotonic() > deadline:
                return _named(best)
            ops = split.ops(room, 1, True, 1, lead)
            if not any(op.kind == "offload" for op in ops):
                break  # rotor's own plan: nothing to place
            plan = score(
                Plan(
                    tuple(ops), tuple(s.name for s in chain.stages), "milp", chain_name=chain.name
                ),
                chain,
                budget_bytes,
            )
            if plan.feasible and (best is None or plan.predicted_time_s < best.predicted_time_s):
                best = plan
    return _named(best)


def _named(plan: Plan | None) -> tuple[str, Plan] | None:
    return None if plan is None else ("host split + dp", plan)
