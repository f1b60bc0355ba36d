"""The code around a model's chain, measured: a step with the chain replaced by its output.

The design notes of :mod:`offremat._model_chain` say what the measured bytes stand for. The
step runs under the independent tracker (:mod:`offremat.measure`), the chain's blocks replaced
by their output on the example (:class:`_Boundary`, which marks where the end code's backward
turns to the chain); the parameters of the code around the chain have gradients as after a
first step, and the caller's own are left alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from offremat._attribute_walk import leaves, map_leaves
from offremat._blocks import NotAChainError, untouched
from offremat._discover import BlockRun, Call, as_call
from offremat._run import RunInterception
from offremat._tensors import flatten, is_differentiable, storage_bytes
from offremat.measure import StepMemory, tree_leaf_tensors


@dataclass(frozen=True)
class Outside:
    """What the code around the chain holds, in bytes (see :mod:`offremat._model_chain`)."""

    resident_bytes: int
    setup_transient_bytes: int
    end_peak_bytes: int
    held_bytes: int
    setup_backward_bytes: int
    # The model's output tensors on the example (0 in a chain cached before they were kept):
    # all of them, predictions sized by the labels beside a loss the only sign of a head on
    # the masked tokens (counting those with a gradient alone left one at 1.6 times the
    # budget unsaid, a review).
    output_bytes: int = 0


def run_stages(stages: Sequence[nn.Module], value: Any) -> Any:
    """The chain's value after ``stages`` run on ``value`` one after the other."""
    for stage in stages:
        value = stage(value)
    return value


class _Boundary(torch.autograd.Function):
    """The chain replaced by its output on the example: marks the end code's last backward.

    Its gradients for the chain input, the first block's and the side inputs made by the code
    before the chain (a gate per group of blocks), are expanded zeros, which allocate nothing:
    the backward of the code that made them then runs as in a step, where it was left out
    (1.08 times the budget, a hunt).
    """

    @staticmethod
    def forward(
        ctx: Any, probe: _OutsideProbe, last: torch.Tensor, *inputs: torch.Tensor
    ) -> torch.Tensor:
        ctx.probe = probe
        ctx.inputs = [(t.shape, t.dtype, t.device) for t in inputs]
        # Not a view of ``last``: the code after the chain may change it in place (a DenseNet
        # applies F.relu(..., inplace=True) to the last block's output), which autograd forbids
        # on a view a custom function returns.
        return last.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ctx.probe.turned(grad)
        zeros = [torch.zeros((), dtype=d, device=v).expand(s) for s, d, v in ctx.inputs]
        return None, None, *zeros


class _OutsideProbe:
    """Marks the memory at the chain's start and at the end code's last backward op."""

    def __init__(self, memory: StepMemory, last: torch.Tensor):
        self.memory = memory
        self.last = last
        self.start_bytes = 0
        self.setup_peak_bytes = 0
        self.end_peak_bytes = 0
        self.turn_bytes = 0
        self.value: Any = None

    def started(self, value: Any) -> Any:
        self.start_bytes = self.memory.live_bytes
        self.setup_peak_bytes = self.memory.peak_so_far_bytes
        self.memory.reset_peak()
        # The executor holds a_0 until B(1), so the measured step must too.
        self.value = value
        hidden, *side = value
        made = [t for t in flatten(side)[0] if t.requires_grad and t.grad_fn is not None]
        return (_Boundary.apply(self, self.last, hidden, *made), *side)

    def turned(self, grad: torch.Tensor) -> None:
        self.end_peak_bytes = self.memory.peak_so_far_bytes
        self.turn_bytes = self.memory.live_bytes
        self.memory.reset_peak()


@contextmanager
def _gradients_dropped(parameters: Sequence[torch.Tensor]) -> Iterator[None]:
    """Gradients exist as after a first step, for the code around the chain alone: each part
    is added to one there and freed. Dropping each once accumulated frees it as that does,
    without making those gradients a second time beside the caller's, which optimize's runs
    set aside (a new shape is profiled in its step, on its budget)."""
    handles = [p.register_post_accumulate_grad_hook(_drop_grad) for p in parameters]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _drop_grad(parameter: torch.Tensor) -> None:
    parameter.grad = None


def measure_outside(
    model: nn.Module,
    batch: Any,
    run: BlockRun,
    blocks: Sequence[nn.Module],
    example_input: Any,
    device: torch.device,
) -> Outside:
    """Run a step of ``model`` on ``batch`` with the chain ``run`` of ``blocks`` replaced by
    its output on ``example_input``, and measure the code around it."""
    batch_tensors = tree_leaf_tensors(batch)
    chained = {id(p) for block in blocks for p in block.parameters()}
    with untouched([model], device):
        last = _last_output(blocks, example_input)
        # As the chain's own output would, whether or not its input carries a gradient.
        last.requires_grad_(is_differentiable(last))
        # The caller's tensors cut from the graphs they came from: this backward must neither
        # run nor free them (a batch computed by the caller's own embedding, say).
        call = as_call(batch)
        cut = Call(tree_map(_cut, call.args), tree_map(_cut, call.kwargs))
        outside = [p for p in model.parameters() if p.requires_grad and id(p) not in chained]
        with _gradients_dropped(outside), StepMemory(device, allocator=False) as memory:
            probe = _OutsideProbe(memory, last)
            with RunInterception(run, probe.started, check_state=False):
                output = model(*cut.args, **cut.kwargs)
            output_bytes = storage_bytes(tree_leaf_tensors(output))
            roots, seeds = _seed(output)
            torch.autograd.backward(roots, seeds)
            del roots, seeds, output
            setup_backward = memory.peak_so_far_bytes - probe.turn_bytes
            probe.value = None
    start = probe.start_bytes
    # The executor's backward keeps the incoming δ_L to its end, as the caller's output.
    held = max(probe.turn_bytes - start, 0)
    return Outside(
        resident_bytes=start + storage_bytes(batch_tensors),
        setup_transient_bytes=max(probe.setup_peak_bytes - start, 0),
        end_peak_bytes=max(probe.end_peak_bytes - start, 0),
        held_bytes=held,
        setup_backward_bytes=max(setup_backward, 0),
        output_bytes=output_bytes,
    )


def _last_output(blocks: Sequence[nn.Module], value: Any) -> torch.Tensor:
    """The chain's output on ``value``, for the code after it: run under no_grad, unless the
    blocks keep tensors as attributes (an attention map that a loss term reads after the
    loop). Those then carry their graph in a step, so the code after the chain saves tensors
    for its backward: the blocks run with gradients, one at a time, and each attribute is cut
    from its block's graph as a leaf of its own, where the measured backward stops."""
    before = _tensor_attributes(blocks)
    with torch.no_grad():
        last = run_stages(blocks, value)[0]
    after = _tensor_attributes(blocks)
    if after.keys() == before.keys() and all(
        len(after[k]) == len(before[k])
        and all(a is b for a, b in zip(after[k], before[k], strict=True))
        for k in after
    ):
        return last
    del last, after
    for block in blocks:
        # Each block's input a leaf that needs a gradient, as its input in a step does.
        hidden = value[0].detach()
        with torch.enable_grad():
            value = block((hidden.requires_grad_(is_differentiable(hidden)), *value[1:]))
        value = (value[0].detach(), *value[1:])
        for (module, name), tensors in _tensor_attributes([block]).items():
            if any(tensor.grad_fn is not None for tensor in tensors):
                module.__dict__[name] = map_leaves(_cut, module.__dict__[name])
    return value[0]


# A module's own tables of parameters, buffers and submodules: not plain attributes.
_MODULE_TABLES = frozenset({"_parameters", "_buffers", "_modules"})


def _tensor_attributes(
    blocks: Sequence[nn.Module],
) -> dict[tuple[nn.Module, str], list[torch.Tensor]]:
    """The tensors the blocks' modules hold as plain attributes (not parameters or buffers),
    alone or inside lists, tuples and dicts (one that holds itself walked once), by
    attribute."""
    found = {}
    for block in blocks:
        for module in block.modules():
            for name, attribute in vars(module).items():
                if name in _MODULE_TABLES:
                    continue
                tensors = [t for t in leaves(attribute) if isinstance(t, torch.Tensor)]
                if tensors:
                    found[(module, name)] = tensors
    return found


def _cut(value: Any) -> Any:
    """A tensor that needs a gradient as a leaf of its own: the gradient goes to the copy."""
    if isinstance(value, torch.Tensor) and value.requires_grad:
        return value.detach().requires_grad_()
    return value


def _seed(output: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What the caller calls ``backward`` on: the output's ``loss``, else every output."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return [loss], [torch.ones_like(loss)]
    roots = [t for t in flatten(output)[0] if t.requires_grad and is_differentiable(t)]
    if not roots:
        raise NotAChainError(
            "the model's output on the example batch carries no gradient: pass a batch on which "
            "the model computes what training differentiates (a loss, or logits)"
        )
    return roots, [torch.ones_like(t) for t in roots]
