"""The joint keep / offload / recompute MILP on a chain: variables, constraints and decoding.

A time-indexed formulation in the spirit of Checkmate (Jain et al., "Checkmate: breaking the
memory wall with optimal tensor rematerialization", 2020), specialised to a chain and to rotor's
persistent memory model (Herrmann, Beaumont et al. 2019) with POFO's two copy channels (Beaumont,
Eyraud-Dubois, Shilova 2021). ``docs/milp.md`` states every variable and constraint; the names
below follow it.

The timeline is cut into positions that mirror how :func:`solvers.simulator.simulate` replays a
plan: the L forwards of the first pass, then one step per backward, step k holding the forwards
recomputed for B(k) and B(k) itself. A plan in this family is described by a
:class:`Schedule`, which :func:`decode` turns into operations and :func:`encode` reads back
from operations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pulp

from solvers.chain import Chain
from solvers.plan import (
    ACTIVATION,
    BACKWARD,
    F_ALL,
    FORWARD_KINDS,
    OFFLOAD,
    PREFETCH,
    SAVED,
    Op,
    backward,
    forward_all,
    forward_checkpoint,
    forward_none,
    free,
    offload,
    prefetch,
)
from solvers.semantics import GRAD, apply, effect, input_holders

Tensor = tuple[str, int]

# What the first forward pass does with the output of each stage.
KEEP_SAVED, OFFLOAD_SAVED = "keep_saved", "offload_saved"
KEEP_ACTIVATION, OFFLOAD_ACTIVATION, DROP_ACTIVATION = "keep_act", "offload_act", "drop_act"
SAVED_FATES = (KEEP_SAVED, OFFLOAD_SAVED)
OFFLOAD_FATES = (OFFLOAD_SAVED, OFFLOAD_ACTIVATION)


class NotInFamilyError(ValueError):
    """A plan that the MILP's schedule family cannot express (so it cannot warm-start it)."""


@dataclass(frozen=True)
class Schedule:
    """The integer part of a MILP solution: which forwards run where and what lives where.

    ``fates[i - 1]`` is what the first pass does with stage i's output. ``recompute`` holds
    (k, i, target): in step k, F(i) is recomputed producing x̄_i (``saved``) or a_i
    (``activation``). ``resident`` holds (k, target, j): the tensor is usable on the GPU when
    step k starts. ``prefetches`` maps a tensor to (issue step, ready step): its prefetch is
    issued when B(issue) starts and it is usable from the start of step ``ready``; those in
    ``late`` are expected to wait for B(issue) to end before their bytes fit.
    """

    length: int
    fates: tuple[str, ...]
    recompute: frozenset[tuple[int, int, str]]
    resident: frozenset[tuple[int, str, int]]
    prefetches: dict[Tensor, tuple[int, int]] = field(default_factory=dict)
    late: frozenset[Tensor] = frozenset()

    def is_resident(self, k: int, tensor: Tensor) -> bool:
        """Whether ``tensor`` is usable on the GPU at the start of step k."""
        if tensor == (ACTIVATION, 0):
            return True
        return (k, tensor[0], tensor[1]) in self.resident

    def carried(self, k: int, tensor: Tensor) -> bool:
        """Whether ``tensor`` stays on the GPU from step k into step k-1 (not a prefetch)."""
        if k <= 1:
            return False
        arriving = self.prefetches.get(tensor, (0, 0))[1] == k - 1
        return self.is_resident(k - 1, tensor) and not arriving


def _valid_at(length: int, k: int) -> list[Tensor]:
    """The tensors that can matter at the start of step k (a_0 excluded: always resident)."""
    return [(ACTIVATION, j) for j in range(1, k)] + [(SAVED, i) for i in range(1, k + 1)]


def decode(schedule: Schedule) -> list[Op]:
    """The plan operations of a schedule, ordered so the simulator replays what the MILP models.

    Forward pass: the offload of stage i's output is listed after F(i+1), so it is issued when
    F(i) ends and F(i+1) still reads a_i. Step k: recomputed forwards in stage order, B(k), then
    the frees of what step k-1 does not keep, then the prefetches issued at B(k) in the order
    they are needed. An input a_{i-1} that nothing needs after F(i) is dropped by F(i) itself
    (F_none) or freed right after it.
    """
    length = schedule.length
    ops: list[Op] = []
    fates = schedule.fates

    def product(i: int) -> Tensor:
        return (SAVED, i) if i == length or fates[i - 1] in SAVED_FATES else (ACTIVATION, i)

    for q in range(1, length + 1):
        previous_dropped = q >= 2 and fates[q - 2] == DROP_ACTIVATION
        if product(q)[0] == SAVED:
            ops.append(forward_all(q))
            if previous_dropped:
                ops.append(free(ACTIVATION, q - 1))
        else:
            ops.append(forward_none(q) if previous_dropped else forward_checkpoint(q))
        if q >= 2 and fates[q - 2] in OFFLOAD_FATES:
            ops.append(offload(product(q - 1)[0], q - 1))

    for k in range(length, 0, -1):
        on_gpu = {t for t in _valid_at(length, k) if schedule.is_resident(k, t)}
        on_gpu.add((ACTIVATION, 0))
        recomputed = {i for kk, i, _ in schedule.recompute if kk == k}
        for i, target in sorted((i, t) for kk, i, t in schedule.recompute if kk == k):
            source = (ACTIVATION, i - 1) if (ACTIVATION, i - 1) in on_gpu else None
            needed_later = i == k or schedule.carried(k, (ACTIVATION, i - 1))
            drop_input = source is not None and not needed_later and i - 1 >= 1
            # The model counts an output only while this step still reads it, unless it is
            # kept; a saved set nothing keeps is cheaper as a plain activation.
            read_later = i == k - 1 or (i < k and i + 1 in recomputed)
            if (
                target == SAVED
                and i != k
                and not schedule.carried(k, (SAVED, i))
                and (ACTIVATION, i) not in on_gpu
            ):
                target = ACTIVATION
            if target == SAVED:
                ops.append(forward_all(i))
                if drop_input:
                    ops.append(free(ACTIVATION, i - 1))
            else:
                ops.append(forward_none(i) if drop_input else forward_checkpoint(i))
            if drop_input:
                on_gpu.discard((ACTIVATION, i - 1))
            output = (target, i)
            if i == k or read_later or schedule.carried(k, output):
                on_gpu.add(output)
            else:
                ops.append(free(*output))
        ops.append(backward(k))
        on_gpu -= {(SAVED, k), (ACTIVATION, k - 1)}
        for tensor in sorted(on_gpu - {(ACTIVATION, 0)}, key=lambda t: (t[1], t[0])):
            if not schedule.carried(k, tensor):
                ops.append(free(*tensor))
        issued = [
            (ready, tensor) for tensor, (issue, ready) in schedule.prefetches.items() if issue == k
        ]
        # Early ones first: a late one waits for memory, and the channel is FIFO.
        for _, tensor in sorted(
            issued,
            key=lambda item: (item[1] in schedule.late, -item[0], item[1][1], item[1][0]),
        ):
            ops.append(prefetch(*tensor))
    return ops


def encode(ops: list[Op] | tuple[Op, ...], length: int) -> Schedule:
    """The schedule a plan follows, if it is in the MILP's family; else NotInFamilyError.

    The family: one forward pass F(1..L) with each output kept, dropped or offloaded (the
    offload listed right after the next forward), then per backward step recomputed forwards
    and B(k), with each offloaded tensor prefetched at most once, right after a B. Frees may
    sit anywhere. A prefetched tensor counts as usable from the first step that reads it.
    """
    ops = list(ops)
    first_backward = next((n for n, op in enumerate(ops) if op.kind == BACKWARD), None)
    if first_backward is None:
        raise NotInFamilyError("the plan has no backward")
    forward_ops = [op for op in ops[:first_backward] if op.kind in FORWARD_KINDS]
    if [op.index for op in forward_ops] != list(range(1, length + 1)):
        raise NotInFamilyError("the first pass is not F(1), ..., F(L) once each")
    if forward_ops[-1].kind != F_ALL:
        raise NotInFamilyError("the first pass does not end with F_all(L)")
    on_gpu: set[Tensor] = {(ACTIVATION, 0)}
    offloaded: set[Tensor] = set()
    compute_seen = 0
    for op in ops[:first_backward]:
        if op.is_compute:
            compute_seen += 1
        elif op.kind == OFFLOAD:
            # The copy of stage i's output must be listed right after F(i+1).
            if compute_seen != op.index + 1 or not 1 <= op.index <= length - 2:
                raise NotInFamilyError(f"{op} is not listed right after F({op.index + 1})")
            offloaded.add(op.tensor)
        elif op.kind == PREFETCH:
            raise NotInFamilyError("a prefetch before the first backward")
        _apply(on_gpu, op)
    fates = []
    for i in range(1, length):
        if forward_ops[i - 1].kind == F_ALL:
            fate = OFFLOAD_SAVED if (SAVED, i) in offloaded else KEEP_SAVED
            if fate == KEEP_SAVED and (SAVED, i) not in on_gpu:
                raise NotInFamilyError(f"x̄{i} is freed during the first pass")
        elif (ACTIVATION, i) in offloaded:
            fate = OFFLOAD_ACTIVATION
        else:
            fate = KEEP_ACTIVATION if (ACTIVATION, i) in on_gpu else DROP_ACTIVATION
        fates.append(fate)
    fates.append(KEEP_SAVED)

    # Pass 1: steps of issue and of first read of every prefetch.
    issued_at: dict[Tensor, int] = {}
    ready_at: dict[Tensor, int] = {}
    step = length
    for n in range(first_backward, len(ops)):
        op = ops[n]
        if op.kind == BACKWARD:
            if op.index != step:
                raise NotInFamilyError(f"{op} where B({step}) was expected")
            step -= 1
        elif op.kind in FORWARD_KINDS and (step == length or op.index > step):
            raise NotInFamilyError(f"{op} recomputed in the step of B({step})")
        elif op.kind == OFFLOAD:
            raise NotInFamilyError(f"{op} after the first pass")
        elif op.kind == PREFETCH:
            previous_compute = next(o for o in reversed(ops[:n]) if o.is_compute)
            if previous_compute.kind != BACKWARD:
                raise NotInFamilyError(f"{op} is not listed right after a backward")
            if op.tensor not in offloaded or op.tensor in issued_at:
                raise NotInFamilyError(f"{op} is not the one prefetch of an offloaded tensor")
            issued_at[op.tensor] = step + 1
        if op.is_compute:
            for tensor in _reads(op):
                if tensor in issued_at and tensor not in ready_at:
                    ready_at[tensor] = step + 1 if op.kind == BACKWARD else step
    prefetches = {}
    for tensor, issue in issued_at.items():
        ready = ready_at.get(tensor, issue - 1)
        if ready >= issue or ready < 1:
            raise NotInFamilyError(f"the prefetch of {tensor} is read in the step it is issued")
        prefetches[tensor] = (issue, ready)

    # Pass 2: residency at each step start, and the recomputed forwards.
    recompute: set[tuple[int, int, str]] = set()
    resident: set[tuple[int, str, int]] = set()
    step = length
    at_step_start = True
    for op in ops[first_backward:]:
        if op.is_compute and at_step_start:
            for tensor in on_gpu:
                in_flight = tensor in prefetches and prefetches[tensor][1] < step
                if tensor != (ACTIVATION, 0) and not in_flight:
                    resident.add((step, tensor[0], tensor[1]))
            at_step_start = False
        if op.kind in FORWARD_KINDS:
            recompute.add((step, op.index, SAVED if op.kind == F_ALL else ACTIVATION))
        _apply(on_gpu, op)
        if op.kind == BACKWARD:
            step -= 1
            at_step_start = True
    return Schedule(
        length=length,
        fates=tuple(fates),
        recompute=frozenset(recompute),
        resident=frozenset(resident),
        prefetches=prefetches,
    )


def _reads(op: Op) -> list[Tensor]:
    """The activations and saved sets a compute op reads: any holder of its input."""
    change = effect(op)
    holders = input_holders(op.index) if change.reads_input else ()
    return [*holders, *(t for t in change.reads if t[0] != GRAD)]


def _apply(on_gpu: set[Tensor], op: Op) -> None:
    """Residency of activations and saved sets after ``op``."""
    apply(on_gpu, op, gradients=False)


@dataclass(frozen=True)
class ModelSize:
    """How big one MILP instance is."""

    binaries: int
    continuous: int
    constraints: int
    nonzeros: int


class JointModel:
    """The MILP for one chain and budget, built with PuLP; see ``docs/milp.md``.

    Memory is counted in units of the largest saved set and time in units of Σf + Σb, which
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
        self.time_unit = chain.compute_time_s if chain.compute_time_s > 0 else 1.0
        self._structural: list[pulp.LpVariable] = []
        self._all_binaries: list[pulp.LpVariable] = []
        self._places: dict[str, tuple[int, int | None]] = {}
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
            self.fate[i] = {name: self._binary(f"fate_{name}_{i}", i, None) for name in names}
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
        for tensor in _valid_at(length, length):
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
                for t in _valid_at(length, k)
            }
            rec = {
                (SAVED, i): self._binary(f"rec_saved_{i}_step{k}", i, k) for i in range(1, k + 1)
            }
            rec.update(
                {(ACTIVATION, i): self._binary(f"rec_act_{i}_step{k}", i, k) for i in range(1, k)}
            )
            self.recompute[k] = rec
            self.keep[k] = {
                t: self._continuous(f"keep_{t[0]}_{t[1]}_step{k}", 0, 1)
                for t in _valid_at(length, k - 1)
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
                    c: self._binary(f"ready_{name}_step{c}", i, c)
                    for c in range(first_ready, length)
                }
                self.issue[tensor] = {
                    s: self._binary(f"issue_{name}_step{s}", i, s)
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

    # ------------------------------------------------------------------ constraints
    def _step_constraints(self) -> None:
        length = self.length
        for tensor in self.issue:
            for k in range(1, length + 1):
                flight = self._in_flight(tensor, k)
                name = f"{tensor[0]}_{tensor[1]}_step{k}"
                self._add(flight >= 0, f"ready_after_issue_{name}")
                if k < length and tensor in self.resident[k]:
                    self._add(self.resident[k][tensor] + flight <= 1, f"not_twice_{name}")
        for k in range(length, 0, -1):
            state = self.resident[k]
            rec = self.recompute.get(k, {})
            for i in range(1, k + 1) if k < length else ():
                self._add(rec[(SAVED, i)] + state[(SAVED, i)] <= 1, f"no_rec_saved_{i}_step{k}")
                flight = self._in_flight((SAVED, i), k)
                if len(flight):
                    self._add(rec[(SAVED, i)] + flight <= 1, f"no_rec_flying_saved_{i}_step{k}")
                if i < k:
                    self._add(rec[(ACTIVATION, i)] + rec[(SAVED, i)] <= 1, f"one_kind_{i}_step{k}")
                    self._add(
                        rec[(ACTIVATION, i)]
                        + state[(ACTIVATION, i)]
                        + state[(SAVED, i)]
                        + self._in_flight((ACTIVATION, i), k)
                        <= 1,
                        f"no_rec_act_{i}_step{k}",
                    )
                if i >= 2:
                    # F(i) reads a_{i-1}: resident when the step starts, or produced in it.
                    self._add(
                        rec[(SAVED, i)] + rec.get((ACTIVATION, i), 0) <= self._available(k, i - 1),
                        f"input_of_F{i}_step{k}",
                    )
            if k < length:
                self._add(state[(SAVED, k)] + rec[(SAVED, k)] >= 1, f"saved_for_B{k}")
            if k < 2:
                continue
            self._add(self._available(k, k - 1) >= 1, f"input_of_B{k}")
            for j in range(1, k):
                self._add(state[(ACTIVATION, j)] + state[(SAVED, j)] <= 1, f"one_copy_a{j}_step{k}")
                if k < length:
                    # Persistence again, for a saved set that was computed rather than
                    # prefetched: a_j stays on the GPU, or went to the host in the first pass.
                    arrived = (
                        self._ready_since[(SAVED, j + 1)][k] if (SAVED, j + 1) in self.ready else 0
                    )
                    on_host = self._fate(j, OFFLOAD_SAVED) + self._fate(j, OFFLOAD_ACTIVATION)
                    self._add(
                        state[(SAVED, j + 1)] - arrived
                        <= state[(ACTIVATION, j)] + state[(SAVED, j)] + on_host,
                        f"input_stays_{j + 1}_step{k}",
                    )
            # Into step k-1: keep what was produced, drop (D) what was resident, or arrive.
            following = self.resident[k - 1]
            for tensor in _valid_at(length, k - 1):
                name = f"{tensor[0]}_{tensor[1]}_step{k}"
                kept = self.keep[k][tensor] if k < length else 0.0
                if k < length:
                    self._add(kept <= rec[tensor], f"keep_produced_{name}")
                drop = self._continuous(f"drop_{name}", 0, 1)
                self._add(drop <= state[tensor], f"drop_resident_{name}")
                arriving = self.ready.get(tensor, {}).get(k - 1, 0.0)
                self._add(
                    following[tensor] == state[tensor] - drop + kept + arriving,
                    f"transition_{name}",
                )
                if tensor in self.issue and k in self.issue[tensor]:
                    # A prefetch issued at B(k) needs the tensor gone from the GPU by then.
                    self._add(
                        self.issue[tensor][k] + following[tensor] - arriving <= 1,
                        f"prefetch_not_resident_{name}",
                    )

    def _available(self, k: int, j: int) -> pulp.LpAffineExpression:
        """a_j usable in step k: resident alone or in x̄_j, or produced earlier in the step."""
        if j == 0:
            return pulp.LpAffineExpression(constant=1.0)
        state = self.resident[k]
        rec = self.recompute.get(k, {})
        return (
            state[(ACTIVATION, j)]
            + state[(SAVED, j)]
            + rec.get((SAVED, j), 0)
            + rec.get((ACTIVATION, j), 0)
        )

    def _timing(self) -> None:
        length, fwd, bwd = self.length, self.fwd, self.bwd
        big = self.big_time
        self.first_pass_start = {1: pulp.LpAffineExpression(constant=0.0)}
        for q in range(2, length + 1):
            start = self._continuous(f"T_{q}", 0, big)
            self._add(start >= self.first_pass_start[q - 1] + fwd[q - 1], f"first_pass_{q}")
            self.first_pass_start[q] = pulp.LpAffineExpression(start)
        self.step_start = {k: self._continuous(f"S_{k}", 0, big) for k in range(length, 0, -1)}
        self.backward_start = {length: self.step_start[length]}
        for k in range(length - 1, 0, -1):
            self.backward_start[k] = self._continuous(f"BS_{k}", 0, big)
        self.makespan = self._continuous("makespan", 0, big)
        self._add(self.step_start[length] >= self.first_pass_start[length] + fwd[length], "F_L")
        for k in range(length, 0, -1):
            if k < length:
                recompute_time = pulp.lpSum(
                    fwd[i] * var for (_, i), var in self.recompute[k].items()
                )
                self._add(
                    self.backward_start[k] >= self.step_start[k] + recompute_time,
                    f"recompute_time_step{k}",
                )
            end = self.step_start[k - 1] if k >= 2 else self.makespan
            self._add(end >= self.backward_start[k] + bwd[k], f"backward_time_{k}")

    def _device_to_host(self) -> None:
        """FIFO offloads (E_i) and the release indicators of each offloaded output."""
        length, big = self.length, self.big_time
        self.offload_end: dict[int, pulp.LpVariable] = {}
        for i in self.offloadable:
            end = self._continuous(f"E_{i}", 0, big)
            duration = self._offloaded_bytes(i) * self.d2h
            if i - 1 in self.offload_end:
                self._add(end >= self.offload_end[i - 1] + duration, f"d2h_fifo_{i}")
            self._add(end >= self.first_pass_start[i + 1] + duration, f"d2h_issue_{i}")
            self.offload_end[i] = end
        # Admission points that see releases: each first-pass forward and each backward.
        self.positions: list[tuple[str, int]] = [("F", q) for q in range(1, length + 1)]
        self.positions += [("B", k) for k in range(length, 0, -1)]
        self.released: dict[int, dict[tuple[str, int], pulp.LpVariable]] = {}
        self.unreleased: dict[tuple[str, int], pulp.LpAffineExpression] = {}
        parts: dict[tuple[str, int], list[pulp.LpVariable]] = {p: [] for p in self.positions}
        for i in self.offloadable:
            first = self.positions.index(("F", i + 2))
            self.released[i] = {}
            previous = None
            for position in self.positions[first:]:
                name = f"{i}_{position[0]}{position[1]}"
                step = position[1]
                phi = self._binary(f"released_{name}", i, step, decision=False)
                self.released[i][position] = phi
                when = (
                    self.first_pass_start[position[1]]
                    if position[0] == "F"
                    else self.backward_start[position[1]]
                )
                self._add(when >= self.offload_end[i] - big * (1 - phi), f"release_time_{name}")
                if previous is not None:
                    self._add(previous <= phi, f"release_stays_{name}")
                earlier = self.released.get(i - 1, {}).get(position)
                if earlier is not None:
                    self._add(phi <= earlier, f"release_fifo_{name}")
                previous = phi
                remaining = self._continuous(f"unreleased_{name}", 0)
                self._add(
                    remaining >= self._offloaded_bytes(i) - self.saved[i] * phi,
                    f"unreleased_bytes_{name}",
                )
                parts[position].append(remaining)
        for position, terms in parts.items():
            if terms:
                total = self._continuous(f"unreleased_{position[0]}{position[1]}", 0)
                self._add(total == pulp.lpSum(terms), f"unreleased_{position[0]}{position[1]}")
                self.unreleased[position] = pulp.LpAffineExpression(total)
            else:
                self.unreleased[position] = pulp.LpAffineExpression()

    def _host_to_device(self) -> None:
        """FIFO prefetches. The prefetches listed after B(s) start with B(s) when their bytes
        fit beside it, or wait (memory admission) for the releases at its end: ``late``. The
        early ones are listed first; H_s ends the whole batch, P_t is tensor t's arrival."""
        length, big = self.length, self.big_time
        self.late: dict[Tensor, dict[int, pulp.LpVariable]] = {}
        for tensor, steps in self.issue.items():
            self.late[tensor] = {}
            for s, var in steps.items():
                late = self._binary(
                    f"late_{tensor[0]}_{tensor[1]}_step{s}", tensor[1], s, decision=False
                )
                self._add(late <= var, f"late_if_issued_{tensor[0]}_{tensor[1]}_step{s}")
                self.late[tensor][s] = late
        early_end: dict[int, pulp.LpVariable] = {}
        channel_end: dict[int, pulp.LpVariable] = {}
        later = None
        for s in range(length, 1, -1):
            batch = [t for t, steps in self.issue.items() if s in steps]
            if not batch:
                continue
            early_duration = self._continuous(f"h2d_early_{s}", 0)
            late_duration = self._continuous(f"h2d_late_{s}", 0)
            self._add(
                early_duration
                == pulp.lpSum(
                    self._size(t) * self.h2d * (self.issue[t][s] - self.late[t][s]) for t in batch
                ),
                f"h2d_early_{s}",
            )
            self._add(
                late_duration
                == pulp.lpSum(self._size(t) * self.h2d * self.late[t][s] for t in batch),
                f"h2d_late_{s}",
            )
            early = self._continuous(f"He_{s}", 0, big)
            end = self._continuous(f"H_{s}", 0, big)
            if later is not None:
                self._add(early >= later + early_duration, f"h2d_fifo_{s}")
            self._add(early >= self.backward_start[s] + early_duration, f"h2d_issue_{s}")
            self._add(end >= early + late_duration, f"h2d_then_late_{s}")
            backward_end = self.backward_start[s] + self.bwd[s]
            self._add(end >= backward_end + late_duration, f"h2d_late_issue_{s}")
            for t in batch:
                name = f"{t[0]}_{t[1]}_step{s}"
                on_host = self.offload_end[t[1]]
                self._add(
                    early >= on_host + early_duration - big * (1 - self.issue[t][s]),
                    f"h2d_host_ready_{name}",
                )
                self._add(
                    end >= on_host + late_duration - big * (1 - self.late[t][s]),
                    f"h2d_host_ready_late_{name}",
                )
            early_end[s] = early
            channel_end[s] = later = end
        self.prefetch_end: dict[Tensor, pulp.LpVariable] = {}
        for tensor, steps in self.issue.items():
            name = f"{tensor[0]}_{tensor[1]}"
            arrival = self._continuous(f"P_{name}", 0, big)
            self.prefetch_end[tensor] = arrival
            for s, var in steps.items():
                self._add(arrival >= early_end[s] - big * (1 - var), f"prefetch_end_{name}_{s}")
                self._add(
                    arrival >= channel_end[s] - big * (1 - self.late[tensor][s]),
                    f"prefetch_end_late_{name}_{s}",
                )
            for c, var in self.ready[tensor].items():
                # The first op of step c to read the tensor waits for it: B(c) for x̄_c; F(c)
                # (when recomputed) and then B(c) for a_{c-1}; else the first recomputation.
                if tensor == (SAVED, c):
                    reader = pulp.LpAffineExpression(self.backward_start[c])
                elif tensor[1] == c - 1:
                    reader = self.backward_start[c] - self.fwd[c] * self.recompute.get(c, {}).get(
                        (SAVED, c), 0
                    )
                else:
                    reader = pulp.LpAffineExpression(self.step_start[c])
                self._add(reader >= arrival - big * (1 - var), f"wait_prefetch_{name}_{c}")

    def _memory(self) -> None:
        """Resident bytes at every admission point of the simulator stay within the budget."""
        length, x, saved, grad = self.length, self.x, self.saved, self.grad
        # First pass: a_0, δ_L, the kept outputs of stages <= q-2, unreleased offloads, the
        # input a_{q-1} (whatever its fate) and F(q)'s own output and temporary.
        kept_prefix = pulp.LpAffineExpression()
        for q in range(1, length + 1):
            if q >= 3:
                running = self._continuous(f"kept_first_pass_{q - 2}", 0)
                self._add(running == kept_prefix + self._kept_bytes(q - 2), f"kept_fp_{q - 2}")
                kept_prefix = pulp.LpAffineExpression(running)
            terms = [x[0] + grad[length], kept_prefix, self.unreleased[("F", q)]]
            if q >= 2:
                terms.append(self._product_bytes(q - 1))
            terms.append(self._product_bytes(q, temporary=True))
            self._add(pulp.lpSum(terms) <= self.budget, f"memory_F{q}")
        for k in range(length, 0, -1):
            state = self.resident[k]
            rec = self.recompute.get(k, {})
            resident_bytes = self._continuous(f"resident_bytes_step{k}", 0)
            self._add(
                resident_bytes == pulp.lpSum(self._size(t) * v for t, v in state.items()),
                f"resident_bytes_step{k}",
            )
            flying = pulp.LpAffineExpression()
            if self.issue:
                flying_var = self._continuous(f"in_flight_bytes_step{k}", 0)
                self._add(
                    flying_var
                    == pulp.lpSum(self._size(t) * self._in_flight(t, k) for t in self.issue),
                    f"in_flight_bytes_step{k}",
                )
                flying = pulp.LpAffineExpression(flying_var)
            # Issued at B(k) and admitted beside it (not waiting for its end).
            issued_here = pulp.lpSum(
                self._size(t) * (steps[k] - self.late[t][k])
                for t, steps in self.issue.items()
                if k in steps
            )
            # From B(L) on, the caller holds its output and the gradient it seeded.
            held = self.held if k < length else 0
            base = grad[k] + x[0] + held + resident_bytes + flying
            # Releases seen by step k's recomputation: those before the previous backward.
            seen_by_recompute = self.unreleased[("B", k + 1)] if k < length else None

            def produced(i: int, rec=rec) -> pulp.LpAffineExpression:
                return saved[i] * rec.get((SAVED, i), 0) + x[i] * rec.get((ACTIVATION, i), 0)

            kept_prefix = {0: pulp.LpAffineExpression()}
            for i in range(1, k - 1):
                running = self._continuous(f"kept_{i}_step{k}", 0)
                kept = self.keep.get(k, {})
                self._add(
                    running
                    == kept_prefix[i - 1]
                    + saved[i] * kept.get((SAVED, i), 0)
                    + x[i] * kept.get((ACTIVATION, i), 0),
                    f"kept_prefix_{i}_step{k}",
                )
                kept_prefix[i] = pulp.LpAffineExpression(running)
            for i in range(1, k + 1) if k < length else ():
                own = (saved[i] + self.fwd_tmp[i]) * rec[(SAVED, i)]
                if (ACTIVATION, i) in rec:
                    own += (x[i] + self.nograd_fwd_tmp[i]) * rec[(ACTIVATION, i)]
                terms = [base, seen_by_recompute, kept_prefix[max(i - 2, 0)], own]
                if i >= 2:
                    terms.append(produced(i - 1))
                self._add(pulp.lpSum(terms) <= self.budget, f"memory_F{i}_step{k}")
            terms = [base, issued_here, self.unreleased[("B", k)], kept_prefix[max(k - 2, 0)]]
            if k < length:
                if k >= 2:
                    terms.append(produced(k - 1))
                terms.append(saved[k] * rec[(SAVED, k)])
            terms.append(grad[k - 1] + self.bwd_tmp[k])
            self._add(pulp.lpSum(terms) <= self.budget, f"memory_B{k}")

    # ------------------------------------------------------------------ helpers
    def _size(self, tensor: Tensor) -> float:
        return self.saved[tensor[1]] if tensor[0] == SAVED else self.x[tensor[1]]

    def _binary(
        self, name: str, stage: int, step: int | None, decision: bool = True
    ) -> pulp.LpVariable:
        """A binary about ``stage`` in ``step`` (None: the first pass). A decision is one a
        :class:`Schedule` records; the others (releases, late prefetches) follow from the
        times."""
        var = self.problem.add_variable(name, cat=pulp.LpBinary)
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
