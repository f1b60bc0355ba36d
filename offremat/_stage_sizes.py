"""What each stage's tensors took in a step, against the sizes its plan was made for.

A model whose activation sizes depend on its input's values (tokens routed by their values,
a boolean mask's rows) saves more at some steps than at the batch its chain was profiled on,
at the same input shapes, so no shape key tells those steps apart. An unmeasured step cannot
see its own peak, but it sees every stage's output a_i (:mod:`offremat._memory`) and the
saved set x̄_i that each forward packs through its hooks: the one it holds (an F_all it
offloads or refills) and the one a recomputed stage's forward lets go
(:class:`offremat._deferred.DeferringPacker`), counted as the profiler counts x̄_i, its
storages with a_i's, each once. A stage that held more than its chain says is a stage whose
profile no longer holds, and the plan simulated on the sizes the step had is a prediction of
its peak where the chain's is not.

A stage kept from its forward to its backward leaves x̄_i to autograd's graph, with no hooks
(saved-tensor hooks switch off autograd's check of in-place changes): its x̄_i is read from
that graph (:mod:`offremat._graph_saved`); a stage whose graph could not be read is not seen
and is taken as profiled, grown with its a_i only. A refill's own tensors are not counted: it
makes again what the stage's forward packed, a copy of a_i among them where the stage saves
its output, which the profile counts once (counting them put a_i's bytes of slack in every
refilled stage, which hid growth at 1.3 to 2 times the budget, in a review).

The executor counts a storage's bytes (``nbytes``); the profiler counts the same storages,
and on CUDA rounds them up to the allocator's blocks, plus what the step holds elsewhere
(moving norms' statistics, leaves of the graph): at the profiled batch a stage holds at most
what its chain says, so only a stage that holds more has grown.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from math import ceil

from solvers.chain import Chain, Stage


@dataclass
class StageSizes:
    """Per stage (from 1), the most bytes its output a_i and its saved set x̄_i held in a step,
    and the stages whose x̄_i was seen (``seen``)."""

    out: dict[int, int] = field(default_factory=dict)
    saved: dict[int, int] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)

    def note(
        self,
        i: int,
        outputs: Mapping[int, int],
        saved: Mapping[int, int],
        inputs: Collection[int],
        seen: bool = True,
    ) -> None:
        """Stage i made ``outputs`` and its saved set held ``saved`` (bytes by storage key),
        none of it in ``inputs`` (a_{i-1}'s storage keys); ``seen``: whether that is all of
        x̄_i."""
        out = {key: size for key, size in outputs.items() if key not in inputs}
        held = {**saved, **out}
        self.out[i] = max(self.out.get(i, 0), sum(out.values()))
        self.saved[i] = max(
            self.saved.get(i, 0), sum(size for key, size in held.items() if key not in inputs)
        )
        if seen:
            self.seen.add(i)

    def __setstate__(self, state: dict[str, object]) -> None:
        # Pickled before ``seen`` was kept: no stage's saved set known as seen (an old
        # module's first grown step crashed, a review).
        self.__dict__.update(seen=set())
        self.__dict__.update(state)

    def scaled(self, factor: float) -> StageSizes:
        """These sizes, each ``factor`` times larger."""
        return StageSizes(
            {i: ceil(size * factor) for i, size in self.out.items()},
            {i: ceil(size * factor) for i, size in self.saved.items()},
            set(self.seen),
        )

    def reaches(self, other: StageSizes) -> bool:
        """Whether these sizes are at least ``other``'s at every stage: each output a_i, and
        each saved set x̄_i that both saw."""
        if any(self.out.get(i, 0) < size for i, size in other.out.items()):
            return False
        both = self.seen & other.seen
        return all(self.saved.get(i, 0) >= size for i, size in other.saved.items() if i in both)

    def merge(self, other: StageSizes) -> None:
        """Keep, per stage, the larger of this and ``other``."""
        for mine, theirs in ((self.out, other.out), (self.saved, other.saved)):
            for i, size in theirs.items():
                mine[i] = max(mine.get(i, 0), size)
        self.seen |= other.seen


@dataclass(frozen=True)
class Outgrown:
    """A chain grown to the sizes a step held (``sizes``), past its budget on the plan."""

    chain: Chain
    sizes: StageSizes


def grown_chain(chain: Chain, sizes: StageSizes, checked: StageSizes) -> Chain | None:
    """``chain`` with each stage grown to the sizes it held in a step, or None where no stage
    held more than its chain says and than a step measured within its budget held
    (``checked``). A stage whose x̄_i was not seen grows with its a_i only."""
    grew = False
    held: dict[int, tuple[int, int]] = {}
    for i, stage in enumerate(chain.stages, 1):
        out, saved = sizes.out.get(i, 0), sizes.saved.get(i, 0)
        if i not in sizes.seen:
            saved = 0
        grew |= out > max(stage.out_bytes, checked.out.get(i, 0))
        grew |= saved > max(stage.saved_bytes, checked.saved.get(i, 0))
        out_bytes = max(stage.out_bytes, out)
        # x̄_i holds a_i: it grows with a_i at least.
        held[i] = out_bytes, max(stage.saved_bytes + out_bytes - stage.out_bytes, saved)
    if not grew:
        return None
    stages = tuple(_grown(stage, *held[i]) for i, stage in enumerate(chain.stages, 1))
    return replace(chain, stages=stages)


def _grown(stage: Stage, out_bytes: int, saved_bytes: int) -> Stage:
    """``stage`` holding ``out_bytes`` and ``saved_bytes``."""
    if (out_bytes, saved_bytes) == (stage.out_bytes, stage.saved_bytes):
        return stage
    # δ_i grows with a_i, as much as the part of a_i that carries a gradient.
    grad_bytes = stage.grad_bytes or 0
    if stage.out_bytes:
        grad_bytes = -(-grad_bytes * out_bytes // stage.out_bytes)
    # A stage that saves more works on more: its temporaries grow as much.
    scale = saved_bytes / max(stage.saved_bytes, 1)
    return replace(
        stage,
        out_bytes=out_bytes,
        saved_bytes=saved_bytes,
        grad_bytes=grad_bytes,
        fwd_tmp_bytes=ceil(stage.fwd_tmp_bytes * scale),
        bwd_tmp_bytes=ceil(stage.bwd_tmp_bytes * scale),
        nograd_fwd_tmp_bytes=ceil((stage.nograd_fwd_tmp_bytes or 0) * scale),
    )


def most_grown(chain: Chain, grown: Chain) -> tuple[str, int, int]:
    """The stage whose saved set grew most: its name, its bytes then and as profiled."""
    pairs = zip(chain.stages, grown.stages, strict=True)
    before, after = max(pairs, key=lambda pair: pair[1].saved_bytes - pair[0].saved_bytes)
    return before.name, after.saved_bytes, before.saved_bytes
