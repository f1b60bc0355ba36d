"""The host link that offloads use: parse a given bandwidth, or measure a CUDA device's.

Beaumont, Eyraud-Dubois and Shilova (2021) model offloading as copies over one device-to-host
and one host-to-device channel running beside compute; these are their bandwidths.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence

import torch

from solvers.budget import format_bytes
from solvers.chain import Link

logger = logging.getLogger(__name__)

LINK_SIZES = (2**23, 2**26, 2**28)
"""Bytes per copy when measuring the link: 8 MiB, 64 MiB, 256 MiB."""


def measure_link(
    device: torch.device, sizes: Sequence[int] = LINK_SIZES, repeats: int = 3
) -> tuple[Link, list[dict[str, float]]]:
    """Pinned device-to-host and host-to-device bandwidth on ``device``.

    Each size is copied in each direction alone and in both directions at once; the link is
    the slower of the two readings per direction at the largest size that fits, since the
    simulator runs the two channels at once.
    """
    free_bytes, _ = torch.cuda.mem_get_info(device)
    usable = [size for size in sizes if 4 * size <= free_bytes] or [min(sizes)]
    readings = []
    streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    for size in usable:
        hosts = [
            torch.empty(size, dtype=torch.uint8, device="cpu", pin_memory=True) for _ in range(2)
        ]
        devices = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]
        d2h = [(hosts[0], devices[0])]
        h2d = [(devices[1], hosts[1])]
        alone_d2h = _median_copy_times(device, streams, d2h, repeats)[0]
        alone_h2d = _median_copy_times(device, streams, h2d, repeats)[0]
        both_d2h, both_h2d = _median_copy_times(device, streams, d2h + h2d, repeats)
        readings.append(
            {
                "bytes": size,
                "d2h_alone_bytes_per_s": size / alone_d2h,
                "h2d_alone_bytes_per_s": size / alone_h2d,
                "d2h_both_bytes_per_s": size / both_d2h,
                "h2d_both_bytes_per_s": size / both_h2d,
            }
        )
    last = readings[-1]
    link = Link(
        min(last["d2h_alone_bytes_per_s"], last["d2h_both_bytes_per_s"]),
        min(last["h2d_alone_bytes_per_s"], last["h2d_both_bytes_per_s"]),
    )
    logger.info(
        "link on %s: device-to-host %s/s, host-to-device %s/s",
        device,
        format_bytes(link.d2h_bytes_per_s),
        format_bytes(link.h2d_bytes_per_s),
    )
    return link, readings


def _median_copy_times(
    device: torch.device,
    streams: tuple[torch.cuda.Stream, torch.cuda.Stream],
    copies: list[tuple[torch.Tensor, torch.Tensor]],
    repeats: int,
) -> list[float]:
    """Median seconds from a common start to the end of each copy, each on its own stream."""
    times: list[list[float]] = [[] for _ in copies]
    for attempt in range(repeats + 1):
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(device))
        ends = []
        for (destination, source), stream in zip(copies, streams, strict=False):
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                destination.copy_(source, non_blocking=True)
            ends.append(stream.record_event(torch.cuda.Event(enable_timing=True)))
        torch.cuda.synchronize(device)
        if attempt > 0:  # the first round warms up
            for k, end in enumerate(ends):
                times[k].append(start.elapsed_time(end) / 1000)
    return [statistics.median(t) for t in times]
