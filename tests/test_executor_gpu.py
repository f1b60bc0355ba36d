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
from solvers.registry import keep_all_peak, min_feasible_budget
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
    # A GPU faster than Python would be idle at the end anyway: queue a long kernel first, so
    # that the stream is still busy unless a step waited for it.
    torch.cuda._sleep(2_000_000_000)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            om(inputs).backward()
        # Syncs torch does not flag (an event's synchronize, say) would leave the GPU idle
        # here: with none, the host is ahead and the stream still has work queued.
        assert not torch.cuda.current_stream().query()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert om.stats.step_time_s > 0


def test_offload_all_at_its_least_budget_is_within_it_measured_by_the_allocator() -> None:
    model, inputs = gpt_on_cuda()
    chain = offremat.profile_model(model, inputs)
    tightest = min_feasible_budget(chain, "offload-all")
    assert tightest < keep_all_peak(chain)  # an executor that never frees would not fit
    om = offremat.optimize(
        model, inputs, chain=chain, budget=tightest, solver="offload-all", measure_memory=True
    )
    step(om, inputs)  # gradients exist from now on, as in a training loop
    model.zero_grad(set_to_none=False)
    step(om, inputs)
    stats = om.stats
    predicted = om.plan.predicted_peak_bytes
    assert stats.reserved_peak_bytes is not None
    # The chain was profiled by the same allocator (its rounding included): no slack above.
    assert 0.9 * predicted <= stats.measured_peak_bytes <= tightest


def _offload_and_keep_times(monkeypatch: pytest.MonkeyPatch | None) -> tuple[float, float, float]:
    """Median step times of keep-all and offload-all on a wide MLP, and the total copy time.

    With ``monkeypatch``, the copies are forced onto the compute stream (the negative control).
    """
    if monkeypatch is not None:
        from offremat import _memory

        def same_stream(self, device):
            self.device = device
            self.compute = torch.cuda.current_stream(device)
            self.d2h = self.h2d = self.compute

        monkeypatch.setattr(_memory.CudaStreams, "__init__", same_stream)
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
    return times["keep"], times["offload"], copy_time


def test_offload_copies_overlap_compute() -> None:
    keep, offload, copy_time = _offload_and_keep_times(None)
    assert offload < keep + 0.25 * copy_time


def test_copies_on_the_compute_stream_do_not_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: the overlap test above fails when nothing overlaps."""
    keep, offload, copy_time = _offload_and_keep_times(monkeypatch)
    assert offload >= keep + 0.25 * copy_time
