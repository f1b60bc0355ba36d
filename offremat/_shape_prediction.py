"""A chain for a new input shape fitted from the shapes profiled so far (:mod:`solvers.predict`,
after Mimose's memory regression), for :mod:`offremat._shapes`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from offremat._signatures import CHAIN_INPUT_KEYS, Signature, differing_size
from solvers.chain import Chain
from solvers.predict import predict_chain

MIXED_KINDS = "predicted from chains of several kinds of blocks' inputs"
"""The kind of a chain predicted from such chains: no input is of it."""


def predicted_chain(profiled: Mapping[Signature, Chain], signature: Signature) -> Chain | None:
    """The chain of ``signature`` predicted from the ``profiled`` chains of signatures that
    differ from it in one size (the same positions of the same tensors), or None."""
    size = None
    points = []
    for known, chain in profiled.items():
        along = differing_size(known, signature)
        if along is not None:
            positions, size, known_size = along
            points.append((positions, known_size, chain))
    if size is None:
        return None
    for positions in {p for p, _, _ in points}:
        same = [(n, chain) for p, n, chain in points if p == positions]
        predicted = predict_chain(same, size)
        if predicted is not None:
            metadata = _predicted_input(predicted.metadata, same, size)
            return dataclasses.replace(predicted, metadata=metadata)
    return None


def _predicted_input(
    metadata: dict[str, Any], same: Sequence[tuple[int, Chain]], size: int
) -> dict[str, Any]:
    """A predicted chain's metadata (at ``size``, from the chains ``same``): the kind of chain
    input its sources were profiled on where they agree (else one no input has), not its
    bytes, which are another size's (offremat._model_chain then takes the costs around the
    blocks from the chain's figures, as upper bounds). The bytes parameters' gradients pin
    grow with the batch, and the held bytes predicted count them: said as what the smallest
    source pinned where ``size`` is not below it, else 0, a lower bound, since the code
    around the blocks takes them from the held bytes."""
    metadata = {k: v for k, v in metadata.items() if k not in CHAIN_INPUT_KEYS}
    smallest = min(same, key=lambda point: point[0])
    pinned = smallest[1].metadata.get("pinned_gradient_bytes", 0)
    metadata["pinned_gradient_bytes"] = pinned if smallest[0] <= size else 0
    kinds = {chain.metadata.get("chain_input") for _, chain in same}
    if kinds != {None}:
        # Sources of several kinds predict no kind's bytes: every input gets its own plan.
        metadata["chain_input"] = kinds.pop() if len(kinds) == 1 else MIXED_KINDS
    return metadata
