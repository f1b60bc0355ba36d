"""``offremat.optimize``: profile, plan and wrap a model so its training step fits a budget.

The module is not called ``optimize``: importing a submodule binds its name on the package,
which would hide the function ``offremat.optimize``.

Design note: the returned :class:`OptimizedModule` *is* the model as far as ``nn.Module`` can
tell. It shares the model's parameter, buffer and child dictionaries, so ``state_dict()`` has
the model's keys (a checkpoint saved from either loads into the other), ``parameters()`` yields
the same tensors, and ``to()``, ``train()`` and ``eval()`` act on the model itself. Only
``forward`` differs, and only when a gradient is wanted: under ``eval()`` or ``no_grad`` it
runs the model as it is.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offremat._blocks import chain_blocks
from offremat._tensors import flatten
from offremat.executor import PlanExecutor, StepStats
from offremat.profiler import (
    check_chain_output,
    check_device,
    parse_bandwidth,
    profile_model,
    stage_modules,
)
from solvers.budget import format_bytes, parse_budget
from solvers.chain import Chain
from solvers.plan import Plan
from solvers.registry import check_count, keep_all_peak, solve
from solvers.simulator import score

logger = logging.getLogger(__name__)


class OptimizedModule(nn.Module):
    """A model whose training step follows a plan; otherwise the model itself."""

    def __init__(
        self,
        model: nn.Sequential,
        stages: Sequence[nn.Module],
        chain: Chain,
        plan: Plan,
        measure_memory: bool = False,
    ):
        super().__init__()
        for name in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
            object.__setattr__(self, name, getattr(model, name))
        object.__setattr__(self, "_model", model)
        executor = PlanExecutor(stages, plan, chain, measure_memory=measure_memory)
        object.__setattr__(self, "_executor", executor)

    @property
    def model(self) -> nn.Sequential:
        """The wrapped model, run as it is under ``eval()`` or ``no_grad``."""
        return self._model

    @property
    def plan(self) -> Plan:
        """The plan every training step follows, with its budget and predicted figures."""
        return self._executor.plan

    @property
    def chain(self) -> Chain:
        """The chain the plan was made for."""
        return self._executor.chain

    @property
    def stats(self) -> StepStats | None:
        """What the last training step measured (None before the first one)."""
        return self._executor.stats

    def release_host_memory(self) -> None:
        """Give back the host buffers kept for offloads between steps."""
        self._executor.release_host_memory()

    @property  # type: ignore[override]
    def training(self) -> bool:
        """The model's own training flag: one flag, whichever of the two was switched."""
        model = self.__dict__.get("_model")
        return True if model is None else model.training

    @training.setter
    def training(self, mode: bool) -> None:
        model = self.__dict__.get("_model")
        if model is not None:  # nn.Module.__init__ sets it before the model is bound
            model.training = mode

    def forward(self, value: Any) -> Any:
        """The model's output; with a gradient wanted, the step follows :attr:`plan`."""
        if not self.training or not torch.is_grad_enabled():
            return self._model(value)
        tensors, _ = flatten(value)
        if tensors:
            check_device(list(self._model), tensors[0].device)
        return self._executor(value)

    def extra_repr(self) -> str:
        plan = self.plan
        budget = "none" if plan.budget_bytes is None else format_bytes(plan.budget_bytes)
        return f"plan={plan.solver}, budget={budget}, stages={plan.length}"


def optimize(
    model: nn.Module | Sequence[nn.Module],
    example_input: Any,
    budget: int | float | str | None = None,
    solver: str = "dp",
    bandwidth: Any = None,
    stages: int | None = None,
    chain: Chain | str | Path | None = None,
    plan: Plan | str | Path | None = None,
    measure_memory: bool = False,
    **solver_options: Any,
) -> OptimizedModule:
    """Wrap ``model`` so that its training step keeps, offloads or recomputes activations.

    ``model`` is an ``nn.Sequential`` or a list of blocks; ``example_input`` is what its
    forward takes, on the device it trains on. ``budget`` is bytes, a size (``"6GiB"``) or a
    fraction in (0, 1] of the keep-all peak. ``solver`` is any of
    :data:`solvers.registry.SOLVERS`, with ``solver_options`` passed on (``slots``,
    ``time_limit_s``...). ``bandwidth`` (bytes/s, ``"25GB/s"`` or a (d2h, h2d) pair) replaces
    the link, so offloading plans can be made on a machine without one. A ``chain`` skips
    profiling (``stages`` groups blocks when profiling); a ``plan`` skips solving and is
    scored at ``budget`` (default: its own). The chain's output on ``example_input`` must be
    the model's own (:func:`offremat.profiler.check_chain_output`). With ``measure_memory``,
    every step's activation peak is measured independently (``stats.measured_peak_bytes``; on
    CUDA this resets the process-wide peak statistics, on CPU it slows the step). Raises
    :class:`solvers.budget.InfeasibleBudgetError` when no plan fits.
    """
    if stages is not None:
        check_count("stages", stages)
    blocks = chain_blocks(model)
    sequential = model if isinstance(model, nn.Sequential) else nn.Sequential(OrderedDict(blocks))
    tensors, _ = flatten(example_input)
    if not tensors:
        raise TypeError("the example input holds no tensor; pass what the model's forward takes")
    check_device([module for _, module in blocks], tensors[0].device)
    if isinstance(chain, (str, Path)):
        chain = Chain.load(chain)
    if chain is None:
        chain = profile_model(sequential, example_input, stages=stages, bandwidth=bandwidth)
    else:
        if stages is not None and stages != chain.length:
            raise ValueError(
                f"stages={stages} but the given chain has {chain.length} stages: drop stages= "
                "or profile again with it"
            )
        if bandwidth is not None:
            chain = chain.with_link(parse_bandwidth(bandwidth))
    modules = stage_modules(sequential, chain)
    if isinstance(model, nn.Module):
        check_chain_output(model, modules, example_input)
    if isinstance(plan, (str, Path)):
        plan = Plan.load(plan)
    if plan is None:
        if budget is None:
            raise ValueError(
                "pass budget= (bytes, a size such as '6GiB', or a fraction of the keep-all "
                "peak such as 0.5), or a plan="
            )
        plan = solve(chain, parse_budget(budget, keep_all_peak(chain)), solver, **solver_options)
    else:
        if solver_options:
            logger.warning(
                "plan= is given, so nothing is solved and the solver options %s are ignored",
                ", ".join(sorted(solver_options)),
            )
        budget_bytes = (
            plan.budget_bytes if budget is None else parse_budget(budget, keep_all_peak(chain))
        )
        plan = score(plan, chain, budget_bytes)
        if budget_bytes is not None and not plan.feasible:
            logger.warning(
                "the plan's simulated peak %s exceeds its budget %s",
                format_bytes(plan.predicted_peak_bytes or 0),
                format_bytes(budget_bytes),
            )
    logger.info(
        "%s plan: predicted step %.4g s, peak %s of %s",
        plan.solver,
        plan.predicted_time_s,
        format_bytes(plan.predicted_peak_bytes or 0),
        "no budget" if plan.budget_bytes is None else format_bytes(plan.budget_bytes),
    )
    return OptimizedModule(sequential, modules, chain, plan, measure_memory=measure_memory)
