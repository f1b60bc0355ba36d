"""Plan pictures: the file, the two axes, the three lanes, labels that fit, the budget line."""

from __future__ import annotations

from matplotlib.collections import PolyCollection

from offremat.plots import plot_plan, plot_simulation
from solvers.baselines import checkpoint_sequential_plan
from solvers.chain import Chain, Link, Stage
from solvers.plan import Plan, backward, forward_all, offload, prefetch
from solvers.simulator import score, simulate

MiB = 2**20


def _chain(length: int) -> Chain:
    stages = tuple(
        Stage(f"block{n}", 0.010 + 0.001 * n, 0.020, 8 * MiB, 40 * MiB, 4 * MiB, 6 * MiB)
        for n in range(length)
    )
    return Chain("toy", 2 * MiB, stages, Link(4e9, 4e9))


def _offloading_plan(chain: Chain, budget: int) -> Plan:
    ops = (
        forward_all(1),
        forward_all(2),
        offload("saved", 1),
        forward_all(3),
        offload("saved", 2),
        forward_all(4),
        backward(4),
        prefetch("saved", 2),
        backward(3),
        prefetch("saved", 1),
        backward(2),
        backward(1),
    )
    return score(Plan(ops, chain.stage_names, "hand"), chain, budget)


def _bars_and_labels(axes):
    bars = [
        path.get_extents()
        for collection in axes.collections
        if isinstance(collection, PolyCollection)
        for path in collection.get_paths()
    ]
    return bars, [text for text in axes.texts if text.get_text()]


def test_plot_plan_writes_a_png_with_timeline_lanes_and_memory_curve(tmp_path):
    chain = _chain(4)
    plan = _offloading_plan(chain, 150 * MiB)
    path = tmp_path / "plan.png"
    figure = plot_plan(chain, plan, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    timeline, memory = figure.axes[:2]
    assert len([axes for axes in figure.axes if axes.has_data()]) == 2
    lanes = [label.get_text() for label in timeline.get_yticklabels()]
    assert lanes == ["host→device", "device→host", "compute"]
    labels = {text.get_text() for text in timeline.texts}
    assert {"F_all(1)", "B(4)", "offload(x̄1)", "offload(x̄2)", "prefetch(x̄2)"} <= labels
    legend = {text.get_text() for text in timeline.get_legend().get_texts()}
    assert "offload to host" in legend and "prefetch to GPU" in legend
    assert timeline.get_shared_x_axes().joined(timeline, memory)
    assert "peak" in figure.get_suptitle() and "budget" in figure.get_suptitle()


def test_every_operation_gets_one_bar_on_its_lane(tmp_path):
    chain = _chain(4)
    plan = _offloading_plan(chain, 150 * MiB)
    figure = plot_plan(chain, plan, tmp_path / "plan.png")
    bars, _ = _bars_and_labels(figure.axes[0])
    assert len(bars) == len(plan.ops)
    rows = sorted(round((bar.y0 + bar.y1) / 2) for bar in bars)
    # Two offloads on device→host (row 1), two prefetches on host→device (row 0).
    assert rows.count(0) == 2 and rows.count(1) == 2 and rows.count(2) == 8


def test_memory_curve_reaches_the_simulated_peak_under_the_budget_line(tmp_path):
    chain = _chain(4)
    budget = 150 * MiB
    plan = _offloading_plan(chain, budget)
    figure = plot_plan(chain, plan, tmp_path / "plan.png")
    memory = figure.axes[1]
    curve = next(line for line in memory.get_lines() if line.get_label() == "resident bytes")
    budget_line = next(line for line in memory.get_lines() if "budget" in line.get_label())
    assert max(curve.get_ydata()) * MiB == plan.predicted_peak_bytes
    assert budget_line.get_ydata()[0] * MiB == budget
    assert memory.get_ylabel() == "GPU memory (MiB)"


def test_labels_stay_inside_their_bars_on_a_long_chain(tmp_path):
    chain = _chain(40)
    plan = checkpoint_sequential_plan(chain, 6)
    figure = plot_plan(chain, plan, tmp_path / "long.png", budget_bytes=2**30)
    renderer = figure.canvas.get_renderer()
    timeline = figure.axes[0]
    bars, texts = _bars_and_labels(timeline)
    bar_boxes = [timeline.transData.transform([[b.x0, b.y0], [b.x1, b.y1]]) for b in bars]
    labelled = 0
    for text in texts:
        box = text.get_window_extent(renderer)
        if text.get_text() == "no copies":
            continue
        holder = [
            (x0, x1)
            for (x0, _), (x1, _) in bar_boxes
            if x0 - 0.5 <= (box.x0 + box.x1) / 2 <= x1 + 0.5
        ]
        assert holder, text.get_text()
        assert box.width <= holder[0][1] - holder[0][0], text.get_text()
        labelled += 1
    # Narrow bars lose their label, but the wide backward bars keep one.
    assert 0 < labelled < len(plan.ops)


def test_a_plan_without_copies_says_so_and_no_budget_means_no_budget_line(tmp_path):
    chain = _chain(6)
    plan = checkpoint_sequential_plan(chain, 2)
    figure = plot_simulation(simulate(plan, chain, None), tmp_path / "free.png")
    texts = [text.get_text() for text in figure.axes[0].texts]
    assert texts.count("no copies") == 2
    assert not any("budget" in line.get_label() for line in figure.axes[1].get_lines())
    assert (tmp_path / "free.png").stat().st_size > 0


def test_plot_command_draws_a_saved_plan_and_refuses_one_for_another_chain(tmp_path, capsys):
    from offremat.cli import main

    chain = _chain(4)
    chain_path, plan_path, png = tmp_path / "c.json", tmp_path / "p.json", tmp_path / "p.png"
    chain.save(chain_path)
    _offloading_plan(chain, 150 * MiB).save(plan_path)
    assert main(["plot", str(chain_path), str(plan_path), "--out", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    other = tmp_path / "other.json"
    _chain(5).save(other)
    assert main(["plot", str(other), str(plan_path), "--out", str(png)]) == 2
    assert "make the plan from this chain" in capsys.readouterr().err
    assert main(["plot", str(chain_path), str(tmp_path / "missing.json")]) == 2
    assert "offremat solve" in capsys.readouterr().err
    assert main(["plot", str(chain_path), str(tmp_path)]) == 2
    assert "cannot read plan file" in capsys.readouterr().err
    unwritable = str(tmp_path / "no" / "such" / "p.png")
    assert main(["plot", str(chain_path), str(plan_path), "--out", unwritable]) == 2
    assert "no folder" in capsys.readouterr().err


def test_every_solver_has_a_line_style_in_the_sweep_plot():
    from offremat.plots import METHOD_STYLE
    from solvers.registry import SOLVERS

    assert set(METHOD_STYLE) == set(SOLVERS)


def test_plot_command_checks_the_budget_as_the_plan_runs_and_takes_a_bandwidth(
    tmp_path, capsys, caplog
):
    """Under its budget a prefetch waits for memory, as the drawing and the plan's own peak
    say: no warning that the peak passes it. A chain without a link takes --bandwidth, as
    solve does, to draw an offloading plan."""
    from dataclasses import replace

    from offremat.cli import main

    chain = _chain(4)
    free_peak = simulate(_offloading_plan(chain, 10**12), chain).peak_bytes
    plan = _offloading_plan(chain, free_peak - 4 * MiB)
    assert plan.feasible and plan.predicted_peak_bytes < free_peak
    chain_path, plan_path = tmp_path / "c.json", tmp_path / "p.json"
    replace(chain, link=None).save(chain_path)
    plan.save(plan_path)
    png = str(tmp_path / "p.png")
    assert main(["plot", str(chain_path), str(plan_path), "--out", png]) == 2
    assert "no link" in capsys.readouterr().err
    assert (
        main(["plot", str(chain_path), str(plan_path), "--out", png, "--bandwidth", "4GB/s"]) == 0
    )
    assert "passes the budget" not in caplog.text
