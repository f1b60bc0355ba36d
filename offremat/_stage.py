"""Running one stage of the chain the way both the profiler and the executor need it.

Design notes (the invariants that make a plan's gradients those of plain autograd).

- Boundary. A grad-enabled forward of stage i (F_all) starts from its input a_{i-1} through
  :class:`StageInput`, an identity autograd function whose backward only records the gradient
  δ_{i-1}. The stage's graph therefore ends at the boundary and keeps no reference to a_{i-1}:
  what autograd saves from a_{i-1} is packed as a description (:class:`InputView`) and
  unpacked from whichever copy of a_{i-1} is resident when B(i) runs, a recomputed one or a
  prefetched one. This is rotor's x̄_i, which excludes a_{i-1} (Herrmann, Beaumont et al.
  2019).
- Saved set. Everything else autograd saves, except parameters and buffers, is recorded by
  storage: with the stage's outputs, that is x̄_i, what the profiler measures as
  ``saved_bytes`` and what the executor offloads. Packing returns a detached alias: packing a
  stage output as itself would make a reference cycle through its ``grad_fn``.
- RNG. The first forward of a stage in a step runs on the global generators as plain autograd
  would; their state before it is kept, and every later forward of the stage (a recomputation)
  replays that state and then puts the global state back, as ``torch.utils.checkpoint`` does.
- BatchNorm. A recomputation must not move running statistics a second time: it runs against
  throw-away copies of the normalisation buffers.
- Autocast. A recomputation during the backward runs under the autocast state that was active
  when the step's forward ran.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from offremat._tensors import storage_key


class GradSlot:
    """Where :class:`StageInput` leaves the gradients of a stage's inputs (δ_{i-1})."""

    def __init__(self) -> None:
        self.grads: tuple[torch.Tensor | None, ...] | None = None


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
        ctx.slot.grads = grads
        return (None, None, *([None] * len(grads)))


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
        if tensor._version != version:
            raise RuntimeError(
                f"stage {stage!r} modifies its input in place (for example an inplace=True "
                f"activation first in the stage); offremat reads a stage's input again to "
                f"recompute it. Make that operation out of place, or group it with the block "
                f"before it (stages=...)"
            )


@dataclass(frozen=True)
class InputView:
    """A tensor autograd saved from the stage's input, described so it can be rebuilt."""

    input: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


class SavedTensorPacker:
    """``saved_tensors_hooks`` for one grad-enabled stage forward; see the design notes."""

    def __init__(self, inputs: Sequence[torch.Tensor], excluded: set[int]):
        self.inputs = list(inputs)
        self.input_of_storage: dict[int, int] = {}
        for index, tensor in enumerate(inputs):
            self.input_of_storage.setdefault(storage_key(tensor), index)
        self.excluded = excluded
        self.storages: dict[int, torch.UntypedStorage] = {}

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context manager that installs the packing hooks."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> Any:
        """Describe input aliases; record other storages; keep a detached alias."""
        key = storage_key(tensor)
        index = self.input_of_storage.get(key)
        if index is not None:
            return InputView(
                index,
                tensor.storage_offset(),
                tuple(tensor.size()),
                tuple(tensor.stride()),
                tensor.dtype,
            )
        storage = tensor.untyped_storage()
        if key not in self.excluded and storage.nbytes() > 0:
            self.storages.setdefault(key, storage)
        return tensor.detach()

    def unpack(self, packed: Any) -> torch.Tensor:
        """Rebuild input aliases from the input resident now; the rest as packed."""
        if isinstance(packed, InputView):
            source = self.inputs[packed.input]
            rebuilt = torch.empty(0, dtype=packed.dtype, device=source.device)
            return rebuilt.set_(source.untyped_storage(), packed.offset, packed.size, packed.stride)
        return packed


def parameter_storages(modules: Sequence[nn.Module]) -> set[int]:
    """Storage keys of every parameter and buffer: never part of a saved set."""
    keys = set()
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            keys.add(storage_key(tensor))
    return keys


def has_trainable_parameters(module: nn.Module) -> bool:
    """Whether any parameter of the module requires grad."""
    return any(parameter.requires_grad for parameter in module.parameters())


def norm_layers(module: nn.Module) -> list[nn.Module]:
    """The normalisation layers whose running statistics a forward in training mode moves."""
    return [
        layer
        for layer in module.modules()
        if isinstance(layer, _NormBase) and layer.training and layer.track_running_stats
    ]


@contextmanager
def frozen_running_stats(layers: Sequence[nn.Module]) -> Iterator[list[torch.Tensor]]:
    """Run with throw-away copies of the layers' running statistics; yields the copies.

    Autograd saves the running statistics for BatchNorm's backward; like the buffers they
    replace, the copies are not part of a saved set.
    """
    originals = []
    copies = []
    for layer in layers:
        for name in ("running_mean", "running_var", "num_batches_tracked"):
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


def cuda_device_indices(device: torch.device) -> list[int]:
    """The CUDA device whose generator a computation on ``device`` draws from (none on CPU)."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


@dataclass(frozen=True)
class RngState:
    """The CPU generator's state and those of the CUDA devices a stage runs on."""

    cpu: torch.Tensor
    cuda: tuple[tuple[int, torch.Tensor], ...]

    @classmethod
    def capture(cls, cuda_devices: Sequence[int]) -> RngState:
        """The current global states."""
        return cls(
            torch.get_rng_state(),
            tuple((index, torch.cuda.get_rng_state(index)) for index in cuda_devices),
        )

    def restore(self) -> None:
        """Make these the global states."""
        torch.set_rng_state(self.cpu)
        for index, state in self.cuda:
            torch.cuda.set_rng_state(state, index)


@contextmanager
def replayed_rng(state: RngState) -> Iterator[None]:
    """Run with the generators as they were in ``state``, then restore the current states."""
    current = RngState.capture([index for index, _ in state.cuda])
    state.restore()
    try:
        yield
    finally:
        current.restore()


@dataclass(frozen=True)
class AutocastState:
    """Autocast as it was for one device type when the step's forward ran."""

    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool

    @classmethod
    def capture(cls, device_type: str) -> AutocastState:
        """The autocast state now, for ``device_type``."""
        return cls(
            device_type,
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled(),
        )

    def enter(self, stack: ExitStack) -> None:
        """Re-enter this autocast state inside ``stack`` (nothing if it was off)."""
        if self.enabled:
            stack.enter_context(
                torch.autocast(self.device_type, self.dtype, cache_enabled=self.cache_enabled)
            )
