"""Profile a chain of PyTorch modules into a :class:`solvers.chain.Chain`.

Per stage it measures what rotor's cost model needs (Herrmann, Beaumont et al., "Optimal
checkpointing for heterogeneous chains", 2019): forward and backward times (warm-ups, then the
median of repeats; CUDA events on a GPU, ``perf_counter`` on a CPU), the output's bytes x_i and
the saved set's bytes x̄_i, and the transient peaks of the forward and the backward
(:mod:`offremat._stage_profile`).
Sizes come from ``saved_tensors_hooks`` and count distinct storages, neither the stage's input
nor parameters, exactly as the executor holds them (:mod:`offremat._stage`). On CUDA it also
measures the pinned host link used to offload (Beaumont, Eyraud-Dubois, Shilova 2021).

Profiling leaves the model as it was: the global RNG states, every buffer (BatchNorm running
statistics) and the parameters' ``.grad`` are untouched.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from offremat._blocks import (
    chain_blocks,
    check_device,
    group_evenly,
    group_name,
    stage_module,
    untouched,
)
from offremat._buffers import shared_buffer_keys
from offremat._link import measure_link
from offremat._pinned_grads import held_pinned_bytes
from offremat._scan import fixed_storages, scan_modules
from offremat._shared_grads import (
    parameter_users,
    refuse_shared_sparse_gradients,
    shared_gradient_bytes,
)
from offremat._stage import AutocastState
from offremat._stage_figures import Measured
from offremat._stage_profile import StageProfile
from offremat._stage_state import hook_count
from offremat._tensors import (
    flatten,
    gradient_bytes,
    is_differentiable,
    refuse_hidden_tensors,
    storage_bytes,
    unflatten,
    unique_storages,
)
from solvers.budget import parse_bandwidth
from solvers.chain import Chain, Stage
from solvers.registry import keep_all_peak

logger = logging.getLogger(__name__)


def profile_model(
    model: nn.Module | Sequence[nn.Module],
    example_input: Any,
    *,
    stages: int | None = None,
    bandwidth: Any = None,
    warmup: int = 2,
    repeats: int = 5,
    name: str | None = None,
) -> Chain:
    """The chain of ``model`` (an ``nn.Sequential`` or a list of blocks) on ``example_input``.

    One stage per block, or ``stages`` stages of consecutive blocks balanced by saved bytes
    (the grouping is logged and kept in ``chain.metadata["grouping"]``). ``bandwidth`` sets
    the link (see :func:`parse_bandwidth`); otherwise it is measured on CUDA and absent on
    a CPU.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    blocks = chain_blocks(model)
    modules = [module for _, module in blocks]
    input_tensors, _ = flatten(example_input)
    if not input_tensors:
        raise TypeError("the example input holds no tensor; pass what the model's forward takes")
    device = input_tensors[0].device
    check_device(modules, device)
    with untouched(modules, device), ExitStack() as autocast:
        # The caller's autocast, with its weight cache off, as every step runs it: the cache
        # would keep each stage's low-precision weight copies, taken for kept activations.
        for state in AutocastState.of_step(device):
            state.enter(autocast)
        if stages is None or stages == len(blocks):
            groups = [range(k, k + 1) for k in range(len(blocks))]
        else:
            sizes = [
                m.saved_bytes for m in _profile_all(blocks, example_input, 0, 1, sizes_only=True)
            ]
            # +1: blocks that save nothing still have to go somewhere.
            groups = group_evenly([size + 1 for size in sizes], stages)
        grouped = [[blocks[k] for k in group] for group in groups]
        names = [group_name([block_name for block_name, _ in group]) for group in grouped]
        measured = _profile_all(
            [(n, stage_module(g)) for n, g in zip(names, grouped, strict=True)],
            example_input,
            warmup,
            repeats,
        )
    # Parameters several stages use: their running gradient sums (offremat._shared_grads)
    # are held to the end of the backward at most, and each earlier user's B adds to one.
    # So are the storages a parameter's gradient, a slice of a larger one, keeps alive from
    # its stage's backward (offremat._pinned_grads).
    modules = [stage_module(g) for g in grouped]
    parameters = [list(module.parameters()) for module in modules]
    refuse_shared_sparse_gradients(names, modules, [m.sparse_grads for m in measured])
    shared, added = shared_gradient_bytes(parameters)
    hooked = [hooked_gradient_bytes(stage_parameters) for stage_parameters in parameters]
    several = {key for key, (_, used) in parameter_users(parameters).items() if len(used) > 1}
    pinned = held_pinned_bytes([m.pinned_grads for m in measured], several)
    chain_stages = tuple(
        Stage(
            name=stage_name,
            fwd_s=m.fwd_s,
            bwd_s=m.bwd_s,
            out_bytes=m.out_bytes,
            saved_bytes=m.saved_bytes,
            fwd_tmp_bytes=m.fwd_tmp_bytes,
            bwd_tmp_bytes=m.bwd_tmp_bytes + extra + hook,
            nograd_fwd_tmp_bytes=m.nograd_fwd_tmp_bytes,
            grad_bytes=m.grad_bytes,
            refill_s=m.refill_s,
        )
        for stage_name, m, extra, hook in zip(names, measured, added, hooked, strict=True)
    )
    # The leaves a stage's graph holds live from its first forward to its backward in every
    # plan (a recomputed stage's forward keeps its graph, offremat._deferred), and to the end
    # of the step under plain autograd: resident for the whole step, like what modules keep.
    kept = sum(m.kept_bytes + m.changed_buffer_bytes + m.leaf_bytes for m in measured)
    leaves = {name: m.leaf_bytes for name, m in zip(names, measured, strict=True) if m.leaf_bytes}
    if leaves:
        logger.warning(
            "%d stage(s) make tensors that require grad as leaves of their graph in their "
            "forward (%s), such as an initial state made with torch.zeros(..., "
            "requires_grad=True): autograd's graph holds them from the stage's forward to its "
            "backward, or to the end of the step, whatever the plan says, and plain "
            "autograd's, with the gradients it gives them, to the end of the step. Counted as "
            "resident for the whole step and in the stage's saved set; make them without "
            "requires_grad=True unless their gradient is read",
            len(leaves),
            ", ".join(f"{name!r} {size} B" for name, size in leaves.items()),
        )
    for stage_name, m in zip(names, measured, strict=True):
        if m.kept_bytes:
            logger.warning(
                "stage %r keeps %d bytes of its activations after its backward (a module "
                "attribute or a hook holds them): no plan can drop or offload them, so they "
                "count as resident for the whole step. A tensor added to a list or a dict at "
                "every forward is added again by each recomputation of the stage, which no "
                "plan counts: keep such logging out of training steps, or give a budget at "
                "which the plan keeps this stage",
                stage_name,
                m.kept_bytes,
            )
    copied = {name: m.changed_buffer_bytes for name, m in zip(names, measured, strict=True)}
    copied = {name: size for name, size in copied.items() if size}
    if copied:
        logger.warning(
            "%d stage(s) hold buffers that their forward changes or that another stage also "
            "holds (%s): a plan that recomputes one keeps copies of them from before its first "
            "forward, and the new tensor of a buffer the forward replaces, to the end of the "
            "step, %d bytes in all, counted as resident for the whole step",
            len(copied),
            ", ".join(f"{name!r} {size} B" for name, size in copied.items()),
            sum(copied.values()),
        )
    metadata: dict[str, Any] = {
        "device": str(device),
        "kept_by_modules_bytes": kept,
        "shared_gradient_bytes": shared,
        "pinned_gradient_bytes": pinned,
        # Of kept_by_modules_bytes: the leaves stages' graphs hold.
        "graph_leaf_bytes": sum(leaves.values()),
        # The gradients autograd gives them, per stage (see cover_plain_autograd).
        "graph_leaf_grad_bytes": [m.leaf_grad_bytes for m in measured],
        "grouping": {
            stage_name: [block_name for block_name, _ in group]
            for stage_name, group in zip(names, grouped, strict=True)
        },
        "profile": {"warmup": warmup, "repeats": repeats},
    }
    if stages is not None and stages != len(blocks):
        logger.info(
            "grouped %d blocks into %d stages: %s",
            len(blocks),
            len(names),
            "; ".join(f"{n} ({len(g)} blocks)" for n, g in zip(names, grouped, strict=True)),
        )
    link = None
    if bandwidth is not None:
        link = parse_bandwidth(bandwidth)
    elif device.type == "cuda":
        link, metadata["link_measurements"] = measure_link(device)
    chain = Chain(
        name=name or type(model).__name__,
        frozen_stages=frozen_prefix([stage_module(group) for group in grouped], input_tensors),
        # What the modules keep of their activations is resident whatever the plan says:
        # counted with the input, which is resident for the whole step as well.
        input_bytes=storage_bytes(input_tensors) + kept,
        input_grad_bytes=gradient_bytes(input_tensors),
        # The caller's output and the gradient it seeds stay alive to the end of the backward,
        # and so, at most, do the summed gradients of parameters several stages use and the
        # storages parameters' gradients pin.
        held_bytes=chain_stages[-1].out_bytes + chain_stages[-1].grad_bytes + shared + pinned,
        stages=chain_stages,
        link=link,
        metadata=metadata,
    )
    return cover_plain_autograd(chain)


def cover_plain_autograd(chain: Chain, through_first: bool = False) -> Chain:
    """``chain`` with B(L)'s temporary raised, where needed, for its keep-all peak to cover
    plain autograd's.

    A keep-all plan runs as plain autograd (:mod:`offremat._plain`), whose graph the caller's
    loss holds to the end of the step, and with it the leaves stages make in their forward
    and the gradients each B(i) gives them: B(i) runs beside those of the later stages
    (``chain.metadata["graph_leaf_grad_bytes"]``; with ``through_first`` B(1) beside every
    stage's, as the code before a model's chain does its backward in B(1)'s temporary). A
    plan the executor runs lets them go with each stage's graph, so only the keep-all
    schedule's peak must cover them. It is raised at the turn, where plans differ most (B(1)
    holds about as much in every plan), by as much as that takes: nothing where the saved sets
    the backward frees outweigh the gradients it makes. The raise is
    ``chain.metadata["plain_autograd_bytes"]``.
    """
    grads = chain.metadata.get("graph_leaf_grad_bytes") or []
    if not any(grads):
        return chain
    later = [sum(grads[k + 1 :]) for k in range(len(grads))]
    if through_first:
        later[0] += grads[0]
    need = keep_all_peak(raised_backward(chain, later))
    if keep_all_peak(chain) >= need:
        return chain
    # Raised by ``need``, B(L) is the keep-all peak (no other level reaches ``need``), which
    # tells the level in B(L) itself.
    at_turn = keep_all_peak(raised_backward(chain, need)) - need
    covered = raised_backward(chain, need - at_turn)
    covered.metadata["plain_autograd_bytes"] = need - at_turn
    return covered


def hooked_gradient_bytes(parameters: Sequence[torch.Tensor]) -> int:
    """The most that tensor hooks (``register_hook``) on the trainable ``parameters`` add to
    the stage's backward: of the parameter where it is largest, one gradient for a hook, two
    for several. A hook may return a new gradient (a clip), which autograd holds beside its
    own until it accumulates it, and the next hook makes another from it while both live.
    Profiling sets these hooks aside (:func:`offremat._blocks.untouched`), so it never sees
    those gradients; a hook that makes more than one inside is left to the steps' checks."""
    return max(
        (p.numel() * p.element_size() * hook_count(p) for p in parameters if p.requires_grad),
        default=0,
    )


def raised_backward(chain: Chain, extra: int | Sequence[int]) -> Chain:
    """``chain`` with ``extra`` more bytes in B(L)'s temporary, or ``extra[k]`` in stage
    k+1's."""
    if isinstance(extra, int):
        extra = [0] * (chain.length - 1) + [extra]
    stages = tuple(
        dataclasses.replace(stage, bwd_tmp_bytes=stage.bwd_tmp_bytes + more)
        for stage, more in zip(chain.stages, extra, strict=True)
    )
    return dataclasses.replace(chain, stages=stages, metadata=dict(chain.metadata))


def frozen_prefix(stages: Sequence[nn.Module], inputs: Sequence[torch.Tensor]) -> int:
    """How many first stages need no backward: with an input that needs no gradient, those
    before the first with a trainable parameter (all of them: none, as nothing trains)."""
    if any(t.requires_grad for t in inputs):
        return 0
    return next((k for k, stage in enumerate(stages) if scan_modules(stage).trainable), 0)


def stage_modules(model: nn.Module | Sequence[nn.Module], chain: Chain) -> list[nn.Module]:
    """The module of each stage of ``chain``, from the blocks of ``model``."""
    blocks = chain_blocks(model)
    grouping = chain.metadata.get("grouping")
    if grouping is None:
        if chain.length != len(blocks):
            raise ValueError(
                f"the chain has {chain.length} stages but the model has {len(blocks)} blocks and "
                "the chain does not say how they were grouped: profile this model with "
                "offremat.profile_model (or `offremat profile`) to get its chain"
            )
        return [module for _, module in blocks]
    by_name = dict(blocks)
    order = [name for name, _ in blocks]
    listed = [block for name in chain.stage_names for block in grouping.get(name, [])]
    if listed != order:
        raise ValueError(
            f"the chain groups blocks {listed} but the model's blocks are {order}: profile this "
            "model to get its chain"
        )
    return [
        stage_module([(block, by_name[block]) for block in grouping[name]])
        for name in chain.stage_names
    ]


def _profile_all(
    stages: Sequence[tuple[str, nn.Module]],
    example_input: Any,
    warmup: int,
    repeats: int,
    sizes_only: bool = False,
) -> list[Measured]:
    """Profile each stage on the output of the one before, starting from the example input.

    Storages of the example input that a stage passes on (targets, masks) are the input a_0's,
    resident for the whole step and counted once there, never in a stage's sizes.
    """
    tensors, structure = flatten(example_input)
    refuse_hidden_tensors(structure)
    flags = [t.requires_grad and is_differentiable(t) for t in tensors]
    scans = [scan_modules(module) for _, module in stages]
    excluded = set(fixed_storages(scans))
    shared_buffers = shared_buffer_keys([scan.buffers for scan in scans])
    shared = set(unique_storages(tensors))
    value = unflatten([t.detach() for t in tensors], structure)
    # Parameters several stages use: B(L) makes the sums of those the last stage uses, which
    # the chain's held bytes count only from B(L)'s end.
    users = parameter_users([list(module.parameters()) for _, module in stages])
    summed = [p for p, used in users.values() if len(used) > 1 and used[-1] == len(stages)]
    results = []
    for name, module in stages:
        last = len(results) == len(stages) - 1
        # The stage's input as only this loop holds it (a_0's storages are resident anyway).
        inputs = {
            key: weakref.ref(storage)
            for key, storage in unique_storages(flatten(value)[0]).items()
            if key not in excluded | shared
        }
        # Sizes only group blocks into stages; the in-place check is for the stages themselves.
        stage = StageProfile(
            name,
            module,
            value,
            flags,
            excluded | shared,
            not sizes_only,
            shared_buffers,
            summed if last else (),
        )
        measured, output = stage.measure(warmup, repeats, sizes_only, last)
        out_tensors, out_structure = flatten(output)
        refuse_hidden_tensors(out_structure)
        # The grad-enabled forward knows which outputs carry a gradient, as plain autograd.
        flags = [t.requires_grad and is_differentiable(t) for t in out_tensors]
        value = unflatten([t.detach() for t in out_tensors], out_structure)
        passed_on = unique_storages(out_tensors).keys()
        del stage, output, out_tensors
        # An input still alive that the stage does not pass on is held by its modules (an
        # attribute, a forward hook that keeps a layer's input for a feature loss): the
        # previous stage made it, so no allocation of this one saw it, and a plan that drops
        # or offloads that checkpoint measured up to 1.46 times its budget (a hunt).
        held = sum(
            storage.nbytes()
            for key, ref in inputs.items()
            if key not in passed_on and (storage := ref()) is not None
        )
        results.append(dataclasses.replace(measured, kept_bytes=measured.kept_bytes + held))
    _refuse_shared_outside_leaves([name for name, _ in stages], results)
    return results


def _refuse_shared_outside_leaves(names: Sequence[str], measured: Sequence[Measured]) -> None:
    """Refuse stages that reach one tensor requiring grad that is no parameter of theirs.

    Each B(i) is its own engine call: a tensor several stages use gets its gradient added to
    ``.grad`` stage by stage, where plain autograd adds their sum once (equal up to rounding
    only, from the second step of accumulation on, and its hooks run once per stage). For
    parameters the executor sums the parts first (:mod:`offremat._shared_grads`), but it
    knows a stage's parameters by its modules': a parameter kept in each block's
    ``__dict__`` gave gradients that differ from plain autograd's (a review).
    """
    users: dict[int, list[str]] = {}
    for name, m in zip(names, measured, strict=True):
        for key in m.outside_leaves:
            users.setdefault(key, []).append(name)
    shared = [stages for stages in users.values() if len(stages) > 1]
    if shared:
        raise ValueError(
            f"stages {', '.join(repr(s) for s in shared[0])} all use one tensor that requires "
            "grad and is no parameter of their modules (kept in a module's __dict__, a "
            "closure or a global): offremat runs each stage's backward on its own and would "
            "add its gradient to .grad stage by stage, where plain autograd adds their sum "
            "once. Register it as a parameter of each module that uses it (an nn.Parameter "
            "attribute, tied as shared weights are), or leave those blocks out of the chain "
            "(blocks=)"
        )
