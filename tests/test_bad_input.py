"""What offremat promises about bad input: a clear error that says what to do, never a
traceback and never a silently wrong result. One test per case, each failing before its fix."""

from __future__ import annotations

import json

import pytest

from solvers.plan import Plan


def plan_text(budget) -> str:
    return json.dumps(
        {
            "format": "offremat.plan/1",
            "chain": "c",
            "stages": ["a"],
            "solver": "dp",
            "budget_bytes": budget,
            "ops": [{"op": "F_all", "index": 1}, {"op": "B", "index": 1}],
        }
    )


@pytest.mark.parametrize("budget", [-5, 0, -1.0])
def test_a_plan_with_a_budget_that_is_not_positive_is_refused(budget) -> None:
    with pytest.raises(ValueError, match="'budget_bytes' must be a positive integer"):
        Plan.from_dict(json.loads(plan_text(budget)))


def test_a_plan_without_a_budget_is_read() -> None:
    assert Plan.from_dict(json.loads(plan_text(None))).budget_bytes is None


def test_demo_with_an_unknown_device_is_a_usage_error(capsys) -> None:
    from offremat.cli import main

    assert main(["demo", "--device", "nope"]) == 2
    assert "--device 'nope' is not a device" in capsys.readouterr().err
