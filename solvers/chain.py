"""The problem instance: a chain of stages, read from and written to ``offremat.chain/1`` JSON.

Indices follow Herrmann, Beaumont et al., "Optimal checkpointing for heterogeneous chains"
(2019): stages are numbered 1..L, stage i maps activation a_{i-1} to a_i, and a_0 is the input.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from solvers.chain_limits import (
    FASTEST_LINK_BYTES_PER_S,
    LARGEST_BYTES,
    LONGEST_SECONDS,
    SHORTEST_SECONDS,
    SLOWEST_LINK_BYTES_PER_S,
    STAGE_BYTE_FIELDS,
    STAGE_FIELDS,
    ChainFormatError,
    check_bytes,
    check_number,
    shown_number,
)
from solvers.json_text import check_fields, non_finite_at, parse_json

CHAIN_FORMAT = "offremat.chain/1"


@dataclass(frozen=True)
class Stage:
    """One stage of the chain: its compute times and the bytes its forward leaves behind.

    ``saved_bytes`` (x̄_i) counts a_i plus everything autograd saves for the backward, but not
    the input a_{i-1}. The temporaries are transient peaks above what the op keeps:
    ``fwd_tmp_bytes`` above x̄_i in a forward with autograd (F_all), ``bwd_tmp_bytes`` in the
    backward above what it starts with and δ_{i-1}, and ``nograd_fwd_tmp_bytes`` above x_i in
    a forward without autograd (F_ck, F_none), which frees its intermediates as it goes; it
    defaults to ``fwd_tmp_bytes``. ``bwd_tmp_bytes`` alone can be negative, down to
    ``-saved_bytes``: autograd frees each saved tensor once the node reading it has run, so a
    backward whose peak comes late can have freed part of x̄_i by then; and a backward lets go
    of the outputs in a_i that no node saved as it starts (the chain's last stage excepted,
    whose output its caller holds).
    ``grad_bytes`` is the size of δ_i, the gradient of a_i: one tensor per tensor of a_i that
    carries a gradient (not integer masks, not what needs none; two outputs sharing a storage
    get two gradients); it defaults to ``out_bytes``.
    ``refill_s`` is the time of F_all(i) right before B(i) when an earlier F_ck(i) or F_none(i)
    kept the stage's graph: that forward stops once its last saved tensor is back, so it
    skips the operations after it (the early stop of ``torch.utils.checkpoint``; see
    :func:`solvers.semantics.refills`). At most ``fwd_s``, which it defaults to.
    """

    name: str
    fwd_s: float
    bwd_s: float
    out_bytes: int
    saved_bytes: int
    fwd_tmp_bytes: int = 0
    bwd_tmp_bytes: int = 0
    nograd_fwd_tmp_bytes: int | None = None
    grad_bytes: int | None = None
    refill_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ChainFormatError(f"stage field 'name' must be a string, got {self.name!r}")
        where = f"stage {self.name!r}"
        for attr in ("fwd_s", "bwd_s"):
            check_number(getattr(self, attr), f"{where}: field {attr!r}")
            if getattr(self, attr) > LONGEST_SECONDS:
                raise ChainFormatError(
                    f"{where}: field {attr!r} is {getattr(self, attr)} s, longer than any "
                    f"stage runs (at most {LONGEST_SECONDS:g} s): give seconds"
                )
        if self.refill_s is None:
            object.__setattr__(self, "refill_s", self.fwd_s)
        check_number(self.refill_s, f"{where}: field 'refill_s'")
        for attr in ("fwd_s", "bwd_s", "refill_s"):
            if 0 < getattr(self, attr) < SHORTEST_SECONDS:
                raise ChainFormatError(
                    f"{where}: field {attr!r} is {getattr(self, attr):g} s, shorter than the "
                    f"{SHORTEST_SECONDS:g} s a simulated op takes at least: give 0 for a stage "
                    "too quick to time, or seconds"
                )
        if self.refill_s > self.fwd_s:
            raise ChainFormatError(
                f"{where}: field 'refill_s' ({self.refill_s}) is larger than 'fwd_s' "
                f"({self.fwd_s}); a refill runs a prefix of the forward"
            )
        if self.nograd_fwd_tmp_bytes is None:
            object.__setattr__(self, "nograd_fwd_tmp_bytes", self.fwd_tmp_bytes)
        if self.grad_bytes is None:
            object.__setattr__(self, "grad_bytes", self.out_bytes)
        for attr in STAGE_BYTE_FIELDS:
            if attr != "bwd_tmp_bytes":
                object.__setattr__(
                    self, attr, check_bytes(getattr(self, attr), f"{where}: field {attr!r}")
                )
        least = -self.saved_bytes
        object.__setattr__(
            self,
            "bwd_tmp_bytes",
            check_bytes(self.bwd_tmp_bytes, f"{where}: field 'bwd_tmp_bytes'", least),
        )
        if self.saved_bytes < self.out_bytes:
            raise ChainFormatError(
                f"{where}: field 'saved_bytes' ({self.saved_bytes}) is smaller than 'out_bytes' "
                f"({self.out_bytes}); the saved set always contains the stage's output"
            )


@dataclass(frozen=True)
class Link:
    """Bandwidths of the two copy channels between GPU and pinned host memory."""

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float

    def __post_init__(self) -> None:
        for attr in ("d2h_bytes_per_s", "h2d_bytes_per_s"):
            value = getattr(self, attr)
            check_number(value, f"link: field {attr!r}")
            if value < SLOWEST_LINK_BYTES_PER_S:
                raise ChainFormatError(
                    f"link: field {attr!r} must be positive and at least "
                    f"{SLOWEST_LINK_BYTES_PER_S:g} byte per second, got {value}"
                )
            if value > FASTEST_LINK_BYTES_PER_S:
                raise ChainFormatError(
                    f"link: field {attr!r} is {value:g} bytes per second, faster than any "
                    f"link (at most {FASTEST_LINK_BYTES_PER_S:g}): give bytes per second"
                )
            object.__setattr__(self, attr, float(value))


@dataclass(frozen=True)
class Chain:
    """A model's training step seen as a chain of stages (the problem every solver takes).

    ``held_bytes`` is what the caller keeps from B(L) to the end of the step: its output a_L
    (the loss it calls ``backward`` on) and the gradient autograd seeded it with. Before B(L)
    those bytes are a_L inside x̄_L and δ_L; after it, nothing in the plan holds them.
    ``frozen_stages`` is p when stages 1..p need no backward: neither their parameters nor the
    input need a gradient (a frozen backbone, fine-tuning), so like plain autograd a plan runs
    them without autograd and keeps nothing for them but a_p, which it may drop and remake
    from a_0 (:mod:`solvers.frozen`).
    """

    name: str
    input_bytes: int
    stages: tuple[Stage, ...]
    link: Link | None = None
    metadata: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    input_grad_bytes: int | None = None
    held_bytes: int = 0
    frozen_stages: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "input_bytes", check_bytes(self.input_bytes, "chain: field 'input_bytes'")
        )
        if self.input_grad_bytes is None:
            object.__setattr__(self, "input_grad_bytes", self.input_bytes)
        object.__setattr__(
            self,
            "input_grad_bytes",
            check_bytes(self.input_grad_bytes, "chain: field 'input_grad_bytes'"),
        )
        object.__setattr__(
            self, "held_bytes", check_bytes(self.held_bytes, "chain: field 'held_bytes'")
        )
        if not self.stages:
            raise ChainFormatError("chain: field 'stages' is empty; a chain needs a stage")
        if self.link is not None and not isinstance(self.link, Link):
            raise ChainFormatError(
                f"chain: field 'link' must be a Link(d2h_bytes_per_s, h2d_bytes_per_s) or "
                f"None, got {self.link!r}"
            )
        frozen = self.frozen_stages
        if isinstance(frozen, bool) or not isinstance(frozen, int):
            raise ChainFormatError(
                f"chain: field 'frozen_stages' must be an integer, got {frozen!r}"
            )
        if not 0 <= frozen < len(self.stages):
            raise ChainFormatError(
                f"chain: field 'frozen_stages' is {frozen}; it must be in "
                f"0..{len(self.stages) - 1} (at least the last stage trains)"
            )
        object.__setattr__(self, "stages", tuple(self.stages))
        total = self.total_bytes
        if total > LARGEST_BYTES:
            raise ChainFormatError(
                f"chain: its sizes add up to {shown_number(total)} bytes, more than any device "
                f"holds (at most {LARGEST_BYTES} in all): give sizes in bytes"
            )
        seen: set[str] = set()
        for index, stage in enumerate(self.stages, start=1):
            if stage.name in seen:
                raise ChainFormatError(
                    f"stage {index}: name {stage.name!r} is used by an earlier stage; plans "
                    "name stages, so give each a name of its own"
                )
            seen.add(stage.name)

    @property
    def length(self) -> int:
        """L, the number of stages."""
        return len(self.stages)

    @property
    def stage_names(self) -> tuple[str, ...]:
        """The stages' names in order, as a plan lists them."""
        return tuple(stage.name for stage in self.stages)

    def stage(self, i: int) -> Stage:
        """Stage i, numbered from 1 as in the papers."""
        if not 1 <= i <= self.length:
            raise IndexError(f"stage index {i} outside 1..{self.length}")
        return self.stages[i - 1]

    def activation_bytes(self, i: int) -> int:
        """x_i, the size of activation a_i; x_0 is the input."""
        return self.input_bytes if i == 0 else self.stage(i).out_bytes

    def grad_bytes(self, i: int) -> int:
        """g_i, the size of δ_i, the gradient of a_i; δ_0 is the input's."""
        return self.input_grad_bytes if i == 0 else self.stage(i).grad_bytes

    def saved_bytes(self, i: int) -> int:
        """x̄_i, what a grad-enabled forward of stage i keeps until its backward."""
        return self.stage(i).saved_bytes

    @property
    def total_bytes(self) -> int:
        """Every size of the chain added up (a backward's temporaries where positive): no plan
        holds more at once, so no peak, least budget or sum a solver forms is larger."""
        stages = sum(
            sum(max(getattr(stage, attr), 0) for attr in STAGE_BYTE_FIELDS) for stage in self.stages
        )
        return stages + self.input_bytes + self.input_grad_bytes + self.held_bytes

    @property
    def compute_time_s(self) -> float:
        """Σ f_i + Σ b_i: the step time of plain autograd, the floor of every plan (frozen
        stages have no backward)."""
        trained = self.stages[self.frozen_stages :]
        return sum(s.fwd_s for s in self.stages) + sum(s.bwd_s for s in trained)

    def with_link(self, link: Link | None) -> Chain:
        """The same chain with another link (None: offloading impossible)."""
        return replace(self, link=link)

    def to_dict(self) -> dict[str, Any]:
        """The ``offremat.chain/1`` JSON object."""
        data: dict[str, Any] = {
            "format": CHAIN_FORMAT,
            "name": self.name,
            "input_bytes": self.input_bytes,
            "stages": [
                {
                    "name": s.name,
                    "fwd_s": s.fwd_s,
                    "bwd_s": s.bwd_s,
                    "out_bytes": s.out_bytes,
                    "saved_bytes": s.saved_bytes,
                    "fwd_tmp_bytes": s.fwd_tmp_bytes,
                    "bwd_tmp_bytes": s.bwd_tmp_bytes,
                    **(
                        {}
                        if s.nograd_fwd_tmp_bytes == s.fwd_tmp_bytes
                        else {"nograd_fwd_tmp_bytes": s.nograd_fwd_tmp_bytes}
                    ),
                    **({} if s.grad_bytes == s.out_bytes else {"grad_bytes": s.grad_bytes}),
                    **({} if s.refill_s == s.fwd_s else {"refill_s": s.refill_s}),
                }
                for s in self.stages
            ],
        }
        if self.link is not None:
            data["link"] = {
                "d2h_bytes_per_s": self.link.d2h_bytes_per_s,
                "h2d_bytes_per_s": self.link.h2d_bytes_per_s,
            }
        if self.input_grad_bytes != self.input_bytes:
            data["input_grad_bytes"] = self.input_grad_bytes
        if self.held_bytes:
            data["held_bytes"] = self.held_bytes
        if self.frozen_stages:
            data["frozen_stages"] = self.frozen_stages
        if self.metadata:
            data["metadata"] = self.metadata
        return data

    @classmethod
    def from_dict(cls, data: Any) -> Chain:
        """Parse and validate an ``offremat.chain/1`` object; errors name the field."""
        if not isinstance(data, dict):
            raise ChainFormatError("chain: the top level must be a JSON object")
        known = {"format", *(f.name for f in fields(cls))}
        required = ("format", "name", "input_bytes", "stages")
        check_fields(data, required, known, "chain", ChainFormatError)
        if data["format"] != CHAIN_FORMAT:
            raise ChainFormatError(
                f"chain: field 'format' is {data['format']!r}; expected {CHAIN_FORMAT!r}"
            )
        if not isinstance(data["name"], str):
            raise ChainFormatError(f"chain: field 'name' must be a string, got {data['name']!r}")
        if not isinstance(data["stages"], list):
            raise ChainFormatError("chain: field 'stages' must be a list")
        stages = []
        for index, raw in enumerate(data["stages"], start=1):
            where = f"stage {index}"
            if not isinstance(raw, dict):
                raise ChainFormatError(f"{where}: must be a JSON object")
            if "name" in raw:
                where = f"stage {index} ({raw['name']!r})"
            required = ("name", "fwd_s", "bwd_s", "out_bytes", "saved_bytes")
            check_fields(raw, required, STAGE_FIELDS, where, ChainFormatError)
            try:
                stages.append(Stage(**raw))
            except ChainFormatError as error:
                # Stage names itself; the file's position replaces that.
                said = str(error).removeprefix(f"stage {raw['name']!r}: ")
                raise ChainFormatError(f"{where}: {said}") from None
        link = None
        if data.get("link") is not None:
            raw_link = data["link"]
            if not isinstance(raw_link, dict):
                raise ChainFormatError("link: must be a JSON object")
            rates = ("d2h_bytes_per_s", "h2d_bytes_per_s")
            check_fields(raw_link, rates, rates, "link", ChainFormatError)
            link = Link(raw_link["d2h_bytes_per_s"], raw_link["h2d_bytes_per_s"])
        metadata = {} if data.get("metadata") is None else data["metadata"]
        if not isinstance(metadata, dict):
            raise ChainFormatError("chain: field 'metadata' must be a JSON object")
        where = non_finite_at(metadata, "metadata")
        if where is not None:
            raise ChainFormatError(
                f"chain: {where} is NaN or infinite, which JSON does not have: write a number"
            )
        return cls(
            name=data["name"],
            input_bytes=data["input_bytes"],
            input_grad_bytes=data.get("input_grad_bytes"),
            held_bytes=data.get("held_bytes", 0),
            frozen_stages=data.get("frozen_stages", 0),
            stages=tuple(stages),
            link=link,
            metadata=dict(metadata),
        )

    def to_json(self) -> str:
        """The chain as ``offremat.chain/1`` JSON text."""
        return json.dumps(self.to_dict(), indent=2, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> Chain:
        """Parse ``offremat.chain/1`` JSON text."""
        return cls.from_dict(parse_json(text, "chain", ChainFormatError))

    def save(self, path: str | Path) -> None:
        """Write the chain to a JSON file."""
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Chain:
        """Read a chain from a JSON file."""
        return cls.from_json(Path(path).read_text())
