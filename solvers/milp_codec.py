"""The MILP's plan family: a :class:`Schedule` and its codec to and from plan operations.

The timeline is cut into positions that mirror how :func:`solvers.simulator.simulate` replays a
plan: the L forwards of the first pass, then one step per backward, step k holding the forwards
recomputed for B(k) and B(k) itself. A plan in this family is described by a
:class:`Schedule`, which :func:`decode` turns into operations and :func:`encode` reads back
from operations; what each operation reads and leaves resident is :mod:`solvers.semantics`.
``docs/milp.md`` states the family.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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

    def in_flight(self, k: int, tensor: Tensor) -> bool:
        """Whether ``tensor``'s prefetch was issued before step k and it is not usable yet:
        the GPU holds its bytes already, so nothing may produce it again in step k."""
        issue, ready = self.prefetches.get(tensor, (0, 0))
        return issue > k > ready

    def carried(self, k: int, tensor: Tensor) -> bool:
        """Whether ``tensor`` stays on the GPU from step k into step k-1 (not a prefetch)."""
        if k <= 1:
            return False
        arriving = self.prefetches.get(tensor, (0, 0))[1] == k - 1
        return self.is_resident(k - 1, tensor) and not arriving


def valid_at(length: int, k: int) -> list[Tensor]:
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
        on_gpu = {t for t in valid_at(length, k) if schedule.is_resident(k, t)}
        on_gpu.add((ACTIVATION, 0))

        recomputed = {i: t for kk, i, t in schedule.recompute if kk == k}
        # The model charges a recomputation that nothing reads but does not forbid it, so a
        # solution within the gap may hold one: such a forward is left out, and its input
        # released where the recomputation would have.
        useful: set[int] = set()
        for i in sorted(recomputed, reverse=True):
            if i >= k - 1 or i + 1 in useful or schedule.carried(k, (recomputed[i], i)):
                useful.add(i)
        for i, target in sorted(recomputed.items()):
            source = (ACTIVATION, i - 1) if (ACTIVATION, i - 1) in on_gpu else None
            needed_later = i == k or schedule.carried(k, (ACTIVATION, i - 1))
            drop_input = source is not None and not needed_later and i - 1 >= 1
            # The model counts an output only while this step still reads it, unless it is
            # kept; a saved set nothing keeps is cheaper as a plain activation.
            read_later = i == k - 1 or (i < k and i + 1 in useful)
            if i not in useful:
                if drop_input:
                    _emit(ops, on_gpu, free(ACTIVATION, i - 1))
                continue
            if (
                target == SAVED
                and i != k
                and not schedule.carried(k, (SAVED, i))
                and (ACTIVATION, i) not in on_gpu
                and not schedule.in_flight(k, (ACTIVATION, i))
            ):
                target = ACTIVATION
            if target == SAVED:
                _emit(ops, on_gpu, forward_all(i))
                if drop_input:
                    _emit(ops, on_gpu, free(ACTIVATION, i - 1))
            else:
                _emit(ops, on_gpu, forward_none(i) if drop_input else forward_checkpoint(i))
            output = (target, i)
            if not (i == k or read_later or schedule.carried(k, output)):
                _emit(ops, on_gpu, free(*output))
        _emit(ops, on_gpu, backward(k))
        for tensor in sorted(on_gpu - {(ACTIVATION, 0)}, key=lambda t: (t[1], t[0])):
            if not schedule.carried(k, tensor):
                _emit(ops, on_gpu, free(*tensor))
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


def _emit(ops: list[Op], on_gpu: set[Tensor], op: Op) -> None:
    """List ``op`` and follow what it leaves on the GPU."""
    ops.append(op)
    apply(on_gpu, op, gradients=False)


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
