"""Running a model's run of blocks as a chain, inside the model's own ``forward``.

Design notes.

- Block. :class:`RunBlock` is one call of a block as a chain block: it takes and returns the
  chain's value ``(hidden, sides)``, calling the block with the side inputs ``(args,
  kwargs)`` of its pattern: one for every call of most runs, one per kind of layer where
  layers alternate kinds of attention, each with a mask of its own. Side tensors pass
  through every stage unchanged, each once however many patterns take it
  (:class:`offremat._block_values.SameAs`), so their gradients add up stage by stage as
  plain autograd adds them, and they are the chain input a_0's storages, resident for the
  whole step and counted once.
- Interception. While a :class:`RunInterception` is active, the model's call of the run's
  first block runs the whole chain through ``execute`` (the plan's executor) and returns the
  last block's output; the model's calls of the other blocks hand that output on unchanged.
  A run of several patterns learns a pattern's side inputs only when the model calls its
  first block, so it runs the chain at the model's call of the last block instead (it is
  ``deferred``), and the calls before get a stand-in that may only be passed to the next
  block; the tensors the chain will take must not change in place meanwhile. The model's own
  code before and after the run runs as it is, under plain autograd. Each call is checked:
  the right block, the state the interception returned, its pattern's side inputs; anything
  else raises rather than runs another model. The interception is installed for one call of
  the model and removed after it, also on an error.
- Hooks. A forward hook on a block would see the handed-on output at every block after the
  first, so blocks with hooks are refused (this is how Hugging Face records
  ``output_hidden_states``: ask for those from a model run without offremat). FSDP2's hooks
  (``fully_shard`` per block) are the exception: they gather the block's parameters, so they
  belong to each time the block computes. The model's own calls of the blocks bypass them,
  and the chain's calls, recomputations included, run them, as for an ``nn.Sequential``.
- torch.compile. A compiled block (``block.compile()``) calls the interception from inside
  its compiled wrapper; dynamo never traces it (it would guard on this step's objects and
  recompile every step), and while the chain runs the blocks have their own ``forward`` back,
  so the chain calls their compiled code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_globals

from offremat._block_values import (
    Side,
    block_output,
    continues_run,
    further_block_message,
    hidden_of,
    same_values,
    shared_sides,
    side_inputs_of,
    side_of,
)
from offremat._blocks import NotAChainError, output_capture_hooks
from offremat._call_state import BlockState, CallContext
from offremat._discover import BlockCall, BlockRun
from offremat._fsdp import sharding_hooks
from offremat._handed_on import HandedOn
from offremat._tensors import describe_kind, flatten, tensor_kind, version_of


class RunBlock(nn.Module):
    """One unit of a :class:`BlockRun` (a call, with the in-place calls after it) as a block."""

    def __init__(self, calls: Sequence[BlockCall]):
        super().__init__()
        self.calls = tuple(calls)
        self.modules_ = nn.ModuleList(call.module for call in calls)

    def forward(self, value: tuple[torch.Tensor, tuple[Side, ...]]) -> Any:
        hidden, sides = value
        for call in self.calls:
            args, kwargs = side_of(sides, call.pattern)
            if not call.side:
                output = call.module(hidden)
            elif call.hidden_keyword is None:
                output = call.module(hidden, *args, **kwargs)
            else:
                output = call.module(*args, **{call.hidden_keyword: hidden}, **kwargs)
            hidden = hidden_of(output, call.path, call.output)
        return hidden, sides

    def extra_repr(self) -> str:
        return "+".join(call.path for call in self.calls)


def run_blocks(run: BlockRun) -> list[tuple[str, nn.Module]]:
    """The chain's blocks, one per unit, named by path (and call, for a shared module)."""
    counts: dict[str, int] = {}
    blocks = []
    for unit in run.units:
        calls = [run.calls[k] for k in unit]
        path = "+".join(call.path for call in calls)
        seen = counts.get(path, 0)
        counts[path] = seen + 1
        blocks.append((path if seen == 0 else f"{path}@{seen}", RunBlock(calls)))
    return blocks


class RunInterception:
    """For one call of the model: its run of blocks goes through ``execute`` as a chain.

    ``execute`` takes the chain input ``(hidden, sides)`` and returns the chain output.
    """

    def __init__(
        self,
        run: BlockRun,
        execute: Callable[[Any], Any],
        check_state: bool = True,
        check_grad: bool = True,
    ):
        self.run = run
        self.execute = execute
        # optimize's own runs of the model leave out the blocks' state (they start from the
        # state optimize found, where an attribute the model sets before each call is not set
        # yet) and its check of the chain's output the grad mode (it runs under no_grad, which
        # the model may switch off around its blocks): comparing the chain's output with the
        # model's own is their oracle.
        self.check_state = check_state
        self.check_grad = check_grad
        self.position = 0
        self.result: torch.Tensor | None = None
        self.handed: torch.Tensor | None = None
        self.sides: list[Side] = []
        self.hidden: torch.Tensor | None = None  # the first block's, until the chain runs
        self.context: CallContext | None = None
        self.states: dict[int, BlockState] = {}
        self.versions: list[tuple[torch.Tensor, int]] = []
        self.deferred = run.patterns > 1
        self._installed: list[tuple[nn.Module, Any]] = []
        self._bypassed: list[tuple[nn.Module, dict[int, Any], dict[int, Any]]] = []

    def __enter__(self) -> RunInterception:
        refuse_hooks(self.run)
        self._install()
        return self

    def _install(self) -> None:
        for module in {id(c.module): c.module for c in self.run.calls}.values():
            self._installed.append((module, module.__dict__.get("forward")))
            original = module.forward
            module.forward = _Forward(self, module, original)
            sharding = sharding_hooks(module)
            if sharding:
                pre, post = dict(module._forward_pre_hooks), dict(module._forward_hooks)
                self._bypassed.append((module, pre, post))
                for hooks in (module._forward_pre_hooks, module._forward_hooks):
                    for key in sharding & hooks.keys():
                        del hooks[key]

    def _uninstall(self) -> None:
        for module, own in self._installed:
            if own is None:
                del module.forward
            else:
                module.forward = own
        self._installed = []
        for module, pre, post in self._bypassed:
            module._forward_pre_hooks.clear()
            module._forward_pre_hooks.update(pre)
            module._forward_hooks.clear()
            module._forward_hooks.update(post)
        self._bypassed = []

    def __exit__(self, kind: Any, *rest: Any) -> None:
        self._uninstall()
        if kind is None and 0 < self.position < len(self.run.calls):
            raise NotAChainError(
                f"the model called {self.position} of its {len(self.run.calls)} blocks "
                f"({self.run.calls[self.position].path} was not called): the chain was found on "
                "the example batch, so profile again with a batch that runs every block"
            )

    @property
    def ran(self) -> bool:
        """Whether the model ran its blocks, all of them, through the interception."""
        return self.position == len(self.run.calls)

    def call(self, module: nn.Module, original: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        """A call of one of the run's modules by the model (or by the chain)."""
        calls = self.run.calls
        if self.position == len(calls):
            # A block of the run (not a stem's or tail's layer) again on the run's output (a
            # shared block run more times than when the chain was found) would run outside
            # the plan; other calls are the model's own. Blocks the run does not hold:
            # offremat/_further_blocks.py.
            block = any(call.side and call.module is module for call in calls)
            if block and continues_run(args, kwargs, self.handed, self.sides):
                raise NotAChainError(further_block_message(_path_of(module, calls), self.run))
            return original(*args, **kwargs)
        expected = calls[self.position]
        if module is not expected.module:
            raise NotAChainError(
                f"the model called {_path_of(module, calls)} where the chain expected "
                f"{expected.path}: it no longer calls its blocks in the order the chain was "
                "found in. A model whose run of blocks depends on the input or on random draws "
                "(an early exit, LayerDrop) is no fixed chain and cannot be planned; if the "
                "model itself changed, optimize it again"
            )
        hidden, side = side_inputs_of(expected.path, args, kwargs)
        if self.position == 0:
            self.context = CallContext.now()
            self.hidden = hidden
        elif hidden is not self.handed:
            raise NotAChainError(
                f"the model changed the hidden state between {calls[self.position - 1].path} "
                f"and {expected.path}; offremat runs the blocks as one chain, so their inputs "
                "must flow from block to block"
            )
        elif not self._takes_its_side(expected, side):
            raise NotAChainError(self._other_side_message(expected))
        else:
            self._check_unchanged(expected)
        if expected.pattern == len(self.sides):
            self.sides.append(side)
            if self.deferred:
                self._note_versions(side if self.position else (hidden, side))
        self.position += 1
        last = self.position == len(calls)
        if self.deferred:
            self.states.setdefault(id(module), BlockState.of(module))
        if last if self.deferred else self.position == 1:  # the call the chain runs at
            if self.deferred:
                self._check_unchanged_since_called()
            self._execute()
        if last:
            self.handed = self.result
        elif self.deferred:
            self.handed = HandedOn.before_run(expected.path, calls[-1].path)
        else:
            self.handed = HandedOn.of(
                self.result, expected.path, calls[-1].path, self.run.keeps_shape
            )
        return block_output(expected.output, self.handed, expected.path, expected.passed, side)

    def _takes_its_side(self, expected: BlockCall, side: Side) -> bool:
        """Whether a call takes the side inputs its pattern's first call took (a first call
        takes any)."""
        if not expected.side or expected.pattern >= len(self.sides):
            return True
        return same_values(side, self.sides[expected.pattern])

    def _other_side_message(self, expected: BlockCall) -> str:
        first = next(c for c in self.run.calls if c.pattern == expected.pattern)
        return (
            f"the model gives {expected.path} other side arguments than {first.path}, which "
            "took the same ones when the chain was found (a mask per kind of attention that "
            "differs only on longer sequences, a number per depth that was equal then); "
            "offremat runs the blocks as one chain, each call with the side inputs of its "
            "group: optimize with a batch on which the blocks take theirs as in training "
            "(a sequence longer than the sliding window, say)"
        )

    def _note_versions(self, value: Any) -> None:
        """Note the versions of the tensors the chain will take: it runs on them later."""
        self.versions += [(t, version_of(t)) for t in flatten(value)[0]]

    def _execute(self) -> None:
        self._uninstall()
        try:
            output = self.execute((self.hidden, shared_sides(self.sides)))
        finally:
            self._install()
        if not self.deferred:
            # Blocks may change their side inputs in place; later calls must not.
            self._note_versions(self.sides)
            self.states = {id(c.module): BlockState.of(c.module) for c in self.run.calls[1:]}
        self.hidden = None
        self.result = output[0]

    def _check_unchanged(self, expected: BlockCall) -> None:
        """Refuse a later call made in another mode, or after the model changed the block.

        The chain runs every block at one of the model's calls (:attr:`_runs_at`), so whatever
        the model's code does between its calls comes too late for the blocks before it, or
        after it: a ``torch.no_grad()`` around some calls (freezing them), another autocast,
        or an attribute it sets on a block (a timestep embedding, a dropout rate for that
        depth). The block's state is compared with the one it had when the chain had run
        (which holds what the block's own forward wrote), or, where the chain runs at the
        last call, when the model called it before.
        """
        moved = next((t for t, version in self.versions if version_of(t) != version), None)
        if moved is not None:
            raise NotAChainError(
                f"the model changed a {describe_kind(tensor_kind(moved))} tensor that the "
                f"blocks take (the first one's input, or a side input) in place before "
                f"calling {expected.path}; offremat runs the whole run of blocks at "
                f"{self._runs_at}, so some blocks would compute with the other value: make "
                "the change out of place"
            )
        changed = self.context.differs_from(CallContext.now(), self.check_grad)
        if changed:
            raise NotAChainError(
                f"the model calls block {expected.path} {changed}, unlike its call of "
                f"{self.run.calls[0].path}; offremat runs the whole run of blocks at "
                f"{self._runs_at}, so every call must run under the same grad mode, "
                "autocast and saved-tensor hooks: freeze blocks with requires_grad_(False) "
                "rather than torch.no_grad(), or name a run called in one mode with blocks="
            )
        self._check_state(expected.module, expected.path)

    def _check_unchanged_since_called(self) -> None:
        """Refuse a chain run at the last call whose earlier blocks changed since called."""
        for call in self.run.calls:
            self._check_state(call.module, call.path)

    def _check_state(self, module: nn.Module, path: str) -> None:
        before = self.states.get(id(module))
        if before is None or not self.check_state:
            return
        what = before.change_in(BlockState.of(module))
        if what is not None:
            raise NotAChainError(
                f"the model changed {what} of block {path} between its calls of "
                f"{self.run.calls[0].path} and {self.run.calls[-1].path}; offremat runs the "
                f"whole run of blocks at {self._runs_at}, so the block ran with another "
                "value than the model gave it: set what the blocks read before the model "
                "calls the first of them, or pass it to every block as an argument"
            )

    @property
    def _runs_at(self) -> str:
        if self.deferred:
            return "the model's call of the last (its blocks take side inputs in turns)"
        return "the model's call of the first"


class _Forward:
    """The ``forward`` a block has while an interception is active.

    An object with explicit state rather than a closure, so that the interception it points
    to is visible (and dropped) with it.
    """

    def __init__(self, interception: RunInterception, module: nn.Module, original: Any):
        self.interception = interception
        self.module = module
        self.original = original

    @torch.compiler.disable
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.interception.call(self.module, self.original, args, kwargs)


def refuse_hooks(run: BlockRun) -> None:
    """Refuse hooks on the run's blocks, their own or those torch runs for every module: the
    blocks hand their outputs on through offremat, so such hooks would see the wrong ones."""
    _refuse_global_hooks()
    for call in run.calls:
        module = call.module
        own = (
            (module._forward_hooks.keys() | module._forward_pre_hooks.keys())
            - sharding_hooks(module)
            - output_capture_hooks(module)
        )
        if own:
            raise NotAChainError(
                f"block {call.path} has forward hooks (output_hidden_states or "
                "output_attentions, say); under offremat they would see one block's output "
                "at every block. Remove the hooks, or run that call without offremat"
            )
        if module._backward_hooks or module._backward_pre_hooks:
            raise NotAChainError(
                f"block {call.path} has a backward hook or pre-hook, which would wrap the "
                "block's output that offremat hands to the next block as it runs the chain: "
                "put the hook on a module inside the block, or on the model"
            )


# Hooks torch runs for every module, by the function that registers them.
_GLOBAL_HOOKS = (
    ("register_module_forward_pre_hook", "_global_forward_pre_hooks"),
    ("register_module_forward_hook", "_global_forward_hooks"),
    ("register_module_full_backward_pre_hook", "_global_backward_pre_hooks"),
    ("register_module_full_backward_hook", "_global_backward_hooks"),
)


def _refuse_global_hooks() -> None:
    """Hooks registered for every module run on the blocks too, as a block's own do: refused
    alike, with the function that registered them (a global backward hook raised an error
    about the model using a block's output for more than calling the next block)."""
    for function, name in _GLOBAL_HOOKS:
        if getattr(module_globals, name):
            raise NotAChainError(
                f"a hook registered for every module ({function}) runs on the model's calls "
                "of its blocks, which offremat answers by handing one block's output on: it "
                "would see that output at every block, or wrap it. Remove it for training "
                "steps (hooks registered on the modules inside the blocks work), or run that "
                "call without offremat"
            )


def _path_of(module: nn.Module, calls: tuple[Any, ...]) -> str:
    return next((c.path for c in calls if c.module is module), type(module).__name__)
