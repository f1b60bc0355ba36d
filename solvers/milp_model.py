"""The joint keep / offload / recompute MILP on a chain: variables and constraints.

A time-indexed formulation in the spirit of Checkmate (Jain et al., "Checkmate: breaking the
memory wall with optimal tensor rematerialization", 2020), specialised to a chain and to rotor's
persistent memory model (Herrmann, Beaumont et al. 2019) with POFO's two copy channels (Beaumont,
Eyraud-Dubois, Shilova 2021). ``docs/milp.md`` states every variable and constraint; the names
below follow it. Its solutions are schedules of :mod:`solvers.milp_codec`.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulp

from solvers.chain import Chain
from solvers.milp_codec import (
    DROP_ACTIVATION,
    KEEP_ACTIVATION,
    KEEP_SAVED,
    OFFLOAD_ACTIVATION,
    OFFLOAD_SAVED,
    Schedule,
    Tensor,
    valid_at,
)
from solvers.milp_constraints import Constraints
from solvers.plan import ACTIVATION, SAVED

# The first-pass fates that copy to the host.
COPY_FATES = (OFFLOAD_SAVED, OFFLOAD_ACTIVATION)


@dataclass(frozen=True)
class ModelSize:
    """How big one MILP instance is."""

    binaries: int
    continuous: int
    constraints: int
    nonzeros: int


def time_unit(chain: Chain, offload: bool) -> float:
    """The MILPs' unit of time: Σf + Σb, unless copying the largest saved set one way takes
    more than :data:`MOST_UNITS` of those (a chain whose compute takes next to no time would
    put copy times of 10²⁰ units before HiGHS, which takes them for infinite)."""
    unit = chain.compute_time_s
    if offload and chain.link is not None:
        largest = max(s.saved_bytes for s in chain.stages)
        slower = min(chain.link.d2h_bytes_per_s, chain.link.h2d_bytes_per_s)
        unit = max(unit, largest / slower / MOST_UNITS)
    return unit if unit > 0 else 1.0


MOST_UNITS = 1e6
"""The most units of time one copy may take in the MILPs (see :func:`time_unit`)."""


class JointModel(Constraints):
    """The MILP for one chain and budget, built with PuLP; see ``docs/milp.md``.

    Memory is counted in units of the largest saved set and time in :func:`time_unit`, which
    keeps the coefficients near 1 for the solver. With ``budget_bytes=None`` the budget is a
    variable and the objective is the least peak (used to find the least feasible budget).
    ``time_cap_s`` bounds the makespan (a cut-off, and the big-M of the timing constraints).
    """

    def __init__(
        self,
        chain: Chain,
        budget_bytes: int | None,
        offload: bool,
        time_cap_s: float | None = None,
    ):
        if offload and chain.link is None:
            raise ValueError("offloading needs a chain with a link")
        self.chain = chain
        self.length = length = chain.length
        self.problem = pulp.LpProblem("offremat_joint", pulp.LpMinimize)
        self.memory_unit = float(max(max(s.saved_bytes for s in chain.stages), 1))
        self.time_unit = time_unit(chain, offload)
        self._structural: list[pulp.LpVariable] = []
        self._all_binaries: list[pulp.LpVariable] = []
        self._places: dict[str, tuple[int, int | None]] = {}
        self._copy_binaries: set[str] = set()
        self.x = [chain.activation_bytes(j) / self.memory_unit for j in range(length + 1)]
        self.grad = [chain.grad_bytes(j) / self.memory_unit for j in range(length + 1)]
        self.held = chain.held_bytes / self.memory_unit
        self.saved = [0.0] + [s.saved_bytes / self.memory_unit for s in chain.stages]
        self.fwd_tmp = [0.0] + [s.fwd_tmp_bytes / self.memory_unit for s in chain.stages]
        self.nograd_fwd_tmp = [0.0] + [
            s.nograd_fwd_tmp_bytes / self.memory_unit for s in chain.stages
        ]
        self.bwd_tmp = [0.0] + [s.bwd_tmp_bytes / self.memory_unit for s in chain.stages]
        self.fwd = [0.0] + [s.fwd_s / self.time_unit for s in chain.stages]
        self.refill = [0.0] + [s.refill_s / self.time_unit for s in chain.stages]
        self.bwd = [0.0] + [s.bwd_s / self.time_unit for s in chain.stages]
        if offload:
            self.d2h = self.memory_unit / chain.link.d2h_bytes_per_s / self.time_unit
            self.h2d = self.memory_unit / chain.link.h2d_bytes_per_s / self.time_unit
        else:
            self.d2h = self.h2d = 0.0
        self.offloadable = list(range(1, length - 1)) if offload else []
        if budget_bytes is None:
            self.budget: pulp.LpVariable | float = self._continuous("budget", 0)
        else:
            self.budget = budget_bytes / self.memory_unit
        if time_cap_s is None:
            # Slow enough for any plan of the family that does not idle on purpose.
            recompute_all = sum(self.fwd[i] * i for i in range(1, length + 1))
            copies = (sum(self.saved) + sum(self.x)) * (self.d2h + self.h2d)
            self.horizon = 1.0 + recompute_all + copies
        else:
            self.horizon = time_cap_s / self.time_unit
        self.big_time = self.horizon + sum(self.saved) * (self.d2h + self.h2d) + 1.0

        self._first_pass_variables()
        self._step_variables()
        self._prefetch_variables()
        self._step_constraints()
        self._timing()
        self._device_to_host()
        self._host_to_device()
        self._memory()
        if budget_bytes is None:
            self.problem += self.budget
        else:
            self.problem += self.makespan
            if time_cap_s is not None:
                self._add(self.makespan <= self.horizon, "time_cap")

    # ------------------------------------------------------------------ variables
    def _first_pass_variables(self) -> None:
        length = self.length
        self.fate: dict[int, dict[str, pulp.LpVariable]] = {}
        for i in range(1, length):
            names = [KEEP_SAVED, KEEP_ACTIVATION]
            if i <= length - 2:
                # a_{L-1} must stay for B(L), which runs right after F(L).
                names.append(DROP_ACTIVATION)
                if i in self.offloadable:
                    names += [OFFLOAD_SAVED, OFFLOAD_ACTIVATION]
            self.fate[i] = {
                name: self._binary(f"fate_{name}_{i}", i, None, copying=name in COPY_FATES)
                for name in names
            }
            self._add(pulp.lpSum(self.fate[i].values()) == 1, f"one_fate_{i}")
            if i >= 2 and DROP_ACTIVATION in self.fate[i - 1]:
                # Rotor's persistence: the input of F_all(i) is not dropped while x̄_i is on the
                # GPU (autograd would keep it alive); it may go to the host.
                self._add(
                    self.fate[i][KEEP_SAVED] + self.fate[i - 1][DROP_ACTIVATION] <= 1,
                    f"input_stays_{i}",
                )

    def _fate(self, i: int, name: str) -> pulp.LpVariable | float:
        if i == self.length:
            return 1.0 if name == KEEP_SAVED else 0.0
        return self.fate[i].get(name, 0.0)

    def _product_bytes(self, i: int, temporary: bool = False) -> pulp.LpAffineExpression:
        """Bytes of what F(i) leaves in the first pass: x̄_i or a_i (with its temporary)."""
        fate = self._fate
        as_saved = fate(i, KEEP_SAVED) + fate(i, OFFLOAD_SAVED)
        as_activation = (
            fate(i, KEEP_ACTIVATION) + fate(i, OFFLOAD_ACTIVATION) + fate(i, DROP_ACTIVATION)
        )
        saved, activation = self.saved[i], self.x[i]
        if temporary:
            saved, activation = saved + self.fwd_tmp[i], activation + self.nograd_fwd_tmp[i]
        return saved * as_saved + activation * as_activation

    def _kept_bytes(self, i: int) -> pulp.LpAffineExpression:
        return self.saved[i] * self._fate(i, KEEP_SAVED) + self.x[i] * self._fate(
            i, KEEP_ACTIVATION
        )

    def _offloaded_bytes(self, i: int) -> pulp.LpAffineExpression:
        return self.saved[i] * self._fate(i, OFFLOAD_SAVED) + self.x[i] * self._fate(
            i, OFFLOAD_ACTIVATION
        )

    def _step_variables(self) -> None:
        length = self.length
        self.resident: dict[int, dict[Tensor, pulp.LpAffineExpression | pulp.LpVariable]] = {}
        self.recompute: dict[int, dict[Tensor, pulp.LpVariable]] = {}
        self.keep: dict[int, dict[Tensor, pulp.LpVariable]] = {}
        first: dict[Tensor, pulp.LpAffineExpression | pulp.LpVariable] = {}
        for tensor in valid_at(length, length):
            kind, i = tensor
            if i == length:
                first[tensor] = pulp.LpAffineExpression(constant=1.0)
            else:
                name = KEEP_SAVED if kind == SAVED else KEEP_ACTIVATION
                first[tensor] = pulp.LpAffineExpression(self._fate(i, name))
        self.resident[length] = first
        for k in range(length - 1, 0, -1):
            self.resident[k] = {
                t: self._binary(f"resident_{t[0]}_{t[1]}_step{k}", t[1], k)
                for t in valid_at(length, k)
            }
            rec = {
                (SAVED, i): self._binary(f"rec_saved_{i}_step{k}", i, k) for i in range(1, k + 1)
            }
            rec.update(
                {(ACTIVATION, i): self._binary(f"rec_act_{i}_step{k}", i, k) for i in range(1, k)}
            )
            self.recompute[k] = rec
            # x̄_k recomputed right before B(k) refills the graph of a forward that kept only
            # a_k (solvers.semantics.refills): never after a first pass that saved x̄_k, which
            # it would have to recompute whole (and that keeps or copies x̄_k for nothing).
            kept = self._fate(k, KEEP_SAVED) + self._fate(k, OFFLOAD_SAVED)
            self._add(rec[(SAVED, k)] + kept <= 1, f"refill_after_checkpoint_{k}")
            self.keep[k] = {
                t: self._continuous(f"keep_{t[0]}_{t[1]}_step{k}", 0, 1)
                for t in valid_at(length, k - 1)
            }

    def _prefetch_variables(self) -> None:
        length = self.length
        self.issue: dict[Tensor, dict[int, pulp.LpVariable]] = {}
        self.ready: dict[Tensor, dict[int, pulp.LpVariable]] = {}
        self._issued_since: dict[Tensor, dict[int, pulp.LpAffineExpression]] = {}
        self._ready_since: dict[Tensor, dict[int, pulp.LpAffineExpression]] = {}
        for i in self.offloadable:
            for tensor, first_ready in (((SAVED, i), i), ((ACTIVATION, i), i + 1)):
                if first_ready > length - 1:
                    continue
                name = f"{tensor[0]}_{i}"
                self.ready[tensor] = {
                    c: self._binary(f"ready_{name}_step{c}", i, c, copying=True)
                    for c in range(first_ready, length)
                }
                self.issue[tensor] = {
                    s: self._binary(f"issue_{name}_step{s}", i, s, copying=True)
                    for s in range(first_ready + 1, length + 1)
                }
                host = self._fate(i, OFFLOAD_SAVED if tensor[0] == SAVED else OFFLOAD_ACTIVATION)
                issued = pulp.lpSum(self.issue[tensor].values())
                self._add(issued == pulp.lpSum(self.ready[tensor].values()), f"one_ready_{name}")
                self._add(issued <= host, f"prefetch_needs_host_{name}")
                # Running sums from the end, so that "in flight" costs two terms per use.
                self._issued_since[tensor] = self._suffix_sums(f"issued_{name}", self.issue[tensor])
                self._ready_since[tensor] = self._suffix_sums(f"readied_{name}", self.ready[tensor])

    def _suffix_sums(
        self, name: str, variables: dict[int, pulp.LpVariable]
    ) -> dict[int, pulp.LpAffineExpression]:
        """sums[k] = Σ_{s >= k} variables[s] for k = 1..L+1, as chained continuous variables."""
        sums: dict[int, pulp.LpAffineExpression] = {
            self.length + 1: pulp.LpAffineExpression(constant=0.0)
        }
        for k in range(self.length, 0, -1):
            if k > max(variables) or k < min(variables):
                sums[k] = sums[k + 1]
            else:
                total = self._continuous(f"{name}_since{k}", 0, 1)
                self._add(total == sums[k + 1] + variables[k], f"{name}_since{k}")
                sums[k] = pulp.LpAffineExpression(total)
        return sums

    def _in_flight(self, tensor: Tensor, k: int) -> pulp.LpAffineExpression:
        """1 if ``tensor``'s prefetch was listed after an earlier backward and the tensor is
        not usable yet when step k starts."""
        if tensor not in self.issue:
            return pulp.LpAffineExpression()
        return self._issued_since[tensor][k + 1] - self._ready_since[tensor][k]

    # ------------------------------------------------------------------ helpers
    def _size(self, tensor: Tensor) -> float:
        return self.saved[tensor[1]] if tensor[0] == SAVED else self.x[tensor[1]]

    def _binary(
        self,
        name: str,
        stage: int,
        step: int | None,
        decision: bool = True,
        copying: bool = False,
    ) -> pulp.LpVariable:
        """A binary about ``stage`` in ``step`` (None: the first pass). A decision is one a
        :class:`Schedule` records; the others (releases, late prefetches) follow from the
        times. ``copying``: the binary is about a copy, and is 0 in every plan that only
        recomputes."""
        var = self.problem.add_variable(name, cat=pulp.LpBinary)
        if copying:
            self._copy_binaries.add(var.name)
        self._places[var.name] = (stage, step)
        self._all_binaries.append(var)
        if decision:
            self._structural.append(var)
        return var

    def _continuous(
        self, name: str, low: float | None = None, high: float | None = None
    ) -> pulp.LpVariable:
        return self.problem.add_variable(name, lowBound=low, upBound=high)

    def _add(self, constraint: pulp.LpConstraint, name: str) -> None:
        self.problem += constraint, name

    # ------------------------------------------------------------------ reading and writing
    @property
    def size(self) -> ModelSize:
        """Counts of variables, constraints and nonzeros."""
        variables = self.problem.variables()
        binaries = sum(1 for v in variables if v.cat == pulp.LpInteger)
        constraints = self.problem.constraints()
        return ModelSize(
            binaries=binaries,
            continuous=len(variables) - binaries,
            constraints=len(constraints),
            nonzeros=sum(len(c) for c in constraints),
        )

    def schedule_values(self, schedule: Schedule) -> dict[str, float]:
        """The values of the structural binaries that describe ``schedule``."""
        values: dict[str, float] = {}
        for i, names in self.fate.items():
            for name, var in names.items():
                values[var.name] = float(schedule.fates[i - 1] == name)
        for k, rec in self.recompute.items():
            for (target, i), var in rec.items():
                values[var.name] = float((k, i, target) in schedule.recompute)
        for k, state in self.resident.items():
            for tensor, var in state.items():
                if isinstance(var, pulp.LpVariable):
                    values[var.name] = float(schedule.is_resident(k, tensor))
        for tensor, steps in self.issue.items():
            issue, ready = schedule.prefetches.get(tensor, (0, 0))
            for s, var in steps.items():
                values[var.name] = float(s == issue)
            for c, var in self.ready[tensor].items():
                values[var.name] = float(c == ready)
        return values

    def structural_variables(self) -> list[pulp.LpVariable]:
        """The binaries :meth:`schedule_values` sets: all but the release indicators."""
        return list(self._structural)

    def binaries(self) -> list[pulp.LpVariable]:
        """Every binary, decisions first."""
        decisions = set(v.name for v in self._structural)
        return list(self._structural) + [v for v in self._all_binaries if v.name not in decisions]

    def copies(self, var: pulp.LpVariable) -> bool:
        """Whether ``var`` is about a copy (an offloading fate, a prefetch, a late prefetch)."""
        return var.name in self._copy_binaries

    def place(self, var: pulp.LpVariable) -> tuple[int, int | None]:
        """The stage a binary is about and the step (or first-pass forward) it belongs to,
        which the neighbourhood search uses to pick windows."""
        return self._places[var.name]

    def read_schedule(self) -> Schedule:
        """The schedule of the solution the solver left in the variables."""

        def on(var: object) -> bool:
            if isinstance(var, pulp.LpAffineExpression):
                return (var.value() or 0.0) > 0.5
            return isinstance(var, pulp.LpVariable) and (var.varValue or 0.0) > 0.5

        fates = [
            next((name for name, var in self.fate[i].items() if on(var)), KEEP_SAVED)
            for i in range(1, self.length)
        ]
        fates.append(KEEP_SAVED)
        recompute = frozenset(
            (k, i, target)
            for k, rec in self.recompute.items()
            for (target, i), var in rec.items()
            if on(var)
        )
        resident = frozenset(
            (k, tensor[0], tensor[1])
            for k, state in self.resident.items()
            for tensor, var in state.items()
            if on(var)
        )
        prefetches = {}
        for tensor, steps in self.issue.items():
            issue = next((s for s, var in steps.items() if on(var)), None)
            ready = next((c for c, var in self.ready[tensor].items() if on(var)), None)
            if issue is not None and ready is not None:
                prefetches[tensor] = (issue, ready)
        late = frozenset(
            tensor for tensor, steps in self.late.items() if any(on(var) for var in steps.values())
        )
        return Schedule(
            length=self.length,
            fates=tuple(fates),
            recompute=recompute,
            resident=resident,
            prefetches=prefetches,
            late=late,
        )

    def objective_s(self) -> float | None:
        """The makespan of the current solution in seconds (None if there is none)."""
        value = self.makespan.varValue
        return None if value is None else value * self.time_unit

    def least_budget_bytes(self) -> float | None:
        """The budget of the current solution, in bytes, when the model minimizes the peak."""
        if isinstance(self.budget, pulp.LpVariable):
            value = self.budget.varValue
            return None if value is None else value * self.memory_unit
        return self.budget * self.memory_unit
