"""A joint warm start: rotor's DP (Herrmann, Beaumont et al. 2019) whose first pass may send a
checkpoint to the host, with POFO's copy channels (Beaumont, Eyraud-Dubois, Shilova 2021).

Rotor's first pass holds the input a_{s-1} of a split's left part while the right part runs.
Here, along the first pass, the split at each stage s of a chosen set H may instead offload
a_{s-1} once F(s) has read it and prefetch it ``lead`` backwards before the right part ends:
the right part runs with x_{s-1} more bytes, less a ``reserve`` for the copies in flight.
The recurrence, in exact bytes and with rotor's own sub-problems
(:class:`solvers.dp_exact.ExactTable`) for everything off the first pass, is

    T(m, s) = min(opt(m, s, L),
                  f_s + T(m - x̄_s, s+1) + b_s                          (F_all(s)),
                  Σ f_s..f_{j-1} + T(m - x_{j-1}, j) + opt(m, s, j-1)      (rotor's split),
                  the same with T(m + x_{s-1} - reserve - x_{j-1}, j)       (s in H: a_{s-1}
                                                                         on the host)).

With no stage of H from s on, T(m, s) is rotor's opt(m, s, L). T ignores the copies' time, so
it would always host the checkpoints that free the most bytes, however long their copies
take: H grows a stage per round, every stage tried beside the sets of the round before whose
plans were fastest (a beam of ties), with every (reserve, lead), each plan simulated (the
simulator judges time and peak), and the fastest that fits is kept, while a round finds a
faster one. One memo serves every H and reserve: a state depends only on the stages of H from
s on. The plans are persistent, with one offload per hosted checkpoint in the first pass and
one prefetch: in the MILP's family, whose search starts from the one with a single hosted
checkpoint (:func:`solvers.milp_warm.first_in_family`).
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
    OFFLOAD,
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
TIE = 1e-9
"""Plans within this fraction of each other's time tie."""
BEAM = 8
"""The most tied sets of hosted stages a round extends."""
ONE_HOSTED = "host split + dp"
SEVERAL_HOSTED = "host splits + dp"

Choice = tuple[str, int]  # ("plain" | "all" | "split" | "host", j)
Parts = tuple[float, list[tuple[int, float, int]], list[tuple[float, int]]]
Key = tuple[int, int, bool, tuple[int, ...], float]  # (m, s, alone, hosts from s on, reserve)


class _HostSplit:
    """T(m, s) for a set of hosted stages and one reserve, memoised over every set and reserve
    tried (a state's value depends only on the hosted stages from s on), over rotor's exact
    table."""

    def __init__(self, chain: Chain, table: ExactTable, deadline: float):
        self.chain = chain
        self.table = table
        self.deadline = deadline
        self.hosted = [0] + [chain.activation_bytes(s - 1) for s in range(1, chain.length + 1)]
        self.best: dict[Key, tuple[float, Choice]] = {}
        self.splits: dict[tuple[int, int], Parts] = {}
        self.plans: dict[tuple[Op, ...], Plan] = {}

    def scored(self, ops: tuple[Op, ...], budget_bytes: int) -> Plan:
        """The plan of ``ops``, simulated once: reserves and leads often give the same ops."""
        plan = self.plans.get(ops)
        if plan is None:
            names = tuple(stage.name for stage in self.chain.stages)
            plan = Plan(ops, names, "milp", chain_name=self.chain.name)
            plan = self.plans[ops] = score(plan, self.chain, budget_bytes)
        return plan

    def opt(self, s: int, t: int, m: int) -> float:
        value = self.table.solve(s, t, m, STATES)
        if value is None or time.monotonic() > self.deadline:
            raise TimeoutError("out of time, or rotor's exact table grew too large")
        return float(value)

    def parts(self, m: int, s: int) -> Parts:
        """opt(m, s, L), rotor's splits of s..L at m, (j, the left part's time, the right
        part's room), and for each split the best of it and the later ones with nothing hosted
        right of them, (time, j): the same for every hosted set, reserve and ``alone``, so
        computed once."""
        known = self.splits.get((m, s))
        if known is not None:
            return known
        table, length = self.table, self.chain.length
        splits: list[tuple[int, float, int]] = []
        if s < length and m >= table.need[s][length]:
            for j in range(s + 1, length + 1):
                if m >= table.need[s][j - 1] and m >= table.sizes.split_room(s, j, length):
                    own = table.prefix[j - 1] - table.prefix[s - 1] + self.opt(s, j - 1, m)
                    splits.append((j, own, m - table.activation[j - 1]))
        tails: list[tuple[float, int]] = [(np.inf, 0)] * len(splits)
        tail = (np.inf, 0)
        for k in range(len(splits) - 1, -1, -1):
            j, own, right = splits[k]
            if right >= table.need[j][length]:
                # Ties go to the earlier split, as in a scan from the left.
                value = own + self.parts(right, j)[0]
                if value <= tail[0]:
                    tail = (value, j)
            tails[k] = tail
        self.splits[m, s] = (self.opt(s, length, m), splits, tails)
        return self.splits[m, s]

    def solve(self, m: int, s: int, alone: bool, hosts: tuple[int, ...], reserve: float) -> float:
        """T(m, s) where the inputs of the stages ``hosts`` (sorted) may go to the host, each
        at most once: ``alone`` says a_{s-1} is a tensor of its own (not inside x̄_{s-1})."""
        # Stages before s can no longer be hosted: states that differ only there are one.
        if hosts and hosts[0] < s:
            hosts = tuple(h for h in hosts if h >= s)
        plain, splits, tails = self.parts(m, s)
        if not hosts:
            # With nothing left to host, T's options are rotor's, over rotor's sub-problems.
            return plain
        key = (m, s, alone, hosts, reserve)
        known = self.best.get(key)
        if known is not None:
            return known[0]
        table, length = self.table, self.chain.length
        need = table.need
        value, choice = plain, ("plain", 0)
        if s < length and m >= need[s][length]:
            if m >= table.own[s][length] and m - table.saved[s] >= need[s + 1][length]:
                rest = table.fb[s] + self.solve(m - table.saved[s], s + 1, False, hosts, reserve)
                if rest < value:
                    value, choice = rest, ("all", 0)
            host_here = alone and s == hosts[0]
            hosted = int(self.hosted[s] * (1 - reserve))
            last, rotor_tail = hosts[-1], True
            for k, (j, own, right) in enumerate(splits):
                if j > last:
                    # Nothing hosted from j on: rotor's splits from here, best one known.
                    if rotor_tail:
                        rotor_tail = False
                        if tails[k][0] < value:
                            value, choice = tails[k][0], ("split", tails[k][1])
                    if not host_here:
                        break
                elif right >= need[j][length]:
                    rest = own + self.solve(right, j, True, hosts, reserve)
                    if rest < value:
                        value, choice = rest, ("split", j)
                if host_here and right + hosted >= need[j][length]:
                    rest = own + self.solve(right + hosted, j, True, hosts, reserve)
                    if rest < value:
                        value, choice = rest, ("host", j)
        self.best[key] = (value, choice)
        return value

    def ops(
        self, m: int, s: int, alone: bool, hosts: tuple[int, ...], reserve: float, lead: int
    ) -> list[Op]:
        """The operations that reach T(m, s), each hosted checkpoint prefetched ``lead``
        backwards before its right part's last."""
        hosts = tuple(h for h in hosts if h >= s)
        kind, j = self.best[m, s, alone, hosts, reserve][1] if hosts else ("plain", 0)
        table, length = self.table, self.chain.length
        if kind == "plain":
            return table.ops(s, length, m)
        if kind == "all":
            rest = self.ops(m - table.saved[s], s + 1, False, hosts, reserve, lead)
            return [forward_all(s), *rest, backward(s)]
        right_room = m - table.activation[j - 1]
        if kind == "host":
            right_room += int(self.hosted[s] * (1 - reserve))
        right = self.ops(right_room, j, True, hosts, reserve, lead)
        first = [forward_checkpoint(s)]
        if kind == "host":
            first.append(offload(ACTIVATION, s - 1))
            after = min(j + lead, length)
            at = next(n for n, op in enumerate(right) if op.kind == BACKWARD and op.index == after)
            right.insert(at + 1, prefetch(ACTIVATION, s - 1))
        first += [forward_none(i) for i in range(s + 1, j)]
        return first + right + table.ops(s, j - 1, m)


def host_split_plan(chain: Chain, budget_bytes: int, deadline: float) -> tuple[str, Plan] | None:
    """The fastest plan of :func:`host_split_plans`, named; None where it has none."""
    plans = host_split_plans(chain, budget_bytes, deadline)
    return plans[-1] if plans else None


def host_split_plans(chain: Chain, budget_bytes: int, deadline: float) -> list[tuple[str, Plan]]:
    """The fastest plan of the module's recurrence with one hosted checkpoint that fits
    ``budget_bytes`` (:data:`ONE_HOSTED`), then, if faster, the fastest with several
    (:data:`SEVERAL_HOSTED`), over the hosted stages, reserves and leads tried before
    ``deadline`` (``time.monotonic()``); empty if none that hosts a checkpoint fits, the chain
    has no link or frozen stages.

    The hosted stages grow a stage per round: each round adds every other stage to each set
    of the round before whose plan was the fastest (up to :data:`BEAM` tied sets), until a
    round finds nothing faster."""
    if chain.link is None or chain.frozen_stages or chain.length < 3:
        return []
    sizes, need, _ = _least_memory(chain)
    room = budget_bytes - int(sizes.activation[0])
    # rotor's sub-problems and T's states, shared by every hosted set and reserve
    split = _HostSplit(chain, ExactTable(chain, sizes, need), deadline)
    found: list[tuple[str, Plan]] = []
    beam: list[tuple[int, ...]] = [()]
    while beam:
        plans = _best_round(split, room, beam, budget_bytes)
        if not plans:
            break
        fastest = min(plan.predicted_time_s for plan, _ in plans)
        if found and fastest >= found[-1][1].predicted_time_s * (1 - TIE):
            break
        # The sets that tie with the fastest all go on: which one the next stage improves
        # is not known yet (ResNet-101 at 35% of keep-all: stages 2, 3 and 6 to 9 tie at
        # 58.35 ms; 3 or 4 with 6 to 8 give 57.88 ms, 2 with any other stage no better).
        tied = [item for item in plans if item[0].predicted_time_s <= fastest * (1 + TIE)]
        found.append((SEVERAL_HOSTED if found else ONE_HOSTED, tied[0][0]))
        beam = [hosts for _, hosts in tied[:BEAM]]
    return found[:1] + found[-1:] if len(found) > 1 else found


def _best_round(
    split: _HostSplit, room: int, beam: list[tuple[int, ...]], budget_bytes: int
) -> list[tuple[Plan, tuple[int, ...]]]:
    """For each set of ``beam`` and each stage beside it, the fastest plan that hosts that
    stage too (each hosted checkpoint offloaded by then), by the simulator, and the set."""
    chain = split.chain
    found: list[tuple[Plan, tuple[int, ...]]] = []
    tried: set[tuple[int, ...]] = set()
    # T ignores the copies' time, so it would host the checkpoint that frees the most bytes,
    # however long its copies take: each stage's input is added alone, the simulator judging.
    for chosen in beam:
        for stage in range(2, chain.length):
            hosts = tuple(sorted({*chosen, stage}))
            if hosts in tried or len(hosts) == len(chosen):
                continue
            tried.add(hosts)
            best: Plan | None = None
            for reserve in RESERVES:
                try:
                    if not np.isfinite(split.solve(room, 1, True, hosts, reserve)):
                        return found
                except TimeoutError:
                    return found
                for lead in LEADS:
                    if time.monotonic() > split.deadline:
                        return found
                    ops = split.ops(room, 1, True, hosts, reserve, lead)
                    if sum(op.kind == OFFLOAD for op in ops) < len(hosts):
                        break  # a smaller set's plan, tried before
                    plan = split.scored(tuple(ops), budget_bytes)
                    if plan.feasible and (
                        best is None or plan.predicted_time_s < best.predicted_time_s
                    ):
                        best = plan
            if best is not None:
                found.append((best, hosts))
    return found
