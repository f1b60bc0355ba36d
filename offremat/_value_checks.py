"""Which steps on values a plan's key leaves out are measured, and which places a step
measured over its budget blames (:mod:`offremat._numbers` learns the places).

A number learnt to size nothing from two profiled values may still make a block save more on
another (a loop past a threshold) without changing a shape; only a measured step finds it.
Measuring every step would slow each on CPU (the dispatch tracker), so per call structure the
first :data:`MEASURED_VALUES` new values are measured, then one in :data:`MEASURED_EVERY`;
and, whatever the call's other numbers hold, a new value at a place that has taken fewer than
:data:`CATEGORY_VALUES` (a loop count, a task's name: a category, not a number new at every
step), a value back at its place that no measured step had, and a number beyond the range
a place's measured steps within budget have spanned (a length that grows over training, an
annealed temperature: past the first values, a curriculum's lengths ran 20 steps at up to
1.51 times the budget, unmeasured; such a number has every step measured while it grows).
Kept per place, not per call: beside a temperature new at every step no whole call ever
comes back, and a task's value past a threshold went unmeasured for 32 steps.

A measured step over its budget blames the places whose values no step had measured within
it, and of those the ones that have taken the fewest values: a category (a task's name, a
loop count) rather than a number new at every step (a temperature, a count of tokens), whose
every new value would otherwise key a plan (a profile at every step). Blamed wrongly, a
place is found on its next measured step over, as before.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

from offremat._signatures import Signature, Value

MEASURED_VALUES = 8
"""How many new values, per call structure, of the numbers a plan's key leaves out have the
first step on each measured."""

CATEGORY_VALUES = 64
"""A new value at a place that has taken fewer values than this has its first step measured,
whatever the call's other values hold (a task's id among 16, one of which adds a branch, ran
its first step unmeasured at 1.46 times the budget when 8 was the bound)."""

MEASURED_EVERY = 32
"""After those, the first step on one new value in this many is measured."""

KEPT_VALUES = 4096
"""How many calls, and values at their places, are remembered as checked or seen."""

KEPT_STRUCTURES = 64
"""How many call structures keep their counts (the latest used)."""


def value_digest(value: Any) -> bytes:
    """A value's identity for the records of checked values."""
    # By digest: a signature holds its strings whole (a caption of kilobytes, each step).
    # Not hash(): hash(-1) == hash(-2), so two values would pass for one.
    return hashlib.blake2b(repr(value).encode(), digest_size=16).digest()


Place = tuple[Any, Any]
"""Where a value is: its call structure (or the blocks' inputs of a plan), and its position."""


class ValueChecks:
    """The values of the numbers that plans' keys leave out, as checked by measured steps."""

    def __init__(self) -> None:
        # Calls, and values at their place, measured within budget, by plan key: a value
        # checked on a plan profiled on it says nothing of another plan (a loop count checked
        # on a padded batch's plan ran at 1.61 times the budget on the unpadded one's,
        # unmeasured), nor of the plan that replaces it under its key (:meth:`replaced`).
        self.checked: dict[tuple[bytes, bytes], None] = {}
        self.within: dict[tuple[bytes, bytes], None] = {}
        self.unmeasured: dict[bytes, None] = {}  # values at their place seen, not measured
        self.new_calls: dict[Any, int] = {}  # per structure
        self.seen: dict[bytes, None] = {}  # values at their place seen
        self.distinct: dict[Place, int] = {}  # how many values each place took
        # Per place and plan key, the least and greatest number that measured steps within
        # budget held.
        self.spanned: dict[tuple[Place, bytes], Span] = {}
        # Per plan key, the values at their places that the step measured last on it holds,
        # and its calls.
        self.pending: dict[Signature, dict[Place, tuple[bytes, Any]]] = {}
        self.pending_calls: dict[Signature, set[bytes]] = {}
        # The step each plan key's pending values were measured in (see next_step).
        self.step = 0
        self.pending_step: dict[Signature, int] = {}

    def next_step(self) -> None:
        """A step begins. Values left pending by an earlier step, whose backward never ran
        (or whose check goes on to this one), are not this step's: merged into its check,
        they were taken as checked by a step that never ran them (a count past a forward
        without its backward ran 4 steps in 4 at 1.05 times the budget, unmeasured, in a
        review); they are measured again where they come back."""
        self.step += 1

    def verifies(
        self,
        signature: Signature,
        key: Signature,
        structure: Any,
        values: list[tuple[Any, Any]],
        measured: bool = False,
    ) -> bool:
        """Whether the step on ``signature`` (of plan key ``key``) is to be measured (module
        notes); ``values``: each number the key leaves out, by its position in ``structure``.
        Where the step is ``measured`` anyway, they join what it checks."""
        places = {(structure, at): (value_digest((structure, at, v)), v) for at, v in values}
        # A new value where few have been (a loop count, a task), beside one new at every step.
        category = False
        for place, (seen, _) in places.items():
            if seen not in self.seen:
                self.seen[seen] = None
                category |= self.distinct.get(place, 0) < CATEGORY_VALUES
                self.distinct[place] = self.distinct.pop(place, 0) + 1
        trim(self.seen, KEPT_VALUES)
        trim(self.distinct, KEPT_VALUES)
        digest, plan = value_digest(signature), value_digest(key)
        chosen = False
        if (plan, digest) not in self.checked:
            back = any(
                d in self.unmeasured and (plan, d) not in self.within for d, _ in places.values()
            )
            beyond = any(self._beyond((place, plan), v) for place, (_, v) in places.items())
            count = self.new_calls.pop(structure, 0) + 1
            self.new_calls[structure] = count
            trim(self.new_calls, KEPT_STRUCTURES)
            chosen = back or category or beyond
            chosen |= count <= MEASURED_VALUES or count % MEASURED_EVERY == 0
        if self.pending_step.get(key, self.step) != self.step:
            self.not_settled(key)  # left by an earlier step (next_step)
        if measured or chosen:
            # The call's checks and the blocks' join in one step.
            self.pending[key] = {**self.pending.pop(key, {}), **places}
            self.pending_calls[key] = self.pending_calls.pop(key, set()) | {digest}
            self.pending_step[key] = self.step
            # A plan key new at every step (a stand-in's) leaves its measurement to no later
            # step: kept for the latest keys only.
            trim(self.pending, KEPT_STRUCTURES)
            trim(self.pending_calls, KEPT_STRUCTURES)
            trim(self.pending_step, KEPT_STRUCTURES)
            return True
        if (plan, digest) not in self.checked:
            self.unmeasured.update(dict.fromkeys(d for d, _ in places.values()))
            trim(self.unmeasured, KEPT_VALUES)
        return False

    def _beyond(self, where: tuple[Place, bytes], value: Any) -> bool:
        """Whether ``value``, a finite number, lies outside what a place has spanned on a
        plan (``where``)."""
        span, number = self.spanned.get(where), _finite_number(value)
        return number is not None and (span is None or not span[0] <= number <= span[1])

    def move(self, key: Any, to: Any) -> None:
        """The step measured on ``key``'s plan runs on ``to``'s: its values go with it."""
        places = self.pending.pop(key, None)
        if places is not None:
            if self.pending_step.get(to, self.step) != self.step:
                self.not_settled(to)  # left by an earlier step (next_step)
            self.pending.setdefault(to, {}).update(places)
            self.pending_calls.setdefault(to, set()).update(self.pending_calls.pop(key, ()))
            self.pending_step[to] = self.pending_step.pop(key, self.step)

    def not_settled(self, key: Signature) -> None:
        """The step measured on ``key``'s plan passed its budget for another reason than its
        values (a plan read from disk or predicted, not profiled at its shape): they are to
        be measured again (a loop count over on such a step was taken for checked)."""
        for digest, _ in self._unsettled(key).values():
            self.unmeasured[digest] = None
        trim(self.unmeasured, KEPT_VALUES)

    def _unsettled(self, key: Signature) -> dict[Place, tuple[bytes, Any]]:
        self.pending_calls.pop(key, None)
        self.pending_step.pop(key, None)
        return self.pending.pop(key, {})

    def forget(self, place: Place) -> None:
        """Measure ``place``'s next new values as a new place's: the values it took were
        found to size nothing, but only on one side of what they may decide."""
        self.distinct.pop(place, None)
        for where in [where for where in self.spanned if where[0] == place]:
            del self.spanned[where]

    def within_budget(self, key: Signature) -> None:
        """The step measured on ``key``'s plan ended within its budget: its values are checked."""
        plan = value_digest(key)
        self.pending_step.pop(key, None)
        self.checked.update(dict.fromkeys((plan, d) for d in self.pending_calls.pop(key, ())))
        trim(self.checked, KEPT_VALUES)
        for place, (digest, value) in self.pending.pop(key, {}).items():
            self.within[(plan, digest)] = None
            self.unmeasured.pop(digest, None)
            number = _finite_number(value)
            if number is not None:
                low, high = self.spanned.pop((place, plan), (number, number))
                self.spanned[(place, plan)] = (min(low, number), max(high, number))
        trim(self.within, KEPT_VALUES)
        trim(self.spanned, KEPT_VALUES)

    def replaced(self, key: Any) -> None:
        """``key`` has a new plan (profiled on other values, or improved): nothing measured
        on the one before is checked on it. A call and a count checked on a key's first plan
        ran at 1.05 times the budget, unmeasured, on the plan of a later profile (a review)."""
        plan = value_digest(key)
        self._unsettled(key)
        for call in [call for call in self.checked if call[0] == plan]:
            del self.checked[call]
        for within in [within for within in self.within if within[0] == plan]:
            del self.within[within]
            self.unmeasured[within[1]] = None  # measured where it comes back
        trim(self.unmeasured, KEPT_VALUES)
        for where in [where for where in self.spanned if where[1] == plan]:
            del self.spanned[where]

    def measured(self, key: Signature) -> frozenset[Place]:
        """The places whose values the step measured last on ``key``'s plan checks, until it
        is settled (:meth:`within_budget`, :meth:`blamed`)."""
        return frozenset(self.pending.get(key, ()))

    def blamed(self, key: Signature, suspects: frozenset[Place]) -> frozenset[Place]:
        """Of the ``suspects``, those to blame for the step measured over its budget on
        ``key``'s plan (module notes); all of them where that step is not known."""
        # The calls stay unchecked, and their values are measured where they come back
        # unkeyed (found neutral again on two values of one side, a task's id that ran over
        # ran unmeasured at every later step on it).
        self.pending_calls.pop(key, None)
        self.pending_step.pop(key, None)
        places = self.pending.pop(key, None)
        if places is None:
            return suspects
        self.unmeasured.update(dict.fromkeys(d for d, _ in places.values()))
        trim(self.unmeasured, KEPT_VALUES)
        plan = value_digest(key)
        unchecked = [p for p in suspects if p in places and (plan, places[p][0]) not in self.within]
        if not unchecked:  # each value checked alone: their combination passed it
            return suspects
        least = min(self.distinct.get(p, 0) for p in unchecked)
        return frozenset(p for p in unchecked if self.distinct.get(p, 0) == least)


Span = tuple[float, float]
"""The least and the greatest of the numbers some measured steps held."""


def _finite_number(value: Any) -> int | float | None:
    """``value`` as a finite Python number, or None: a NumPy number as Python's (an annealed
    NumPy temperature was never past the range spanned: 12 steps in 12 at 1.46 times the
    budget, unmeasured, in a review)."""
    if type(value) is Value:
        value = value.number
    # An int is finite however large (math.isfinite overflows past a float's range).
    if type(value) is int or (type(value) is float and math.isfinite(value)):
        return value
    return None


def same_value(a: Any, b: Any) -> bool:
    """Whether two numbers or strings are one value (a NaN as itself, 1 not 1.0 or True)."""
    return type(a) is type(b) and (a == b or (a != a and b != b))


def trim(mapping: dict[Any, Any], kept: int) -> None:
    """Keep the ``kept`` latest entries of ``mapping`` (in insertion order)."""
    while len(mapping) > kept:
        mapping.pop(next(iter(mapping)))
