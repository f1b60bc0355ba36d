"""The solution: an ordered list of operations over a chain (``offremat.plan/1``).

Compute operations follow rotor's persistent model (Herrmann, Beaumont et al. 2019); copy
operations add POFO's offloading (Beaumont, Eyraud-Dubois, Shilova 2021). The exact meaning of
each operation, including when it allocates and releases memory, is specified in
``docs/plan-format.md``; :func:`validate` checks the ordering rules and
:func:`solvers.simulator.simulate` the timing and memory.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from solvers import semantics
from solvers.chain import Chain
from solvers.chain_limits import LARGEST_BYTES, shown_number
from solvers.json_text import check_fields, non_finite_at, parse_json
from solvers.ops import (
    ACTIVATION,
    BACKWARD,
    COMPUTE_KINDS,
    COPY_KINDS,
    F_ALL,
    F_CK,
    F_NONE,
    FORWARD_KINDS,
    FREE,
    MEMORY_KINDS,
    OFFLOAD,
    PREFETCH,
    SAVED,
    Decision,
    Op,
    Target,
    backward,
    forward_all,
    forward_checkpoint,
    forward_none,
    free,
    offload,
    prefetch,
)

# The op vocabulary is part of the format: it is imported from here throughout.
__all__ = [
    "ACTIVATION",
    "BACKWARD",
    "COMPUTE_KINDS",
    "COPY_KINDS",
    "FORWARD_KINDS",
    "FREE",
    "F_ALL",
    "F_CK",
    "F_NONE",
    "MEMORY_KINDS",
    "OFFLOAD",
    "PLAN_FORMAT",
    "PREFETCH",
    "SAVED",
    "Decision",
    "Op",
    "Plan",
    "PlanError",
    "Target",
    "backward",
    "forward_all",
    "forward_checkpoint",
    "forward_none",
    "free",
    "offload",
    "prefetch",
    "validate",
]

PLAN_FORMAT = "offremat.plan/1"
_PLAN_FIELDS = {
    "format",
    "chain",
    "stages",
    "solver",
    "budget_bytes",
    "predicted_time_s",
    "predicted_peak_bytes",
    "decisions",
    "ops",
    "info",
}


class PlanError(ValueError):
    """A plan breaks the rules of ``offremat.plan/1``; ``problems`` lists every broken rule."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid plan:\n  " + "\n  ".join(problems))


# The entries of ``Plan.info`` that are times of the plan's schedule (a solver's objective,
# its proven bound, the DP's table value), as opposed to settings (``time_limit_s``).
PLAN_TIME_INFO = ("objective", "best_bound", "milp_plan_time_s", "dp_time_s", "fastest_s")


def copies(ops: Sequence[Op]) -> bool:
    """Whether the plan's ``ops`` move a tensor between the device and the host: timing them
    needs the chain's link."""
    return any(op.kind in (OFFLOAD, PREFETCH) for op in ops)


def relative_gap(objective: float, bound: float) -> float:
    """A solver's relative gap, (objective − bound) ÷ objective, as MILP solvers report it."""
    return max(0.0, (objective - bound) / objective) if objective > 0 else 0.0


@dataclass(frozen=True)
class Plan:
    """A schedule for one training step, with the figures the simulator predicts for it."""

    ops: tuple[Op, ...]
    stage_names: tuple[str, ...]
    solver: str
    budget_bytes: int | None = None
    predicted_time_s: float | None = None
    predicted_peak_bytes: int | None = None
    chain_name: str = ""
    info: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def length(self) -> int:
        """The number of stages of the chain the plan was made for."""
        return len(self.stage_names)

    @property
    def feasible(self) -> bool:
        """Whether the simulated peak is within the budget (unknown figures: False)."""
        return (
            self.budget_bytes is not None
            and self.predicted_peak_bytes is not None
            and self.predicted_peak_bytes <= self.budget_bytes
        )

    @property
    def decisions(self) -> dict[str, Decision]:
        """Per stage, what happens to its saved set x̄_i between its forward and backward.

        ``offload`` if x̄_i is copied to the host at some point; otherwise ``recompute`` if
        the x̄_i that B(i) consumes was produced after the first backward began; else ``keep``.
        """
        offloaded = {op.index for op in self.ops if op.kind == OFFLOAD and op.target == SAVED}
        first_backward = next(
            (n for n, op in enumerate(self.ops) if op.kind == BACKWARD), len(self.ops)
        )
        last_all: dict[int, int] = {}
        result: dict[str, Decision] = {}
        for position, op in enumerate(self.ops):
            if op.kind == F_ALL:
                last_all[op.index] = position
            elif op.kind == BACKWARD:
                i = op.index
                if i in offloaded:
                    decision: Decision = "offload"
                elif last_all.get(i, -1) > first_backward:
                    decision = "recompute"
                else:
                    decision = "keep"
                result[self.stage_names[i - 1]] = decision
        return {name: result[name] for name in self.stage_names if name in result}

    def to_dict(self) -> dict[str, Any]:
        """The ``offremat.plan/1`` JSON object."""
        return {
            "format": PLAN_FORMAT,
            "chain": self.chain_name,
            "stages": list(self.stage_names),
            "solver": self.solver,
            "budget_bytes": self.budget_bytes,
            "predicted_time_s": self.predicted_time_s,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "decisions": self.decisions,
            "ops": [op.to_dict() for op in self.ops],
            "info": self.info,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Parse an ``offremat.plan/1`` object; ``decisions``, derived from ``ops``, must agree
        with them where given."""
        if not isinstance(data, dict):
            raise ValueError("plan: the top level must be a JSON object")
        check_fields(data, ("format", "stages", "solver", "ops"), _PLAN_FIELDS, "plan")
        if data["format"] != PLAN_FORMAT:
            raise ValueError(f"plan: field 'format' must be {PLAN_FORMAT!r}")
        if not isinstance(data["ops"], list):
            raise ValueError("plan: field 'ops' must be a list")
        try:
            ops = tuple(Op.from_dict(raw) for raw in data["ops"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"plan: malformed field 'ops' ({error})") from None
        stages = data["stages"]
        if not isinstance(stages, list) or not all(isinstance(name, str) for name in stages):
            raise ValueError("plan: field 'stages' must be a list of stage names")
        budget = data.get("budget_bytes")
        if isinstance(budget, float) and budget.is_integer():
            budget = int(budget)
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0
        ):
            raise ValueError(
                f"plan: field 'budget_bytes' must be a positive integer or null, got {budget!r}"
            )
        if budget is not None and budget > LARGEST_BYTES:
            raise ValueError(
                f"plan: field 'budget_bytes' is {shown_number(budget)} bytes, more than any "
                f"device holds (at most {LARGEST_BYTES})"
            )
        for name, kind in (("solver", str), ("chain", str)):
            if name in data and not isinstance(data[name], kind):
                raise ValueError(f"plan: field {name!r} must be a string, got {data[name]!r}")
        for name, kind in (("predicted_time_s", "number"), ("predicted_peak_bytes", "integer")):
            value = data.get(name)
            if value is not None and not _non_negative(value, integral=kind == "integer"):
                shown = shown_number(value) if _is_number(value) else repr(value)
                raise ValueError(
                    f"plan: field {name!r} must be a finite non-negative {kind} or null, "
                    f"got {shown}"
                )
        beyond = max((op.index for op in ops), default=0)
        if beyond > len(stages):
            raise ValueError(
                f"plan: field 'stages' names {len(stages)} stages, but 'ops' run stage {beyond}"
            )
        plan = cls(
            ops=ops,
            stage_names=tuple(stages),
            solver=data["solver"],
            budget_bytes=budget,
            predicted_time_s=data.get("predicted_time_s"),
            predicted_peak_bytes=data.get("predicted_peak_bytes"),
            chain_name=data.get("chain", ""),
            info=_info(data.get("info")),
        )
        if "decisions" in data:
            _check_decisions(data["decisions"], plan)
        return plan

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan from JSON."""
        return cls.from_dict(parse_json(Path(path).read_text(), "plan"))


def _check_decisions(written: Any, plan: Plan) -> None:
    """Refuse ``decisions`` that are not what the plan's ops make (a typo, ops edited)."""
    if not isinstance(written, dict):
        raise ValueError(f"plan: field 'decisions' must be an object, got {written!r}")
    derived = plan.decisions
    for stage, decision in written.items():
        if stage not in derived:
            raise ValueError(f"plan: field 'decisions' names stage {stage!r}, not in 'stages'")
        if decision != derived[stage]:
            raise ValueError(
                f"plan: field 'decisions' says stage {stage!r} is {decision!r}, but the plan's "
                f"'ops' make it {derived[stage]!r}: decisions are derived from the ops, so "
                "correct the field or leave it out"
            )
    missing = derived.keys() - written.keys()
    if missing:
        raise ValueError(f"plan: field 'decisions' leaves out stage {sorted(missing)[0]!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _non_negative(value: Any, integral: bool) -> bool:
    """Whether ``value`` is a finite number of at least 0 (a whole one if ``integral``) within
    a float's range (a plan's peak may pass any one tensor's largest size)."""
    if not _is_number(value):
        return False
    try:
        if not math.isfinite(value) or value < 0:
            return False
    except OverflowError:  # an int past a float's range
        return False
    return not integral or float(value).is_integer()


def _info(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"plan: field 'info' must be a JSON object, got {raw!r}")
    where = non_finite_at(raw, "info")
    if where is not None:
        raise ValueError(f"plan: {where} is NaN or infinite, which JSON does not have")
    return dict(raw)


def validate(plan: Plan | tuple[Op, ...] | list[Op], chain: Chain) -> list[str]:
    """Every rule of ``offremat.plan/1`` that the plan breaks on this chain (empty: valid).

    What each op needs is :func:`solvers.semantics.effect`; the ordering rules (each backward
    once, none for a frozen stage, no forward after its stage's backward, no recomputation of
    what is resident) are checked here. A plan belongs to the chain whose stages it names, in
    order: any other chain is refused here, the one check that every caller (simulator,
    executor, CLI, API) goes through.
    """
    if isinstance(plan, Plan) and plan.stage_names != chain.stage_names:
        return [
            f"the plan is for stages {list(plan.stage_names)} but the chain has "
            f"{list(chain.stage_names)}: make the plan from this chain"
        ]
    ops = plan.ops if isinstance(plan, Plan) else tuple(plan)
    problems: list[str] = []
    length = chain.length
    on_gpu = semantics.initial_residency(length)
    on_host: set[tuple[str, int]] = set()
    backward_done: set[int] = set()
    dead: set[tuple[str, int]] = set()  # read by no later op, their host copies dropped too
    for n, op in enumerate(ops):
        where = f"op {n} {op}"
        outside = _index_problem(op, length)
        if outside:
            problems.append(f"{where}: {outside}")
            continue
        i, change = op.index, semantics.effect(op)
        if change.reads_input and semantics.stage_input(i, on_gpu) is None:
            problems.append(f"{where}: input a{i - 1} is not resident on the GPU")
        problems += [
            f"{where}: {_missing(op, tensor)}" for tensor in change.reads if tensor not in on_gpu
        ]
        if op.kind in FORWARD_KINDS:
            if i in backward_done:
                problems.append(f"{where}: forward of a stage whose backward is already done")
            if change.allocates in on_gpu:
                problems.append(f"{where}: recomputes a tensor that is already resident")
        elif op.kind == BACKWARD:
            if i in backward_done:
                problems.append(f"{where}: backward done twice")
            if i <= chain.frozen_stages:
                problems.append(
                    f"{where}: stage {i} is frozen (the chain's first {chain.frozen_stages} "
                    "stages need no backward)"
                )
            backward_done.add(i)
        elif change.from_host is not None:
            reader = semantics.last_reader(change.from_host)
            if reader <= chain.frozen_stages:
                problems.append(
                    f"{where}: prefetch of a tensor no backward reads (B({reader}) "
                    "is not run for a frozen stage)"
                )
            elif change.from_host in dead:
                problems.append(
                    f"{where}: prefetch of a tensor no later op reads (its backward is done)"
                )
            elif change.from_host not in on_host:
                problems.append(f"{where}: prefetch of a tensor that was never offloaded")
            if change.from_host in on_gpu:
                problems.append(f"{where}: prefetch of a tensor already resident on the GPU")
        if change.to_host is not None:
            on_host.add(change.to_host)
        semantics.apply(on_gpu, op)
        dead.discard(change.allocates)
        for tensor in change.dead:
            dead.add(tensor)
            on_host.discard(tensor)
    for i in range(chain.frozen_stages + 1, length + 1):
        if i not in backward_done:
            problems.append(f"backward B({i}) is missing")
    return problems


def _index_problem(op: Op, length: int) -> str | None:
    if op.is_compute and not 1 <= op.index <= length:
        return f"stage index outside 1..{length}"
    if op.target == SAVED and not 1 <= op.index <= length:
        return f"saved set index outside 1..{length}"
    if op.target == ACTIVATION and not 0 <= op.index <= length:
        return f"activation index outside 0..{length}"
    if op.target == ACTIVATION and op.index == 0:
        # The caller holds its input: no step can move or free it.
        return "a0 is the caller's input and stays on the GPU for the whole step"
    if op.target is not None and op.index == length:
        # The caller holds the output, and through it the graph that saved x̄_L, from the
        # end of the forward: freeing or moving them would release nothing.
        name = f"a{length}" if op.target == ACTIVATION else f"x̄{length}"
        return f"{name} holds the step's output, which the caller holds until B({length})"
    return None


def _missing(op: Op, tensor: tuple[str, int]) -> str:
    """Why ``op`` cannot run: ``tensor`` is not on the GPU (the message names what to run)."""
    kind, i = tensor
    if op.kind == BACKWARD and kind == SAVED:
        return f"saved set x̄{i} is not resident (run F_all({i}) first)"
    if op.kind == BACKWARD:
        return f"gradient δ{i} is not resident (run B({i + 1}) first)"
    return f"{op.kind} of a tensor that is not resident on the GPU"
