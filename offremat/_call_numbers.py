"""The numbers and strings of a model's call, named for an error that one of them may explain:
a number that sets how many blocks run makes another chain."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from offremat._discover import Call
from offremat._handed_on import HandedOnError


def call_numbers(model: nn.Module, call: Call) -> dict[str, Any]:
    """The numbers and strings among a call's arguments, defaults included, by the name of
    the parameter of the model's ``forward`` they bind to (one passed by position was named
    "argument 2" where the example named it, a review), else by keyword or by position."""
    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind(*call.args, **call.kwargs)
        bound.apply_defaults()
        named = {}
        for name, value in bound.arguments.items():
            kind = signature.parameters[name].kind
            # Those gathered by **kwargs and *args by their own names and positions (a
            # wrapper's forward(*args, **kwargs) hid them all, a review).
            if kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                first = len(bound.args) - len(value) + 1
                named.update({f"argument {k}": v for k, v in enumerate(value, first)})
            else:
                named[name] = value
    except (AttributeError, TypeError, ValueError):  # a list of blocks; a call it refuses
        named = {f"argument {k}": v for k, v in enumerate(call.args, 1)}
        named.update(call.kwargs)
    return {k: v for k, v in named.items() if type(v) in (int, float) or isinstance(v, str)}


def with_other_numbers(
    error: Exception, given: dict[str, Any], first: dict[str, Any] | None
) -> Exception:
    """``error``, naming the call's numbers (``given``) that differ from the example's
    (``first``): one that sets how many blocks run (a loop count, a depth) makes another
    chain, which a new user took for a broken model (the message named no argument)."""
    if first is None:
        return error
    other = [
        f"{k}={v!r} (the example's: {first[k]!r})"
        if k in first
        else f"{k}={v!r} (not in the example)"
        for k, v in given.items()
        if k not in first or first[k] != v
    ]
    other += [f"no {k} (the example's: {v!r})" for k, v in first.items() if k not in given]
    if not other:
        return error
    advice = (
        "where a number sets how many blocks run, each value is a chain of its own; optimize "
        "the model once per value (an offremat.optimize on an example with each) and call "
        "the one for the value"
    )
    if isinstance(error, HandedOnError):
        # A number may also switch on code that reads a block's output, which no value's
        # chain allows (optimizing once per value failed the same way, a review).
        advice += (
            "; where it only switches on code that reads a block's output, a plan per value "
            "does not help: turn that reading off (see above)"
        )
    return type(error)(f"{error}. This call's {', '.join(other)}: {advice}")
