"""From a model and its example batch to its plans: the chain found, profiled and planned.

An ``nn.Sequential`` or a list of blocks is its own chain; any other model's chain is its run
of repeated blocks (:mod:`offremat._discover`). Either way the example batch's plan comes
first, and :class:`offremat._shapes.ShapePlans` keeps the functions that profile a new shape
(and, for a model, blocks' inputs of another kind) over the same stages.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from offremat._block_values import DroppedOutputError
from offremat._blocks import (
    NotAChainError,
    chain_blocks,
    check_chain_output,
    check_device,
    refuse_own_hooks,
)
from offremat._call_checks import recorded_output_flags, refuse_kv_cache, refuse_recorded_outputs
from offremat._discover import BlockRun, Call, call_of
from offremat._handed_on import DeferredOutputError, UnknownShapeError
from offremat._model_chain import (
    ModelChain,
    check_model_chain_output,
    model_chain_stages,
    profile_blocks_on,
    profile_model_chain,
)
from offremat._planning import QUICK, Request, link_of, same_stages
from offremat._shapes import ShapePlans
from offremat._tensors import flatten, storage_bytes
from offremat.profiler import profile_model, stage_modules
from solvers.chain import Chain
from solvers.plan import Plan

logger = logging.getLogger(__name__)

# The model the optimized module wraps, its plans, and its run of blocks.
Built = tuple[nn.Module, ShapePlans, BlockRun | None]


def _is_block_list(model: Any) -> bool:
    """Whether ``model`` is its own chain: a list of blocks, or an ``nn.Sequential`` that
    calls its children as ``nn.Sequential`` does (a subclass with a ``forward`` of its own may
    call them otherwise, under ``no_grad`` say, so its run of blocks is found as any model's)."""
    if isinstance(model, nn.Sequential):
        return type(model).forward is nn.Sequential.forward
    return isinstance(model, (nn.ModuleList, list, tuple))


def build(
    model: nn.Module | Sequence[nn.Module], example_batch: Any, request: Request, blocks: str | None
) -> Built:
    """The model to wrap, its plans by input shape, and its run of blocks (None for a chain
    of blocks given as such)."""
    tensors, _ = flatten(example_batch)
    if blocks is None and _is_block_list(model):
        return _build_sequential(model, example_batch, request)
    if not isinstance(model, nn.Module) or isinstance(model, nn.ModuleList):
        raise TypeError(
            f"blocks= names blocks inside a model, and a {type(model).__name__} is not one: "
            "pass the model, or the list without blocks="
        )
    check_device([model], tensors[0].device)
    call = call_of(model, example_batch)
    # As a training step would, before profiling runs the model with its blocks intercepted.
    refuse_recorded_outputs(model, recorded_output_flags(model), call.kwargs)
    refuse_kv_cache(call.args, call.kwargs)
    found = ModelChain.find(model, call, blocks)
    try:
        chain, plan, modules = _first_runs(model, call, found, request)
    except DeferredOutputError as error:
        # A run of several patterns runs at its last call, too late for code that reads a
        # block's output between the calls: plan a run taking one pattern instead.
        logger.warning("%s: planning blocks that take the same side inputs", error)
        try:
            found = ModelChain.find(model, call, blocks, same_sides=True)
        except NotAChainError as refused:
            raise NotAChainError(
                f"{error}; and no two blocks called one after the other take the same side "
                f"inputs ({refused}). Train this model with plain autograd, or read the "
                "blocks' outputs only after the last block"
            ) from error
        chain, plan, modules = _first_runs(model, call, found, request)
    stage_blocks = list(zip(chain.stage_names, modules, strict=True))

    profile_shape = functools.partial(_profile_model_shape, model, found, chain, stage_blocks)
    profile_blocks = functools.partial(_profile_blocks, stage_blocks)
    plans = request.plans(modules, call, chain, plan, profile_shape, profile_blocks, model)
    return model, plans, found.run


def _first_runs(
    model: nn.Module, call: Call, found: ModelChain, request: Request
) -> tuple[Chain, Plan, list[nn.Module]]:
    """The first runs of the model with its blocks as a chain: the example's chain and plan
    (profiled, or read from the disk cache), its stages, the chain's output checked."""
    try:
        chain, plan = request.example_plan(
            call,
            lambda: profile_model_chain(model, call, found, request.stages, request.bandwidth),
            functools.partial(model_chain_stages, found),
        )
        modules = model_chain_stages(found, chain)
        shapes = check_model_chain_output(model, call, found, modules)
        if request.chain is not None:
            _check_blocks_input(chain, shapes)
    except (DroppedOutputError, UnknownShapeError) as error:  # reads what the chain drops
        raise NotAChainError(str(error)) from error
    return chain, plan, modules


# Module-level functions rather than closures, so that an optimized model pickles.
def _profile_model_shape(
    model: nn.Module,
    found: ModelChain,
    chain: Chain,
    stage_blocks: list[tuple[str, nn.Module]],
    new: Call,
) -> Chain:
    """A new input shape's chain, profiled quickly over the stages of the first."""
    again = found.on(model, new)
    return same_stages(
        chain,
        profile_model_chain(
            model, new, again, bandwidth=link_of(chain), blocks=stage_blocks, **QUICK
        ),
    )


def _profile_blocks(stage_blocks: list[tuple[str, nn.Module]], chain: Chain, value: Any) -> Chain:
    """The stages profiled quickly on another kind of chain input of ``chain``'s call."""
    return same_stages(
        chain, profile_blocks_on(chain, stage_blocks, value, bandwidth=link_of(chain), **QUICK)
    )


def _profile_sequential_shape(
    chain: Chain, stage_blocks: list[tuple[str, nn.Module]], value: Any
) -> Chain:
    """A new input shape's chain, profiled quickly over the stages of the first."""
    return same_stages(chain, profile_model(stage_blocks, value, bandwidth=link_of(chain), **QUICK))


def _check_chain_input(chain: Chain, tensors: list[torch.Tensor]) -> None:
    """Refuse a chain profiled on an input of another size: its sizes are another input's.

    The profile counts the bytes the input reaches of its storages (both views of
    ``ids[:, :-1]`` and ``ids[:, 1:]`` together once); each view is compared by its own bytes
    too.
    """
    sizes = {storage_bytes(tensors), sum(t.numel() * t.element_size() for t in tensors)}
    profiled = chain.input_bytes - chain.metadata.get("kept_by_modules_bytes", 0)
    if profiled not in sizes:
        raise ValueError(
            f"the given chain was profiled with an input of {profiled} bytes, but the "
            f"example input has {min(sizes)}: its sizes are another input's. Omit chain= to "
            "profile this input, or give the input the chain was profiled with"
        )


def _check_blocks_input(chain: Chain, shapes: str | None) -> None:
    """Refuse a chain of a model's blocks profiled on a batch of other sizes, as
    :func:`_check_chain_input` does for a chain of the whole model: its budget, a fraction
    of its keep-all peak, was another batch's (a new user's trial: 9.72 MiB for 40% of a
    batch of 512, the fraction of the batch of 256 its chain was profiled on)."""
    profiled = chain.metadata.get("chain_input_shapes")
    if profiled is not None and shapes is not None and profiled != shapes:
        raise ValueError(
            f"the given chain was profiled where the blocks' input had shapes {profiled}, but "
            f"on the example batch it has {shapes}: its sizes are another batch's. Omit "
            "chain= to profile this batch, or give the batch the chain was profiled with"
        )


def _build_sequential(
    model: nn.Sequential | Sequence[nn.Module], example_input: Any, request: Request
) -> Built:
    blocks = chain_blocks(model)
    sequential = (
        model if isinstance(model, nn.Sequential) else nn.Sequential(*[m for _, m in blocks])
    )
    refuse_own_hooks(model if isinstance(model, nn.Module) else sequential)
    tensors, _ = flatten(example_input)
    check_device([module for _, module in blocks], tensors[0].device)
    if request.chain is not None:
        _check_chain_input(request.chain, tensors)
    chain, plan = request.example_plan(
        example_input,
        lambda: profile_model(
            sequential, example_input, stages=request.stages, bandwidth=request.bandwidth
        ),
        functools.partial(stage_modules, sequential),
    )
    modules = stage_modules(sequential, chain)
    check_chain_output(
        model if isinstance(model, nn.Module) else sequential, modules, example_input
    )
    stage_blocks = list(zip(chain.stage_names, modules, strict=True))

    profile_shape = functools.partial(_profile_sequential_shape, chain, stage_blocks)
    return sequential, request.plans(modules, example_input, chain, plan, profile_shape), None
