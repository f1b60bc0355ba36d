"""The chain as one autograd function, through which a step's forward and backward run
(:class:`PlanFunction`), and the refusals of what its backward cannot do."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

from offremat._step import _Step


class PlanFunction(torch.autograd.Function):
    """The chain as one autograd function: forward and backward follow the plan.

    Design note, what the caller asked for. ``loss.backward()`` runs every node of the graph,
    so B(i) accumulates parameter gradients into ``.grad`` as plain autograd does.
    ``torch.autograd.grad(loss, x)`` and ``backward(inputs=[x])`` run only the nodes on the way
    to ``x``: the engine then does not run the anchor's node, and B(i) computes the gradients
    of the stage inputs alone, leaving ``.grad`` untouched. The parameters are not inputs of
    this function, and nothing of its graph reaches them: an edge to a parameter would make the
    engine run the parameter's accumulation node once more after the plan's backward, with no
    gradient, and run its hooks again (``register_hook`` with None, an optimizer step in
    ``register_post_accumulate_grad_hook`` twice, DDP's readiness hooks twice). So the engine
    sees no use of the parameters outside B(i): ``torch.autograd.grad`` with respect to them
    reports them unused, as for a reentrant checkpoint. ``create_graph=True`` is refused.
    """

    @staticmethod
    def forward(
        ctx: Any,
        step: _Step,
        anchor: torch.Tensor,
        *tensors: torch.Tensor,
    ) -> Any:
        outputs = step.run_forward()
        ctx.step = step
        step.node = weakref.ref(ctx)  # ctx is the step's node in the graph
        ctx.anchor_node = get_gradient_edge(anchor).node
        ctx.set_materialize_grads(False)
        # An output that carries no gradient in plain autograd (a model computed under
        # no_grad) carries none here: its backward raises as plain autograd's does.
        flags = step.flags[step.length]
        ctx.mark_non_differentiable(
            *[o for o, flag in zip(outputs, flags, strict=True) if not flag]
        )
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        step = ctx.step
        if step is None:
            raise RuntimeError(
                getattr(ctx, "ended", None)
                or "backward ran twice through an offremat-optimized model; the plan frees its "
                "activations as it goes, so retain_graph=True is not supported: run the "
                "forward again"
            )
        ctx.step = None
        runs = torch._C._will_engine_execute_node
        accumulate = runs(ctx.anchor_node)
        hooked = step.hooked_parameters()
        if accumulate and hooked:
            # The rest of the graph accumulates into these too: a second run of their hooks.
            outside = [p for p in hooked if runs(get_gradient_edge(p).node)]
            if outside:
                _end(step, "a parameter of the chain with hooks is also used outside it")
                raise RuntimeError(
                    f"a parameter of the chain (shape {tuple(outside[0].shape)}) is also used "
                    "outside it (a weight penalty in the loss, a weight tied to a layer outside "
                    "the chain) and has gradient hooks: its gradient reaches .grad in two parts, "
                    "from the plan's backward and from the rest of the graph, so its hooks "
                    "would run twice. Move that use into the chain, or remove the hooks"
                )
        # Hooks run twice only where this step accumulates (a gradient for the inputs alone
        # runs none).
        sharing = step.steps_sharing(hooked) if accumulate and hooked else []
        if sharing:
            # The backward ends here: the other steps' halves never run either.
            for pending in (step, *sharing):
                _end(pending, "two steps it ran share a parameter with hooks")
            raise RuntimeError(
                f"a parameter of the chain (shape {tuple(hooked[0].shape)}) has gradient hooks "
                "and another step this backward runs also uses it (the model called twice "
                "before one backward, a block shared by two optimized models): each step's "
                "backward accumulates into .grad on its own, so its hooks would run once per "
                "step, each time on part of the gradient. Run one backward per forward, or "
                "remove the hooks (clip gradients after the backward)"
            )
        if any(g is not None and _batched(g) for g in grads):
            _end(step, "it was a batched backward")
            raise RuntimeError(
                "a batched backward (torch.autograd.grad(..., is_grads_batched=True), "
                "torch.autograd.functional.jacobian(..., vectorize=True)) runs under vmap, "
                "which a plan's backward cannot: it holds, moves and frees the storages of its "
                "tensors, and batched tensors have none. Loop over the gradient vectors, or "
                "compute it on a model run without offremat"
            )
        if torch.is_grad_enabled():
            _end(step, "it asked for create_graph=True")
            raise RuntimeError(
                "create_graph=True (higher-order gradients, gradient penalties) is not "
                "supported through an offremat-optimized model: its plan frees activations "
                "as the backward goes. Compute the penalty on a model run without offremat, "
                "after zeroing the gradients: the backward ran through the code after the "
                "blocks before it reached them, so parameters there (a head, a final norm) "
                "already hold their part of this one"
            )
        return (None, None, *step.run_backward(grads, accumulate))


def _end(step: _Step, why: str) -> None:
    """Give back ``step`` with its backward refused (``why``): a later backward through its
    node, the caller's retry without what was refused, says so and to run the forward again."""
    node = None if step.node is None else step.node()
    if node is not None:
        node.step = None
        node.ended = (
            f"a backward through this output was refused ({why}), and its step gave back its "
            "activations then: run the forward again"
        )
    step.abandon()


def _batched(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is batched by vmap: torch.func's, or the older one that
    ``is_grads_batched=True`` runs a backward under."""
    functorch = torch._C._functorch
    return functorch.is_batchedtensor(tensor) or functorch.is_legacy_batchedtensor(tensor)
