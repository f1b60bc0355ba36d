"""Any model as a chain: its run of blocks, profiled, with what the code around it costs.

The chain is the model's run of repeated blocks (:mod:`offremat._discover`); the model's code
before the run (embeddings, a stem) and after it (a final norm, a head, the loss) runs under
plain autograd (:mod:`offremat._run`). That code's memory is the plan's too, and is measured
with the same independent tracker as every stage (:mod:`offremat.measure`):

- what is resident when the chain starts (the batch, the set-up code's saved tensors, the
  hidden state and the side inputs) is the chain's input a_0, resident for the whole step;
- the end code's forward and backward happen between F(L) and B(L): their peak is counted as
  part of B(L)'s temporary, with the caller's outputs (a loss, logits) and the gradient δ_L
  that the end code hands the chain, which stay alive from then to the end of the step (the
  chain's ``held_bytes``);
- the set-up code's backward comes after B(1) and is counted as part of B(1)'s temporary.

Both foldings over-count by at most one gradient of the hidden state; neither hides a byte.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from offremat._attribute_walk import leaves, map_leaves
from offremat._block_skips import skips_refused
from offremat._blocks import NotAChainError, model_and_chain_outputs, untouched
from offremat._discover import BlockRun, Call, as_call, call_model, chain_input, find_block_run
from offremat._run import RunInterception, refuse_hooks, run_blocks
from offremat._signatures import chain_input_kind, chain_input_shapes
from offremat._tensors import bitwise_equal, flatten, is_differentiable, storage_bytes, unflatten
from offremat.measure import StepMemory, tree_leaf_tensors
from offremat.profiler import (
    cover_plain_autograd,
    profile_model,
    raised_backward,
    stage_modules,
)
from solvers.chain import Chain


@dataclass(frozen=True)
class ModelChain:
    """A model's run of blocks, its blocks as chain blocks, and the chain's first input."""

    run: BlockRun
    blocks: tuple[tuple[str, nn.Module], ...]
    example_input: Any

    @classmethod
    def find(cls, model: nn.Module, batch: Any, blocks: str | None = None) -> ModelChain:
        """The chain of ``model`` called with ``batch`` (``blocks`` names its container)."""
        # Watching the model run must leave it as it was (BatchNorm statistics, RNG states).
        with untouched([model], _device(model, batch)):
            run = find_block_run(model, partial(call_model, model, batch), blocks)
            example_input = chain_input(run, partial(call_model, model, batch))
        # With the caller's backward hooks back, which optimize's own runs set aside.
        refuse_hooks(run)
        return cls(run, tuple(run_blocks(run)), _leaves(example_input))

    def on(self, model: nn.Module, batch: Any) -> ModelChain:
        """The same chain, with its first input taken from ``batch`` (another input shape)."""
        with untouched([model], _device(model, batch)):
            example_input = chain_input(self.run, partial(call_model, model, batch))
        return dataclasses.replace(self, example_input=_leaves(example_input))


def _leaves(example_input: Any) -> Any:
    """``example_input`` cut from the graph that made it, each tensor a leaf that requires a
    gradient where it did: only leaves can be deep-copied (an EMA copy of an optimized
    model), and the profile reads nothing but values and flags."""
    tensors, structure = flatten(example_input)
    return unflatten([t.detach().requires_grad_(t.requires_grad) for t in tensors], structure)


@dataclass(frozen=True)
class _Outside:
    """What the code around the chain holds, in bytes (see the module's notes)."""

    resident_bytes: int
    setup_transient_bytes: int
    end_peak_bytes: int
    held_bytes: int
    setup_backward_bytes: int


def profile_model_chain(
    model: nn.Module,
    batch: Any,
    found: ModelChain,
    stages: int | None = None,
    bandwidth: Any = None,
    blocks: Sequence[tuple[str, nn.Module]] | None = None,
    **options: Any,
) -> Chain:
    """The chain of ``model``'s blocks on ``batch``, with the cost of the code around them.

    ``blocks`` replaces ``found``'s blocks (already grouped stages, say); ``options`` go to
    :func:`offremat.profiler.profile_model` (``warmup``, ``repeats``, ``name``).
    """
    options.setdefault("name", type(model).__name__)
    modules = [block for _, block in (found.blocks if blocks is None else blocks)]
    with skips_refused(modules):
        chain = profile_model(
            list(found.blocks if blocks is None else blocks),
            found.example_input,
            stages=stages,
            bandwidth=bandwidth,
            **options,
        )
    outside = _measure_outside(model, batch, found)
    return _with_outside(chain, outside, found.run.paths, found.example_input)


def profile_blocks_on(
    chain: Chain, blocks: Sequence[tuple[str, nn.Module]], value: Any, **options: Any
) -> Chain:
    """``chain``'s stages ``blocks`` profiled on another chain input ``value`` of the same
    call (inside the model's step, where the code around the blocks cannot run again), with
    the costs around them measured for ``chain``: only what the blocks' inputs hold
    differs, which the input's bytes correct. A tensor the code before the blocks keeps
    only for such inputs, without passing it on, is not seen. For a chain predicted from
    other sizes the costs around the blocks are its own figures, which bound them from above,
    and the whole input is counted on top. ``options`` go to
    :func:`offremat.profiler.profile_model`."""
    value_bytes = storage_bytes(flatten(value)[0])
    if "chain_input_bytes" in chain.metadata:
        outside = _Outside(**chain.metadata["outside"])
        moved = value_bytes - chain.metadata["chain_input_bytes"]
        outside = dataclasses.replace(outside, resident_bytes=outside.resident_bytes + moved)
    else:
        first, last = chain.stages[0], chain.stages[-1]
        outside = _Outside(
            resident_bytes=chain.input_bytes
            - chain.metadata.get("kept_by_modules_bytes", 0)
            + value_bytes,
            setup_transient_bytes=max(first.fwd_tmp_bytes, first.nograd_fwd_tmp_bytes),
            end_peak_bytes=last.bwd_tmp_bytes,
            held_bytes=chain.held_bytes - chain.metadata.get("shared_gradient_bytes", 0),
            setup_backward_bytes=first.bwd_tmp_bytes,
        )
    with skips_refused([block for _, block in blocks]):
        profiled = profile_model(list(blocks), value, **options)
    return _with_outside(profiled, outside, chain.metadata["blocks"], value)


def _with_outside(chain: Chain, outside: _Outside, paths: Any, example_input: Any) -> Chain:
    """``chain`` of the blocks with the costs of the code around them folded in."""
    # B(L)'s temporary without what covers plain autograd's keep-all peak on the blocks
    # alone: covered again below, with the code around them.
    folded = list(raised_backward(chain, -chain.metadata.get("plain_autograd_bytes", 0)).stages)
    first = folded[0]
    folded[0] = dataclasses.replace(
        first,
        fwd_tmp_bytes=max(first.fwd_tmp_bytes, outside.setup_transient_bytes),
        nograd_fwd_tmp_bytes=max(first.nograd_fwd_tmp_bytes, outside.setup_transient_bytes),
        bwd_tmp_bytes=max(first.bwd_tmp_bytes, outside.setup_backward_bytes),
    )
    last = folded[-1]
    folded[-1] = dataclasses.replace(
        last, bwd_tmp_bytes=max(last.bwd_tmp_bytes + outside.held_bytes, outside.end_peak_bytes)
    )
    metadata = dict(chain.metadata)
    metadata["outside"] = dataclasses.asdict(outside)
    metadata["blocks"] = paths
    metadata["chain_input"] = chain_input_kind(example_input)
    metadata["chain_input_bytes"] = storage_bytes(flatten(example_input)[0])
    metadata["chain_input_shapes"] = chain_input_shapes(example_input)
    metadata.pop("plain_autograd_bytes", None)
    folded_chain = dataclasses.replace(
        chain,
        input_bytes=outside.resident_bytes + chain.metadata["kept_by_modules_bytes"],
        held_bytes=outside.held_bytes + chain.metadata["shared_gradient_bytes"],
        stages=tuple(folded),
        metadata=metadata,
    )
    # The set-up code's backward, part of B(1)'s temporary, runs beside the gradients of the
    # leaves every stage made, under plain autograd.
    return cover_plain_autograd(folded_chain, through_first=True)


def model_chain_stages(found: ModelChain, chain: Chain) -> list[nn.Module]:
    """The module of each stage of ``chain``, from the blocks of ``found``."""
    return stage_modules(list(found.blocks), chain)


def check_model_chain_output(
    model: nn.Module, batch: Any, found: ModelChain, stages: Sequence[nn.Module]
) -> None:
    """Refuse a chain whose model output differs from the model's own on ``batch``, and a
    random draw that recomputation could not replay (:class:`GeneratorWatch`)."""

    def run_chain() -> Any:
        with RunInterception(
            found.run, lambda value: _run_stages(stages, value), check_state=False, check_grad=False
        ):
            return call_model(model, batch)

    (plain, _), (chained_output, _) = model_and_chain_outputs(
        model, _device(model, batch), lambda: call_model(model, batch), run_chain
    )
    if len(plain) != len(chained_output) or not all(
        bitwise_equal(a, b) for a, b in zip(plain, chained_output, strict=True)
    ):
        difference = _rounding_difference(plain, chained_output)
        if difference is not None:
            raise NotAChainError(
                f"{type(model).__name__} run with its blocks as a chain gives the model's own "
                f"output only up to rounding (largest difference {difference:.3g}): something "
                "the model's own run does and the chain's does not changes the kernels used, "
                "such as filling a Hugging Face key-value cache. Turn it off "
                "(model.config.use_cache = False) and optimize again"
            )
        raise NotAChainError(
            f"{type(model).__name__} run with its blocks {found.run.calls[0].path} .. "
            f"{found.run.calls[-1].path} as a chain does not give the model's own output: name "
            "the blocks that its forward runs one after the other with blocks=; a block whose "
            "forward depends on state that is neither a parameter nor a buffer and that it "
            "changes (a Python counter, say) cannot be recomputed: keep "
            "such state in buffers; and the chain runs the blocks one after the other, so "
            "random numbers the model draws between their calls (a mask per layer) come from "
            "another point of the generator: draw them inside the blocks"
        )


def _rounding_difference(
    plain: Sequence[torch.Tensor], chained: Sequence[torch.Tensor]
) -> float | None:
    """The largest difference of two outputs that agree up to rounding, else None."""
    if len(plain) != len(chained):
        return None
    largest = 0.0
    for a, b in zip(plain, chained, strict=True):
        if a.shape != b.shape or a.dtype != b.dtype:
            return None
        if bitwise_equal(a, b):
            continue
        if not a.is_floating_point() or not torch.allclose(a, b, rtol=1e-4, atol=1e-6):
            return None
        largest = max(largest, (a - b).abs().max().item())
    return largest


def _run_stages(stages: Sequence[nn.Module], value: Any) -> Any:
    for stage in stages:
        value = stage(value)
    return value


def _device(model: nn.Module, batch: Any) -> torch.device:
    parameter = next(model.parameters(), None)
    if parameter is not None:
        return parameter.device
    return tree_leaf_tensors(batch)[0].device


class _Boundary(torch.autograd.Function):
    """The chain replaced by its output on the example: marks the end code's last backward.

    Its gradient for the chain input is an expanded zero, which allocates nothing.
    """

    @staticmethod
    def forward(
        ctx: Any, probe: _OutsideProbe, hidden: torch.Tensor, last: torch.Tensor
    ) -> torch.Tensor:
        ctx.probe = probe
        ctx.input_shape = hidden.shape
        # Not a view of ``last``: the code after the chain may change it in place (a DenseNet
        # applies F.relu(..., inplace=True) to the last block's output), which autograd forbids
        # on a view a custom function returns.
        return last.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ctx.probe.turned(grad)
        return None, grad.new_zeros(()).expand(ctx.input_shape), None


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
        return (_Boundary.apply(self, hidden, self.last), *side)

    def turned(self, grad: torch.Tensor) -> None:
        self.end_peak_bytes = self.memory.peak_so_far_bytes
        self.turn_bytes = self.memory.live_bytes
        self.memory.reset_peak()


def _drop_grad(parameter: torch.Tensor) -> None:
    parameter.grad = None


def _measure_outside(model: nn.Module, batch: Any, found: ModelChain) -> _Outside:
    """Run a step with the chain replaced by its output, and measure the code around it."""
    batch_tensors = tree_leaf_tensors(batch)
    device = _device(model, batch)
    chained = {id(p) for _, block in found.blocks for p in block.parameters()}
    with untouched([model], device):
        last = _last_output([block for _, block in found.blocks], found.example_input)
        # As the chain's own output would, whether or not its input carries a gradient.
        last.requires_grad_(is_differentiable(last))
        # Gradients exist as after a first step, for the code around the chain alone: each
        # part is added to one there and freed. Dropping each once accumulated frees it as
        # that does, without making those gradients a second time beside the caller's, which
        # optimize's runs set aside (a new shape is profiled in its step, on its budget).
        dropping = [
            parameter.register_post_accumulate_grad_hook(_drop_grad)
            for parameter in model.parameters()
            if parameter.requires_grad and id(parameter) not in chained
        ]
        # The caller's tensors cut from the graphs they came from: this backward must neither
        # run nor free them (a batch computed by the caller's own embedding, say).
        call = as_call(batch)
        cut = Call(tree_map(_cut, call.args), tree_map(_cut, call.kwargs))
        with StepMemory(device) as memory:
            probe = _OutsideProbe(memory, last)
            with RunInterception(found.run, probe.started, check_state=False):
                output = model(*cut.args, **cut.kwargs)
            roots, seeds = _seed(output)
            torch.autograd.backward(roots, seeds)
            del roots, seeds, output
            setup_backward = memory.peak_so_far_bytes - probe.turn_bytes
            probe.value = None
        for handle in dropping:
            handle.remove()
    start = probe.start_bytes
    # The executor's backward keeps the incoming δ_L to its end, as the caller's output.
    held = max(probe.turn_bytes - start, 0)
    return _Outside(
        resident_bytes=start + storage_bytes(batch_tensors),
        setup_transient_bytes=max(probe.setup_peak_bytes - start, 0),
        end_peak_bytes=max(probe.end_peak_bytes - start, 0),
        held_bytes=held,
        setup_backward_bytes=max(setup_backward, 0),
    )


def _last_output(blocks: Sequence[nn.Module], value: Any) -> torch.Tensor:
    """The chain's output on ``value``, for the code after it: run under no_grad, unless the
    blocks keep tensors as attributes (an attention map that a loss term reads after the
    loop). Those then carry their graph in a step, so the code after the chain saves tensors
    for its backward: the blocks run with gradients, one at a time, and each attribute is cut
    from its block's graph as a leaf of its own, where the measured backward stops."""
    before = _tensor_attributes(blocks)
    with torch.no_grad():
        last = _run_stages(blocks, value)[0]
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
