"""What each operation of a plan needs resident, what it allocates and what it releases.

The one statement, in code, of the tables of ``docs/plan-format.md`` (sections "State" and
"Operations"), which stays the normative text. :func:`solvers.plan.validate`,
:func:`solvers.simulator.simulate`, the MILP's plan codec (:mod:`solvers.milp_codec`) and the
executor (:mod:`offremat._step`) all read it, so a rule about residency is written once.

Tensors are named ``(kind, i)``: ``(ACTIVATION, i)`` is a_i, ``(SAVED, i)`` the saved set x̄_i
(which contains a_i), ``(GRAD, i)`` the gradient δ_i. A compute op of stage i reads its input
a_{i-1} from whichever holds it: a_{i-1} by itself or x̄_{i-1} (:func:`stage_input`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from solvers.chain import Chain
from solvers.ops import (
    ACTIVATION,
    BACKWARD,
    F_ALL,
    F_CK,
    F_NONE,
    FREE,
    OFFLOAD,
    PREFETCH,
    SAVED,
    Op,
)

GRAD = "grad"
Tensor = tuple[str, int]


@dataclass(frozen=True)
class Effect:
    """One operation's effect on the GPU (and the host), as ``docs/plan-format.md`` states it.

    ``reads_input``: a compute op reads a_{i-1}, which must be resident. ``reads``: what else
    must be on the GPU when it starts. ``allocates``: what it makes resident, from its start.
    ``releases``: what it takes off the GPU when it ends (an offload: when its copy has ended
    and the op reading the tensor has too). ``releases_input``: it also releases a_{i-1} when
    a_{i-1} is on the GPU by itself. ``dead``: what no later op of the step reads, on the GPU
    or from the host. ``to_host`` / ``from_host``: the tensor an offload copies out / a
    prefetch copies back (which must be on the host and not on the GPU).
    """

    reads_input: bool = False
    reads: tuple[Tensor, ...] = ()
    allocates: Tensor | None = None
    releases: tuple[Tensor, ...] = ()
    releases_input: bool = False
    dead: tuple[Tensor, ...] = ()
    to_host: Tensor | None = None
    from_host: Tensor | None = None


def effect(op: Op) -> Effect:
    """The effect of ``op`` (the "Operations" tables of ``docs/plan-format.md``)."""
    i = op.index
    if op.kind == F_ALL:
        return Effect(reads_input=True, allocates=(SAVED, i))
    if op.kind == F_CK:
        return Effect(reads_input=True, allocates=(ACTIVATION, i))
    if op.kind == F_NONE:
        # Never a_0: the caller holds its input for the whole step (B(1) ends the step).
        return Effect(reads_input=True, allocates=(ACTIVATION, i), releases_input=i > 1)
    if op.kind == BACKWARD:
        # After B(i) nothing reads x̄_i, or a_{i-1} by itself, again.
        return Effect(
            reads_input=True,
            reads=((SAVED, i), (GRAD, i)),
            allocates=(GRAD, i - 1),
            releases=((SAVED, i), (GRAD, i)),
            releases_input=True,
            dead=((SAVED, i), (ACTIVATION, i - 1)),
        )
    if op.kind == OFFLOAD:
        return Effect(reads=(op.tensor,), releases=(op.tensor,), to_host=op.tensor)
    if op.kind == PREFETCH:
        return Effect(allocates=op.tensor, from_host=op.tensor)
    if op.kind == FREE:
        return Effect(reads=(op.tensor,), releases=(op.tensor,))
    raise ValueError(f"unknown operation kind {op.kind!r}")


def initial_residency(length: int) -> set[Tensor]:
    """What the GPU holds when the step starts: a_0 and the loss gradient δ_L."""
    return {(ACTIVATION, 0), (GRAD, length)}


def input_holders(i: int) -> tuple[Tensor, ...]:
    """The tensors that can hold stage i's input a_{i-1}: a_{i-1} itself, and x̄_{i-1}."""
    return ((ACTIVATION, i - 1), (SAVED, i - 1)) if i >= 2 else ((ACTIVATION, 0),)


def last_reader(tensor: Tensor) -> int:
    """The stage whose backward reads ``tensor`` last: B(i + 1) for a_i and for x̄_i, which
    holds a_i (B(i) reads x̄_i before)."""
    return tensor[1] + 1


def stage_input(i: int, resident: Collection[Tensor]) -> Tensor | None:
    """Where stage i's input a_{i-1} is resident: by itself, else inside x̄_{i-1}; or None."""
    return next((tensor for tensor in input_holders(i) if tensor in resident), None)


def released(op: Op, resident: Collection[Tensor]) -> tuple[Tensor, ...]:
    """What ``op`` takes off the GPU, given what is resident before it."""
    change = effect(op)
    alone = (ACTIVATION, op.index - 1)
    if change.releases_input and alone in resident:
        return (*change.releases, alone)
    return change.releases


def apply(resident: set[Tensor], op: Op, gradients: bool = True) -> None:
    """Update ``resident`` to what the GPU holds after ``op``; with ``gradients`` False the
    δ tensors are left out (for callers that follow activations and saved sets only)."""
    for tensor in released(op, resident):
        resident.discard(tensor)
    made = effect(op).allocates
    if made is not None and (gradients or made[0] != GRAD):
        resident.add(made)


def undisturbed_forwards(ops: Sequence[Op]) -> frozenset[int]:
    """Positions of the F_all(i) after which, until B(i), no operation moves, frees or
    recomputes stage i's input a_{i-1} or saved set x̄_i (nor touches stage i-1 or i again).

    Between such an F_all and its backward both stay on the GPU as they are, so an executor
    may leave them to autograd's own graph instead of holding them itself.
    """
    found = set()
    for position, op in enumerate(ops):
        if op.kind != F_ALL:
            continue
        i = op.index
        watched = {(ACTIVATION, i - 1), (SAVED, i - 1), (ACTIVATION, i), (SAVED, i)}
        for later in ops[position + 1 :]:
            if later.kind == BACKWARD and later.index == i:
                found.add(position)
                break
            if later.kind in (OFFLOAD, PREFETCH, FREE):
                if later.tensor in watched:
                    break
            elif later.index in (i - 1, i):
                break
    return frozenset(found)


def tensor_bytes(tensor: Tensor, chain: Chain) -> int:
    """The size of a_i (x_i), x̄_i or δ_i (g_i) on this chain."""
    kind, i = tensor
    if kind == SAVED:
        return chain.saved_bytes(i)
    if kind == GRAD:
        return chain.grad_bytes(i)
    return chain.activation_bytes(i)


def temporary_bytes(op: Op, chain: Chain) -> int:
    """The transient bytes of a compute op: allocated at its start, released at its end."""
    stage = chain.stage(op.index)
    if op.kind == F_ALL:
        return stage.fwd_tmp_bytes
    if op.kind == BACKWARD:
        return stage.bwd_tmp_bytes
    return stage.nograd_fwd_tmp_bytes


def duration_s(op: Op, chain: Chain, refill: bool = False) -> float:
    """How long a compute op takes: f_i or b_i, or the refill's time for an F_all(i) at a
    position of :func:`refills`."""
    stage = chain.stage(op.index)
    if op.kind == BACKWARD:
        return stage.bwd_s
    return stage.refill_s if refill else stage.fwd_s


def refills(ops: Sequence[Op]) -> frozenset[int]:
    """The positions of the F_all(i) that refill a kept graph: right before B(i), after an
    F_ck(i) or F_none(i).

    Such a forward (offremat._deferred) runs on the graph the latest F_ck(i) or F_none(i)
    kept and stops once its last saved tensor is back, as ``torch.utils.checkpoint``'s
    non-reentrant recomputation does: it takes ``refill_s``, not ``fwd_s``. (A stage that
    changes a saved tensor in place after saving it is refilled to its end, which the model
    does not know; so is the copy of BatchNorm's running statistics a refill makes.)
    """
    found = set()
    forwarded: set[int] = set()
    for position, op in enumerate(ops):
        if op.kind in (F_CK, F_NONE):
            forwarded.add(op.index)
        elif op.kind == F_ALL and op.index in forwarded:
            following = ops[position + 1] if position + 1 < len(ops) else None
            if following is not None and following.kind == BACKWARD and following.index == op.index:
                found.add(position)
    return frozenset(found)
