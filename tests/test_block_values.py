"""Numbers and strings the blocks receive (a length or a loop count the model computes from
the batch, a mode it picks, a caption handed down) are keyed by type among their inputs,
since one may be new at every step; but one may decide what the blocks save without any shape
showing it, and a plan profiled on one value ran every other at two or three times its
budget, unwarned (a probe and a review: 2.07 and 3.13 times). Now the steps on new values
are measured, as for the call's own numbers, and once one measures over its budget, each
value gets a plan of its own; a string the model computes keys a plan of its own on its first
few values (a mode, exact from its first step), not at every step (a caption made lower case:
a profile at every step, a review). Oracles: the budget measured by StepMemory, gradients by
plain autograd, bit for bit."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import offremat
from offremat._outgrown import CHECKED_EVERY
from offremat._value_checks import CATEGORY_VALUES, MEASURED_EVERY, MEASURED_VALUES
from offremat.measure import StepMemory
from tests.test_number_arguments import WIDTH as MODE_WIDTH
from tests.test_number_arguments import ModeBlock

WIDTH = 32


class SlicingBlock(nn.Module):
    """Works on the first ``n`` positions only: what it saves grows with ``n``."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, n: int, scale: float) -> torch.Tensor:
        head = x[:, :n]
        return torch.cat([head + scale * self.down(torch.tanh(self.up(head))), x[:, n:]], 1)


class Lengths(nn.Module):
    """Hands its blocks the longest of the batch's lengths, and a scale from its input;
    ``count`` divides the loss (a call's number that sizes nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(SlicingBlock() for _ in range(6))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, count: int = 1) -> torch.Tensor:
        n, scale = int(lengths.max()), 1 + float(x.mean()) / 8
        hidden = self.embed(x)
        for block in self.blocks:
            hidden = block(hidden, n, scale)
        return self.head(hidden).square().sum() / count


X = torch.randn(4, 64, 8, generator=torch.Generator().manual_seed(0))


def _optimized(**call: int) -> tuple[offremat.OptimizedModule, nn.Module, nn.Module]:
    """A Lengths model optimized on lengths up to 8 (and ``call``), a plain copy, their
    gradients made."""
    torch.manual_seed(0)
    model = Lengths()
    plain = copy.deepcopy(model)
    example = {"x": X, "lengths": torch.tensor([8, 4, 2, 8]), **call}
    om = offremat.optimize(model, example, budget=0.7)
    for p in (*model.parameters(), *plain.parameters()):
        p.grad = torch.zeros_like(p)
    return om, model, plain


def _step(
    om, model: nn.Module, plain: nn.Module, lengths: list[int], x: torch.Tensor = X, **call: int
) -> StepMemory:
    """One step on ``x``, ``lengths`` and ``call``, its gradients bit-equal to plain
    autograd's; its memory."""
    with StepMemory("cpu", inputs=x) as memory:
        om(x=x, lengths=torch.tensor(lengths), **call).backward()
    plain(x=x, lengths=torch.tensor(lengths), **call).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    return memory


def test_a_number_computed_for_the_blocks_that_sizes_what_they_save_gets_plans(caplog) -> None:
    om, model, plain = _optimized()
    for _ in range(2):
        assert _step(om, model, plain, [8, 4, 2, 3]).peak_bytes <= om.plan.budget_bytes
    with caplog.at_level(logging.WARNING, logger="offremat"):
        past = _step(om, model, plain, [20, 4, 2, 3])  # its first step, on the plan for 8
        assert om.stats.measured_peak_bytes is not None  # measured
        assert past.peak_bytes > om.plan.budget_bytes  # over
        for _ in range(2):  # planned for its own value from the next step on
            assert _step(om, model, plain, [20, 4, 2, 3]).peak_bytes <= om.plan.budget_bytes
    assert "the blocks received numbers or strings at values" in caplog.text
    assert om.cache_info()["variants"] == 1


def test_a_number_computed_for_the_blocks_new_at_every_step_is_measured_on_some() -> None:
    # A scale from the input's values, new at every step and sizing nothing: measured on the
    # first new values (those of a category's size) and one in MEASURED_EVERY after, and
    # never planned again. Its first new values span those after it (one past them is
    # measured: test_value_thresholds).
    om, model, plain = _optimized()
    offsets = [0, 39, 1] + [2 + (step * 0.618) % 1 * 36 for step in range(3, 100)]
    measured = []
    for offset in offsets:
        _step(om, model, plain, [8, 4, 2, 3], X + offset / 64)
        measured.append(om.stats.measured_peak_bytes is not None)
    # The first step is on the values the plan was profiled on: nothing to check. Step n is
    # also the (n + 1)-th on its plan, measured where a multiple of CHECKED_EVERY.
    new_values = range(1, len(offsets))
    expected = [
        n <= CATEGORY_VALUES or n % MEASURED_EVERY == 0 or (n + 1) % CHECKED_EVERY == 0
        for n in new_values
    ]
    assert measured == [False, *expected]
    assert om.cache_info()["variants"] == 0 and om.cache_info()["misses"] == 0


@pytest.mark.parametrize("checked", [MEASURED_VALUES + 1, 1])
def test_beside_a_call_number_new_at_every_step_it_learns_which_sized(checked, caplog) -> None:
    # A count new at every step, learnt to size nothing, beside the blocks' length: the step
    # past the threshold blames the length, whether the count was checked on many values or
    # on one (a review: early in training the count was blamed twice, and then keyed plans
    # for good, a profile at every step).
    om, model, plain = _optimized(count=1)
    counts = iter(range(2, 1000))
    _step(om, model, plain, [8, 4, 2, 3], count=next(counts))  # profiled: count learnt
    for _ in range(checked):
        _step(om, model, plain, [8, 4, 2, 3], count=next(counts))
    caplog.set_level(logging.WARNING, logger="offremat")
    past = _step(om, model, plain, [20, 4, 2, 3], count=next(counts))
    assert om.stats.measured_peak_bytes is not None  # measured: its length is new
    assert past.peak_bytes > om.plan.budget_bytes
    for _ in range(3):  # planned for the length 20 within two steps
        _step(om, model, plain, [20, 4, 2, 3], count=next(counts))
    planned = om.cache_info()
    for _ in range(6):
        memory = _step(om, model, plain, [20, 4, 2, 3], count=next(counts))
        assert memory.peak_bytes <= om.plan.budget_bytes
    assert om.cache_info()["misses"] == planned["misses"]
    assert om.cache_info()["variants"] == planned["variants"]
    # The length, which has taken fewer values than the count, is blamed: never the count.
    assert "with the Python argument count" not in caplog.text
    assert "the blocks received numbers or strings at values" in caplog.text


class HandedModes(nn.Module):
    """Picks one of the two modes the call names for its blocks from the batch's values."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, MODE_WIDTH)
        self.blocks = nn.ModuleList(ModeBlock() for _ in range(6))

    def forward(self, x: torch.Tensor, modes: tuple[str, str]) -> torch.Tensor:
        mode = modes[1] if x[0, 0, 0].item() > 0 else modes[0]
        hidden = self.inp(x)
        for block in self.blocks:
            hidden = block(hidden, mode)
        return hidden.square().mean()


def test_a_mode_picked_among_the_calls_strings_gets_a_plan_after_one_step_over(caplog) -> None:
    # Both names among the call's strings, the mode was keyed by type and the deep steps ran
    # on the shallow plan at 3.13 times the budget at every step, unwarned (review F2).
    torch.manual_seed(0)
    model = HandedModes()
    plain = copy.deepcopy(model)
    shallow = torch.randn(4, 32, 8, generator=torch.Generator().manual_seed(0))
    shallow[0, 0, 0] = -1.0
    deep = shallow.clone()
    deep[0, 0, 0] = 1.0
    modes = ("shallow", "deep")
    om = offremat.optimize(model, {"x": shallow, "modes": modes}, budget=1.0)
    for p in (*model.parameters(), *plain.parameters()):
        p.grad = torch.zeros_like(p)
    peaks = []
    with caplog.at_level(logging.WARNING, logger="offremat"):
        for x in (shallow, deep, deep, deep, shallow):
            with StepMemory("cpu", inputs=x) as memory:
                om(x=x, modes=modes).backward()
            plain(x, modes).backward()
            for p, q in zip(model.parameters(), plain.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad)
            peaks.append(memory.peak_bytes / om.plan.budget_bytes)
    assert peaks[1] > 1  # the first deep step, on the shallow plan: measured over
    assert max(peaks[:1] + peaks[2:]) <= 1
    assert "the blocks received numbers or strings at values" in caplog.text


class NoteBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, note: str) -> torch.Tensor:
        return x + torch.tanh(self.up(x))


class Captioned(nn.Module):
    """Hands its blocks the call's caption made lower case: a new string at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(NoteBlock() for _ in range(4))

    def forward(self, x: torch.Tensor, caption: str) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, caption.lower())
        return x.square().mean()


def test_a_caption_transformed_for_the_blocks_is_planned_a_few_times_not_each_step() -> None:
    # Keyed by value among the blocks' inputs, it was a profile and a plan at every step
    # (review F6): 20 steps, 20 plans.
    from offremat._block_value_keys import MODE_VALUES

    torch.manual_seed(0)
    model = Captioned()
    x = torch.randn(4, 24, 8, generator=torch.Generator().manual_seed(0))
    om = offremat.optimize(model, {"x": x, "caption": "Step 0"}, budget=0.7)
    for step in range(1, 21):
        with StepMemory("cpu", inputs=x) as memory:
            om(x=x, caption=f"Step {step}").backward()
        assert memory.peak_bytes <= om.plan.budget_bytes
    info = om.cache_info()
    assert info["misses"] == 1  # the second caption's profile: the call's caption is learnt
    assert info["variants"] == MODE_VALUES - 1  # the first lower-cased ones, then by type


class WideInput(Lengths):
    """A Lengths model whose batch is wide: the step holds it (for the embedding's backward)
    beside the blocks' activations, and its bytes are most of the budget's margin."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(256, WIDTH)


@pytest.mark.parametrize("budget, length", [(0.8, 20), (1.0, 32)], ids=["planned", "keep-all"])
def test_a_measured_step_counts_what_the_code_around_the_blocks_holds(budget, length) -> None:
    # A measured step saw the chain's part only, and compared it with a budget for the whole
    # step: the length-20 step passed at 1.20 times its budget, its chain's part at 0.71; on
    # a keep-all plan, run as plain autograd, the length-32 steps at 1.25 (a review).
    x = torch.randn(4, 64, 256, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = WideInput()
    example = {"x": x, "lengths": torch.tensor([8, 4, 2, 8])}
    om = offremat.optimize(model, example, budget=budget)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    peaks = []
    for n in (8, length, length, length):
        with StepMemory("cpu", inputs=x) as memory:
            om(x=x, lengths=torch.tensor([n, 4, 2, 3])).backward()
        peaks.append(memory.peak_bytes / om.plan.budget_bytes)
    assert peaks[1] > 1  # the first step on the new length, measured: over, and found so
    assert max(peaks[:1] + peaks[2:]) <= 1 and om.cache_info()["variants"] == 1


class LoopBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, loops: int, **kwargs: object) -> torch.Tensor:
        for _ in range(loops):
            x = x + self.down(torch.tanh(self.up(x)))
        return x


class Looped(nn.Module):
    """Blocks that loop as often as the batch says, handed Hugging Face's
    ``num_items_in_batch`` through ``**kwargs`` as the Trainer does: an int new at every
    step that only divides the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.layers = nn.ModuleList(LoopBlock() for _ in range(6))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, num_items_in_batch: int = 1) -> torch.Tensor:
        loops = 1 if x[0, 0, 0].item() < 0 else 3
        hidden = self.embed(x)
        for layer in self.layers:
            hidden = layer(hidden, loops, num_items_in_batch=num_items_in_batch)
        return self.head(hidden).square().sum() / num_items_in_batch


@pytest.mark.parametrize(
    "loops",
    [[1, 1, 3, 1, 3, 1, 3, 3, 1, 3, 1, 3], [1, 3] * 6, [1] * 10 + [3, 1, 3, 1]],
    ids=["early", "alternating", "late"],
)
def test_a_loop_count_beside_a_count_new_every_step_costs_a_few_profiles(loops) -> None:
    # A review: past its threshold early in training, the count was blamed twice and keyed
    # plans for good (25 profiles in 28 steps); alternating, every step was a profile,
    # unsaid; late, after 8 new counts, the first step on 3 loops went unmeasured, 2.08 times
    # the budget. Now one step runs over (measured, said) and a few profiles tell them apart.
    torch.manual_seed(0)
    model = Looped()
    plain = copy.deepcopy(model)
    batches = torch.Generator().manual_seed(0)

    def batch(loop: int) -> torch.Tensor:
        x = torch.randn(4, 64, 8, generator=batches)
        x[0, 0, 0] = -1.0 if loop == 1 else 1.0
        return x

    om = offremat.optimize(model, {"x": batch(1), "num_items_in_batch": 200}, budget=0.85)
    for p in (*model.parameters(), *plain.parameters()):
        p.grad = torch.zeros_like(p)
    peaks, plans = [], []
    for step, loop in enumerate(loops):
        x, count = batch(loop), 201 + step
        with StepMemory("cpu", inputs=x) as memory:
            om(x=x, num_items_in_batch=count).backward()
        plain(x=x, num_items_in_batch=count).backward()
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
        peaks.append(memory.peak_bytes / om.plan.budget_bytes)
        info = om.cache_info()
        plans.append(info["misses"] + info["variants"])
    assert sum(peak > 1 for peak in peaks) <= 1  # the first step on 3 loops, measured
    assert plans[-1] <= 4 and plans[-1] == plans[-2]  # a few, and none once both are seen


def test_a_length_beside_a_scale_new_every_step_keys_plans_and_the_scale_does_not() -> None:
    # A review: the step over on a new length blamed the scale the batch gives too, and each
    # later step was a plan of its own (a new scale at every step).
    # Blamed both on the first step over (each had taken one value), the scale is found to
    # size nothing by two plans that differ in it alone, and keys plans no more.
    om, model, plain = _optimized()
    lengths = [8, 20, 20, 8, 20, 12, 12, 8, 20, 12, 20, 8, 12]
    peaks, plans = [], []
    for step, n in enumerate(lengths):
        peaks.append(_step(om, model, plain, [n, 4, 2, 3], X + step / 64).peak_bytes)
        plans.append(om.cache_info()["variants"])
    budget = om.plan.budget_bytes
    assert sum(peak > budget for peak in peaks) <= 2  # the first steps on 20 and on 12
    assert plans[-1] <= 6 and plans[-1] == plans[-5]  # none in the last steps
