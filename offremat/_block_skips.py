"""A block that skips itself, seen while it is profiled, is refused.

Stochastic depth drawn inside a block (``if self.training and torch.rand(()) < p: return
x``) calls every block at every step, so the run of blocks looks fixed, but a draw that skips
a block saves nothing for it. A profile that saw such a draw measured too little for every
step where the block computes; one that saw none measured each step's most, where a skip only
saves. So the stages are watched while they are profiled: a unit holding a block of the run
(not a stem's or tail's layer, which may pass its input on, an identity or an eval dropout)
that returns its input unchanged is refused. Discovery refuses one its recorded calls saw
(:func:`offremat._discover_refusals.refuse_skipping_blocks`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

from offremat._blocks import NotAChainError
from offremat._discover_refusals import skip_message
from offremat._run import RunBlock
from offremat._tensors import version_of


@contextmanager
def skips_refused(blocks: Sequence[nn.Module]) -> Iterator[None]:
    """While active, a :class:`RunBlock` inside ``blocks`` holding a block of the run that
    returns its hidden state unchanged raises NotAChainError."""
    units = {
        id(unit): unit
        for block in blocks
        for unit in block.modules()
        if isinstance(unit, RunBlock) and any(call.side for call in unit.calls)
    }
    handles = []
    for unit in units.values():
        watch = _Watch(unit)
        handles.append(unit.register_forward_pre_hook(watch.before))
        handles.append(unit.register_forward_hook(watch.after))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class _Watch:
    """The hidden state a unit was called with, and its version then."""

    def __init__(self, unit: RunBlock):
        self.unit = unit
        self.hidden: Any = None
        self.version = 0

    def before(self, module: nn.Module, args: Any) -> None:
        self.hidden = args[0][0]
        self.version = version_of(self.hidden)

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        hidden, self.hidden = self.hidden, None
        if output[0] is hidden and version_of(hidden) == self.version:
            raise NotAChainError(skip_message(self.unit.extra_repr()))
