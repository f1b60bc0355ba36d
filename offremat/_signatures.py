"""What a plan depends on: a call's inputs, the blocks' own inputs, the stages' state.

A call's signature (its tensors' shapes, dtypes, devices and gradient flags, and its other
arguments; the numbers, strings and objects among them by value until
:mod:`offremat._numbers` learns they size nothing) keys its plan; the kind of the blocks'
own inputs (:func:`chain_input_kind`) keys a plan of its own where the same shapes carry other
side inputs (a padding mask); and the stages' state (:mod:`offremat._stage_state`) the plans
made for it.
"""

from __future__ import annotations

import ast
import enum
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from offremat._tensors import Structure, flatten

Signature = tuple[Any, ...]

# Values that choose what a model computes: kept by value in a signature, never learnt.
_CHOICES = (
    bool,
    type(None),
    enum.Enum,
    type,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)


@dataclass(frozen=True)
class Value:
    """A string or an object among a call's arguments, as a signature keeps it: a string by
    value, an object by its repr (for most objects their address: a new object at every call
    is a new key) until :mod:`offremat._numbers` learns that it sizes nothing, as it does for
    numbers (a caption, a file name, a generator made for each step). A real number of
    another library's type (a NumPy float from a schedule) keeps its value as ``number``, for
    the range checks of :mod:`offremat._value_checks`."""

    type_name: str
    text: str
    number: int | float | None = None


def learnable(value: Any) -> bool:
    """Whether a Python value among a call's arguments can be learnt to size nothing: a
    number, a string or an object; not a flag or a choice (a bool, None, an enum, a class, a
    dtype, a device, a layout)."""
    return not isinstance(value, _CHOICES)


def input_signature(batch: Any) -> Signature:
    """What a plan depends on in a call's inputs: tensor shapes, dtypes, devices, gradient
    flags and memory layouts (:func:`memory_layout`), the rest."""
    tensors, structure = flatten(batch)
    return (
        tuple(
            (tuple(t.shape), t.dtype, str(t.device), t.requires_grad, memory_layout(t))
            for t in tensors
        ),
        _structure_key(structure),
    )


def memory_layout(tensor: torch.Tensor) -> Any:
    """How a tensor's elements lie in memory, whatever its sizes: ``"contiguous"``, else the
    order of its dimensions (those longer than one) from the outermost in memory. An
    operation may save a contiguous copy of an input that is not (a ``Linear`` on a 3-d
    transposed view), which a plan made on a contiguous batch never counted: 1.19 times the
    budget, at every step."""
    if tensor.layout != torch.strided:
        return str(tensor.layout)
    if tensor.is_contiguous():
        return "contiguous"
    dimensions = [d for d in range(tensor.dim()) if tensor.shape[d] > 1]
    return tuple(sorted(dimensions, key=lambda d: (-tensor.stride(d), d)))


VariantKey = tuple[Signature, str]
"""A call's signature and the kind of its blocks' inputs (:func:`chain_input_kind`)."""


# What a model chain's metadata says of the chain input it was profiled on.
CHAIN_INPUT_KEYS = (
    "chain_input",
    "chain_input_bytes",
    "chain_input_shapes",
    "chain_input_values",
)


def chain_input_kind(value: Any, keyed: Sequence[tuple[int, Any]] = ()) -> str:
    """What a plan depends on in the blocks' own inputs beyond the call's shapes: which side
    inputs are tensors and which None (Hugging Face passes no mask where the attention mask
    is all ones, a 4-d one where a batch of the same shape is padded), their dtypes and ranks,
    and which carry a gradient; flags and choices (a bool, None, an enum, a dtype) by value.
    Numbers, strings and objects by type: one the model computes from the batch (a count, a
    scale, a caption made lower case) may be another at every step, and one handed down from
    the call (a caption in Hugging Face's ``**kwargs``) is the call signature's to key. But
    the values ``keyed`` (position among :func:`block_values`, value) by value: a measured
    step found that they decide what the blocks save (a loop count, a mode:
    :mod:`offremat._shape_variants`)."""
    tensors, structure = flatten(value)
    kind: tuple[Any, ...] = (
        tuple((str(t.dtype), t.dim(), t.requires_grad) for t in tensors),
        _structure_key(structure, True),
    )
    if keyed:  # repr tells 1 from 1.0 and True, as same_value does
        kind += (tuple((at, repr(v)) for at, v in keyed),)
    return repr(kind)


BlockValue = int | float | str | bool
"""A number or string among the blocks' inputs, or a 0-d tensor's value."""


def block_values(value: Any) -> list[BlockValue]:
    """The numbers and strings among the blocks' own inputs ``value``, and the values of
    their 0-d tensors (a length the model computes as ``lengths.max()`` and the blocks slice
    to, a temperature passed as a tensor), in order: their values are checked by measured steps
    (:mod:`offremat._shape_variants`). Reading a tensor on a GPU waits for it; a model that
    sizes a tensor by that value waits for it anyway."""
    tensors, structure = flatten(value)
    found: list[BlockValue] = []
    _block_values(structure, iter(tensors), found)
    return found


def _block_values(structure: Structure, tensors: Iterator[torch.Tensor], found: list[Any]) -> None:
    # In flatten's order, which is the order of its tensors.
    if structure.kind == "tensor":
        tensor = next(tensors)
        if _is_value_tensor(tensor):
            found.append(tensor.item())
    elif structure.kind == "value" and _is_block_value(structure.value):
        found.append(structure.value)
    for child in structure.children:
        _block_values(child, tensors, found)


def _is_value_tensor(tensor: torch.Tensor) -> bool:
    # A float too may pick a branch (a temperature past a threshold ran at 1.46 times the
    # budget, unmeasured), one computed from the activations as well (a score the blocks
    # branch on ran 20 steps in 40 at 1.53 times, unmeasured, in a review); not a learned
    # parameter handed as it is (a gate, which the optimizer moves at every step: 75 to 94%
    # of steps were measured, in a review), which is computed with, not decided on; a fake
    # tensor (a predicted chain) has no value.
    return (
        tensor.dim() == 0
        and not (tensor.requires_grad and tensor.is_leaf)
        and not tensor.is_complex()
        and tensor.device.type != "meta"
    )


def handed_values(batch: Any) -> frozenset[tuple[type, int | float | str]]:
    """The numbers and strings among a call's arguments, which may reach the blocks, by type
    and value (a temperature of 3.0 is no loop count of 3)."""
    found: set[Any] = set()
    pending = [flatten(batch)[1]]
    while pending:
        structure = pending.pop()
        if structure.kind == "value" and _is_block_value(structure.value):
            found.add((type(structure.value), structure.value))
        pending.extend(structure.children)
    return frozenset(found)


def _real_number(value: Any) -> int | float | None:
    """``value`` as a Python number where it is a real number of another type (NumPy's)."""
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def _is_block_value(value: Any) -> bool:
    return type(value) in (int, float) or isinstance(value, str)


def chain_input_shapes(value: Any) -> str:
    """The shapes of the blocks' input tensors: the call's shapes decide them, except where
    the code before the blocks sizes them by the batch's values (padding removed, tokens
    packed: a hidden state of as many rows as the mask has valid tokens), and then a plan made
    for one size must not run another. A string, as the disk cache's metadata keeps it."""
    return repr(tuple(tuple(t.shape) for t in flatten(value)[0]))


def _structure_key(structure: Structure, by_type: bool = False) -> Any:
    if structure.kind == "tensor":
        return "tensor"
    if structure.kind == "value":
        value = structure.value
        if by_type and learnable(value):
            return type(value).__qualname__
        if type(value) in (int, float) or isinstance(value, (bool, type(None))):
            return value
        if learnable(value):
            text = value if isinstance(value, str) else repr(value)
            return Value(type(value).__qualname__, text, _real_number(value))
        return value if isinstance(value, (int, float, str)) else repr(value)
    container = structure.value if structure.kind == "sequence" else structure.value[1]
    return (
        structure.kind,
        repr(container),
        tuple(_structure_key(child, by_type) for child in structure.children),
    )


def differing_size(
    known: Signature, new: Signature
) -> tuple[frozenset[tuple[int, int]], int, int] | None:
    """Where ``new`` differs from ``known`` if it differs in one size only, and that size.

    The positions (tensor, dimension) that differ, at most one per tensor (a sequence length
    shared by the ids and the mask), the size ``new`` has at all of them and the size
    ``known`` has at all of them; None if anything else differs.
    """
    if known[1] != new[1] or len(known[0]) != len(new[0]):
        return None
    positions = []
    for index, (a, b) in enumerate(zip(known[0], new[0], strict=True)):
        if a[1:] != b[1:] or len(a[0]) != len(b[0]):
            return None
        positions += [(index, d) for d, (x, y) in enumerate(zip(a[0], b[0], strict=True)) if x != y]
    if not positions:
        return None
    if len({t for t, _ in positions}) != len(positions):
        # Two dimensions of one tensor (an image's height and width): sizes grow as their
        # product, a polynomial of twice the degree solvers.predict fits. Profile it.
        return None
    new_sizes = {new[0][t][0][d] for t, d in positions}
    known_sizes = {known[0][t][0][d] for t, d in positions}
    if len(new_sizes) != 1 or len(known_sizes) != 1:
        return None
    return frozenset(positions), new_sizes.pop(), known_sizes.pop()


def describe(signature: Signature) -> str:
    """The shapes of a signature, for messages: ``(8, 128) int64, (8, 128) int64``, and
    ``requiring grad`` after a tensor that does (a plan of its own: its gradient is computed),
    the order of its dimensions in memory after one not contiguous (a plan of its own too);
    then the numbers and strings it keeps by value (``with k=32``), which key plans too."""
    shapes = ", ".join(
        f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"
        + (" requiring grad" if requires_grad else "")
        + ("" if layout == "contiguous" else f" not contiguous ({_laid_out(layout)})")
        for shape, dtype, _, requires_grad, layout in signature[0]
    )
    values = list(_keyed_values(signature[1]))
    return shapes + (" with " + ", ".join(values) if values else "")


def _keyed_values(key: Any, name: str = "") -> Iterator[str]:
    """``name=value`` for each number or string a structure key keeps by value."""
    if isinstance(key, Value):
        shown = _shortened(repr(key.text) if key.type_name == "str" else key.text)
        yield f"{name}={shown}" if name else shown
        return
    if type(key) in (int, float):
        yield f"{name}={key!r}" if name else repr(key)
        return
    if not (isinstance(key, tuple) and len(key) == 3 and key[0] in ("dict", "sequence")):
        return
    kind, container, children = key
    names = [""] * len(children)
    if kind == "dict":
        try:
            keys = ast.literal_eval(container)
        except (ValueError, SyntaxError):
            keys = None
        if isinstance(keys, (list, tuple)) and len(keys) == len(children):
            names = [str(k) for k in keys]
    for child_name, child in zip(names, children, strict=True):
        yield from _keyed_values(child, child_name)


def _shortened(text: str, most: int = 40) -> str:
    """``text``, cut to ``most`` characters: a caption of 300 was quoted whole (a review)."""
    return text if len(text) <= most else text[: most - 3] + "..."


def _laid_out(layout: Any) -> str:
    if isinstance(layout, str):
        return layout
    return "dimensions " + ", ".join(map(str, layout)) + " from the outermost in memory"
