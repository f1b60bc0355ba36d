"""How ``optimize`` gets its plans: the example batch's, from the disk cache or made, and the
rules by which each new input shape gets one (:mod:`offremat._shapes`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from offremat._call_checks import (
    refuse_disabled_saved_tensor_hooks,
    refuse_mutation_of_saved_tensors,
)
from offremat._plan_cache import PlanCache
from offremat._shapes import ShapePlans
from offremat._signatures import input_signature
from offremat.profiler import parse_bandwidth
from solvers.budget import InfeasibleBudgetError, format_bytes, parse_budget
from solvers.chain import Chain
from solvers.plan import Plan, copies
from solvers.registry import check_request, keep_all_peak, solve
from solvers.simulator import score

logger = logging.getLogger(__name__)


@contextmanager
def in_training_mode(model: nn.Module | Sequence[nn.Module]) -> Iterator[None]:
    """Run the inside with ``model`` in training mode where it is in eval mode, then give every
    module its own flag back.

    Dropout saves masks in training mode only: a model optimized in eval mode (as Hugging
    Face's ``from_pretrained`` returns it) and then trained would run a plan made for a
    smaller step. (A step in eval mode gets plans of its own, see ``_shapes``.)
    """
    roots = [model] if isinstance(model, nn.Module) else list(model)
    evaluating = [root for root in roots if not root.training]
    flags = [(module, module.training) for root in evaluating for module in root.modules()]
    if evaluating:
        logger.info("the model is in eval mode: profiled in training mode, as it trains")
    try:
        for root in evaluating:
            root.train()
        yield
    finally:
        for module, flag in flags:
            module.training = flag


@dataclass(frozen=True)
class Request:
    """What ``optimize`` was asked for besides the model and its batch."""

    budget: int | float | str | None
    solver: str
    bandwidth: Any
    stages: int | None
    chain: Chain | None
    plan: Plan | str | Path | None
    measure_memory: bool
    solver_options: dict[str, Any]
    disk: PlanCache | None

    def __post_init__(self) -> None:
        # Checked here, the first thing optimize builds: before any profiling.
        refuse_disabled_saved_tensor_hooks("offremat.optimize is called")
        refuse_mutation_of_saved_tensors("offremat.optimize is called")
        _refuse_wrong_type("chain", self.chain, Chain, "a path to a chain file (str or Path)")
        _refuse_wrong_type("plan", self.plan, Plan, "a path to a plan file (str or Path)")
        check_request(self.solver, self.solver_options)  # a misspelt option: before profiling

    def example_plan(
        self,
        example: Any,
        profile: Callable[[], Chain],
        stages_of: Callable[[Chain], object],
    ) -> tuple[Chain, Plan]:
        """The example batch's chain and plan: from the disk cache, else made and stored.
        ``stages_of`` gives the model's stages for a chain, and refuses one it cannot."""
        signature = repr(input_signature(example))
        check = functools.partial(self._check_cached, stages_of)
        cached = None if self.disk is None else self.disk.load(signature, check)
        if cached is not None:
            return cached
        if self.chain is None:
            chain = profile()
        else:
            chain = _given_chain(self.chain, self.stages, self.bandwidth)
        plan = _plan(chain, self.budget, self.solver, self.plan, self.solver_options)
        if self.disk is not None:
            self.disk.store(signature, chain, plan)
        return chain, plan

    def _check_cached(self, stages_of: Callable[[Chain], object], chain: Chain, plan: Plan) -> None:
        """Refuse a cached entry this request does not make: a chain of other stages, a plan
        for another budget (files are edited; the key says only what was asked)."""
        stages_of(chain)
        if self.budget is not None:
            asked = parse_budget(self.budget, keep_all_peak(chain))
            if plan.budget_bytes != asked:
                raise ValueError(
                    f"its plan's budget is {plan.budget_bytes} B where {asked} B is asked for"
                )

    def plans(
        self,
        modules: Sequence[nn.Module],
        example: Any,
        chain: Chain,
        plan: Plan,
        profile_shape: Callable[[Any], Chain],
        profile_blocks: Callable[[Chain, Any], Chain] | None = None,
        model: nn.Module | None = None,
    ) -> ShapePlans:
        """The plans by input shape, starting with the example's; ``profile_blocks`` profiles
        the blocks of ``model`` on another kind of chain input (ShapePlans.for_chain_input),
        whose state, code around the blocks included, the plans are made for."""
        solve_shape = _solver_for(plan, self.solver, self.solver_options)
        plans = ShapePlans(
            modules,
            profile_shape,
            solve_shape,
            self.measure_memory,
            self.disk,
            _quick_for(plan, self.solver, self.solver_options),
            profile_blocks,
            model,
        )
        # Only the example's plan can have been read from disk by now.
        from_disk = 0 if self.disk is None else self.disk.loaded
        # A given chain was not profiled here either (one profiled in eval mode measured
        # 1.06-1.08x its budget): its first step is measured, as a disk cache's is, and its
        # shape profiled and planned again where it passes the budget.
        unprofiled = bool(from_disk) or self.chain is not None
        plans.add(example, chain, plan, from_disk=unprofiled)
        plans.cache.from_disk = from_disk
        return plans


def _refuse_wrong_type(name: str, given: Any, kind: type, or_else: str) -> None:
    """Refuse a ``chain=`` or ``plan=`` of a type optimize does not take, saying what to pass
    (it failed on its first attribute)."""
    if given is None or isinstance(given, (kind, str, Path)):
        return
    text = repr(given)
    shown = text if len(text) <= 60 else text[:57] + "..."
    hint = (
        f"; a dict read from such a file's JSON is {kind.__qualname__}.from_dict(d)"
        if isinstance(given, dict)
        else ""
    )
    raise TypeError(
        f"{name}= takes a {kind.__module__}.{kind.__qualname__} or {or_else}, got "
        f"{type(given).__name__} {shown}{hint}"
    )


# A new input shape is profiled once, quickly: its sizes are exact, its times rough.
QUICK = {"warmup": 0, "repeats": 1}


def link_of(chain: Chain) -> tuple[float, float] | None:
    link = chain.link
    return None if link is None else (link.d2h_bytes_per_s, link.h2d_bytes_per_s)


def same_stages(first: Chain, chain: Chain) -> Chain:
    """``chain`` (profiled over ``first``'s stages) under ``first``'s name and grouping."""
    metadata = {**chain.metadata, "grouping": first.metadata.get("grouping")}
    if "blocks" in first.metadata:
        metadata["blocks"] = first.metadata["blocks"]
    return dataclasses.replace(chain, name=first.name, metadata=metadata)


def _solver_for(plan: Plan, solver: str, solver_options: dict[str, Any]) -> Callable[[Chain], Plan]:
    """How a new input shape gets its plan: solved at the first plan's budget, in bytes."""
    if plan.budget_bytes is None:
        return functools.partial(_scored, plan)
    return functools.partial(_solved, plan.budget_bytes, solver, solver_options)


def _quick_for(
    plan: Plan, solver: str, solver_options: dict[str, Any]
) -> Callable[[Chain], Plan] | None:
    """The MILP takes seconds, so a new shape's first step runs on the DP's plan (at the same
    ``slots``) and the MILP's replaces it at the next one; other solvers are quick already."""
    if solver != "milp" or plan.budget_bytes is None:
        return None
    options = {"slots": solver_options.get("slots")}
    return functools.partial(_solved, plan.budget_bytes, "dp", options)


# Module-level functions rather than closures, so that an optimized model pickles.
def _scored(plan: Plan, chain: Chain) -> Plan:
    return score(plan, chain, None)


def _solved(budget: int, solver: str, options: dict[str, Any], chain: Chain) -> Plan:
    return solve(chain, budget, solver, **options)


def _given_chain(chain: Chain, stages: int | None, bandwidth: Any) -> Chain:
    if stages is not None and stages != chain.length:
        raise ValueError(
            f"stages={stages} but the given chain has {chain.length} stages: drop stages= "
            "or profile again with it"
        )
    if bandwidth is not None:
        chain = chain.with_link(parse_bandwidth(bandwidth))
    return chain


AROUND_SHARE = 0.25
"""The share of the least feasible budget that the code around a model's chain must hold for
a refusal to say so."""


def _say_what_is_around(chain: Chain, least_bytes: int | None) -> None:
    """Where no plan fits a model's chain and the code around it holds much of the least
    budget, say what: a U-Net planned on its decoder alone was refused at 82% of keep-all,
    the encoder, outside the chain, unsaid (the trial)."""
    if "outside" not in chain.metadata or not least_bytes:
        return
    around = chain.input_bytes + chain.held_bytes
    if around < AROUND_SHARE * least_bytes:
        return
    logger.warning(
        "no plan fits: of the least budget, %s, the code around the chain (%s to %s, %d "
        "stages) holds %s, which no plan recomputes or offloads: the batch and what the code "
        "before the blocks keeps for its backward (%s), and what the code after them holds "
        "(%s). If other modules of the model repeat too (an encoder beside a decoder), name "
        "them with blocks=, or make the code around the blocks part of them",
        format_bytes(least_bytes),
        chain.stage_names[0],
        chain.stage_names[-1],
        chain.length,
        format_bytes(around),
        format_bytes(chain.input_bytes),
        format_bytes(chain.held_bytes),
    )


def _plan(
    chain: Chain,
    budget: int | float | str | None,
    solver: str,
    plan: Plan | str | Path | None,
    solver_options: dict[str, Any],
) -> Plan:
    """The plan to follow: solved at ``budget``, or ``plan`` scored at it."""
    if isinstance(plan, (str, Path)):
        plan = Plan.load(plan)
    if plan is None:
        if budget is None:
            raise ValueError(
                "pass budget= (bytes, a size such as '6GiB', or a fraction of the keep-all "
                "peak such as 0.5), or a plan="
            )
        try:
            plan = solve(
                chain, parse_budget(budget, keep_all_peak(chain)), solver, **solver_options
            )
        except InfeasibleBudgetError as error:
            _say_what_is_around(chain, error.min_budget_bytes)
            raise
    else:
        # Nothing is solved for this input, but a new input shape is solved with them.
        check_request(solver, solver_options)
        if chain.link is None and copies(plan.ops):
            raise ValueError(
                "the given plan offloads, and the chain has no link to time its copies: pass "
                "optimize the bandwidth it was solved with (bandwidth='12GB/s', say), or a "
                "chain= that has a 'link'"
            )
        budget_bytes = (
            plan.budget_bytes if budget is None else parse_budget(budget, keep_all_peak(chain))
        )
        plan = score(plan, chain, budget_bytes)
        if budget_bytes is not None and not plan.feasible:
            raise ValueError(
                f"the given plan's simulated peak on this chain, "
                f"{format_bytes(plan.predicted_peak_bytes or 0)}, exceeds its budget "
                f"{format_bytes(budget_bytes)} (a plan made for a smaller input or another "
                f"model?): omit plan= to solve for this budget, or pass a budget of at least "
                f"{plan.predicted_peak_bytes} bytes to run this plan as it is"
            )
    logger.info(
        "%s plan: predicted step %.4g s, peak %s of %s",
        plan.solver,
        plan.predicted_time_s,
        format_bytes(plan.predicted_peak_bytes or 0),
        "no budget" if plan.budget_bytes is None else format_bytes(plan.budget_bytes),
    )
    return plan
