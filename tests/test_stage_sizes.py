"""What a step's stages held, against their chain (offremat._stage_sizes)."""

from __future__ import annotations

import torch

from offremat._memory import StorageRecord
from offremat._stage_sizes import StageSizes, grown_chain, most_grown
from solvers.chain import Chain, Stage


def _record(nbytes: int) -> StorageRecord:
    return StorageRecord(0, torch.empty(nbytes, dtype=torch.uint8).untyped_storage(), True)


def _chain() -> Chain:
    stages = [
        Stage("a", 1e-3, 2e-3, 100, 300, fwd_tmp_bytes=50, bwd_tmp_bytes=60),
        Stage("b", 1e-3, 2e-3, 100, 400, fwd_tmp_bytes=40, bwd_tmp_bytes=-20),
    ]
    return Chain("two", 100, stages)


def test_a_stage_counts_its_storages_once_and_not_its_input() -> None:
    given, out, saved = _record(100), _record(120), _record(500)
    sizes = StageSizes()
    sizes.note(1, [out, given], [out, saved, given, saved], [given])
    assert (sizes.out[1], sizes.saved[1]) == (120, 620)
    sizes.note(1, [out], [out], [given])  # a recomputation holding less keeps the most
    assert (sizes.out[1], sizes.saved[1]) == (120, 620)


def test_no_stage_above_its_chain_or_what_was_checked_is_no_growth() -> None:
    chain = _chain()
    sizes = StageSizes(out={1: 100, 2: 90}, saved={1: 300, 2: 500})
    assert grown_chain(chain, sizes, StageSizes()) is not None
    checked = StageSizes(saved={2: 500})
    assert grown_chain(chain, sizes, checked) is None


def test_a_grown_stage_grows_its_gradient_and_temporaries_with_it() -> None:
    chain = _chain()
    sizes = StageSizes(out={2: 150}, saved={2: 800})
    grown = grown_chain(chain, sizes, StageSizes())
    assert grown is not None
    assert grown.stages[0] == chain.stages[0]
    b = grown.stages[1]
    assert (b.out_bytes, b.saved_bytes, b.grad_bytes) == (150, 800, 150)
    assert (b.fwd_tmp_bytes, b.bwd_tmp_bytes) == (80, -40)  # twice the saved, twice these
    assert most_grown(chain, grown) == ("b", 800, 400)
