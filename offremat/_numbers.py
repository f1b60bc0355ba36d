"""Number arguments that change between steps (a count, a scale) without a plan each.

A call's signature (:func:`offremat._signatures.input_signature`) keeps its Python numbers by
value, since one may size a tensor (``logits[:, -n:]``, ``x[:, :n]``). But a number that
changes at every step (Hugging Face's ``num_items_in_batch`` passed as an int, a loss scale or
a temperature a training loop varies) then profiled the model at every step and kept one plan
per value without end. So what each number does is learnt, once, from a real profile, per
place (its position among the numbers of calls of one structure: the same arguments, given
the same way):

- the first time a call differs from a profiled one only in the values of numbers whose
  place is not known yet, it is profiled as any new signature is; where the two chains agree
  in every byte figure (each stage's, the code around the blocks', the blocks' input sizes
  and kinds), those places are *neutral*: their values leave the plans' keys (kept by type),
  and every later value reuses the plan without profiling. A number the blocks receive but
  that sizes nothing is neutral too (Hugging Face hands ``num_items_in_batch`` to every
  decoder layer through ``**kwargs``): the plan depends on sizes, which it leaves alone;
- where the chains differ, the places *size* tensors and keep their values in the key: a
  plan per value, as for any new shape. Once such numbers have forced
  :data:`NUMBER_PLANS_BEFORE_WARNING` plans, a warning says to pass them as tensors; the
  plans of the last :data:`offremat._shape_solving.KEPT_SIGNATURES` signatures are kept, so memory
  stays bounded.

Strings and other objects among the arguments are learnt the same way (a caption or a file
name carried through ``**batch``, a generator made for each step: an object is keyed by its
repr, which for most objects holds their address, so each new one was a profile and a plan,
at every step; :class:`offremat._signatures.Value`); flags and choices (a bool, None, an enum,
a dtype) key plans by value.

An ``nn.Sequential`` hands its input, numbers included, to its first block: it learns no
place (each value its plan, bounded the same way). Every step still checks the blocks' input
sizes and kinds (:meth:`offremat._shapes.ShapePlans.for_chain_input`), and, where a key left
numbers out, the shapes of the model's output (:meth:`NumberPlaces.check_output`): a number
that sizes nothing on the two values compared but does on another (a task id that picks a
head of another size) is found there, after the one step that ran on another value's plan,
and from then on its values key plans. One that makes a block save more on another value
without changing a shape (a loop past a threshold) is found by the first step on a new
value, measured as a plan read from disk is (:mod:`offremat._value_checks`, which says
which steps are measured, and which numbers a step measured over its budget blames): that step
may pass the budget, and the next plans the blamed numbers' values anew.
"""

from __future__ import annotations

import logging
from typing import Any

from offremat._signatures import Signature, Value, learnable
from offremat._tensors import Structure, flatten
from offremat._value_checks import Place, ValueChecks, same_value, trim
from solvers.chain import Chain
from solvers.chain_limits import STAGE_BYTE_FIELDS

logger = logging.getLogger(__name__)

_NUMBERS = (int, float)  # exact types: a bool is a flag, an enum a choice
_ERASED = "number"  # a marker (_ERASED, type name): a 2-tuple, where a container's is a 3-tuple

NUMBER_PLANS_BEFORE_WARNING = 3
"""How many plans a number's changing value makes before the warning to pass it as a tensor."""


def erased(signature: Signature, places: frozenset[int] | None) -> Signature:
    """``signature`` with the numbers at ``places`` (their order among its numbers; None: all
    of them) by type."""
    if places is not None and not places:
        return signature
    counter = [0]
    return (signature[0], _erase(signature[1], places, counter))


def _erase(key: Any, places: frozenset[int] | None, counter: list[int]) -> Any:
    if _is_number(key):
        place = counter[0]
        counter[0] += 1
        if (places is None or place in places) and type(key) is not tuple:
            return (_ERASED, key.type_name if type(key) is Value else type(key).__name__)
        return key
    if type(key) is tuple and len(key) == 3:  # (kind, container, children)
        kind, container, children = key
        return (kind, container, tuple(_erase(child, places, counter) for child in children))
    return key


def _is_number(key: Any) -> bool:
    """Whether a signature's key is a learnable value's (a number, a string, an object)."""
    if type(key) in _NUMBERS or type(key) is Value:
        return True
    return type(key) is tuple and len(key) == 2 and key[0] == _ERASED


def _numbers(key: Any, found: list[Any]) -> None:
    if _is_number(key):
        found.append(key)
    elif type(key) is tuple and len(key) == 3:
        for child in key[2]:
            _numbers(child, found)


def differing_numbers(known: Signature, new: Signature) -> frozenset[int] | None:
    """The places of the numbers in which ``new`` differs from ``known``, where nothing else
    differs (tensors, structure, other values) and some number does; else None."""
    if known[0] != new[0]:
        return None
    a: list[Any] = []
    b: list[Any] = []
    _numbers(known[1], a)
    _numbers(new[1], b)
    if len(a) != len(b):
        return None
    places = frozenset(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if not same_value(x, y))
    if not places or erased(known, places) != erased(new, places):
        return None
    return places


# The chain figures a plan depends on: every byte (STAGE_BYTE_FIELDS, and these of its
# metadata), not a time (a profile's are rough).
_METADATA_BYTES = (
    "outside",
    "chain_input",
    "chain_input_bytes",
    "chain_input_shapes",
    "kept_by_modules_bytes",
    "shared_gradient_bytes",
    "pinned_gradient_bytes",
)


def same_sizes(a: Chain, b: Chain) -> bool:
    """Whether two chains agree in every byte figure, the code around the blocks and the
    blocks' inputs (kind and sizes) included: a plan of one holds for the other."""
    return _sizes(a) == _sizes(b)


def _sizes(chain: Chain) -> tuple[Any, ...]:
    return (
        chain.length,
        chain.input_bytes,
        chain.input_grad_bytes,
        chain.held_bytes,
        chain.frozen_stages,
        tuple(tuple(getattr(s, f) for f in STAGE_BYTE_FIELDS) for s in chain.stages),
        tuple(repr(chain.metadata.get(k)) for k in _METADATA_BYTES),
    )


def number_names(batch: Any) -> list[str]:
    """Where each number of ``batch`` is, in order (``num_items_in_batch``, ``at position 2``
    for the second positional argument, ``input[1]``): for messages."""
    structure = flatten(batch)[1]
    names: list[str] = []
    if type(batch).__name__ == "Call":  # positional arguments, then keyword arguments
        args, kwargs = structure.children
        for index, child in enumerate(args.children):
            _names(child, f"at position {index + 1}", names)
        for key, child in zip(kwargs.value[1], kwargs.children, strict=True):
            _names(child, str(key), names)
    else:
        _names(structure, "input", names)
    return names


def _names(structure: Structure, path: str, names: list[str]) -> None:
    if structure.kind == "value":
        if learnable(structure.value):
            names.append(path)
        return
    keys = structure.value[1] if structure.kind == "dict" else range(len(structure.children))
    for key, child in zip(keys, structure.children, strict=True):
        _names(child, f"{path}[{key!r}]", names)


def _skeleton(signature: Signature) -> Any:
    """The call's structure with every number by type: a place means one argument in it."""
    return erased(signature, None)[1]


KEPT_SKELETONS = 64
"""How many call structures keep what was learnt of their numbers (the latest learnt)."""


class NumberPlaces:
    """What is learnt of the places of a call's numbers, per call structure (an argument
    given by keyword or by position is another structure): neutral or sizing (module notes)."""

    def __init__(self, learns: bool = True):
        self.learns = learns
        self.neutral: dict[Any, frozenset[int]] = {}
        self.sizing: dict[Any, frozenset[int]] = {}
        self.forced = 0
        self.warned = False
        # The shapes of the model's output in the first step on each key with neutral places.
        self.outputs: dict[Signature, str] = {}
        self.checks = ValueChecks()
        # How many measured steps over their budget blamed each place (see over_budget).
        self.blames: dict[tuple[Any, int], int] = {}

    def key(self, signature: Signature) -> Signature:
        """The key of ``signature``'s plan: its neutral numbers by type."""
        if not self.neutral:
            return signature
        return erased(signature, self.neutral.get(_skeleton(signature), frozenset()))

    def keyed_floats(self, signature: Signature) -> dict[int, Any]:
        """The floats of ``signature`` at places that key plans, by place: Python's, and
        NumPy's scalars (a schedule computed with NumPy was a profile at every step, 40 in
        40, in a review)."""
        places = self.sizing.get(_skeleton(signature), frozenset())
        if not places:
            return {}
        found: list[Any] = []
        _numbers(signature[1], found)
        return {p: found[p] for p in sorted(places) if p < len(found) and _is_float(found[p])}

    def is_neutral(self, signature: Signature, places: frozenset[int]) -> bool:
        """Whether ``places`` are all known neutral in ``signature``'s structure."""
        return places <= self.neutral.get(_skeleton(signature), frozenset())

    def unknown(self, signature: Signature, places: frozenset[int], batch: Any) -> bool:
        """Whether none of ``places`` (where ``batch``'s numbers differ from a profiled
        call's) is known yet; else a plan is forced by numbers that size tensors."""
        if places & self.sizing.get(_skeleton(signature), frozenset()) or not self.learns:
            self.forced_by(places, batch)
            return False
        return True

    def learn(self, signature: Signature, places: frozenset[int], same: bool, batch: Any) -> None:
        """``places`` are neutral where their chains agree (``same``), else they size; where
        several differ and the chains do too, which of them sizes is not known: nothing is
        learnt, and a later call that differs in one of them alone tells."""
        skeleton = _skeleton(signature)
        blamed_once = any(self.blames.get((skeleton, p)) == 1 for p in places)
        if not same and (len(places) > 1 or blamed_once):
            # Blamed once, a place keys plans until two profiles agree (see over_budget): the
            # profile it differs from may be of a value on the other side of a threshold.
            self.forced_by(places, batch)
            return
        learnt = self.neutral if same else self.sizing
        learnt[skeleton] = learnt.pop(skeleton, frozenset()) | places
        trim(learnt, KEPT_SKELETONS)
        if same and blamed_once:
            for place in places:  # found neutral again: on one side of a threshold, maybe
                self.checks.forget((skeleton, place))
        if same:
            logger.info(
                "%s changed and no size with it (a second profile agrees with the first in "
                "every byte): its values no longer key plans",
                _named(places, batch),
            )
        else:
            self.forced_by(places, batch)

    def check_output(self, signature: Signature, output: Any, batch: Any) -> None:
        """After a step on ``batch``: where its key left numbers out, the model's output must
        have the shapes it had in the key's first step. Where it has not, a neutral number
        sizes a tensor after all (on a value other than the two profiled: a task id that
        picks a head): its values key plans again from the next step, said aloud."""
        key = self.key(signature)
        if key is signature:
            return
        shapes = repr(tuple(tuple(t.shape) for t in flatten(output)[0]))
        seen = self.outputs.setdefault(key, shapes)
        trim(self.outputs, KEPT_SKELETONS)
        if seen == shapes:
            return
        skeleton = _skeleton(signature)
        places = self.neutral.get(skeleton, frozenset())
        self._sizes_after_all(
            skeleton,
            places,
            places,
            batch,
            f"the model's output changed shape ({shapes} where it was {seen})",
        )

    def verifies(self, signature: Signature, key: Signature) -> bool:
        """Whether a step on ``signature`` (of plan key ``key``) is to be measured (the plan's
        ``verify_next``): see :mod:`offremat._value_checks`."""
        if key is signature:
            return False
        skeleton = _skeleton(signature)
        values: list[Any] = []
        _numbers(signature[1], values)
        neutral = self.neutral.get(skeleton, frozenset())
        left_out = [(place, value) for place, value in enumerate(values) if place in neutral]
        return self.checks.verifies(signature, key, skeleton, left_out)

    def left_out(self, signature: Signature) -> frozenset[tuple[type, Any]]:
        """The numbers of a call of ``signature`` that its plan's key leaves out, by type and
        value: the call's checks measure the steps on their new values."""
        neutral = self.neutral.get(_skeleton(signature), frozenset())
        values: list[Any] = []
        _numbers(signature[1], values)
        return frozenset(
            (type(v), v) for at, v in enumerate(values) if at in neutral and type(v) in (int, float)
        )

    def within_budget(self, key: Signature) -> None:
        """The step measured on ``key``'s plan, if any, ended within its budget."""
        self.checks.within_budget(key)

    def over_budget(self, key: Signature, signature: Signature, batch: Any) -> frozenset[Place]:
        """A step measured on ``key``'s plan passed its budget: of the numbers that key leaves
        out, those it blames key plans again (``signature`` and ``batch``: the call after that
        step), until profiles of two of their values agree in every byte; blamed twice, for
        good. The places of the other values it checked that it blames (the numbers and
        strings the blocks receive: :mod:`offremat._shape_variants`)."""
        skeleton = _skeleton(signature)
        own = frozenset((skeleton, p) for p in self.neutral.get(skeleton, frozenset()))
        others = self.checks.measured(key) - own
        blamed = self.checks.blamed(key, own | others)
        places = frozenset(p for _, p in blamed & own)
        for place in places:
            self.blames[(skeleton, place)] = self.blames.pop((skeleton, place), 0) + 1
        trim(self.blames, KEPT_SKELETONS)
        if places:
            again = frozenset(p for p in places if self.blames[(skeleton, p)] > 1)
            seen = "a step measured over its plan's budget"
            self._sizes_after_all(skeleton, places, again, batch, seen)
        return blamed & others

    def _sizes_after_all(
        self, skeleton: Any, places: frozenset[int], sizing: frozenset[int], batch: Any, seen: str
    ) -> None:
        """``places`` key plans again, ``sizing`` of them for good: a neutral number sized
        something after all (``seen``), or may have."""
        left = self.neutral.pop(skeleton, frozenset()) - places
        if left:
            self.neutral[skeleton] = left
        self.sizing[skeleton] = self.sizing.get(skeleton, frozenset()) | sizing
        told = []
        if sizing:
            told.append(f"each value of {_named(sizing, batch)} gets its own plan")
        if places - sizing:
            told.append(
                f"the values of {_named(places - sizing, batch)} key plans until the profiles "
                "of two of them agree in every byte"
            )
        logger.warning(
            "%s with the Python argument %s, which a second profile had found to size nothing: "
            "that step ran on the plan of another value, and could pass its budget; from now "
            "on %s",
            seen,
            _named(places, batch),
            "; ".join(told),
        )

    def forced_by(self, places: frozenset[int], batch: Any) -> None:
        """Count a plan that ``places`` forced; past a few, say to pass them as tensors."""
        self.forced += 1
        if self.forced >= NUMBER_PLANS_BEFORE_WARNING and not self.warned:
            self.warned = True
            logger.warning(
                "the model is profiled and planned again for each value of the Python argument "
                "%s: %s, so its value keys plans (those of the last %d signatures are kept). "
                "Pass a number that only scales a loss as a tensor, or keep it to a few values",
                _named(places, batch),
                "it changes what the model saves"
                if self.learns
                else "it is part of the input an nn.Sequential hands its first block",
                _kept_signatures(),
            )


def _named(places: frozenset[int], batch: Any) -> str:
    names = number_names(batch)
    return ", ".join(names[p] for p in sorted(places) if p < len(names))


def _kept_signatures() -> int:
    from offremat._shape_solving import KEPT_SIGNATURES  # it imports this module

    return KEPT_SIGNATURES


def _is_float(number: Any) -> bool:
    return type(number) is float or (type(number) is Value and number.type_name.startswith("float"))
