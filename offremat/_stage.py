"""Running one stage of the chain the way both the profiler and the executor need it.

Design notes (the invariants that make a plan's gradients those of plain autograd).

- Boundary. A grad-enabled forward of stage i (F_all) starts from its input a_{i-1} through
  :class:`StageInput`, an identity autograd function whose backward only records the gradient
  δ_{i-1}. The stage's graph therefore ends at the boundary and keeps no reference to a_{i-1}:
  what autograd saves from a_{i-1} is packed as a description (:class:`InputView`) and
  unpacked from whichever copy of a_{i-1} is resident when B(i) runs, a recomputed one or a
  prefetched one. This is rotor's x̄_i, which excludes a_{i-1} (Herrmann, Beaumont et al.
  2019). A forward that the plan leaves in place until its backward packs nothing: its graph
  keeps its saved tensors, a_{i-1} included (see "Direct forwards" in
  :mod:`offremat.executor`).
- Saved set. Everything else autograd saves, except parameters and buffers, is recorded by
  storage: with the stage's outputs, that is x̄_i, what the profiler measures as
  ``saved_bytes`` and what the executor offloads. Packing returns a detached alias: packing a
  stage output as itself would make a reference cycle through its ``grad_fn``.
- RNG. The first forward of a stage in a step runs on the global generators as plain autograd
  would; every later forward of the stage (a recomputation) replays their state before it
  (``offremat/_rng.py``).
- BatchNorm. A recomputation must not move running statistics a second time: it runs against
  throw-away copies of the normalisation buffers.
- Autocast. Every forward the executor runs (the first one and every recomputation) runs
  under the autocast state that was active when the step's forward ran, with autocast's
  weight cache off: the cache would keep each stage's low-precision weight copies alive until
  the caller's autocast region ends, and nothing counts them. A recomputation also runs under
  the forward's kernel and precision settings (:mod:`offremat._backend_flags`).
- torch.compile. The pack and unpack hooks run inside compiled blocks (their saved tensors
  are packed by the compiled function) and are never traced: dynamo would guard on offremat's
  bookkeeping and recompile the hooks every step.
- In-place changes. Saved-tensor hooks switch off autograd's version check, so
  :class:`SavedTensorPacker` records each saved tensor's version and compares it when
  unpacking, raising autograd's own error with the stage's name.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from offremat._call_state import innermost_saved_tensor_hooks
from offremat._held import TensorRef
from offremat._memory import Residency
from offremat._scan import NORM_STATISTICS
from offremat._tensors import storage_key, tensor_over, unique_storages, version_of


class GradSlot:
    """Where :class:`StageInput` leaves the gradients of a stage's inputs (δ_{i-1}).

    A step's slot names its stage and takes gradients only while the step runs that stage's
    backward (``receiving``): one arriving at another time came into the stage's graph from
    outside, through a tensor made inside the stage that the caller kept (a forward hook, an
    auxiliary loss stored as an attribute), and would be lost.
    """

    def __init__(self, stage: str | None = None) -> None:
        self.grads: tuple[torch.Tensor | None, ...] | None = None
        self.stage = stage
        self.receiving = stage is None


class StageInput(torch.autograd.Function):
    """Identity on a stage's differentiable inputs; its backward stores their gradients.

    ``anchor`` is a zero-element tensor that requires grad, so that the outputs require grad
    whatever the inputs do.
    """

    @staticmethod
    def forward(ctx: Any, slot: GradSlot, anchor: torch.Tensor, *tensors: torch.Tensor) -> Any:
        ctx.slot = slot
        ctx.set_materialize_grads(False)
        return tuple(tensor.detach() for tensor in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        if not ctx.slot.receiving:
            raise escaped_tensor_error(ctx.slot.stage)
        ctx.slot.grads = grads
        return (None, None, *([None] * len(grads)))


def escaped_tensor_error(stage: str | None) -> RuntimeError:
    """The error for a gradient reaching a stage's graph other than through its output."""
    return RuntimeError(
        f"a tensor computed inside stage {stage!r} reaches the loss other than through the "
        "stage's output (kept by a forward hook on a module inside it, or stored as an "
        "attribute, such as an auxiliary loss): offremat runs each stage's backward itself, "
        "from its output, so that path's gradient would be lost. Return the tensor from the "
        "block, compute the extra loss term from the blocks' outputs, or leave those blocks "
        "out of the chain (blocks=). This step's gradients are incomplete: zero them"
    )


class BackwardInForwardError(RuntimeError):
    """A backward ran inside a forward whose saved tensors offremat packs."""


def backward_in_forward_error(stage: str | None) -> BackwardInForwardError:
    """The error for a backward run inside a forward (``torch.autograd.grad`` in a block)."""
    where = "a module of the model" if stage is None else f"stage {stage!r}"
    return BackwardInForwardError(
        f"{where} runs a backward inside its own forward (torch.autograd.grad of an energy "
        "for its forces, a gradient penalty inside a block): offremat drops, offloads or "
        "recomputes what a stage saves, and that backward reads it while the forward still "
        "runs, so such a module cannot be planned. Leave it out of the chain (name the other "
        "blocks with blocks=), or train this model without offremat"
    )


def enter_stage(
    inputs: Sequence[torch.Tensor], diff: Sequence[int], slot: GradSlot, anchor: torch.Tensor
) -> list[torch.Tensor]:
    """The stage's inputs, those at positions ``diff`` passed through :class:`StageInput`."""
    entered = list(inputs)
    if diff:
        detached = [inputs[k].detach() for k in diff]
        for k, alias in zip(diff, StageInput.apply(slot, anchor, *detached), strict=True):
            entered[k] = alias
    return entered


def check_unmodified(stage: str, inputs: Sequence[torch.Tensor], versions: Sequence[int]) -> None:
    """Refuse a stage that changed its input in place: that input is a checkpoint."""
    for tensor, version in zip(inputs, versions, strict=True):
        if version_of(tensor) != version:
            raise RuntimeError(
                f"stage {stage!r} modifies its input in place (for example an inplace=True "
                f"activation first in the stage); offremat reads a stage's input again to "
                f"recompute it, and the first stage's input is the chain's own input (the "
                f"caller's batch, or what the code before the blocks made). Make that "
                f"operation out of place (inplace=False); in a later stage of an "
                f"nn.Sequential, grouping it with the block before it (stages=...) also does"
            )


class VersionRecord(Protocol):
    """A saved tensor as recorded when saved, which tells an in-place change made since."""

    version: int

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def size(self) -> tuple[int, ...]: ...

    def modified_version(self) -> int | None: ...


def modified_error(stage: str, tensor: VersionRecord, version: int) -> RuntimeError:
    """Autograd's own error for a saved tensor changed in place, naming the stage."""
    kind = str(tensor.dtype).removeprefix("torch.")
    return RuntimeError(
        f"one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{kind} {list(tensor.size)}], saved by offremat stage {stage!r}, "
        f"is at version {version}; expected version {tensor.version} instead. Make the "
        f"in-place change out of place, or make it after the backward pass"
    )


def check_versions(stage: str, refs: Iterable[VersionRecord | None]) -> None:
    """Raise :func:`modified_error` if any of ``refs`` was changed in place since recorded."""
    for ref in refs:
        if ref is not None and (version := ref.modified_version()) is not None:
            raise modified_error(stage, ref, version)


@dataclass(frozen=True)
class InputView:
    """A tensor autograd saved from the stage's input, described so it can be rebuilt."""

    input: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    version: int
    original: weakref.ref[torch.Tensor]
    conj: bool = False  # the lazy bits of a view of the input (x.conj(), its .imag)
    neg: bool = False

    def modified_version(self) -> int | None:
        """The input's version now if it was changed in place since packed, else None."""
        original = self.original()
        if original is not None and version_of(original) != self.version:
            return version_of(original)
        return None


class SavedTensorPacker:
    """``saved_tensors_hooks`` for one grad-enabled stage forward; see the design notes.

    Saved-tensor hooks switch off autograd's check that a saved tensor was not changed in
    place, so :meth:`unpack` makes it: every packed tensor records its version.
    """

    def __init__(
        self, stage: str, inputs: Sequence[torch.Tensor], excluded: set[int] | frozenset[int]
    ):
        self.stage = stage
        self.inputs = list(inputs)
        self.input_of_storage: dict[int, int] = {}
        for index, tensor in enumerate(inputs):
            self.input_of_storage.setdefault(storage_key(tensor), index)
        self.excluded = excluded
        self.refs: list[TensorRef] = []
        # Set for the backward: told of each saved tensor autograd takes (see unpack).
        self.residency: Residency | None = None
        # A step's stage slot: its saved tensors are read in that stage's backward only.
        self.slot: GradSlot | None = None

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context manager that installs the packing hooks."""
        # The hooks here and in offremat._deferred carry no torch.compiler.disable: autograd
        # calls them from C++, in no frame dynamo evaluates, compiled blocks included
        # (tests/test_compose_compile.py), and that wrapper cost about 0.5 ms a step on a
        # ten-stage model (experiments/overhead_cpu.py's own-cost part).
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> Any:
        """Describe input aliases; hold the rest through a :class:`TensorRef`."""
        try:
            storage = tensor.untyped_storage()
        except NotImplementedError as error:  # a sparse tensor: no storage to count or move
            key = storage_key(tensor)
            # A sparse parameter or buffer, or one of the stage's inputs (an adjacency passed
            # along the blocks), whose parts the step counts and never moves.
            if key in self.excluded or key in self.input_of_storage:
                return _alias(tensor)
            raise storageless_tensor_error(self.stage, tensor) from error
        key = storage._cdata  # storage_key, inlined: this runs for every saved tensor
        index = self.input_of_storage.get(key)
        if index is not None:
            return InputView(
                index,
                tensor.storage_offset(),
                tuple(tensor.size()),
                tuple(tensor.stride()),
                tensor.dtype,
                version_of(tensor),
                weakref.ref(self.inputs[index]),
                tensor.is_conj(),
                tensor.is_neg(),
            )
        if key not in self.excluded and storage.nbytes() > 0:
            return self._hold(tensor, storage)
        return _alias(tensor)

    def _hold(self, tensor: torch.Tensor, storage: torch.UntypedStorage) -> Any:
        """Pack a tensor of the saved set (over ``storage``), which the step holds."""
        ref = _alias(tensor)
        self.refs.append(ref)
        return ref

    def check_backward(self) -> None:
        """Refuse a backward through the stage's graph other than the step's own B(i)."""
        hooks = innermost_saved_tensor_hooks()
        if hooks is not None and hooks[0] == self.pack:  # the stage's forward still runs
            raise backward_in_forward_error(self.stage)
        if self.slot is not None and not self.slot.receiving:
            raise escaped_tensor_error(self.stage)

    def unpack(self, packed: Any) -> torch.Tensor:
        """Rebuild input aliases from the input resident now; the rest from its reference."""
        self.check_backward()
        check_versions(self.stage, [packed])
        if isinstance(packed, InputView):
            source = self.inputs[packed.input]
            return tensor_over(
                source.untyped_storage(),
                packed.dtype,
                packed.offset,
                packed.size,
                packed.stride,
                packed.conj,
                packed.neg,
            )
        return self._taken(packed)

    def _taken(self, ref: TensorRef) -> torch.Tensor:
        """The tensor of ``ref``, which autograd now holds for the node that reads it."""
        if ref.taken:
            raise RuntimeError(
                f"stage {self.stage!r}: a saved tensor was unpacked a second time in one "
                "backward (ctx.saved_tensors read twice?). offremat lets each saved tensor go "
                "once autograd has taken it, as torch.utils.checkpoint does: read "
                "ctx.saved_tensors once in a custom Function's backward"
            )
        tensor = ref.get()
        # Autograd holds it now, and frees it once the node has run: so does B(i) in plain
        # autograd, and so does the profiler's backward, which measures that.
        ref.tensor = None
        ref.taken = True
        if self.residency is not None:
            self.residency.unpacked(ref)
        return tensor

    def saved_storages(self) -> dict[int, torch.UntypedStorage]:
        """The distinct storages held, by :func:`storage_key` (what the profiler measures)."""
        return unique_storages(ref.get() for ref in self.refs)


def storageless_tensor_error(stage: str, tensor: torch.Tensor) -> ValueError:
    """The refusal of a saved tensor without a storage of its own (a sparse one)."""
    return ValueError(
        f"stage {stage!r} saves a {str(tensor.layout).removeprefix('torch.')} tensor for its "
        "backward: it has no storage of its own, which offremat counts, moves and rebuilds "
        "saved tensors by, so no plan could say what the stage holds. Leave this block out of "
        "the chain (blocks= naming the others), or make the tensor dense before autograd "
        "saves it"
    )


def _alias(tensor: torch.Tensor) -> TensorRef:
    # A detached alias: packing a stage output as itself would make a reference cycle through
    # its grad_fn.
    return TensorRef(tensor.detach(), original=tensor)


@contextmanager
def frozen_running_stats(layers: Sequence[nn.Module]) -> Iterator[list[torch.Tensor]]:
    """Run with throw-away copies of the layers' running statistics; yields the copies.

    Autograd saves the running statistics for BatchNorm's backward. The buffers themselves
    are no part of a saved set, but a recomputation's copies are: packed as saved tensors, a
    kept F_ck or F_none graph does not hold them until its refill, and the profile counts
    their bytes in the stage's saved set (:func:`norm_statistics_bytes`).
    """
    originals = []
    copies = []
    for layer in layers:
        for name in NORM_STATISTICS:
            buffer = layer._buffers.get(name)
            if buffer is not None:
                originals.append((layer, name, buffer))
                copies.append(buffer.clone())
                layer._buffers[name] = copies[-1]
    try:
        yield copies
    finally:
        for layer, name, buffer in originals:
            layer._buffers[name] = buffer


def norm_statistics_bytes(layers: Sequence[nn.Module]) -> int:
    """The bytes of the copies :func:`frozen_running_stats` makes of these layers'."""
    return sum(
        buffer.numel() * buffer.element_size()
        for layer in layers
        for buffer in (layer._buffers.get(name) for name in NORM_STATISTICS)
        if buffer is not None
    )


@dataclass(frozen=True)
class AutocastState:
    """Autocast as it was for one device type when the step's forward ran."""

    device_type: str
    enabled: bool
    dtype: torch.dtype

    @classmethod
    def capture(cls, device_type: str) -> AutocastState:
        """The autocast state now, for ``device_type``."""
        return cls(
            device_type,
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
        )

    @classmethod
    def of_step(cls, device: torch.device) -> list[AutocastState]:
        """The autocast states a step on ``device`` runs under: its device type's and the CPU's."""
        return [cls.capture(kind) for kind in sorted({device.type, "cpu"})]

    def runs_as(self, other: AutocastState) -> bool:
        """Whether a step under ``other`` computes as under this state (a disabled autocast's
        dtype makes no difference)."""
        return self.enabled == other.enabled and (not self.enabled or self.dtype == other.dtype)

    def enter(self, stack: ExitStack) -> None:
        """Enter this autocast state, with its weight cache off, inside ``stack``.

        The cache would keep each stage's low-precision weight copies alive until the caller's
        autocast region ends, memory that no plan counts. A disabled state is entered too
        where autocast is on now: a recomputation run by a backward inside the caller's
        autocast region computes as the forward did, without it.
        """
        if self.enabled:
            stack.enter_context(torch.autocast(self.device_type, self.dtype, cache_enabled=False))
        elif torch.is_autocast_enabled(self.device_type):
            stack.enter_context(torch.autocast(self.device_type, enabled=False))
