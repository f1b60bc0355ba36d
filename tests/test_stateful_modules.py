"""Modules that change their own state in a forward: counters, moving averages, spectral
norm's power iteration, embeddings with ``max_norm``.

Plain autograd runs each forward once; a plan runs some again. Each case trains a few steps
through plans that recompute, beside plain autograd on a copy, and compares every gradient,
buffer and parameter bit for bit (see offremat/_buffers.py and offremat._blocks.untouched).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm

import offremat
from offremat.measure import StepMemory
from solvers.baselines import keep_all

WIDTH = 32
ROWS = 64
PLANS = ["checkpoint-every-stage", "chen", "offload-all"]


class Counted(nn.Module):
    """Counts its training calls in a buffer, in place or by a new tensor."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.in_place = in_place
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_place:
            self.calls += 1
        else:
            self.calls = self.calls + 1
        return torch.tanh(self.linear(x))


class Centred(nn.Module):
    """Subtracts a moving average of its output from it, and moves the average."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("average", torch.zeros(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.linear(x)) - self.average
        with torch.no_grad():
            self.average.mul_(0.9).add_(0.1 * y.mean(0))
        return y


class DataWritten(Centred):
    """Moves its average through ``.data``, which moves no version counter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.linear(x)) - self.average
        self.average.data.mul_(0.9).add_(0.1 * y.detach().mean(0))
        return y


class LateData(Centred):
    """Starts moving its average, through ``.data``, only from its third call."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = torch.tanh(self.linear(x)) - self.average
        if self.calls >= 3:
            self.average.data.mul_(0.9).add_(0.1 * y.detach().mean(0))
        return y


class Looped(nn.Module):
    """Its blocks run in a loop over a ModuleList (offremat finds the run of blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Centred() for _ in range(4))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Renormed(nn.Module):
    """Adds rows of an embedding that renormalises them in place (``max_norm``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(ROWS, WIDTH, max_norm=1.0)
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) + self.embedding(torch.arange(x.shape[0]))


class Renormalised(nn.BatchNorm1d):
    """Batch renormalisation (Ioffe, 2017): a BatchNorm that reads its running statistics in
    training mode, where torch's own does not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean, var = x.mean(0), x.var(0, unbiased=False)
        std, running_std = (var + self.eps).sqrt(), (self.running_var + self.eps).sqrt()
        r = (std.detach() / running_std).clamp(1 / 3, 3)
        d = ((mean.detach() - self.running_mean) / running_std).clamp(-5, 5)
        with torch.no_grad():
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var, self.momentum)
        return ((x - mean) / std * r + d) * self.weight + self.bias


class WarmedUp(nn.Module):
    """Halves its pre-activation from its third call on, counted in a plain attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.linear(x) * (1.0 if self.calls <= 2 else 0.5))


class Queued(nn.Module):
    """Reads a bank of past outputs and writes its own into it in place (MoCo's queue)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("queue", torch.randn(16 * ROWS, WIDTH))
        self.register_buffer("pointer", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.linear(x))
        bank = self.queue[: len(h)].clone()
        with torch.no_grad():
            start = int(self.pointer)
            self.queue[start : start + len(h)] = h
            self.pointer.fill_((start + len(h)) % len(self.queue))
        return h + bank


MODELS = {
    "counter in place": lambda: [Counted(True) for _ in range(4)],
    "counter assigned": lambda: [Counted(False) for _ in range(4)],
    "moving average": lambda: [Centred() for _ in range(4)],
    "moving average through .data": lambda: [DataWritten() for _ in range(4)],
    "moving average from a later step": lambda: [LateData() for _ in range(4)],
    "batch renormalisation": lambda: [
        nn.Sequential(nn.Linear(WIDTH, WIDTH), Renormalised(WIDTH), nn.Tanh()) for _ in range(4)
    ],
    "spectral norm": lambda: [
        nn.Sequential(spectral_norm(nn.Linear(WIDTH, WIDTH)), nn.Tanh()) for _ in range(4)
    ],
}


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach() for t in [*model.parameters(), *model.buffers()]]


def _same_state(model: nn.Module, reference: nn.Module) -> bool:
    return all(torch.equal(a, b) for a, b in zip(_state(model), _state(reference), strict=True))


def _train_beside(om, model: nn.Module, reference: nn.Module, x: torch.Tensor) -> None:
    """Three steps of each, gradients and state compared bit for bit after every one."""
    for _ in range(3):
        om(x).pow(2).mean().backward()
        reference(x).pow(2).mean().backward()
        for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(mine.grad, theirs.grad)
        assert _same_state(model, reference)


def _fit_beside(om, model: nn.Module, reference: nn.Module, x: torch.Tensor, budget: int):
    """Two steps of each: the measured peak within ``budget``, gradients and state equal."""
    for parameter in (*model.parameters(), *reference.parameters()):
        parameter.grad = torch.zeros_like(parameter)
    for _ in range(2):
        with StepMemory("cpu", x) as memory:
            om(x).pow(2).mean().backward()
        reference(x).pow(2).mean().backward()
        assert memory.peak_bytes <= budget
        for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(mine.grad, theirs.grad)
        assert _same_state(model, reference)


@pytest.mark.parametrize("solver", PLANS)
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_forward_that_changes_state_trains_as_plain_autograd(kind: str, solver: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*MODELS[kind](), nn.Linear(WIDTH, 1))
    reference = copy.deepcopy(model)
    x = torch.randn(ROWS, WIDTH)
    om = offremat.optimize(model, x, budget=1.0, solver=solver, bandwidth=1e9)
    # optimize ran the forward (profiling, checking) and left no trace.
    assert _same_state(model, reference)
    assert om.plan.ops != keep_all(om.chain).ops
    _train_beside(om, model, reference, x)


@pytest.mark.parametrize("solver", PLANS)
def test_a_recomputation_sees_the_plain_attributes_its_forward_saw(solver: str) -> None:
    # A call counter that ends a warm-up: a recomputation reading the count its forward left
    # would switch a step early.
    torch.manual_seed(0)
    model = nn.Sequential(*[WarmedUp() for _ in range(4)], nn.Linear(WIDTH, 1))
    reference = copy.deepcopy(model)
    x = torch.randn(ROWS, WIDTH)
    om = offremat.optimize(model, x, budget=1.0, solver=solver, bandwidth=1e9)
    assert [block.calls for block in model[:4]] == [0] * 4  # optimize's own runs undone
    _train_beside(om, model, reference, x)
    assert [block.calls for block in model[:4]] == [3] * 4


class SharesATable(nn.Module):
    """Reads a table that every block registers as its buffer (one tensor)."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("table", table, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) + self.table[0, :WIDTH]


def test_the_copies_of_a_buffer_several_stages_hold_are_counted() -> None:
    # Each recomputed stage keeps a copy of a buffer another stage also holds, to the end of
    # the step (another stage's forward could change it first): 3.1x before they counted.
    torch.manual_seed(0)
    table = torch.randn(128, 128)
    model = nn.Sequential(*[SharesATable(table) for _ in range(4)], nn.Linear(WIDTH, 1))
    x = torch.randn(ROWS, WIDTH)
    first = offremat.optimize(model, x, budget=2**24, solver="checkpoint-every-stage")
    budget = first.plan.predicted_peak_bytes
    om = offremat.optimize(model, x, budget=budget, chain=first.chain, solver=first.plan.solver)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    with StepMemory("cpu", x) as memory:
        om(x).pow(2).mean().backward()
    assert memory.peak_bytes <= budget


class Gained(nn.Module):
    """Multiplies by a large buffer (saved for the backward), then replaces it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("gain", torch.ones(16 * ROWS, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.linear(x)) * self.gain[: len(x)]
        with torch.no_grad():
            self.gain = self.gain * 0.999
        return y


def test_a_buffer_replaced_by_its_forward_fits_the_least_budget() -> None:
    # Per recomputed stage the step holds the buffer's new tensor, its pre-forward copy and,
    # during a recomputation, a fresh copy the graph saves: 1.12x the least budget before.
    torch.manual_seed(0)
    model = nn.Sequential(*[Gained() for _ in range(6)], nn.Linear(WIDTH, 1))
    reference = copy.deepcopy(model)
    x = torch.randn(16 * ROWS, WIDTH)
    with pytest.raises(offremat.InfeasibleBudgetError) as raised:
        offremat.optimize(copy.deepcopy(model), x, budget=64)
    least = raised.value.min_budget_bytes
    om = offremat.optimize(model, x, budget=least)
    assert list(om.plan.decisions.values()).count("recompute") >= 3
    _fit_beside(om, model, reference, x, least)


def test_a_block_used_twice_keeps_the_attributes_of_its_later_use() -> None:
    # dp's recomputations from the first checkpoint run the shared block's first use again:
    # each sees that use's count, and leaves the count of both uses behind.
    torch.manual_seed(0)
    blocks = [WarmedUp() for _ in range(8)]
    blocks[6] = blocks[1]
    model = nn.Sequential(*blocks, nn.Linear(WIDTH, 1))
    reference = copy.deepcopy(model)
    x = torch.randn(32 * ROWS, WIDTH)
    om = offremat.optimize(model, x, budget=0.5, solver="dp")
    assert sum(op.kind == "F_ck" and op.index == 1 for op in om.plan.ops) > 1
    _train_beside(om, model, reference, x)
    assert [block.calls for block in model[:8]] == [block.calls for block in reference[:8]]


def test_the_copy_of_a_buffer_the_forward_changes_is_counted(caplog) -> None:
    # A recomputed stage's copy of a buffer its forward changes lives to the end of the step:
    # a plan at its exact predicted peak fits, measured, only if the profile counted it.
    torch.manual_seed(0)
    model = nn.Sequential(Queued(), *[Counted(True) for _ in range(3)], nn.Linear(WIDTH, 1))
    x = torch.randn(ROWS, WIDTH)
    first = offremat.optimize(model, x, budget=2**24, solver="checkpoint-every-stage")
    budget = first.plan.predicted_peak_bytes
    om = offremat.optimize(model, x, budget=budget, chain=first.chain, solver=first.plan.solver)
    assert "'0' 131080 B" in caplog.text  # the queue and its pointer
    assert om.plan.decisions["0"] == "recompute"
    reference = copy.deepcopy(model)
    _fit_beside(om, model, reference, x, om.plan.budget_bytes)


def test_a_parameter_changed_by_the_forward_is_left_alone_and_never_recomputed() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[Renormed() for _ in range(4)], nn.Linear(WIDTH, 1))
    reference = copy.deepcopy(model)
    x = torch.randn(ROWS, WIDTH)
    keeping = offremat.optimize(model, x, budget=1.0, solver="offload-all", bandwidth=1e9)
    assert _same_state(model, reference)
    for _ in range(2):  # a plan that runs each forward once trains as plain autograd
        keeping(x).pow(2).mean().backward()
        reference(x).pow(2).mean().backward()
    assert _same_state(model, reference)
    before = _state(model)
    with pytest.raises(ValueError, match=r"nn\.Embedding with max_norm"):
        offremat.optimize(model, x, budget=1.0, solver="checkpoint-every-stage")
    assert all(torch.equal(a, b) for a, b in zip(_state(model), before, strict=True))


@pytest.mark.parametrize("solver", PLANS)
def test_a_found_run_of_blocks_with_moving_averages_trains_as_plain_autograd(solver: str) -> None:
    torch.manual_seed(0)
    model = Looped()
    reference = copy.deepcopy(model)
    x = torch.randn(ROWS, WIDTH)
    om = offremat.optimize(model, x, budget=1.0, solver=solver, bandwidth=1e9)
    assert _same_state(model, reference)
    _train_beside(om, model, reference, x)


def test_a_parameter_changed_between_forward_and_backward_is_refused_for_recomputation() -> None:
    """A bias (which autograd does not save) updated between forward and backward: plain
    autograd computes the gradients from the forward's values, a recomputation would read the
    new bias. The step is refused, with what to do, and the next one trains as plain autograd."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Counted(False) for _ in range(4)], nn.Linear(WIDTH, 1))
    reference = copy.deepcopy(model)
    x = torch.randn(ROWS, WIDTH)
    om = offremat.optimize(model, x, budget=1.0, solver="checkpoint-every-stage")
    bias = model[1].linear.bias
    before = bias.detach().clone()
    loss = om(x).pow(2).mean()
    with torch.no_grad():
        bias.add_(1.0)
    with pytest.raises(RuntimeError, match="changed in place after the forward and before"):
        loss.backward()
    with torch.no_grad():
        bias.copy_(before)
        for block in reference[:4]:  # the refused step's forward counted its calls
            block.calls += 1
    model.zero_grad()
    _train_beside(om, model, reference, x)


class Logged(nn.Module):
    """Keeps an intermediate and its gradient, as activation-logging and saliency code do."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.seen: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.up(x)
        if hidden.requires_grad:
            hidden.retain_grad()
        self.seen = hidden
        return x + self.down(torch.relu(hidden))


@pytest.mark.parametrize("solver", ["dp", "checkpoint-every-stage"])
def test_a_kept_intermediate_gets_its_gradient_as_under_plain_autograd(solver: str) -> None:
    """A refill reran the forward and left its own tensor, outside the graph the backward ran,
    on the module: its ``.grad`` was None."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Logged() for _ in range(5)], nn.Linear(WIDTH, 1))
    reference = copy.deepcopy(model)
    x = torch.randn(ROWS, WIDTH)
    om = offremat.optimize(model, x, budget=0.7 if solver == "dp" else 1.0, solver=solver)
    assert "recompute" in om.plan.decisions.values()
    om(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    for mine, theirs in zip(model[:5], reference[:5], strict=True):
        assert torch.equal(mine.seen, theirs.seen)
        assert theirs.seen.grad is not None and torch.equal(mine.seen.grad, theirs.seen.grad)


class Shifted(nn.Module):
    """Adds a buffer it may also move; two of them share one tensor."""

    def __init__(self, shift: torch.Tensor, moves: str | None) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("shift", shift)
        self.moves = moves

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.linear(x) + self.shift)
        if self.moves == "in place":
            with torch.no_grad():
                self.shift.mul_(0.5).add_(y.mean(0))
        elif self.moves == ".data":
            self.shift.data.mul_(0.5).add_(y.detach().mean(0))
        return y


@pytest.mark.parametrize("moves", ["in place", ".data"])
def test_a_buffer_a_later_stage_moves_is_replayed_for_an_earlier_one(moves: str) -> None:
    """Stage 1 reads a buffer that stage 3's forward moves: stage 1's recomputation must see
    it as stage 1's forward did, though stage 1 itself left it unchanged."""
    torch.manual_seed(0)
    shift = torch.randn(WIDTH)
    reader, writer = Shifted(shift, None), Shifted(shift, moves)
    model = nn.Sequential(reader, nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()), writer)
    model.append(nn.Linear(WIDTH, 1))
    reference = copy.deepcopy(model)
    x = torch.randn(ROWS, WIDTH)
    om = offremat.optimize(model, x, budget=1.0, solver="checkpoint-every-stage")
    _train_beside(om, model, reference, x)


def test_an_unchanged_buffer_holding_a_nan_gives_its_copy_back() -> None:
    from offremat._buffers import FirstForward

    module = nn.Linear(WIDTH, WIDTH)
    module.register_buffer("table", torch.tensor([1.0, float("nan")]))
    watch = FirstForward([module], [(module, "table")])
    watch.finish("s")
    assert watch.copies == {}  # bit for bit the same: no copy held to the step's end
    watch = FirstForward([module], [(module, "table")])
    module.table[0] = 2.0
    watch.finish("s")
    assert list(watch.copies) == [(module, "table")]


def test_a_recomputation_keeps_what_it_assigns_and_the_first_forward_s_attributes_stay() -> None:
    """After a recomputation whose graph the backward runs, the tensors it assigned stay on
    the module; the attributes its first forward found, which later recomputations replay,
    must not take them in (they are the same dictionaries when nothing changed since)."""
    from offremat._buffers import attribute_values, replayed_attributes

    module = nn.Linear(2, 2)
    seen = attribute_values([module])
    before = dict(seen[0][1])
    for refill in (False, True):
        with replayed_attributes(seen, refill=refill):
            module.activation = torch.ones(1)
        assert ("activation" in vars(module)) is not refill  # a refill's graph is not run
        assert seen[0][1].keys() == before.keys()
        assert all(seen[0][1][name] is value for name, value in before.items())
        vars(module).pop("activation", None)
