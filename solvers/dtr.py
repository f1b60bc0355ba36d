"""Dynamic Tensor Rematerialization (Kirisame, Lyubomirsky, Haan, Brennan, He, Roesch, Chen and
Tatlock, "Dynamic Tensor Rematerialization", ICLR 2021), simulated on a chain.

DTR plans nothing ahead. It runs the step as plain autograd would (F_all for every stage, then
every backward) and, whenever the next operation's output and temporaries would not fit in the
budget, evicts (``free``) the resident tensor with the least

    h(t) = cost(t) / (size(t) × staleness(t)),

where cost(t) is the compute time needed to bring t back: its stage's forward plus those of
the evicted stages before it down to the nearest resident activation (DTR's projected cost
over t's evicted neighbourhood); staleness is the time since t was last used. A backward that
finds its saved set or its input evicted recomputes them on demand: the missing activations
with F_ck from the nearest resident one, then F_all. The input a_0 and the gradients are never
evicted, nor what the operation about to run reads.

The result is an ordinary plan (forwards, backwards and ``free``), scored by
:func:`solvers.simulator.simulate` like every other solver.
"""

from __future__ import annotations

from solvers import semantics
from solvers.baselines import keep_all
from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain
from solvers.frozen import least_budget, with_frozen_prefix
from solvers.plan import (
    ACTIVATION,
    BACKWARD,
    FREE,
    SAVED,
    Op,
    Plan,
    backward,
    forward_all,
    forward_checkpoint,
    free,
)
from solvers.semantics import Tensor
from solvers.simulator import score, simulate


class _OutOfMemory(Exception):
    """Nothing left to evict and the next operation still does not fit."""


class _Run:
    """One DTR run at one budget: what is resident, when each tensor was last used, the clock
    (the compute time spent so far) and the operations emitted."""

    def __init__(self, chain: Chain, budget_bytes: int) -> None:
        self.chain = chain
        self.budget_bytes = budget_bytes
        self.resident = semantics.initial_residency(chain.length)
        self.last_use: dict[Tensor, float] = dict.fromkeys(self.resident, 0.0)
        self.clock = 0.0
        self.held = 0  # the caller's output and seed gradient, from the end of B(L)
        self.ops: list[Op] = []

    def resident_bytes(self) -> int:
        size = semantics.tensor_bytes
        return sum(size(tensor, self.chain) for tensor in self.resident) + self.held

    def run(self, op: Op, keep: frozenset[Tensor] = frozenset()) -> None:
        """Evict until ``op`` fits, never what it reads or ``keep``, then emit it."""
        change = semantics.effect(op)
        assert change.allocates is not None
        holder = semantics.stage_input(op.index, self.resident)
        assert holder is not None, f"{op} has no input"
        pinned = {*change.reads, holder, *keep}
        needed = semantics.tensor_bytes(change.allocates, self.chain)
        # A negative temporary does not make room before the op starts.
        needed = max(0, needed + semantics.temporary_bytes(op, self.chain))
        while self.resident_bytes() + needed > self.budget_bytes:
            self.evict(pinned)
        self.ops.append(op)
        semantics.apply(self.resident, op)
        self.clock += semantics.duration_s(op, self.chain)
        for tensor in (*change.reads, holder, change.allocates):
            self.last_use[tensor] = self.clock
        if op.kind == BACKWARD and op.index == self.chain.length:
            self.held = self.chain.held_bytes

    def evict(self, pinned: set[Tensor]) -> None:
        """Free the resident tensor of least h(t) that is not pinned."""
        candidates = [
            tensor
            for tensor in self.resident
            if tensor[0] in (ACTIVATION, SAVED)
            and tensor != (ACTIVATION, 0)
            and tensor not in pinned
            and semantics.tensor_bytes(tensor, self.chain) > 0
        ]
        if not candidates:
            raise _OutOfMemory
        victim = min(candidates, key=self.heuristic)
        self.ops.append(free(*victim))
        self.resident.discard(victim)

    def heuristic(self, tensor: Tensor) -> tuple[float, Tensor]:
        kind, i = tensor
        if kind == ACTIVATION and (SAVED, i) in self.resident:
            return (0.0, tensor)  # a copy of what x̄_i holds: free to bring back
        cost = sum(self.chain.stage(m).fwd_s for m in range(self.nearest_below(i) + 1, i + 1))
        staleness = self.clock - self.last_use[tensor]
        weight = semantics.tensor_bytes(tensor, self.chain) * staleness
        return (cost / weight if weight > 0 else float("inf"), tensor)

    def nearest_below(self, i: int) -> int:
        """The largest j < i whose a_j is resident, by itself or inside x̄_j (a_0 at worst)."""
        j = i - 1
        while j > 0 and (ACTIVATION, j) not in self.resident and (SAVED, j) not in self.resident:
            j -= 1
        return j

    def bring_back_input(self, i: int, keep: frozenset[Tensor] = frozenset()) -> None:
        """Recompute a_{i-1} with F_ck from the nearest resident activation, if it is gone,
        never evicting ``keep``."""
        if semantics.stage_input(i, self.resident) is not None:
            return
        for m in range(self.nearest_below(i - 1) + 1, i):
            self.run(forward_checkpoint(m), keep)


def _dtr_ops(chain: Chain, budget_bytes: int) -> list[Op]:
    """DTR's operations at ``budget_bytes``; raises :class:`_OutOfMemory` if it gets stuck."""
    run = _Run(chain, budget_bytes)
    for i in range(1, chain.length + 1):
        run.run(forward_all(i))
    for i in range(chain.length, 0, -1):
        # B(i)'s saved set, once resident, is locked while its input is rebuilt.
        run.bring_back_input(i, keep=frozenset({(SAVED, i)} & run.resident))
        if (SAVED, i) not in run.resident:
            run.run(forward_all(i))
        run.run(backward(i))
    if run.resident_bytes() > budget_bytes:  # δ_0 and what the caller holds, at the end
        raise _OutOfMemory
    return run.ops


def _fits(chain: Chain, budget_bytes: int) -> bool:
    try:
        _dtr_ops(chain, budget_bytes)
    except _OutOfMemory:
        return False
    return True


def dtr_least_budget(chain: Chain, above: int = 0) -> int:
    """The least budget greater than ``above`` at which DTR completes the step, by bisection
    below one at which it does (plain autograd's peak, as a rule). DTR is greedy, so its
    success is not monotone in the budget: the budget named is one at which it does succeed,
    with none found between ``above`` and it."""
    if chain.frozen_stages:
        return least_budget(chain, dtr_least_budget)
    # At plain autograd's peak DTR usually never evicts. Its admission counts an operation's
    # output and temporaries before it runs, which can ask for more than the simulated peak
    # (a backward with a negative temporary that takes no time): grow the budget until it fits.
    ceiling = simulate(keep_all(chain), chain).peak_bytes
    low, high = above, max(ceiling, above + 1)
    step = max(1, high // 64)
    while not _fits(chain, high):
        low, high, step = high, high + step, 2 * step
    while high - low > 1:
        middle = (low + high) // 2
        if _fits(chain, middle):
            high = middle
        else:
            low = middle
    return high


def dtr(chain: Chain, budget_bytes: int) -> Plan:
    """DTR's plan for ``chain`` within ``budget_bytes``, scored by the simulator. When it gets
    stuck it raises :class:`InfeasibleBudgetError` naming a larger budget at which it does not."""
    if chain.frozen_stages:
        return score(with_frozen_prefix(chain, budget_bytes, dtr), chain, budget_bytes)
    try:
        ops = _dtr_ops(chain, budget_bytes)
    except _OutOfMemory:
        least = dtr_least_budget(chain, above=budget_bytes)
        raise InfeasibleBudgetError(budget_bytes, least, "dtr", exact=False) from None
    evictions = sum(op.kind == FREE for op in ops)
    plan = Plan(
        ops=tuple(ops),
        stage_names=chain.stage_names,
        solver="dtr",
        chain_name=chain.name,
        info={"evictions": evictions},
    )
    return score(plan, chain, budget_bytes)
