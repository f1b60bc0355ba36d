"""A Python number among a model's arguments that changes at every step (a count of items
for the loss, a temperature): each value was a new signature, so the model was profiled at
every step and the plans grew without end. Now a number that sizes nothing is learnt so
from one second profile and then reuses the plan; one that sizes a tensor keeps a plan per
value, the last few kept, with a warning to pass it as a tensor. Oracles: plain autograd,
bit for bit, and the budget measured by StepMemory at every step."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import offremat
import offremat._shape_solving
from offremat.measure import StepMemory
from tests.oracles import step_as_plain_autograd

WIDTH = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.down(torch.tanh(self.up(x)))


class Model(nn.Module):
    """``count`` divides the loss; ``temperature`` reaches every block, sizing nothing;
    ``keep`` keeps the last positions for the head; ``cut`` the first ones for the blocks;
    ``tag`` is carried and unused; ``pool="last"`` gives the head the last four positions."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(WIDTH, 64)

    def forward(
        self,
        x: torch.Tensor,
        count: int = 1,
        temperature: float = 1.0,
        keep: int = 0,
        cut: int = 0,
        tag: Any = None,
        pool: str = "all",
    ) -> torch.Tensor:
        h = self.inp(x[:, :cut] if cut else x)
        for block in self.blocks:
            h = block(h, temperature)
        h = h[:, -4:] if pool == "last" else h
        logits = self.head(h[:, -keep:] if keep else h)
        return torch.log_softmax(logits, -1).square().sum() / count


X = torch.randn(4, 24, 8, generator=torch.Generator().manual_seed(0))


def _steps(example: dict[str, Any], calls: Iterable[dict[str, Any]], budget: float = 0.7):
    """Optimize on ``example`` and train on ``calls``: each step within the budget and, from
    the same weights, bit-equal to plain autograd. The optimized model and its profiles."""
    torch.manual_seed(0)
    model = Model()
    plain = copy.deepcopy(model)
    om = offremat.optimize(model, {"x": X, **example}, budget=budget)
    profiles: list[int] = []  # one entry per profile of a new signature
    profile = om._plans.profile
    om._plans.profile = lambda batch: profiles.append(1) or profile(batch)
    for p in (*model.parameters(), *plain.parameters()):
        p.grad = torch.zeros_like(p)  # step 0's gradients are not activations
    for call in calls:
        with StepMemory("cpu", inputs=X) as memory:
            om(x=X, **call).backward()
        assert memory.peak_bytes <= om.plan.budget_bytes, call
        plain(x=X, **call).backward()
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), (name, call)
    return om, profiles


@pytest.mark.parametrize(
    "name, values",
    [("count", [9 + i for i in range(10)]), ("temperature", [0.5 + i / 8 for i in range(10)])],
)
def test_a_number_that_sizes_nothing_is_profiled_once_then_reused(name, values) -> None:
    # A count that only divides the loss, a temperature every block receives: the second
    # value is profiled (its chain agrees with the first in every byte), later ones are not.
    om, profiles = _steps({name: values[0] - 1}, [{name: v} for v in values])
    assert len(profiles) == 1
    info = om.cache_info()
    assert info["misses"] == 1 and info["hits"] == len(values) - 1
    assert info["plans"] == 1  # the example's plan and the second value's share one key


class Tag:
    """An object with the default repr, which holds its address."""


@pytest.mark.parametrize(
    "make",
    [
        lambda i: f"shard-{i}",
        lambda i: [f"caption {i}-{k}" for k in range(3)],
        lambda i: Tag(),
        lambda i: torch.Generator().manual_seed(i),
    ],
    ids=["string", "captions", "object", "generator"],
)
def test_a_string_or_object_that_changes_every_step_is_profiled_once_then_reused(make) -> None:
    # Keyed by value (an object by its repr, its address), each step was a profile and a
    # plan: 4.7 times checkpoint's step (a hunt).
    om, profiles = _steps({"tag": make(0)}, [{"tag": make(i)} for i in range(1, 8)])
    assert len(profiles) == 1
    assert om.cache_info()["misses"] == 1 and om.cache_info()["plans"] == 1


class CaptionBlock(Block):
    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return super().forward(x)


class Carrying(nn.Module):
    """Hands its keywords down to every block, as Hugging Face's models do."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(CaptionBlock() for _ in range(4))

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, **kwargs)
        return h.square().sum()


def test_a_string_handed_down_to_the_blocks_is_profiled_once_then_reused() -> None:
    # The blocks' own inputs kept strings by value: two captions always differed there, so a
    # caption was never learnt to size nothing, a profile and a plan at every step (review).
    torch.manual_seed(0)
    model = Carrying()
    plain = copy.deepcopy(model)
    om = offremat.optimize(model, {"x": X, "caption": "caption 0"}, budget=0.7)
    for p in (*model.parameters(), *plain.parameters()):
        p.grad = torch.zeros_like(p)
    for i in range(1, 8):
        with StepMemory("cpu", inputs=X) as memory:
            om(x=X, caption=f"caption {i}").backward()
        assert memory.peak_bytes <= om.plan.budget_bytes
        plain(x=X, caption=f"caption {i}").backward()
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
    assert om.cache_info()["misses"] == 1 and om.cache_info()["plans"] == 1


def test_a_string_that_sizes_the_head_gets_a_plan_per_value() -> None:
    om, profiles = _steps({"pool": "all"}, [{"pool": p} for p in ("last", "all", "last")])
    assert len(profiles) == 1
    assert om.cache_info()["plans"] == 2 and om.cache_info()["hits"] == 2


def test_a_number_new_at_every_step_has_only_some_of_its_steps_measured() -> None:
    # A temperature new at every step had every step measured, each 14% slower (a hunt): the
    # first new values are, then one in MEASURED_EVERY, and those past the values measured
    # (an annealed temperature has all its steps measured: test_value_thresholds).
    from offremat._value_checks import CATEGORY_VALUES, MEASURED_EVERY

    torch.manual_seed(0)
    model = Model()
    om = offremat.optimize(model, {"x": X, "temperature": 2.0}, budget=0.7)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    # A second value, then the least and the greatest, then new values between them.
    temperatures = [1.5, 1.0, 3.0] + [1 + (step * 0.618) % 2 for step in range(3, 140)]
    measured = []
    for temperature in temperatures:
        om(x=X, temperature=temperature).backward()
        measured.append(om.stats.measured_peak_bytes is not None)
    # Step 0 (a second value) is profiled and learnt neutral; the next are new values, the
    # first of them measured as a category's.
    new_values = range(1, len(measured))
    expected = [n <= CATEGORY_VALUES or n % MEASURED_EVERY == 0 for n in new_values]
    assert measured == [False, *expected]
    assert om.cache_info()["misses"] == 1


def test_a_number_that_sizes_the_head_gets_a_plan_per_value() -> None:
    # keep sizes the head's logits, outside the blocks: their inputs alone would not tell.
    om, profiles = _steps({"keep": 8}, [{"keep": k} for k in (5, 6, 7, 5)])
    # One more: keep=5's tensors with the value 8, which tells keep's doing from theirs.
    assert len(profiles) == 4
    assert om.cache_info()["plans"] == 4 and om.cache_info()["hits"] == 1


def test_a_number_that_sizes_the_blocks_inputs_gets_a_plan_per_value() -> None:
    om, profiles = _steps({"cut": 20}, [{"cut": c} for c in (12, 16, 12)])
    assert len(profiles) == 3  # with one on cut=12's tensors and the value 20
    assert om.cache_info()["plans"] == 3 and om.cache_info()["hits"] == 1


def test_a_neutral_count_beside_a_sizing_one_keeps_each_apart() -> None:
    # count is learnt neutral, keep sizing: a new count with a known keep reuses its plan.
    calls = [{"count": 3, "keep": 8}, {"count": 4, "keep": 5}, {"count": 5, "keep": 5}]
    calls += [{"count": 6, "keep": 8}, {"count": 7, "keep": 6}]
    om, profiles = _steps({"count": 2, "keep": 8}, calls)
    # count learnt on step 1; keep=5 planned (differs in keep only from keep=8's plan: learnt
    # sizing, on its tensors with keep=8 too); counts 5 and 6 reuse; keep=6 is planned.
    assert len(profiles) == 4
    assert om.cache_info()["plans"] == 3


def test_a_neutral_count_changed_with_a_sizing_one_is_not_taken_for_sizing() -> None:
    # Both changed in the first call, so both were learnt sizing: count keyed plans forever
    # (9 profiles for 9 calls), and the warning said it changed a tensor size (review).
    calls = [{"count": 3, "keep": 5}] + [{"count": c, "keep": 5} for c in range(4, 12)]
    om, profiles = _steps({"count": 2, "keep": 8}, calls)
    assert len(profiles) == 2  # (3, 5), then (4, 5), which differs in count alone
    assert om.cache_info()["plans"] == 2


def test_plans_stay_bounded_and_a_warning_says_to_pass_a_tensor(monkeypatch, caplog) -> None:
    monkeypatch.setattr(offremat._shape_solving, "KEPT_SIGNATURES", 3)
    with caplog.at_level(logging.WARNING, logger="offremat._numbers"):
        om, profiles = _steps({"keep": 12}, [{"keep": k} for k in range(11, 3, -1)])
    assert len(profiles) == 9  # every value profiled, the first twice: it sizes the head
    assert om.cache_info()["plans"] == 3
    plans = om._plans
    assert len(plans.profiled) <= 3 and plans.unprofiled <= plans.executors.keys()
    warnings = [r.getMessage() for r in caplog.records if "as a tensor" in r.getMessage()]
    assert len(warnings) == 1 and "keep" in warnings[0]


class Slicing(nn.Module):
    """A block of an nn.Sequential that hands on the number it is given with its input."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, value: tuple[torch.Tensor, int]) -> tuple[torch.Tensor, int]:
        x, n = value
        return x + torch.tanh(self.linear(x[:, :n])).sum(1, keepdim=True), n


def test_an_nn_sequential_keeps_a_bounded_plan_per_value(monkeypatch, caplog) -> None:
    # Its input is its first block's: each value gets a plan, the last few kept.
    monkeypatch.setattr(offremat._shape_solving, "KEPT_SIGNATURES", 3)
    torch.manual_seed(0)
    model = nn.Sequential(*(Slicing() for _ in range(4)))
    plain = copy.deepcopy(model)
    x = torch.randn(4, 24, WIDTH, generator=torch.Generator().manual_seed(0))
    om = offremat.optimize(model, (x, 20), budget=0.8)
    with caplog.at_level(logging.WARNING, logger="offremat._numbers"):
        for n in range(12, 20):
            om((x, n))[0].square().sum().backward()
            plain((x, n))[0].square().sum().backward()
    assert om.cache_info()["misses"] == 8 and om.cache_info()["plans"] == 3
    warnings = [r.getMessage() for r in caplog.records if "as a tensor" in r.getMessage()]
    assert len(warnings) == 1 and "input[1]" in warnings[0]
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_a_value_seen_before_the_number_was_learnt_still_finds_its_plan() -> None:
    om, profiles = _steps({"count": 2}, [{"count": c} for c in (3, 2, 3, 4)])
    assert len(profiles) == 1 and om.cache_info()["hits"] == 3


def test_a_hugging_face_num_items_in_batch_int_is_profiled_once() -> None:
    # The Trainer's num_items_in_batch, passed as an int, reaches every decoder layer through
    # **kwargs and only divides the loss.
    pytest.importorskip("transformers")
    from tests import model_zoo as zoo

    torch.manual_seed(0)
    model = zoo.llama().train()
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    om = offremat.optimize(
        model, {"input_ids": ids, "labels": ids, "num_items_in_batch": 20}, budget=0.6
    )
    for p in (*model.parameters(), *plain.parameters()):
        p.grad = torch.zeros_like(p)
    for items in range(21, 27):
        with StepMemory("cpu", inputs=ids) as memory:
            om(input_ids=ids, labels=ids, num_items_in_batch=items).loss.backward()
        assert memory.peak_bytes <= om.plan.budget_bytes
        plain(input_ids=ids, labels=ids, num_items_in_batch=items).loss.backward()
    assert om.cache_info()["misses"] == 1 and om.cache_info()["plans"] == 1
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


class MultiTask(nn.Module):
    """A task id picks a head: tasks 0 and 1 give logits of one size, task 2 larger ones."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.heads = nn.ModuleList(nn.Linear(WIDTH, n) for n in (16, 16, 40))

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return torch.log_softmax(self.heads[task](h), -1)


def test_a_number_learnt_neutral_that_sizes_the_output_after_all_is_planned_again(
    caplog,
) -> None:
    # Tasks 0 and 1 profile alike, so the task id is learnt to size nothing; task 2's step
    # runs on their plan, its output's shape says otherwise, and from then on each task has
    # its own plan.
    torch.manual_seed(0)
    model = MultiTask()
    plain = copy.deepcopy(model)
    om = offremat.optimize(model, {"x": X, "task": 0}, budget=0.7, blocks="blocks")
    profiles: list[int] = []
    profile = om._plans.profile
    om._plans.profile = lambda batch: profiles.append(1) or profile(batch)
    with caplog.at_level(logging.WARNING, logger="offremat._numbers"):
        for task in (1, 2, 2, 0, 2):
            om(x=X, task=task).square().sum().backward()
            plain(x=X, task=task).square().sum().backward()
    # Task 1 (learning); task 2 once found to size the output, and task 0 again: its plan
    # was keyed without the task, which now keys plans.
    assert len(profiles) == 3
    warnings = [r.getMessage() for r in caplog.records if "changed shape" in r.getMessage()]
    assert len(warnings) == 1 and "task" in warnings[0]
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    # Task 2's own plan holds its budget.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with StepMemory("cpu", inputs=X) as memory:
        om(x=X, task=2).square().sum().backward()
    assert memory.peak_bytes <= om.plan.budget_bytes


class ThresholdBlock(nn.Module):
    """More work, and more saved, above a threshold of ``k``: the same shapes either way."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, k: int) -> torch.Tensor:
        hidden = torch.tanh(self.up(x))
        if k > 8:
            for _ in range(k // 4):
                hidden = torch.tanh(hidden * 1.01)
        return x + self.down(hidden)


class ThresholdModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(ThresholdBlock() for _ in range(4))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor, k: int = 1) -> torch.Tensor:
        hidden = self.embed(x)
        for block in self.blocks:
            hidden = block(hidden, k)
        return self.head(hidden).square().sum()


def _threshold_model() -> tuple[offremat.OptimizedModule, torch.Tensor]:
    """A ThresholdModel optimized on k=1, its gradients allocated, and its input."""
    x = torch.randn(4, 24, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = ThresholdModel()
    om = offremat.optimize(model, {"x": x, "k": 1}, budget=0.7)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    return om, x


def _refused_after_measured_over(om, x: torch.Tensor, caplog) -> None:
    """The step after one measured over its budget on k=32: planned for its own value, which
    no plan fits, with the warning that says why."""
    from solvers.budget import InfeasibleBudgetError

    # The error names the value that made the budget too small, not only the shapes.
    refused = pytest.raises(
        InfeasibleBudgetError, match=r"for input \(4, 24, 8\) float32 with k=32; the least"
    )
    with caplog.at_level(logging.WARNING, logger="offremat"), refused:
        om(x=x, k=32)
    assert "a step measured over its plan's budget with the Python argument k" in caplog.text


def test_a_number_learnt_to_size_nothing_is_measured_on_each_new_value(caplog) -> None:
    # Learnt to size nothing from k=1 and k=2, k=32 ran every later step on their plan at
    # 2.29 times its budget, unwarned (review); before the learning, its profile refused it.
    om, x = _threshold_model()
    for k in (2, 3):
        with StepMemory("cpu", inputs=x) as memory:
            om(x=x, k=k).backward()
        assert memory.peak_bytes <= om.plan.budget_bytes
    assert om.cache_info()["misses"] == 1  # k=2's profile; k=3 reuses its plan
    om(x=x, k=32).backward()  # its first step, measured: over the budget
    _refused_after_measured_over(om, x, caplog)


def test_a_value_past_those_measured_is_measured_on_its_first_step(caplog) -> None:
    # After the first new values, one in MEASURED_EVERY is measured: a value first seen then
    # was never measured, on any of its steps, as it had been seen (review: a task's name,
    # 2.29 times the budget at every step on it, unwarned); then on its second step (a value
    # back); now on its first where it lies past the values measured within budget.
    from offremat._value_checks import MEASURED_VALUES

    om, x = _threshold_model()
    # k=2 profiled, then the new values measured (each at most 8: under the threshold).
    for k in (2, *range(-1, -MEASURED_VALUES - 1, -1)):
        om(x=x, k=k).backward()
        assert (om.stats.measured_peak_bytes is not None) == (k != 2)
    om(x=x, k=-4).backward()  # a value back, measured before
    assert om.stats.measured_peak_bytes is None
    om(x=x, k=32).backward()  # a new value past those: measured, over the budget
    assert om.stats.measured_peak_bytes > om.plan.budget_bytes
    _refused_after_measured_over(om, x, caplog)


class TemperedThreshold(ThresholdModel):
    """A ThresholdModel whose loss a temperature scales, a number that sizes nothing; its
    blocks get ``k`` as a tensor, so that only the call's signature holds its value."""

    def forward(self, x: torch.Tensor, k: int = 1, t: float = 1.0) -> torch.Tensor:
        return super().forward(x, torch.tensor(k)) * t  # type: ignore[arg-type]


def test_a_value_back_is_measured_and_blamed_beside_a_number_new_every_step(caplog) -> None:
    # A task's value past a threshold beside a temperature new at every step: no whole call
    # came back, so k=9 went unmeasured until one call in MEASURED_EVERY, and once measured
    # over, both numbers keyed plans: a profile at every step from then on (review F6). Now a
    # new value where few have been is measured, and the blame goes to the place that has
    # taken the fewest values, not to the temperature.
    from offremat._value_checks import MEASURED_VALUES

    x = torch.randn(4, 24, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = TemperedThreshold()
    plain = copy.deepcopy(model)
    om = offremat.optimize(model, {"x": x, "k": 1, "t": 1.0}, budget=0.95)
    for p in (*model.parameters(), *plain.parameters()):
        p.grad = torch.zeros_like(p)
    temperatures = iter(1.0 - n / 1024 for n in range(1, 1000))
    om(x=x, k=2, t=1.0).backward()  # profiled: k sizes nothing
    om(x=x, k=1, t=next(temperatures)).backward()  # profiled: neither does t
    assert om.cache_info()["misses"] == 2
    for _ in range(MEASURED_VALUES):  # the first new values: each measured, within budget
        om(x=x, k=1, t=next(temperatures)).backward()
        assert om.stats.measured_peak_bytes <= om.plan.budget_bytes
    # A new value of k, which has taken few, t new: measured whatever t holds (before, a new
    # value past the first ones was not, nor on its return beside a new t), and over.
    om(x=x, k=9, t=next(temperatures)).backward()
    assert om.stats.measured_peak_bytes > om.plan.budget_bytes
    for p in model.parameters():
        p.grad.zero_()
    caplog.set_level(logging.WARNING, logger="offremat")
    for k in (9, 1):  # k keys plans, t still not: one profile each, then reused
        misses = om.cache_info()["misses"]
        for _ in range(3):
            t = next(temperatures)
            with StepMemory("cpu", inputs=x) as memory:
                om(x=x, k=k, t=t).backward()
            assert memory.peak_bytes <= om.plan.budget_bytes
            plain(x=x, k=k, t=t).backward()
            for q, r in zip(model.parameters(), plain.parameters(), strict=True):
                assert torch.equal(q.grad, r.grad)
        assert om.cache_info()["misses"] == misses + 1
    assert "measured over its plan's budget with the Python argument k, which" in caplog.text


class WideBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(256, 1024)
        self.down = nn.Linear(1024, 256)

    def forward(self, x: torch.Tensor, temperature: float) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x) / temperature))


class Wide(nn.Module):
    """Parameters' gradients (12.6 MB) far above its activations at a few tokens (a budget
    of 1.6 MB at 70% of keep-all)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(WideBlock() for _ in range(6))

    def forward(self, x: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, temperature)
        return x.square().mean()


def test_where_gradients_cannot_be_told_apart_a_new_value_is_not_taken_for_sizing(
    monkeypatch, caplog
) -> None:
    # On CUDA (simulated: no peak less gradients) a loop that sets .grad to None had each
    # sampled new value's check over by the gradients it made, put off to the next step, a
    # new value again, and then counted over: the temperature was taken to size tensors, a
    # profile and a plan at every step (review).
    from offremat.measure import StepMemory

    monkeypatch.setattr(StepMemory, "peak_less_gradients_bytes", property(lambda self: None))
    torch.manual_seed(0)
    model = Wide()
    x = torch.randn(2, 16, 256, generator=torch.Generator().manual_seed(0))
    om = offremat.optimize(model, {"x": x, "temperature": 2.0}, budget=0.7)
    with caplog.at_level(logging.WARNING, logger="offremat"):
        for step in range(10):
            model.zero_grad(set_to_none=True)
            om(x=x, temperature=2 * 0.99 ** (step + 1)).backward()
    assert om.cache_info()["misses"] == 1
    assert "measured over its plan's budget" not in caplog.text
    assert "cannot tell those from activations, so the plan is kept" in caplog.text  # said


def test_captions_are_not_kept_after_their_step() -> None:
    # The signatures checked, up to 4096, held each step's strings whole: 32 captions of 2 KB
    # a step kept 21.5 MiB after 300 steps (review).
    import tracemalloc

    def captions(step: int) -> list[str]:
        return [f"{step}-{k} " + "lorem ipsum " * 170 for k in range(32)]

    torch.manual_seed(0)
    model = Model()
    om = offremat.optimize(model, {"x": X, "tag": captions(0)}, budget=0.7)
    om(x=X, tag=captions(1)).backward()  # profiled: learnt to size nothing
    tracemalloc.start()
    try:
        for step in range(2, 102):
            om(x=X, tag=captions(step)).backward()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 1 << 20  # 100 steps of 64 KiB of captions each


class ModeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        for _ in range(4 if mode == "deep" else 1):
            x = x + self.down(torch.tanh(self.up(x)))
        return x


class Moded(nn.Module):
    """Chooses its blocks' mode from the batch's values: the call's signature never changes,
    the blocks save four times as much in one mode."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(ModeBlock() for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mode = "deep" if x[0, 0, 0].item() > 0 else "shallow"
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, mode)
        return h.square().mean()


def test_a_string_the_model_computes_for_its_blocks_gets_a_plan_of_its_own() -> None:
    # Keyed by type among the blocks' inputs, a mode computed from the batch ran the deep
    # steps on the shallow plan, at 2.64 times the budget, unwarned (a review); strings the
    # call passes are keyed by type there (the call's signature keys and learns them).
    torch.manual_seed(0)
    model = Moded()
    plain = copy.deepcopy(model)
    shallow = torch.randn(4, 32, 8, generator=torch.Generator().manual_seed(0))
    shallow[0, 0, 0] = -1.0
    deep = shallow.clone()
    deep[0, 0, 0] = 1.0
    om = offremat.optimize(model, shallow, budget=1.0)  # the shallow mode's keep-all
    for p in (*model.parameters(), *plain.parameters()):
        p.grad = torch.zeros_like(p)
    for x in (shallow, deep, deep, shallow):
        with StepMemory("cpu", inputs=x) as memory:
            om(x).backward()
        assert memory.peak_bytes <= om.plan.budget_bytes
        plain(x).backward()
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
    assert om.cache_info()["variants"] == 1


class SparseHead(nn.Module):
    """Scores the masked tokens alone (as ModernBERT's sparse prediction does): what the head
    saves follows how many tokens each batch masks, beside a count that divides the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(512, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(6))
        self.head = nn.Linear(WIDTH, 512)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, num_items_in_batch: int
    ) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        chosen = labels != -100
        loss = F.cross_entropy(self.head(hidden[chosen]), labels[chosen], reduction="sum")
        return loss / num_items_in_batch


def test_a_count_beside_a_head_on_the_masked_tokens_is_learnt_to_size_nothing() -> None:
    # The two calls' chains differed in the head, which the mask's values size, and the
    # count was taken to size it: a profile at almost every step, 17 in 30 (a review).
    generator = torch.Generator().manual_seed(0)

    def batch() -> dict:
        ids = torch.randint(0, 512, (4, 64), generator=generator)
        masked = torch.rand(4, 64, generator=generator) < 0.15
        count = int(masked.sum()) + int(torch.randint(20, 60, (1,), generator=generator))
        return {"input_ids": ids, "labels": ids.masked_fill(~masked, -100),
                "num_items_in_batch": count}  # fmt: skip

    torch.manual_seed(0)
    model = SparseHead()
    plain = copy.deepcopy(model)
    om = offremat.optimize(model, batch(), budget=0.7)
    for _ in range(12):
        step_as_plain_autograd(om, model, plain, **batch())
    assert om.cache_info()["misses"] <= 2


def test_a_blame_says_which_numbers_key_plans_for_good(caplog) -> None:
    # Blamed together, one a second time: the warning said of both what held for one.
    from offremat._numbers import NumberPlaces, number_names

    batch = {"x": X, "count": 3, "temperature": 0.5}
    count, temperature = number_names(batch)
    with caplog.at_level(logging.WARNING, logger="offremat"):
        NumberPlaces()._sizes_after_all("call", frozenset({0, 1}), frozenset({0}), batch, "over")
    said = f"each value of {count} gets its own plan; the values of {temperature} key plans"
    assert said in caplog.text


class _Repeated(nn.Module):
    """One block applied ``n`` times: each depth is a chain of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.block = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.Tanh(), nn.Linear(4 * WIDTH, WIDTH)
        )
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor, n: int = 4) -> torch.Tensor:
        hidden = self.embed(x)
        for _ in range(n):
            hidden = self.block(hidden)
        return self.head(hidden).square().sum()


def test_a_depth_set_by_a_number_names_it_in_its_refusal() -> None:
    # A loop count passed to forward was refused as "no fixed chain", naming no argument, and
    # a new user took it for a broken model (a trial).
    from offremat._blocks import NotAChainError

    torch.manual_seed(0)
    om = offremat.optimize(_Repeated(), {"x": X}, budget=0.7)
    with pytest.raises(NotAChainError, match=r"n=6 \(the example's: 4\).*once per value"):
        om(x=X, n=6)
    om = offremat.optimize(_Repeated(), {"x": X, "n": 4}, budget=0.7)
    with pytest.raises(NotAChainError, match=r"n=2 \(the example's: 4\)"):
        om(x=X, n=2)
    om(x=X, n=4).backward()  # the example's depth still trains
    with pytest.raises(NotAChainError, match=r"This call's n=2 \(the example's: 4\)"):
        om(X, 2)  # by position, named as forward names it


class _Wrapped(_Repeated):
    """_Repeated behind a forward(*args, **kwargs), as a thin wrapper has it."""

    def forward(self, *args, **kwargs) -> torch.Tensor:  # type: ignore[override]
        return super().forward(*args, **kwargs)


def test_a_depth_passed_through_args_or_kwargs_is_named_in_the_refusal() -> None:
    # Bound to forward's parameters, the numbers gathered by *args and **kwargs were one
    # tuple and one dict, dropped: the refusal named none (a review).
    from offremat._blocks import NotAChainError

    torch.manual_seed(0)
    om = offremat.optimize(_Wrapped(), {"x": X, "n": 4}, budget=0.7)
    with pytest.raises(NotAChainError, match=r"This call's n=6 \(the example's: 4\)"):
        om(x=X, n=6)
    om = offremat.optimize(_Wrapped(), (X, 4), budget=0.7)
    with pytest.raises(NotAChainError, match=r"This call's argument 2=6 \(the example's: 4\)"):
        om(X, 6)


class _Sliced(nn.Module):
    """Runs the first ``n`` of its blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.Tanh(), nn.Linear(4 * WIDTH, WIDTH))
            for _ in range(6)
        )

    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        hidden = self.embed(x)
        for block in self.blocks[:n]:
            hidden = block(hidden)
        return hidden.square().sum()


def test_fewer_blocks_set_by_a_number_name_it_in_the_refusal() -> None:
    # A loop over a slice of the blocks, called with fewer, was refused as a use of a block's
    # output inside the chain, naming no number (a review).
    from offremat._handed_on import HandedOnError

    torch.manual_seed(0)
    om = offremat.optimize(_Sliced(), {"x": X, "n": 6}, budget=0.7)
    with pytest.raises(HandedOnError, match=r"n=3 \(the example's: 6\).*once per value"):
        om(X, 3)
    # A number may switch on a read of a block's output instead, which no plan allows (a
    # review: the advice alone led to the same error).
    with pytest.raises(HandedOnError, match=r"a plan per value does not help"):
        om(X, 3)


def test_the_optimized_module_keeps_no_example_tensor_alive() -> None:
    import gc
    import weakref

    x = X.clone()
    example = weakref.ref(x)
    om = offremat.optimize(_Repeated(), {"x": x, "n": 4}, budget=0.7)
    del x
    gc.collect()
    assert example() is None
    om(x=X, n=4).backward()
