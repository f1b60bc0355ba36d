"""The envelope of chains of one model: at every stage, the most any of them holds.

Values a model receives can change what its blocks save without changing a shape (a float
that picks which blocks add a branch): one call then has several chains, with the same stages
and different sizes. A plan's resident bytes at every operation are sums of the chain's byte
figures, so a plan's peak on the envelope is at least its peak on each of those chains, and a
plan within budget on the envelope is within budget on all of them. Offloads are the one
exception the bytes alone cannot settle: when a copy ends follows the times, which are the
first chain's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from solvers.chain import Chain
from solvers.chain_limits import STAGE_BYTE_FIELDS


def envelope(chains: Sequence[Chain]) -> Chain:
    """The chain with every byte figure the largest of ``chains``' and the first's times,
    name, link and metadata; the chains must share their stages' names and frozen stages."""
    if not chains:
        raise ValueError("envelope: give at least one chain")
    first = chains[0]
    for other in chains[1:]:
        if other.stage_names != first.stage_names or other.frozen_stages != first.frozen_stages:
            raise ValueError(
                f"envelope: chain {other.name!r} has other stages than {first.name!r} "
                f"({other.length} against {first.length}, or other names or frozen stages): "
                "an envelope bounds chains of one model's stages"
            )
    stages = tuple(
        dataclasses.replace(
            stage,
            **{
                field: max(getattr(chain.stages[i], field) for chain in chains)
                for field in STAGE_BYTE_FIELDS
            },
        )
        for i, stage in enumerate(first.stages)
    )
    return dataclasses.replace(
        first,
        stages=stages,
        input_bytes=max(chain.input_bytes for chain in chains),
        input_grad_bytes=max(chain.input_grad_bytes for chain in chains),
        held_bytes=max(chain.held_bytes for chain in chains),
        metadata=dict(first.metadata),
    )
