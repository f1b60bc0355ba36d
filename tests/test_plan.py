"""The plan format: JSON round trip, derived decisions, and malformed input."""

from __future__ import annotations

import json

import pytest

from solvers.chain import Chain, Link, Stage
from solvers.plan import (
    ACTIVATION,
    Op,
    Plan,
    backward,
    forward_all,
    forward_checkpoint,
    forward_none,
    free,
    offload,
    prefetch,
    validate,
)

CHAIN = Chain(
    "four",
    8,
    tuple(Stage(f"block{i}", 1.0, 2.0, 8, 24) for i in range(1, 5)),
    Link(1e3, 1e3),
)

MIXED = (
    forward_checkpoint(1),  # block1 and block2 are recomputed from a_0
    forward_none(2),
    forward_all(3),
    forward_all(4),
    offload("saved", 3),  # block3 goes to the host
    backward(4),
    prefetch("saved", 3),
    backward(3),
    forward_all(1),
    forward_all(2),
    backward(2),
    backward(1),
)


def mixed_plan() -> Plan:
    return Plan(ops=MIXED, stage_names=CHAIN.stage_names, solver="hand")


def test_decisions_follow_the_ops() -> None:
    assert mixed_plan().decisions == {
        "block1": "recompute",
        "block2": "recompute",
        "block3": "offload",
        "block4": "keep",
    }


def test_json_round_trip(tmp_path) -> None:
    path = tmp_path / "plan.json"
    mixed_plan().save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "offremat.plan/1"
    assert data["ops"][4] == {"op": "offload", "tensor": "saved", "index": 3}
    assert data["decisions"]["block3"] == "offload"
    assert Plan.load(path) == mixed_plan()


@pytest.mark.parametrize(
    ("decisions", "message"),
    [
        ({"block3": "offlaod"}, "says stage 'block3' is 'offlaod'"),
        ({"block3": "keep"}, "the plan's 'ops' make it 'offload'"),
        ({"block9": "keep"}, "names stage 'block9'"),
        ("keep", "must be an object"),
    ],
)
def test_decisions_that_disagree_with_the_ops_are_refused(decisions, message) -> None:
    # A hand-edited plan file's typo was read silently before (a new user's trial).
    data = mixed_plan().to_dict()
    if isinstance(decisions, dict):
        decisions = {**data["decisions"], **decisions}
    data["decisions"] = decisions
    with pytest.raises(ValueError, match=message):
        Plan.from_dict(data)
    del data["decisions"]
    assert Plan.from_dict(data) == mixed_plan()


def test_decisions_that_leave_a_stage_out_are_refused() -> None:
    data = mixed_plan().to_dict()
    del data["decisions"]["block2"]
    with pytest.raises(ValueError, match="leaves out stage 'block2'"):
        Plan.from_dict(data)


def test_op_text_names_the_tensor() -> None:
    assert str(offload("saved", 3)) == "offload(x̄3)"
    assert str(prefetch("activation", 0)) == "prefetch(a0)"
    assert str(forward_none(2)) == "F_none(2)"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"format": "offremat.plan/0", "stages": [], "solver": "x", "ops": []}, "format"),
        ({"format": "offremat.plan/1", "solver": "x", "ops": []}, "stages"),
        (
            {"format": "offremat.plan/1", "stages": [], "solver": "x", "ops": [{"op": "F_all"}]},
            "ops",
        ),
        (
            {
                "format": "offremat.plan/1",
                "stages": [],
                "solver": "x",
                "ops": [{"op": "jump", "index": 1}],
            },
            "ops",
        ),
        ({"format": "offremat.plan/1", "stages": 5, "solver": "x", "ops": []}, "stages"),
        (
            {
                "format": "offremat.plan/1",
                "stages": [],
                "solver": "x",
                "ops": [],
                "budget_bytes": "1",
            },
            "budget_bytes",
        ),
        (
            {"format": "offremat.plan/1", "stages": [], "solver": "x", "ops": [], "budget_byte": 9},
            "unknown field.*budget_byte",
        ),
        (  # a misspelled required field: named with the one it misspells, not as missing
            {"format": "offremat.plan/1", "stages": [], "solvr": "x", "ops": []},
            r"'solvr' \(did you mean 'solver'\?\)",
        ),
        (
            {
                "format": "offremat.plan/1",
                "stages": [],
                "solver": "x",
                "ops": [{"op": "B", "index": 1, "tensro": "saved"}],
            },
            "unknown field.*tensro",
        ),
        *(
            (
                {
                    "format": "offremat.plan/1",
                    "stages": [],
                    "solver": "x",
                    "ops": [{"op": "B", "index": index}],
                },
                "index.*integer",
            )
            for index in (1.7, "2", True)
        ),
        (  # fewer stage names than the ops run: an IndexError once, in decisions (review 41)
            {
                "format": "offremat.plan/1",
                "stages": ["a"],
                "solver": "x",
                "ops": [{"op": "F_all", "index": 2}, {"op": "B", "index": 2}],
                "decisions": {"a": "keep"},
            },
            "'stages' names 1 stages, but 'ops' run stage 2",
        ),
    ],
)
def test_malformed_plans_name_the_field(raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Plan.from_dict(raw)


def test_ops_check_their_target() -> None:
    with pytest.raises(ValueError, match="target"):
        Op("offload", 1)
    with pytest.raises(ValueError, match="stage index"):
        Op("B", 1, "saved")


def test_the_callers_input_is_never_moved_or_freed() -> None:
    # The executor never moves a0 (the caller holds it): a plan that did would be scored as
    # holding less than it does (a hand plan offloading it measured 1.39x its budget).
    chain = Chain("two", 10, (Stage("s1", 1.0, 1.0, 4, 8), Stage("s2", 1.0, 1.0, 4, 8)))
    for memory_op in (offload, free):
        ops = [forward_all(1), memory_op(ACTIVATION, 0), forward_all(2), backward(2)]
        ops += [prefetch(ACTIVATION, 0)] if memory_op is offload else []
        problems = validate([*ops, backward(1)], chain)
        assert any("a0 is the caller's input" in problem for problem in problems)


def test_the_step_s_output_is_never_moved_or_freed() -> None:
    # The caller holds the output, and through it the graph that saved x̄_L: a plan freeing
    # x̄_L and running F_all(L) again measured 8.8% over its predicted peak.
    forwards = [forward_all(i) for i in range(1, 5)]
    backwards = [backward(i) for i in range(4, 0, -1)]
    for tensor in (("saved", 4), (ACTIVATION, 4)):
        freed = validate([*forwards, free(*tensor), forward_all(4), *backwards], CHAIN)
        moved = validate([*forwards, offload(*tensor), prefetch(*tensor), *backwards], CHAIN)
        for problems in (freed, moved):
            assert any("holds the step's output" in problem for problem in problems), problems


def test_a_prefetch_no_backward_reads_is_invalid() -> None:
    # Frozen stages run no backward: a prefetch of x̄_1 with two frozen stages only held
    # memory. With one, B(2) reads a_1 inside it, and the prefetch is valid.
    ops = [
        forward_checkpoint(1),
        forward_all(1),
        offload("saved", 1),
        forward_checkpoint(2),
        forward_all(3),
        forward_all(4),
        backward(4),
        backward(3),
        prefetch("saved", 1),
    ]
    chain = Chain("frozen", 8, CHAIN.stages, Link(1e3, 1e3), frozen_stages=2)
    assert validate(ops, chain) == [
        "op 8 prefetch(x̄1): prefetch of a tensor no backward reads (B(2) is not run for a "
        "frozen stage)"
    ]
    chain = Chain("frozen", 8, CHAIN.stages, Link(1e3, 1e3), frozen_stages=1)
    reads = [forward_all(1), forward_all(2), offload("saved", 1), *ops[4:], backward(2)]
    assert validate(reads, chain) == []


def test_a_prefetch_of_a_tensor_whose_backward_is_done_is_invalid() -> None:
    """After B(2) nothing reads x̄_2 again, and the executor drops its host copy there: a
    prefetch of it afterwards names why, rather than fail in the executor."""
    late = (
        forward_all(1),
        forward_all(2),
        forward_all(3),
        offload("saved", 2),
        forward_all(4),
        backward(4),
        prefetch("saved", 2),
        backward(3),
        backward(2),
        prefetch("saved", 2),
        backward(1),
    )
    assert validate(late, CHAIN) == [
        "op 9 prefetch(x̄2): prefetch of a tensor no later op reads (its backward is done)"
    ]
