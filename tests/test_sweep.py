"""Budget sweeps: the grid, the CSV, infeasible points and the plot."""

from __future__ import annotations

import csv
import itertools

import pytest

from offremat.plots import plot_sweep
from offremat.sweep import (
    CSV_COLUMNS,
    budget_range,
    read_csv,
    run_sweep,
    write_csv,
)
from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain, Link, Stage
from solvers.registry import keep_all_peak, min_feasible_budget

MiB = 2**20
RECOMPUTE_AND_BASELINES = (
    "keep-all",
    "chen",
    "checkpoint-every-stage",
    "offload-all",
    "min-peak",
    "dtr",
    "dp",
)


FAST_LINK = Link(4e9, 4e9)


def _chain(length: int = 6, link: Link | None = FAST_LINK) -> Chain:
    stages = tuple(
        Stage(f"block{n}", 0.01 + 0.002 * (n % 3), 0.02, 8 * MiB, 40 * MiB, 2 * MiB, 4 * MiB)
        for n in range(length)
    )
    return Chain("sweep-toy", 2 * MiB, stages, link)


def test_budget_range_spans_least_feasible_to_keep_all():
    chain = _chain()
    budgets = budget_range(chain, count=5)
    assert budgets == sorted(budgets) and len(budgets) == 5
    assert budgets[-1] == keep_all_peak(chain)
    least = min(min_feasible_budget(chain, m) for m in ("dp", "chen", "offload-all", "min-peak"))
    assert budgets[0] == least


def test_csv_has_the_columns_one_row_per_method_and_budget_and_empty_infeasible_times(tmp_path):
    chain = _chain()
    budgets = budget_range(chain, count=4)
    points = run_sweep(chain, budgets, RECOMPUTE_AND_BASELINES)
    path = tmp_path / "sweep.csv"
    write_csv(points, path)
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
    assert tuple(reader.fieldnames) == CSV_COLUMNS
    assert len(rows) == len(RECOMPUTE_AND_BASELINES) * len(budgets)
    assert {(row["method"], int(row["budget_bytes"])) for row in rows} == {
        (m, b) for m in RECOMPUTE_AND_BASELINES for b in budgets
    }
    keep_all = {
        int(r["budget_bytes"]): r["predicted_time_s"] for r in rows if r["method"] == "keep-all"
    }
    # Plain autograd fits only at its own peak; below it the time cell is empty.
    assert keep_all[budgets[-1]] != ""
    assert all(keep_all[b] == "" for b in budgets[:-1])
    for row in rows:
        assert (row["predicted_time_s"] == "") == (row["predicted_peak_bytes"] == "")
        assert float(row["solve_time_s"]) >= 0
        if row["predicted_time_s"]:
            assert int(row["predicted_peak_bytes"]) <= int(row["budget_bytes"])
            assert float(row["predicted_time_s"]) >= chain.compute_time_s - 1e-12
    again = read_csv(path)
    assert [(p.method, p.budget_bytes, p.predicted_time_s) for p in again] == [
        (p.method, p.budget_bytes, p.predicted_time_s) for p in points
    ]


def test_dp_fits_everywhere_on_the_grid_and_never_slows_as_the_budget_grows():
    chain = _chain(length=8)
    budgets = budget_range(chain, count=6)
    points = run_sweep(chain, [b for b in budgets if b >= min_feasible_budget(chain, "dp")], ["dp"])
    times = [p.predicted_time_s for p in points]
    assert all(t is not None for t in times)
    assert all(later <= earlier + 1e-12 for earlier, later in itertools.pairwise(times))


def test_offload_needs_a_link_and_unknown_methods_are_refused(caplog):
    chain = _chain(link=None)
    points = run_sweep(chain, [keep_all_peak(chain)], ["offload-all", "keep-all"])
    assert [p.feasible for p in points] == [False, True]
    assert "needs a host link" in caplog.text
    with pytest.raises(ValueError, match="choose from"):
        run_sweep(chain, [keep_all_peak(chain)], ["greedy"])


def test_milp_points_come_from_the_registry_with_a_time_limit():
    chain = _chain(length=4)
    top = keep_all_peak(chain)
    points = run_sweep(chain, [top // 2, top], ["milp", "dp"], {"milp": {"time_limit_s": 5.0}})
    by_key = {(p.method, p.budget_bytes): p for p in points}
    for budget in (top // 2, top):
        milp, dp = by_key["milp", budget], by_key["dp", budget]
        if dp.feasible:
            assert milp.feasible and milp.predicted_time_s <= dp.predicted_time_s * (1 + 1e-6)


def test_sweep_plot_has_one_line_per_method(tmp_path):
    chain = _chain()
    points = run_sweep(chain, budget_range(chain, count=3), RECOMPUTE_AND_BASELINES)
    path = tmp_path / "sweep.png"
    figure = plot_sweep(points, chain, path)
    assert path.read_bytes()[:4] == b"\x89PNG"
    labels = [line.get_label().split(" (")[0] for line in figure.axes[0].get_lines()]
    assert set(RECOMPUTE_AND_BASELINES) <= set(labels)
    assert figure.axes[0].get_xlabel().startswith("memory budget")


def test_a_line_hidden_under_another_of_the_same_times_says_so(tmp_path):
    """offload-all's line lay under milp's, of the same points, with nothing to show it (a
    new user's trial)."""
    from offremat.sweep import SweepPoint

    chain = _chain()
    budgets = budget_range(chain, count=3)
    points = [
        SweepPoint(method, budget, 0.01 * (1 + index), 1000, 0.0)
        for method in ("offload-all", "dp", "milp")
        for index, budget in enumerate(budgets)
        if method != "dp" or index
    ]
    figure = plot_sweep(points, chain, tmp_path / "sweep.png")
    labels = {
        line.get_label().split(" (")[0]: line.get_label() for line in figure.axes[0].get_lines()
    }
    assert labels["offload-all"] == "offload-all (under milp: the same times)"
    assert labels["milp"] == "milp" and labels["dp"] == "dp"


def test_sweep_command_writes_csv_and_png_for_a_chain_file(tmp_path, capsys):
    from offremat.cli import main

    chain_path = tmp_path / "chain.json"
    _chain().save(chain_path)
    out = tmp_path / "out"
    argv = ["sweep", str(chain_path), "--out", str(out), "--points", "3"]
    assert main([*argv, "--methods", "keep-all,dp,chen"]) == 0
    points = read_csv(out / "sweep.csv")
    assert len(points) == 9
    assert {p.method for p in points} == {"keep-all", "dp", "chen"}
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert "9 rows" in capsys.readouterr().out


def test_sweep_command_profiles_an_in_repo_model(tmp_path):
    from offremat.cli import main

    out = tmp_path / "model"
    argv = ["sweep", "--model", "resnet-tiny", "--out", str(out), "--points", "2"]
    assert main([*argv, "--methods", "keep-all,dp,offload-all", "--bandwidth", "1e10"]) == 0
    chain = Chain.load(out / "chain.json")
    assert chain.name == "resnet-tiny" and chain.link.d2h_bytes_per_s == 1e10
    assert chain.stages[0].name == "stem" and chain.stages[-1].name == "head"
    points = read_csv(out / "sweep.csv")
    assert any(p.method == "offload-all" and p.feasible for p in points)


def test_sweep_command_usage_errors_exit_2(tmp_path, capsys):
    from offremat.cli import main

    out = str(tmp_path / "x")
    assert main(["sweep", "transformer", "--out", out, "--methods", "dp,greedy"]) == 2
    assert "greedy" in capsys.readouterr().err
    assert main(["sweep", "--model", "gpt-huge", "--out", out]) == 2
    assert "gpt-small" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["sweep", "transformer", "--out", str(blocker / "x"), "--methods", "chen"]) == 2
    assert "cannot make the output folder" in capsys.readouterr().err
    assert main(["sweep", "transformer", "--out", out, "--methods", "dp,chen,dp"]) == 2
    assert "dp listed twice" in capsys.readouterr().err
    assert main(["sweep", "transformer", "--out", out, "--batch", "64"]) == 2
    assert "--batch sets the batch of --model" in capsys.readouterr().err
    # One point swept keep-all's budget alone (a new user's trial).
    assert main(["sweep", "transformer", "--out", out, "--points", "1"]) == 2
    assert "--points" in capsys.readouterr().err


def test_milp_keeps_the_default_time_limit_beside_other_options(monkeypatch):
    import offremat.sweep as sweep

    received = []

    def fake_solve(chain, budget, solver, **options):
        received.append((solver, options))
        raise InfeasibleBudgetError(budget, budget + 1, solver)

    monkeypatch.setattr(sweep, "solve", fake_solve)
    chain = _chain(length=3)
    methods = ["milp", "dp", "checkmate"]
    points = run_sweep(chain, [keep_all_peak(chain)], methods, {"milp": {"slots": 50}})
    assert [p.feasible for p in points] == [False, False, False]
    assert received == [
        ("milp", {"slots": 50, "time_limit_s": sweep.DEFAULT_MILP_TIME_LIMIT_S}),
        ("dp", {}),
        ("checkmate", {"time_limit_s": sweep.DEFAULT_MILP_TIME_LIMIT_S}),
    ]


def test_a_sweep_of_one_budget_names_it_once(tmp_path, capsys):
    """A chain whose least feasible budget is its keep-all peak printed "1 budgets from
    7.82 KiB to 7.81 KiB", the one budget rounded up and then down."""
    from offremat.cli import main

    chain = Chain("t", 1000, (Stage("s1", 0.001, 0.002, 1000, 5000),), Link(1e9, 1e9))
    chain_path = tmp_path / "chain.json"
    chain.save(chain_path)
    argv = ["sweep", str(chain_path), "--out", str(tmp_path / "out"), "--methods", "keep-all"]
    assert main(argv) == 0
    assert "t: 1 stages, 1 budget, 7.81 KiB (8000 B)," in capsys.readouterr().err
