"""The state of a model's stages that their plans are made for (:func:`stage_state`): what
each module is and holds, its hooks, modes and dropout rates; and the hooks torch runs for
every module."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

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

StageState = tuple[tuple[Any, ...], tuple[bool, ...]]  # the modules' and their modes


def hook_count(parameter: nn.Parameter) -> int:
    """How many new gradients the parameter's tensor hooks (``register_hook``) can hold at
    once: 0, 1, or 2 for several (each makes the next from the last)."""
    return min(len(parameter._backward_hooks or ()), 2)


def stage_state(stages: Sequence[nn.Module]) -> StageState:
    """What the stages' plans are made for, in one walk (it runs at every step): each
    module's type, its parameters' shapes, dtypes, devices and ``requires_grad`` and how
    many new gradients their hooks can hold (which the profile counts), its
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
                (p.shape, p.dtype, p.device, p.requires_grad, hook_count(p))
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


def describe_change(before: StageState, after: StageState) -> str:
    """What changed between two states of the stages, in words, for the messages of a state
    planned anew: a budget that fit the stages before may not fit them after (a gradient hook
    added after ``optimize`` holds a new gradient per parameter), and the refusal says why."""
    (old, old_modes), (new, new_modes) = before, after
    counts: Counter[str] = Counter()
    if len(old) == len(new):  # the same walk: entry by entry, in linear time
        for a, b in zip(old, new, strict=True):
            if a != b:
                counts.update(_changed(a, b))
    else:  # entries came or went: by kind, without aligning repeated blocks
        had, has = Counter(map(_kind, old)), Counter(map(_kind, new))
        counts.update({f"{kind} added": n for kind, n in (has - had).items()})
        counts.update({f"{kind} removed": n for kind, n in (had - has).items()})
    if len(old_modes) == len(new_modes):
        switched = sum(a != b for a, b in zip(old_modes, new_modes, strict=True))
        if switched:
            counts["modules switched between training and eval"] += switched
    elif set(old_modes) != set(new_modes):  # all in one mode before, or after
        counts["modules switched between training and eval"] += abs(sum(new_modes) - sum(old_modes))
    if not counts:
        return "the stages' modules, parameters, hooks or settings changed"
    return "; ".join(f"{what} ({n})" for what, n in counts.items())


def _kind(entry: Any) -> str:
    if isinstance(entry, type):
        return "modules"
    if entry and isinstance(entry[0], str):
        return _SETTINGS.get(entry[0], entry[0])
    return "parameters"


def _changed(a: Any, b: Any) -> list[str]:
    """The kinds of change from one entry of a state to the entry in its place after."""
    if _kind(a) != _kind(b) or isinstance(a, type):
        return [f"{_kind(a)} replaced"]
    if _kind(a) != "parameters":
        return [f"{_kind(a)} changed"]
    changes = []
    if a[:3] != b[:3]:
        changes.append("parameters' shape, dtype or device changed")
    if a[3] != b[3]:
        changes.append("parameters' requires_grad changed")
    if a[4] != b[4]:
        more = "added to" if b[4] > a[4] else "removed from"
        changes.append(f"gradient hooks (register_hook) {more} parameters")
    return changes


_SETTINGS = {
    "global hooks": "hooks registered for every module",
    "hooks": "module hooks",
    "gradient_checkpointing": "Hugging Face gradient checkpointing flags",
    "dropout": "dropout rates",
    "config": "configs' implementations",
}
