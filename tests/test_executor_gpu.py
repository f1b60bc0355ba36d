"""The executor on CUDA: copies on their own streams overlap compute, without host syncs, and
the allocator's real peak respects the plan's budget. Run with ``pytest -m gpu``."""

from __future__ import annotations

import copy
import statistics

import pytest
import torch
from torch import nn

import offremat
from offremat.executor import PlanExecutor
from offremat.models import GPTConfig, build_gpt, gpt_batch
from solvers.baselines import keep_all, offload_all
from solvers.plan import OFFLOAD, SAVED
from solvers.registry import keep_all_peak
from solvers.simulator import score

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CONFIG = GPTConfig(layers=6, hidden=256, heads=4, seq=256, vocab=1024, dropout=0.1)


def gpt_on_cuda(seed: int = 0) -> tuple[nn.Sequential, tuple[torch.Tensor, torch.Tensor]]:
    return build_gpt(CONFIG, seed).cuda(), gpt_batch(CONFIG, 8, device="cuda")


def step(module: nn.Module, inputs) -> None:
    torch.manual_seed(0)
    torch.cuda.manual_seed(0)
    module(inputs).backward()


@pytest.mark.parametrize("solver", ["keep-all", "dp", "offload-all", "checkpoint-every-stage"])
def test_gradients_match_plain_autograd(solver: str) -> None:
    reference, inputs = gpt_on_cuda()
    model = copy.deepcopy(reference)
    step(reference, inputs)
    om = offremat.optimize(model, inputs, budget=0.5 if solver == "dp" else 1.0, solver=solver)
    step(om, inputs)
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad)


def test_steady_state_steps_never_synchronize_the_host() -> None:
    model, inputs = gpt_on_cuda()
    om = offremat.optimize(model, inputs, budget=1.0, solver="offload-all")
    step(om, inputs)  # the first step allocates the pinned buffers
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            om(inputs).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert om.stats.step_time_s > 0


def test_the_allocator_peak_respects_the_budget() -> None:
    model, inputs = gpt_on_cuda()
    for budget, solver in ((0.5, "dp"), (1.0, "offload-all")):
        om = offremat.optimize(model, inputs, budget=budget, solver=solver, measure_memory=True)
        step(om, inputs)  # gradients exist from now on, as in a training loop
        model.zero_grad(set_to_none=False)
        step(om, inputs)
        stats = om.stats
        assert stats.bookkept_peak_bytes <= om.plan.budget_bytes
        # The allocator also sees the caller's loss and its own 512-byte rounding.
        assert stats.measured_peak_bytes <= 1.1 * om.plan.budget_bytes


def test_offload_copies_overlap_compute() -> None:
    torch.manual_seed(0)
    width, depth = 4096, 8
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)]
    ).cuda()
    x = torch.randn(8192, width, device="cuda")
    chain = offremat.profile_model(model, x)
    assert chain.link is not None
    keep = PlanExecutor(list(model), score(keep_all(chain), chain, keep_all_peak(chain)), chain)
    offload = PlanExecutor(list(model), score(offload_all(chain), chain, None), chain)
    times = {}
    for name, executor in (("keep", keep), ("offload", offload)):
        readings = []
        for _ in range(5):
            executor(x).sum().backward()
            readings.append(executor.stats.step_time_s)
        times[name] = statistics.median(readings[1:])
    moved = sum(
        chain.saved_bytes(op.index)
        for op in offload.plan.ops
        if op.kind == OFFLOAD and op.target == SAVED
    )
    copy_time = moved / chain.link.d2h_bytes_per_s + moved / chain.link.h2d_bytes_per_s
    assert copy_time > 0.1 * times["keep"], "the copies are too small to show overlap"
    assert times["offload"] < times["keep"] + copy_time
