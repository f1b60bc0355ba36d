"""Parameters that several stages use: their gradient reaches ``.grad`` once, as in plain
autograd.

Design note. Each B(i) is its own engine call, so a parameter that one stage uses is
accumulated into ``.grad`` there, once, and its hooks run once: plain autograd's behaviour. A
parameter that several stages use (a block used twice, weights tied between stages) would be
accumulated once per stage: its hooks would run once per stage on that stage's part, and into
a ``.grad`` that already holds G (gradient accumulation) the parts would be added one by one,
((G + g_j) + g_i), where plain autograd adds their sum, G + (g_j + g_i): equal up to rounding
only. So the running sum of the parts goes into each B(i) as one more root of its engine call,
at the parameter's gradient edge: the engine's graph root runs first, so the sum enters the
parameter's input buffer before the stage's parts, and the parts are added to it in the order
in which plain autograd's buffer adds them (a parameter used twice in one stage included).
Before the last stage that uses the parameter, ``.grad`` and the parameter's hooks are set
aside for the call, and what the accumulation node leaves in ``.grad`` is the new running sum;
in the last one they stay, and the node adds the whole sum to ``.grad`` and runs the hooks
once. Hooks registered on the accumulation node itself, rather than on the parameter, cannot
be set aside and still run once per stage.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge


def shared_gradient_bytes(
    stage_parameters: Sequence[Sequence[torch.Tensor]],
) -> tuple[int, list[int]]:
    """The bytes of the running sums :class:`SharedGradients` holds, and per stage those of
    the sums its backward adds its part to.

    The sum of a trainable parameter that several stages use exists from the backward of the
    last such stage to that of the first; each earlier stage's backward adds its part to it
    out of place (the step still holds the old sum), so it holds one more such gradient."""
    held, added = 0, [0] * len(stage_parameters)
    for parameter, stages in parameter_users(stage_parameters).values():
        if len(stages) > 1:
            held += parameter.numel() * parameter.element_size()
        for i in stages[:-1]:
            added[i - 1] += parameter.numel() * parameter.element_size()
    return held, added


def refuse_shared_sparse_gradients(
    stage_names: Sequence[str], stages: Sequence[nn.Module], seen: Sequence[frozenset[int]]
) -> None:
    """Refuse a parameter that several stages use and whose gradient is sparse in one of
    them: an ``nn.Embedding`` or ``nn.EmbeddingBag`` with ``sparse=True``, or one whose
    profiled gradient was sparse (``seen``: per stage, the parameters' ids).

    Its running sum keeps every part's indices and values, or adds values where torch finds
    the same indices, so its size follows the ids' values, which no plan made on one batch
    bounds: counted at the table's size, a table every block shared measured 1.52 times the
    budget; sized on the profiled batch, 2.31 times on a batch of the same shapes whose
    blocks looked up other rows, and 4.80 times where the profiled batch was mostly padding
    (reviews 38 and 39)."""
    sparse = [
        seen_here
        | {
            id(module.weight)
            for module in stage.modules()
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse
        }
        for stage, seen_here in zip(stages, seen, strict=True)
    ]
    parameters = [list(stage.parameters()) for stage in stages]
    for key, (parameter, used) in parameter_users(parameters).items():
        if len(used) > 1 and any(key in sparse[i - 1] for i in used):
            names = ", ".join(repr(stage_names[i - 1]) for i in used)
            raise ValueError(
                f"stages {names} all use one parameter (shape {tuple(parameter.shape)}) "
                "whose gradient is sparse (an nn.Embedding or nn.EmbeddingBag with "
                "sparse=True): its gradient's running sum grows with the ids each batch "
                "looks up, which no plan can bound. Give it sparse=False, look it up once "
                "before the blocks and pass the result to them, or train this model with "
                "plain autograd"
            )


def parameter_users(
    stage_parameters: Sequence[Sequence[torch.Tensor]],
) -> dict[int, tuple[torch.Tensor, list[int]]]:
    """Each trainable parameter, by id, with the stages (1-based, in order) that use it."""
    users: dict[int, tuple[torch.Tensor, list[int]]] = {}
    for i, parameters in enumerate(stage_parameters, 1):
        for parameter in parameters:
            if parameter.requires_grad:
                users.setdefault(id(parameter), (parameter, []))[1].append(i)
    return users


class SharedGradients:
    """The running gradient sums of the parameters that more than one stage uses."""

    def __init__(self, stage_parameters: Sequence[Sequence[torch.Tensor]]):
        users = parameter_users(stage_parameters)
        # Stage i's shared parameters, each with whether B(i) is the last backward to use it.
        self.used_by: dict[int, list[tuple[torch.Tensor, bool]]] = {}
        if any(len(stages) > 1 for _, stages in users.values()):
            for i, parameters in enumerate(stage_parameters, 1):
                for parameter in parameters:
                    _, stages = users[id(parameter)]
                    if len(stages) > 1:
                        entry = (parameter, min(stages) == i)
                        self.used_by.setdefault(i, []).append(entry)
        self.sums: dict[int, torch.Tensor] = {}

    def backward(self, i: int, roots: list[GradientEdge], grads: list[torch.Tensor]) -> None:
        """B(i): ``torch.autograd.backward(roots, grads)``, its shared parameters as above."""
        shared = self.used_by.get(i, [])
        if not shared:
            if roots:
                torch.autograd.backward(roots, grads)
            return
        extra: list[tuple[torch.Tensor, torch.Tensor]] = []
        aside = []
        for parameter, last in shared:
            total = self.sums.pop(id(parameter), None)
            if not roots and not last:
                if total is not None:
                    self.sums[id(parameter)] = total  # nothing to add in this stage
                continue
            if total is not None:
                extra.append((parameter, total))
            if not last:
                aside.append((parameter, parameter.grad, _set_hooks_aside(parameter)))
                parameter.grad = None
        try:
            if roots or extra:
                torch.autograd.backward(
                    [*roots, *(get_gradient_edge(p) for p, _ in extra)],
                    [*grads, *(total for _, total in extra)],
                )
        finally:
            for parameter, grad, hooks in aside:
                total, parameter.grad = parameter.grad, grad
                for hook_dict, items in hooks:
                    hook_dict.update(items)
                if total is not None:
                    self.sums[id(parameter)] = total


def _set_hooks_aside(parameter: torch.Tensor) -> list[tuple[dict, list]]:
    """Empty the parameter's hook dictionaries in place (autograd holds them), for restoring."""
    aside = []
    for hook_dict in (parameter._backward_hooks, parameter._post_accumulate_grad_hooks):
        if hook_dict:
            aside.append((hook_dict, list(hook_dict.items())))
            hook_dict.clear()
    return aside
