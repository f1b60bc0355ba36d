"""One stage's figures as :class:`offremat._stage_profile.StageProfile` measures them, before
:func:`offremat.profiler.profile_model` makes them a :class:`solvers.chain.Stage`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Measured:
    """One stage's figures, before they become a :class:`Stage`."""

    fwd_s: float
    bwd_s: float
    out_bytes: int
    saved_bytes: int
    fwd_tmp_bytes: int
    bwd_tmp_bytes: int
    nograd_fwd_tmp_bytes: int
    grad_bytes: int
    refill_s: float | None = None
    # Made by the forward and still held after the backward by the modules themselves.
    kept_bytes: int = 0
    # The buffers the forward changes or other stages hold, copied to the step's end when the
    # stage is recomputed.
    changed_buffer_bytes: int = 0
    # Tensors that require grad made by the forward as leaves of its graph (an RNN cell's
    # initial state made with requires_grad=True), which only the graph holds, and the
    # gradients B(i) gives them (see _measure).
    leaf_bytes: int = 0
    leaf_grad_bytes: int = 0
    # The storage keys of the leaves its graph reaches that outlive the graph and are none of
    # its parameters (a parameter kept in a block's __dict__, a closure's): refused where
    # several stages reach one (profiler._refuse_shared_outside_leaves).
    outside_leaves: frozenset[int] = frozenset()
    # By parameter id, what the storage its gradient views holds beyond parameters' gradients
    # (offremat._pinned_grads).
    pinned_grads: dict[int, int] = field(default_factory=dict)
    # The ids of the parameters whose gradient B(i) made sparse (an nn.Embedding's with
    # sparse=True), refused where several stages use one
    # (offremat._shared_grads.refuse_shared_sparse_gradients).
    sparse_grads: frozenset[int] = frozenset()
