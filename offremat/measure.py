"""Measure a training step's activation memory independently of the executor.

"Within the budget" means: the device bytes that the step itself allocates and holds at
once (its activations, temporaries and input; not the parameters, their gradients or the
optimizer's state), seen by something that sees every allocation, never the executor's own
count.

- CUDA: the caching allocator's statistics. ``max_memory_allocated()`` after
  ``reset_peak_memory_stats()``, minus what was allocated when the step began. Resetting the
  peak statistics is process-wide, which is why measuring is opt-in.
- CPU: :class:`LiveStorageTracker`, a ``TorchDispatchMode`` that records every storage an op
  creates while it is active and, after each op, sums the bytes of those still alive. It sees
  resizes as well as frees, so nothing a program does to a storage can hide it. What kernels
  allocate inside themselves (oneDNN's scratchpads, contiguous copies) is no op's output: the
  CPU allocator's own reports (:mod:`offremat._cpu_allocator`) see it, and the peak is the
  larger of the two readings.

In both, storages that existed before the step (parameters, the caller's input, gradients
already allocated) are not counted; :class:`StepMemory` adds the step's input, which the
budget counts as a_0. Host copies made by offloads are host memory: on CUDA they are pinned
memory outside the device allocator, and on CPU the executor's host arena is allocated outside
any dispatch mode for the same reason.

The CUDA allocator can hold more than the tensors it hands out. Every block is rounded up to
512 bytes, which the profile counts (:func:`offremat._tensors.allocated_bytes`). And in its
default mode it splits a large block only when more than 1 MiB would be left over, so a
request can take up to 1 MiB beyond its size, depending on what was freed before: on an H100 a
bf16 GPT step held up to 4 MiB (2.7% of its peak) more than its tensors, an fp32 one nothing
(``experiments/results/gpu/2026-11-25``). With ``expandable_segments:True`` it splits off any
remainder and the two agree; :func:`cuda_blocks_split_exactly` says whether that is set.

Compiled code (``torch.compile``) runs eagerly while the CPU tracker is active
(:mod:`offremat._eager`): a dispatch mode cannot see the allocations inside compiled kernels.
On CPU the tracker therefore measures the eager form of compiled blocks; the process's
resident memory is the check of the compiled form (``experiments/compose_cpu.py``).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode, _push_mode
from torch.utils._pytree import tree_leaves

from offremat._cpu_allocator import CpuAllocatorRecord
from offremat._live_storages import LiveStorageTracker, WithinNode, storage_leaves
from offremat._storage_table import StorageTable
from offremat._tensors import storage_bytes

__all__ = [
    "Allocations",
    "LiveStorageTracker",
    "StepMemory",
    "cuda_blocks_split_exactly",
    "is_measurement_hook",
    "storage_bytes",
    "tree_leaf_tensors",
]


class StepMemory:
    """The activation peak of the code run inside it, on ``device``, as the budget counts it.

    ``with StepMemory(device, inputs=batch) as memory: ...`` then ``memory.peak_bytes`` is the
    most bytes that the code inside allocated and held at once, plus the bytes that ``inputs``
    reach of their storages (a_0, which the budget counts: of a batch sliced from a dataset,
    the slice). On CUDA, ``reserved_peak_bytes`` is the
    allocator's reserved peak as well. The peak is net of frees: on CPU, of storages created
    inside and of the ``existing`` ones named (the CUDA allocator sees every free), so a code
    that frees older tensors before it allocates can have a peak below its allocations.

    The budget leaves out parameters' gradients (module notes). On CPU, the gradients that the
    code accumulates into the parameters ``gradients_of`` stop counting, from that moment, in
    ``peak_less_gradients_bytes`` (they count in ``peak_bytes``): so one step whose .grad were
    None can be checked against the budget exactly. The CUDA allocator cannot tell them apart.

    On CPU with ``allocator`` (the default), the CPU allocator's reports raise the peak to what
    kernels allocated inside themselves, from entry to the first :meth:`pause` or the exit,
    and from a :meth:`reset_peak` on; ``peak_so_far_bytes`` is the tracker's alone. Leave it
    off for a measurement that starts or ends inside a backward pass (module notes of
    :mod:`offremat._cpu_allocator`). The gradients' part of the allocator's peak is not known:
    the peak less gradients takes off all those alive at the exit, which is never too much.
    """

    def __init__(
        self,
        device: torch.device | str,
        inputs: Iterable[torch.Tensor] | Any = (),
        existing: Iterable[torch.UntypedStorage] = (),
        gradients_of: Iterable[torch.Tensor] = (),
        allocator: bool = True,
    ):
        self.device = torch.device(device)
        self._use_allocator = allocator
        self._allocator_peak = 0  # the most the records counted read, in the tracker's bytes
        self.input_bytes = storage_bytes(tree_leaf_tensors(inputs))
        # Storages made before whose frees inside count, as the CUDA allocator counts them:
        # held weakly, so that they can be freed.
        self._existing = [weakref.ref(storage) for storage in existing]
        self._gradients_of = list(gradients_of)
        # Per storage, the bytes of each parameter's gradient in it (see _accumulated).
        self._gradient_parts: StorageTable[dict[int, int]] = StorageTable()
        self._hooks: list[Any] = []
        self._tracker: LiveStorageTracker | None = None
        self._within_node: WithinNode | None = None
        self._recording = False  # the tracker's dispatch mode is on the stack
        self._before = 0
        self.step_peak_bytes = 0
        self.paused_bytes: int | None = None
        self.step_peak_less_gradients_bytes: int | None = None
        self.reserved_peak_bytes: int | None = None

    @property
    def peak_bytes(self) -> int:
        """The step's activation peak: its own allocations' peak plus its input."""
        return self.step_peak_bytes + self.input_bytes

    @property
    def peak_less_gradients_bytes(self) -> int | None:
        """``peak_bytes`` less the gradients of ``gradients_of`` once accumulated; on CUDA,
        None."""
        less = self.step_peak_less_gradients_bytes
        return None if less is None else less + self.input_bytes

    def __enter__(self) -> StepMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
        else:
            self._tracker = LiveStorageTracker()
            for ref in self._existing:
                storage = ref()
                if storage is not None:
                    self._tracker.record(storage)
            self._before = self._tracker.live_bytes
            self._tracker.peak_bytes = self._before
            self._tracker.peak_less_left_out_bytes = self._before
            self._hooks = [
                p.register_post_accumulate_grad_hook(self._accumulated) for p in self._gradients_of
            ]
            self._tracker.__enter__()
            self._recording = True
            self._open_allocator()
        return self

    def _open_allocator(self) -> None:
        tracker = self._tracker
        if self._use_allocator and tracker is not None and tracker.allocator is None:
            record = CpuAllocatorRecord(tracker.live_bytes).__enter__()
            if record.recording:
                tracker.allocator = record

    def _close_allocator(self, counted: bool) -> None:
        """End the allocator's record; ``counted``: its peak joins the step's. Inside a
        backward it raises with nothing changed (offremat._cpu_allocator)."""
        record = None if self._tracker is None else self._tracker.allocator
        if record is None:
            return
        record.__exit__(None, None, None)
        self._tracker.allocator = None
        if counted and record.peak_bytes is not None:
            self._allocator_peak = max(self._allocator_peak, record.peak_bytes)

    def _accumulated(self, parameter: torch.Tensor) -> None:
        """A post-accumulate-grad hook: the parameter's gradient stops counting in the peak
        less gradients (a hook run before it may have taken the gradient away). Its own bytes:
        autograd may hand it a slice of a larger gradient, whose other slices are other
        parameters' (a weight made by ``torch.cat`` of three) or activations' (a learned
        token put before them), which still count."""
        if self._tracker is None or parameter.grad is None:
            return
        found: list[Any] = []
        storage_leaves(parameter.grad, found)
        for leaf in found:
            storage = leaf.untyped_storage()
            parts = self._gradient_parts.get(storage)
            if parts is None:
                parts = {}
                self._gradient_parts.set(storage, parts)
            parts[id(parameter)] = leaf.numel() * leaf.element_size()
            self._tracker.leave_out(storage, sum(parts.values()))

    @property
    def live_bytes(self) -> int:
        """Bytes allocated inside and alive now (not counting ``inputs``)."""
        if self._tracker is not None:
            return self._tracker.live_bytes - self._before
        return torch.cuda.memory_allocated(self.device) - self._before

    @property
    def peak_so_far_bytes(self) -> int:
        """The most bytes allocated inside and alive at once since entry or the last reset."""
        if self._tracker is not None:
            return self._tracker.peak_bytes - self._before
        return torch.cuda.max_memory_allocated(self.device) - self._before

    def reset_peak(self) -> None:
        """Start the peak again from what is alive now (to measure one phase of the code)."""
        if self._tracker is not None:
            self._tracker.peak_bytes = self._tracker.live_bytes
            self._tracker.peak_less_left_out_bytes = 0
            self._tracker.note_peak()
            self._close_allocator(counted=False)
            self._allocator_peak = 0
            self._open_allocator()
        else:
            torch.cuda.reset_peak_memory_stats(self.device)

    def pause(self) -> None:
        """Stop recording new storages (CPU), keeping those recorded; the peak stays. The
        bytes alive at the first pause (``paused_bytes``, a forward's end) are kept."""
        if self._tracker is not None and self._recording:
            if self.paused_bytes is None:
                self.paused_bytes = self.live_bytes
            self._close_allocator(counted=True)
            self._tracker.__exit__(None, None, None)
            self._recording = False

    def resume(self) -> None:
        """Record again after :meth:`pause`."""
        if self._tracker is not None and not self._recording:
            self._tracker.__enter__()
            self._recording = True

    def record_within_node(self) -> None:
        """Record what the autograd node about to run allocates (CPU; from the node's
        pre-hook, the tracker paused): the engine restores the thread's dispatch modes when the
        node ends, which takes the tracker off again (see :mod:`offremat._plain_measured`)."""
        if self._tracker is not None and not self._recording:
            if self._within_node is None:  # a StepMemory has one tracker, entered once
                self._within_node = WithinNode(self._tracker)
            _push_mode(self._within_node)

    def discard(self) -> None:
        """Stop without a measurement (a step that failed, or was dropped before its
        backward): the hooks on the parameters go, and the dispatch mode if it is on."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._close_allocator(counted=False)
        self.pause()
        self._tracker = None

    def __exit__(self, *exc: Any) -> None:
        if self._tracker is not None:
            recording = self._tracker.allocator is not None
            if recording and _get_current_dispatch_mode() is not self._tracker:
                # Its tracker's mode would come off the stack from under another's.
                raise RuntimeError(
                    "StepMemory measurements must be left innermost first, in the reverse "
                    "order of entering them"
                )
            self._close_allocator(counted=True)
            if self._recording:
                self._tracker.__exit__(*exc)
                self._recording = False
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
            tracker = self._tracker
            self.step_peak_bytes = max(tracker.peak_bytes, self._allocator_peak) - self._before
            gradients = tracker.left_out_bytes if self._allocator_peak else 0
            self.step_peak_less_gradients_bytes = (
                max(tracker.peak_less_left_out_bytes, self._allocator_peak - gradients)
                - self._before
            )
            self._tracker = None
            return
        if self.device.type != "cuda":
            return  # discarded
        torch.cuda.synchronize(self.device)
        self.step_peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._before
        self.reserved_peak_bytes = torch.cuda.max_memory_reserved(self.device)


def is_measurement_hook(hook: Any) -> bool:
    """Whether a parameter's post-accumulate-grad ``hook`` is a :class:`StepMemory`'s (not
    the caller's, whose hooks the executor must run exactly once)."""
    return isinstance(getattr(hook, "__self__", None), StepMemory)


def tree_leaf_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors inside a nested structure of tuples, lists and dicts."""
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def cuda_blocks_split_exactly() -> bool:
    """Whether the CUDA allocator is set to expandable segments, under which a block holds its
    request rounded to 512 bytes and nothing more (see the module notes).

    Read from ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``), which must be set
    before CUDA starts.
    """
    for variable in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for option in os.environ.get(variable, "").split(","):
            key, _, value = option.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return True
    return False


class Allocations:
    """The storages a block of code allocates, to find those still alive later.

    On CPU a :class:`LiveStorageTracker`; on CUDA the allocator's count, which
    a dispatch mode would change (compiled blocks would run eagerly under it).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.tracker = LiveStorageTracker() if device.type != "cuda" else None
        self.before = 0

    def __enter__(self) -> Allocations:
        if self.tracker is None:
            self.before = torch.cuda.memory_allocated(self.device)
        else:
            self.tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(*exc)

    def alive(self) -> dict[int, torch.UntypedStorage]:
        """The storages allocated inside and alive now, by key (none known on CUDA, where the
        allocator sees every free anyway)."""
        if self.tracker is None:
            return {}
        return self.tracker.live_storages()

    def alive_bytes(
        self, handed: dict[int, torch.UntypedStorage], state: dict[int, torch.UntypedStorage]
    ) -> int:
        """Bytes allocated inside and alive now, but for the outputs ``handed`` on (allocated
        inside) and the modules' ``state`` (parameters and buffers, allocated before)."""
        if self.tracker is None:
            inside = torch.cuda.memory_allocated(self.device) - self.before
            return max(inside - sum(s.nbytes() for s in handed.values()), 0)
        return sum(s.nbytes() for k, s in self.alive().items() if k not in handed | state)
