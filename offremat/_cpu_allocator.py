"""The CPU allocator's own reports of what it hands out, for :class:`offremat.measure.StepMemory`.

A dispatch mode sees the storages that ops return, not what a kernel allocates and frees
inside itself: oneDNN's scratchpads and reordered inputs in a convolution, a contiguous copy
of a strided gradient, the im2col buffer of a convolution without oneDNN. That is real
memory: on the ResNet of ``experiments/peers_cpu.py`` a dp plan's step held 2.1 MB (11% of
its budget) beyond the storages the tracker saw, and the process's resident memory agreed
with the allocator, not with the tracker.

PyTorch's CPU allocator reports every allocation and free to the profiler when memory
profiling is on. The legacy profiler collects those reports without kineto (no trace, nothing
written to stderr); only its memory records and the trackers' marks are read here, and the op
ranges it also records are the cost of reading them (a few microseconds an op). PyTorch says
once per process, on stderr, that a block allocated before the profiling started was freed
during it: the frees the tracker accounts for (see :class:`CpuAllocatorRecord`).

Rules that keep it safe:

- One profiler session per thread, shared by nested records: a record entered inside another
  ends the session (each open record reads its reports so far) and starts a new one, and its
  exit does the same. A caller's own profiler cannot be shared: under it nothing is recorded,
  ``peak_bytes`` stays None, and the tracker alone measures (said once).
- Never switched on or off inside a backward pass. The autograd engine restores, around each
  node, the thread-local state it captured when the backward began, profiler included; a
  profiler switched in a hook would be switched back for the nodes after it, and on again
  for the caller once the backward returns. Entered inside a backward, nothing is recorded;
  left inside one (entered outside), it raises and changes nothing, so that leaving it again
  outside the backward ends it.

The legacy profiler keeps a record of every op until its session ends, a few kilobytes an
op of host memory (about 190 MiB for 3,000 small ops forward and backward, in a review) and
about as much time again as the ops themselves: a reading for a measurement, not for every
step.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import threading
from typing import Any

import torch

logger = logging.getLogger(__name__)

MARK = "offremat.tracker_mark"
# Blocks smaller than this are left out: the 0-dim tensors PyTorch wraps Python numbers in
# (``x * 2``), which on CUDA are host memory too. A tensor an op returns, however small, is
# the tracker's.
SMALL_BYTES = 64

try:
    from torch._C._autograd import _disable_profiler_legacy, _enable_profiler_legacy
    from torch._C._profiler import (
        ProfilerConfig,
        ProfilerState,
        _ExperimentalConfig,
        _RecordFunctionFast,
    )
except ImportError:  # a torch without the legacy profiler: the tracker alone measures
    _enable_profiler_legacy = None

_open = threading.local()  # .records: this thread's open records, innermost last
_names = itertools.count()


def _config() -> Any:
    return ProfilerConfig(
        ProfilerState.CPU,
        False,  # report_input_shapes
        True,  # profile_memory
        False,  # with_stack
        False,  # with_flops
        False,  # with_modules
        _ExperimentalConfig(),
    )


def _in_backward() -> bool:
    return torch._C._current_autograd_node() is not None


def _open_records() -> list[CpuAllocatorRecord]:
    if not hasattr(_open, "records"):
        _open.records = []
    return _open.records


def _end_session(records: list[CpuAllocatorRecord]) -> None:
    """Stop the thread's session; every open record reads its reports."""
    session = _disable_profiler_legacy()
    for record in records:
        record._read(session)


class CpuAllocatorRecord:
    """Every allocation and free through PyTorch's CPU allocator while active, read between
    the marks of a :class:`offremat._live_storages.LiveStorageTracker`.

    The allocator reports no free of a block it never saw allocated (one allocated before any
    session, whose size it does not know), while the tracker sees those frees. So the two are
    joined: the tracker marks its live bytes before and after each op, and a span's peak (from
    one mark to the next) is the tracker's bytes at its start plus the most the allocator saw
    rise within it: within one op, the op's outputs and its kernels' own allocations.
    ``peak_bytes`` is the most of them; None where nothing could be recorded (see the module
    notes).
    """

    def __init__(self, base_bytes: int) -> None:
        self.peak_bytes: int | None = None
        # Per span (from entry, then from each mark), its peak; complete once left.
        self.span_peak_bytes: list[int] = [base_bytes]
        self._levels = [base_bytes]  # the tracker's live bytes at each mark, from entry
        self._name = f"{MARK}.{next(_names)}"
        self._span = 0  # the span reading has reached
        self._rise = 0  # how far the allocator rose in it, up to the last session's end
        self._recording = False

    @property
    def recording(self) -> bool:
        """Whether the allocator's reports are being recorded."""
        return self._recording

    @property
    def marks(self) -> int:
        """The marks made so far: the span now running is ``span_peak_bytes[marks]``."""
        return len(self._levels) - 1

    def __enter__(self) -> CpuAllocatorRecord:
        records = _open_records()
        if _enable_profiler_legacy is None or _in_backward():
            return self
        if records:
            _end_session(records)
        elif torch._C._autograd._profiler_enabled():
            _say_foreign()
            return self
        records.append(self)
        self._recording = True
        _enable_profiler_legacy(_config())
        return self

    def mark(self, live_bytes: int) -> None:
        """The tracker's live bytes now: a span ends and the next one starts from them."""
        if self._recording:
            self._levels.append(live_bytes)
            self.span_peak_bytes.append(live_bytes)
            with _RecordFunctionFast(self._name):
                pass

    def __exit__(self, *exc: Any) -> None:
        if not self._recording:
            return
        if _in_backward():
            raise RuntimeError(
                "a CPU allocator record entered outside a backward pass must be left outside "
                "it (offremat._cpu_allocator)"
            )
        records = _open_records()
        _end_session(records)
        records.remove(self)  # every open record has read the session: any order will do
        self._recording = False
        self.peak_bytes = max(self.span_peak_bytes)
        if records:
            _enable_profiler_legacy(_config())

    def _read(self, session: list[list[Any]]) -> None:
        """Raise the spans' peaks by one session's reports, in time order across threads."""
        start = next(
            (r for records in session for r in records if r.name() == "__start_profile"), None
        )
        streams = [
            [r for r in records if _is_counted(r) or r.name() == self._name] for records in session
        ]
        streams = [stream for stream in streams if stream]
        if len(streams) > 1 and start is not None:
            ordered = heapq.merge(*streams, key=start.cpu_elapsed_us)
        else:
            ordered = (r for stream in streams for r in stream)
        # The allocator reports a block's free by the size it noted when profiling saw it
        # allocated; one allocated before any session is freed unreported, and a mark starts
        # the next span again from the tracker's bytes.
        allocated, span_start = 0, -self._rise
        for record in ordered:
            if record.kind() == "memory_alloc":
                allocated += record.cpu_memory_usage()
                self._rise = allocated - span_start
                level = self._levels[self._span] + self._rise
                self.span_peak_bytes[self._span] = max(self.span_peak_bytes[self._span], level)
            elif record.kind() == "push":
                self._span += 1
                self._rise = 0
                span_start = allocated


def _is_counted(record: Any) -> bool:
    return record.kind() == "memory_alloc" and abs(record.cpu_memory_usage()) >= SMALL_BYTES


@functools.cache
def _say_foreign() -> None:
    logger.warning(
        "a profiler is running on this thread: offremat's CPU measurements read the storages "
        "ops return but not what kernels allocate inside themselves (oneDNN's scratch, im2col "
        "buffers), so profiles made now leave that out of the plans"
    )
