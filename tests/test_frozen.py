"""Frozen first stages (fine-tuning, a frozen backbone): no backward and nothing kept for them.

Solver side: a chain with ``frozen_stages = p`` is planned with the frozen stages as one
stage whose backward is free (or as its trained part with a_0 held beside it); every solver's
plan runs the frozen forwards, all of them from a_0 each time, and no backward for them; a
named least budget is one at which the same solve succeeds, and none above the same chain's
trained whole. PyTorch side: the profiler finds
the frozen prefix, gradients equal plain autograd's (presence and values), no backward runs
through a frozen block, and the independently measured peak at 100% is at most plain
autograd's.
"""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
import torch
from test_milp import random_chain
from torch import nn

import offremat
from offremat.measure import StepMemory
from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain, Link
from solvers.frozen import prefix_peak, trained_part, with_frozen_prefix
from solvers.plan import (
    BACKWARD,
    F_ALL,
    Plan,
    backward,
    forward_all,
    forward_checkpoint,
    forward_none,
    validate,
)
from solvers.registry import SOLVERS, keep_all_peak, min_feasible_budget, solve
from solvers.simulator import simulate


def frozen_chain(seed: int, length: int = 6, frozen: int = 3) -> Chain:
    chain = random_chain(random.Random(seed), length)
    return replace(chain, frozen_stages=frozen, link=Link(2.0, 2.0))


@pytest.mark.parametrize("solver", SOLVERS)
def test_every_solver_runs_the_frozen_forwards_and_no_backward_for_them(solver) -> None:
    chain = frozen_chain(0)
    budget = keep_all_peak(chain)
    options = {"time_limit_s": 5} if solver == "milp" else {}
    plan = solve(chain, budget, solver, **options)
    assert validate(plan, chain) == []
    prefix = (forward_checkpoint(1), forward_none(2), forward_none(3))
    assert plan.ops[:3] == prefix
    # A plan may drop a_3 and run the frozen forwards again from a_0, all of them in turn.
    frozen = tuple(op for op in plan.ops if op.is_compute and op.index <= 3)
    assert frozen == prefix * (len(frozen) // 3)
    assert plan.predicted_peak_bytes <= budget


@pytest.mark.parametrize("solver", ["dp", "checkmate", "milp"])
def test_the_times_a_solver_reports_are_the_whole_chains(solver) -> None:
    """The objective, bound and table value in ``info`` count the frozen forwards, as the
    predicted time does: a bound of the trained part alone sits below every plan."""
    chain = frozen_chain(2)
    budget = (min_feasible_budget(chain, "milp") + keep_all_peak(chain)) // 2
    options = {"time_limit_s": 5} if solver != "dp" else {}
    plan = solve(chain, budget, solver, **options)
    frozen_s = sum(chain.stage(i).fwd_s for i in range(1, 4))
    assert frozen_s > 1e-3 * plan.predicted_time_s
    times = [plan.info[key] for key in ("objective", "dp_time_s") if plan.info.get(key)]
    assert times
    for time_s in times:
        assert time_s == pytest.approx(plan.predicted_time_s, rel=1e-6)
    if plan.info.get("best_bound") is not None:
        assert plan.info["best_bound"] <= plan.predicted_time_s * (1 + 1e-6)
        assert plan.info["best_bound"] >= frozen_s


def test_keep_all_holds_nothing_for_frozen_stages() -> None:
    chain = frozen_chain(1)
    trained = trained_part(chain)
    unfrozen = replace(chain, frozen_stages=0)
    held = max(keep_all_peak(trained) + chain.input_bytes, prefix_peak(chain))
    assert keep_all_peak(chain) == held
    assert keep_all_peak(chain) < keep_all_peak(unfrozen)


def test_a_backward_of_a_frozen_stage_is_invalid() -> None:
    chain = frozen_chain(2)
    ops = list(solve(chain, keep_all_peak(chain), "keep-all").ops)
    problems = validate([*ops, backward(3)], chain)
    assert any("stage 3 is frozen" in p for p in problems)
    unfrozen = replace(chain, frozen_stages=0)
    assert any("B(1) is missing" in p for p in validate(ops, unfrozen))


@pytest.mark.parametrize("solver", ["dp", "milp", "chen"])
def test_the_named_least_budget_is_one_the_same_solve_reaches(solver) -> None:
    chain = frozen_chain(3)
    options = {"time_limit_s": 5} if solver == "milp" else {}
    least = min_feasible_budget(chain, solver, **options)
    with pytest.raises(InfeasibleBudgetError) as raised:
        solve(chain, least - 1, solver, **options)
    assert raised.value.min_budget_bytes == least
    assert solve(chain, least, solver, **options).predicted_peak_bytes <= least


def test_the_frozen_forwards_alone_can_set_the_least_budget() -> None:
    chain = frozen_chain(4)
    stages = list(chain.stages)
    stages[0] = replace(stages[0], nograd_fwd_tmp_bytes=10_000)
    chain = replace(chain, stages=tuple(stages))
    least = min_feasible_budget(chain, "dp")
    assert least == prefix_peak(chain)
    with pytest.raises(InfeasibleBudgetError) as raised:
        solve(chain, least - 1, "dp")
    assert raised.value.min_budget_bytes == least


WIDTH, ROWS = 64, 256


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


def fine_tuned(frozen: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(6)], nn.Linear(WIDTH, 1))
    for block in list(model)[:frozen]:
        block.requires_grad_(False)
    return model


def step(forward, model, x, loss=lambda output: output.pow(2).mean()):
    for parameter in model.parameters():
        parameter.grad = None
    loss(forward(x)).backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def test_the_profile_finds_the_frozen_blocks() -> None:
    model = fine_tuned()
    chain = offremat.profile_model(model, torch.randn(ROWS, WIDTH), warmup=0, repeats=1)
    assert chain.frozen_stages == 4
    grad_input = torch.randn(ROWS, WIDTH, requires_grad=True)
    assert offremat.profile_model(model, grad_input, warmup=0, repeats=1).frozen_stages == 0


@pytest.mark.parametrize("budget", [1.0, 0.9])
def test_frozen_blocks_train_like_plain_autograd_without_a_backward(budget) -> None:
    model = fine_tuned()
    reference = copy.deepcopy(model)
    x = torch.randn(ROWS, WIDTH)
    om = offremat.optimize(model, x, budget=budget)
    assert om.chain.frozen_stages == 4
    assert not any(op.kind == BACKWARD and op.index <= 4 for op in om.plan.ops)
    assert not any(op.kind == F_ALL and op.index <= 4 for op in om.plan.ops)
    ran = []
    hooks = [
        block.register_full_backward_hook(lambda *_: ran.append(1)) for block in list(model)[:4]
    ]
    grads = step(om, model, x)
    for hook in hooks:
        hook.remove()
    assert ran == []
    expected = step(reference, reference, x)
    assert [g is None for g in grads] == [g is None for g in expected]
    assert all(a is None or torch.equal(a, b) for a, b in zip(grads, expected, strict=True))


def test_at_a_full_budget_the_peak_is_at_most_plain_autograds() -> None:
    model = fine_tuned()
    x = torch.randn(ROWS, WIDTH)
    om = offremat.optimize(model, x, budget=1.0)
    peaks = []
    for forward in (model, om):
        step(forward, model, x)  # gradients exist before the measured step
        for parameter in model.parameters():
            if parameter.grad is not None:
                parameter.grad.zero_()
        with StepMemory("cpu", x) as memory:
            forward(x).pow(2).mean().backward()
        peaks.append(memory.peak_bytes)
    plain, planned = peaks
    # Within the gradients of one backward of plain autograd, frozen or not: B(i) holds δ_i
    # until it ends, where autograd frees it once used (a known margin of every plan).
    chain = om.chain
    margin = max(chain.grad_bytes(i) + chain.grad_bytes(i - 1) for i in range(1, chain.length + 1))
    assert planned <= plain + margin
    assert planned <= om.plan.budget_bytes
    unfrozen = fine_tuned(frozen=0)
    full = offremat.optimize(unfrozen, x, budget=1.0)
    assert om.plan.predicted_peak_bytes < full.plan.predicted_peak_bytes


def test_a_hand_plan_dropping_the_frozen_prefix_s_input_counts_it_as_held() -> None:
    # F_none(1) releases its input a_0 in rotor's model, but a_0 is the caller's input, held
    # for the whole step: a plan that runs it is measured with a_0 resident throughout.
    model = fine_tuned(frozen=1)
    x = torch.randn(16 * ROWS, WIDTH)  # an input as large as several activations
    chain = offremat.optimize(model, x, budget=1.0).chain
    assert chain.frozen_stages == 1
    ops = [forward_none(1)]
    ops += [forward_all(i) for i in range(2, chain.length + 1)]
    ops += [backward(i) for i in range(chain.length, 1, -1)]
    hand = Plan(tuple(ops), chain.stage_names, "hand")
    predicted = simulate(hand, chain).peak_bytes
    om = offremat.optimize(model, x, chain=chain, plan=hand, budget=predicted)
    for parameter in model.parameters():
        parameter.grad = None if not parameter.requires_grad else torch.zeros_like(parameter)
    with StepMemory("cpu", x) as memory:
        om(x).pow(2).mean().backward()
    assert memory.peak_bytes <= predicted


def test_unfreezing_after_optimize_is_planned_again() -> None:
    # The frozen prefix ran no backward and saved nothing; unfrozen, it does both.
    model = fine_tuned()
    x = torch.randn(ROWS, WIDTH)
    om = offremat.optimize(model, x, budget=1.0)
    assert om.chain.frozen_stages == 4
    model[0].requires_grad_(True)
    reference = copy.deepcopy(model)
    ours, theirs = step(om, model, x), step(reference, reference, x)
    assert om.chain.frozen_stages == 0
    assert [a is None for a in ours] == [b is None for b in theirs]
    assert all(a is None or torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_a_hugging_face_model_with_its_embeddings_and_first_layers_frozen() -> None:
    pytest.importorskip("transformers")
    from tests import model_zoo as zoo
    from tests.test_any_model import LM_BATCH

    torch.manual_seed(0)
    model = zoo.llama().train()
    model.get_input_embeddings().requires_grad_(False)
    for layer in model.model.layers[:2]:
        layer.requires_grad_(False)
    reference = copy.deepcopy(model)
    om = offremat.optimize(model, LM_BATCH, budget=1.0)
    assert om.chain.frozen_stages == 2
    ours = step(lambda batch: om(**batch).loss, model, LM_BATCH, loss=lambda out: out)
    theirs = step(lambda batch: reference(**batch).loss, reference, LM_BATCH, loss=lambda out: out)
    assert [g is None for g in ours] == [g is None for g in theirs]
    assert all(a is None or torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


BUDGETED = ["dp", "checkmate", "milp", "dtr"]


@pytest.mark.parametrize("solver", BUDGETED)
@pytest.mark.parametrize("seed", range(4))
def test_freezing_never_raises_the_least_budget(solver, seed) -> None:
    """A plan may drop the frozen stages' output a_p and run them again from a_0 before
    B(p+1) (solvers.frozen.merged): it kept a_p all step, and an adversarial hunt's model
    with its embedding frozen needed 1.22 times the budget it trained in."""
    rng = random.Random(seed)
    chain = replace(random_chain(rng, 6), link=Link(2.0, 2.0))
    # A forward without autograd holds no more than one with (the profiler measures both).
    stages = [
        replace(s, nograd_fwd_tmp_bytes=min(s.nograd_fwd_tmp_bytes, s.fwd_tmp_bytes))
        for s in chain.stages
    ]
    unfrozen = replace(chain, stages=tuple(stages))
    options = {"time_limit_s": 5} if solver in ("milp", "checkmate") else {}
    for frozen in (1, 2, 4):
        chain = replace(unfrozen, frozen_stages=frozen)
        least = min_feasible_budget(chain, solver, **options)
        assert least <= min_feasible_budget(unfrozen, solver, **options)
        plan = solve(chain, least, solver, **options)
        assert validate(plan, chain) == []
        assert simulate(plan, chain, least).peak_bytes <= least


def test_freezing_the_first_stage_of_a_model_planned_at_its_least_budget() -> None:
    """The hunt's case shrunk: an embedding and blocks trained at the least budget, then the
    embedding frozen (a freezing schedule): the next step plans again within that budget."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(32, WIDTH),
        *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(5)],
        nn.Linear(WIDTH, 1),
    )
    x = torch.randint(0, 32, (ROWS,))
    with pytest.raises(InfeasibleBudgetError) as raised:
        offremat.optimize(copy.deepcopy(model), x, budget=64, solver="dp")
    budget = raised.value.min_budget_bytes
    om = offremat.optimize(model, x, budget=budget, solver="dp")
    step(om, model, x)
    model[0].requires_grad_(False)
    reference = copy.deepcopy(model)
    # The step after freezing profiles the new state and plans it again (no error); the
    # profile's own runs are not the plan's, so the step after it is the one measured.
    ours, theirs = step(om, model, x), step(reference, reference, x)
    assert om.chain.frozen_stages == 1
    assert all(a is None or torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    for parameter in (*model.parameters(), *reference.parameters()):
        parameter.grad = torch.zeros_like(parameter) if parameter.requires_grad else None
    with StepMemory("cpu", x) as memory:
        loss = om(x).pow(2).mean()
        loss.backward()
    assert memory.peak_bytes <= budget
    expected = reference(x).pow(2).mean()
    expected.backward()
    assert torch.equal(loss, expected)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert (ours.grad is None) == (theirs.grad is None)
        assert ours.grad is None or torch.equal(ours.grad, theirs.grad)


def test_a_merged_stage_plan_whose_lift_breaks_a_rule_gives_way_to_the_trained_parts() -> None:
    # The merged chain's a_1 and x̄_1 are both a_p: a plan holding both (a MILP's can) lifts
    # to one that makes a_p twice, which is not handed on.
    chain = frozen_chain(5)
    budget = keep_all_peak(chain)

    def solve_part(part: Chain, room: int) -> Plan:
        if part.length == chain.length - chain.frozen_stages + 1:  # the merged chain
            ops = [forward_checkpoint(1), *(forward_all(i) for i in range(1, part.length + 1))]
            ops += [backward(i) for i in range(part.length, 0, -1)]
            plan = Plan(tuple(ops), part.stage_names, "hand")
            assert validate(plan, part) == []
            return plan
        return solve(part, room, "dp")

    plan = with_frozen_prefix(chain, budget, solve_part)
    assert validate(plan, chain) == []
    assert plan.solver == "dp"
    assert simulate(plan, chain, budget).peak_bytes <= budget


def test_a_frozen_stage_that_cannot_be_recomputed_keeps_training_beside_its_output() -> None:
    """A frozen nn.Embedding(max_norm=...) renormalises its weight at each forward, so the
    step refuses to run it again: plans that kept its output trained, and after frozen
    stages could be run again they were refused at 80% of keep-all (a review). Where keeping
    the output fits, the frozen stages run once."""
    import copy

    import offremat
    from offremat.measure import StepMemory

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(96, 64, max_norm=1.0),
        *[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(4)],
        torch.nn.Linear(64, 1),
    )
    model[0].requires_grad_(False)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 96, (512,), generator=torch.Generator().manual_seed(0))
    optimized = offremat.optimize(model, ids, budget=0.8)
    for parameter in (*model.parameters(), *reference.parameters()):
        if parameter.requires_grad:
            parameter.grad = torch.zeros_like(parameter)
    with StepMemory("cpu", inputs=ids) as memory:
        loss = optimized(ids).square().mean()
        loss.backward()
    expected = reference(ids).square().mean()
    expected.backward()
    assert torch.equal(loss, expected)
    assert memory.peak_bytes <= optimized.plan.budget_bytes
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    assert all(p.grad is q.grad is None or torch.equal(p.grad, q.grad) for p, q in pairs)
