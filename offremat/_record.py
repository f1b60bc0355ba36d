"""One eager call of a model, recorded module call by module call, holding none of its tensors.

Tensors are known by token: a serial number given to a tensor the first time a hook sees it
and forgotten when it is freed, so two calls see "the same tensor" exactly when one returned
the very tensor object the other received. Holding the tensors themselves would keep every
intermediate of the call alive: a whole keep-all forward, more than a budget allows.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint
from torch import nn

from offremat._blocks import NotAChainError
from offremat._saved_bytes import Saved, SavedBytes
from offremat._stage import BackwardInForwardError, backward_in_forward_error
from offremat._tensors import Structure, flatten, version_of

_T = TypeVar("_T")


@dataclass(frozen=True)
class RecordedCall:
    """One module call: where it sits, what it took and returned, by token.

    ``hidden`` is the token of its hidden state (the first positional argument if a tensor,
    else a ``hidden_states`` keyword), ``output`` the token of its output's first tensor,
    ``side`` the tokens and structure of its other arguments; ``nth`` counts the module's
    calls before this one; ``checkpointed`` says whether its caller ran it under
    ``torch.utils.checkpoint`` (see :func:`checkpointed_by_caller`).
    """

    path: str
    module: nn.Module
    depth: int
    nth: int
    hidden: int | None
    hidden_keyword: str | None
    output: int | None
    output_structure: Structure
    output_tensors: int
    state_only: bool
    side: tuple[tuple[int, ...], Structure]
    returns_input: bool = False
    checkpointed: bool = False
    # The tokens of its output's other tensors, and whether a call after it reads one or the
    # model returns one (else the model drops them: attention weights it did not ask for).
    extra_outputs: tuple[int, ...] = ()
    # The bytes of the activations autograd saved during the call (what a plan of the run
    # could release): not parameters, each storage once.
    saved_bytes: int = 0
    extras_read: bool = False
    # Whether its output's first tensor has the shape of its hidden state (a transformer
    # layer's does; a strided stage's does not).
    keeps_shape: bool = True
    # For each of those, where it sits among the call's side arguments if it is one of them,
    # handed back (("arg", position) or ("kwarg", name)), else None.
    passed: tuple[tuple[str, Any] | None, ...] = ()

    @property
    def in_place(self) -> bool:
        """Whether it returned its own input (changed in place, as ``ReLU(inplace=True)``)."""
        return self.returns_input


def hidden_keyword(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | bool | None:
    """None if the hidden state is the first argument, ``"hidden_states"``, or False: none."""
    if args and isinstance(args[0], torch.Tensor):
        return None
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return "hidden_states"
    return False


def side_places(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int, tuple[str, Any]]:
    """Side arguments that are tensors themselves, by ``id``: ("arg", position) or
    ("kwarg", name)."""
    places: dict[int, tuple[str, Any]] = {}
    for position, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            places.setdefault(id(value), ("arg", position))
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            places.setdefault(id(value), ("kwarg", name))
    return places


def split_hidden(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Tensor | None, tuple[Any, ...], dict[str, Any]]:
    """A call's hidden state (None if it has none) and its other arguments."""
    keyword = hidden_keyword(args, kwargs)
    if keyword is None:
        return args[0], args[1:], dict(kwargs)
    if keyword is False:
        return None, args, dict(kwargs)
    return kwargs[keyword], args, {k: v for k, v in kwargs.items() if k != keyword}


class _Tokens:
    """Serial numbers for live tensors' values, dropped when a tensor is freed.

    A tensor changed in place gets a new serial: a call that takes it after the change (the
    head after ``F.relu(out, inplace=True)`` on the last block's output) does not take what
    the call before returned, so it does not continue a chain from it.
    """

    def __init__(self) -> None:
        self.serials: dict[int, tuple[int, weakref.ref[torch.Tensor], int]] = {}
        self.count = 0

    def of(self, tensor: torch.Tensor) -> int:
        version = version_of(tensor)
        known = self.serials.get(id(tensor))
        if known is not None and known[1]() is tensor and known[2] == version:
            return known[0]
        self.count += 1
        forget = _Forget(self.serials, id(tensor))
        self.serials[id(tensor)] = (self.count, weakref.ref(tensor, forget), version)
        return self.count


class _Forget:
    """A weak reference's callback: forget a freed tensor's serial."""

    def __init__(self, serials: dict[int, Any], key: int):
        self.serials = serials
        self.key = key

    def __call__(self, _: Any) -> None:
        self.serials.pop(self.key, None)


class _Recorder:
    """Forward hooks on every submodule, building one :class:`RecordedCall` per call."""

    def __init__(self) -> None:
        self.tokens = _Tokens()
        self.saved = SavedBytes()
        self.calls: list[dict[str, Any]] = []
        self.open: list[dict[str, Any]] = []
        self.counts: dict[int, int] = {}

    def before(self, path: str, module: nn.Module, args: Any, kwargs: Any) -> None:
        hidden, side_args, side_kwargs = split_hidden(tuple(args), dict(kwargs))
        side_tensors, side_structure = flatten((side_args, side_kwargs))
        nth = self.counts.get(id(module), 0)
        self.counts[id(module)] = nth + 1
        call = {
            "path": path,
            "module": module,
            "depth": len(self.open),
            "nth": nth,
            "hidden": None if hidden is None else self.tokens.of(hidden),
            "hidden_keyword": hidden_keyword(tuple(args), dict(kwargs)) or None,
            "state_only": len(args) == 1 and hidden is not None and not kwargs,
            "side": (tuple(self.tokens.of(t) for t in side_tensors), side_structure),
            "places": side_places(side_args, side_kwargs),
            "checkpointed": checkpointed_by_caller(module),
            "saved": Saved(),
        }
        self.calls.append(call)
        self.open.append(call)
        self.saved.open.append(call["saved"])

    def after(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        call = self.open.pop()
        self.saved.open.pop()
        tensors, structure = flatten(output)
        first = tensors[0] if tensors and isinstance(tensors[0], torch.Tensor) else None
        call["output"] = None if first is None else self.tokens.of(first)
        hidden = split_hidden(args, kwargs)[0]
        call["returns_input"] = first is not None and first is hidden
        call["keeps_shape"] = (
            first is not None and hidden is not None and first.shape == hidden.shape
        )
        call["output_structure"] = structure
        call["output_tensors"] = len(tensors)
        call["saved_bytes"] = call.pop("saved").bytes
        call["extra_outputs"] = tuple(self.tokens.of(t) for t in tensors[1:])
        places = call.pop("places")
        call["passed"] = tuple(places.get(id(t)) for t in tensors[1:])
        call["state_only"] = call["state_only"] and len(tensors) == 1


def record_calls(
    model: nn.Module, run_model: Callable[[], Any]
) -> tuple[list[RecordedCall], frozenset[int]]:
    """Every submodule call that ``run_model()`` makes, in the order they start, and the
    tokens of the tensors the model returns."""
    return _in_training(functools.partial(_record_calls, model, run_model))


def _in_training(attempt: Callable[[bool], _T]) -> _T:
    """``attempt(keep_saved)`` with the saved tensors dropped, or, where the model runs a
    backward in its forward, again from the start with them kept, as autograd keeps them (a
    stage that does so is refused when profiled)."""
    try:
        return attempt(False)
    except BackwardInForwardError:
        return attempt(True)


def _record_calls(
    model: nn.Module, run_model: Callable[[], Any], keep_saved: bool
) -> tuple[list[RecordedCall], frozenset[int]]:
    recorder = _Recorder()
    handles = []
    for path, module in model.named_modules():
        # A TorchScript module takes no hooks: it (and what it holds) is one opaque call of
        # the code around it. Scripted blocks are refused where they are named (_discover).
        if module is model or isinstance(module, torch.jit.ScriptModule):
            continue
        # First among the pre-hooks: FSDP2's own hands the block new tensor objects (through
        # an autograd function), and the call must be recorded with what its caller passed.
        handles.append(
            module.register_forward_pre_hook(
                _PathHook(recorder.before, path), with_kwargs=True, prepend=True
            )
        )
        handles.append(module.register_forward_hook(recorder.after, with_kwargs=True))
    try:
        # Eagerly: compiled blocks would trace these hooks and keep code compiled with them.
        with (
            _as_in_training(keep_saved, recorder.saved),
            torch.compiler.set_stance("force_eager"),
        ):
            returned = frozenset(recorder.tokens.of(t) for t in flatten(run_model())[0])
    finally:
        for handle in handles:
            handle.remove()
    records = [RecordedCall(**call) for call in recorder.calls if "output" in call]
    return _extras_marked(records, returned), returned


def _extras_marked(records: list[RecordedCall], returned: frozenset[int]) -> list[RecordedCall]:
    """``records``, each that returns more than one tensor marked where the model returns one
    of the others, or a call after it reads one (the calls inside it made them), but for
    side inputs it returns as they came."""
    marked = []
    for k, record in enumerate(records):
        # A side argument handed back (a position bias) is no output the chain must keep.
        pairs = zip(record.extra_outputs, record.passed, strict=True)
        extras = {t for t, place in pairs if place is None}
        if extras:
            end = k + 1
            while end < len(records) and records[end].depth > record.depth:
                end += 1
            read = not extras.isdisjoint(returned) or any(
                later.hidden in extras or not extras.isdisjoint(later.side[0])
                for later in records[end:]
            )
            record = dataclasses.replace(record, extras_read=read)
        marked.append(record)
    return marked


def checkpointed_by_caller(module: nn.Module) -> bool:
    """Whether the code that called ``module`` wrapped the call in ``torch.utils.checkpoint``
    (``h = checkpoint(block, h)`` in a model's loop, or through a closure, a lambda or a
    method that calls blocks), called from the module's forward pre-hook.

    Such checkpointing is the caller's, and a chain's stage calls the block itself, without
    it. Checkpointing inside the module's own call (Hugging Face's
    ``GradientCheckpointingLayer``) stays with the block: the first frame outside torch
    above the checkpoint's is then a method of the module itself. The walk ends at the
    recorder's own frame, :func:`record_calls`, which runs the model.
    """
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:  # the recorder's hooks
        frame = frame.f_back
    through_checkpoint = False
    while frame is not None and frame.f_code.co_filename != __file__:
        filename = frame.f_code.co_filename
        if filename == _CHECKPOINT_FILE:
            through_checkpoint = True
        elif through_checkpoint and not filename.startswith(_TORCH_DIR):
            return frame.f_locals.get("self") is not module
        frame = frame.f_back
    return False


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_CHECKPOINT_FILE = torch.utils.checkpoint.__file__


class _Captured(Exception):
    """Ends the model's call once the arguments wanted are captured."""


def capture_calls(
    run_model: Callable[[], Any], targets: Sequence[tuple[nn.Module, int]]
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The arguments of each target's call, a module's call number ``nth`` in
    ``run_model()``, which stops once it made the last of them."""

    def attempt(keep_saved: bool) -> _Capture:
        capture = _Capture(targets)  # counting from the start of this run
        modules = {id(module): module for module, _ in targets}.values()
        handles = [
            module.register_forward_pre_hook(capture, with_kwargs=True) for module in modules
        ]
        try:
            # Eagerly: compiled blocks would trace these hooks and keep code compiled with them.
            with _as_in_training(keep_saved), torch.compiler.set_stance("force_eager"):
                run_model()
        except _Captured:
            pass
        finally:
            for handle in handles:
                handle.remove()
        return capture

    capture = _in_training(attempt)
    missing = [k for k, arguments in enumerate(capture.arguments) if arguments is None]
    if missing:
        module, nth = targets[missing[0]]
        raise NotAChainError(
            f"the model did not call {type(module).__name__} {nth + 1} times when run again: "
            "its run of blocks changes from call to call (a model whose blocks depend on random "
            "draws, LayerDrop, is no fixed chain and cannot be planned)"
        )
    return capture.arguments


class _Capture:
    def __init__(self, targets: Sequence[tuple[nn.Module, int]]):
        self.wanted = {(id(module), nth): k for k, (module, nth) in enumerate(targets)}
        self.seen: dict[int, int] = {}
        self.arguments: list[Any] = [None] * len(targets)

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        nth = self.seen.get(id(module), 0)
        self.seen[id(module)] = nth + 1
        k = self.wanted.get((id(module), nth))
        if k is not None:
            self.arguments[k] = (tuple(args), dict(kwargs))
            if all(arguments is not None for arguments in self.arguments):
                raise _Captured


class _PathHook:
    """A pre-hook that knows its module's path."""

    def __init__(self, function: Callable[..., None], path: str):
        self.function = function
        self.path = path

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self.function(self.path, module, args, kwargs)


@contextmanager
def _as_in_training(
    keep_saved: bool = False, pack: Callable[[torch.Tensor], None] | None = None
) -> Iterator[None]:
    """Gradients on, as in training, so that inputs say which of them carry a gradient;
    saved tensors dropped at once (by ``pack``, which keeps nothing), so memory is that of a
    forward without autograd, unless ``keep_saved`` (a backward inside the forward reads
    them)."""
    with torch.enable_grad():
        if keep_saved:
            yield
            return
        with torch.autograd.graph.saved_tensors_hooks(pack or _drop, _refuse_unpack):
            yield


def _drop(_: Any) -> None:
    return None


def _refuse_unpack(_: Any) -> torch.Tensor:
    raise backward_in_forward_error(None)
