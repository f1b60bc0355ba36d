"""What a stage's graph saved, read from the graph, against what the profiler's saved-tensor
hooks measured; and the steps of a model whose kept stages grow with their input's values."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offremat
from offremat._graph_saved import graph_saved_bytes, sequence_mark
from offremat.executor import PlanExecutor
from offremat.measure import StepMemory
from offremat.models import GPTConfig, RoutedBlock, RoutedNet, build_gpt, gpt_batch
from offremat.profiler import profile_model, stage_modules
from solvers.budget import InfeasibleBudgetError
from solvers.plan import BACKWARD, F_ALL
from solvers.registry import keep_all_peak, solve
from tests.test_budget_measured import MODELS, _routed


def _read(block: nn.Module, batch) -> int:
    """x̄ and a, as the graph of one forward of ``block`` on ``batch`` holds them."""
    anchor = torch.zeros(0, requires_grad=True)
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in batch]
    excluded = {p.untyped_storage()._cdata for p in block.parameters()}
    excluded |= {t.untyped_storage()._cdata for t in leaves}
    mark = sequence_mark(anchor)
    result = block(leaves[0] if len(leaves) == 1 else tuple(leaves))
    outputs = list(result) if isinstance(result, tuple) else [result]
    found = graph_saved_bytes(outputs, [mark], excluded)
    assert found is not None
    (held,), hidden = found
    assert not hidden
    held.update({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in outputs})
    return sum(size for key, size in held.items() if key not in excluded)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x) / 4)


def test_a_blocks_graph_holds_what_the_profiler_measured() -> None:
    config = GPTConfig(layers=2, hidden=32, heads=2, seq=16, vocab=64, dropout=0.0)
    model, batch = build_gpt(config, seed=0), gpt_batch(config, 2, seed=0)
    chain = profile_model(model, batch)
    embedded = model[0](batch)
    assert _read(model[1], embedded) == chain.stages[1].saved_bytes

    # A Python number an op took is saved as a tensor no hook sees, nor the profile counts.
    scaled = nn.Sequential(_Scaled())
    tokens = torch.randn(8, 64)
    assert _read(scaled[0], [tokens]) == profile_model(scaled, tokens).stages[0].saved_bytes

    routed = nn.Sequential(RoutedBlock())
    for count in (8, 40):
        _, (tokens,) = _routed(count)
        assert _read(routed[0], [tokens]) == profile_model(routed, tokens).stages[0].saved_bytes


def test_a_saved_tensor_changed_in_place_is_left_to_the_backward_to_refuse() -> None:
    # Read, not unpacked: unpacking would refuse it here, before plain autograd does.
    anchor = torch.zeros(0, requires_grad=True)
    x = torch.randn(4, requires_grad=True)
    mark = sequence_mark(anchor)
    y = (x * 2).sigmoid()  # saves its result
    y.mul_(1)
    assert graph_saved_bytes([y], [mark], set()) == ([{y.untyped_storage()._cdata: 16}], set())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
        self.calls = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + checkpoint(self._inner, h, use_reentrant=False)

    def _inner(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(h)


def test_a_checkpoint_inside_a_block_is_not_run_by_reading_its_graph(caplog) -> None:
    # Unpacked, each of its saved tensors ran its forward again and held what that made:
    # a block of six ran at 15.8 times the budget, said to outgrow it (a review).
    torch.manual_seed(0)
    model = nn.Sequential(*[_Checkpointed() for _ in range(6)], _MeanSquare())
    batch = torch.randn(16, 64, 64)
    om = offremat.optimize(model, batch, budget=1.0)
    caplog.set_level(logging.WARNING, logger="offremat")
    for block in model[:6]:
        block.calls = 0
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # the budget leaves the gradients out
    with StepMemory("cpu", batch) as memory:
        om(batch).backward()
    assert memory.peak_bytes <= om.plan.budget_bytes
    assert [block.calls for block in model[:6]] == [2] * 6  # its forward, its backward's
    assert not caplog.text


class _MeanSquare(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.pow(2).mean()


def _steps(pattern: str, width: int, budget: float, counts: list[int], caplog) -> list:
    """Peak ÷ budget and whether a warning was said, per step on ``counts`` chosen tokens."""
    _, batches = _routed(*counts)
    torch.manual_seed(0)
    model = RoutedNet(pattern, width)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    om = offremat.optimize(model, batches[0], budget=budget, solver="chen")
    caplog.set_level(logging.WARNING, logger="offremat")
    found = []
    for batch in batches:
        caplog.clear()
        with StepMemory("cpu", batch) as memory:
            om(batch).backward()
        found.append((memory.peak_bytes / om.plan.budget_bytes, bool(caplog.text)))
    return found


def test_routed_blocks_kept_behind_dense_ones_are_seen_to_grow(caplog) -> None:
    # Checkpointed dense blocks, then routed ones kept to their backward, all outputs of one
    # size: taken to grow as the dense ones did (not at all), steps ran at 1.17 to 2.0 times
    # the budget, unsaid (a review).
    steps = _steps("DDDRRR", 128, 0.8, [8, 24, 48], caplog)
    assert steps[0][0] <= 1 and not steps[0][1]
    assert all(said for peak, said in steps[1:] if peak > 1)
    assert any(peak > 1 for peak, _ in steps[1:])


def test_dense_blocks_beside_routed_ones_are_not_taken_to_grow(caplog) -> None:
    # Taken to grow as the routed blocks of their output size did, a dense block was named
    # at bytes it never held, and steps at 0.80 of the budget were warned over (a review).
    steps = _steps("RDRDRD", 512, 0.95, [8, 12, 20], caplog)
    assert all(peak <= 1 and not said for peak, said in steps)


def test_a_keep_all_plan_sees_routed_blocks_grow(caplog) -> None:
    # Run as plain autograd, with no hooks, a keep-all plan saw no stage's sizes: routed
    # tokens ran at 1.32 times its budget at every step, unsaid (a review).
    model, (few, many) = _routed(8, 24)
    om = offremat.optimize(model, few, budget=1.0)
    assert {op.kind for op in om.plan.ops} == {F_ALL, BACKWARD}  # keep-all: run plainly
    caplog.set_level(logging.WARNING, logger="offremat")
    found = []
    for batch in (few, many, many, many):
        caplog.clear()
        with StepMemory("cpu", batch) as memory:
            om(batch).backward()
        found.append((memory.peak_bytes / om.plan.budget_bytes, caplog.text))
    assert found[0][0] <= 1 and not found[0][1]
    assert found[1][0] > 1 and "saved more than its plan was made for" in found[1][1]
    assert found[-1][0] <= 1  # on a plan made for those sizes


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("solver", ["keep-all", "dp"])
def test_no_stage_read_from_the_graph_outgrows_its_profile(name: str, solver: str) -> None:
    # The sizes read from a step's graph at the profiled batch are within the profile's
    # (the profiler's hooks' count), or every step would be said to outgrow its plan.
    model, batch = MODELS[name]()
    model.train()
    chain = profile_model(copy.deepcopy(model), batch, warmup=0, repeats=1)
    budget = int((1.0 if solver == "keep-all" else 0.5) * keep_all_peak(chain))
    try:
        plan = solve(chain, budget, solver)
    except InfeasibleBudgetError:
        pytest.skip("no dp plan at half of keep-all")
    executor = PlanExecutor(stage_modules(model, chain), plan, chain)
    torch.manual_seed(1)
    executor(batch).backward()
    assert executor.outgrown is None
    assert not executor.said_sizes.saved


class _SlicedInPlace(nn.Module):
    """Squares the first n tokens' hidden features in place, n chosen by the input's values:
    the op's saved tensors sit in a CopySlices node, which Python cannot read."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 512), nn.Linear(512, 64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        n = int((h[0, :, 0] > 0).sum())
        y = self.up(h)
        for _ in range(3):
            y[:, :n].pow_(2)
        return h + self.down(torch.tanh(y))


def test_a_stage_whose_graph_hides_what_it_saved_is_hooked(caplog) -> None:
    # Read without what CopySlices holds, such stages ran a dp plan at 1.33 to 1.65 times
    # its budget unsaid (a review); from the step after the one that found such a node, the
    # stage's forwards run with saved-tensor hooks, which see it.
    _, (few, many) = _routed(4, 20)
    torch.manual_seed(0)
    model = nn.Sequential(*[_SlicedInPlace() for _ in range(6)], _MeanSquare())
    plain = copy.deepcopy(model)
    om = offremat.optimize(model, few, budget=0.9, solver="dp")
    caplog.set_level(logging.WARNING, logger="offremat")
    found = []
    for batch in (few, many, many):
        caplog.clear()
        for p in (*model.parameters(), *plain.parameters()):
            p.grad = torch.zeros_like(p)  # the budget leaves the gradients out
        with StepMemory("cpu", batch) as memory:
            om(batch).backward()
        plain(batch).backward()
        found.append((memory.peak_bytes / om.plan.budget_bytes, bool(caplog.text)))
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
    assert found[0][0] <= 1 and not found[0][1]
    assert all(said for peak, said in found if peak > 1)
    assert found[-1][0] <= 1
