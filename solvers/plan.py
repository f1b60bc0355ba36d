"""The solution: an ordered list of operations over a chain (``offremat.plan/1``).

Compute operations follow rotor's persistent model (Herrmann, Beaumont et al. 2019); copy
operations add POFO's offloading (Beaumont, Eyraud-Dubois, Shilova 2021). The exact meaning of
each operation, including when it allocates and releases memory, is specified in
``docs/plan-format.md``; :func:`validate` checks the ordering rules and
:func:`solvers.simulator.simulate` the timing and memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from solvers.chain import Chain

PLAN_FORMAT = "offremat.plan/1"

F_ALL, F_CK, F_NONE, BACKWARD = "F_all", "F_ck", "F_none", "B"
OFFLOAD, PREFETCH, FREE = "offload", "prefetch", "free"
COMPUTE_KINDS = (F_ALL, F_CK, F_NONE, BACKWARD)
FORWARD_KINDS = (F_ALL, F_CK, F_NONE)
COPY_KINDS = (OFFLOAD, PREFETCH)
MEMORY_KINDS = (OFFLOAD, PREFETCH, FREE)

ACTIVATION, SAVED = "activation", "saved"
Target = Literal["activation", "saved"]
Decision = Literal["keep", "recompute", "offload"]


class PlanError(ValueError):
    """A plan breaks the rules of ``offremat.plan/1``; ``problems`` lists every broken rule."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid plan:\n  " + "\n  ".join(problems))


@dataclass(frozen=True)
class Op:
    """One operation. Compute ops name a stage; memory ops name a tensor: a_i or x̄_i."""

    kind: str
    index: int
    target: Target | None = None

    def __post_init__(self) -> None:
        if self.kind in COMPUTE_KINDS:
            if self.target is not None:
                raise ValueError(f"{self.kind} takes a stage index, not a target")
        elif self.kind in MEMORY_KINDS:
            if self.target not in (ACTIVATION, SAVED):
                raise ValueError(f"{self.kind} needs target 'activation' or 'saved'")
        else:
            raise ValueError(f"unknown operation kind {self.kind!r}")

    @property
    def is_compute(self) -> bool:
        """Whether the op runs on the compute stream (a forward or a backward)."""
        return self.kind in COMPUTE_KINDS

    @property
    def tensor(self) -> tuple[str, int]:
        """The (target, index) a memory op moves or frees."""
        assert self.target is not None
        return (self.target, self.index)

    def __str__(self) -> str:
        if self.is_compute:
            return f"{self.kind}({self.index})"
        name = f"a{self.index}" if self.target == ACTIVATION else f"x̄{self.index}"
        return f"{self.kind}({name})"

    def to_dict(self) -> dict[str, Any]:
        """The op as a JSON object."""
        data: dict[str, Any] = {"op": self.kind, "index": self.index}
        if self.target is not None:
            data["tensor"] = self.target
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Op:
        """Parse one JSON op."""
        return cls(kind=data["op"], index=int(data["index"]), target=data.get("tensor"))


def forward_all(i: int) -> Op:
    """F_all(i): forward of stage i with autograd; x̄_i stays until B(i)."""
    return Op(F_ALL, i)


def forward_checkpoint(i: int) -> Op:
    """F_ck(i): forward without autograd that keeps its input a_{i-1} as a checkpoint."""
    return Op(F_CK, i)


def forward_none(i: int) -> Op:
    """F_none(i): forward without autograd that releases its input a_{i-1}."""
    return Op(F_NONE, i)


def backward(i: int) -> Op:
    """B(i): backward of stage i; turns δ_i into δ_{i-1} and releases x̄_i."""
    return Op(BACKWARD, i)


def offload(target: Target, i: int) -> Op:
    """Copy a_i or x̄_i to pinned host memory; its GPU bytes go once the copy ends."""
    return Op(OFFLOAD, i, target)


def prefetch(target: Target, i: int) -> Op:
    """Copy a_i or x̄_i back from the host; it occupies GPU memory from the copy's start."""
    return Op(PREFETCH, i, target)


def free(target: Target, i: int) -> Op:
    """Release a_i or x̄_i from the GPU when the preceding compute op ends."""
    return Op(FREE, i, target)


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
        """Parse an ``offremat.plan/1`` object (the derived ``decisions`` are ignored)."""
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise ValueError(f"plan: field 'format' must be {PLAN_FORMAT!r}")
        for name in ("stages", "solver", "ops"):
            if name not in data:
                raise ValueError(f"plan: missing field {name!r}")
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
        return cls(
            ops=ops,
            stage_names=tuple(stages),
            solver=str(data["solver"]),
            budget_bytes=budget,
            predicted_time_s=data.get("predicted_time_s"),
            predicted_peak_bytes=data.get("predicted_peak_bytes"),
            chain_name=str(data.get("chain", "")),
            info=_info(data.get("info")),
        )

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan from JSON."""
        return cls.from_dict(json.loads(Path(path).read_text()))


def _info(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"plan: field 'info' must be a JSON object, got {raw!r}")
    return dict(raw)


def validate(plan: Plan | tuple[Op, ...] | list[Op], chain: Chain) -> list[str]:
    """Every rule of ``offremat.plan/1`` that the plan breaks on this chain (empty: valid).

    A plan belongs to the chain whose stages it names, in order: any other chain is refused
    here, the one check that every caller (simulator, executor, CLI, API) goes through.
    """
    if isinstance(plan, Plan) and plan.stage_names != chain.stage_names:
        return [
            f"the plan is for stages {list(plan.stage_names)} but the chain has "
            f"{list(chain.stage_names)}: make the plan from this chain"
        ]
    ops = plan.ops if isinstance(plan, Plan) else tuple(plan)
    problems: list[str] = []
    length = chain.length
    on_gpu: set[tuple[str, int]] = {(ACTIVATION, 0), ("grad", length)}
    on_host: set[tuple[str, int]] = set()
    backward_done: set[int] = set()

    def has_activation(i: int) -> bool:
        return (ACTIVATION, i) in on_gpu or (i >= 1 and (SAVED, i) in on_gpu)

    for n, op in enumerate(ops):
        where = f"op {n} {op}"
        if op.is_compute:
            if not 1 <= op.index <= length:
                problems.append(f"{where}: stage index outside 1..{length}")
                continue
        elif op.target == SAVED and not 1 <= op.index <= length:
            problems.append(f"{where}: saved set index outside 1..{length}")
            continue
        elif op.target == ACTIVATION and not 0 <= op.index <= length:
            problems.append(f"{where}: activation index outside 0..{length}")
            continue
        i = op.index
        if op.kind in FORWARD_KINDS:
            if not has_activation(i - 1):
                problems.append(f"{where}: input a{i - 1} is not resident on the GPU")
            if i in backward_done:
                problems.append(f"{where}: forward of a stage whose backward is already done")
            produced = (SAVED, i) if op.kind == F_ALL else (ACTIVATION, i)
            if produced in on_gpu:
                problems.append(f"{where}: recomputes a tensor that is already resident")
            on_gpu.add(produced)
            if op.kind == F_NONE:
                on_gpu.discard((ACTIVATION, i - 1))
        elif op.kind == BACKWARD:
            if i in backward_done:
                problems.append(f"{where}: backward done twice")
            if (SAVED, i) not in on_gpu:
                problems.append(f"{where}: saved set x̄{i} is not resident (run F_all({i}) first)")
            if ("grad", i) not in on_gpu:
                problems.append(f"{where}: gradient δ{i} is not resident (run B({i + 1}) first)")
            if not has_activation(i - 1):
                problems.append(f"{where}: input a{i - 1} is not resident on the GPU")
            backward_done.add(i)
            on_gpu.discard((SAVED, i))
            on_gpu.discard(("grad", i))
            on_gpu.discard((ACTIVATION, i - 1))
            on_gpu.add(("grad", i - 1))
        elif op.kind == OFFLOAD:
            if op.tensor not in on_gpu:
                problems.append(f"{where}: offload of a tensor that is not resident on the GPU")
            on_gpu.discard(op.tensor)
            on_host.add(op.tensor)
        elif op.kind == PREFETCH:
            if op.tensor not in on_host:
                problems.append(f"{where}: prefetch of a tensor that was never offloaded")
            if op.tensor in on_gpu:
                problems.append(f"{where}: prefetch of a tensor already resident on the GPU")
            on_gpu.add(op.tensor)
        elif op.kind == FREE:
            if op.tensor not in on_gpu:
                problems.append(f"{where}: free of a tensor that is not resident on the GPU")
            on_gpu.discard(op.tensor)
    for i in range(1, length + 1):
        if i not in backward_done:
            problems.append(f"backward B({i}) is missing")
    return problems
