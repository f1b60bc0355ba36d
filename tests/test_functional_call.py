"""Weights given per call (``torch.func.functional_call``: per-example weights, a fast-weight
step): a recomputation runs after the call has put the module's own parameters back, and must
still compute with the weights the forward used. Oracle: plain autograd on a copy."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

import offremat


class Block(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.inner = nn.Linear(width, 2 * width)
        self.outer = nn.Linear(2 * width, width)
        self.register_buffer("scale", torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(torch.tanh(self.inner(x))) * self.scale


class Loss(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.square().mean()


def models() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(6)], Loss())
    return model, copy.deepcopy(model), torch.randn(64, 32)


def weights(model: nn.Module, make) -> dict[str, torch.Tensor]:
    """``make`` applied to each parameter, and the buffers doubled (they are swapped too)."""
    given = {name: make(p) for name, p in model.named_parameters()}
    given.update({name: b * 2 for name, b in model.named_buffers()})
    return given


@pytest.mark.parametrize("kind", ["leaves", "computed"])
def test_given_weights_get_plain_autograds_gradients(kind) -> None:
    """Leaves (per-example weights) or weights computed elementwise from the parameters: the
    gradients reach what plain autograd reaches, bit for bit, with the stages recomputed."""
    model, reference, x = models()
    om = offremat.optimize(model, x, budget=0.5)
    assert "recompute" in om.plan.decisions.values()
    grads = []
    for net, call in [(reference, reference), (model, om)]:
        torch.manual_seed(1)
        if kind == "leaves":
            given = weights(
                net, lambda p: (p.detach() + 0.01 * torch.randn_like(p)).requires_grad_()
            )
        else:
            given = weights(net, lambda p: p * 0.5 + 0.01)
        functional_call(call, given, (x,)).backward()
        leaves = [t for t in given.values() if t.requires_grad] if kind == "leaves" else []
        grads.append([t.grad for t in [*leaves, *net.parameters()]])
    for ours, theirs in zip(*grads, strict=True):
        assert (ours is None and theirs is None) or torch.equal(ours, theirs)
    if kind == "leaves":  # the module's own parameters were not used
        assert all(p.grad is None for p in model.parameters())


def test_weights_from_an_inner_gradient_step_are_refused_clearly() -> None:
    """MAML: the weights come from one graph that every stage's backward would run again."""
    model, _, x = models()
    om = offremat.optimize(model, x, budget=0.5)
    params = dict(model.named_parameters())
    inner = torch.autograd.grad(model(x * 2), list(params.values()), create_graph=True)
    fast = {name: p - 0.1 * g for (name, p), g in zip(params.items(), inner, strict=True)}
    with pytest.raises(RuntimeError, match="functional_call with weights from an inner"):
        functional_call(om, fast, (x,)).backward()
