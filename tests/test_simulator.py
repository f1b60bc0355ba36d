"""The simulator on hand-computed cases: compute, copies, overlap, releases and admission."""

from __future__ import annotations

import pytest

from solvers.chain import Chain, Link, Stage
from solvers.plan import (
    ACTIVATION,
    PlanError,
    backward,
    forward_all,
    forward_checkpoint,
    forward_none,
    free,
    offload,
    prefetch,
    validate,
)
from solvers.semantics import refills
from solvers.simulator import simulate

SLOW_LINK = Link(10.0, 10.0)


def chain(link: Link | None = SLOW_LINK) -> Chain:
    """Three equal stages: f=1, b=2, x=10, x̄=30, ftmp=5, btmp=7; input 10."""
    stages = tuple(Stage(f"s{i}", 1.0, 2.0, 10, 30, 5, 7) for i in (1, 2, 3))
    return Chain("three", 10, stages, link)


KEEP_ALL = [forward_all(1), forward_all(2), forward_all(3), backward(3), backward(2), backward(1)]


def test_keep_all_time_and_peak() -> None:
    result = simulate(KEEP_ALL, chain(), None)
    assert result.makespan_s == 9.0
    # a_0 + δ_3 + three saved sets, then B(3) adds δ_2 and its temporary.
    assert result.peak_bytes == 10 + 10 + 3 * 30 + 10 + 7
    assert result.wait_s == 0.0
    assert [i.lane for i in result.timeline] == ["compute"] * 6


def test_recompute_plan_peak_follows_rotors_accounting() -> None:
    ops = [
        forward_checkpoint(1),  # keeps a_0, makes a_1
        forward_none(2),  # releases a_1, makes a_2
        forward_all(3),
        backward(3),  # releases x̄_3, δ_3 and a_2
        forward_all(1),
        forward_all(2),
        backward(2),
        backward(1),
    ]
    result = simulate(ops, chain(), None)
    assert result.makespan_s == 3 * 1.0 + 3 * 2.0 + 2 * 1.0
    levels = dict(result.memory_curve)
    # B(3) starts at t=3: a_0, δ_3, a_2, x̄_3 (F_all(3)'s temporary gone), δ_2 and btmp.
    assert levels[3.0] == 10 + 10 + 10 + 30 + 10 + 7
    # The peak is B(2) at t=7: a_0, δ_2, x̄_1, x̄_2, then δ_1 and btmp.
    assert result.peak_bytes == levels[7.0] == 10 + 10 + 30 + 30 + 10 + 7


def test_offload_overlaps_compute_and_frees_when_the_copy_ends() -> None:
    ops = [
        forward_all(1),
        forward_all(2),
        offload("saved", 1),  # issued when F_all(2) starts, at t=1
        forward_all(3),
        prefetch("saved", 1),  # issued when F_all(3) starts, after the offload: t=4..7
        backward(3),
        backward(2),  # waits for the prefetch until t=7
        backward(1),
    ]
    result = simulate(ops, chain(), None)
    lanes = {i.label: (i.lane, i.start_s, i.end_s) for i in result.timeline}
    assert lanes["offload(x̄1)"] == ("d2h", 1.0, 4.0)
    assert lanes["prefetch(x̄1)"] == ("h2d", 4.0, 7.0)
    assert lanes["B(2)"] == ("compute", 7.0, 9.0)
    assert result.makespan_s == 11.0
    assert result.wait_s == 2.0
    curve = dict(result.memory_curve)
    assert curve[4.0] == 127  # released and re-allocated in the same instant
    assert curve[5.0] == 127 - 30 - 10 - 7  # B(3) ends: x̄_3, δ_3, btmp go


def test_admission_delays_a_compute_op_until_an_offload_ends() -> None:
    ops = [forward_all(1), forward_all(2), offload("saved", 1), forward_all(3)]
    ops += [backward(3), prefetch("saved", 1), backward(2), backward(1)]
    # Offload of x̄_1 runs t=1..4. F_all(3) is ready at t=2 but needs 35 more bytes on top of
    # a_0, δ_3, x̄_1, x̄_2 = 80: with a budget of 105 it waits for x̄_1 to leave at t=4.
    result = simulate(ops, chain(), 105)
    starts = {i.label: i.start_s for i in result.timeline}
    assert starts["F_all(3)"] == 4.0
    assert result.peak_bytes <= 105
    assert simulate(ops, chain(), None).timeline[3].start_s == 2.0


def test_admission_delays_a_prefetch_until_memory_is_released() -> None:
    fast = chain(Link(30.0, 30.0))
    ops = [forward_all(1), forward_all(2), offload("saved", 1), forward_all(3)]
    ops += [backward(3), prefetch("saved", 1), backward(2), backward(1)]
    unlimited = {i.label: i.start_s for i in simulate(ops, fast, None).timeline}
    assert unlimited["prefetch(x̄1)"] == 3.0  # issued when B(3) starts
    # With 105 bytes the prefetch (30) cannot join B(3)'s 97 bytes; it waits for B(3) to end.
    result = simulate(ops, fast, 105)
    starts = {i.label: i.start_s for i in result.timeline}
    assert starts["F_all(3)"] == 2.0  # the offload ended at t=2, released before allocating
    assert starts["prefetch(x̄1)"] == 5.0
    assert starts["B(2)"] == 6.0
    assert result.peak_bytes <= 105


def test_free_releases_at_the_end_of_the_preceding_compute_op() -> None:
    ops = [forward_checkpoint(1), forward_all(2), free("activation", 1), forward_all(3)]
    ops += [backward(3), forward_checkpoint(1), backward(2), forward_all(1), backward(1)]
    result = simulate(ops, chain(), None)
    assert result.makespan_s == 3 * 1.0 + 3 * 2.0 + 2 * 1.0
    curve = dict(result.memory_curve)
    # While F_all(2) runs it reads a_1: a_0, δ_3, a_1, x̄_2 and the temporary.
    assert curve[1.0] == 10 + 10 + 10 + 30 + 5
    # a_1 goes when F_all(2) ends, before F_all(3) allocates x̄_3 and its temporary.
    assert curve[2.0] == 10 + 10 + 30 + 30 + 5


def test_incomplete_plans_are_refused() -> None:
    ops = [forward_checkpoint(1), forward_all(2), free("activation", 1), forward_all(3)]
    with pytest.raises(PlanError, match="backward B"):
        simulate(ops, chain(), None)


def test_the_input_is_never_offloaded() -> None:
    # The caller holds a_0 for the whole step, so the executor never moves it; a plan that
    # offloads it would be scored below what it holds.
    ops = [forward_all(1), offload("activation", 0), forward_all(2), forward_all(3)]
    ops += [backward(3), backward(2), prefetch("activation", 0), backward(1)]
    with pytest.raises(PlanError, match="a0 is the caller's input"):
        simulate(ops, chain(), None)


def test_validation_lists_every_broken_rule() -> None:
    ops = [forward_all(2), prefetch("saved", 1), backward(1), backward(1)]
    problems = validate(ops, chain())
    text = "\n".join(problems)
    assert "input a1 is not resident" in text
    assert "never offloaded" in text
    assert "backward done twice" in text
    assert "B(3) is missing" in text


def test_offload_then_read_is_rejected() -> None:
    ops = [forward_all(1), offload("saved", 1), forward_all(2)]
    assert any("a1 is not resident" in p for p in validate(ops, chain()))


def test_copies_need_a_link() -> None:
    ops = [forward_all(1), forward_all(2), offload("saved", 1), forward_all(3)]
    ops += [prefetch("saved", 1), backward(3), backward(2), backward(1)]
    with pytest.raises(ValueError, match="no link"):
        simulate(ops, chain(link=None), None)


def test_zero_length_ops_still_count_their_temporaries() -> None:
    stages = (Stage("s1", 0.0, 0.0, 1, 1, 50, 0),)
    result = simulate([forward_all(1), backward(1)], Chain("z", 1, stages), None)
    assert result.peak_bytes == 1 + 1 + 1 + 50  # a_0, δ_1, x̄_1 and the forward temporary


@pytest.mark.parametrize("backward_s", [0.0, 1e-12, 1.0])
def test_a_backward_that_frees_part_of_its_saved_set_peaks_alike_however_long(
    backward_s: float,
) -> None:
    """A negative backward temporary: B(2) has freed 20 of x̄_2's 30 bytes by its peak. A
    backward that took no time gave those bytes back before releasing x̄_2, a spike of 20."""
    stages = (Stage("s1", 1.0, 1.0, 10, 10), Stage("s2", 1.0, backward_s, 10, 30, 0, -20))
    result = simulate([*KEEP_ALL[:2], backward(2), backward(1)], Chain("n", 0, stages), None)
    # F_all(2): x̄_1, δ_2 and x̄_2; B(2) adds δ_1 less the 20 freed by its peak.
    assert result.peak_bytes == 10 + 10 + 30


def test_free_of_a_tensor_still_arriving_waits_for_its_prefetch() -> None:
    ops = [forward_all(1), forward_all(2), offload("saved", 1), forward_all(3)]
    ops += [backward(3), prefetch("saved", 1), free("saved", 1)]
    ops += [forward_all(1), backward(2), backward(1)]
    result = simulate(ops, chain(), None)
    prefetch_span = next(i for i in result.timeline if i.label == "prefetch(x̄1)")
    # The prefetch allocates at t=4 (issued when B(3) starts, after the offload ended) and
    # ends at t=7; the free cannot release before then, although B(3) ended at t=5.
    assert (prefetch_span.start_s, prefetch_span.end_s) == (4.0, 7.0)
    levels = dict(result.memory_curve)
    # t=5: B(3) releases x̄_3, δ_3 and btmp and F_all(1) allocates x̄_1 + ftmp; the arriving
    # x̄_1 is still held.
    assert levels[5.0] == levels[4.0] - (30 + 10 + 7) + 35
    # t=6: F_all(1)'s temporary goes, B(2) allocates δ_1 and btmp. t=7: the free lands.
    assert levels[6.0] == levels[5.0] - 5 + 17
    assert levels[7.0] == levels[6.0] - 30


def test_an_f_all_right_before_its_backward_after_a_checkpoint_is_a_refill() -> None:
    stages = tuple(Stage(f"s{i}", 1.0, 2.0, 10, 30, refill_s=0.25) for i in (1, 2, 3))
    quick = Chain("three", 10, stages)
    ops = [
        forward_checkpoint(1),
        forward_checkpoint(2),
        forward_all(3),
        backward(3),  # F_all(3) is stage 3's first forward: f_3
        forward_all(2),
        backward(2),  # after F_ck(2): a refill, r_2
        forward_all(1),
        backward(1),  # after F_ck(1): r_1
    ]
    assert refills(ops) == {4, 6}
    assert simulate(ops, quick, None).makespan_s == 3 * 1.0 + 2 * 0.25 + 3 * 2.0
    assert refills([*ops[:6], forward_all(1), free(ACTIVATION, 1), backward(1)]) == {4}


@pytest.mark.parametrize("seed", range(20))
def test_compute_time_is_the_time_of_a_copy_free_plan_and_bounds_every_plan(seed: int) -> None:
    # dp_family skips simulating a baseline whose compute time alone is no faster than the
    # DP's plan: that must be the simulated time of a plan without copies, and a lower bound
    # of any plan's.
    import random

    from solvers.baselines import checkpoint_sequential_plan, offload_all
    from solvers.simulator import compute_time_s
    from tests.test_dp import random_chain

    chain = random_chain(random.Random(seed), 6)
    for segments in range(1, chain.length + 1):
        plan = checkpoint_sequential_plan(chain, segments)
        assert compute_time_s(plan, chain) == simulate(plan, chain, None).makespan_s
    linked = Chain(chain.name, chain.input_bytes, chain.stages, link=Link(1e8, 1e8))
    plan = offload_all(linked)
    assert compute_time_s(plan, linked) <= simulate(plan, linked, None).makespan_s
