"""What each stage's tensors took in a step, against the sizes its plan was made for.

A model whose activation sizes depend on its input's values (tokens routed by their values,
a boolean mask's rows) saves more at some steps than at the batch its chain was profiled on,
at the same input shapes, so no shape key tells those steps apart. An unmeasured step cannot
see its own peak, but it holds as storages (:mod:`offremat._memory`) every stage's output a_i
and the saved set x̄_i of each stage the plan recomputes or offloads: a stage that held more
than its chain says is a stage whose profile no longer holds, and the plan simulated on the
sizes the step had is a prediction of its peak where the chain's is not. A stage kept from
its forward to its backward leaves x̄_i to autograd's graph (:mod:`offremat.executor`), which
no one here sees: its growth goes unseen.

The executor counts a storage's bytes (``nbytes``); the profiler counts the same storages,
and on CUDA rounds them up to the allocator's blocks, plus what the step holds elsewhere
(moving norms' statistics, leaves of the graph): at the profiled batch a stage holds at most
what its chain says, so only a stage that holds more has grown.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from math import ceil

from offremat._memory import StorageRecord
from solvers.chain import Chain


@dataclass
class StageSizes:
    """Per stage (from 1), the most bytes its output a_i and its saved set x̄_i held in a step."""

    out: dict[int, int] = field(default_factory=dict)
    saved: dict[int, int] = field(default_factory=dict)

    def note(
        self,
        i: int,
        outputs: Iterable[StorageRecord],
        saved: Iterable[StorageRecord],
        inputs: Iterable[StorageRecord],
    ) -> None:
        """Stage i made ``outputs`` and, in all, ``saved`` (None of it in ``inputs``, a_{i-1})."""
        given = {id(record) for record in inputs}
        out = {id(r): r.nbytes for r in outputs if id(r) not in given}
        held = {**out, **{id(r): r.nbytes for r in saved if id(r) not in given}}
        self.out[i] = max(self.out.get(i, 0), sum(out.values()))
        self.saved[i] = max(self.saved.get(i, 0), sum(held.values()))

    def merge(self, other: StageSizes) -> None:
        """Keep, per stage, the larger of this and ``other``."""
        for mine, theirs in ((self.out, other.out), (self.saved, other.saved)):
            for i, size in theirs.items():
                mine[i] = max(mine.get(i, 0), size)


def grown_chain(chain: Chain, sizes: StageSizes, checked: StageSizes) -> Chain | None:
    """``chain`` with each stage that held more than it says (and than a step measured within
    its budget held, ``checked``) grown by as much, or None where no stage did."""
    stages = list(chain.stages)
    grown = False
    for i, stage in enumerate(chain.stages, 1):
        out = sizes.out.get(i, 0) - max(stage.out_bytes, checked.out.get(i, 0))
        saved = sizes.saved.get(i, 0) - max(stage.saved_bytes, checked.saved.get(i, 0))
        if out <= 0 and saved <= 0:
            continue
        grown = True
        more_out = max(out, 0)
        out_bytes = stage.out_bytes + more_out
        # δ_i grows with a_i, as much as the part of a_i that carries a gradient.
        grad_bytes = stage.grad_bytes or 0
        if stage.out_bytes:
            grad_bytes = -(-grad_bytes * out_bytes // stage.out_bytes)
        saved_bytes = stage.saved_bytes + max(saved, more_out)
        # A stage that saves more works on more: its temporaries grow as much.
        scale = saved_bytes / max(stage.saved_bytes, 1)
        stages[i - 1] = replace(
            stage,
            out_bytes=out_bytes,
            saved_bytes=saved_bytes,
            grad_bytes=grad_bytes,
            fwd_tmp_bytes=ceil(stage.fwd_tmp_bytes * scale),
            bwd_tmp_bytes=ceil(stage.bwd_tmp_bytes * scale),
            nograd_fwd_tmp_bytes=ceil((stage.nograd_fwd_tmp_bytes or 0) * scale),
        )
    return replace(chain, stages=tuple(stages)) if grown else None


def most_grown(chain: Chain, grown: Chain) -> tuple[str, int, int]:
    """The stage whose saved set grew most: its name, its bytes then and as profiled."""
    pairs = zip(chain.stages, grown.stages, strict=True)
    before, after = max(pairs, key=lambda pair: pair[1].saved_bytes - pair[0].saved_bytes)
    return before.name, after.saved_bytes, before.saved_bytes
