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

from offremat._block_skips import skips_refused
from offremat._blocks import NotAChainError, model_and_chain_outputs, untouched
from offremat._discover import BlockRun, call_model, find_block_run
from offremat._outside import Outside, measure_outside, run_stages
from offremat._pinned_grads import backward_gradient_bytes
from offremat._run import RunInterception, refuse_hooks, run_blocks
from offremat._side_patterns import chain_input
from offremat._signatures import block_values, chain_input_kind, chain_input_shapes
from offremat._tensors import bitwise_equal, flatten, storage_bytes, unflatten
from offremat.measure import tree_leaf_tensors
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
    def find(
        cls, model: nn.Module, batch: Any, blocks: str | None = None, same_sides: bool = False
    ) -> ModelChain:
        """The chain of ``model`` called with ``batch`` (``blocks`` names its container; see
        :func:`offremat._discover.find_block_run` for ``same_sides``)."""
        # Watching the model run must leave it as it was (BatchNorm statistics, RNG states).
        with untouched([model], _device(model, batch)):
            run = find_block_run(model, partial(call_model, model, batch), blocks, same_sides)
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
    outside = measure_outside(
        model,
        batch,
        found.run,
        [block for _, block in found.blocks],
        found.example_input,
        _device(model, batch),
    )
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
        outside = Outside(**chain.metadata["outside"])
        moved = value_bytes - chain.metadata["chain_input_bytes"]
        outside = dataclasses.replace(outside, resident_bytes=outside.resident_bytes + moved)
    else:
        first, last = chain.stages[0], chain.stages[-1]
        outside = Outside(
            resident_bytes=chain.input_bytes
            - chain.metadata.get("kept_by_modules_bytes", 0)
            + value_bytes,
            setup_transient_bytes=max(first.fwd_tmp_bytes, first.nograd_fwd_tmp_bytes),
            end_peak_bytes=last.bwd_tmp_bytes,
            held_bytes=chain.held_bytes - backward_gradient_bytes(chain),
            setup_backward_bytes=first.bwd_tmp_bytes,
        )
    with skips_refused([block for _, block in blocks]):
        profiled = profile_model(list(blocks), value, **options)
    return _with_outside(profiled, outside, chain.metadata["blocks"], value)


def _with_outside(
    chain: Chain,
    outside: Outside,
    paths: Any,
    example_input: Any,
) -> Chain:
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
    metadata["chain_input_values"] = block_values(example_input)
    metadata.pop("plain_autograd_bytes", None)
    folded_chain = dataclasses.replace(
        chain,
        input_bytes=outside.resident_bytes + chain.metadata["kept_by_modules_bytes"],
        held_bytes=outside.held_bytes + backward_gradient_bytes(chain),
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
) -> str | None:
    """Refuse a chain whose model output differs from the model's own on ``batch``, and a
    random draw that recomputation could not replay (:class:`GeneratorWatch`); the shapes
    of the blocks' input on ``batch`` (:func:`chain_input_shapes`), None if they never ran."""
    seen: list[str] = []

    def run_blocks(value: Any) -> Any:
        seen.append(chain_input_shapes(value))
        return run_stages(stages, value)

    def run_chain() -> Any:
        with RunInterception(found.run, run_blocks, check_state=False, check_grad=False):
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
    return seen[0] if seen else None


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


def _device(model: nn.Module, batch: Any) -> torch.device:
    parameter = next(model.parameters(), None)
    if parameter is not None:
        return parameter.device
    return tree_leaf_tensors(batch)[0].device
