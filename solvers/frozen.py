"""Chains whose first stages need no backward (a frozen backbone): plan only the rest.

When neither the input nor the parameters of stages 1..p need a gradient, plain autograd
records nothing for them and never runs their backward. A plan does the same: it runs
F_ck(1), F_none(2), ..., F_none(p) (a_0 stays, the caller holds it; each later input goes as
soon as it is read) and no backward for them. Two ways to plan the rest, and a budgeted solver
takes the better (:func:`with_frozen_prefix`):

- :func:`merged`: the frozen prefix as one more stage of the trained part (rotor's chain,
  Beaumont et al. 2019, with a stage whose backward is free and reads no δ): the solver may
  drop a_p and run the frozen forwards again from a_0 before B(p+1), as it would recompute
  any stage. Without this, freezing stages could make a budget infeasible that the same
  chain trained whole fits (an adversarial hunt: embedding + 8 blocks, 1.22x the least
  budget).
- :func:`trained_part`: stages p+1..L with a_p as input, resident all step, a_0's bytes
  taken from the budget. The merged chain ends with that stage's forward and backward, which
  the lifted plan drops; where that tail sets the merged chain's least budget, this plan can
  fit in less.

The frozen forwards hold a_0, δ_L and their own input, output and temporary; their peak
(:func:`prefix_peak`) must fit too. ``docs/plan-format.md`` states the rules.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain, Stage
from solvers.ops import (
    ACTIVATION,
    BACKWARD,
    FORWARD_KINDS,
    Op,
    forward_checkpoint,
    forward_none,
)
from solvers.plan import PLAN_TIME_INFO, Plan, relative_gap, validate


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
    time, bound = plan.predicted_time_s, info.get("best_bound")
    if info.get("gap") is not None and time is not None and bound is not None:
        info["gap"] = relative_gap(time + frozen_s, bound)  # the plan returned's
    return Plan(
        frozen_forwards(p) + moved, chain.stage_names, plan.solver, chain_name=chain.name, info=info
    )


def frozen_forward_count(plan: Plan, chain: Chain) -> int:
    """How many forwards of the chain's frozen stages ``plan`` runs (p where it runs them
    once, as every plan of :func:`trained_part` does)."""
    return sum(op.kind in FORWARD_KINDS and op.index <= chain.frozen_stages for op in plan.ops)


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


def merged(chain: Chain) -> Chain:
    """The chain with stages 1..p as one stage: its input a_0, its output and saved set a_p
    (autograd saves nothing for it), its forward the frozen forwards in turn, its backward
    free (the trained part's input gradient g_p is still made by B(p+1), as the whole chain's
    simulator counts it; the merged stage's own input gradient is 0)."""
    p = chain.frozen_stages
    out = chain.activation_bytes(p)
    # The frozen forwards' highest point beside a_0 (the simulator's rules, compute ops in
    # turn: each holds its input, from the second on, its output and temporary), less a_p.
    highest = max(
        (chain.activation_bytes(i - 1) if i >= 2 else 0)
        + chain.stage(i).out_bytes
        + chain.stage(i).nograd_fwd_tmp_bytes
        for i in range(1, p + 1)
    )
    prefix = Stage(
        name=chain.stage(p).name,
        fwd_s=sum(chain.stage(i).fwd_s for i in range(1, p + 1)),
        bwd_s=0.0,
        out_bytes=out,
        saved_bytes=out,
        fwd_tmp_bytes=highest - out,
        bwd_tmp_bytes=0,
        nograd_fwd_tmp_bytes=highest - out,
        grad_bytes=chain.grad_bytes(p),
    )
    return replace(
        chain,
        name=f"{chain.name} (frozen stages as one)",
        input_grad_bytes=0,
        stages=(prefix, *chain.stages[p:]),
        frozen_stages=0,
        metadata={},
    )


def lift_merged(plan: Plan, chain: Chain) -> Plan:
    """A plan of :func:`merged` as a plan of ``chain`` (unscored): each forward of the merged
    stage becomes the frozen forwards, its output or saved set a_p; its backward, and what
    after B(p+1) only serves that backward, go. The copies and frees listed after a merged
    forward follow the last frozen forward, which makes the a_p they may name; the whole
    chain's simulator says what the plan costs (such a copy is issued later than the merged
    chain's prediction has it)."""
    p = chain.frozen_stages
    ops = plan.ops
    last = max(n for n, op in enumerate(ops) if op.kind == BACKWARD and op.index == 2)
    lifted: list[Op] = []
    dropped = 0  # the merged forwards after B(p+1), which only its own backward needed
    for n, op in enumerate(ops):
        if op.index == 1:
            if n > last or op.kind == BACKWARD:
                dropped += n > last and op.kind in FORWARD_KINDS
                continue
            if op.kind in FORWARD_KINDS:
                lifted += frozen_forwards(p)
            else:  # a_1 and x̄_1 of the merged chain are both a_p
                lifted.append(Op(op.kind, p, ACTIVATION))
        else:
            lifted.append(Op(op.kind, op.index + p - 1, op.target))
    # The merged chain's times count those forwards (a refill there takes as long). A bound
    # holds for plans with one such forward too (more are never faster: their lifts are the
    # same plan), so it gives one up whatever the plan found.
    frozen_s = sum(chain.stage(i).fwd_s for i in range(1, p + 1))
    info = {
        key: value - (frozen_s if key == "best_bound" else dropped * frozen_s)
        if key in PLAN_TIME_INFO and value is not None
        else value
        for key, value in plan.info.items()
    }
    time, bound = plan.predicted_time_s, info.get("best_bound")
    if info.get("gap") is not None and time is not None and bound is not None:
        info["gap"] = relative_gap(time - dropped * frozen_s, bound)  # the plan returned's
    return Plan(tuple(lifted), chain.stage_names, plan.solver, chain_name=chain.name, info=info)


def with_frozen_prefix(
    chain: Chain, budget_bytes: int, solve: Callable[[Chain, int], Plan]
) -> Plan:
    """``solve``'s plan of :func:`trained_part` where it fits ``budget_bytes`` on ``chain``
    by the simulator, else its plan of :func:`merged`, lifted (unscored). Raises
    :class:`InfeasibleBudgetError` with the lesser of the two least budgets when neither
    fits.

    The merged chain's plans include the trained part's, so where both fit the merged one
    is at least as fast; but it may run the frozen stages again, which some cannot be (an
    ``nn.Embedding(max_norm=...)`` renormalises its weight in place at each forward, and the
    step refuses to recompute it: a review found such models, which trained beside a_p,
    refused). So the frozen stages are run again only where keeping a_p does not fit."""
    from solvers.simulator import simulate  # the simulator reads plans, which read this

    errors: list[InfeasibleBudgetError] = []
    for plan_part in (_trained_part_plan, _merged_plan):
        try:
            plan = plan_part(chain, budget_bytes, solve)
        except InfeasibleBudgetError as error:
            errors.append(error)
            continue
        # The lift can break a rule the merged chain's plan kept: a MILP plan can hold a_1 and
        # x̄_1 at once, both a_p here. Such a plan is not handed on.
        if not validate(plan, chain) and simulate(plan, chain, budget_bytes).feasible:
            return plan
    if not errors:  # a merged plan's later-issued copies passed the budget, and no other fits
        raise InfeasibleBudgetError(budget_bytes, budget_bytes + 1, "frozen", exact=False)
    least = min(errors, key=lambda error: error.min_budget_bytes)
    raise InfeasibleBudgetError(
        budget_bytes, least.min_budget_bytes, least.solver, exact=least.exact
    ) from None


def _merged_plan(chain: Chain, budget_bytes: int, solve: Callable[[Chain, int], Plan]) -> Plan:
    """``solve``'s plan of :func:`merged`, lifted."""
    return lift_merged(solve(merged(chain), budget_bytes), chain)


def _trained_part_plan(
    chain: Chain, budget_bytes: int, solve: Callable[[Chain, int], Plan]
) -> Plan:
    """``solve``'s plan of :func:`trained_part` at the budget left beside a_0, lifted."""
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
    """The least budget of a chain with a frozen prefix, from that of a chain without: the
    lesser of :func:`merged`'s and its trained part's beside a_0 and the frozen forwards."""
    trained = least_of_trained(trained_part(chain))
    beside = max(trained + chain.activation_bytes(0), prefix_peak(chain))
    return min(least_of_trained(merged(chain)), beside)


def plans_trained_part(make: Callable[..., Plan]) -> Callable[..., Plan]:
    """``make(chain, ...)`` (a plan without a budget: a baseline) for a chain with frozen
    stages: its plan of :func:`merged` or of :func:`trained_part`, lifted to the whole chain,
    whichever has the lesser peak (at a tie, the trained part's, which runs the frozen
    forwards once)."""
    from solvers.simulator import simulate  # the simulator reads plans, which read this

    @functools.wraps(make)
    def planned(chain: Chain, *args: Any, **kwargs: Any) -> Plan:
        if not chain.frozen_stages:
            return make(chain, *args, **kwargs)
        trained = lift(make(trained_part(chain), *args, **kwargs), chain)
        other = lift_merged(make(merged(chain), *args, **kwargs), chain)
        if validate(other, chain):
            return trained
        return min((trained, other), key=lambda plan: simulate(plan, chain).peak_bytes)

    return planned
