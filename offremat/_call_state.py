"""What a model's later call of a block must share with the chain that already ran it.

Design note. Inside a model's forward the whole run of blocks runs as one chain at one of
the model's calls of its blocks (:mod:`offremat._run`): the first, or the last where the
blocks take side inputs in turns; the model's other calls only receive that result, or a
stand-in. So the model's own code between two block calls runs after or before the blocks
do, and anything it changes there, that a block would have read, comes too late or too
early. Two kinds of change are seen, and refused:

- the mode of the call (:class:`CallContext`): grad mode, inference mode, autocast and the
  innermost ``saved_tensors_hooks``. ``torch.no_grad()`` around the first blocks is a common
  way to freeze them; run as one chain they would train.
- the block's own state (:class:`BlockState`): its submodules, by type; their plain
  attributes (a timestep embedding or a per-depth dropout rate set before each call), by
  identity and, for plain values, by value (a container that holds itself as the infinite
  value it stands for); their parameters and buffers, by identity and
  version (an in-place update under ``no_grad``). A change through ``.data`` bumps no
  version and is not seen, nor is a change to an object the block reads through another
  reference.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# The nn.Module machinery in every module's __dict__ (its parameters, buffers, submodules and
# hook tables, compared by their contents below or elsewhere), and the ``forward`` an
# interception installs on each block.
_MACHINERY = frozenset(nn.Module().__dict__) - {"training"} | {"forward"}
_SCALARS = (bool, int, float, complex, str, bytes, type(None))
_DEVICE_TYPES = ("cpu", "cuda")


_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def innermost_saved_tensor_hooks() -> tuple[Any, Any] | None:
    """The (pack, unpack) hooks of the innermost ``saved_tensors_hooks`` in force, or None."""
    return None if _TOP_HOOKS is None else _TOP_HOOKS(False)


@contextmanager
def callers_saved_tensor_hooks_set_aside() -> Iterator[None]:
    """Run without the ``saved_tensors_hooks`` in force, which come back afterwards.

    For the work a step's backward does: plain autograd saves nothing in a backward, so hooks
    the caller holds around ``loss.backward()`` pack nothing there, and must not pack a
    recomputation's saved tensors either (a lossy one, activation compression, would change
    the gradients). Without hooks in force this costs one look at the stack.
    """
    held = []
    while (hooks := innermost_saved_tensor_hooks()) is not None:
        held.append(hooks)
        torch._C._autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(held):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


@dataclass(frozen=True)
class CallContext:
    """The autograd and autocast modes a block call runs under."""

    grad: bool
    inference: bool
    autocast: tuple[tuple[bool, torch.dtype] | None, ...]  # a disabled one's dtype is moot
    saved_tensor_hooks: Any

    @classmethod
    def now(cls) -> CallContext:
        """The modes in force now."""
        return cls(
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            tuple(
                (True, torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else None
                for kind in _DEVICE_TYPES
            ),
            innermost_saved_tensor_hooks(),
        )

    def differs_from(self, other: CallContext, grad: bool = True) -> str | None:
        """How a call under ``other`` runs otherwise than one under these modes, or None (the
        grad mode left out where ``grad`` is false)."""
        if grad and self.grad != other.grad:
            return "with grad mode " + ("on" if other.grad else "off (torch.no_grad)")
        if self.inference != other.inference:
            return "with inference mode " + ("on" if other.inference else "off")
        if self.autocast != other.autocast:
            return "under another autocast"
        hooks, others = self.saved_tensor_hooks, other.saved_tensor_hooks
        if (hooks is None) != (others is None) or (
            hooks is not None and any(a is not b for a, b in zip(hooks, others, strict=True))
        ):
            return "under other saved_tensors_hooks"
        return None


@dataclass(frozen=True)
class BlockState:
    """A block's attributes, parameters and buffers, as far as a later call can tell."""

    block: nn.Module
    entries: tuple[tuple[str, Any, int], ...]

    @classmethod
    def of(cls, block: nn.Module) -> BlockState:
        """The state of ``block`` and its submodules now."""
        entries = []
        for prefix, module in block.named_modules():
            if prefix:  # a submodule swapped for another kind (an activation per depth)
                entries.append((prefix, type(module), -1))
            dot = prefix + "." if prefix else ""
            for name, value in module.__dict__.items():
                if name not in _MACHINERY:
                    entries.append((dot + name, value, _version(value)))
            for table in (module._parameters, module._buffers):
                for name, value in table.items():
                    entries.append((dot + name, value, _version(value)))
        return cls(block, tuple(entries))

    def change_in(self, later: BlockState) -> str | None:
        """The name of what differs in ``later`` (an attribute, parameter or buffer), or None.

        An attribute added since is no change where its name was unknown to the block's
        modules: the chain's run could not have read it (it would have raised; a read through
        ``getattr`` with a default is not told apart). One that shadows a class attribute (a
        default, a property) is a change: the chain's run read the class's.
        """
        now = {name: (value, version) for name, value, version in later.entries}
        before = {name for name, _, _ in self.entries}
        for name in now.keys() - before:
            prefix, _, attribute = name.rpartition(".")
            owner = self.block.get_submodule(prefix) if prefix else self.block
            if hasattr(type(owner), attribute):
                return f"{name!r} (over the class's)"
        for name, value, version in self.entries:
            if name not in now:
                return f"{name!r} (deleted)"
            other, other_version = now[name]
            if value is other:
                if version != other_version:
                    return f"{name!r} in place"
            elif not _equal_values(value, other):
                return f"{name!r}"
        return None


def _equal_values(a: Any, b: Any, compared: set[tuple[int, int]] | None = None) -> bool:
    """Whether two plain values are equal: numbers and strings (NaN equal to NaN), and lists,
    tuples, dicts and ``functools.partial`` of them; other objects only when the same one.

    A container that holds itself (``cache = []; cache.append(cache)``) is compared as an
    infinite one would be: a pair of containers met again while being compared counts as
    equal there, and the rest of the comparison decides (two such lists are equal, a cycle
    beside another number is not). ``compared`` holds the pairs met so far: any difference
    makes the whole comparison false, so a pair met again needs no second look either.
    """
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if not isinstance(a, (tuple, list, dict, functools.partial)):
        return isinstance(a, _SCALARS) and a == b
    compared = set() if compared is None else compared
    if (id(a), id(b)) in compared:
        return True
    compared.add((id(a), id(b)))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(
            _equal_values(x, y, compared) for x, y in zip(a, b, strict=True)
        )
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal_values(a[k], b[k], compared) for k in a)
    # Their own args and keywords: a tuple made here could share an id with a later one.
    return (
        a.func is b.func
        and _equal_values(a.args, b.args, compared)
        and _equal_values(a.keywords, b.keywords, compared)
    )


def _version(value: Any) -> int:
    if not isinstance(value, torch.Tensor) or value.is_inference():
        return -1  # an inference tensor has no version counter
    return value._version
