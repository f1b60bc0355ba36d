"""The training methods the demo and the benchmarks compare, and how a step of each is measured.

Each method is a ``ForwardMaker``: from a model, the function a training step calls. The
methods are plain autograd (keep-all), ``torch.utils.checkpoint.checkpoint_sequential``,
``torch.autograd.graph.save_on_cpu(pin_memory=True)`` (CUDA only) and a plan run by
:func:`offremat.optimize`. :func:`train` trains a fresh model with one of them and measures
every step the same way: step time with the clock (CUDA synchronised), the peak independently
of offremat with :class:`offremat.measure.StepMemory`.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from offremat._tensors import storage_bytes
from offremat.measure import StepMemory
from offremat.models import Batch
from offremat.wrapper import optimize
from solvers.baselines import checkpoint_sequential_plan
from solvers.chain import Chain
from solvers.plan import Plan
from solvers.simulator import score

LEARNING_RATE = 0.05
"""The SGD learning rate every method trains with."""


@dataclass(frozen=True)
class Measurement:
    """What training with one method measured."""

    losses: tuple[float, ...]
    step_times_s: tuple[float, ...]
    peak_bytes: int | None

    @property
    def step_time_s(self) -> float:
        """Median forward plus backward time, the first (warm-up) step left out."""
        timed = self.step_times_s[1:] or self.step_times_s
        return statistics.median(timed)


def batch_bytes(batch: Batch) -> int:
    """Bytes of the input a_0, which the budget counts (what it reaches of its storages, as
    profiled)."""
    return storage_bytes(batch)


# What ``train`` takes as ``make_forward``: from the model, the function a step calls.
ForwardMaker = Callable[[nn.Module], Callable[[Batch], torch.Tensor]]


def plain_forward(model: nn.Module) -> Callable[[Batch], torch.Tensor]:
    """Plain autograd (keep-all): the model itself."""
    return model


def save_on_cpu_forward(model: nn.Module) -> Callable[[Batch], torch.Tensor]:
    """The model under ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` (CUDA only)."""

    def forward(batch: Batch) -> torch.Tensor:
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return model(batch)

    return forward


def checkpoint_sequential_forward(segments: int) -> ForwardMaker:
    """``torch.utils.checkpoint.checkpoint_sequential`` with ``segments`` segments."""

    def make(model: nn.Module) -> Callable[[Batch], torch.Tensor]:
        return lambda batch: checkpoint_sequential(model, segments, batch, use_reentrant=False)

    return make


def optimized_forward(example: Batch, chain: Chain, plan: Plan) -> ForwardMaker:
    """The model wrapped by :func:`offremat.optimize` to run ``plan`` (no profiling, no solve)."""
    return lambda model: optimize(model, example, chain=chain, plan=plan)


def train(
    build: Callable[[], nn.Module],
    make_forward: ForwardMaker,
    batches: Sequence[Batch],
    seed: int,
) -> Measurement:
    """Train a fresh model with one method for ``len(batches)`` SGD steps; measure each step.

    ``make_forward(model)`` returns the function that maps a batch to the loss. The peak is
    measured as the module notes say: on CPU the tracker slows the step it watches, so it
    watches only the untimed warm-up step.
    """
    model = build()
    forward = make_forward(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    # Gradients exist before the first measured step, so they are never counted as activations.
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    torch.manual_seed(seed)
    if cuda:
        torch.cuda.manual_seed_all(seed)
    losses, times, peaks = [], [], []
    for number, batch in enumerate(batches):
        optimizer.zero_grad(set_to_none=False)
        measured = cuda or number == 0
        memory = StepMemory(device, batch)
        if cuda:
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        with memory if measured else contextlib.nullcontext():
            loss = forward(batch)
            loss.backward()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
        if measured:
            peaks.append(memory.peak_bytes)
        losses.append(loss.item())
        optimizer.step()
    return Measurement(tuple(losses), tuple(times), max(peaks))


def best_checkpoint_sequential(chain: Chain, budget: int) -> Plan | None:
    """The ``checkpoint_sequential`` segment count whose simulated plan is fastest within
    ``budget``, as a scored plan (``info["segments"]``); None if no count fits."""
    best = None
    for segments in range(1, chain.length + 1):
        plan = score(checkpoint_sequential_plan(chain, segments), chain, budget)
        if plan.feasible and (best is None or plan.predicted_time_s < best.predicted_time_s):
            best = plan
    return best
