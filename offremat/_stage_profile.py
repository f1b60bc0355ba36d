"""One stage measured as the executor runs it, for :func:`offremat.profiler.profile_model`.

The forward and backward times, the output and saved-set bytes (distinct storages, as
:mod:`offremat._stage` holds them), the transient peaks of each pass (on every device, from
:class:`offremat.measure.StepMemory`), the gradient bytes, and the time of a refill: a forward
rerun up to the last tensor the stage's backward saves (:mod:`offremat._deferred`).
"""

from __future__ import annotations

import dataclasses
import statistics
import weakref
from collections.abc import Sequence
from contextlib import ExitStack
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from offremat._buffers import FirstForward, buffer_copy_bytes
from offremat._call_checks import refuse_disabled_saved_tensor_hooks
from offremat._clock import MarkingPacker, mark, seconds, timed
from offremat._ctx_tensors import refuse_hidden_saved, refuse_tensors_on_ctx
from offremat._fsdp import sharded_parameters
from offremat._graph_leaves import GraphLeaf, graph_leaves, graph_run_before
from offremat._pinned_grads import PinnedGradients
from offremat._scan import scan_modules
from offremat._stage import (
    GradSlot,
    SavedTensorPacker,
    check_unmodified,
    enter_stage,
    norm_statistics_bytes,
)
from offremat._stage_figures import Measured
from offremat._tensors import (
    copied,
    flatten,
    gradient_bytes,
    refuse_sparse_outputs,
    storage_allocated_bytes,
    storage_key,
    unflatten,
    unique_storages,
    version_of,
)
from offremat.measure import Allocations, StepMemory


class StageProfile:
    """One stage run as the executor runs it: the same boundary, hooks and gradient flow."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        value: Any,
        flags: list[bool],
        excluded: set[int],
        check_inputs: bool = True,
        shared_buffers: frozenset[int] = frozenset(),
        summed: Sequence[torch.Tensor] = (),
    ):
        self.name = name
        self.module = module
        self.tensors, self.structure = flatten(value)
        self.device = self.tensors[0].device if self.tensors else torch.device("cpu")
        self.excluded = excluded
        self.diff = [k for k, flag in enumerate(flags) if flag]
        self.anchor = torch.empty(0, device=self.device, requires_grad=True)
        self.check_inputs = check_inputs
        self.shared_buffers = shared_buffers
        # Parameters other stages use too, whose gradient sum this backward makes: in a step it
        # holds each part from when it is made (offremat._shared_grads), where a gradient of
        # the stage's alone is added to .grad and freed.
        self.summed = list(summed)
        self.sparse_grads: frozenset[int] = frozenset()  # the last backward's (see Measured)

    def forward(
        self, grad: bool, marks: list[Any] | None = None, hooks: bool = True
    ) -> tuple[Any, GradSlot, SavedTensorPacker]:
        """One forward; with ``grad``, through the executor's boundary and (unless not
        ``hooks``) pack hooks. With ``marks``, a clock mark (:func:`offremat._clock.mark`) at
        its start and at each tensor it holds. The slot takes gradients only in
        :meth:`backward`, as in a step: a later stage's backward that reaches this graph (a
        tensor of this stage kept on a module and read there) raises."""
        slot = GradSlot(self.name)
        if marks is None:
            packer = SavedTensorPacker(self.name, self.tensors, self.excluded)
        else:
            marks.append(mark(self.device))
            packer = MarkingPacker(self.name, self.tensors, self.excluded, marks, self.device)
        versions = [version_of(t) for t in self.tensors]
        with ExitStack() as stack:
            if grad:
                stack.enter_context(torch.enable_grad())
                if hooks:
                    # A new shape or kind of input, profiled in a step, also meets it here.
                    refuse_disabled_saved_tensor_hooks("offremat profiles a stage")
                    stack.enter_context(packer.hooks())
                inputs = enter_stage(self.tensors, self.diff, slot, self.anchor)
            else:
                # As the executor runs it: a stage of which nothing needs a gradient (frozen)
                # with grad mode on, as plain autograd does, which code may read.
                frozen = not self.diff and not any(
                    p.requires_grad for p in self.module.parameters()
                )
                stack.enter_context(torch.enable_grad() if frozen else torch.no_grad())
                inputs = self.tensors
            output = self.module(unflatten(inputs, self.structure))
        refuse_sparse_outputs(self.name, flatten(output)[0], self.tensors)
        if self.check_inputs:
            check_unmodified(self.name, self.tensors, versions)
        return output, slot, packer

    @staticmethod
    def incoming(output: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The outputs that carry a gradient, and a δ_i for them (resident before B(i))."""
        outputs = [t for t in flatten(output)[0] if t.requires_grad]
        return outputs, [torch.ones_like(t) for t in outputs]

    def backward(
        self, outputs: list[torch.Tensor], grads: list[torch.Tensor], slot: GradSlot
    ) -> list[torch.Tensor]:
        """B(i) as in training: parameter gradients accumulate, δ_{i-1} lands in the slot."""
        if outputs:
            slot.receiving = True
            try:
                torch.autograd.backward(outputs, grads)
            except RuntimeError as error:
                if "backward through the graph a second time" not in str(error):
                    raise
                raise RuntimeError(graph_run_before(self.name, None)) from error
            finally:
                slot.receiving = False
        return [g for g in slot.grads or () if g is not None]

    def _backward_temporary(
        self, pending: list[Any], last: bool, saved_bytes: int
    ) -> tuple[int, Any]:
        """B(i)'s temporary: its peak above δ_i, x̄_i and what stays, net of the outputs it lets
        go, and the outputs handed to the next stage.

        ``pending`` is ``[output, slot, saved]`` (the forward's output and slot, and the
        storages it left, by key), handed over: the caller keeps no reference to them, so that
        what B(i) frees is freed.
        """
        output, slot, saved = pending
        pending.clear()
        # The outputs this stage made go to the next stage as copies, so that the backward
        # below holds them only as B(i) does: the chain's output stays (its caller holds it);
        # any other goes as B(i) starts, or once the node that saved it has run
        # (offremat._step_compute). The backward frees the saved tensors as it goes.
        out_tensors = flatten(output)[0]
        out_storages = unique_storages(out_tensors)
        inputs = unique_storages(self.tensors)
        made = set() if last else out_storages.keys() - self.excluded - inputs.keys()
        handed = unflatten(copied(out_tensors, made), flatten(output)[1])
        backward_memory = StepMemory(
            self.device,
            existing=[
                s
                for k, s in saved.items()
                if k not in self.excluded and (k not in out_storages or k in made)
            ],
        )
        # Measured from after that release: the peak above a baseline that still held them
        # could not fall below it, and bytes let go at once would read as no change at all.
        # Only what really goes: a module that keeps its output (as logging code does), or a
        # node that saved it, holds it.
        unsaved = [
            (weakref.ref(s), storage_allocated_bytes(s))
            for k, s in out_storages.items()
            if k in made
        ]
        outputs, grads = self.incoming(output)
        roots = [get_gradient_edge(t) for t in outputs]
        del saved, out_storages, inputs, output, outputs
        out_tensors.clear()  # the profiler's last reference to the outputs, as at B(i)'s start
        let_go = sum(nbytes for storage, nbytes in unsaved if storage() is None)
        del unsaved
        kept_grads = [p.grad for p in self.summed]
        for parameter in self.summed:
            parameter.grad = None  # the part made lands in .grad, and stays
        try:
            with backward_memory:
                produced = sum(
                    map(
                        storage_allocated_bytes,
                        unique_storages(self.backward(roots, grads, slot)).values(),
                    )
                )
        finally:
            self.sparse_grads = frozenset(
                id(p) for p in self.summed if p.grad is not None and p.grad.layout != torch.strided
            )
            for parameter, grad in zip(self.summed, kept_grads, strict=True):
                parameter.grad = grad
        # The incoming gradient δ_i existed before the backward; δ_{i-1} is counted by the plan.
        # Negative when the backward has freed part of x̄_i by its peak (solvers.chain.Stage).
        return max(backward_memory.step_peak_bytes - produced - let_go, -saved_bytes), handed

    def _graph_leaves(
        self, outputs: Sequence[torch.Tensor], slot: GradSlot
    ) -> dict[int, GraphLeaf]:
        """The leaves of the forward's graph that are not the stage's inputs, parameters or
        buffers (see :func:`offremat._graph_leaves.graph_leaves`)."""
        known = self.excluded | unique_storages(self.tensors).keys()
        known.add(storage_key(self.anchor))
        return graph_leaves(outputs, slot, known, self.name)

    def _unhooked_backward_temporary(self, last: bool, saved_bytes: int) -> int:
        """B(i)'s temporary after a forward without saved-tensor hooks, as autograd alone runs
        it: every storage that forward left is x̄_i or an output."""
        allocations = Allocations(self.device)
        with allocations:
            output, slot, _ = self.forward(grad=True, hooks=False)
        pending = [output, slot, allocations.alive()]
        del output, slot, allocations
        return self._backward_temporary(pending, last, saved_bytes)[0]

    def measure(
        self, warmup: int, repeats: int, sizes_only: bool, last: bool
    ) -> tuple[Measured, Any]:
        """Sizes and temporaries, measured independently (:mod:`offremat.measure`); times.
        ``last``: the chain's last stage, whose outputs its caller keeps through B(i)."""
        # In a training step after the first, gradients exist: a backward holds only transient
        # parameter gradients, added to them, which count as its temporaries. Here each one
        # lands in .grad and is let go at once, the same transient, with no gradients made
        # beside the caller's, which a new shape profiled mid-training would hold twice (a
        # hunt: a ConvNeXt step 2.7 times its budget). Gradients several stages sum
        # (offremat._shared_grads), and those FSDP2 reduces, which autograd does not
        # accumulate, exist as before.
        made = [p for p in self.module.parameters() if p.requires_grad and p.grad is None]
        sharded = {id(p) for p in sharded_parameters([self.module])}
        summed = {id(p) for p in self.summed}
        for parameter in made:
            if id(parameter) in summed or id(parameter) in sharded:
                parameter.grad = torch.zeros_like(parameter)
        pinned = PinnedGradients()
        handles = [
            p.register_post_accumulate_grad_hook(pinned.let_go) for p in made if p.grad is None
        ]
        try:
            sizes, handed = self._measure(warmup, repeats, sizes_only, last)
        finally:
            for handle in handles:
                handle.remove()
            for parameter in made:
                parameter.grad = None
        sparse = sizes.sparse_grads | pinned.sparse
        return dataclasses.replace(sizes, pinned_grads=pinned.pinned(), sparse_grads=sparse), handed

    def _measure(
        self, warmup: int, repeats: int, sizes_only: bool, last: bool
    ) -> tuple[Measured, Any]:
        if self.device.type == "cuda":  # first-call workspaces (autotuning) are no temporaries
            output, slot, _ = self.forward(grad=True)
            self.backward(*self.incoming(output), slot)
            del output, slot
        # A recomputed stage's copies of the buffers its forward changes, and of those other
        # stages hold, live to the end of the step (offremat._buffers): made here before the
        # measurement, which they are not part of.
        scan = scan_modules(self.module)
        slots = scan.buffers
        before = [module._buffers[name] for module, name in slots]
        buffers = FirstForward(tuple(self.module.modules()), slots, shared=self.shared_buffers)
        allocations = Allocations(self.device)
        with allocations, StepMemory(self.device) as forward_memory:
            output, slot, packer = self.forward(grad=True)
        buffers.finish(self.name)
        # By key and size only: holding a storage here would keep it past the backward.
        left = {key: storage.nbytes() for key, storage in allocations.alive().items()}
        # A buffer the forward replaces (self.gain = self.gain * 0.999) leaves its new tensor,
        # made during the step, to its end, while the graph may still hold the old one.
        replaced = [
            s for s, old in zip(slots, before, strict=True) if s[0]._buffers[s[1]] is not old
        ]
        changed_buffers = buffer_copy_bytes(list(buffers.copies)) + buffer_copy_bytes(replaced)
        del buffers, before
        out_tensors = flatten(output)[0]
        refuse_tensors_on_ctx(self.name, out_tensors, self.excluded)
        leaves = self._graph_leaves(out_tensors, slot)
        grad_bytes = gradient_bytes(out_tensors)
        out_storages = unique_storages(out_tensors)
        out_bytes = sum(
            storage_allocated_bytes(s) for k, s in out_storages.items() if k not in self.excluded
        )
        saved = {**packer.saved_storages(), **out_storages}
        # A recomputation saves copies of moving norms' statistics (offremat._stage).
        saved_bytes = sum(
            storage_allocated_bytes(s) for k, s in saved.items() if k not in self.excluded
        ) + norm_statistics_bytes(scan.norms)
        unsaved_leaves = leaves.keys() - saved.keys()
        seen = saved.keys() | leaves.keys()
        pending = [output, slot, saved]
        del output, slot, saved, packer, out_storages, out_tensors
        bwd_tmp, handed = self._backward_temporary(pending, last, saved_bytes)
        # The next stage reads only values and flags: cut from this graph, so that the last
        # stage's output no longer holds it, and what only the graph held goes.
        handed_tensors, handed_structure = flatten(handed)
        handed = unflatten(
            [t.detach().requires_grad_(t.requires_grad) for t in handed_tensors],
            handed_structure,
        )
        del handed_tensors
        # Leaves that went with the graph were held by it alone (what a module still holds
        # is counted as kept below). In a step the first forward's graph holds them whatever
        # the plan says, to B(i) or, where a forward with autograd recomputes the stage before
        # B(i)'s refill, to the end of the step (offremat._deferred): counted for the whole
        # step (profiler.py). That recomputation makes them again, held to B(i): counted in
        # x̄_i as well. Plain autograd holds them, and from B(i) their gradients, to the end.
        gone = {key: leaf for key, leaf in leaves.items() if leaf.storage() is None}
        outside = frozenset(leaves.keys() - gone.keys())
        leaf_bytes = sum(leaf.nbytes for leaf in gone.values())
        leaf_grad_bytes = sum(leaf.grad_bytes for leaf in gone.values())
        saved_bytes += sum(gone[key].nbytes for key in unsaved_leaves & gone.keys())
        del leaves, gone, unsaved_leaves
        # What outlives the backward but for the output handed on and the modules' state is
        # kept by the modules (an attribute, a hook): held whatever the plan says. Measured
        # before another forward replaces it.
        state = unique_storages([*self.module.parameters(), *self.module.buffers()])
        kept = allocations.alive_bytes(unique_storages(flatten(handed)[0]), state)
        # What the forward left and the backward freed but offremat's packer never saw, the
        # graph held past its hooks. Not seen on CUDA (see Allocations), nor looked for in a
        # distributed run, where FSDP2 holds buffers of its own from a forward to its backward.
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            accounted = seen | allocations.alive().keys()
            refuse_hidden_saved(self.name, sum(s for k, s in left.items() if k not in accounted))
            del accounted
        del allocations, left
        # Without saved-tensor hooks (plain autograd, a forward the executor runs directly)
        # autograd lets a saved tensor go after its node, not once unpacked, so a node can hold
        # more at once (a bias gradient beside a weight gradient's input): the larger counts.
        bwd_tmp = max(bwd_tmp, self._unhooked_backward_temporary(last, saved_bytes))
        with StepMemory(self.device) as plain_memory:
            try:
                plain_output = self.forward(grad=False)[0]
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as error:
                raise RuntimeError(
                    f"stage {self.name!r} fails under torch.no_grad(), where the profiler runs "
                    "it to measure a forward without autograd (and evaluation runs it): "
                    f"{error}. Make its forward work without autograd too (call "
                    "register_hook only on tensors that require grad)"
                ) from error
        # A forward without autograd (F_ck, F_none) frees its intermediates as it goes, so its
        # transient peak above its output differs from the grad-enabled one above x̄_i.
        # The first forward of a stage that a plan recomputes runs beside a copy of its
        # buffers, which it keeps only of those it changes (offremat._buffers).
        copies = buffer_copy_bytes(slots)
        fwd_tmp = max(forward_memory.step_peak_bytes - saved_bytes, 0) + copies
        nograd_fwd_tmp = max(plain_memory.step_peak_bytes - out_bytes, 0) + copies
        del plain_output
        sizes = Measured(
            0.0,
            0.0,
            out_bytes,
            saved_bytes,
            fwd_tmp,
            bwd_tmp,
            nograd_fwd_tmp,
            grad_bytes,
            kept_bytes=kept,
            changed_buffer_bytes=changed_buffers,
            leaf_bytes=leaf_bytes,
            leaf_grad_bytes=leaf_grad_bytes,
            outside_leaves=outside,
            sparse_grads=self.sparse_grads,
        )
        if sizes_only:
            return sizes, handed
        forward_times, backward_times, refill_times = [], [], []
        for attempt in range(warmup + repeats):
            marks: list[Any] = []
            (timed_output, timed_slot, _), forward_s = timed(
                self.device, partial(self.forward, True, marks)
            )
            incoming = self.incoming(timed_output)
            _, backward_s = timed(self.device, partial(self.backward, *incoming, timed_slot))
            if attempt >= warmup:
                forward_times.append(forward_s)
                backward_times.append(backward_s)
                # A refill (offremat._deferred) runs this forward up to the last tensor it
                # holds, and nothing at all for a stage that holds none.
                refill_times.append(seconds(self.device, marks[0], marks[-1]))
            del timed_output, timed_slot, incoming
        forward_s = statistics.median(forward_times)
        timed_figures = {
            "fwd_s": forward_s,
            "bwd_s": statistics.median(backward_times),
            "refill_s": min(statistics.median(refill_times), forward_s),
        }
        return dataclasses.replace(sizes, **timed_figures), handed
