"""The executor runs every kind of plan with exactly plain autograd's gradients.

Random small chains mix dropout, BatchNorm, frozen parameters, a stage returning a tuple with
an integer tensor, and inputs with and without grad. For each, plans of every kind (the
baselines, dp at several budgets, milp when it is installed, and hand-written plans that keep,
recompute and offload, checkpoints included) must give bit-identical outputs, gradients and
buffers on CPU, and the peak the executor measures must respect the plan.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import itertools
import random

import pytest
import torch
from torch import nn

from offremat.executor import PlanExecutor
from offremat.profiler import profile_model
from solvers.baselines import checkpoint_every_stage, chen, keep_all, offload_all
from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain, Link, Stage
from solvers.dp import memory_need, solve_dp
from solvers.host import COMPUTE, ISSUE, RELEASE
from solvers.plan import (
    SAVED,
    Plan,
    backward,
    forward_all,
    forward_checkpoint,
    free,
    offload,
    prefetch,
    validate,
)
from solvers.registry import keep_all_peak
from solvers.registry import min_feasible_budget as registry_min_feasible_budget
from solvers.simulator import score, simulate

FAST_LINK = 1e9
# Rows per batch: enough that activations (tens of KiB) dwarf the executor's few fixed bytes.
ROWS = 1024


class MeanOfSquares(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.pow(2).mean()


class Split(nn.Module):
    """Returns a tuple: a hidden state, an integer mask and a float side channel."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.linear(x), (x > 0).long(), x.sum(-1)


class Merge(nn.Module):
    """Takes :class:`Split`'s tuple back to one tensor."""

    def forward(self, parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden, mask, side = parts
        return torch.tanh(hidden + side[:, None] * mask.to(hidden.dtype))


def random_model(seed: int) -> tuple[nn.Sequential, int]:
    """A chain of 4 to 7 blocks of mixed kinds, and its width."""
    rng = random.Random(seed)
    width = rng.choice([8, 12, 16])
    torch.manual_seed(seed)
    blocks: list[nn.Module] = []
    kinds = ["mlp", "dropout", "batchnorm", "frozen", "split"]
    while len(blocks) < rng.randint(4, 7):
        kind = rng.choice(kinds)
        if kind == "mlp":
            blocks.append(nn.Sequential(nn.Linear(width, width), nn.Tanh()))
        elif kind == "dropout":
            blocks.append(nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.3)))
        elif kind == "batchnorm":
            blocks.append(nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.GELU()))
        elif kind == "frozen":
            frozen = nn.Linear(width, width)
            frozen.requires_grad_(False)
            blocks.append(nn.Sequential(frozen, nn.Tanh()))
        else:
            blocks += [Split(width), Merge()]
    blocks.append(nn.Sequential(nn.Linear(width, width), nn.Dropout(0.2)))
    return nn.Sequential(*blocks).train(), width


def run_step(step, model: nn.Module, x: torch.Tensor, target: torch.Tensor, seed: int):
    """One forward and backward with a fixed RNG; output, parameter grads, buffers, input grad."""
    x = x.detach().clone().requires_grad_(x.requires_grad)
    # As after a first step: parameter gradients exist and are not activation memory.
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
    torch.manual_seed(seed)
    out = step(x)
    ((out - target) ** 2).mean().backward()
    grads = [p.grad for p in model.parameters()]
    return out.detach(), grads, [b.clone() for b in model.buffers()], x.grad


def assert_identical(reference, result) -> None:
    out_ref, grads_ref, buffers_ref, input_grad_ref = reference
    out, grads, buffers, input_grad = result
    assert torch.equal(out, out_ref)
    assert len(grads) == len(grads_ref)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert (g is None) == (g_ref is None)
        if g is not None:
            assert torch.equal(g, g_ref)
    for b, b_ref in zip(buffers, buffers_ref, strict=True):
        assert torch.equal(b, b_ref)
    assert (input_grad is None) == (input_grad_ref is None)
    if input_grad is not None:
        assert torch.equal(input_grad, input_grad_ref)


def mixed_plan(chain: Chain) -> Plan:
    """Keep, recompute and offload on a 4-stage chain, with a checkpoint offloaded."""
    ops = [
        forward_all(1),
        forward_checkpoint(2),
        offload("saved", 1),
        forward_all(3),
        offload("activation", 2),
        forward_all(4),
        backward(4),
        prefetch("activation", 2),
        backward(3),
        prefetch("saved", 1),
        forward_all(2),
        backward(2),
        backward(1),
    ]
    return Plan(tuple(ops), chain.stage_names, "hand-mixed")


def freeing_plan(chain: Chain) -> Plan:
    """Offloads x̄_1 while stage 2 reads it, frees x̄_2 and recomputes it from the host copy."""
    ops = [
        forward_all(1),
        forward_all(2),
        offload("saved", 1),
        forward_checkpoint(3),
        free("saved", 2),
        forward_all(4),
        backward(4),
        prefetch("saved", 1),
        forward_all(2),
        forward_all(3),
        backward(3),
        backward(2),
        backward(1),
    ]
    return Plan(tuple(ops), chain.stage_names, "hand-free")


def two_versions_plan(chain: Chain) -> Plan:
    """x̄_1 recomputed while its host copy lives on; the host copy is prefetched twice."""
    ops = [
        forward_all(1),
        forward_checkpoint(2),
        offload("saved", 1),
        forward_all(3),
        forward_all(4),
        backward(4),
        backward(3),
        forward_all(1),
        free("saved", 1),
        prefetch("saved", 1),
        free("saved", 1),
        prefetch("saved", 1),
        forward_all(2),
        backward(2),
        backward(1),
    ]
    return Plan(tuple(ops), chain.stage_names, "hand-two-versions")


def input_offload_plan(chain: Chain) -> Plan:
    """Checkpoint every stage input, offload the checkpoints (not the model input a_0, which
    the caller holds) but the last stage's, prefetch each for its stage."""
    length = chain.length
    ops = []
    for i in range(1, length):
        ops += [forward_checkpoint(i)] + ([offload("activation", i - 1)] if i > 1 else [])
    ops += [forward_all(length), backward(length)]
    for i in range(length - 1, 0, -1):
        ops += [prefetch("activation", i - 1)] if i > 1 else []
        ops += [forward_all(i), backward(i)]
    return Plan(tuple(ops), chain.stage_names, "hand-checkpoint-offload")


def test_hand_written_plans_are_valid() -> None:
    chain = Chain("c", 8, tuple(Stage(f"s{i}", 1.0, 2.0, 4, 8) for i in range(1, 5)), Link(4, 4))
    for plan in (
        mixed_plan(chain),
        freeing_plan(chain),
        two_versions_plan(chain),
        input_offload_plan(chain),
    ):
        assert validate(plan, chain) == [], plan.solver
    assert set(mixed_plan(chain).decisions.values()) == {"keep", "recompute", "offload"}


def profiled(model: nn.Module, x: torch.Tensor, seed: int) -> Chain:
    torch.manual_seed(seed)
    return profile_model(model, x, warmup=0, repeats=1, bandwidth=FAST_LINK)


def plans_for(chain: Chain) -> list[Plan]:
    """Every kind of plan this chain admits, scored at the budget it was made for."""
    plans = []
    peak = keep_all_peak(chain)
    for maker in (keep_all, chen, checkpoint_every_stage, offload_all):
        plans.append(score(maker(chain), chain, peak))
    least = memory_need(chain)
    for fraction in (0.0, 0.35, 0.7):
        budget = int(least + fraction * (peak - least))
        try:
            plans.append(solve_dp(chain, budget))
        except InfeasibleBudgetError:
            continue
    if chain.length == 4:
        for plan in (mixed_plan(chain), freeing_plan(chain), two_versions_plan(chain)):
            plans.append(score(plan, chain, peak))
    plans.append(score(input_offload_plan(chain), chain, peak))
    return plans


@pytest.mark.parametrize("seed", range(6))
def test_every_plan_matches_plain_autograd_bit_for_bit(seed: int) -> None:
    model, width = random_model(seed)
    torch.manual_seed(100 + seed)
    x = torch.randn(ROWS, width, requires_grad=seed % 2 == 0)
    target = torch.randn(ROWS, width)
    chain = profiled(copy.deepcopy(model), x, seed)
    reference_model = copy.deepcopy(model)
    reference = run_step(reference_model, reference_model, x, target, seed)
    for plan in plans_for(chain):
        assert validate(plan, chain) == []
        candidate = copy.deepcopy(model)
        executor = PlanExecutor(list(candidate), plan, chain, measure_memory=True)
        assert_identical(reference, run_step(executor, candidate, x, target, seed))
        stats = executor.stats
        assert stats is not None and stats.step_time_s > 0
        assert stats.measured_peak_bytes <= plan.budget_bytes, plan.solver


def test_a_four_stage_model_runs_the_hand_written_offload_plans() -> None:
    torch.manual_seed(0)
    width = 10
    model = nn.Sequential(
        nn.Sequential(nn.Linear(width, width), nn.Dropout(0.5)),
        Split(width),
        Merge(),
        nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width)),
    ).train()
    x = torch.randn(5, width, requires_grad=True)
    target = torch.randn(5, width)
    chain = profiled(copy.deepcopy(model), x, 0)
    reference_model = copy.deepcopy(model)
    reference = run_step(reference_model, reference_model, x, target, 7)
    for plan in (
        mixed_plan(chain),
        freeing_plan(chain),
        two_versions_plan(chain),
        input_offload_plan(chain),
    ):
        candidate = copy.deepcopy(model)
        executor = PlanExecutor(list(candidate), score(plan, chain, None), chain)
        assert_identical(reference, run_step(executor, candidate, x, target, 7))


@pytest.mark.parametrize("seed", range(2))
def test_milp_plans_match_plain_autograd(seed: int) -> None:
    from solvers.milp import solve_milp

    model, width = random_model(seed)
    x = torch.randn(ROWS, width)
    target = torch.randn(ROWS, width)
    chain = profiled(copy.deepcopy(model), x, seed)
    reference_model = copy.deepcopy(model)
    reference = run_step(reference_model, reference_model, x, target, seed)
    peak = keep_all_peak(chain)
    least = memory_need(chain)
    # A fast link offloads everything; a slow one mixes offloads (checkpoints too), frees and
    # recomputation.
    decisions = set()
    for link, fraction in itertools.product((FAST_LINK, 2e6), (0.2, 0.6)):
        chain = chain.with_link(Link(link, link))
        plan = solve_milp(chain, int(least + fraction * (peak - least)), time_limit_s=10.0)
        decisions.update(plan.decisions.values())
        candidate = copy.deepcopy(model)
        executor = PlanExecutor(list(candidate), plan, chain, measure_memory=True)
        assert_identical(reference, run_step(executor, candidate, x, target, seed))
        assert executor.stats.measured_peak_bytes <= plan.budget_bytes
    assert decisions == {"keep", "recompute", "offload"}


def wide_mlp(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
            for _ in range(depth)
        ]
    )


def recompute_plans(model: nn.Sequential, x: torch.Tensor) -> tuple[Chain, list[Plan]]:
    chain = profile_model(model, x, warmup=0, repeats=1)
    least = memory_need(chain)
    peak = keep_all_peak(chain)
    plans = [score(keep_all(chain), chain, peak), score(chen(chain), chain, peak)]
    plans += [score(checkpoint_every_stage(chain), chain, peak)]
    plans += [solve_dp(chain, int(least + f * (peak - least))) for f in (0.0, 0.3, 0.6)]
    return chain, plans


def measured_peak(model: nn.Sequential, plan: Plan, chain: Chain, x, target) -> int:
    executor = PlanExecutor(list(model), plan, chain, measure_memory=True)
    run_step(executor, model, x, target, 0)
    return executor.stats.measured_peak_bytes


def test_recompute_plans_stay_within_their_budget_measured_independently() -> None:
    model = wide_mlp(64, 8)
    x, target = torch.randn(32, 64), torch.randn(32, 64)
    chain, plans = recompute_plans(model, x)
    for plan in plans:
        assert measured_peak(model, plan, chain, x, target) <= plan.budget_bytes, plan.solver


def test_offloading_plans_stay_within_their_budget_on_cpu() -> None:
    model = wide_mlp(64, 6)
    x = torch.randn(32, 64)
    target = torch.randn(32, 64)
    chain = profile_model(model, x, warmup=0, repeats=1, bandwidth=FAST_LINK)
    # At the least budget the offload-all plan admits, the simulator makes allocations wait
    # for offloads to finish; the executor must release them at the same points.
    tightest = registry_min_feasible_budget(chain, "offload-all")
    unconstrained = simulate(offload_all(chain), chain).peak_bytes
    assert tightest < unconstrained
    for budget in (unconstrained, tightest):
        plan = score(offload_all(chain), chain, budget)
        assert plan.feasible
        executor = PlanExecutor(list(model), plan, chain, measure_memory=True)
        run_step(executor, model, x, target, 0)
        assert executor.stats.measured_peak_bytes <= budget


def test_host_schedule_issues_prefetches_ahead_and_releases_after_the_copy() -> None:
    stages = tuple(Stage(f"s{i}", 1.0, 1.0, 10, 10) for i in range(1, 4))
    chain = Chain("c", 10, stages, Link(10.0, 10.0))  # a copy of 10 bytes takes 1 s
    ops = (
        forward_all(1),
        forward_all(2),
        offload("saved", 1),
        forward_all(3),
        backward(3),
        prefetch("saved", 1),
        backward(2),
        backward(1),
    )
    actions = simulate(ops, chain).host_actions
    # Offload once F_all(2) is enqueued; the copy ends at t=2 when F_all(3) starts, so its
    # bytes are released just before F_all(3); the prefetch runs beside B(3).
    assert [(a.kind, a.position) for a in actions] == [
        (COMPUTE, 0),
        (COMPUTE, 1),
        (ISSUE, 2),
        (RELEASE, 2),
        (COMPUTE, 3),
        (ISSUE, 5),
        (COMPUTE, 4),
        (COMPUTE, 6),
        (COMPUTE, 7),
    ]


def test_host_schedule_defers_a_prefetch_that_waits_for_memory() -> None:
    stages = tuple(Stage(f"s{i}", 1.0, 1.0, 10, 10) for i in range(1, 4))
    chain = Chain("c", 10, stages, Link(10.0, 10.0))
    ops = (
        forward_all(1),
        forward_all(2),
        offload("saved", 1),
        forward_all(3),
        backward(3),
        prefetch("saved", 1),
        backward(2),
        backward(1),
    )
    unconstrained = simulate(ops, chain)
    tight = simulate(ops, chain, unconstrained.peak_bytes - 10)
    assert tight.feasible
    prefetch_start = next(i.start_s for i in tight.timeline if i.op_index == 5)
    b3_end = next(i.end_s for i in tight.timeline if i.op_index == 4)
    assert prefetch_start >= b3_end  # it waited for what B(3) frees
    order = [(a.kind, a.position) for a in tight.host_actions]
    assert order.index((ISSUE, 5)) > order.index((COMPUTE, 4))


def test_an_in_place_change_of_a_stage_input_is_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4))
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="'1' modifies its input in place"):
        profile_model(model, x, warmup=0, repeats=1)
    chain = Chain("c", 48, tuple(Stage(str(k), 1.0, 1.0, 48, 96) for k in range(3)))
    executor = PlanExecutor(list(model), score(checkpoint_every_stage(chain), chain, None), chain)
    with pytest.raises(RuntimeError, match="'1' modifies its input in place"):
        executor(x).sum().backward()


def test_a_plan_for_another_chain_is_refused() -> None:
    model = wide_mlp(8, 3)
    chain = profile_model(model, torch.randn(2, 8), warmup=0, repeats=1)
    other = Chain("other", 8, chain.stages[:2])
    with pytest.raises(ValueError, match="stages"):
        PlanExecutor(list(model), keep_all(other), chain)


def test_backward_twice_says_what_to_do() -> None:
    model = wide_mlp(8, 3)
    x = torch.randn(2, 8)
    chain = profile_model(model, x, warmup=0, repeats=1)
    # A keep-all plan is plain autograd, which retains its graph when asked; a plan that
    # recomputes frees what it recomputed as its backward goes.
    executor = PlanExecutor(list(model), score(checkpoint_every_stage(chain), chain, None), chain)
    loss = executor(x).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


def test_a_keep_all_plan_is_plain_autograd_and_still_timed() -> None:
    model = wide_mlp(8, 3)
    x = torch.randn(2, 8)
    chain = profile_model(model, x, warmup=0, repeats=1)
    executor = PlanExecutor(list(model), score(keep_all(chain), chain, None), chain)
    loss = executor(x).sum()
    # No autograd function of offremat's: the output's node is the last module's own.
    assert type(loss.grad_fn.next_functions[0][0]).__name__ != "PlanFunctionBackward"
    loss.backward(retain_graph=True)
    loss.backward()  # plain autograd's graph, retained as asked
    stats = executor.stats
    assert stats is not None and stats.bookkept_peak_bytes == 0
    assert stats.forward_time_s > 0 and stats.backward_time_s > 0


def test_host_buffers_are_reused_from_step_to_step() -> None:
    model = wide_mlp(32, 4)
    x = torch.randn(64, 32)  # 8 KiB activations: large enough to be moved
    chain = profile_model(model, x, warmup=0, repeats=1, bandwidth=FAST_LINK)
    executor = PlanExecutor(list(model), score(offload_all(chain), chain, None), chain)
    executor(x).sum().backward()
    pool = executor.resources.arenas[x.device]
    allocated = pool.allocated_bytes
    assert allocated > 0
    for _ in range(3):
        executor(x).sum().backward()
    assert pool.allocated_bytes == allocated
    executor.release_host_memory()
    assert executor.host_buffer_bytes == 0


def test_recomputation_runs_under_the_forward_autocast_state() -> None:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.1)) for _ in range(4)]
    model = nn.Sequential(*blocks)
    x = torch.randn(8, 16)
    chain = profile_model(model, x, warmup=0, repeats=1)
    reference = copy.deepcopy(model)
    executor = PlanExecutor(list(model), score(checkpoint_every_stage(chain), chain, None), chain)
    outputs = []
    for step in (reference, executor):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.manual_seed(1)
            out = step(x)
        out.float().pow(2).mean().backward()  # the recomputations run here, outside autocast
        outputs.append(out)
    assert outputs[1].dtype == torch.bfloat16
    assert torch.equal(outputs[0], outputs[1])
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine.grad, theirs.grad)


def test_two_steps_in_flight_share_one_backward() -> None:
    model = wide_mlp(8, 4)
    reference = copy.deepcopy(model)
    first, second = torch.randn(3, 8), torch.randn(5, 8)
    (reference(first).sum() + reference(second).pow(2).sum()).backward()
    chain = profile_model(model, first, warmup=0, repeats=1, bandwidth=FAST_LINK)
    executor = PlanExecutor(list(model), score(offload_all(chain), chain, None), chain)
    (executor(first).sum() + executor(second).pow(2).sum()).backward()
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=0)


def test_the_host_arena_is_one_buffer_sized_from_the_plan_and_grows_once() -> None:
    from offremat._host import HostArena

    arena = HostArena(pinned=False, capacity=1000)
    step = arena.open()
    first, second = step.take(300), step.take(600)
    assert first.untyped_storage()._cdata == second.untyped_storage()._cdata  # one buffer
    assert arena.allocated_bytes == 1000
    step.take(500)  # more than the plan said: a buffer of the step's own
    assert arena.allocated_bytes == 1500
    step.close()  # the next step gets one arena as large as this step used
    assert arena.capacity == 320 + 640 + 512
    arena.open().take(10)
    assert arena.allocated_bytes == arena.capacity
    arena.release()
    assert arena.allocated_bytes == 0


def test_steps_run_beside_a_waiting_one_take_memory_of_their_own_and_give_it_back() -> None:
    from offremat._host import HostArena

    arena = HostArena(pinned=False, capacity=1024)
    waiting = arena.open()
    kept = waiting.take(1024)
    kept.fill_(7)
    for _ in range(5):
        step = arena.open()
        step.take(1024).fill_(1)
        step.close()
        assert arena.allocated_bytes == 1024  # no more than the waiting step's arena
    assert bool((kept == 7).all())
    waiting.close()
    assert arena.capacity == 1024


def test_an_offloading_executor_holds_one_arena_of_the_plan_s_size() -> None:
    model = wide_mlp(32, 4)
    x = torch.randn(64, 32)
    chain = profile_model(model, x, warmup=0, repeats=1, bandwidth=FAST_LINK)
    executor = PlanExecutor(list(model), score(offload_all(chain), chain, None), chain)
    for _ in range(3):
        executor(x).sum().backward()
        assert 0 < executor.host_buffer_bytes <= executor.host_bytes + 64 * len(executor.plan.ops)


def test_a_step_run_while_another_waits_for_its_backward_leaves_its_host_copies() -> None:
    # A step that begins and ends between another's forward and backward reused the host
    # arena from its start, over the waiting step's offloaded copies: wrong gradients.
    model = wide_mlp(256, 4)
    reference = copy.deepcopy(model)
    a, b, c = (torch.randn(64, 256) for _ in range(3))
    chain = profile_model(model, a, warmup=0, repeats=1, bandwidth=FAST_LINK)
    executor = PlanExecutor(list(model), score(offload_all(chain), chain, None), chain)
    (executor(a).sum() + executor(b).sum()).backward()  # the arena grows to two steps
    waiting = executor(a)
    executor(b).sum().backward()
    executor(c).sum().backward()
    model.zero_grad(set_to_none=True)
    waiting.sum().backward()
    reference(a).sum().backward()
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine.grad, theirs.grad)


def byte_buffers() -> dict[int, int]:
    """Every byte tensor's storage alive, by key: host copies are carved from such buffers."""
    gc.collect()
    return {
        t.untyped_storage()._cdata: t.untyped_storage().nbytes()
        for t in gc.get_objects()
        if type(t) is torch.Tensor and t.dtype == torch.uint8
    }


def test_the_plans_of_every_input_shape_share_one_host_arena() -> None:
    import offremat

    before = byte_buffers()
    model = wide_mlp(64, 4)
    om = offremat.optimize(
        model, torch.randn(32, 64), budget=10**8, solver="offload-all", bandwidth=FAST_LINK
    )
    largest = 0
    for rows in (32, 48, 16, 64, 40, 24):
        om(torch.randn(rows, 64)).sum().backward()
        largest = max(largest, om._executor.host_bytes)
    assert om.cache_info()["plans"] == 6
    held = {key: size for key, size in byte_buffers().items() if key not in before}
    assert 0 < sum(held.values()) <= largest + 64 * len(om.plan.ops)


def test_a_prefetch_waiting_for_an_offload_beside_the_same_op_follows_its_release() -> None:
    # The simulator starts prefetch(x̄1) during B(5), once offload(x̄2), listed before it
    # after B(5), has ended; the host issued the prefetch before B(5) and released x̄2 only
    # after it, so B(5) ran with both: measured 131,068 B over the plan's least budget.
    from offremat.measure import StepMemory

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)]
    model = nn.Sequential(*blocks, MeanOfSquares())
    x = torch.randn(512, 64)
    chain = profile_model(copy.deepcopy(model), x, warmup=0, repeats=1)
    # Fixed times, so that the schedule is too: each compute op 1 ms, each copy 0.1 ms.
    stages = tuple(
        dataclasses.replace(s, fwd_s=1e-3, bwd_s=1e-3, refill_s=1e-3) for s in chain.stages
    )
    chain = dataclasses.replace(chain, stages=stages, link=Link(131072 / 1e-4, 131072 / 1e-4))
    ops = (
        *(forward_all(1), forward_all(2), offload(SAVED, 1)),
        *(forward_all(3), forward_all(4), forward_all(5), backward(5)),
        *(offload(SAVED, 2), prefetch(SAVED, 1), backward(4), prefetch(SAVED, 2)),
        *(backward(3), backward(2), backward(1)),
    )
    plan = Plan(ops=ops, stage_names=chain.stage_names, solver="hand")
    budget = next(
        b
        for b in range(simulate(plan, chain).peak_bytes - 2 * 131072, 10**8, 4096)
        if simulate(plan, chain, b).feasible
    )
    executor = PlanExecutor(list(model), score(plan, chain, budget), chain)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    with StepMemory("cpu", inputs=x) as memory:
        executor(x).backward()
    assert memory.peak_bytes <= budget


def test_tiny_storages_move_and_foreign_ones_stay_resident_when_offloaded() -> None:
    from offremat._held import TensorRef
    from offremat._host import HostArena
    from offremat._memory import Residency

    residency = Residency(torch.device("cpu"), HostArena(pinned=False), None)
    big = torch.ones(1024)
    tiny = torch.ones(4)
    meta = torch.ones(1024, device="meta")  # another device than the step's
    refs = [TensorRef(big), TensorRef(tiny), TensorRef(meta)]
    records = residency.hold(refs)
    residency.offload(records, None)
    residency.release(records)
    # The plan counts the whole tensor as gone: tiny storages too.
    assert refs[0].tensor is None and refs[1].tensor is None
    assert refs[2].tensor is meta  # kept where it was
    residency.prefetch(records)
    assert torch.equal(refs[0].get(), big) and torch.equal(refs[1].get(), tiny)
