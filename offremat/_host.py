"""Host memory for offloaded copies, and the CUDA streams that move them.

Design note. Host copies live in one arena per device and model, shared by the executors of
all its input shapes and states (:class:`DeviceResources`), sized from the largest plan and
released on demand (:class:`HostArena`). It remembers the event of the last step's end: a
later step's copies into it wait for that event, whatever stream that step runs on. One step
at a time holds the arena (:class:`HostLease`): a step that begins while another waits for
its backward (two forwards, then their backwards) takes buffers of its own, freed when it
ends, so that it never writes over the waiting step's copies and the arena grows only to what
one step needs. On CPU the arena is plain memory and the copies are synchronous.
"""

from __future__ import annotations

from typing import Any

import numpy
import torch
from torch.utils._python_dispatch import _disable_current_modes


class HostArena:
    """One host buffer per device and model, pinned for CUDA, that the host copies of a step
    live in.

    Copies are carved from it one after the other and the whole arena is reused by the next
    step, so pinned memory is allocated once, at the size the plans need, instead of one
    power-of-two buffer per tensor size. ``capacity`` starts at the largest plan's offloaded
    bytes (:meth:`reserve`); a step that needs more takes the rest from buffers of its own,
    and the arena grows to what that step used for the next ones.
    """

    ALIGNMENT = 64

    def __init__(self, pinned: bool, capacity: int = 0):
        self.pinned = pinned
        self.capacity = capacity
        self.buffer: torch.Tensor | None = None
        self.holder: HostLease | None = None
        self.leases: set[HostLease] = set()  # of the steps in flight
        self.last_use: torch.cuda.Event | None = None

    @property
    def allocated_bytes(self) -> int:
        """Host bytes held now: the arena and the buffers of the steps in flight."""
        held = 0 if self.buffer is None else self.buffer.numel()
        return held + sum(lease.own_bytes for lease in self.leases)

    def reserve(self, nbytes: int) -> None:
        """Make the arena at least ``nbytes``: now if no step holds it, else once it is free."""
        self.capacity = max(self.capacity, nbytes)
        if self.holder is None and self.buffer is not None and self.buffer.numel() < nbytes:
            self.buffer = None

    def open(self) -> HostLease:
        """A step begins: the arena if no other step holds it, else buffers of its own."""
        lease = HostLease(self, holds_arena=self.holder is None)
        if lease.holds_arena:
            self.holder = lease
        self.leases.add(lease)
        return lease

    def release(self) -> None:
        """Give the arena back (pinned memory returns to torch's host cache); the next step
        allocates it again. A step in flight keeps the copies it made."""
        if self.last_use is not None:
            self.last_use.synchronize()
            self.last_use = None
        self.buffer = None

    def allocate(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of host memory, apart from the arena."""
        # Host memory, not the device's, which the budget counts. On CPU both are the same
        # RAM: numpy allocates it, outside PyTorch's allocator and any dispatch mode, so that
        # the measurement (offremat.measure) leaves it out as the CUDA allocator leaves out
        # pinned memory.
        if not self.pinned:
            return torch.from_numpy(numpy.empty(nbytes, dtype=numpy.uint8))
        with _disable_current_modes():
            return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)


class HostLease:
    """One step's host memory: carved from the arena when the step holds it, else (or beyond
    its capacity) buffers of the step's own; valid until :meth:`close`."""

    def __init__(self, arena: HostArena, holds_arena: bool):
        self.arena = arena
        self.holds_arena = holds_arena
        self._offset = 0
        self._used = 0
        self._own: list[torch.Tensor] = []

    @property
    def own_bytes(self) -> int:
        """Bytes of the step's own buffers."""
        return sum(buffer.numel() for buffer in self._own)

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of host memory for one copy, valid until :meth:`close`."""
        arena = self.arena
        size = -(-nbytes // arena.ALIGNMENT) * arena.ALIGNMENT
        self._used += size
        if self.holds_arena:
            if arena.buffer is None and self._offset == 0 and arena.capacity > 0:
                arena.buffer = arena.allocate(arena.capacity)
            buffer = arena.buffer
            if buffer is not None and self._offset + size <= buffer.numel():
                self._offset += size
                return buffer[self._offset - size : self._offset - size + nbytes]
        self._own.append(arena.allocate(nbytes))
        return self._own[-1]

    def close(self) -> None:
        """The step is over: its copies are no longer read. The arena grows to what the step
        used, if more, and is free for the next step."""
        arena = self.arena
        arena.capacity = max(arena.capacity, self._used)
        if self.holds_arena:
            arena.holder = None
            if arena.buffer is not None and arena.buffer.numel() < arena.capacity:
                arena.buffer = None
        arena.leases.discard(self)
        self._own.clear()


class CudaStreams:
    """The compute stream of the current step and the two copy streams of one device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self.compute = torch.cuda.current_stream(device)


class DeviceResources:
    """The host arena and CUDA copy streams of each device, shared by the executors of one
    model (one per input shape, block-input kind and state), so that host memory follows the
    largest plan rather than the number of shapes seen."""

    def __init__(self) -> None:
        self.arenas: dict[torch.device, HostArena] = {}
        self.streams: dict[torch.device, CudaStreams] = {}

    def of(self, device: torch.device, host_bytes: int) -> tuple[HostArena, CudaStreams | None]:
        """``device``'s arena, made to hold at least ``host_bytes``, and its streams."""
        if device not in self.arenas:
            cuda = device.type == "cuda"
            self.arenas[device] = HostArena(pinned=cuda, capacity=host_bytes)
            if cuda:
                self.streams[device] = CudaStreams(device)
        arena = self.arenas[device]
        arena.reserve(host_bytes)
        streams = self.streams.get(device)
        if streams is not None:
            streams.compute = torch.cuda.current_stream(device)
        return arena, streams

    @property
    def host_bytes(self) -> int:
        """Host memory kept for offloads between steps."""
        return sum(arena.allocated_bytes for arena in self.arenas.values())

    def release(self) -> None:
        """Give back every arena; the next step allocates its own again."""
        for arena in self.arenas.values():
            arena.release()

    def __getstate__(self) -> dict[str, Any]:
        # A copy (pickle, deepcopy) starts without this process's buffers and streams.
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.arenas = {}
        self.streams = {}
