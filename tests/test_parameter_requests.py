"""The caller's backward asking for a parameter of the chain (``backward(inputs=[p])``,
``torch.autograd.grad(loss, p)``): plain autograd gives that parameter its gradient alone.
The plan's backward accumulates into every parameter's ``.grad`` or into none, so such a
backward is refused with what to do, never run as if the parameter had no gradient. Oracle:
plain autograd on a copy."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import offremat
from solvers.baselines import keep_all

WIDTH = 64
ROWS = 256
ASKED = "asked for the gradient of a parameter"


def setup(solver: str, budget: float = 1.0):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(6)])
    reference = copy.deepcopy(model)
    x = torch.randn(ROWS, WIDTH)
    om = offremat.optimize(model, x, budget=budget, solver=solver, bandwidth=1e9)
    return model, reference, om, x


PLANS = [("dp", 0.8), ("checkpoint-every-stage", 1.0), ("offload-all", 1.0)]


def _same_grads(model: nn.Module, reference: nn.Module) -> bool:
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    for a, b in pairs:
        if (a.grad is None) != (b.grad is None):
            return False
        if a.grad is not None and not torch.equal(a.grad, b.grad):
            return False
    return True


@pytest.mark.parametrize(("solver", "budget"), PLANS)
def test_a_backward_asking_for_a_parameter_is_refused_and_the_next_step_is_plain(
    solver: str, budget: float
) -> None:
    model, reference, om, x = setup(solver, budget)
    assert om.plan.ops != keep_all(om.chain).ops  # the plan's executor, not plain autograd
    p = model[2][0].weight
    xr = x.clone().requires_grad_()
    asks = [
        lambda: om(x).sum().backward(inputs=[p]),
        lambda: torch.autograd.grad(om(x).sum(), [p]),
        lambda: torch.autograd.grad(om(x).sum(), [p], allow_unused=True),
        lambda: om(xr).sum().backward(inputs=[p, xr]),
        lambda: torch.autograd.grad(om(xr).sum(), [xr, p]),
    ]
    for ask in asks:
        with pytest.raises(RuntimeError, match=ASKED):
            ask()
    # Nothing was accumulated (plain autograd would have filled p.grad) ...
    assert all(q.grad is None for q in model.parameters()) and xr.grad is None
    # ... and the refused steps left nothing behind: the next one is plain autograd's.
    om(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    assert _same_grads(model, reference)


def test_asking_for_the_input_alone_still_leaves_parameters_alone() -> None:
    """Adversarial training: the gradient of the input, with .grad untouched."""
    model, reference, om, x = setup("dp", 0.8)
    xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    om(xr).pow(2).mean().backward(inputs=[xr])
    reference(xs).pow(2).mean().backward(inputs=[xs])
    assert torch.equal(xr.grad, xs.grad)
    (mine,) = torch.autograd.grad(om(xr).pow(2).mean(), xr)
    (theirs,) = torch.autograd.grad(reference(xs).pow(2).mean(), xs)
    assert torch.equal(mine, theirs)
    assert all(p.grad is None for p in model.parameters())


def test_a_keep_all_plan_gives_the_parameter_its_gradient_as_plain_autograd() -> None:
    """A keep-all plan runs as plain autograd, where asking for a parameter works."""
    model, reference, om, x = setup("keep-all")
    om(x).sum().backward(inputs=[model[2][0].weight])
    reference(x).sum().backward(inputs=[reference[2][0].weight])
    assert _same_grads(model, reference)


def test_a_gradient_hook_registered_between_forward_and_backward_is_refused() -> None:
    """The engine would run it once more after the plan's backward, with no gradient; one
    registered before the forward runs once with the gradient, as in plain autograd."""
    model, reference, om, x = setup("dp", 0.8)
    seen: list[torch.Tensor | None] = []
    loss = om(x).pow(2).mean()
    handle = model[1][0].bias.register_hook(seen.append)
    with pytest.raises(RuntimeError, match="between the forward and the backward"):
        loss.backward()
    assert seen == []
    handle.remove()
    for module in (model, reference):
        module[1][0].bias.register_hook(seen.append)
    om(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])
    assert _same_grads(model, reference)


def test_ddp_ignores_the_extra_call_of_its_readiness_hooks(tmp_path) -> None:
    """DDP's hooks sit on the parameters' accumulation nodes, which the edges call once more
    after the plan's backward, with no gradient: its gradients are plain DDP's."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        model, reference, om, x = setup("dp", 0.8)
        mine, theirs = DistributedDataParallel(om), DistributedDataParallel(reference)
        for _ in range(2):
            mine(x).pow(2).mean().backward()
            theirs(x).pow(2).mean().backward()
        assert _same_grads(model, reference)
    finally:
        dist.destroy_process_group()
