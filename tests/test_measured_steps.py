"""A measured step trains as an unmeasured one: the measurement's own hooks on the parameters
are not the caller's, and go with the step, however it ends.

A review found that the hooks a measured step puts on the parameters whose .grad is None (to
leave their gradients out of the peak) were taken for the caller's: a weight penalty in the
loss, or a model called twice before one backward, was refused at every measured step, and
so at every step (an abandoned check stays due). A step dropped before its backward, or whose
backward failed, left its hooks on the parameters for good. Oracles: plain autograd's
gradients, and the parameters' own hook tables.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

import offremat


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 32)) for _ in range(6)]
    )


X, X2 = torch.randn(64, 32), torch.randn(64, 32)


def _loss(forward, model: nn.Module, case: str) -> torch.Tensor:
    if case == "penalty":
        penalty = sum(p.square().sum() for p in model.parameters())
        return forward(X).square().mean() + 1e-4 * penalty
    return (forward(X) - forward(X2)).square().mean()  # two calls, one backward


@pytest.mark.parametrize("case", ["penalty", "siamese"])
def test_a_measured_step_with_gradients_set_to_none_trains_as_plain_autograd(case) -> None:
    model = _model()
    reference = copy.deepcopy(model)
    optimized = offremat.optimize(model, X, budget=0.6, measure_memory=True)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        _loss(optimized, model, case).backward()
        _loss(reference, reference, case).backward()
        assert optimized.stats.measured_peak_bytes is not None
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)


def _hooks(model: nn.Module) -> int:
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def test_a_dropped_or_failed_measured_step_leaves_no_hooks() -> None:
    model = _model()
    optimized = offremat.optimize(model, X, budget=0.6, measure_memory=True)
    output = optimized(X)
    assert _hooks(model) > 0  # the measurement's, while the step is pending
    del output
    gc.collect()
    assert _hooks(model) == 0

    def fail(gradient: torch.Tensor) -> torch.Tensor:
        raise ValueError("a hook of the caller's failed")

    handle = model[0][0].weight.register_hook(fail)
    with pytest.raises(ValueError, match="a hook of the caller's failed"):
        optimized(X).sum().backward()
    handle.remove()
    assert _hooks(model) == 0
    assert torch._C._len_torch_dispatch_stack() == 0
    model.zero_grad(set_to_none=True)
    _loss(optimized, model, "penalty").backward()  # the next step trains
    assert optimized.stats.measured_peak_bytes is not None


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Tower(nn.Module):
    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.embedding = embedding
        self.blocks = nn.ModuleList(_Residual() for _ in range(4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids)
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def test_a_refused_backward_settles_every_step_it_ran(caplog) -> None:
    # Two optimized models share an embedding with a hook of the caller's: one backward
    # through both is refused, and the other model's step kept its activations and its
    # measurement's hooks until that model's next forward (a review).
    torch.manual_seed(0)
    embedding = nn.Embedding(50, 32)
    towers = [_Tower(embedding), _Tower(embedding)]
    ids = torch.randint(0, 50, (4, 16))
    first, second = (offremat.optimize(t, ids, budget=0.6, measure_memory=True) for t in towers)
    handle = embedding.weight.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(RuntimeError, match="another step this backward runs also uses it"):
        (first(ids) + second(ids)).backward()
    handle.remove()
    gc.collect()
    assert sum(_hooks(t) for t in towers) == 0
    with caplog.at_level("WARNING", logger="offremat"):
        (first(ids) + second(ids)).backward()  # no hook now: trains
    assert "still waits for its backward" not in caplog.text


def test_a_step_given_back_by_a_refused_backward_says_so_when_run_again() -> None:
    # A backward through both towers is refused, and gives back both steps: a backward of
    # one tower's output alone then failed with a bare KeyError from inside the executor,
    # and a retry of the refused one said retain_graph=True is not supported (a review).
    torch.manual_seed(0)
    embedding = nn.Embedding(50, 32)
    towers = [_Tower(embedding), _Tower(embedding)]
    ids = torch.randint(0, 50, (4, 16))
    first, second = (offremat.optimize(t, ids, budget=0.6) for t in towers)
    handle = embedding.weight.register_post_accumulate_grad_hook(lambda p: None)
    out1, out2 = first(ids), second(ids)
    with pytest.raises(RuntimeError, match="another step this backward runs also uses it"):
        (out1 + out2).backward()
    handle.remove()
    said = []
    for out in (out1, out2):  # the one whose graph ran before the refusal: torch's own error
        with pytest.raises(RuntimeError, match=r"was refused|through the graph a second") as caught:
            out.backward()
        said.append(str(caught.value))
    assert any("was refused (two steps it ran share a parameter" in text for text in said)


def test_input_gradients_of_a_model_called_twice_run_no_hooks_and_are_not_refused() -> None:
    # Adversarial training's gradients for the inputs make no parameter gradient, so no
    # hook runs in plain autograd: a parameter's hook refused them as if it would run twice
    # (a review).
    torch.manual_seed(0)
    model = nn.Sequential(*(_Residual() for _ in range(6)))
    plain = copy.deepcopy(model)
    a, b = torch.randn(8, 32), torch.randn(8, 32)
    om = offremat.optimize(model, a, budget=0.6)
    calls: list[int] = []
    for m in (model, plain):
        m[2].up.weight.register_post_accumulate_grad_hook(lambda p: calls.append(1))

    def input_gradients(f: nn.Module) -> tuple[torch.Tensor, ...]:
        x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
        return torch.autograd.grad((f(x) - f(y)).square().mean(), [x, y])

    expected = input_gradients(plain)
    got = input_gradients(om)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert not calls and all(p.grad is None for p in model.parameters())
