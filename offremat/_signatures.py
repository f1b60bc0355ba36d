"""What a plan depends on: a call's inputs, the blocks' own inputs, the stages' state.

A call's signature (its tensors' shapes, dtypes, devices and gradient flags, and its other
arguments; the numbers, strings and objects among them by value until
:mod:`offremat._numbers` learns they size nothing) keys its plan; the kind of the blocks'
own inputs (:func:`chain_input_kind`) keys a plan of its own where the same shapes carry other
side inputs (a padding mask); and the stages' state (:func:`stage_state`) the plans made for
it.
"""

from __future__ import annotations

import ast
import enum
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from torch.nn.modules.dropout import _DropoutNd
from torch.utils.module_tracker import ModuleTracker

try:  # torch's module trackers (see global_hooks)
    from torch.distributed._tools.mod_tracker import ModTracker

    _TRACKERS: tuple[type, ...] = (ModuleTracker, ModTracker)
except ImportError:  # a torch built without distributed support
    _TRACKERS = (ModuleTracker,)

from offremat._blocks import output_capture_hooks
from offremat._tensors import Structure, flatten

Signature = tuple[Any, ...]
StageState = tuple[tuple[Any, ...], tuple[bool, ...]]  # the modules' and their modes

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


def stage_state(stages: Sequence[nn.Module]) -> StageState:
    """What the stages' plans are made for, in one walk (it runs at every step): each
    module's type, its parameters' shapes, dtypes, devices and ``requires_grad``, its
    hooks (one that logs activations keeps them, which the profile measures) and the
    implementations its ``config`` picks (a Hugging Face model's attention
    implementation, which decides what attention saves); and each module's training
    flag; a Hugging Face layer's ``gradient_checkpointing`` flag, which
    ``gradient_checkpointing_disable`` clears alone (the profile measured what checkpointing
    saves); and its dropout rates. Not buffers: one may follow the input's shape (a mask
    cached for the last length), which each shape's own plan covers. The hooks registered
    for every module (``register_module_forward_hook`` and the like) count as each module's
    own do."""
    modules, modes = [], []
    hooks = global_hooks()
    if any(hooks):  # by code: a tool may register its hook anew at every step
        modules.append(("global hooks", *(tuple(map(_code, h.values())) for h in hooks)))
    configs: set[int] = set()
    for stage in stages:
        for module in stage.modules():
            modes.append(module.training)
            modules.append(type(module))
            checkpointing = module.__dict__.get("gradient_checkpointing")
            if checkpointing is not None:
                modules.append(("gradient_checkpointing", checkpointing))
            rates = _dropout_rates(module)
            if rates:
                modules.append(("dropout", rates))
            modules.extend(
                (p.shape, p.dtype, p.device, p.requires_grad)
                for p in module._parameters.values()
                if p is not None
            )
            hooks = (
                module._forward_pre_hooks,
                module._forward_hooks,
                module._backward_pre_hooks,
                module._backward_hooks,
            )
            if any(hooks):  # by handle id: a removed hook's id is never given again
                # Hugging Face's recording hooks record nothing in a training step.
                inert = output_capture_hooks(module)
                keys = tuple(tuple(k for k in h if k not in inert) for h in hooks)
                if any(keys):
                    modules.append(("hooks", *keys))
            config = module.__dict__.get("config")
            if config is not None and id(config) not in configs:
                configs.add(id(config))
                modules.append(("config", implementations(config)))
    return tuple(modules), tuple(modes)


def _dropout_rates(module: nn.Module) -> tuple[tuple[str, float], ...]:
    """The module's dropout rates: what a dropout layer, or a module whose rate is a plain
    attribute, saves depends on them (a mask, attention's probabilities), and a dropout
    schedule changes them between steps. A plain rate is a float whose name says ``drop``
    (``dropout``, ``attention_dropout``, BART's ``activation_dropout``, GPT-2's
    ``resid_pdrop``, ``drop_prob``): a fixed list of names missed the feed-forward rates, and
    a plan made at 0 ran at 1.23 times its budget once a schedule raised them. Other plain
    attributes are left out: one may count steps."""
    if isinstance(module, _DropoutNd):
        return (("p", module.p),)
    return tuple(
        (name, value)
        for name, value in module.__dict__.items()
        if isinstance(value, float) and "drop" in name.lower()
    )


def global_hooks() -> tuple[dict[int, Any], ...]:
    """The hooks torch runs for every module (``register_module_forward_hook`` and the like),
    by kind (forward pre-hooks, forward hooks, backward pre-hooks, backward hooks), each a
    dict from handle id to hook; empty when there are none. Left out: those of torch's
    ``ModuleTracker`` (``FlopCounterMode``'s), whose planned steps are refused
    (:func:`refuse_module_tracker`), and ``ModTracker`` (``MemTracker``'s and
    ``CommDebugMode``'s), which notes module names and keeps no tensor; each use registers
    them anew, and planning again for them would break the tracker."""
    kinds = (
        torch_module._global_forward_pre_hooks,
        torch_module._global_forward_hooks,
        torch_module._global_backward_pre_hooks,
        torch_module._global_backward_hooks,
    )
    if not any(kinds):
        return ()
    return tuple({k: h for k, h in hooks.items() if not _tracks_modules(h)} for hooks in kinds)


def _tracks_modules(hook: Any) -> bool:
    return isinstance(getattr(hook, "__self__", None), _TRACKERS)


def refuse_module_tracker() -> None:
    """Refuse a planned step while torch's ``ModuleTracker`` (``FlopCounterMode``'s) tracks
    modules: the gradient hook it puts on every module's output keeps memory alive across
    offremat's per-stage backwards, which plain autograd's one backward does not show: 6
    residual blocks (width 64, 128 rows) and a head at half of keep-all measured 1.20 times
    their budget with dp, 1.46 with milp's offloads (other models less, or nothing); torch's
    own ``checkpoint_sequential`` also holds more under it."""
    hooks = torch_module._global_forward_hooks.values()
    if any(isinstance(getattr(h, "__self__", None), ModuleTracker) for h in hooks):
        raise RuntimeError(
            "this training step runs under torch's ModuleTracker (FlopCounterMode uses it), "
            "whose gradient hooks keep memory alive across offremat's per-stage "
            "backwards, past the budget. Count the flops of the plain model "
            "(optimized.model, or a budget of 1.0, whose plan runs as plain autograd)"
        )


def _code(hook: Any) -> Any:
    """What a hook runs: its function's code (the same for each closure a ``def`` makes),
    else, for a callable object, its type."""
    code = getattr(getattr(hook, "__func__", hook), "__code__", None)
    return type(hook) if code is None else code


def implementations(config: Any) -> tuple[tuple[str, Any], ...]:
    """The implementations a model's config picks by name (``_attn_implementation_internal``):
    not its other settings, one of which may count steps."""
    attributes = getattr(config, "__dict__", {})
    return tuple(sorted((k, v) for k, v in attributes.items() if "implementation" in k))
