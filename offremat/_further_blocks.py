"""Blocks of the run's kind that the chain does not hold, guarded for one training step.

A model may choose its depth per step (``for b in self.blocks[: int(depth)]``): the chain
holds the blocks the example batch ran, and a later step that runs more calls blocks the
interception does not know, on the chain's output, outside the plan. Those calls are refused
before they run. The guarded modules are the other children of the containers that hold the
run's blocks, of the blocks' type: a block elsewhere (a second tower, a decoder) is the
model's own code, and a call with other inputs than the run's output and side inputs is too.
A call of one of the run's own modules again is checked by the interception
(:class:`offremat._run.RunInterception`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from offremat._block_values import continues_run, further_block_message
from offremat._blocks import NotAChainError
from offremat._discover import BlockRun
from offremat._run import RunInterception


@contextmanager
def further_blocks_refused(
    model: nn.Module, run: BlockRun, interception: RunInterception
) -> Iterator[None]:
    """While active, a call of a sibling block (see the module's notes) that takes the run's
    output and side inputs, once ``interception`` has run the chain, raises NotAChainError."""
    handles = [
        module.register_forward_pre_hook(_Guard(interception, path, run), with_kwargs=True)
        for path, module in _siblings(model, run)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class _Guard:
    """A sibling's pre-hook: raises where its call continues the run."""

    def __init__(self, interception: RunInterception, path: str, run: BlockRun):
        self.interception = interception
        self.path = path
        self.run = run

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        done = self.interception
        if done.ran and continues_run(args, kwargs, done.handed, done.sides):
            raise NotAChainError(further_block_message(self.path, self.run))


def _siblings(model: nn.Module, run: BlockRun) -> list[tuple[str, nn.Module]]:
    """The children of the run's blocks' containers that are of a block's type but not in
    the run, with their paths."""
    blocks = [call for call in run.calls if call.side]
    held = {id(call.module) for call in run.calls}
    kinds = {type(call.module) for call in blocks}
    parents = {call.path.rpartition(".")[0] for call in blocks if "." in call.path}
    found = []
    for parent in sorted(parents):
        for name, child in model.get_submodule(parent).named_children():
            if type(child) in kinds and id(child) not in held:
                found.append((f"{parent}.{name}", child))
    return found
