"""bf16 autocast: the plan is made for what runs, and gradients are plain autograd's."""

from __future__ import annotations

import pytest
import torch

import offremat
from offremat.measure import StepMemory
from offremat.models import GPTConfig, build_gpt, gpt_batch

CONFIG = GPTConfig(layers=4, hidden=64, heads=2, seq=64, vocab=128)


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(("how", "solver"), [("argument", "dp"), ("context", "milp")])
def test_bf16_autocast_plan_matches_measured_and_gradients_equal(how: str, solver: str) -> None:
    batch = gpt_batch(CONFIG, 4)
    plain, ours = build_gpt(CONFIG), build_gpt(CONFIG)
    options = {"time_limit_s": 5} if solver == "milp" else {}
    if how == "argument":
        om = offremat.optimize(
            ours, batch, budget=0.5, solver=solver, autocast=torch.bfloat16, **options
        )
    else:
        with torch.autocast("cpu", torch.bfloat16):
            om = offremat.optimize(ours, batch, budget=0.5, solver=solver, **options)
    assert "recompute" in om.plan.decisions.values()
    for step in range(2):
        step_batch = gpt_batch(CONFIG, 4, seed=step)
        torch.manual_seed(step)  # the same dropout masks in both
        with torch.autocast("cpu", torch.bfloat16):
            plain_loss = plain(step_batch)
        plain_loss.backward()  # outside autocast, as recommended (and as ours)
        torch.manual_seed(step)
        with StepMemory("cpu", inputs=step_batch) as memory:
            if how == "argument":  # the optimized model runs its steps under the autocast
                loss = om(step_batch)
            else:
                with torch.autocast("cpu", torch.bfloat16):
                    loss = om(step_batch)
            loss.backward()
        assert loss.dtype == torch.float32  # the loss is computed in fp32 under autocast
        for a, b in zip(_grads(ours), _grads(plain), strict=True):
            assert torch.equal(a, b)
    predicted = om.plan.predicted_peak_bytes
    assert abs(predicted - memory.peak_bytes) <= 0.1 * memory.peak_bytes, (
        predicted,
        memory.peak_bytes,
    )
    assert memory.peak_bytes <= om.plan.budget_bytes


def test_a_step_under_an_autocast_it_was_not_planned_under_is_refused() -> None:
    """Planned without autocast, a bf16 step saves bf16 copies of the weights it casts, which
    no plan counted (3.3 times the budget on an MLP)."""
    batch = gpt_batch(CONFIG, 2)
    om = offremat.optimize(build_gpt(CONFIG), batch, budget=0.5)
    with (
        torch.autocast("cpu", torch.bfloat16),
        pytest.raises(
            RuntimeError, match="profiled under no autocast but this step runs under autocast"
        ),
    ):
        om(batch).backward()
    # An autocast region that is switched off (autocast(enabled=use_amp)) is no autocast.
    with torch.autocast("cpu", torch.float16, enabled=False):
        om(batch).backward()


def test_a_step_without_the_autocast_it_was_planned_under_is_refused() -> None:
    """Planned under bf16, the fp32 activations of a step without autocast would not fit."""
    batch = gpt_batch(CONFIG, 2)
    with torch.autocast("cpu", torch.bfloat16):
        om = offremat.optimize(build_gpt(CONFIG), batch, budget=0.5)
    with pytest.raises(RuntimeError, match=r"profiled under autocast torch\.bfloat16"):
        om(batch)


def test_a_step_inside_another_autocast_than_the_one_given_to_optimize_is_refused() -> None:
    """The model enters the autocast given to optimize, and inside the caller's the inner one
    wins: a step the caller ran under float16 ran in bfloat16, unsaid (review 38)."""
    batch = gpt_batch(CONFIG, 2)
    om = offremat.optimize(build_gpt(CONFIG), batch, budget=0.5, autocast=torch.bfloat16)
    with (
        torch.autocast("cpu", torch.float16),
        pytest.raises(RuntimeError, match=r"called inside autocast torch\.float16"),
    ):
        om(batch)
    with torch.autocast("cpu", torch.bfloat16):  # the same autocast: as asked
        om(batch).backward()


def test_a_keep_all_plan_under_the_callers_autocast_holds_no_cached_weights() -> None:
    # Run as plain autograd, a keep-all step still turns autocast's weight cache off: with
    # the backward inside the caller's autocast region, cached bf16 weight copies would be
    # memory that no plan counts.
    torch.manual_seed(0)
    width = 512
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(6)])
    x = torch.randn(64, width)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        om = offremat.optimize(model, x, budget=1.0)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    for _ in range(2):
        with StepMemory("cpu", inputs=x) as memory, torch.autocast("cpu", dtype=torch.bfloat16):
            om(x).float().pow(2).mean().backward()
    assert om.plan.decisions == dict.fromkeys(om.plan.decisions, "keep")
    assert memory.peak_bytes <= om.plan.budget_bytes


def test_a_shape_profiled_under_the_callers_autocast_counts_no_cached_weights(caplog) -> None:
    """A new shape planned in a step inside the caller's autocast region profiled its stages
    with autocast's weight cache on: each block's bf16 weight copies were taken for
    activations the block keeps, warned of and counted as resident for the whole step."""
    from dataclasses import replace

    torch.manual_seed(0)
    model = build_gpt(CONFIG)
    with torch.autocast("cpu", torch.bfloat16):
        om = offremat.optimize(model, gpt_batch(CONFIG, 4), budget=0.5)
    shorter = gpt_batch(replace(CONFIG, seq=32), 4)
    with torch.autocast("cpu", torch.bfloat16), caplog.at_level("WARNING", logger="offremat"):
        loss = om(shorter)
    loss.backward()
    assert om.cache_info()["misses"] == 1
    assert om.chain.metadata["kept_by_modules_bytes"] == 0
    assert "of its activations after its backward" not in caplog.text
