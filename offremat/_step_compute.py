"""The compute operations of a step: F_all, F_ck and F_none, the refill before B(i), and B(i).

A mixin of :class:`offremat._step._Step`, which owns the state these methods read and change
(where each plan tensor is, the step's RNG states and kept graphs); the design notes of
:mod:`offremat.executor` and :mod:`offremat._stage` apply. :class:`PlanTensor` is one of the
plan's tensors as the step holds it.
"""

from __future__ import annotations

from contextlib import ExitStack, suppress
from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from offremat._buffers import (
    FirstForward,
    attribute_values,
    reinstated,
    replayed_attributes,
    replayed_buffers,
)
from offremat._deferred import (
    DeferringPacker,
    Refill,
    StopRecomputation,
)
from offremat._graph_saved import graph_saved_bytes, sequence_mark
from offremat._held import StorageRecord, TensorRef
from offremat._rng import RngState, replayed_rng
from offremat._stage import (
    GradSlot,
    SavedTensorPacker,
    check_unmodified,
    check_versions,
    enter_stage,
    frozen_running_stats,
)
from offremat._step_errors import (
    graph_run_before,
    reducer_found_unused,
    reducer_saw_shared,
    refuse_other_outputs,
    shared_weight_graph,
)
from offremat._tensors import (
    Structure,
    flatten,
    is_differentiable,
    refuse_hidden_tensors,
    storage_key,
    tensor_kind,
    unflatten,
    version_of,
)
from solvers.plan import (
    F_ALL,
    SAVED,
    Op,
)
from solvers.semantics import effect, released


class PlanTensor:
    """One of the plan's tensors (a_i, x̄_i or δ_i): references to its tensors, storages held.

    For x̄_i, ``edges`` are the gradient edges of stage i's outputs (the roots of B(i)),
    ``packer`` holds what autograd saved and ``slot`` receives δ_{i-1}.
    """

    __slots__ = ("diff", "edges", "packer", "records", "refs", "slot", "structure")

    def __init__(
        self,
        refs: list[TensorRef | None],
        structure: Structure | None,
        records: tuple[StorageRecord, ...],
    ):
        self.refs = refs
        self.structure = structure
        self.records = records
        self.edges: list[GradientEdge | None] = []
        self.packer: SavedTensorPacker | None = None
        self.slot: GradSlot | None = None
        self.diff: list[int] = []

    @property
    def tensors(self) -> list[torch.Tensor | None]:
        """The tensors, over the storages resident now."""
        return [None if ref is None else ref.get() for ref in self.refs]


@dataclass
class KeptGraph:
    """The graph of a stage's latest F_ck or F_none, its saved tensors still to recompute."""

    packer: DeferringPacker
    slot: GradSlot | None
    diff: list[int]
    edges: list[GradientEdge | None]


class Compute:
    """F(i), the refill of F_all(i) right before B(i), and B(i) on a step's state."""

    def _forward(self, op: Op, direct: bool = False) -> None:
        """Run F(i); a ``direct`` F_all leaves its saved set to autograd's graph (no hooks)."""
        i = op.index
        name = self.names[i - 1]
        stage = self.executor.stages[i - 1]
        source = self._source(i)
        gone = released(op, self.on_device)
        self.residency.use(source.records)
        # A checkpoint changed in place since it was made would recompute another activation.
        check_versions(name, source.refs)
        inputs = source.tensors
        first = i not in self.flags
        if first:
            # Only a stage the plan runs forward again replays its random numbers.
            replays = i in self.executor.recomputed
            rng = (
                RngState.capture(self.cuda_devices, self.generators[i - 1], self.host_random)
                if replays
                else None
            )
        else:
            rng = self.rng.get(i)
        versions = [version_of(tensor) for tensor in inputs]
        kept = self.kept.get(i)
        if kept is not None and op.kind == F_ALL:
            # Its backward will run on this forward's graph: the tensors the kept graph
            # saved, which the model may hold and have changed, are checked as B(i) would.
            check_versions(name, kept.packer.slots)
        watch = None
        if first and i in self.executor.recomputed:
            watch = FirstForward(
                self.modules[i - 1],
                self.buffers[i - 1],
                self.parameters[i - 1],
                self.shared_buffers,
            )
        packer = slot = None
        mark = None
        diff: list[int] = []
        with ExitStack() as stack:
            if not first:
                _leave_inference_mode(stack)
                if rng is not None:
                    stack.enter_context(replayed_rng(rng))
                stack.enter_context(self.backend_flags.applied())
                self._enter_replay(stack, i, name, refill=False)
            for state in self.autocast:
                state.enter(stack)
            # Grad mode on, as plain autograd runs every stage, also one of which nothing
            # needs a gradient (frozen: autograd records nothing), since code may read the
            # mode (an inference fast path under no_grad computed other numbers). F_ck and
            # F_none keep their graph without its saved tensors (see _deferred).
            stack.enter_context(torch.enable_grad())
            grad = op.kind == F_ALL or self.trainable[i - 1] or any(self.flags[i - 1])
            if grad:
                diff = [k for k, flag in enumerate(self.flags[i - 1]) if flag]
                direct = direct and i not in self.executor.hooked
                # A direct F_all's graph is read, unless this step saw x̄_i already (a
                # recomputation) or no budget asks what it holds.
                read = direct and i not in self.sizes.seen
                read = read and self.executor.plan.budget_bytes is not None
                if op.kind == F_ALL and not direct:
                    packer = SavedTensorPacker(name, inputs, self.excluded)
                elif op.kind != F_ALL:
                    expected = self.executor.pack_counts.get(i)
                    changes = i in self.executor.changes_saved
                    packer = DeferringPacker(name, inputs, self.excluded, expected, changes)
                slot = GradSlot(name)
                inputs = enter_stage(inputs, diff, slot, self.anchor)
                if op.kind == F_ALL and read:
                    mark = sequence_mark(self.anchor)
                if packer is not None:
                    packer.slot = slot
                    stack.enter_context(packer.hooks())
                if isinstance(packer, DeferringPacker):
                    stack.enter_context(packer.watching())
            result = stage(unflatten(inputs, source.structure))
        check_unmodified(name, source.tensors, versions)
        if watch is not None:
            watch.finish(name)
            self.first_forwards[i] = watch
        tensors, structure = flatten(result)
        refuse_hidden_tensors(structure)
        del result
        kinds = [tensor_kind(t) for t in tensors]
        if first:
            self.output_kinds[i] = kinds
            self.flags[i] = self._gradient_flags(i, grad, inputs, tensors)
            if rng is not None:
                self.rng[i] = rng.for_replay(self.host_random)
            del rng
        elif kinds != self.output_kinds[i]:
            refuse_other_outputs(name, self.output_kinds[i], kinds)
        del inputs
        is_output = i == self.length and self.outputs is None and not self.in_backward
        if is_output:
            self.outputs, self.output_structure = tensors, structure
        refs = [TensorRef(t.detach(), original=t) for t in tensors]
        held = refs + (packer.refs if packer is not None else [])
        records = self.residency.hold(held, movable=not is_output)
        outputs = [ref.record for ref in refs if ref.record is not None]
        # Of x̄_i, what the step does not hold itself: a recomputed stage's forward let it go,
        # and a direct F_all leaves it to autograd's graph.
        found = graph_saved_bytes(tensors, [mark], self.excluded) if mark is not None else None
        if isinstance(packer, DeferringPacker):
            saved = dict(packer.saved_bytes)
        else:
            saved = found[0][0] if found is not None else {}
        if found is not None and found[1]:
            self.executor.hooked.add(i)  # a node hid what it saved: hooks see it from now on
        saved.update((record.key, record.nbytes) for record in records)
        self.sizes.note(
            i,
            {record.key: record.nbytes for record in outputs},
            saved,
            {record.key for record in source.records},
            seen=mark is None or found is not None,
        )
        produced = PlanTensor(refs, structure, records)
        edges = [get_gradient_edge(t) if t.requires_grad else None for t in tensors]
        if packer is not None:
            packer.inputs = []  # B(i) binds whichever copy of a_{i-1} is resident then
        if op.kind == F_ALL:
            produced.edges = edges
            produced.packer, produced.slot, produced.diff = packer, slot, diff
        elif isinstance(packer, DeferringPacker):
            self.kept[i] = KeptGraph(packer, slot, diff, edges)
            # The latest count: a compiled stage's first forward runs eagerly (_deferred).
            self.executor.pack_counts[i] = len(packer.slots)
            if packer.changed_after_saving:
                self.executor.changes_saved.add(i)
        del edges
        del tensors
        key = effect(op).allocates
        assert key is not None
        self.on_device[key] = produced
        if self.streams is not None:
            self.produced[key] = self.streams.compute.record_event()
        self.peak = max(self.peak, self.residency.live_bytes)
        for key in gone:
            self._drop_resident(key)

    def _gradient_flags(
        self, i: int, grad: bool, inputs: list[torch.Tensor], outputs: list[torch.Tensor]
    ) -> list[bool]:
        """Which of a_i's tensors carry a gradient in plain autograd.

        A grad-enabled forward knows it from autograd. A forward without autograd assumes so
        for every floating output of a stage with a trainable parameter or a gradient-carrying
        input, except what it passes on unchanged from an input without one (a target, a mask).
        """
        if grad:
            return [t.requires_grad and is_differentiable(t) for t in outputs]
        upstream = self.trainable[i - 1] or any(self.flags[i - 1])
        constant = {
            storage_key(t) for t, flag in zip(inputs, self.flags[i - 1], strict=True) if not flag
        }
        return [
            upstream and is_differentiable(t) and storage_key(t) not in constant for t in outputs
        ]

    def _enter_replay(self, stack: ExitStack, i: int, name: str, refill: bool) -> None:
        """Enter the context of a recomputation of stage i, in this order: the parameters and
        buffers its first forward used (``torch.func.functional_call`` puts the module's own
        back before the backward), which the others read; copies of its moving norms'
        running statistics and of its buffers as its first forward found them (its parameters
        as that forward used them, else refused); its modules' attributes as that forward
        found them (see offremat._buffers). The copies are saved like activations: a kept
        F_ck or F_none graph lets them go, and its refill makes them again (see _stage)."""
        first_forward = self.first_forwards.get(i)
        if first_forward is not None:
            stack.enter_context(reinstated(first_forward.registered))
        if self.norms[i - 1]:
            stack.enter_context(frozen_running_stats(self.norms[i - 1]))
        if first_forward is not None:
            first_forward.check_recomputable(name)
            if first_forward.copies:
                stack.enter_context(replayed_buffers(first_forward.copies))
        modules = self.modules[i - 1]
        seen = attribute_values(modules) if first_forward is None else first_forward.attributes
        stack.enter_context(replayed_attributes(seen, refill))

    def _refill(self, i: int) -> None:
        """F_all(i) right before B(i), on the graph an earlier forward kept: see _deferred."""
        kept = self.kept.pop(i)
        name = self.names[i - 1]
        source = self._source(i)
        self.residency.use(source.records)
        check_versions(name, source.refs)
        refs = []
        if not kept.packer.empty:
            refill = Refill(kept.packer)
            rng = self.rng.get(i)
            with ExitStack() as stack:
                _leave_inference_mode(stack)
                if rng is not None:
                    stack.enter_context(replayed_rng(rng))
                stack.enter_context(self.backend_flags.applied())
                self._enter_replay(stack, i, name, refill=True)
                for state in self.autocast:
                    state.enter(stack)
                stack.enter_context(torch.enable_grad())
                inputs = enter_stage(source.tensors, kept.diff, GradSlot(), self.anchor)
                stack.enter_context(refill.running())
                with suppress(StopRecomputation):
                    self.executor.stages[i - 1](unflatten(inputs, source.structure))
                if not refill.complete:
                    raise refill.incomplete()
                del inputs
            refs = refill.refs
        produced = PlanTensor([], None, self.residency.hold(refs))
        produced.edges, produced.packer = kept.edges, kept.packer
        produced.slot, produced.diff = kept.slot, kept.diff
        self.on_device[(SAVED, i)] = produced
        if self.streams is not None:
            self.produced[(SAVED, i)] = self.streams.compute.record_event()
        self.peak = max(self.peak, self.residency.live_bytes)

    def _backward(self, op: Op) -> None:
        i = op.index
        saved = self.on_device[(SAVED, i)]
        grad = self.grads[i]
        source = self._source(i)
        self.residency.use(saved.records)
        self.residency.use(source.records)
        assert saved.slot is not None
        if saved.packer is not None:
            saved.packer.inputs = source.tensors
            saved.packer.residency = self.residency
        if i < self.length:
            # B(i) starts from its outputs' gradient edges, and reads their values only where
            # a node saved them (those references go as autograd takes them): the step lets
            # them go now, as plain autograd has by the time this backward runs. The chain's
            # output is the caller's, and stays.
            for ref in saved.refs:
                if ref is not None:
                    ref.tensor = None
                    self.residency.unpacked(ref)
        pairs = [
            (edge, g)
            for edge, g in zip(saved.edges, grad.tensors, strict=True)
            if g is not None and edge is not None
        ]
        saved.slot.receiving = True
        try:
            if self.accumulate:  # parameters several stages use: see offremat._shared_grads
                self.shared.backward(i, [e for e, _ in pairs], [g for _, g in pairs])
            elif pairs and saved.diff:
                # Without accumulation only the path to the stage's inputs runs: through
                # StageInput, whose input is the anchor.
                torch.autograd.backward(
                    [e for e, _ in pairs], [g for _, g in pairs], inputs=[self.anchor]
                )
        except RuntimeError as error:
            if "mark a variable ready only once" in str(error):
                if self.shared.used_by.get(i):
                    raise reducer_saw_shared(self.names[i - 1]) from error
                raise reducer_found_unused(self.names[i - 1]) from error
            if "a second time" not in str(error):
                raise
            if any(not p.is_leaf for p in self.parameters[i - 1]):
                raise shared_weight_graph(self.names[i - 1]) from error
            raise graph_run_before(self.names[i - 1]) from error
        finally:
            saved.slot.receiving = False
        grads: list[torch.Tensor | None] = [None] * len(source.refs)
        for k, g in zip(saved.diff, saved.slot.grads or (), strict=False):
            grads[k] = g
        saved.slot.grads = None
        refs = [None if g is None else TensorRef(g) for g in grads]
        del grads, pairs
        held = self.residency.hold(r for r in refs if r is not None)
        self.grads[i - 1] = PlanTensor(refs, None, held)
        self.peak = max(self.peak, self.residency.live_bytes)
        gone = self.grads.pop(i)
        self.residency.drop(gone.records)
        # Nothing reads them again: their host copies go too.
        for key in effect(op).dead:
            self._drop(key)


def _leave_inference_mode(stack: ExitStack) -> None:
    """A recomputation that a backward inside ``torch.inference_mode`` runs (plain autograd
    allows that backward) records its graph, as the forward did."""
    if torch.is_inference_mode_enabled():
        stack.enter_context(torch.inference_mode(False))
