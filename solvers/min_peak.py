"""The least-peak checkpoint selection of Hong, Tsai, Wang, Liu and Wu, "GPU memory usage
optimization for backward propagation in deep network training" (JPDC 2025).

Their problem: choose which stage inputs to keep as checkpoints during the forward so that
the peak memory of the step is least, every segment between two checkpoints being recomputed
once, just before its backward. This is the family of ``checkpoint_sequential`` with free
segment boundaries. On the chain model a segmentation (f_1 = 1 < f_2 < ... < f_k) runs:

- forward: each segment but the last without autograd (F_ck on its first stage, F_none on the
  rest), keeping only its input a_{f-1}; the last segment with autograd (F_all);
- backward: the last segment's backwards, then each earlier segment recomputed with F_all from
  its checkpoint and followed by its backwards.

Design note, the recurrence. While segment j runs (its forward or its backward), the GPU also
holds the checkpoints of the segments before it, E_j = Σ_{j' < j} a_{f_j' - 1}, and nothing
else of theirs. So the peak is max_j (E_j + c(f_j, l_j)), where c is the segment's own peak
(its checkpoint included), and the least peak of stages f..L, when f starts a segment, is

    g(f) = min over l in f..L of  max(c(f, l), a_{f-1} + g(l + 1)),   c(f, L) for l = L.

c(f, l) for growing l is a running maximum, so the whole table takes O(L²) time (the paper
gives an O(L³) DP and an O(L) algorithm for its own cost model). rotor's least memory
(:func:`solvers.dp.memory_need`) is never larger: its plans may recompute a segment's inside
from checkpoints of its own, several levels deep, which this family cannot.
"""

from __future__ import annotations

import math

from solvers.chain import Chain


def segment_peaks(chain: Chain, first: int) -> list[tuple[int, int]]:
    """For l = first..L: the peak of segment (first, l) as a middle segment and as the last
    one, checkpoint a_{first-1} included (the memory rules of ``docs/plan-format.md``). A
    middle segment is recomputed after B(L), so beside the caller's ``held_bytes``."""
    x, a, d = chain.saved_bytes, chain.activation_bytes, chain.grad_bytes
    length = chain.length
    checkpoint = a(first - 1)
    stage = chain.stage(first)
    # Forward without autograd: a_{f-1} kept, then each stage's input, output and temporary.
    no_grad = d(length) + checkpoint + a(first) + stage.nograd_fwd_tmp_bytes
    with_grad = 0  # max over i of Σ_{m<i} x̄_m + x̄_i + forward temporary, from stage f
    backward_peak = 0  # max over i of Σ_{m<=i} x̄_m + δ_i + δ_{i-1} + backward temporary
    saved_so_far = 0
    peaks = []
    for i in range(first, length + 1):
        stage = chain.stage(i)
        if i > first:
            no_grad = max(
                no_grad, d(length) + checkpoint + a(i - 1) + a(i) + stage.nograd_fwd_tmp_bytes
            )
        with_grad = max(with_grad, saved_so_far + x(i) + stage.fwd_tmp_bytes)
        saved_so_far += x(i)
        # From the end of B(L), the caller holds its output and seed gradient.
        held = chain.held_bytes if i < length else 0
        # A negative temporary frees part of x̄_i by the backward's peak, never before its
        # start (solvers.bounds.working_set).
        backward_peak = max(
            backward_peak, saved_so_far + d(i) + max(0, d(i - 1) + stage.bwd_tmp_bytes) + held
        )
        recompute = checkpoint + d(i) + with_grad + chain.held_bytes
        middle = max(no_grad, recompute, checkpoint + backward_peak)
        last = max(checkpoint + d(length) + with_grad, checkpoint + backward_peak)
        peaks.append((middle, last))
    return peaks


def least_peak_segments(chain: Chain) -> tuple[int, list[tuple[int, int]]]:
    """The least peak of a segmented plan and its segments (first, last), by the recurrence
    of the module's design note; among segmentations of equal peak, less recomputation
    time is preferred at each step."""
    length = chain.length
    # best[f] = (peak of stages f..L with f starting a segment, recomputed seconds, segment end)
    best: list[tuple[float, float, int]] = [(-math.inf, 0.0, length)] * (length + 2)
    forward_s = [0.0] + [stage.fwd_s for stage in chain.stages]
    for first in range(length, 0, -1):
        options = []
        recomputed = 0.0
        for last, (middle, final) in enumerate(segment_peaks(chain, first), start=first):
            recomputed += forward_s[last]
            if last == length:
                options.append((final, 0.0, last))
                continue
            rest_peak, rest_s, _ = best[last + 1]
            peak = max(middle, chain.activation_bytes(first - 1) + rest_peak)
            options.append((peak, recomputed + rest_s, last))
        best[first] = min(options)
    segments, first = [], 1
    while first <= length:
        last = best[first][2]
        segments.append((first, last))
        first = last + 1
    # Every plan ends holding δ_0 and the caller's bytes (B(1) lets a_0 go), whichever
    # segments it has.
    end = chain.grad_bytes(0) + chain.held_bytes
    return int(max(best[1][0], end)), segments
