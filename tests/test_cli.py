"""``offremat solve``: every solver on every shipped chain, JSON fields, budgets, exit codes."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from offremat import examples
from offremat.cli import main
from solvers.chain import Chain
from solvers.plan import Plan, validate
from solvers.registry import SOLVERS, keep_all_peak, lower_bound_s, solve
from solvers.simulator import simulate

EXAMPLES = ("transformer", "cnn", "llama7b")
REQUIRED_FIELDS = {
    "feasible",
    "solver",
    "budget_bytes",
    "predicted_time_s",
    "predicted_peak_bytes",
    "decisions",
    "ops",
    "lower_bound_s",
}


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def solve_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code, out, err = run_cli(capsys, "solve", *argv, "--json")
    assert out, err
    return code, json.loads(out)


def _solver_args(solver: str) -> list[str]:
    # Keep the MILP short in tests; its quality is tested in its own files.
    return ["--time-limit", "2"] if solver in ("milp", "checkmate") else []


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("name", EXAMPLES)
def test_every_solver_answers_on_every_example(
    capsys: pytest.CaptureFixture[str], name: str, solver: str
) -> None:
    chain = examples.load(name)
    code, report = solve_json(
        capsys, name, "--budget", "1.0", "--solver", solver, *_solver_args(solver)
    )
    assert code == 0, report
    assert set(report) >= REQUIRED_FIELDS
    assert report["feasible"] is True
    assert report["solver"] == solver
    assert report["budget_bytes"] == keep_all_peak(chain)
    assert report["predicted_peak_bytes"] <= report["budget_bytes"]
    assert report["lower_bound_s"] <= report["predicted_time_s"] * (1 + 1e-12)
    assert list(report["decisions"]) == list(chain.stage_names)
    fields = ("chain", "stages", "solver", "budget_bytes", "ops")
    plan = Plan.from_dict({"format": "offremat.plan/1", **{k: report[k] for k in fields}})
    assert validate(plan, chain) == []
    # The figures are the simulator's for the printed ops.
    replay = simulate(plan, chain, report["budget_bytes"])
    assert replay.makespan_s == pytest.approx(report["predicted_time_s"])
    assert replay.peak_bytes == report["predicted_peak_bytes"]


def test_fraction_size_and_byte_budgets(capsys: pytest.CaptureFixture[str]) -> None:
    peak = keep_all_peak(examples.load("cnn"))
    for text, expected in (
        ("0.5", int(0.5 * peak)),
        ("1.0", peak),
        ("2GiB", 2 * 2**30),
        ("1500MB", 1500 * 10**6),
        ("1234567890", 1234567890),
    ):
        code, report = solve_json(
            capsys, "cnn", "--budget", text, "--solver", "checkpoint-every-stage"
        )
        assert code == 0
        assert report["budget_bytes"] == expected, text


def test_dp_json_matches_the_registry(capsys: pytest.CaptureFixture[str]) -> None:
    chain = examples.load("transformer")
    budget = int(0.4 * keep_all_peak(chain))
    code, report = solve_json(capsys, "transformer", "--budget", str(budget), "--slots", "300")
    assert code == 0
    expected = solve(chain, budget, "dp", slots=300)
    assert report["predicted_time_s"] == expected.predicted_time_s
    assert report["predicted_peak_bytes"] == expected.predicted_peak_bytes
    assert report["decisions"] == expected.decisions
    assert report["overhead"] == pytest.approx(
        expected.predicted_time_s / chain.compute_time_s - 1  # type: ignore[operator]
    )
    assert report["lower_bound_s"] == lower_bound_s(chain, budget)


def test_plain_output_is_a_table_with_the_figures(capsys: pytest.CaptureFixture[str]) -> None:
    chain = examples.load("cnn")
    code, out, _ = run_cli(capsys, "solve", "cnn", "--budget", "0.7", "--solver", "chen")
    assert code == 0
    for stage in chain.stages:
        assert stage.name in out
    plan = solve(chain, int(0.7 * keep_all_peak(chain)), "chen")
    for decision in set(plan.decisions.values()):
        assert decision in out
    assert "predicted time" in out and "over Σ fwd + Σ bwd" in out
    assert "predicted peak" in out and "budget" in out
    overhead = plan.predicted_time_s / chain.compute_time_s - 1  # type: ignore[operator]
    assert f"{overhead:+.1%}" in out
    # Captured output is no terminal: each line of prose stays whole, as a pipe reads it.
    (line,) = [text for text in out.splitlines() if text.startswith("predicted time")]
    assert "lower bound at this budget" in line


@pytest.mark.parametrize(
    ("offload", "shown_ms"), [(True, "63.98 ms"), (False, "62.85 ms, 63.98 ms recomputing only")]
)
def test_the_bound_shown_is_the_one_the_plan_met(
    offload: bool, shown_ms: str, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    """At 60% the milp returns the dp's plan because it meets the whole-tensor bound: the
    bound shown beside it is that one (the fractional 62.85 ms read as a contradiction), and
    without offloading, where it bounds recomputing plans only, beside the one for every
    plan."""
    monkeypatch.setenv("COLUMNS", "200")
    argv = ["solve", "transformer", "--budget", "0.6", "--solver", "milp", "--time-limit", "5"]
    argv += [] if offload else ["--no-offload"]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0
    assert f"lower bound at this budget {shown_ms}" in out


def test_without_a_link_the_bound_the_plan_met_is_the_lower_bound(
    tmp_path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    """No plan offloads on a chain without a host link, so the whole-tensor bound on
    recomputing plans bounds every plan: shown as the lower bound, not beside a looser one (a
    new user read "recomputing only" as room that offloading could take)."""
    import dataclasses

    from offremat.commands import load_chain

    monkeypatch.setenv("COLUMNS", "200")
    path = tmp_path / "no-link.json"
    dataclasses.replace(load_chain("transformer"), link=None).save(path)
    argv = ["solve", str(path), "--budget", "0.6", "--solver", "milp", "--time-limit", "5"]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0
    assert "lower bound at this budget 63.98 ms)" in out


def test_infeasible_budget_exits_3_with_the_least_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, report = solve_json(capsys, "cnn", "--budget", "0.05", "--solver", "chen")
    assert code == 3
    assert report["feasible"] is False
    least = report["min_budget_bytes"]
    assert least > report["budget_bytes"] and report["min_budget_is_least"] is True
    code, greedy = solve_json(capsys, "cnn", "--budget", "0.05", "--solver", "dtr")
    assert code == 3 and greedy["min_budget_is_least"] is False
    code, report = solve_json(capsys, "cnn", "--budget", str(least), "--solver", "chen")
    assert code == 0 and report["predicted_peak_bytes"] <= least
    code, _, err = run_cli(capsys, "solve", "cnn", "--budget", "0.05", "--solver", "chen")
    assert code == 3
    assert "least feasible budget" in err and str(least) in err


def test_infeasible_dp_names_a_budget_that_works(capsys: pytest.CaptureFixture[str]) -> None:
    code, report = solve_json(capsys, "transformer", "--budget", "0.1")
    assert code == 3
    code, again = solve_json(capsys, "transformer", "--budget", str(report["min_budget_bytes"]))
    assert code == 0 and again["feasible"] is True


def _malformed_chain(tmp_path: Path) -> Path:
    data = examples.load("cnn").to_dict()
    del data["stages"][2]["bwd_s"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return path


def _linkless_chain(tmp_path: Path) -> Path:
    path = tmp_path / "nolink.json"
    examples.load("cnn").with_link(None).save(path)
    return path


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["cnn", "--budget", "lots"], "is not a size"),
        (["cnn", "--budget", "1.5x"], "is not a size"),
        (["cnn", "--budget", "-3"], "is not a size"),
        (["no/such/chain.json", "--budget", "1GiB"], "no chain file"),
        (["MALFORMED", "--budget", "1GiB"], "stage 3"),
        (["MALFORMED", "--budget", "1GiB"], "bwd_s"),
        (["NOLINK", "--budget", "1.0", "--solver", "offload-all"], "no link"),
        (["cnn", "--budget", "1.0", "--slots", "0"], "--slots"),
        (["cnn", "--budget", "1.0", "--solver", "greedy"], "invalid choice"),
        (["cnn"], "--budget"),
        (["cnn", "--budget", "1.0", "--out", "/no/such/dir/plan.json"], "in an existing folder"),
    ],
)
def test_usage_errors_exit_2_with_a_message(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], expected: str
) -> None:
    paths = {"MALFORMED": _malformed_chain(tmp_path), "NOLINK": _linkless_chain(tmp_path)}
    argv = [str(paths.get(arg, arg)) for arg in argv]
    code, out, err = run_cli(capsys, "solve", *argv)
    assert code == 2
    assert out == ""
    assert expected in err


def test_bare_invocation_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys)
    assert code == 2
    assert "solve" in err


def test_out_writes_the_plan(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    code, report = solve_json(
        capsys, "cnn", "--budget", "0.6", "--solver", "offload-all", "--out", str(target)
    )
    assert code == 0
    plan = Plan.load(target)
    chain = examples.load("cnn")
    assert validate(plan, chain) == []
    assert [op.to_dict() for op in plan.ops] == report["ops"]
    assert plan.predicted_time_s == report["predicted_time_s"]
    assert plan.budget_bytes == report["budget_bytes"]


def test_plot_draws_a_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "plan.png"
    code, _, err = run_cli(
        capsys, "solve", "cnn", "--budget", "0.7", "--solver", "chen", "--plot", str(target)
    )
    assert code == 0, err
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_says_when_the_plan_passes_the_budget_or_is_another_chain_s(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plan, png = tmp_path / "plan.json", str(tmp_path / "plan.png")
    assert run_cli(capsys, "solve", "llama7b", "--budget", "0.3", "--out", str(plan))[0] == 0
    assert run_cli(capsys, "plot", "llama7b", str(plan), "--out", png)[0] == 0
    assert "passes the budget" not in caplog.text and "made for chain" not in caplog.text
    assert run_cli(capsys, "plot", "llama7b", str(plan), "-b", "0.1", "--out", png)[0] == 0
    assert "the plan's simulated peak, 5.95 GiB, passes the budget of 1.98 GiB" in caplog.text
    assert run_cli(capsys, "plot", "llama7b-fused", str(plan), "--out", png)[0] == 0
    assert "made for chain 'llama-7b' and is drawn on 'llama-7b-fused-swiglu'" in caplog.text


def test_the_table_says_which_stages_are_frozen(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    chain = dataclasses.replace(examples.load("cnn"), frozen_stages=2)
    chain.save(tmp_path / "frozen.json")
    code, out, err = run_cli(capsys, "solve", str(tmp_path / "frozen.json"), "-b", "0.5")
    assert code == 0, err
    rows = [line for line in out.splitlines() if "stem" in line or "layer1." in line]
    assert ["frozen" in row for row in rows[:3]] == [True, True, False]


def test_milp_flags_and_report_reach_the_output(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    received: dict[str, Any] = {}

    def fake_solve_milp(chain: Chain, budget_bytes: int, **options: Any) -> Plan:
        received.update(options)
        plan = solve(chain, budget_bytes, "checkpoint-every-stage")
        report = {"solver_status": "Optimal", "gap": 0.0, "objective": 0.0312}
        return dataclasses.replace(plan, solver="milp", info=report)

    fake = types.ModuleType("solvers.milp")
    fake.solve_milp = fake_solve_milp  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "solvers.milp", fake)
    code, report = solve_json(
        capsys,
        "cnn",
        "--budget",
        "0.5",
        "--solver",
        "milp",
        "--no-offload",
        "--time-limit",
        "7",
        "--gap",
        "0.02",
        "--backend",
        "cbc",
        "--slots",
        "100",
    )
    assert code == 0
    assert received == {
        "offload": False,
        "time_limit_s": 7.0,
        "gap": 0.02,
        "backend": "cbc",
        "slots": 100,
    }
    assert (report["solver_status"], report["gap"], report["objective"]) == ("Optimal", 0.0, 0.0312)


def test_milp_options_given_to_a_baseline_are_ignored_with_a_warning(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    code, report = solve_json(capsys, "cnn", "--budget", "1.0", "--solver", "chen", "--gap", "0.1")
    assert code == 0 and report["solver"] == "chen"
    assert "ignores --gap" in caplog.text


def test_verbose_before_or_after_the_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["-v", "solve", "cnn"], ["solve", "cnn", "--verbose"]):
        code, out, _ = run_cli(capsys, *argv, "--budget", "1.0", "--solver", "keep-all", "--json")
        assert code == 0 and json.loads(out)["feasible"] is True


@pytest.mark.parametrize("module", ["offremat", "offremat.cli"])
def test_module_entry_point_runs(module: str) -> None:
    command = ["solve", "cnn", "--budget", "0.02", "--solver", "chen", "--json"]
    result = subprocess.run(
        [sys.executable, "-m", module, *command],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 3, result.stderr
    assert json.loads(result.stdout)["feasible"] is False


def test_number_flags_are_checked_by_the_parser() -> None:
    import argparse

    from offremat.commands import integer_at_least, positive_number

    assert integer_at_least(0)("0") == 0
    assert positive_number("2.5e10") == 2.5e10
    for parse, text, message in (
        (integer_at_least(1), "0", "at least 1"),
        (integer_at_least(1), "1.5", "not a whole number"),
        (positive_number, "0", "positive"),
        (positive_number, "inf", "positive"),
        (positive_number, "fast", "not a number"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(text)


def test_unreadable_input_and_unwritable_output_are_one_line_errors(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    nested = tmp_path / "nested.json"
    nested.write_text("[" * 100000 + "]" * 100000)
    code, _, err = run_cli(capsys, "solve", str(nested), "--budget", "0.5")
    assert code == 2 and "nested too deeply" in err and "Traceback" not in err
    if Path("/dev/full").exists():
        with open("/dev/full", "w") as full:
            done = subprocess.run(
                [sys.executable, "-m", "offremat.cli", "solve", "cnn", "-b", "0.5", "--json"],
                stdout=full,
                stderr=subprocess.PIPE,
                text=True,
                timeout=120,
            )
        assert done.returncode == 1
        assert done.stderr.strip().splitlines() == [
            "offremat solve: error: cannot write: [Errno 28] No space left on device"
        ]


def test_a_bad_plot_path_is_refused_before_solving(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    plan = tmp_path / "plan.json"
    for plot in ("plan.jpg", "missing/plan.png"):
        code, _, err = run_cli(
            capsys, "solve", "cnn", "-b", "0.5", "--out", str(plan), "--plot", str(tmp_path / plot)
        )
        assert code == 2 and "plan" in err
        assert not plan.exists()
