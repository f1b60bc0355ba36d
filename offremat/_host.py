"""Host memory for offloaded copies, and the CUDA streams that move them.

Design note. Host copies live in one arena per executor, sized from the plan and released on
demand (:class:`HostArena`). It remembers the event of the last step's end: a later step's
copies into it wait for that event, whatever stream that step runs on. On CPU the arena is
plain memory and the copies are synchronous.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes


class HostArena:
    """One host buffer per executor, pinned for CUDA, that every host copy of a step lives in.

    Copies are carved from it one after the other and the whole arena is reused by the next
    step (:meth:`reset`), so pinned memory is allocated once, at the size the plan needs,
    instead of one power-of-two buffer per tensor size. ``capacity`` starts at the plan's
    offloaded bytes; a step that needs more takes the rest from overflow buffers, and the
    arena grows to what that step used for the next one.
    """

    ALIGNMENT = 64

    def __init__(self, pinned: bool, capacity: int = 0):
        self.pinned = pinned
        self.capacity = capacity
        self._buffer: torch.Tensor | None = None
        self._offset = 0
        self._overflow: list[torch.Tensor] = []
        self._used = 0
        self.last_use: torch.cuda.Event | None = None

    @property
    def allocated_bytes(self) -> int:
        """Host bytes held now: the arena and this step's overflow buffers."""
        held = 0 if self._buffer is None else self._buffer.numel()
        return held + sum(buffer.numel() for buffer in self._overflow)

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of host memory for one copy, valid until :meth:`reset`."""
        size = -(-nbytes // self.ALIGNMENT) * self.ALIGNMENT
        self._used += size
        if self._buffer is None and self.capacity > 0:
            self._buffer = self._allocate(self.capacity)
        if self._buffer is not None and self._offset + size <= self.capacity:
            view = self._buffer[self._offset : self._offset + nbytes]
            self._offset += size
            return view
        self._overflow.append(self._allocate(nbytes))
        return self._overflow[-1]

    def reset(self) -> None:
        """The step is over: its copies are no longer read. Grow to what it used, if more."""
        if self._used > self.capacity:
            self.capacity = self._used
            self._buffer = None
        self._overflow.clear()
        self._offset = 0
        self._used = 0

    def release(self) -> None:
        """Give the arena back (pinned memory returns to torch's host cache); the next step
        allocates it again."""
        if self.last_use is not None:
            self.last_use.synchronize()
            self.last_use = None
        self._buffer = None
        self._overflow.clear()

    def _allocate(self, nbytes: int) -> torch.Tensor:
        # Host memory, not the device's: on CPU, where both are the same RAM, it is allocated
        # outside any dispatch mode so that the step's measurement leaves it out (design.md).
        with _disable_current_modes():
            return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self.pinned)


class CudaStreams:
    """The compute stream of the current step and the two copy streams of one device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self.compute = torch.cuda.current_stream(device)
