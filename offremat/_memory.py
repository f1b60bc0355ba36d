"""Where each storage the executor holds lives, and the copies that move it.

Design notes.

- Unit of residency: the storage. A plan tensor (a_i, x̄_i or δ_i) is a set of storages, and
  storages can be shared: a stage that passes its input through, or returns a view of it, puts
  one storage in two plan tensors. A storage's device memory is released only when no plan
  tensor that is resident on the device still needs it, and its bytes count once.
- Offloading keeps every tensor object alive, including those inside autograd's graph, and
  only empties the storage (``resize_(0)``); a prefetch refills the same storage. Views and
  saved tensors therefore stay valid without being rebuilt, as in FSDP's parameter freeing.
  The copies go through a fresh byte view of the storage, whose version counter is its own, so
  autograd's in-place checks on the saved tensors are untouched.
- The caller's storages (the step's input and its returned output) are never emptied: the
  executor stops counting them when the plan releases them, but the memory is the caller's.
- CUDA ordering, without host synchronisation: copies run on a device-to-host and a
  host-to-device stream. A storage allocated for a prefetch is allocated on the compute stream
  and the copy waits on an event recorded right after the allocation. Device memory read by a
  copy is handed back to the allocator only after the compute stream has waited on the copy's
  event (a deferred free), so the allocator can reuse it at once for compute-stream work.
- Host buffers come from a pool that lives as long as the executor: pinned memory is
  allocated once and reused step after step.
- CPU: the same bookkeeping with synchronous copies into separate host buffers.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import torch

from offremat._tensors import byte_view


class HostBufferPool:
    """Host byte buffers, pinned for CUDA, reused from one step to the next."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self._free: list[tuple[int, int, torch.Tensor]] = []
        self.allocated_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes``, from the pool when one is large enough."""
        index = bisect.bisect_left(self._free, (nbytes, -1))
        if index < len(self._free):
            return self._free.pop(index)[2]
        self.allocated_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def give_back(self, buffers: Iterable[torch.Tensor]) -> None:
        """Return buffers for later steps to reuse."""
        for buffer in buffers:
            bisect.insort(self._free, (buffer.numel(), id(buffer), buffer))


class StorageRecord:
    """One storage held by the executor: its holders, where its bytes are, pending copies."""

    __slots__ = (
        "away_holders",
        "device_ready",
        "external",
        "host",
        "host_ready",
        "key",
        "nbytes",
        "on_device",
        "resident_holders",
        "storage",
    )

    def __init__(self, key: int, storage: torch.UntypedStorage, external: bool):
        self.key = key
        self.storage = storage
        self.nbytes = storage.nbytes()
        self.external = external
        self.resident_holders = 0
        self.away_holders = 0
        self.on_device = True
        self.host: torch.Tensor | None = None
        self.host_ready: torch.cuda.Event | None = None
        self.device_ready: torch.cuda.Event | None = None


class Residency:
    """The storages of one step, their copies, and the live device bytes they add up to."""

    def __init__(self, pool: HostBufferPool, streams: CudaStreams | None):
        self.pool = pool
        self.streams = streams
        self.records: dict[int, StorageRecord] = {}
        self.live_bytes = 0
        self.host_buffers: list[torch.Tensor] = []
        self.last_h2d: torch.cuda.Event | None = None

    def hold(
        self, storages: dict[int, torch.UntypedStorage], external: bool = False
    ) -> tuple[StorageRecord, ...]:
        """Count a new resident plan tensor made of ``storages``."""
        held = []
        for key, storage in storages.items():
            record = self.records.get(key)
            if record is None:
                record = StorageRecord(key, storage, external)
                self.records[key] = record
                self.live_bytes += record.nbytes
            record.external = record.external or external
            record.resident_holders += 1
            held.append(record)
        return tuple(held)

    def drop(self, records: Iterable[StorageRecord], resident: bool = True) -> None:
        """A plan tensor made of ``records`` is gone (``resident``: it was on the device)."""
        for record in records:
            if resident:
                record.resident_holders -= 1
            else:
                record.away_holders -= 1
            if record.resident_holders > 0:
                continue
            if record.away_holders > 0:
                self._empty(record)
            else:
                self._forget(record)

    def offload(
        self,
        records: Iterable[StorageRecord],
        produced: torch.cuda.Event | None,
        newly_away: bool = True,
    ) -> None:
        """Start copying a plan tensor to the host; it stops being resident on the device.

        ``newly_away`` is False for a tensor whose host copy is already counted (offloaded
        before, prefetched, and offloaded again).
        """
        for record in records:
            record.resident_holders -= 1
            if newly_away:
                record.away_holders += 1
            if record.host is None and record.on_device and not record.external:
                self._copy_to_host(record, produced)

    def release(self, records: Iterable[StorageRecord]) -> None:
        """Free the device bytes of an offloaded plan tensor that nothing resident still uses."""
        for record in records:
            if record.resident_holders == 0 and record.on_device:
                self._empty(record)

    def prefetch(self, records: Iterable[StorageRecord]) -> None:
        """Bring an offloaded plan tensor back; storages still on the device are not copied.

        The host copy stays, for the plan may drop the tensor and prefetch it again.
        """
        allocated = []
        for record in records:
            record.resident_holders += 1
            if record.on_device:
                continue
            record.on_device = True
            self.live_bytes += record.nbytes
            if not record.external:  # the caller's storage never left the device
                record.storage.resize_(record.nbytes)
                allocated.append(record)
        if not allocated:
            return
        if self.streams is None:
            for record in allocated:
                byte_view(record.storage).copy_(record.host)
            return
        allocated_at = self.streams.compute.record_event()
        stream = self.streams.h2d
        stream.wait_event(allocated_at)
        with torch.cuda.stream(stream):
            for record in allocated:
                if record.host_ready is not None:
                    stream.wait_event(record.host_ready)
                byte_view(record.storage).copy_(record.host, non_blocking=True)
        ready = stream.record_event()
        for record in allocated:
            record.device_ready = ready
        self.last_h2d = ready

    def use(self, records: Iterable[StorageRecord]) -> None:
        """Make the compute stream wait until prefetched bytes it is about to read are there."""
        if self.streams is None:
            return
        for record in records:
            if record.device_ready is not None:
                self.streams.compute.wait_event(record.device_ready)
                record.device_ready = None

    def close(self) -> None:
        """End of the step: settle every pending copy and return the host buffers."""
        for record in list(self.records.values()):
            self._settle(record)
        if self.streams is not None and self.last_h2d is not None:
            # Next step's device-to-host copies, ordered after this compute stream, may then
            # write into the host buffers this step's prefetches read.
            self.streams.compute.wait_event(self.last_h2d)
            self.last_h2d = None
        self.records.clear()
        self.live_bytes = 0
        self.pool.give_back(self.host_buffers)
        self.host_buffers = []

    def _copy_to_host(self, record: StorageRecord, produced: torch.cuda.Event | None) -> None:
        buffer = self.pool.take(record.nbytes)
        self.host_buffers.append(buffer)
        record.host = buffer[: record.nbytes]
        if self.streams is None:
            record.host.copy_(byte_view(record.storage))
            return
        stream = self.streams.d2h
        if produced is not None:
            stream.wait_event(produced)
        with torch.cuda.stream(stream):
            record.host.copy_(byte_view(record.storage), non_blocking=True)
        record.host_ready = stream.record_event()

    def _settle(self, record: StorageRecord) -> None:
        # Before the allocator may hand this memory to compute-stream work, the compute stream
        # must have waited for every copy that still touches it.
        if self.streams is None:
            return
        for event in (record.host_ready, record.device_ready):
            if event is not None:
                self.streams.compute.wait_event(event)
        record.host_ready = None
        record.device_ready = None

    def _empty(self, record: StorageRecord) -> None:
        if not record.on_device:
            return
        self._settle(record)
        if not record.external:
            record.storage.resize_(0)
        record.on_device = False
        self.live_bytes -= record.nbytes

    def _forget(self, record: StorageRecord) -> None:
        self._settle(record)
        if record.on_device:
            self.live_bytes -= record.nbytes
        del self.records[record.key]


class CudaStreams:
    """The compute stream of the current step and the two copy streams of one device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self.compute = torch.cuda.current_stream(device)
