"""The plan cache on disk: a bad file is never trusted, and concurrent writers never tear one."""

from __future__ import annotations

import json
import multiprocessing
import os
from typing import Any

import pytest
import torch

from offremat._plan_cache import PlanCache, _digest
from solvers.chain import Chain, Stage
from solvers.plan import Plan
from solvers.registry import solve


def small_chain(scale: int = 1) -> Chain:
    stages = tuple(
        Stage(
            name=f"s{i}",
            fwd_s=1.0 + i,
            bwd_s=2.0 + i,
            out_bytes=100 * scale,
            saved_bytes=150 * scale,
            grad_bytes=100 * scale,
        )
        for i in range(1, 7)
    )
    return Chain("small", 100 * scale, stages)


KEY = {"model": "m", "device": "cpu", "budget": 900, "solver": "dp"}


def test_a_file_made_for_another_key_is_ignored_with_a_warning(tmp_path, caplog) -> None:
    chain = small_chain()
    PlanCache(tmp_path, {**KEY, "budget": 800}).store("(64,)", chain, solve(chain, 800))
    (foreign,) = tmp_path.glob("*.json")
    cache = PlanCache(tmp_path, KEY)
    cache.store("(64,)", chain, solve(chain, 900))
    (path,) = set(tmp_path.glob("*.json")) - {foreign}
    path.write_text(foreign.read_text())  # another budget's entry under this key's name
    with caplog.at_level("WARNING"):
        assert cache.load("(64,)") is None
    assert "another model's, device's, budget's or shape's" in caplog.text


@pytest.mark.parametrize(
    "spoil",
    [
        lambda data: {**data, "format": "offremat.plan-cache/0"},
        lambda data: {k: v for k, v in data.items() if k != "plan"},
        lambda data: {**data, "chain": small_chain(scale=3).to_dict()},  # plan no longer fits
        lambda data: [data],
        lambda data: {**data, "plan": {**data["plan"], "budget_bytes": None}},
    ],
    ids=["other format", "no plan", "plan over its chain's budget", "not an object", "no budget"],
)
def test_a_spoilt_file_is_ignored_with_a_warning(tmp_path, caplog, spoil) -> None:
    chain = small_chain()
    cache = PlanCache(tmp_path, KEY)
    cache.store("(64,)", chain, solve(chain, 900))
    (path,) = tmp_path.glob("*.json")
    assert cache.load("(64,)") is not None
    path.write_text(json.dumps(spoil(json.loads(path.read_text()))))
    with caplog.at_level("WARNING"):
        assert cache.load("(64,)") is None
    assert "ignoring plan cache file" in caplog.text


def write_many(directory: str, chain: Chain, plan: Plan, go: Any, times: int) -> None:
    cache = PlanCache(directory, KEY)
    go.wait()
    for _ in range(times):
        cache.store("(64,)", chain, plan)


def test_two_processes_writing_one_entry_never_leave_a_torn_file(tmp_path, caplog) -> None:
    # Two writers race on one entry (with plans for different budgets, so their files differ)
    # while this process reads it: every read must find one whole, valid file.
    chain = small_chain()
    cache = PlanCache(tmp_path, KEY)
    cache.store("(64,)", chain, solve(chain, 900))
    context = multiprocessing.get_context("fork")
    go = context.Event()
    writers = [
        context.Process(
            target=write_many, args=(str(tmp_path), chain, solve(chain, budget), go, 300)
        )
        for budget in (900, 700)
    ]
    for writer in writers:
        writer.start()
    loads = []
    with caplog.at_level("WARNING"):
        go.set()
        while True:
            loads.append(cache.load("(64,)"))
            if not any(writer.is_alive() for writer in writers):
                break
    for writer in writers:
        writer.join()
        assert writer.exitcode == 0
    assert "ignoring" not in caplog.text
    assert None not in loads
    assert {plan.budget_bytes for _, plan in [*loads, cache.load("(64,)")]} <= {900, 700}
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".tmp-")] == []


def test_a_cache_dir_that_is_a_file_is_refused(tmp_path) -> None:
    blocker = tmp_path / "plans"
    blocker.write_text("")
    for directory in (blocker, blocker / "inside"):
        with pytest.raises(ValueError, match="is a file, or inside one"):
            PlanCache(directory, {"model": "m"})


def test_a_file_of_json_nested_too_deep_is_ignored(tmp_path, caplog) -> None:
    """It raised RecursionError out of optimize, where the README says it is ignored."""
    chain = small_chain()
    cache = PlanCache(tmp_path, KEY)
    cache.store("(64,)", chain, solve(chain, 900))
    (path,) = tmp_path.glob("*.json")
    path.write_text("[" * 100_000 + "]" * 100_000)
    with caplog.at_level("WARNING"):
        assert cache.load("(64,)") is None
    assert "nested too deeply" in caplog.text


def test_a_plan_read_back_has_the_simulator_s_predictions_not_the_file_s(tmp_path) -> None:
    """A file whose predicted peak was edited to 1 B was trusted: the plan reported 1 B."""
    chain = small_chain()
    plan = solve(chain, 900)
    cache = PlanCache(tmp_path, KEY)
    cache.store("(64,)", chain, plan)
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    data["plan"].update(predicted_peak_bytes=1, predicted_time_s=0.001)
    data["digest"] = _digest(data["chain"], data["plan"])
    path.write_text(json.dumps(data))
    loaded = cache.load("(64,)")
    assert loaded is not None
    assert loaded[1].predicted_peak_bytes == plan.predicted_peak_bytes > 1
    assert loaded[1].predicted_time_s == plan.predicted_time_s


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
        for _ in range(4)
    ]
    return torch.nn.Sequential(*blocks)


def _edit_entry(path, change) -> None:
    """Change an entry as if it had been written so (its digest made anew): what the checks
    after the digest's must catch in a file another version or shape wrote."""
    data = json.loads(path.read_text())
    change(data)
    data["digest"] = _digest(data["chain"], data["plan"])
    path.write_text(json.dumps(data))


def test_an_entry_edited_after_it_was_written_is_ignored(tmp_path, caplog) -> None:
    """Chain bytes divided by 3 and a keep-all plan, consistent with each other, were read and
    run 1.012 times over the budget at every step; with the budget a fraction, an edited
    chain set the bytes of the budget (1.51 times the one asked for)."""
    chain = small_chain()
    cache = PlanCache(tmp_path, KEY)
    cache.store("(64,)", chain, solve(chain, 900))
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    for stage in data["chain"]["stages"]:
        stage["saved_bytes"] = max(stage["out_bytes"], stage["saved_bytes"] // 3)
    path.write_text(json.dumps(data))
    with caplog.at_level("WARNING", logger="offremat"):
        assert cache.load("(64,)") is None
    assert "changed after it was written" in caplog.text


def _regroup(data: dict[str, Any]) -> None:
    data["chain"]["metadata"]["grouping"] = {"x": 5}


def _rebudget(data: dict[str, Any]) -> None:
    data["plan"]["budget_bytes"] *= 4


@pytest.mark.parametrize("change", [_regroup, _rebudget], ids=["grouping", "budget"])
def test_an_entry_the_request_does_not_make_is_ignored_by_optimize(
    tmp_path, caplog, change
) -> None:
    """An edited grouping raised "the chain groups blocks []" out of optimize, with no word
    of the cache; an edited budget ran the plan at it, past the budget asked for."""
    import offremat

    x = torch.randn(64, 32)
    fresh = offremat.optimize(_mlp(), x, budget=0.8, cache_dir=tmp_path)
    (path,) = tmp_path.glob("*.json")
    _edit_entry(path, change)
    with caplog.at_level("WARNING"):
        again = offremat.optimize(_mlp(), x, budget=0.8, cache_dir=tmp_path)
    assert "ignoring plan cache file" in caplog.text
    assert again.plan.budget_bytes == fresh.plan.budget_bytes
    assert again.cache_info()["from_disk"] == 0


def test_another_shape_s_entry_of_other_stages_is_ignored(tmp_path, caplog) -> None:
    """An edited entry for a second shape, of two stages where the model has four, raised
    "the plan has 2 stages, the chain 2 and the model 4" from the step."""
    import offremat

    x, y = torch.randn(64, 32), torch.randn(48, 32)
    model = offremat.optimize(_mlp(), x, budget=0.8, cache_dir=tmp_path)
    first = set(tmp_path.glob("*.json"))
    model(y).sum().backward()
    (path,) = set(tmp_path.glob("*.json")) - first

    def two_stages(data: dict[str, Any]) -> None:
        data["chain"]["stages"] = data["chain"]["stages"][:2]
        data["plan"]["stages"] = data["plan"]["stages"][:2]
        data["plan"]["ops"] = [
            {"op": "F_all", "index": 1},
            {"op": "F_all", "index": 2},
            {"op": "B", "index": 2},
            {"op": "B", "index": 1},
        ]
        data["plan"]["decisions"] = {"0": "keep", "1": "keep"}

    _edit_entry(path, two_stages)
    again = offremat.optimize(_mlp(), x, budget=0.8, cache_dir=tmp_path)
    with caplog.at_level("WARNING"):
        again(y).sum().backward()
    assert "ignoring plan cache file" in caplog.text
    assert "it has 2 stages" in caplog.text


def test_a_forward_set_on_the_instance_is_part_of_the_key() -> None:
    """A head whose forward was replaced on the instance (its backward makes a float64
    temporary) read the plain model's keep-all plan from disk and ran 1.046 times over the
    budget at every step."""
    import types

    from offremat._fingerprint import model_fingerprint

    model = _mlp()
    before = model_fingerprint(model)

    def doubled(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.Sequential.forward(self, x.double()).float()

    model[0].forward = types.MethodType(doubled, model[0])
    assert model_fingerprint(model) != before


def test_the_folder_keeps_the_entries_used_last(tmp_path, monkeypatch) -> None:
    # A number that sizes tensors and changes at every step writes an entry at every step:
    # the folder grew without end. Its modification time says when an entry was used last.
    monkeypatch.setattr("offremat._plan_cache.KEPT_FILES", 3)
    # The user's files in the folder are not entries (a review: all were deleted).
    mine = ["config.json", "data.json", "adapter_config.json", "0123456789abcdef.json"]
    mine.append("d41d8cd98f00b204e9800998ecf8427e.json")  # an MD5 name, not an entry
    for name in mine:
        (tmp_path / name).write_text("{}")
        os.utime(tmp_path / name, (1.0, 1.0))
    chain = small_chain()
    plan = solve(chain, 900)
    cache = PlanCache(tmp_path, KEY)
    for step, length in enumerate(range(10, 14)):
        cache.store(f"({length},)", chain, plan)
        for path in tmp_path.glob("*.json"):  # one second between steps
            os.utime(path, (path.stat().st_mtime - 1,) * 2)
        if step == 0:
            assert cache.load("(10,)") is not None  # read back: used last, until the next
    assert len(list(tmp_path.glob("*.json"))) == 3 + len(mine)
    assert cache.load("(10,)") is None  # the one used longest ago
    assert all(cache.load(f"({n},)") is not None for n in (11, 12, 13))
    for path in tmp_path.glob("*.json"):
        os.utime(path, (path.stat().st_mtime - 1,) * 2)
    cache.load("(11,)")
    cache.store("(14,)", chain, plan)
    assert len(list(tmp_path.glob("*.json"))) == 3 + len(mine)
    assert all((tmp_path / name).exists() for name in mine)
    assert cache.load("(11,)") is not None and cache.load("(14,)") is not None
