"""Where each storage the executor holds lives, and the copies that move it.

Design notes.

- Unit of residency: the storage. A plan tensor (a_i, x̄_i or δ_i) is a set of storages, and
  storages can be shared: a stage that passes its input through, or returns a view of it, puts
  one storage in two plan tensors. A storage's device memory is released only when no plan
  tensor that is resident on the device still needs it, and its bytes count once.
- The step never empties a storage in place. It holds each of its tensors through a
  :class:`~offremat._held.TensorRef` (the stage outputs it keeps and everything autograd
  saved, see :mod:`offremat._stage`). Offloading copies the storage to the host and then
  drops every reference the step holds to it; the memory is freed when nobody else holds it
  either. A storage that a module attribute, a hook, autocast's cache or the caller also
  holds therefore stays valid and stays counted: it is never emptied under its owner. A
  prefetch allocates a new storage and the references rebuild their tensors over it.
- Release during B(i). Autograd frees each saved tensor as soon as the node that reads it has
  run; the step lets go of a storage of x̄_i once autograd has taken every tensor the step
  held on it (:meth:`Residency.unpacked`), so B(i) frees memory node by node as plain autograd
  does. Freeing it all at the end of B(i) also returned it to the OS in one piece on CPU,
  where glibc then faulted it in again page by page (measured: 12-16 thousand page faults per
  backward of a ResNet recompute plan, against 0-5 thousand under
  ``torch.utils.checkpoint``).
- Storages that the step cannot move are resident for the whole step: the caller's (the input
  a_0 and the returned output), those on another device (CPU scalars beside a CUDA step, such
  as attention's RNG seed and offset, which take no device memory). Every other storage moves
  with its plan tensor, however small: the plan counts all of x̄_i as gone once offloaded
  (a ViT's layer-norm statistics, 4 KiB per layer left behind, put a milp plan over its
  budget).
- In-place changes: each reference records its tensor's version counter. Saved-tensor hooks
  switch off autograd's own check, so the executor compares versions itself where autograd
  would (see :mod:`offremat._stage`).
- CUDA ordering, without host synchronisation: copies run on a device-to-host and a
  host-to-device stream. A storage allocated for a prefetch is allocated on the compute stream
  and the copy waits on an event recorded right after the allocation. A storage read by a copy
  is let go only after the compute stream has waited on the copy's event (a deferred free), so
  the allocator can reuse it at once for compute-stream work.
- Host copies live in one arena per executor (:mod:`offremat._host`).
- CPU: the same bookkeeping with synchronous copies into separate host buffers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from offremat._held import StorageRecord, TensorRef
from offremat._host import CudaStreams, HostArena
from offremat._tensors import byte_view, sparse_parts, storage_key


class Residency:
    """The storages of one step on ``device``, their copies, and the bytes they add up to.

    ``fixed`` names storages never moved: the parameters' and buffers'.
    """

    def __init__(
        self,
        device: torch.device,
        arena: HostArena,
        streams: CudaStreams | None,
        fixed: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        self.device = device
        self.fixed = fixed
        self.arena = arena
        self.host = arena.open()  # this step's host memory, until close
        self.streams = streams
        # Storages on the device by key; a key is an address that the allocator may give to a
        # new storage once this one is freed, so an emptied record leaves the index.
        self.records: dict[int, StorageRecord] = {}
        self.away: dict[int, StorageRecord] = {}
        self.live_bytes = 0
        self.last_h2d: torch.cuda.Event | None = None

    def hold(self, refs: Iterable[TensorRef], movable: bool = True) -> tuple[StorageRecord, ...]:
        """Count a new resident plan tensor made of the storages of ``refs``."""
        held: dict[int, StorageRecord] = {}
        for ref in refs:
            tensor = ref.get()
            if tensor.layout != torch.strided:
                # A sparse tensor (an adjacency passed along the blocks): its indices' and
                # values' storages count, and stay where they are, with the reference.
                for part in sparse_parts(tensor):
                    self._count(part, False, held)
                continue
            record = self._count(tensor, movable, held)
            if record is not None and ref.record is None:
                ref.record = record
                record.refs.append(ref)
        return tuple(held.values())

    def count_reached(self, reached: dict[int, int]) -> None:
        """Count of the step's input's storages only the bytes it reaches (``reached``, by
        key: :func:`offremat._tensors.reached_bytes`), as the budget counts a_0: of a batch
        sliced from a dataset, the slice, not the dataset there before the step."""
        for key, nbytes in reached.items():
            record = self.records.get(key)
            if record is not None and nbytes < record.nbytes:
                self.live_bytes -= record.nbytes - nbytes
                record.nbytes = nbytes

    def _count(
        self, tensor: torch.Tensor, movable: bool, held: dict[int, StorageRecord]
    ) -> StorageRecord | None:
        """The record of a strided tensor's storage, made if new, added to ``held``."""
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return None
        key = storage._cdata  # storage_key, of a strided tensor
        record = self.records.get(key)
        if record is None:
            can_move = movable and key not in self.fixed and tensor.device == self.device
            record = StorageRecord(key, storage, can_move)
            self.records[key] = record
            self.live_bytes += record.nbytes
        elif not movable:
            record.movable = False
        if key not in held:
            record.resident_holders += 1
            held[key] = record
        return record

    def drop(self, records: Iterable[StorageRecord], resident: bool = True) -> None:
        """A plan tensor made of ``records`` is gone (``resident``: it was on the device)."""
        for record in records:
            if record.released:
                continue
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
        copies = []
        for record in records:
            record.resident_holders -= 1
            if newly_away:
                record.away_holders += 1
            if record.host is None and record.on_device and record.movable:
                copies.append(record)
        if copies:
            self._copy_to_host(copies, produced)

    def release(self, records: Iterable[StorageRecord]) -> None:
        """Let go of the device bytes of an offloaded plan tensor that nothing resident uses."""
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
            assert record.movable and record.host is not None
            storage = torch.empty(record.nbytes, dtype=torch.uint8, device=self.device)
            record.storage = storage.untyped_storage()
            record.key = storage_key(storage)
            del self.away[id(record)]
            self.records[record.key] = record
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

    def unpacked(self, ref: TensorRef) -> None:
        """Autograd has taken ``ref``'s saved tensor for the node that reads it, in B(i).

        Once every tensor the step held on a storage is taken, the step lets the storage go:
        its bytes are freed when autograd releases the node's saved tensors, one node after
        another as plain autograd frees them, instead of all at the end of B(i).
        """
        record = ref.record
        if record is None or not any(held is ref for held in record.refs):
            return
        record.refs = [held for held in record.refs if held is not ref]
        if record.refs or not record.on_device:
            return
        self._settle(record)
        record.storage = None
        record.released = True
        self.live_bytes -= record.nbytes
        del self.records[record.key]

    def let_go(self, refs: Iterable[TensorRef | None]) -> None:
        """A plan tensor made of ``refs`` is gone from the step for good: its references
        stop counting among those :meth:`unpacked` waits for. A storage it shared (a block
        that returns a view of its input) then goes when the other tensor's are taken."""
        for ref in refs:
            record = ref.record if ref is not None else None
            if record is not None and any(held is ref for held in record.refs):
                record.refs = [held for held in record.refs if held is not ref]

    def use(self, records: Iterable[StorageRecord]) -> None:
        """Make the compute stream wait until prefetched bytes it is about to read are there."""
        if self.streams is None:
            return
        for record in records:
            if record.device_ready is not None:
                self.streams.compute.wait_event(record.device_ready)
                record.device_ready = None

    def close(self) -> None:
        """End of the step, normal or not: settle every pending copy, return host buffers."""
        for record in [*self.records.values(), *self.away.values()]:
            self._settle(record)
            record.refs.clear()
            record.storage = None
        if self.streams is not None:
            # Later copies into these host buffers, on whatever stream, wait for this event.
            self.arena.last_use = self.streams.compute.record_event()
            if self.last_h2d is not None:
                self.streams.compute.wait_event(self.last_h2d)
                self.last_h2d = None
        self.records.clear()
        self.away.clear()
        self.live_bytes = 0
        self.host.close()

    def _copy_to_host(
        self, records: list[StorageRecord], produced: torch.cuda.Event | None
    ) -> None:
        """Copy the storages of one offload, on the device-to-host stream, under one event."""
        for record in records:
            record.host = self.host.take(record.nbytes)
        if self.streams is None:
            for record in records:
                assert record.host is not None and record.storage is not None
                record.host.copy_(byte_view(record.storage))
            return
        stream = self.streams.d2h
        if produced is not None:
            stream.wait_event(produced)
        if self.arena.last_use is not None:
            stream.wait_event(self.arena.last_use)
        with torch.cuda.stream(stream):
            for record in records:
                assert record.host is not None and record.storage is not None
                record.host.copy_(byte_view(record.storage), non_blocking=True)
        ready = stream.record_event()
        for record in records:
            record.host_ready = ready

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
        if record.movable:
            record.storage = None
            for ref in record.refs:
                ref.release()
            record.on_device = False
            self.live_bytes -= record.nbytes
            del self.records[record.key]
            self.away[id(record)] = record

    def _forget(self, record: StorageRecord) -> None:
        self._settle(record)
        if record.on_device:
            self.live_bytes -= record.nbytes
            del self.records[record.key]
        else:
            del self.away[id(record)]
        record.refs.clear()
        record.storage = None
