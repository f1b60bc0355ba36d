"""The control of ``experiments/overhead_cpu.py``: a dp plan run by torch's checkpoint.

It separates a plan's cost from the executor's only if it runs the same computation: the same
stages recomputed, the same gradients as plain autograd, and no control for a plan that
``torch.utils.checkpoint`` cannot run as it is.
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import offremat
from offremat.models import GPTConfig, build_gpt, gpt_batch
from solvers.baselines import checkpoint_every_stage, checkpoint_sequential_plan, offload_all
from solvers.chain import Link
from solvers.ops import backward, forward_all, forward_checkpoint, forward_none
from solvers.plan import Plan
from solvers.registry import keep_all_peak, solve
from solvers.simulator import score

SCRIPT = Path(__file__).parent.parent / "experiments" / "overhead_cpu.py"
CONFIG = GPTConfig(layers=4, hidden=16, heads=2, seq=8, vocab=32, dropout=0.1)


def _script():
    spec = importlib.util.spec_from_file_location("overhead_cpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _grads(model: torch.nn.Module, step, batch) -> list[torch.Tensor]:
    for parameter in model.parameters():
        parameter.grad = None
    torch.manual_seed(1)
    step(batch).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("segments", [None, 3], ids=["dp", "runs-of-two-stages"])
def test_the_control_recomputes_the_plans_stages_and_matches_plain_autograd(
    segments: int | None,
) -> None:
    script = _script()
    model, batch = build_gpt(CONFIG, seed=0), gpt_batch(CONFIG, 2, seed=0)
    chain = offremat.profile_model(model, batch, warmup=0, repeats=1)
    if segments is None:
        plan = solve(chain, int(0.5 * keep_all_peak(chain)), "dp")
    else:
        plan = score(checkpoint_sequential_plan(chain, segments), chain, None)
    runs = script.checkpointed_runs(plan)
    assert runs  # these plans recompute runs of stages, each once
    recomputed = [i for first, last in runs for i in range(first, last + 1)]
    plain = copy.deepcopy(model)
    expected = _grads(plain, plain, batch)
    # The stages' own forward calls, counted from outside: the control runs every stage the
    # executor runs, as often.
    calls: list[int] = []
    for index, stage in enumerate(model, 1):
        stage.register_forward_pre_hook(lambda *_, index=index: calls.append(index))
    # After the hooks: hooks added to a stage later make the next step plan again.
    executor = offremat.optimize(model, batch, chain=chain, plan=plan)
    calls.clear()
    control = _grads(model, script.run_checkpoint(model, runs), batch)
    by_control = sorted(calls)
    calls.clear()
    _grads(model, executor, batch)
    assert by_control == sorted(calls)
    assert by_control == sorted([*range(1, chain.length + 1), *recomputed])
    assert all(torch.equal(a, b) for a, b in zip(control, expected, strict=True))


def test_the_runs_of_a_plan_and_no_control_for_plans_that_checkpoint_cannot_run() -> None:
    script = _script()
    model, batch = build_gpt(CONFIG, seed=0), gpt_batch(CONFIG, 2, seed=0)
    chain = offremat.profile_model(model, batch, warmup=0, repeats=1)
    linked = replace(chain, link=Link(1e10, 1e10))
    assert script.checkpointed_runs(offload_all(linked)) is None  # offloads
    every = set(range(1, chain.length))
    assert script.checkpointed_runs(checkpoint_every_stage(chain)) == [(i, i) for i in every]
    # Two segments of three stages: the first under one checkpoint, the second kept.
    assert script.checkpointed_runs(checkpoint_sequential_plan(chain, 2)) == [(1, 3)]
    # Stage 1 recomputed twice (rotor's nesting): one checkpoint cannot run that.
    nested = [forward_checkpoint(1), forward_none(2), forward_all(3), backward(3)]
    nested += [forward_checkpoint(1), forward_all(2)]
    nested += [backward(2), forward_all(1), backward(1)]
    names = chain.stage_names[:3]
    assert script.checkpointed_runs(Plan(ops=tuple(nested), stage_names=names, solver="x")) is None
