"""A model seen as a chain of blocks, and blocks grouped into stages.

offremat plans a chain in the sense of Herrmann, Beaumont et al. (2019): each stage takes the
previous stage's output and nothing else. An ``nn.Sequential`` (or a list of modules) is such a
chain by construction; any other module is refused with advice on how to make it one.
:func:`check_chain_output` holds a chain to the model's own output, and :func:`untouched`
leaves a model as it was after a run made only to look at it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from offremat._buffers import assign_attributes, attribute_values
from offremat._eager import eager
from offremat._fsdp import sharded_parameters, sharding_hooks
from offremat._rng import (
    GeneratorWatch,
    RngState,
    cuda_device_indices,
    host_random_state,
    restore_host_random,
)
from offremat._scan import module_generators
from offremat._tensors import bitwise_equal, flatten

logger = logging.getLogger(__name__)


class NotAChainError(TypeError):
    """The model is not a chain of blocks; the message names it and says how to make it one."""


def chain_blocks(model: nn.Module | Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    """The (name, block) pairs of an ``nn.Sequential``, an ``nn.ModuleList`` or a list.

    A list holds modules (named by position) or (name, module) pairs.
    """
    if isinstance(model, (nn.Sequential, nn.ModuleList)):
        # What the model runs, not named_children(), which lists a block used twice once.
        blocks = [(name, block) for name, block in model._modules.items() if block is not None]
    elif isinstance(model, (list, tuple)):
        blocks = []
        for index, block in enumerate(model):
            if (
                isinstance(block, tuple)
                and len(block) == 2
                and isinstance(block[0], str)
                and isinstance(block[1], nn.Module)
            ):
                blocks.append(block)
                continue
            if not isinstance(block, nn.Module):
                raise NotAChainError(
                    f"block {index} of the list is a {type(block).__name__}, not an nn.Module: "
                    "pass a list of nn.Module blocks, each taking the previous block's output"
                )
            blocks.append((str(index), block))
    else:
        name = type(model).__name__
        raise NotAChainError(
            f"{name} is not a chain of blocks: offremat runs a model as a sequence of stages, "
            f"each taking the previous one's output. Wrap your model as an nn.Sequential of its "
            f"blocks (for example nn.Sequential(model.embed, *model.blocks, model.head)), or pass "
            f"a list of blocks instead of the {name}"
        )
    if not blocks:
        raise NotAChainError(f"the {type(model).__name__} has no blocks to run as stages")
    return blocks


def group_evenly(weights: Sequence[float], count: int) -> list[range]:
    """Split consecutive blocks into ``count`` groups so that the heaviest group is lightest.

    The classic linear-partition DP; ties go to the earliest cut, so the result is
    deterministic for given weights.
    """
    total = len(weights)
    if not 1 <= count <= total:
        raise ValueError(f"cannot group {total} blocks into {count} stages; pick 1..{total}")
    prefix = [0.0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    infinity = float("inf")
    # best[k][n]: least possible heaviest group when the first n blocks form k groups.
    best = [[infinity] * (total + 1) for _ in range(count + 1)]
    cut = [[0] * (total + 1) for _ in range(count + 1)]
    best[0][0] = 0.0
    for groups in range(1, count + 1):
        for end in range(groups, total - (count - groups) + 1):
            for start in range(groups - 1, end):
                heaviest = max(best[groups - 1][start], prefix[end] - prefix[start])
                if heaviest < best[groups][end]:
                    best[groups][end] = heaviest
                    cut[groups][end] = start
    ranges: list[range] = []
    end = total
    for groups in range(count, 0, -1):
        start = cut[groups][end]
        ranges.append(range(start, end))
        end = start
    return ranges[::-1]


def group_name(names: Sequence[str]) -> str:
    """A stage's name from the names of its blocks: ``block3`` or ``block0..block3``."""
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


def stage_module(blocks: Sequence[tuple[str, nn.Module]]) -> nn.Module:
    """One module running ``blocks`` in order (the block itself when there is one)."""
    if len(blocks) == 1:
        return blocks[0][1]
    # Positional: block names are module paths, and a child's name cannot hold a dot.
    return nn.Sequential(*[block for _, block in blocks])


def output_capture_hooks(module: nn.Module) -> set[int]:
    """The keys of the forward hooks Hugging Face installs, once, to record what blocks
    compute (``output_hidden_states``): they record nothing unless a call asks, which a
    training step may not (:func:`offremat._call_checks.refuse_recorded_outputs`)."""
    return {
        key
        for hooks in (module._forward_pre_hooks, module._forward_hooks)
        for key, hook in hooks.items()
        if getattr(hook, "__module__", None) == "transformers.utils.output_capturing"
    }


def refuse_own_hooks(model: nn.Module) -> None:
    """Refuse hooks on a model whose training step runs its children as stages.

    The step calls the stages, never the model itself, so hooks on the model would silently
    not run (a hook that changes the output or a gradient would train another model); the
    optimized wrapper's own call runs hooks registered on it.
    """
    sharding = sharding_hooks(model)  # FSDP2's: each stage is sharded and runs its own
    hooks = {
        "forward pre-hook": model._forward_pre_hooks.keys() - sharding,
        "forward hook": model._forward_hooks.keys() - sharding,
        "backward pre-hook": model._backward_pre_hooks,
        "backward hook": model._backward_hooks,
    }
    kinds = [kind for kind, registered in hooks.items() if registered]
    if kinds:
        raise NotAChainError(
            f"this {type(model).__name__} has a {' and a '.join(kinds)} of its own, which an "
            "optimized training step would not run: it runs the children as the plan's stages "
            "and never calls the container. Register the hook on the module offremat.optimize "
            "returns (its call runs it), or on one of the children"
        )


def block_places(
    model: nn.Module, placed: Sequence[tuple[str, nn.Module]]
) -> tuple[tuple[tuple[str, nn.Module], ...], dict[str, int]]:
    """Where each block is in ``model`` (its path) and how many modules each container of
    blocks holds (an ``nn.Sequential`` or ``nn.ModuleList``, by path; "" is the model), for
    :func:`refuse_replaced_blocks`."""
    sizes = {}
    for path, _ in placed:
        parent = path.rpartition(".")[0]
        container = model.get_submodule(parent)
        if isinstance(container, (nn.Sequential, nn.ModuleList)):
            sizes[parent] = len(container._modules)
    return tuple(placed), sizes


def refuse_replaced_blocks(
    model: nn.Module, places: tuple[tuple[tuple[str, nn.Module], ...], dict[str, int]]
) -> None:
    """Refuse a training step after a block was replaced, removed or added since ``places``
    (from :func:`block_places`) was taken.

    The plan's stages hold the blocks that ``optimize`` found: a block put in their place
    would never run, and one added to their container would run in no plan.
    """
    placed, sizes = places
    changed = None
    for path, block in placed:
        try:
            found = model.get_submodule(path)
        except AttributeError:
            found = None
        if found is not block:
            changed = f"block {path!r}"
            break
    for parent, size in sizes.items():
        if changed is None and len(model.get_submodule(parent)._modules) != size:
            changed = f"the blocks of {parent!r}" if parent else "its blocks"
    if changed is not None:
        raise RuntimeError(
            f"{changed} of this {type(model).__name__} changed since offremat.optimize "
            "planned for it (replaced, added or removed): the plan's stages would run the "
            "blocks it found. Call offremat.optimize again on the changed model"
        )


def check_chain_output(model: nn.Module, stages: Sequence[nn.Module], example_input: Any) -> None:
    """Refuse a chain whose output on ``example_input`` is not the model's own.

    Both run without autograd from the same RNG state, and leave the model as it was; a random
    draw that recomputation could not replay is refused (:class:`GeneratorWatch`). A model
    whose ``forward`` does more than run its blocks in order (an ``nn.Sequential`` subclass with
    its own ``forward``, say) would otherwise train silently as another model.
    """
    parameters = [p for stage in stages for p in stage.parameters()]
    device = parameters[0].device if parameters else flatten(example_input)[0][0].device

    def run_chain() -> Any:
        value = example_input
        for stage in stages:
            value = stage(value)
        return value

    outputs = model_and_chain_outputs(model, device, lambda: model(example_input), run_chain)
    (model_tensors, model_structure), (chain_tensors, chain_structure) = outputs
    same = model_structure == chain_structure and all(
        bitwise_equal(a, b) for a, b in zip(model_tensors, chain_tensors, strict=True)
    )
    if not same:
        raise NotAChainError(
            f"the chain of {type(model).__name__}'s blocks, run in order, does not give the "
            f"model's own output on the example input: its forward does more than run its "
            f"children one after the other, or a forward depends on state that is neither a "
            f"parameter nor a buffer and that it changes (a Python counter, say), which "
            f"a recomputation could not replay. Pass the blocks that forward "
            f"runs, in order, as an nn.Sequential or a list "
            f"(offremat.optimize([block0, block1, ...], ...)), and keep such state in buffers"
        )


def model_and_chain_outputs(
    model: nn.Module,
    device: torch.device,
    run_model: Callable[[], Any],
    run_chain: Callable[[], Any],
) -> list[tuple[list[torch.Tensor], Any]]:
    """The flattened outputs of the model's own run and of its chain's, both without autograd
    and eager, from the same RNG and buffer state, the model left as it was; the model's run
    refuses a random draw that recomputation could not replay (:class:`GeneratorWatch`).

    Eager both: GeneratorWatch runs compiled blocks eagerly, and compiled code rounds
    differently from eager.
    """
    outputs = []
    with untouched([model], device) as restore, torch.no_grad(), eager():
        generators = module_generators(model)
        state = RngState.capture(cuda_device_indices(device), generators)
        for run, watch in ((run_model, GeneratorWatch(generators)), (run_chain, nullcontext())):
            state.restore()
            restore()  # a forward may change buffers (counters, moving averages)
            with watch:
                outputs.append(flatten(run()))
    return outputs


def check_device(modules: Sequence[nn.Module], device: torch.device) -> None:
    """Refuse an input on another device than the model's parameters, saying how to fix it."""
    parameter = next((p for module in modules for p in module.parameters()), None)
    if parameter is not None and parameter.device != device:
        raise ValueError(
            f"the input is on {device} but the model's parameters are on {parameter.device}: "
            f"move the input with x.to({str(parameter.device)!r}) or the model with "
            f"model.to({str(device)!r})"
        )


@contextmanager
def untouched(modules: Sequence[nn.Module], device: torch.device) -> Iterator[Callable[[], None]]:
    """Restore RNG states (the modules' own generators too), buffers, plain attributes,
    parameter gradients and the parameters a forward changes in place, with the caller's
    gradient hooks (parameters', modules' backward hooks, and those for every module) set
    aside; yields a function that restores buffers, attributes and those parameters now (so
    that each of several runs starts from the same state).

    A buffer a forward changes (a counter, a moving average, spectral norm's vectors) is put
    back, in place or in the module where the forward assigned a new tensor. Of the parameters,
    those of embeddings with ``max_norm`` (which renormalise their rows in place) are copied
    beforehand and put back; any other parameter found changed in place is reported.
    """
    cuda_devices = cuda_device_indices(device)
    generators = [g for module in modules for g in module_generators(module)]
    generator_states = [(g, g.get_state()) for g in generators]
    buffers = [
        (owner, name, buffer, buffer.clone())
        for module in modules
        for owner in module.modules()
        for name, buffer in owner._buffers.items()
        if buffer is not None
    ]
    # With FSDP2's sharded parameters, which its gradients go to and parameters() need not list.
    listed = [p for module in modules for p in module.parameters()]
    parameters = {id(p): p for p in (*listed, *sharded_parameters(modules))}.values()
    versions = [(p, p._version) for p in parameters]
    renormed = [
        (p, p.detach().clone())
        for module in modules
        for owner in module.modules()
        if isinstance(owner, nn.Embedding) and owner.max_norm is not None
        for p in owner.parameters(recurse=False)
    ]
    grads = [(p, p.grad) for p in parameters]
    for parameter, _ in grads:  # profiling accumulates into gradients of its own
        parameter.grad = None
    # The caller's gradient hooks belong to training steps, not to profiling's backwards: an
    # optimizer step run in the backward would train on them, and a module's backward hooks
    # (a gradient-norm logger) would see the profile's seeds. Emptied in place, since autograd
    # and the hooks' handles hold the tables themselves.
    tables = [
        *(t for p in parameters for t in (p._backward_hooks, p._post_accumulate_grad_hooks)),
        *(
            t
            for module in modules
            for owner in module.modules()
            for t in (owner._backward_hooks, owner._backward_pre_hooks)
        ),
        module_hooks._global_backward_hooks,
        module_hooks._global_backward_pre_hooks,
    ]
    hooks = [(table, dict(table)) for table in tables if table]
    for table, _ in hooks:
        table.clear()
    attributes = [values for module in modules for values in attribute_values(module.modules())]
    # Forward hooks a first call installs go with the attributes it sets: Hugging Face's
    # output capture marks the module with an attribute, which the attributes' restoring
    # removes, so its hooks must go too, or the next call installs them twice. Hooks removed
    # meanwhile stay removed (the step's own, its interception ending on an error).
    forward_hooks = [
        (table, set(table))
        for module in modules
        for owner in module.modules()
        for table in (
            owner._forward_pre_hooks,
            owner._forward_pre_hooks_with_kwargs,
            owner._forward_hooks,
            owner._forward_hooks_with_kwargs,
            owner._forward_hooks_always_called,
        )
    ]

    def restore() -> None:
        assign_attributes(attributes)  # a call counter, an activation kept for logging
        for table, before in forward_hooks:
            for key in table.keys() - before:
                del table[key]
        with torch.no_grad():
            for owner, name, buffer, copy in buffers:
                owner._buffers[name] = buffer
                # Through .data, which has a version counter of its own: putting back the
                # values a waiting forward's graph saved (BatchNorm's running statistics,
                # while a second input shape is planned) is no change to that graph.
                buffer.data.copy_(copy)
            for parameter, copy in renormed:
                parameter.copy_(copy)

    host = host_random_state()
    with torch.random.fork_rng(devices=cuda_devices):
        try:
            yield restore
        finally:
            restore()
            restore_host_random(host)
            restored = {id(p) for p, _ in renormed}
            for parameter, version in versions:
                if parameter._version != version and id(parameter) not in restored:
                    logger.warning(
                        "offremat ran the model's forward to profile and check it, and that "
                        "forward changed a parameter of shape %s in place; it stays changed",
                        tuple(parameter.shape),
                    )
            for parameter, grad in grads:
                parameter.grad = grad
            for table, saved in hooks:
                table.update(saved)
            for generator, state in generator_states:
                generator.set_state(state)
