"""Parameters that several stages use: their gradient reaches ``.grad`` once, as in plain
autograd.

Design note. Each B(i) is its own engine call, so a parameter that one stage uses is
accumulated into ``.grad`` there, once, and its hooks run once: plain autograd's behaviour. A
parameter that several stages use (a block used twice, weights tied between stages) would be
accumulated once per stage: its hooks would run once per stage on that stage's part, and into
a ``.grad`` that already holds G (gradient accumulation) the parts would be added one by one,
((G + g_j) + g_i), where plain autograd adds their sum, G + (g_j + g_i): equal up to rounding
only. So around B(i) :class:`SharedGradients` sets such a parameter's ``.grad`` and its hooks
aside, takes what B(i) accumulated as stage i's part and adds it to the parameter's running
sum (later stages first, the order in which plain autograd's buffer adds them). After the
backward of the last stage that uses the parameter, the sum goes to the parameter's
accumulation node in one engine call: it is added to ``.grad`` and the hooks run once, on the
whole gradient. Hooks registered on the accumulation node itself, rather than on the
parameter, cannot be set aside and still run once per stage.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch.autograd.graph import get_gradient_edge


class SharedGradients:
    """The running gradient sums of the parameters that more than one stage uses."""

    def __init__(self, stage_parameters: Sequence[Sequence[torch.Tensor]]):
        users: dict[int, list[int]] = {}
        for i, parameters in enumerate(stage_parameters, 1):
            for parameter in {id(p): p for p in parameters}.values():
                users.setdefault(id(parameter), []).append(i)
        shared = {key for key, stages in users.items() if len(stages) > 1}
        # Stage i's shared parameters, and those whose last backward (lowest stage) is B(i).
        self.used_by: dict[int, list[torch.Tensor]] = {}
        self.last_in: dict[int, list[torch.Tensor]] = {}
        for i, parameters in enumerate(stage_parameters, 1):
            for parameter in {id(p): p for p in parameters}.values():
                if id(parameter) in shared:
                    self.used_by.setdefault(i, []).append(parameter)
                    if min(users[id(parameter)]) == i:
                        self.last_in.setdefault(i, []).append(parameter)
        self.sums: dict[int, torch.Tensor] = {}

    @contextmanager
    def backward_of(self, i: int) -> Iterator[None]:
        """Run B(i) inside: its parts of the shared parameters' gradients are kept aside."""
        parameters = self.used_by.get(i, [])
        aside = [(p, p.grad, _set_hooks_aside(p)) for p in parameters]
        for parameter in parameters:
            parameter.grad = None
        try:
            yield
        finally:
            for parameter, grad, hooks in aside:
                part, parameter.grad = parameter.grad, grad
                for hook_dict, items in hooks:
                    hook_dict.update(items)
                if part is not None:
                    key = id(parameter)
                    self.sums[key] = part if key not in self.sums else self.sums[key] + part

    def accumulate_after(self, i: int) -> None:
        """After B(i): the sums of the parameters no later backward uses go to ``.grad``."""
        due = [(p, self.sums.pop(id(p))) for p in self.last_in.get(i, []) if id(p) in self.sums]
        if due:
            torch.autograd.backward(
                [get_gradient_edge(p) for p, _ in due], [total for _, total in due]
            )


def _set_hooks_aside(parameter: torch.Tensor) -> list[tuple[dict, list]]:
    """Empty the parameter's hook dictionaries in place (autograd holds them), for restoring."""
    aside = []
    for hook_dict in (parameter._backward_hooks, parameter._post_accumulate_grad_hooks):
        if hook_dict:
            aside.append((hook_dict, list(hook_dict.items())))
            hook_dict.clear()
    return aside
