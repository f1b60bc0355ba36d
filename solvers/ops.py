"""The operations of a plan: compute ops on stages and memory ops on tensors.

Compute operations follow rotor's persistent model (Herrmann, Beaumont et al. 2019); copy
operations add POFO's offloading (Beaumont, Eyraud-Dubois, Shilova 2021). What each one needs
and does is :mod:`solvers.semantics`; ``docs/plan-format.md`` is the normative text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

F_ALL, F_CK, F_NONE, BACKWARD = "F_all", "F_ck", "F_none", "B"
OFFLOAD, PREFETCH, FREE = "offload", "prefetch", "free"
COMPUTE_KINDS = (F_ALL, F_CK, F_NONE, BACKWARD)
FORWARD_KINDS = (F_ALL, F_CK, F_NONE)
COPY_KINDS = (OFFLOAD, PREFETCH)
MEMORY_KINDS = (OFFLOAD, PREFETCH, FREE)

ACTIVATION, SAVED = "activation", "saved"
Target = Literal["activation", "saved"]
Decision = Literal["keep", "recompute", "offload"]


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
        if not isinstance(data, dict):
            raise ValueError(f"an op must be a JSON object, got {data!r}")
        unknown = set(data) - {"op", "index", "tensor"}
        if unknown:
            raise ValueError(f"op {data}: unknown field(s) {sorted(unknown)}")
        missing = [name for name in ("op", "index") if name not in data]
        if missing:
            raise ValueError(f"op {data}: missing field(s) {missing}")
        index = data["index"]
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"op {data}: field 'index' must be an integer, got {index!r}")
        return cls(kind=data["op"], index=index, target=data.get("tensor"))


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
