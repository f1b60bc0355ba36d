"""The budget holds in real memory (issue: "The budget must hold in real memory").

For the in-repo GPT and ResNet and a pre-LayerNorm residual MLP, at 30%, 50% and 70% of
keep-all, every plan kind runs one training step watched by an independent measurement
(:class:`offremat.measure.StepMemory`: a dispatch-mode tracker of every storage the step
creates, plus the input). The measured peak must stay within the budget and the gradients must
equal plain autograd's bit for bit. Offloads are counted as freed once their copy is done, as
on a GPU. A fixed plan that does not fit a budget is refused with the least budget that fits.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import offremat
from offremat.executor import PlanExecutor
from offremat.measure import StepMemory
from offremat.models import (
    GPTConfig,
    ResNetConfig,
    RoutedNet,
    build_gpt,
    build_resnet,
    gpt_batch,
    resnet_batch,
)
from offremat.profiler import profile_model, stage_modules
from solvers.budget import InfeasibleBudgetError
from solvers.chain import Link
from solvers.plan import SAVED, Plan, backward, forward_all, offload, prefetch
from solvers.registry import keep_all_peak, min_feasible_budget, solve
from solvers.simulator import score

SOLVERS = ("dp", "milp", "chen", "checkpoint-every-stage", "offload-all", "min-peak", "dtr")
FRACTIONS = (0.3, 0.5, 0.7)
LINK = Link(1.2e10, 1.2e10)


class PreNormBlock(nn.Module):
    """x + MLP(LayerNorm(x)), passing the regression target on."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, batch):
        hidden, target = batch
        return hidden + self.down(torch.relu(self.up(self.norm(hidden)))), target


class SquaredError(nn.Module):
    def forward(self, batch):
        hidden, target = batch
        return (hidden - target).pow(2).mean()


def residual_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(*[PreNormBlock(64) for _ in range(8)], SquaredError())
    return model, (torch.randn(256, 64), torch.randn(256, 64))


def gpt():
    config = GPTConfig(layers=4, hidden=64, heads=4, seq=64, vocab=128, dropout=0.1)
    return build_gpt(config), gpt_batch(config, 4)


def resnet():
    config = ResNetConfig(blocks=(4, 4), width=8, image=16)
    return build_resnet(config), resnet_batch(config, 8)


class MeanSquare(nn.Module):
    def forward(self, hidden):
        return hidden.pow(2).mean()


def random_chain(seed: int):
    """One of test_executor's random small chains (dropout, BatchNorm, frozen blocks, tuple
    outputs with an integer mask), wide enough that activations dwarf fixed bytes."""
    from test_executor import random_model

    blocks, width = random_model(seed)
    generator = torch.Generator().manual_seed(seed)
    return nn.Sequential(*blocks, MeanSquare()), torch.randn(2048, width, generator=generator)


class Twice(nn.Module):
    """Returns the same tensor twice: its two gradients are two storages."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        h = torch.tanh(self.linear(x))
        return h, h


class Join(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, pair):
        a, b = pair
        return torch.tanh(self.linear(a) * b)


def twice():
    torch.manual_seed(0)
    width = 64
    blocks = [nn.Sequential(nn.Linear(width, width), nn.Tanh())]
    for _ in range(3):
        blocks += [Twice(width), Join(width)]
    return nn.Sequential(*blocks, MeanSquare()), torch.randn(512, width)


class MaskedAttention(nn.Module):
    """Causal self-attention whose mask is a buffer, as in nanoGPT: it never changes."""

    def __init__(self, width: int, length: int):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.register_buffer("mask", torch.tril(torch.ones(length, length)), persistent=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-2, -1)).masked_fill(self.mask == 0, float("-inf"))
        return x + scores.softmax(-1) @ v


def masked():
    torch.manual_seed(0)
    blocks = [MaskedAttention(16, 128) for _ in range(6)]
    return nn.Sequential(*blocks, MeanSquare()), torch.randn(2, 128, 16)


class Embedding(nn.Module):
    def __init__(self, vocabulary: int, width: int):
        super().__init__()
        self.table = nn.Embedding(vocabulary, width)

    def forward(self, ids):
        return self.table(ids)


class TiedHead(nn.Module):
    """Logits through the embedding's own weight, then a loss: a weight two stages use."""

    def __init__(self, embedding: Embedding):
        super().__init__()
        self.embedding = embedding

    def forward(self, hidden):
        return (hidden @ self.embedding.table.weight.t()).logsumexp(-1).mean()


def tied():
    torch.manual_seed(0)
    embedding = Embedding(256, 64)
    blocks = [nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)) for _ in range(5)]
    return nn.Sequential(embedding, *blocks, TiedHead(embedding)), torch.randint(0, 256, (96,))


class Stashing(nn.Module):
    """Keeps its output as a plain attribute, as logging code does: held whatever the plan."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.last: torch.Tensor | None = None

    def forward(self, x):
        self.last = torch.tanh(self.linear(x))
        return self.last


def stashing():
    # The stash is counted as resident for the whole step, so while a plan keeps the stage
    # it is counted twice: small beside the other blocks here, as it usually is.
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(5)]
    return nn.Sequential(*blocks[:2], Stashing(64), *blocks[2:], MeanSquare()), torch.randn(512, 64)


MODELS = {
    "gpt": gpt,
    "stashing": stashing,
    "tied": tied,
    "masked": masked,
    "twice": twice,
    "resnet": resnet,
    "residual-mlp": residual_mlp,
    **{f"random-{seed}": functools.partial(random_chain, seed) for seed in range(3)},
}


def step(
    module: nn.Module, parameters: list[nn.Parameter], batch, allocator: bool = True
) -> tuple[int, list]:
    """One training step under the independent measurement: its peak and the gradients.
    ``allocator`` False: the storages ops return alone, without the kernels' own memory."""
    for parameter in parameters:  # as after a first step: gradients are not activations
        parameter.grad = torch.zeros_like(parameter)
    torch.manual_seed(1)
    with StepMemory("cpu", batch, allocator=allocator) as memory:
        module(batch).backward()
    return memory.peak_bytes, [p.grad.clone() for p in parameters]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_plan_fits_its_budget_measured_independently(name: str) -> None:
    model, batch = MODELS[name]()
    model.train()
    chain = profile_model(copy.deepcopy(model), batch, warmup=0, repeats=1).with_link(LINK)
    reference = copy.deepcopy(model)
    _, expected = step(reference, list(reference.parameters()), batch)
    keep = keep_all_peak(chain)
    ran = 0
    for fraction in FRACTIONS:
        budget = int(fraction * keep)
        for solver in SOLVERS:
            options = {"time_limit_s": 5.0} if solver == "milp" else {}
            try:
                plan = solve(chain, budget, solver, **options)
            except InfeasibleBudgetError as error:
                assert error.min_budget_bytes > budget
                continue
            candidate = copy.deepcopy(model)
            executor = PlanExecutor(stage_modules(candidate, chain), plan, chain)
            peak, grads = step(executor, list(candidate.parameters()), batch)
            where = f"{solver} at {fraction:.0%}: measured {peak} B, budget {budget} B"
            assert peak <= budget, where
            assert abs(peak - plan.predicted_peak_bytes) <= 0.1 * plan.predicted_peak_bytes, (
                f"{where}, predicted {plan.predicted_peak_bytes} B"
            )
            assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True)), where
            ran += 1
    assert ran >= 2  # at least dp and milp at 70%: the test never passes by skipping all


def simulated_op_peaks(executor: PlanExecutor) -> dict[int, int]:
    """The simulator's highest resident bytes while each compute op runs, by op position."""
    simulation = executor.simulation
    peaks = {}
    for interval in simulation.timeline:
        if executor.plan.ops[interval.op_index].is_compute:
            # An op of no duration (a refill with nothing to recompute) holds what is there.
            levels = [
                level
                for time, level in simulation.memory_curve
                if interval.start_s <= time < interval.end_s or time == interval.start_s
            ]
            peaks[interval.op_index] = max(levels)
    return peaks


def offloaded_input_plan(chain) -> Plan:
    """Keep everything but x̄_1, which goes to the host after F_all(2) has read a_1 from it
    and comes back for B(2): stage 2's graph must not keep a_1 on the device meanwhile."""
    length = chain.length
    ops = [forward_all(1), forward_all(2), offload(SAVED, 1)]
    ops += [forward_all(i) for i in range(3, length + 1)]
    ops += [backward(i) for i in range(length, 2, -1)]
    ops += [prefetch(SAVED, 1), backward(2), backward(1)]
    return score(Plan(ops=tuple(ops), stage_names=chain.stage_names, solver="hand"), chain, None)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("solver", ["dp", "offload-all", "offloaded-input"])
def test_each_op_holds_what_the_simulator_says(
    name: str, solver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Walk a plan op by op: the bytes live while each compute op runs, measured by the
    tracker and the CPU allocator's reports (what kernels allocate inside themselves), never
    exceed the simulator's resident bytes plus that op's temporaries by more than 5% of the
    plan's peak (what autograd's engine holds briefly), and the step as a whole is within 10%
    of the prediction. Single ops may hold less than simulated, by what the cost model counts
    conservatively: δ_L from the step's start."""
    from offremat import _step as step_module
    from offremat._cpu_allocator import CpuAllocatorRecord
    from offremat.measure import LiveStorageTracker

    model, batch = MODELS[name]()
    chain = profile_model(copy.deepcopy(model), batch, warmup=0, repeats=1).with_link(LINK)
    budget = int(0.7 * keep_all_peak(chain)) if solver == "dp" else None
    if solver == "offloaded-input":
        plan = offloaded_input_plan(chain)
    else:
        plan = solve(chain, budget, solver) if budget else solve(chain, 2**62, solver)
    executor = PlanExecutor(stage_modules(model, chain), plan, chain)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    expected = simulated_op_peaks(executor)
    tracker = LiveStorageTracker()
    record = CpuAllocatorRecord(0)
    input_bytes = StepMemory("cpu", batch).input_bytes  # the batch itself, measured
    spans: dict[int, tuple[int, int, int]] = {}
    run = step_module._Step._run

    def run_one_by_one(step, actions):
        for action in actions:
            # The highest live bytes within the op's own kernels: what B(i) lets go of
            # before its first kernel is not held while it runs.
            tracker.peak_bytes = 0
            first = record.marks
            run(step, [action])
            if action.kind == "compute":
                spans[action.position] = (first, record.marks, tracker.peak_bytes)

    monkeypatch.setattr(step_module._Step, "_run", run_one_by_one)
    torch.manual_seed(1)
    with record:
        assert record.recording
        tracker.allocator = record
        with tracker:
            executor(batch).backward()
        tracker.allocator = None
    # The spans from the op's first mark to its last: its kernels, and what runs between them.
    measured = {
        position: max([peak, *record.span_peak_bytes[first + 1 : last]]) + input_bytes
        for position, (first, last, peak) in spans.items()
    }
    assert measured.keys() == expected.keys()
    slack = 0.05 * plan.predicted_peak_bytes
    for position, peak in measured.items():
        op = plan.ops[position]
        assert peak <= expected[position] + slack, (str(op), peak, expected[position])
    highest = max(measured.values())
    assert abs(highest - plan.predicted_peak_bytes) <= 0.1 * plan.predicted_peak_bytes


@pytest.mark.parametrize("name", ["gpt", "resnet", "residual-mlp"])
def test_segments_hold_no_more_than_torch_checkpoint_sequential(name: str) -> None:
    """The schedule of ``torch.utils.checkpoint.checkpoint_sequential``, run by the executor,
    holds about the storages torch's own checkpointing holds, measured the same way: both free
    each recomputed saved tensor once autograd has used it. (Before the executor did, it held
    11% more on the ResNet of experiments/peers_cpu.py.) Their kernels' own memory differs: the
    executor runs the first pass without autograd, where torch runs it with autograd and
    drops what it saves, and oneDNN takes more scratch then (7% more at the ResNet's peak);
    the plan counts it."""
    from torch.utils.checkpoint import checkpoint_sequential

    from solvers.baselines import segmented_ops, sequential_segments

    model, batch = MODELS[name]()
    chain = profile_model(copy.deepcopy(model), batch, warmup=0, repeats=1)
    count = max(2, chain.length // 2)
    ops = segmented_ops(sequential_segments(chain.length, count))
    plan = score(
        Plan(ops=tuple(ops), stage_names=chain.stage_names, solver="segments"), chain, None
    )
    ours = copy.deepcopy(model)
    executor = PlanExecutor(stage_modules(ours, chain), plan, chain)
    theirs = copy.deepcopy(model)

    def torch_step(value):
        return checkpoint_sequential(theirs, count, value, use_reentrant=False)

    measured, grads = step(executor, list(ours.parameters()), batch)
    reference, expected = step(torch_step, list(theirs.parameters()), batch)
    assert measured <= plan.predicted_peak_bytes, (measured, plan.predicted_peak_bytes)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    held = step(executor, list(ours.parameters()), batch, allocator=False)[0]
    reference = step(torch_step, list(theirs.parameters()), batch, allocator=False)[0]
    assert held <= 1.05 * reference, (held, reference)


@pytest.mark.parametrize("solver", ["dp", "dtr", "min-peak"])
def test_a_plan_at_exactly_its_budget_fits_it(solver: str) -> None:
    """Plain autograd lets a saved tensor go after its node, the profile's hooks once it is
    unpacked: a node's bias gradient beside a weight gradient's input was missed by 128-512
    B, which only a plan whose peak is its budget shows (keep-all at budget=1.0, dtr and
    min-peak at the least budget they name)."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(5)]
    model, batch = nn.Sequential(*blocks, MeanSquare()), torch.randn(256, 32)
    chain = profile_model(copy.deepcopy(model), batch, warmup=0, repeats=1)
    budget = keep_all_peak(chain)
    if solver == "dtr":
        with pytest.raises(InfeasibleBudgetError) as refused:
            solve(chain, 1, solver)
        budget = refused.value.min_budget_bytes
    elif solver == "min-peak":
        budget = solve(chain, budget, solver).predicted_peak_bytes
    plan = solve(chain, budget, solver)
    assert plan.predicted_peak_bytes == budget  # the plan has no slack
    executor = PlanExecutor(stage_modules(model, chain), plan, chain)
    peak, _ = step(executor, list(model.parameters()), batch)
    assert peak <= budget, f"{solver}: measured {peak} B, budget {budget} B"


def test_a_batchnorm_resnet_fits_the_least_budget_dp_names() -> None:
    """A recomputation runs BatchNorm against copies of its running statistics, which its
    backward saves: kept F_ck/F_none graphs held them until their refill, uncounted, and the
    ResNet measured 1.0063x the least budget the DP named. They are now saved like
    activations (freed with the graph's other saved tensors) and counted in the saved set."""
    import offremat
    from tests import model_zoo

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model_zoo.ResNet()

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(self.net(x), y)

    def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        images = torch.randn(4, 3, 32, 32, generator=generator)
        return images, torch.randint(0, 10, (4,), generator=generator)

    torch.manual_seed(0)
    model = WithLoss()
    reference = copy.deepcopy(model)
    with pytest.raises(InfeasibleBudgetError) as raised:
        offremat.optimize(copy.deepcopy(model), batch(0), budget=64)
    least = raised.value.min_budget_bytes
    om = offremat.optimize(model, batch(0), budget=least)
    assert "recompute" in om.plan.decisions.values()
    for network in (model, reference):
        for parameter in network.parameters():
            parameter.grad = torch.zeros_like(parameter)
    for seed in (1, 2):
        inputs = batch(seed)
        with StepMemory("cpu", inputs=inputs) as memory:
            om(*inputs).backward()
        reference(*inputs).backward()
        assert memory.peak_bytes <= least
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine.grad, theirs.grad)


class ResidualLinear(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.relu(self.linear(h))


class Reshaped(nn.Module):
    """Returns a view of its input: its output shares the input's storage."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.view(h.shape[0], -1, h.shape[-1])


@pytest.mark.parametrize("middle", [Reshaped, nn.Identity])
def test_offloading_around_a_block_that_returns_its_input_fits_its_budget(middle) -> None:
    """A block returning a view of its input (or the input itself) makes two plan tensors
    of one storage. Offloaded, dropped and prefetched, the dropped one's references kept the
    storage from going when its last other tensor was taken: one activation over a budget
    equal to the plan's own peak."""
    from solvers.plan import forward_checkpoint

    torch.manual_seed(0)
    width = 48
    model = nn.Sequential(
        *[ResidualLinear(width) for _ in range(3)],
        middle(),
        *[ResidualLinear(width) for _ in range(2)],
        MeanSquare(),
    )
    reference = copy.deepcopy(model)
    batch = torch.randn(16, 64, width)
    chain = profile_model(copy.deepcopy(model), batch, warmup=0, repeats=1).with_link(LINK)
    ops = [forward_all(1), forward_all(2), offload(SAVED, 1), forward_all(3), offload(SAVED, 2)]
    ops += [forward_checkpoint(4), offload(SAVED, 3), forward_all(5), offload("activation", 4)]
    ops += [forward_all(6), forward_all(7), backward(7), backward(6), prefetch("activation", 4)]
    ops += [backward(5), prefetch(SAVED, 3), forward_all(4), backward(4), prefetch(SAVED, 2)]
    ops += [backward(3), prefetch(SAVED, 1), backward(2), backward(1)]
    plan = score(Plan(ops=tuple(ops), stage_names=chain.stage_names, solver="hand"), chain, None)
    plan = score(plan, chain, plan.predicted_peak_bytes)  # no slack
    executor = PlanExecutor(stage_modules(model, chain), plan, chain)
    peak, grads = step(executor, list(model.parameters()), batch)
    _, expected = step(reference, list(reference.parameters()), batch)
    assert peak <= plan.budget_bytes, (peak, plan.budget_bytes)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))


class LeafState(nn.Module):
    """A GRU cell whose initial state is made in its forward with requires_grad=True."""

    def __init__(self, width: int):
        super().__init__()
        self.cell = nn.GRUCell(width, width)

    def forward(self, x):
        return self.cell(x, torch.zeros(x.shape[0], x.shape[1], requires_grad=True))


class LeafBias(nn.Module):
    """Adds the first rows of a leaf 8 times its output, made in its forward: the leaf is most
    of what the stage holds."""

    def __init__(self, width: int, linear: bool = True):
        super().__init__()
        self.linear = nn.Linear(width, width) if linear else nn.Identity()

    def forward(self, x):
        rows, width = x.shape
        return self.linear(x) + torch.zeros(8 * rows, width, requires_grad=True)[:rows]


class Wide(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 32 * width), nn.Linear(32 * width, width)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


LEAF_MODELS = {
    # The tester's case: dp and milp measured 1.087x a budget of 40% of keep-all.
    "gru": lambda w: [_mlp(w), *[LeafState(w) for _ in range(4)]],
    # A recomputation with autograd other than B(i)'s refill makes the leaf again, while
    # the graph the first forward kept holds its own.
    "big-leaves": lambda w: [LeafBias(w) for _ in range(4)],
    # Plain autograd (a keep-all plan) runs B(1)'s wide backward beside the gradients of the
    # later stages' leaves, which the caller's loss holds through the graph.
    "wide-then-leaves": lambda w: [Wide(w), *[LeafBias(w, linear=False) for _ in range(3)]],
}


@pytest.mark.parametrize("name", sorted(LEAF_MODELS))
def test_stages_that_make_leaves_requiring_grad_fit_their_least_budget(name: str) -> None:
    """A leaf made in a stage's forward (``torch.zeros(..., requires_grad=True)``) is held by
    its graph's AccumulateGrad node, not saved: the profile counted it as a forward temporary
    only, and its gradient as B(i)'s. The graph of the first forward holds it to B(i), or to
    the end of the step where a forward with autograd recomputes the stage before B(i), and
    plain autograd's, with its gradient, to the end of the step. Before: plain autograd
    measured 4.63x the profiled keep-all peak (big-leaves) and 1.48x (wide-then-leaves), dp
    1.17x its least budget (gru); counting each leaf once, for the whole step, dp still
    measured 1.11x (big-leaves), and without covering plain autograd's gradients keep-all
    1.19x (wide-then-leaves)."""
    torch.manual_seed(0)
    width, rows = 32, 96
    model = nn.Sequential(*LEAF_MODELS[name](width), MeanSquare())
    batch = torch.randn(rows, width)
    chain = profile_model(copy.deepcopy(model), batch, warmup=0, repeats=1).with_link(LINK)
    reference = copy.deepcopy(model)
    plain_peak, expected = step(reference, list(reference.parameters()), batch)
    assert plain_peak <= keep_all_peak(chain)
    for solver in ("dp", "milp", "chen", "keep-all"):
        options = {"time_limit_s": 5.0} if solver == "milp" else {}
        least = min_feasible_budget(chain, solver, **options)
        plan = solve(chain, least, solver, **options)
        candidate = copy.deepcopy(model)
        executor = PlanExecutor(stage_modules(candidate, chain), plan, chain)
        peak, grads = step(executor, list(candidate.parameters()), batch)
        assert peak <= least, f"{solver}: measured {peak} B, least budget {least} B"
        assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True)), solver


class BeforeLeafBlocks(nn.Module):
    """Wide code before a run of LeafBias blocks, written in the model's forward (no module a
    chain could take in): its backward comes after B(1)."""

    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Parameter(torch.randn(width, 32 * width) / 8)
        self.down = nn.Parameter(torch.randn(32 * width, width) / 8)
        self.blocks = nn.ModuleList([LeafBias(width) for _ in range(4)])

    def forward(self, x):
        hidden = torch.relu(x @ self.up) @ self.down
        for block in self.blocks:
            hidden = block(hidden)
        return hidden.pow(2).mean()


def test_a_models_blocks_that_make_leaves_fit_keep_all_under_plain_autograd() -> None:
    """Under plain autograd (a keep-all plan) the code before the chain runs its backward
    beside the gradients of every block's leaves. Before: 1.48x the keep-all peak; covering
    the blocks alone, not the code around them, still 1.14x."""
    import offremat

    torch.manual_seed(0)
    model = BeforeLeafBlocks(32)
    reference = copy.deepcopy(model)
    batch = torch.randn(96, 32)
    om = offremat.optimize(model, batch, budget=1.0)
    assert set(om.plan.decisions) == {f"blocks.{k}" for k in range(4)}
    _, expected = step(reference, list(reference.parameters()), batch)
    peak, grads = step(om, list(model.parameters()), batch)
    assert peak <= om.plan.budget_bytes
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))


class Prefixed(nn.Module):
    """Puts a learned prefix before its rows: the prefix's gradient is a slice of the
    concatenation's, which holds the rows' gradient as well."""

    def __init__(self, width: int):
        super().__init__()
        self.prefix = nn.Parameter(torch.randn(8, width))
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(torch.cat([self.prefix, x], 0)))[8:]


@pytest.mark.parametrize("solver", ["dp", "chen", "keep-all"])
def test_a_prefix_whose_gradient_keeps_the_rows_gradient_fits_its_budget(solver: str) -> None:
    """Where ``.grad`` is None (``zero_grad(set_to_none=True)``, PyTorch's default), autograd
    keeps the slice it hands the prefix as ``.grad``, and the slice keeps the concatenation's
    whole gradient alive to the end of the step. Before: 1.12 times the budget at every
    step (a review), the activations measured without the gradients' own bytes."""
    torch.manual_seed(0)
    width = 64
    model = nn.Sequential(*(Prefixed(width) for _ in range(6)), MeanSquare())
    batch = torch.randn(512, width)
    chain = profile_model(copy.deepcopy(model), batch, warmup=0, repeats=1)
    reference = copy.deepcopy(model)
    reference(batch).backward()
    least = min_feasible_budget(chain, solver)
    executor = PlanExecutor(stage_modules(model, chain), solve(chain, least, solver), chain)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with StepMemory("cpu", batch, gradients_of=list(model.parameters())) as memory:
            executor(batch).backward()
        assert memory.peak_less_gradients_bytes <= least
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got.grad, expected.grad)


def test_a_prefix_that_every_block_shares_pins_one_gradient_at_a_time() -> None:
    """Its running sum (offremat._shared_grads) is one slice at a time: counting each block's
    for the whole backward made the least budget 1.45 times what its plan measured, and
    refused half the keep-all peak (a review)."""
    torch.manual_seed(0)
    width, prefix = 64, nn.Parameter(torch.randn(8, 64))
    blocks = [Prefixed(width) for _ in range(6)]
    for block in blocks:
        block.prefix = prefix
    model = nn.Sequential(*blocks, MeanSquare())
    batch = torch.randn(512, width)
    chain = profile_model(copy.deepcopy(model), batch, warmup=0, repeats=1)
    reference = copy.deepcopy(model)
    reference(batch).backward()
    least = min_feasible_budget(chain, "dp")
    executor = PlanExecutor(stage_modules(model, chain), solve(chain, least, "dp"), chain)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with StepMemory("cpu", batch, gradients_of=list(model.parameters())) as memory:
            executor(batch).backward()
        # Within the least budget, and within 10% of it: what the plan holds is what it needs.
        assert 0.9 * least <= memory.peak_less_gradients_bytes <= least
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got.grad, expected.grad)


class PrefixedMasked(Prefixed):
    """A Prefixed block that adds a saved branch under a mask, where there is one."""

    def __init__(self, width: int):
        super().__init__(width)
        self.extra = nn.Sequential(
            nn.Linear(width, 4 * width), nn.Tanh(), nn.Linear(4 * width, width)
        )

    def forward(self, x, mask):
        x = super().forward(x)
        return x if mask is None else x + self.extra(x) * mask[:, None]


class MaskedPrefixes(nn.Module):
    """Masks its rows where the batch says so (blocks' inputs of another kind, planned in the
    step that meets them)."""

    def __init__(self, width: int):
        super().__init__()
        self.blocks = nn.ModuleList(PrefixedMasked(width) for _ in range(6))

    def forward(self, x):
        mask = (x[:, 1] > 0).float() if float(x[0, 0]) > 0 else None
        for block in self.blocks:
            x = block(x, mask)
        return x.square().mean()


def test_pinned_gradients_of_a_predicted_shape_are_not_taken_from_another_size() -> None:
    """A chain predicted for 1152 rows from 1024 and 2048 held the pinned bytes of 2048 rows,
    which the masked plan profiled on it took from the bytes around the blocks: every masked
    step at 1.04 times the budget, unmeasured (a review)."""
    import offremat

    torch.manual_seed(0)
    model = MaskedPrefixes(64)
    reference = copy.deepcopy(model)

    def batch(rows: int, masked: bool) -> torch.Tensor:
        x = torch.randn(rows, 64)
        x[0, 0] = 1.0 if masked else -1.0
        return x

    om = offremat.optimize(model, batch(2048, False), budget=0.65)
    for rows, masked in [(1024, False), (1152, False), (1152, True), (1152, True)]:
        x = batch(rows, masked)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        with StepMemory("cpu", x, gradients_of=list(model.parameters())) as memory:
            om(x).backward()
        reference(x).backward()
        measured = om.stats.measured_peak_bytes is not None
        assert memory.peak_less_gradients_bytes <= om.plan.budget_bytes or measured
        grads = zip(model.parameters(), reference.parameters(), strict=True)
        assert all(
            p.grad is q.grad is None or torch.equal(p.grad, q.grad) for p, q in grads
        )  # unmasked, the branches have none
    assert om.cache_info()["predicted"] == 1


def _routed(*chosen: int) -> tuple[RoutedNet, list[torch.Tensor]]:
    """A routed net, its gradients allocated (the budget leaves them out), and one batch of
    8 sequences of 64 tokens per count, the first that many tokens of each chosen."""
    torch.manual_seed(0)
    tokens = torch.rand(8, 64, 64)
    batches = []
    for count in chosen:
        batch = tokens.clone()
        batch[:, count:, 0] *= -1
        batches.append(batch)
    model = RoutedNet()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model, batches


def test_a_step_whose_plan_held_more_than_its_budget_is_said(caplog) -> None:
    # Tokens routed by their values: optimized where few are chosen, a step where all are
    # ran at 7.3 times the budget, unsaid at every step (a new user's trial). The tensors the
    # plan held alone passed the budget (1.3 times it here): a lower bound of the step's peak.
    import logging

    import offremat

    torch.manual_seed(0)
    many = torch.rand(8, 64, 64)
    few = many.clone()
    few[:, 4:, 0] *= -1  # 4 of 64 tokens chosen
    om = offremat.optimize(RoutedNet(), few, budget=0.6)
    budget = om.plan.budget_bytes
    with caplog.at_level(logging.WARNING, logger="offremat"):
        om(few).backward()
        assert "in the tensors its plan keeps alone" not in caplog.text
        with StepMemory("cpu", many) as memory:
            om(many).backward()
    assert memory.peak_bytes > budget
    assert "in the tensors its plan keeps alone, over its budget" in caplog.text


def test_a_step_whose_recomputed_stages_saved_more_than_profiled_is_said(caplog) -> None:
    # Tokens routed by their values, optimized where 8 of 64 are chosen: a step where 40 are
    # ran at 2.4 times the budget while the tensors the plan kept stayed at 0.7 of it, so the
    # held check said nothing. The stages the plan recomputes saved 2.5 times their profile.
    import logging

    import offremat

    model, (few, many) = _routed(8, 40)
    om = offremat.optimize(model, few, budget=0.7)
    budget = om.plan.budget_bytes
    with caplog.at_level(logging.WARNING, logger="offremat"):
        with StepMemory("cpu", few) as memory:
            om(few).backward()
        assert memory.peak_bytes <= budget
        assert "saved more than its plan was made for" not in caplog.text
        with StepMemory("cpu", many) as memory:
            om(many).backward()
    assert memory.peak_bytes > budget
    assert om.stats.measured_peak_bytes is None
    assert om.stats.bookkept_peak_bytes <= budget
    assert "in the tensors its plan keeps alone" not in caplog.text
    assert "this step's stages saved more than its plan was made for" in caplog.text


class _ResidualMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(32, 512), nn.Tanh(), nn.Linear(512, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class _MaskedHeadNet(nn.Module):
    """Blocks over every token, then a wide head and its loss on the labelled tokens alone
    (ModernBERT's sparse_prediction): the code after the blocks is sized by the labels."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ResidualMLP() for _ in range(4))
        self.head = nn.Linear(32, 1024)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for block in self.blocks:
            x = block(x)
        chosen = labels >= 0
        logits = self.head(x[chosen])
        return nn.functional.cross_entropy(logits, labels[chosen]), logits


def _labels(count: int) -> torch.Tensor:
    """Labels for 4 sequences of 64 tokens, the first ``count`` of each labelled."""
    labels = torch.full((4, 64), -100)
    labels[:, :count] = 1
    return labels


def test_a_step_whose_outputs_outgrew_the_example_s_is_said(caplog) -> None:
    # Optimized where 8 of 64 tokens carry a label, a step where 40 do held 1.1 times the
    # budget, unsaid (a new user's trial: ModernBERT's masked-token head at 1.6 times, unsaid
    # even with measure_memory=True, since on CPU the tracker does not watch that code).
    import logging

    import offremat

    torch.manual_seed(0)
    x = torch.randn(4, 64, 32)
    few, many = _labels(8), _labels(40)
    model = _MaskedHeadNet()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # the budget leaves the gradients out
    om = offremat.optimize(model, {"x": x, "labels": few}, budget=0.8)
    budget = om.plan.budget_bytes
    with caplog.at_level(logging.WARNING, logger="offremat"):
        with StepMemory("cpu", (x, few)) as memory:
            om(x, few)[0].backward()
        assert memory.peak_bytes <= budget
        assert "outputs took" not in caplog.text
        with StepMemory("cpu", (x, many)) as memory:
            om(x, many)[0].backward()
    assert memory.peak_bytes > budget
    assert "this step's outputs took" in caplog.text


def test_a_measured_step_over_its_budget_says_what_the_tracker_saw(caplog) -> None:
    # The warning's figure added the code around the blocks as profiled, stats' did not:
    # 6.35 MiB said, 5.34 MiB in stats for one step (a new user's trial).
    import logging

    import offremat
    from solvers.budget import format_bytes

    model, (few, many) = _routed(8, 64)
    om = offremat.optimize(model, few, budget=0.7, measure_memory=True)
    om(few).backward()
    assert om.stats.over_budget is False
    with caplog.at_level(logging.WARNING, logger="offremat"):
        om(many).backward()
    seen = format_bytes(om.stats.measured_peak_bytes)  # its gradients existed: none made
    assert f"({seen} seen by the tracker and " in caplog.text
    # Stats say every step over, as the budget counts it, not only the first the warning says.
    assert om.stats.over_budget is True
    assert om.stats.budgeted_peak_bytes > om.stats.measured_peak_bytes
    assert f"this step measured {format_bytes(om.stats.budgeted_peak_bytes)}" in caplog.text


def test_a_step_returning_logits_and_no_loss_says_the_loss_is_outside_the_budget(caplog) -> None:
    # A Llama's logits with the cross-entropy taken outside the model ran at 1.33 times the
    # budget, unsaid (a new user's trial); the budget covers what the model's call holds.
    import logging

    import offremat

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64)) for _ in range(4)]
    model = nn.Sequential(*blocks, nn.Linear(64, 2048))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    x = torch.randn(256, 64)
    target = torch.randint(0, 2048, (256,))
    om = offremat.optimize(model, x, budget=0.9)
    with (
        caplog.at_level(logging.WARNING, logger="offremat"),
        StepMemory("cpu", (x, target)) as memory,
    ):
        nn.functional.cross_entropy(om(x), target, label_smoothing=0.1).backward()
    assert memory.peak_bytes > om.plan.budget_bytes
    assert "this step returned no loss but 2.00 MiB of tensors that carry a gradient" in (
        caplog.text
    )


def test_sizes_grown_within_the_budget_are_simulated_once(monkeypatch, caplog) -> None:
    import logging

    import offremat
    import offremat._step_reports as step_reports

    model, (few, more) = _routed(8, 24)
    om = offremat.optimize(model, few, budget=4e6, solver="checkpoint-every-stage")
    simulated = []
    real = step_reports.simulate
    monkeypatch.setattr(step_reports, "simulate", lambda *a: simulated.append(1) or real(*a))
    with caplog.at_level(logging.WARNING, logger="offremat"):
        for _ in range(3):
            om(more).backward()
    assert "saved more than its plan was made for" not in caplog.text
    assert len(simulated) == 1


def test_outputs_grown_within_the_budget_are_simulated_once(monkeypatch) -> None:
    import offremat
    import offremat._step_reports as step_reports

    torch.manual_seed(0)
    x = torch.randn(4, 64, 32)
    few, more = _labels(8), _labels(12)
    om = offremat.optimize(_MaskedHeadNet(), {"x": x, "labels": few}, budget=8e6)
    om(x=x, labels=few)[0].backward()
    simulated = []
    real = step_reports.simulate
    monkeypatch.setattr(step_reports, "simulate", lambda *a: simulated.append(1) or real(*a))
    for _ in range(3):
        om(x=x, labels=more)[0].backward()
    assert len(simulated) == 1


def _tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _tokens(seed: int, length: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("budget", [0.7, 1.0], ids=["dp", "keep-all"])
@pytest.mark.parametrize("output_held", [False, True], ids=["output-dropped", "output-held"])
def test_a_measured_step_reads_no_less_than_an_outside_tracker(
    budget: float, output_held: bool
) -> None:
    # On CPU the step's tracker does not watch the code after the blocks (a loss, the logits'
    # gradient), taken as profiled: counted as held through the backward alone, a tiny
    # Llama's measured steps read 0.08 of the budget below an outside tracker's (a review),
    # so steps over by as much passed as within. Its peak on what the chain held at its
    # forward's end is counted too, as the plan counts it (the plan's prediction bounds it):
    # at the example's length, at others profiled, and at one predicted from them, whose
    # profiled end peak, another length's, said steps at 0.87 of the budget over it (a
    # review).
    model = _tiny_llama()
    om = offremat.optimize(model, _tokens(0, 128), budget=budget, measure_memory=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for seed, length in enumerate((128, 32, 64, 48), 1):
        batch = _tokens(seed, length)
        with StepMemory("cpu", batch) as outside:
            output = om(**batch)
            loss = output.loss
            if not output_held:
                del output
            loss.backward()
        read = om.stats.budgeted_peak_bytes
        assert outside.peak_bytes * 0.99 <= read <= om.plan.predicted_peak_bytes
    assert "predicted_from" in om.chain.metadata  # the last length's chain
