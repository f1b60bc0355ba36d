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
from torch.autograd.graph import GradientEdge, get_gradient_edge

from offremat._tensors import storage_bytes
from offremat.measure import StepMemory


def shared_gradient_bytes(
    stage_parameters: Sequence[Sequence[torch.Tensor]],
    sparse: dict[int, int] | None = None,
) -> tuple[int, list[int]]:
    """The bytes of the running sums :class:`SharedGradients` holds, and per stage those of
    the sums its backward adds its part to.

    The sum of a trainable parameter that several stages use exists from the backward of the
    last such stage to that of the first; each earlier stage's backward adds its part to it
    out of place (the step still holds the old sum), so it holds one more such gradient: the
    parameter's size. A sparse sum's size is the lookups' (``sparse``, by parameter id, as
    :func:`sparse_sums` measures it), held at its largest."""
    held, added = 0, [0] * len(stage_parameters)
    for key, (parameter, stages) in parameter_users(stage_parameters).items():
        if len(stages) == 1:
            continue
        if sparse is not None and key in sparse:
            held += sparse[key]  # its parts are made and freed within their stages' backward
            continue
        size = parameter.numel() * parameter.element_size()
        held += size
        for i in stages[:-1]:
            added[i - 1] += size
    return held, added


def sparse_sums(
    stage_parameters: Sequence[Sequence[torch.Tensor]],
    parts: Sequence[dict[int, torch.Tensor]],
) -> dict[int, int]:
    """By id of each parameter that several stages use and whose gradient is sparse (an
    ``nn.Embedding(sparse=True)``), the most bytes its running sum holds, while a stage's
    backward adds its part and while the last one adds the sum to a ``.grad`` that exists
    included (``parts``: per stage, the sparse gradient its profile made).

    A sparse sum keeps every part's indices and values, or adds values where torch finds the
    same indices, so its sizes are the lookups': replayed here as a step adds them, out of
    place beside the old sum, each addition's peak measured (:class:`StepMemory`). Counted at
    the parameter's dense size instead, an embedding that 6 blocks shared measured 1.52 times
    its budget (a review). A stage whose part is missing (added to a ``.grad`` that existed)
    adds the last part seen again."""
    found: dict[int, int] = {}
    for key, (parameter, stages) in parameter_users(stage_parameters).items():
        made = [parts[i - 1].get(key) for i in stages]
        if len(stages) == 1 or all(part is None for part in made):
            continue
        total: torch.Tensor | None = None
        seen: torch.Tensor | None = None
        old = most = 0  # the sum before the last addition, which the step holds through it
        with torch.no_grad():
            for part in reversed(made):
                seen = part if part is not None else seen
                if seen is None:
                    continue
                if total is None:
                    total = seen
                    continue
                with StepMemory(seen.device) as adding:
                    added = total + seen
                # The old sum, the part and the new sum live at once.
                old = storage_bytes([total])
                most = max(most, old + storage_bytes([seen]) + adding.step_peak_bytes)
                total = added
            if total is None:
                continue
            dense = torch.zeros_like(parameter)
            with StepMemory(total.device) as accumulating:
                dense.add_(total)
            most = max(most, old + storage_bytes([total]) + accumulating.step_peak_bytes)
        found[key] = most
    return found


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
