"""Chains whose first stages need no backward (a frozen backbone): plan only the rest.

When neither the input nor the parameters of stages 1..p need a gradient, plain autograd
records nothing for them and never runs their backward. A plan does the same: it runs
F_ck(1), F_none(2), ..., F_none(p) once (a_0 stays, the caller holds it; each later input goes
as soon as it is read) and then plans the trained part, stages p+1..L with a_p as input, as a
chain of its own, with a_0's bytes taken from the budget since a_0 stays resident throughout.
The frozen forwards hold a_0, δ_L and their own input, output and temporary; their peak
(:func:`prefix_peak`) must fit too. ``docs/plan-format.md`` states the rules.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain
from solvers.ops import Op, forward_checkpoint, forward_none
from solvers.plan import PLAN_TIME_INFO, Plan, relative_gap


def trained_part(chain: Chain) -> Chain:
    """Stages p+1..L as a chain whose input is a_p (the frozen stages' output)."""
    p = chain.frozen_stages
    return replace(
        chain,
        name=f"{chain.name} (trained stages)",
        input_bytes=chain.activation_bytes(p),
        input_grad_bytes=chain.grad_bytes(p),
        stages=chain.stages[p:],
        frozen_stages=0,
        metadata={},
    )


def frozen_forwards(p: int) -> tuple[Op, ...]:
    """The forwards of stages 1..p: the input a_0 is kept, every later input dropped."""
    return tuple(forward_checkpoint(1) if i == 1 else forward_none(i) for i in range(1, p + 1))


def lift(plan: Plan, chain: Chain) -> Plan:
    """A plan of :func:`trained_part` as a plan of ``chain``: the frozen forwards, then its
    operations with their stage numbers moved up by p (unscored). The times in its ``info``
    (an objective, a bound) become the whole chain's: the frozen forwards run first, alone."""
    p = chain.frozen_stages
    moved = tuple(Op(op.kind, op.index + p, op.target) for op in plan.ops)
    frozen_s = sum(chain.stage(i).fwd_s for i in range(1, p + 1))
    info = {
        key: value + frozen_s if key in PLAN_TIME_INFO and value is not None else value
        for key, value in plan.info.items()
    }
    objective, bound = info.get("objective"), info.get("best_bound")
    if info.get("gap") is not None and objective and bound is not None:
        info["gap"] = relative_gap(objective, bound)
    return Plan(
        frozen_forwards(p) + moved, chain.stage_names, plan.solver, chain_name=chain.name, info=info
    )


def prefix_peak(chain: Chain) -> int:
    """The most memory the frozen forwards hold: a_0, δ_L, and per forward its input (inside
    a_0 for the first), output and temporary (the simulator's rules, compute ops in turn)."""
    held = chain.activation_bytes(0) + chain.grad_bytes(chain.length)
    peak = held
    for i in range(1, chain.frozen_stages + 1):
        previous = chain.activation_bytes(i - 1) if i >= 2 else 0
        stage = chain.stage(i)
        peak = max(peak, held + previous + stage.out_bytes + stage.nograd_fwd_tmp_bytes)
    return peak


def with_frozen_prefix(
    chain: Chain, budget_bytes: int, solve: Callable[[Chain, int], Plan]
) -> Plan:
    """``solve``'s plan of the trained part at the budget left beside a_0, lifted to
    ``chain`` (unscored). Raises :class:`InfeasibleBudgetError` with the least budget of the
    whole chain when the trained part or the frozen forwards do not fit."""
    input_bytes = chain.activation_bytes(0)
    try:
        plan = solve(trained_part(chain), max(budget_bytes - input_bytes, 1))
    except InfeasibleBudgetError as error:
        least = max(error.min_budget_bytes + input_bytes, prefix_peak(chain))
        raise InfeasibleBudgetError(budget_bytes, least, error.solver, exact=error.exact) from None
    if prefix_peak(chain) > budget_bytes:
        # The trained part fits here, so any budget the frozen forwards fit in will do.
        raise InfeasibleBudgetError(budget_bytes, prefix_peak(chain), plan.solver)
    return lift(plan, chain)


def least_budget(chain: Chain, least_of_trained: Callable[[Chain], int]) -> int:
    """The least budget of a chain with a frozen prefix, from that of its trained part."""
    trained = least_of_trained(trained_part(chain))
    return max(trained + chain.activation_bytes(0), prefix_peak(chain))


def plans_trained_part(make: Callable[..., Plan]) -> Callable[..., Plan]:
    """``make(chain, ...)`` (a plan without a budget: a baseline) planning only the trained
    part of a chain with frozen stages, lifted to the whole chain."""

    @functools.wraps(make)
    def planned(chain: Chain, *args: Any, **kwargs: Any) -> Plan:
        if not chain.frozen_stages:
            return make(chain, *args, **kwargs)
        return lift(make(trained_part(chain), *args, **kwargs), chain)

    return planned
