"""Steps measured now and then (offremat._outgrown.checked_now_and_then), and a measured step
over its budget planned again on a profile of its batch (profiled_on_step)."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import offremat
import offremat._outgrown as outgrown
import offremat._plain_measured as plain_measured
from offremat.measure import StepMemory
from solvers.baselines import keep_all
from solvers.registry import keep_all_peak

transformers = pytest.importorskip("transformers")

VOCAB = 256


def _mixtral() -> tuple[torch.nn.Module, dict, dict]:
    """A small Mixtral with the per-expert loop, an example whose one token reaches two of
    its eight experts, and a batch of random tokens, which reach them all: the backward of
    each expert reached allocates a gradient of all experts' stacked weights, so the batch
    holds more in its backward than the example, at the same saved sets."""
    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        attention_dropout=0.0,
        experts_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    one = torch.full((2, 64), 7)
    tokens = torch.randint(0, VOCAB, (2, 64))
    return model, {"input_ids": one, "labels": one}, {"input_ids": tokens, "labels": tokens}


def _steps(om, model, plain, batch, count: int, caplog) -> list[tuple[float, bool]]:
    """Peak ÷ budget and whether a warning was logged, per step; gradients checked against
    plain autograd's at each."""
    for p in (*model.parameters(), *plain.parameters()):
        p.grad = torch.zeros_like(p)
    found = []
    for _ in range(count):
        caplog.clear()
        with StepMemory("cpu", batch) as memory:
            om(**batch).loss.backward()
        plain(**batch).loss.backward()
        for mine, theirs in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(mine.grad, theirs.grad)
        said = any(r.levelno >= logging.WARNING for r in caplog.records)
        found.append((memory.peak_bytes / om.plan.budget_bytes, said))
    return found


@pytest.mark.parametrize("budget", [0.8, 1.0], ids=["dp", "keep-all"])
def test_a_mixture_of_experts_over_its_budget_in_its_backward_is_checked_and_planned_again(
    budget: float, monkeypatch, caplog
) -> None:
    # No saved set grows, so no unmeasured step saw it: such a model ran at 1.3 times the
    # budget at every step, unsaid (a new user's trial). A keep-all plan runs as plain
    # autograd, whose backward its checks did not measure: at a budget the example's
    # keep-all fits, the batch ran at 1.13 times it at every step, unsaid (a review).
    monkeypatch.setattr(outgrown, "CHECKED_EVERY", 2, raising=False)
    model, example, batch = _mixtral()
    plain = copy.deepcopy(model)
    om = offremat.optimize(model, example, budget=budget, solver="dp")
    assert (om.plan.ops == keep_all(om.chain).ops) == (budget == 1.0)
    caplog.set_level(logging.INFO, logger="offremat")
    found = _steps(om, model, plain, batch, 5, caplog)
    assert found[0][0] > 1 and not found[0][1]  # unmeasured: over, and nothing sees it
    assert found[1][0] > 1 and found[1][1]  # the check, through the backward: over, said
    assert all(peak <= 1 for peak, _ in found[2:])  # planned on a profile of its batch
    assert om.cache_info()["misses"] == 0


def test_a_batch_refilled_in_place_after_the_check_is_checked_again(monkeypatch) -> None:
    # The step over its budget had its buffer refilled with a batch that holds less: that
    # one was profiled, nothing was planned, and every later step ran over, unsaid (a review).
    monkeypatch.setattr(outgrown, "CHECKED_EVERY", 2, raising=False)
    model, example, batch = _mixtral()
    om = offremat.optimize(model, example, budget=0.8, solver="dp")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    buffer = {name: tensor.clone() for name, tensor in batch.items()}
    peaks = []
    for step in range(10):
        if step == 2:  # after the check: the example's one token
            for name in buffer:
                buffer[name].copy_(example[name])
        elif step > 2:
            tokens = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(step))
            for name in buffer:
                buffer[name].copy_(tokens)
        with StepMemory("cpu", buffer) as memory:
            om(**buffer).loss.backward()
        peaks.append(memory.peak_bytes / om.plan.budget_bytes)
    assert peaks[1] > 1  # the check
    assert max(peaks[-4:]) <= 1


def test_a_milp_plan_made_again_on_a_profile_is_milp_s_again(monkeypatch) -> None:
    # Made again by the quick solver (dp) inside the call, it was never improved (a review).
    monkeypatch.setattr(outgrown, "CHECKED_EVERY", 2, raising=False)
    model, example, batch = _mixtral()
    om = offremat.optimize(
        model, example, budget=0.8, solver="milp", bandwidth="12GB/s", time_limit_s=5
    )
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    solvers = []
    for _ in range(5):
        with StepMemory("cpu", batch) as memory:
            om(**batch).loss.backward()
        solvers.append(om.plan.solver)
    assert om.cache_info()["improved"] >= 1
    assert solvers[-1] == "milp" and memory.peak_bytes <= om.plan.budget_bytes


def test_measure_memory_plans_a_step_over_its_budget_again(caplog) -> None:
    # Measured over at every step, it was said once and never planned again (a new user's
    # trial).
    model, example, batch = _mixtral()
    plain = copy.deepcopy(model)
    om = offremat.optimize(model, example, budget=0.8, solver="dp", measure_memory=True)
    caplog.set_level(logging.INFO, logger="offremat")
    found = _steps(om, model, plain, batch, 3, caplog)
    assert found[0][0] > 1 and found[0][1]
    assert all(peak <= 1 for peak, _ in found[1:])


def test_steps_are_measured_every_checked_every_th(monkeypatch) -> None:
    monkeypatch.setattr(outgrown, "CHECKED_EVERY", 3)
    model, example, _ = _mixtral()
    om = offremat.optimize(model, example, budget=0.8, solver="dp")
    measured = []
    for _ in range(7):
        om(**example).loss.backward()
        measured.append(om.stats.measured_peak_bytes is not None)
    assert measured == [False, False, True, False, False, True, False]


@pytest.mark.parametrize("budget", [0.8, 1.0], ids=["dp", "keep-all"])
def test_a_check_whose_backward_never_runs_falls_to_the_next_step(
    budget: float, monkeypatch, caplog
) -> None:
    # Its measurement is dropped, and the next step is checked instead: said and planned
    # again as a check (it was taken for a step on values its plan was not profiled on, and
    # the plan was not made again, a review).
    monkeypatch.setattr(outgrown, "CHECKED_EVERY", 2, raising=False)
    model, example, batch = _mixtral()
    om = offremat.optimize(model, example, budget=budget, solver="dp")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    om(**example).loss.backward()
    om(**batch)  # the check's forward; its output dropped
    with caplog.at_level(logging.WARNING, logger="offremat"):
        om(**batch).loss.backward()
    assert om.stats.measured_peak_bytes is not None and om.stats.over_budget
    assert "the next call profiles this step's batch" in caplog.text
    with StepMemory("cpu", batch) as memory:
        om(**batch).loss.backward()
    assert memory.peak_bytes <= om.plan.budget_bytes
    # Nothing of the measurement is left on: no dispatch mode, the compiler's stance.
    assert not _get_current_dispatch_mode_stack()
    assert torch._dynamo.eval_frame._stance.stance == "default"


def test_a_keep_all_check_settles_where_the_loss_reads_some_outputs(monkeypatch) -> None:
    # Its end was queued from the first output's node alone: with the loss on another
    # output, every step was measured and none settled (a review).
    monkeypatch.setattr(outgrown, "CHECKED_EVERY", 2, raising=False)

    class Pair(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU())
            self.out = torch.nn.Linear(64, 32)

        def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple:
            side, hidden = pair
            return side + hidden.mean(), hidden + self.out(self.mlp(hidden))

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Pair() for _ in range(4)))
    x = torch.randn(16, 32)
    om = offremat.optimize(model, (x * 0, x), budget=1.0)
    made = []
    original = plain_measured.PlainMeasurement.__init__

    def counted(self: Any, *args: Any) -> None:
        made.append(self)
        original(self, *args)

    monkeypatch.setattr(plain_measured.PlainMeasurement, "__init__", counted)
    for _ in range(6):
        _, hidden = om((x * 0, x))
        hidden.square().mean().backward()
    assert len(made) == 3  # every second step, each settled by its backward
    assert all(measurement.ended for measurement in made)
    assert om.stats is not None and om.stats.budgeted_peak_bytes is not None


class _Experts(torch.nn.Module):
    """Tokens routed by value to one of eight experts, each a slice of stacked weights: the
    backward makes a gradient of all experts' weights per expert reached."""

    def __init__(self, width: int = 32, experts: int = 8) -> None:
        super().__init__()
        self.router = torch.nn.Linear(width, experts)
        self.up = torch.nn.Parameter(torch.randn(experts, width, 4 * width) * 0.05)
        self.down = torch.nn.Parameter(torch.randn(experts, 4 * width, width) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for e in range(self.up.shape[0]):
            mask = chosen == e
            if mask.any():
                routed = torch.relu(x[mask] @ self.up[e]) @ self.down[e]
                out = out.index_put((mask,), routed)
        return x + out


class _Unpadded(torch.nn.Module):
    """Padding removed before the blocks: their input's size is the batch's valid tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(16, 32)
        self.blocks = torch.nn.ModuleList(_Experts() for _ in range(4))
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)[valid][None]
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden).pow(2).mean()


def _unpadded_batch(seed: int, valid: int, repeated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, 64, 16, generator=torch.Generator().manual_seed(seed))
    if repeated:  # one token: it reaches one expert per block
        x = x[:1, :1].expand(4, 64, 16).contiguous()
    return x, (torch.arange(64) < valid)[None, :].expand(4, 64)


def test_a_plan_for_blocks_inputs_of_another_kind_is_checked_and_planned_again(
    monkeypatch,
) -> None:
    # Such a plan (unpadded tokens, of another size than the example's) was never checked:
    # random tokens ran it at 1.28 times the budget at every step, unsaid (a review).
    monkeypatch.setattr(outgrown, "CHECKED_EVERY", 2, raising=False)
    torch.manual_seed(0)
    model = _Unpadded()
    plain = copy.deepcopy(model)
    example = _unpadded_batch(0, 32, repeated=True)
    probe = offremat.optimize(copy.deepcopy(model), example, budget=1.0)
    budget = int(1.3 * keep_all_peak(probe.chain))  # the example's keep-all fits
    om = offremat.optimize(model, example, budget=budget, solver="dp")
    for p in (*model.parameters(), *plain.parameters()):
        p.grad = torch.zeros_like(p)
    peaks, measured = [], []
    batches = [_unpadded_batch(1, 48, repeated=True)]  # the variant: planned on one token
    batches += [_unpadded_batch(seed, 48, repeated=False) for seed in range(2, 9)]
    for batch in batches:
        with StepMemory("cpu", batch) as memory:
            om(*batch).backward()
        plain(*batch).backward()
        for mine, theirs in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(mine.grad, theirs.grad)
        peaks.append(memory.peak_bytes / budget)
        measured.append(om.stats.measured_peak_bytes is not None)
    assert om.cache_info()["variants"] == 1
    assert peaks[0] <= 1 and peaks[1] > 1 and not measured[1]  # over, unmeasured
    assert peaks[2] > 1 and measured[2]  # the check
    assert max(peaks[3:]) <= 1  # planned again on a profile of the blocks' input


_FAILING = [False]


class _Raising(torch.autograd.Function):
    """tanh, whose backward raises while ``_FAILING[0]``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.tanh(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _FAILING[0]:
            raise FloatingPointError("non-finite gradient: step skipped")
        (x,) = ctx.saved_tensors
        return grad * (1 - torch.tanh(x) ** 2)


class _Act(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Raising.apply(x)


def test_a_checked_keep_all_step_whose_backward_raises_leaves_nothing_on(monkeypatch) -> None:
    # The check's compiler stance, process-wide, stayed force_eager after a backward that
    # raised inside the chain: every compiled function then ran eagerly (a review).
    monkeypatch.setattr(outgrown, "CHECKED_EVERY", 1, raising=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(m for _ in range(4) for m in (torch.nn.Linear(32, 32), _Act())))
    x = torch.randn(64, 32)
    om = offremat.optimize(model, x, budget=1.0)
    for step in range(4):
        _FAILING[0] = step % 2 == 1
        loss = om(x).square().mean()
        if _FAILING[0]:
            with pytest.raises(FloatingPointError):
                loss.backward()
        else:
            loss.backward()
            assert om.stats.measured_peak_bytes is not None
        assert not _get_current_dispatch_mode_stack()
        assert torch._dynamo.eval_frame._stance.stance == "default"
    _FAILING[0] = False


@pytest.mark.parametrize("kept_at", [{1, 3, 5, 7}, {1, 6}], ids=["every-step", "some-steps"])
def test_a_keep_all_plan_whose_backward_keeps_its_graph_is_not_made_again(
    kept_at: set[int], monkeypatch, caplog
) -> None:
    # Checked, found over and made again as a plan that recomputes, it refused the caller's
    # retain_graph=True at the next step: a training loop that ran stopped (a review). Such
    # a step is not checked; the plan's other checks go on, and one over is said (one such
    # step stopped the checks for good, and the Mixtral ran over unsaid, a review).
    monkeypatch.setattr(outgrown, "CHECKED_EVERY", 2, raising=False)
    model, example, batch = _mixtral()
    plain = copy.deepcopy(model)
    om = offremat.optimize(model, example, budget=1.0, solver="dp")
    for p in (*model.parameters(), *plain.parameters()):
        p.grad = torch.zeros_like(p)
    with caplog.at_level(logging.WARNING, logger="offremat"):
        for index in range(8):
            for step in (om, plain):
                loss = step(**batch).loss
                if index in kept_at:
                    loss.backward(retain_graph=True)
                loss.backward()  # through the graph kept, if it was
            for mine, theirs in zip(model.parameters(), plain.parameters(), strict=True):
                assert torch.equal(mine.grad, theirs.grad)
    assert om.plan.ops == keep_all(om.chain).ops
    assert caplog.text.count("kept its graph through its backward") == 1
    checked_without = any(i % 2 == 1 and i not in kept_at for i in range(8))
    assert ("is not planned again" in caplog.text) == checked_without
