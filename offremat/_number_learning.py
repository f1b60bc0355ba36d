"""Learning from two profiles whether a call's numbers size anything (:mod:`offremat._numbers`
keeps what is learnt).

A call that differs from a profiled one only in numbers whose place is not known yet is
profiled; its chain and the other's tell. Two calls differ in their tensors' values too, and a
chain can follow those (a head on the masked tokens alone, padding a 4-d mask shows where an
unpadded batch passes none): where the chains differ in one number, the new call is profiled
again with the other call's value, on its own tensors, and only that comparison says that the
number sizes (a count beside a head on the masked tokens was a profile at every step,
and "it changes what the model saves" was false).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from offremat._numbers import _numbers, _skeleton, differing_numbers, same_sizes
from offremat._signatures import Signature, handed_values, learnable
from offremat._tensors import Structure, flatten, unflatten
from offremat._value_checks import same_value
from solvers.chain import Chain

if TYPE_CHECKING:
    from offremat._shapes import ShapePlans


def sibling(
    plans: ShapePlans, signature: Signature, batch: Any
) -> tuple[frozenset[int], Chain, Signature] | None:
    """A chain ``plans`` profiled for a call that differs from ``batch`` (of ``signature``)
    in numbers of unknown places only, those places and that call's signature; None where
    there is none (or they are known to size tensors)."""
    for known in reversed(plans.profiled):
        if known in plans.unprofiled:
            continue  # read from disk or predicted: not profiled here
        places = differing_numbers(known, signature)
        if places is not None:
            if not plans.numbers.unknown(signature, places, batch):
                return None
            return places, plans.profiled[known], known
    return None


def with_number(batch: Any, place: int, value: Any) -> Any:
    """``batch`` with ``value`` for its number at ``place`` (its order among the numbers)."""
    tensors, structure = flatten(batch)
    return unflatten(tensors, _replaced(structure, place, value, [0]))


def _replaced(structure: Structure, place: int, value: Any, counter: list[int]) -> Structure:
    if structure.kind == "value":
        if not learnable(structure.value):
            return structure
        counter[0] += 1
        return Structure("value", value=value) if counter[0] - 1 == place else structure
    children = tuple(_replaced(child, place, value, counter) for child in structure.children)
    return dataclasses.replace(structure, children=children)


def _sizes_on_these_tensors(
    plans: ShapePlans, batch: Any, place: int, value: Any, chain: Chain
) -> bool:
    """Whether ``batch``'s number at ``place`` changes its chain (``chain``) on the same
    tensors, set to ``value``: two calls' chains differ with their tensors' values too (a
    head on the masked tokens alone, routing), and a count beside them was taken to size."""
    try:
        other = plans.profile_call(with_number(batch, place, value))
    except Exception:  # the other value may not suit these tensors
        return True
    return not same_sizes(other, chain)


def _same_blocks_inputs(known: Chain, new: Chain, handed: frozenset[Any]) -> bool:
    """Whether two chains' blocks received inputs of one kind and size, and the same numbers
    and strings, but where ``new``'s is one of its call's (``handed``), which the call
    signatures tell apart. Where they differ (Hugging Face passes no mask where a batch has
    no padding, a 4-d one where it has), so may the chains, whatever the call's numbers."""
    if _blocks_input_kind(known) != _blocks_input_kind(new):
        return False
    a = known.metadata.get("chain_input_values")
    b = new.metadata.get("chain_input_values")
    if a is None or b is None or len(a) != len(b):
        return a == b
    return all(same_value(x, y) or (type(y), y) in handed for x, y in zip(a, b, strict=True))


def _blocks_input_kind(chain: Chain) -> tuple[Any, Any]:
    return chain.metadata.get("chain_input"), chain.metadata.get("chain_input_shapes")


def _alike(
    plans: ShapePlans, signature: Signature, chain: Chain, handed: frozenset[Any]
) -> tuple[frozenset[int], Chain] | None:
    """A chain ``plans`` profiled for a call that differs from ``signature`` in numbers of
    unknown places only, whose blocks received inputs of the kind, sizes and values
    ``chain``'s did; and those places."""
    for known, other in reversed(plans.profiled.items()):
        if known in plans.unprofiled or other is chain:
            continue
        places = differing_numbers(known, signature)
        unknown = places is not None and not places & plans.numbers.sizing.get(
            _skeleton(signature), frozenset()
        )
        if unknown and _same_blocks_inputs(other, chain, handed):
            return places, other
    return None


def learn(
    plans: ShapePlans,
    signature: Signature,
    batch: Any,
    found: tuple[frozenset[int], Chain, Signature],
    chain: Chain,
) -> Signature:
    """Learn from ``chain``, just profiled for ``batch``, and ``found`` (what :func:`sibling`
    gave before): where the places are neutral, every plan of ``plans`` is keyed without them
    (the latest of those that then share a key stays: they differ in those numbers alone). The
    key of ``signature`` now."""
    places, known, known_signature = found
    same = same_sizes(known, chain)
    numbers: list[Any] = []
    _numbers(known_signature[1], numbers)
    other = [numbers[p] for p in places if p < len(numbers)]
    exact = not same and len(places) == 1 and bool(other) and type(other[0]) in (int, float)
    if exact:
        # On these tensors with the other call's value: the number's doing alone.
        same = not _sizes_on_these_tensors(plans, batch, min(places), other[0], chain)
    handed = handed_values(batch)
    if not same and not exact and not _same_blocks_inputs(known, chain, handed):
        # The blocks' inputs differ too (a loop count that alternates, a padding mask):
        # which of them, or of the call's numbers, made the chains differ is not known from
        # this one; an earlier call with the blocks' inputs of this one tells.
        alike = _alike(plans, signature, chain, handed)
        if alike is None:
            if _blocks_input_kind(known) == _blocks_input_kind(chain):
                plans.numbers.forced_by(places, batch)
            return signature
        places, known = alike
        same = same_sizes(known, chain)
    plans.numbers.learn(signature, places, same, batch)
    if not plans.numbers.is_neutral(signature, places):
        return signature
    key = plans.numbers.key
    plans.executors = {key(s): e for s, e in plans.executors.items()}
    plans.profiled = {key(s): c for s, c in plans.profiled.items()}
    plans.provisional = {key(s) for s in plans.provisional}
    plans.unprofiled = {key(s) for s in plans.unprofiled}
    plans.variants = {(key(s), kind): v for (s, kind), v in plans.variants.items()}
    plans.refused = {(key(s), kind): r for (s, kind), r in plans.refused.items()}
    return key(signature)
