"""What offremat promises about bad input: a clear error that says what to do, never a
traceback and never a silently wrong result. One test per case, each failing before its fix."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import solvers.dp
from solvers.chain import Chain, Stage
from solvers.dp import DEFAULT_SLOTS, check_table_size, solve_dp
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


def test_json_never_prints_infinity() -> None:
    from offremat.commands import json_text

    text = json_text({"gap": float("inf"), "bound": [1.0, float("nan")], "n": 3})
    assert json.loads(text) == {"gap": None, "bound": [1.0, None], "n": 3}


def test_json_piped_into_a_reader_that_left_ends_quietly() -> None:
    # `offremat solve ... --json | head -1`: the reader is gone before the output is written.
    import subprocess
    import sys

    command = [sys.executable, "-m", "offremat.cli", "solve", "transformer", "--budget", "0.5"]
    process = subprocess.Popen(
        [*command, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    process.stdout.close()
    _, errors = process.communicate(timeout=120)
    assert process.returncode == 0, errors
    assert "Traceback" not in errors and "BrokenPipe" not in errors


def test_names_are_printed_as_they_are_never_as_markup_or_emoji(tmp_path, capsys) -> None:
    from offremat.cli import main
    from solvers.chain import Chain, Stage

    odd = "[bold]adapters.py:llama:[/bold]"
    chain = Chain(odd, 64, (Stage(":llama:", 1.0, 1.0, 64, 128), Stage("[red]b", 1.0, 1.0, 4, 8)))
    path = tmp_path / "chain.json"
    chain.save(path)
    assert main(["solve", str(path), "--budget", "1.0"]) == 0
    out = capsys.readouterr().out
    assert odd in out and ":llama:" in out and "[red]b" in out


@pytest.mark.parametrize(
    ("written", "message"),
    [
        ([1], "is not a size"),
        (float("inf"), "not a finite size"),
        (float("nan"), "not a finite size"),
        ("1e400", "not a finite size"),
        (1.5, "neither a fraction"),
        ("1.5", "neither a fraction"),
        (15, "neither a fraction"),
        (2.5e9 + 0.5, "neither a fraction"),
    ],
)
def test_a_budget_that_is_neither_a_fraction_nor_a_size_is_refused(written, message) -> None:
    from solvers.budget import parse_budget

    with pytest.raises(ValueError, match=message):
        parse_budget(written, 1000)


@pytest.mark.parametrize(
    ("written", "expected"),
    [(1, 1000), (1.0, 1000), ("1", 1000), (0.25, 250), (16, 16), ("12B", 12), ("2KiB", 2048)],
)
def test_the_budget_rule_a_person_can_predict(written, expected) -> None:
    from solvers.budget import parse_budget

    assert parse_budget(written, 1000) == expected


@pytest.mark.parametrize(
    ("option", "value"), [("stages", 2.5), ("slots", 2.5), ("slots", "10"), ("slots", 0)]
)
def test_optimize_refuses_counts_that_are_not_positive_integers(option, value) -> None:
    import torch
    from torch import nn

    import offremat

    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    with pytest.raises(ValueError, match=f"{option} must be a positive integer"):
        offremat.optimize(model, torch.randn(64, 8), budget=0.9, **{option: value})


@pytest.mark.parametrize("command", ["sweep", "solve"])
def test_every_command_reads_a_bandwidth_the_same_way(command, tmp_path, capsys) -> None:
    from offremat.cli import main

    argv = [command, "transformer", "--bandwidth", "12GB/s"]
    if command == "solve":
        argv += ["--budget", "0.5", "--solver", "offload-all", "--json"]
    else:
        argv += ["--out", str(tmp_path / "sweep"), "--points", "2", "--methods", "dp"]
    assert main(argv) == 0, capsys.readouterr().err


@pytest.mark.parametrize("rate", ["1e-300", "inf", "fast", "0", "25", "1.5"])
def test_a_rate_that_cannot_be_a_link_is_a_usage_error(rate, capsys) -> None:
    from offremat.cli import main

    argv = ["solve", "transformer", "--budget", "0.5", "--bandwidth", rate]
    assert main(argv) == 2
    assert "--bandwidth" in capsys.readouterr().err


def test_a_bare_rate_too_slow_for_any_link_asks_for_its_unit() -> None:
    """``--bandwidth 25`` meant 25GB/s: read as 25 bytes per second, it made a plan predicted
    to take 20 years, and the command succeeded. A unit written says what is meant."""
    import torch
    from torch import nn

    import offremat
    from solvers.budget import parse_bandwidth
    from solvers.chain import Link

    for bare in (25, "25", 1.5, (1e10, 25)):
        with pytest.raises(ValueError, match=r"write the unit \((25|1\.5)GB/s\)"):
            parse_bandwidth(bare)
    assert parse_bandwidth("1KB/s") == Link(1e3, 1e3)  # a unit written is taken as meant
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    with pytest.raises(ValueError, match="write the unit"):
        offremat.optimize(model, torch.randn(64, 8), budget=1.0, bandwidth=25)


def test_a_plan_for_another_chain_of_the_same_length_is_refused_everywhere(tmp_path, capsys):
    from offremat.cli import main
    from solvers.baselines import keep_all
    from solvers.chain import Chain, Stage
    from solvers.simulator import simulate

    def chain(names):
        return Chain("c", 64, tuple(Stage(n, 1.0, 1.0, 64, 128) for n in names))

    ours, renamed, reversed_ = chain(["a", "b", "c"]), chain(["x", "y", "z"]), chain("cba")
    plan = keep_all(ours)
    plan.save(tmp_path / "plan.json")
    for other in (renamed, reversed_):
        with pytest.raises(ValueError, match="make the plan from this chain"):
            simulate(plan, other)
        other.save(tmp_path / "other.json")
        argv = ["plot", str(tmp_path / "other.json"), str(tmp_path / "plan.json")]
        assert main([*argv, "--out", str(tmp_path / "p.png")]) == 2
        assert "make the plan from this chain" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["plan", "plan.txt", "folder.png"])
def test_a_plot_goes_where_asked_or_is_refused(name, tmp_path, capsys) -> None:
    from offremat.cli import main

    (tmp_path / "folder.png").mkdir()
    target = tmp_path / name
    argv = ["solve", "transformer", "--budget", "0.5", "--plot", str(target)]
    assert main(argv) == 2
    assert ".png" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder.png"]  # nothing written


def test_an_unwritable_plan_file_is_a_usage_error(capsys) -> None:
    from offremat.cli import main

    assert main(["solve", "transformer", "--budget", "0.5", "--out", "/dev/full"]) == 2
    assert "cannot write" in capsys.readouterr().err


def _example_with(tmp_path, change) -> str:
    from offremat import examples

    data = json.loads(examples.path("transformer").read_text())
    change(data)
    path = tmp_path / "chain.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_sizes_beyond_any_memory_are_a_format_error(tmp_path, capsys) -> None:
    from offremat.cli import main

    def huge(data):
        data["stages"][0]["out_bytes"] = data["stages"][0]["saved_bytes"] = 1e30

    assert main(["solve", _example_with(tmp_path, huge), "--budget", "0.5"]) == 2
    assert "more than any device holds" in capsys.readouterr().err


def test_a_chain_of_zero_sizes_has_nothing_to_sweep(tmp_path, capsys) -> None:
    from offremat.cli import main

    def zero(data):
        data["input_bytes"] = 0
        for stage in data["stages"]:
            for key in ("out_bytes", "saved_bytes", "fwd_tmp_bytes", "bwd_tmp_bytes"):
                stage[key] = 0

    path = _example_with(tmp_path, zero)
    assert main(["sweep", path, "--out", str(tmp_path / "out"), "--points", "2"]) == 2
    assert "every size in the chain is 0 bytes" in capsys.readouterr().err


def test_slots_beyond_memory_are_refused_with_what_fits(capsys) -> None:
    from offremat.cli import main

    argv = ["solve", "transformer", "--budget", "0.5", "--slots", "10000000000"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "GiB of tables" in err and "use at most" in err


def test_a_plan_whose_info_is_not_an_object_names_the_field() -> None:
    data = json.loads(plan_text(5000))
    for info in ([1, 2], "text"):
        with pytest.raises(ValueError, match="field 'info' must be a JSON object"):
            Plan.from_dict({**data, "info": info})


def test_a_key_given_twice_or_a_number_too_long_is_refused_in_chain_and_plan_files(
    tmp_path,
) -> None:
    # json.loads keeps the last of two equal keys: a stage's time would silently be the other.
    stage = '{"name": "a", "fwd_s": 0.001, "fwd_s": 5.0, "bwd_s": 1, "out_bytes": 1, '
    stage += '"saved_bytes": 1}'
    chain = '{"format": "offremat.chain/1", "name": "c", "input_bytes": 1, "stages": [%s]}'
    with pytest.raises(ValueError, match="chain: key 'fwd_s' appears twice in one object"):
        Chain.from_json(chain % stage)
    with pytest.raises(ValueError, match="chain: a number is too long to read"):
        Chain.from_json(chain.replace('"input_bytes": 1', '"input_bytes": ' + "9" * 5000))
    path = tmp_path / "plan.json"
    path.write_text(plan_text(5000).replace('"solver": "dp"', '"solver": "dp", "solver": "x"'))
    with pytest.raises(ValueError, match="plan: key 'solver' appears twice"):
        Plan.load(path)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("predicted_time_s", "fast", "'predicted_time_s' must be a finite non-negative number"),
        ("predicted_peak_bytes", -1, "'predicted_peak_bytes' must be a finite non-negative"),
        ("predicted_peak_bytes", 12.5, "must be a finite non-negative integer"),
        ("predicted_time_s", float("nan"), "must be a finite non-negative number"),
        ("predicted_time_s", float("inf"), "must be a finite non-negative number"),
        ("predicted_peak_bytes", 10**400, "integer or null, got about 1e400"),
        ("predicted_time_s", 10**400, "number or null, got about 1e400"),
        ("budget_bytes", 10**400, "'budget_bytes' is about 1e400 bytes, more than any device"),
        ("solver", [1], "field 'solver' must be a string"),
        ("chain", 5, "field 'chain' must be a string"),
        ("ops", [{"op": "B"}], r"missing field\(s\) \['index'\]"),
    ],
)
def test_a_plan_field_of_the_wrong_type_is_named(field, value, message) -> None:
    data = json.loads(plan_text(5000))
    with pytest.raises(ValueError, match=message):
        Plan.from_dict({**data, field: value})


def _user_file(tmp_path, body: str) -> str:
    (tmp_path / "helpers.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "def blocks():\n    return [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)]\n"
    )
    path = tmp_path / "my_models.py"
    path.write_text(body)
    return f"{path}:build"


def test_profile_imports_the_user_file_s_siblings(tmp_path, capsys) -> None:
    from offremat.cli import main

    spec = _user_file(
        tmp_path,
        "import torch\nfrom torch import nn\nfrom helpers import blocks\n\n"
        "def build():\n    return nn.Sequential(*blocks()), torch.randn(8, 4)\n",
    )
    out = str(tmp_path / "chain.json")
    assert main(["profile", spec, "--out", out, "--warmup", "0", "--repeats", "1"]) == 0
    import sys

    assert "my_models" not in sys.modules  # never registered under a name it could shadow


@pytest.mark.parametrize(
    ("body", "shown"),
    [
        ("def build(:\n    pass\n", "SyntaxError"),
        ("def build():\n    raise RuntimeError('no weights here')\n", "no weights here"),
        (  # the model fails on its own example input while profiling
            "import torch\nfrom torch import nn\n\n"
            "def build():\n    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)), "
            "torch.randn(4, 5)\n",
            "cannot be multiplied",
        ),
    ],
)
def test_profile_reports_an_error_in_the_user_file_in_one_line(body, shown, tmp_path, capsys):
    from offremat.cli import main

    spec = _user_file(tmp_path, body)
    assert main(["profile", spec, "--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert shown in err and "-v" in err and "Traceback" not in err


def test_profile_refuses_an_output_folder_before_profiling(tmp_path, capsys) -> None:
    from offremat.cli import main

    assert main(["profile", "gpt-small", "--out", str(tmp_path)]) == 2
    assert "give a file path" in capsys.readouterr().err


def test_milp_json_is_pure_json_and_plain_output_says_how_the_search_ended(capfd) -> None:
    from offremat.cli import main

    argv = ["solve", "transformer", "--budget", "0.5", "--solver", "milp", "--time-limit", "3"]
    assert main([*argv, "--json"]) == 0
    summary = json.loads(capfd.readouterr().out)  # nothing else on stdout, native code included
    assert summary["solver_status"] is not None
    assert main(argv) == 0
    assert "solver           " in capfd.readouterr().out


def test_a_milp_model_too_large_for_its_time_limit_is_not_built() -> None:
    from solvers.chain import Chain, Link, Stage
    from solvers.milp import estimated_build_s, solve_milp
    from solvers.registry import keep_all_peak, solve

    stages = tuple(Stage(f"s{i}", 1.0, 2.0, 1000, 4000) for i in range(120))
    # A copy takes two forwards: no plan meets the lower bound, which would end the search.
    chain = Chain("long", 1000, stages, Link(2e3, 2e3))
    assert estimated_build_s(chain.length) > 3.0
    budget = int(0.3 * keep_all_peak(chain))
    plan = solve_milp(chain, budget, time_limit_s=3.0)
    assert plan.info["solver_status"] == "time limit (model not built)"
    assert plan.feasible
    assert plan.predicted_time_s <= solve(chain, budget, "dp").predicted_time_s


def test_a_chain_file_with_a_link_too_slow_to_count_names_the_field(tmp_path, capsys) -> None:
    from offremat.cli import main

    def crawl(data):
        data["link"] = {"d2h_bytes_per_s": 1e-300, "h2d_bytes_per_s": 1e9}

    path = _example_with(tmp_path, crawl)
    assert main(["solve", path, "--budget", "0.5", "--solver", "milp"]) == 2
    assert "'d2h_bytes_per_s'" in capsys.readouterr().err


def _long_chain(length: int) -> Chain:
    stages = tuple(
        Stage(f"block{i}", fwd_s=1e-3, bwd_s=2e-3, out_bytes=2**20, saved_bytes=4 * 2**20)
        for i in range(length)
    )
    return Chain(f"long{length}", 2**20, stages)


def test_a_dp_too_long_to_run_is_refused_up_front_with_its_cost(monkeypatch) -> None:
    def ran(*_: object, **__: object) -> None:
        raise AssertionError("the DP started before refusing")

    # Up front: before simulating keep-all or filling any table.
    for name in ("simulate", "_exact_plan", "_table_plan"):
        monkeypatch.setattr(solvers.dp, name, ran)
    with pytest.raises(ValueError, match=r"2000 stages .* GiB of tables and \d+ s.*--stages"):
        solve_dp(_long_chain(2000), 2**30)


def test_a_dp_that_takes_a_while_says_so_before_it_starts(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="solvers.dp"):
        check_table_size(_long_chain(500), DEFAULT_SLOTS)
    assert "500 stages at 500 slots needs about" in caplog.text
    assert "--stages" in caplog.text


def test_a_budget_larger_than_any_device_is_refused() -> None:
    from solvers.budget import parse_budget

    for budget in (10**400, 2**70):  # 10**400 ended in OverflowError formatting it
        with pytest.raises(ValueError, match="more than any device holds"):
            parse_budget(budget)


def test_a_chain_whose_sizes_add_up_past_any_memory_is_refused() -> None:
    """Four stages of 2**59 bytes each were a valid chain whose keep-all peak, past 2**60, no
    budget could be asked for; past 2**53 the solvers' sums were no longer exact."""
    from solvers.chain import LARGEST_BYTES, ChainFormatError

    with pytest.raises(ChainFormatError, match=r"sizes add up to \d+ bytes, more than any"):
        Chain("big", 0, tuple(Stage(f"s{i}", 1.0, 1.0, 2**48, 2**48) for i in range(4)))
    with pytest.raises(ChainFormatError, match=r"'out_bytes' is .* more than any device"):
        Stage("s", 1.0, 1.0, LARGEST_BYTES + 1, LARGEST_BYTES + 1)


@pytest.mark.parametrize("solver", ["dp", "checkmate", "milp"])
def test_the_least_budget_of_a_chain_at_the_size_limit_is_a_budget_with_a_plan(solver) -> None:
    """Sizes near 2**56, then allowed, are refused: dp named a least budget 14 B below its
    plan's peak and then raised "a bug in offremat"; checkmate and milp died on an
    AssertionError. The same chain at 1/1024 of that size has exact least budgets."""
    from solvers.budget import InfeasibleBudgetError, parse_budget
    from solvers.chain import ChainFormatError
    from solvers.registry import solve

    times = ((0.0, 1.0), (1e9, 1e-3), (0.0, 1e-12))
    sizes = ((14287178951329,) * 2, (57981288628987, 170467783220619), (1, 277035322039679))
    stages = tuple(
        Stage(f"s{i}", *time, *size)
        for i, (time, size) in enumerate(zip(times, sizes, strict=True))
    )
    with pytest.raises(ChainFormatError, match="'out_bytes' is 14630071246161271 bytes, more than"):
        Chain("x", 626053460838, (Stage("s1", 0.0, 1.0, 14630071246161271, 14630071246161271),))
    chain = Chain("x", 626053460838, stages)
    options = {} if solver == "dp" else {"time_limit_s": 3}
    with pytest.raises(InfeasibleBudgetError) as refused:
        solve(chain, 16, solver, **options)
    least = refused.value.min_budget_bytes
    plan = solve(chain, parse_budget(str(least)), solver, **options)
    assert plan.feasible and plan.predicted_peak_bytes <= least


def test_a_long_chain_whose_groups_pass_the_size_limit_is_still_solved_by_milp() -> None:
    """A group counts the held output twice, so the chain of groups of a chain near the size
    limit passed it: milp raised ChainFormatError where the chain itself was valid."""
    from solvers.chain import LARGEST_BYTES
    from solvers.registry import solve

    held = LARGEST_BYTES * 3 // 5
    stages = tuple(Stage(f"s{i}", 1.0, 1.0, 2**20, 2**21) for i in range(50))
    chain = Chain("long", 2**20, stages, held_bytes=held)
    plan = solve(chain, held + 2**26, "milp", time_limit_s=3)
    assert plan.feasible


class _GradientInForward(torch.nn.Module):
    """A block that differentiates inside its forward with torch.func (a force field)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        forces = torch.func.grad(lambda y: torch.tanh(y).sum())(x)
        return x + self.linear(forces)


@pytest.mark.parametrize("budget", [0.5, 1.0])
def test_a_block_calling_torch_func_grad_is_refused_with_what_to_do(budget: float) -> None:
    # Was torch's own "torch.func.{grad, ...} don't yet support saved tensor hooks. Please
    # open an issue", from inside the profile, at any budget.
    import offremat

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_GradientInForward() for _ in range(4)], torch.nn.Linear(16, 1))
    advice = r"calls a torch\.func transform .* nn\.Sequential of the blocks"
    with pytest.raises(RuntimeError, match=advice):
        offremat.optimize(model, torch.randn(32, 16), budget=budget)
