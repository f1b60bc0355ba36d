"""Random numbers on recomputation: a recomputed stage draws what its first forward drew,
from torch's generators, a module's own, Python's ``random`` and NumPy's global one, as plain
autograd's single forward does (compared with it: gradients and the generators' states)."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from torch import nn

import offremat
from offremat._rng import HostRandomReader, host_random_state, same_host_state

WIDTH = 64
ROWS = 128


class OwnNoise(nn.Module):
    """Adds noise drawn from a generator of its own, not the global one."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.generator = torch.Generator().manual_seed(7)

    def forward(self, x):
        h = self.linear(x)
        return torch.tanh(h + torch.randn(h.shape, generator=self.generator))


@pytest.mark.parametrize("solver", ["dp", "checkpoint-every-stage"])
def test_a_module_generator_is_replayed_on_recomputation(solver: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(OwnNoise(), OwnNoise(), OwnNoise(), nn.Linear(WIDTH, 1))
    x = torch.randn(ROWS, WIDTH)
    # checkpoint-every-stage may need more than keep-all here: a generous budget in bytes.
    om = offremat.optimize(model, x, budget=0.95 if solver == "dp" else "1GiB", solver=solver)
    assert any(d == "recompute" for d in om.plan.decisions.values())
    reference = copy.deepcopy(model)  # generators copied in the same state
    om(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    for a, b in zip(model, reference, strict=True):
        if isinstance(a, OwnNoise):  # each generator moved once, as in plain autograd
            assert torch.equal(a.generator.get_state(), b.generator.get_state())


class HiddenNoise(nn.Module):
    """Draws noise from a generator kept in a list, where no one can find it to replay it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.generators = [torch.Generator().manual_seed(7)]

    def forward(self, x, *rest):
        h = self.linear(x)
        noisy = torch.tanh(h + torch.randn(h.shape, generator=self.generators[0]))
        return (noisy, *rest) if rest else noisy


class HiddenNoiseModel(nn.Module):
    """The same blocks inside a model of its own: the front door finds them as its chain."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(HiddenNoise() for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("kind", ["sequential", "list", "model"])
def test_a_generator_that_cannot_be_replayed_is_refused(kind: str) -> None:
    torch.manual_seed(0)
    blocks = [HiddenNoise(), HiddenNoise(), HiddenNoise(), nn.Linear(WIDTH, 1)]
    model = {
        "sequential": nn.Sequential(*blocks),
        "list": blocks,
        "model": HiddenNoiseModel(),
    }[kind]
    with pytest.raises(offremat.UnreplayableRandomnessError, match="attribute of the module"):
        offremat.optimize(model, torch.randn(ROWS, WIDTH), budget=0.95)


class HostRandomScale(nn.Module):
    """Scales its input by a draw of Python's random and of NumPy's global generator."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        import random

        scale = (0.5 if random.random() < 0.5 else 1.0) * (1.0 + float(np.random.rand()))
        return torch.tanh(self.linear(x * scale))


@pytest.mark.parametrize("solver", ["checkpoint-every-stage", "dp"])
def test_python_and_numpy_random_draws_are_replayed_on_recomputation(solver: str) -> None:
    # Same number of saved tensors whichever way the draw goes: only replaying the draw
    # keeps the recomputation equal to the forward (the gradients differed by 0.02 before).
    import random

    torch.manual_seed(0)
    model = nn.Sequential(*[HostRandomScale() for _ in range(4)], nn.Linear(WIDTH, 1))
    reference = copy.deepcopy(model)
    x = torch.randn(ROWS, WIDTH)
    random.seed(0)
    np.random.seed(0)
    om = offremat.optimize(model, x, budget=0.75 if solver == "dp" else 1.0, solver=solver)
    assert "recompute" in om.plan.decisions.values()
    for step in range(3):
        random.seed(step)
        np.random.seed(step)
        om(x).pow(2).mean().backward()
        after = (random.getstate(), np.random.get_state()[1].copy())
        random.seed(step)
        np.random.seed(step)
        reference(x).pow(2).mean().backward()
        assert after[0] == random.getstate()  # as many draws as plain autograd's
        assert np.array_equal(after[1], np.random.get_state()[1])
        for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(ours.grad, theirs.grad), step


class CachedNormalScale(nn.Module):
    """Scales by one draw of NumPy's legacy normal: every other draw is the cached one, which
    moves no word of the Mersenne Twister."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.linear(x) * (1.0 + 0.1 * float(np.random.standard_normal())))


def train_like_plain_autograd(model: nn.Module, om: nn.Module, x: torch.Tensor) -> None:
    """One step of ``om`` and of plain autograd on a copy of ``model``, from the same host
    states: equal gradients, and the host generators left in the same states."""
    reference = copy.deepcopy(model)
    start = host_random_state()
    om(x).pow(2).mean().backward()
    after = host_random_state()
    random.setstate(start[0])
    np.random.set_state(start[1])
    reference(x).pow(2).mean().backward()
    assert same_host_state(after, host_random_state())  # as many draws as plain autograd's
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)
        ours.grad = None


@pytest.mark.parametrize("solver", ["checkpoint-every-stage", "dp"])
def test_numpys_cached_normal_is_replayed_on_recomputation(solver: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[CachedNormalScale() for _ in range(5)], nn.Linear(WIDTH, 1))
    x = torch.randn(ROWS, WIDTH)
    np.random.seed(0)
    om = offremat.optimize(model, x, budget=0.75 if solver == "dp" else "1GiB", solver=solver)
    assert "recompute" in om.plan.decisions.values()
    for seed in range(2):  # each stage in turn draws a pair or takes the cached normal
        np.random.seed(seed)
        np.random.standard_normal(seed)
        train_like_plain_autograd(model, om, x)


@pytest.fixture
def pcg64_global_generator():
    """NumPy's global generator over PCG64 rather than a Mersenne Twister, for one test."""
    before = np.random.get_bit_generator()
    np.random.set_bit_generator(np.random.PCG64(0))
    yield
    np.random.set_bit_generator(before)


def test_draws_from_another_numpy_bit_generator_are_replayed(pcg64_global_generator) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[HostRandomScale() for _ in range(4)], nn.Linear(WIDTH, 1))
    x = torch.randn(ROWS, WIDTH)
    om = offremat.optimize(model, x, budget=0.75, solver="dp")
    assert "recompute" in om.plan.decisions.values()
    train_like_plain_autograd(model, om, x)


def test_the_host_reader_reads_what_a_full_read_reads() -> None:
    # What a stage may do to the host generators between two reads of a step.
    draws = [
        lambda: random.random(),
        lambda: random.gauss(0.0, 1.0),
        lambda: np.random.rand(),
        lambda: np.random.standard_normal(),
        lambda: np.random.standard_normal(3),
        lambda: np.random.seed(1),
        lambda: None,
    ]
    rng = random.Random(0)
    random.seed(0)
    np.random.seed(0)
    reader = HostRandomReader()
    for _ in range(300):
        rng.choice(draws)()
        assert same_host_state(reader.read(), host_random_state())


class ForkedNoise(nn.Module):
    """Draws noise inside torch.random.fork_rng: the global state is as it was after it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        with torch.random.fork_rng(devices=[]):
            noise = torch.randn_like(x)
        return torch.tanh(self.linear(x) + noise)


class Noise(nn.Module):
    """Moves the global state between the blocks that fork it."""

    def forward(self, x):
        return x + torch.randn_like(x)


def test_draws_inside_fork_rng_are_replayed_on_recomputation() -> None:
    # The state looked unchanged after the first forward, so it was not replayed: the
    # recomputation drew from another state (gradients differed, silently).
    torch.manual_seed(0)
    blocks = [ForkedNoise(), Noise(), ForkedNoise(), Noise(), ForkedNoise(), nn.Linear(WIDTH, 1)]
    model = nn.Sequential(*blocks)
    reference = copy.deepcopy(model)
    x = torch.randn(ROWS, WIDTH)
    om = offremat.optimize(model, x, budget="1GiB", solver="checkpoint-every-stage")
    torch.manual_seed(1)
    om(x).pow(2).mean().backward()
    torch.manual_seed(1)
    reference(x).pow(2).mean().backward()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)
