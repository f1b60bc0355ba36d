"""What a model's plans depend on, as text for a disk cache's key (:func:`model_fingerprint`):
its structure (module types, the code of their ``forward`` methods and of the functions those
reach, their plain settings, hooks), its parameters' and buffers' shapes, dtypes and
``requires_grad``, and the versions of torch and of offremat's own code
(:func:`library_versions`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import inspect
import json
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offremat._blocks import output_capture_hooks
from offremat._stage_state import global_hooks


def model_fingerprint(model: nn.Module) -> str:
    """A digest of the model's structure: module types, settings and code by path, tensors'
    shapes and dtypes. Settings are the modules' plain attributes (a dropout's ``p``, a count
    of attention heads, a Hugging Face config) and, with the code (an edited block, another
    activation function), they change what a forward saves."""
    parts = [
        f"{path}:{type(module).__qualname__}:{_settings(module)}:{_reached_code(module)}"
        f":{_hooks(module)}"
        for path, module in model.named_modules()
    ]
    parts.append(f"global hooks:{_global_hooks()}")
    for kind, tensors in (("p", model.named_parameters()), ("b", model.named_buffers())):
        parts.extend(
            f"{kind}:{name}:{tuple(tensor.shape)}:{tensor.dtype}:{tensor.requires_grad}"
            for name, tensor in tensors
        )
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _hooks(module: nn.Module) -> str:
    """The module's forward and backward hooks, each named with its code: one that keeps an
    activation changes what a step holds. Hugging Face's recording hooks, which record
    nothing in a training step, are left out (as the plans in memory leave them out)."""
    inert = output_capture_hooks(module)
    hooks = (
        module._forward_pre_hooks,
        module._forward_hooks,
        module._backward_pre_hooks,
        module._backward_hooks,
    )
    return repr([[_named(_unwrapped(h)) for k, h in d.items() if k not in inert] for d in hooks])


def _global_hooks() -> str:
    """The hooks registered for every module (``register_module_forward_hook`` and the like),
    each named with its code, as a module's own are."""
    return repr([[_named(_unwrapped(h)) for h in d.values()] for d in global_hooks()])


def library_versions() -> str:
    """Torch's version and a digest of offremat's own source: a plan profiled and solved by
    other code is not trusted."""
    return f"torch {torch.__version__}, offremat {_source_digest()}"


@functools.cache
def _source_digest() -> str:
    digest = hashlib.sha256()
    for package in ("offremat", "solvers"):
        root = Path(importlib.import_module(package).__file__ or "").parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _reached_code(module: nn.Module) -> str:
    """The module's ``forward`` and the functions it reaches by name, each named with its code.

    From ``forward``, a name its code uses is followed where it is a function: an attribute of
    the module (``self.act = F.silu``), a method of its class, a global of the function's own
    module, or an attribute of a module that is such a global (``helpers.act``). Only
    functions from the package that defines the module's class are followed further (its
    helpers); others (torch's) are named, with their code, and not entered.
    """
    if isinstance(module, torch.jit.ScriptModule):  # its compiled code, by its text
        return repr(getattr(module, "code", type(module).__qualname__))
    home = _package(type(module))
    parts = []
    # A forward set on the instance (a patched module) runs instead of its class's.
    pending: list[Any] = [module.__dict__.get("forward", type(module).forward)]
    seen: set[int] = set()
    while pending:
        function = _unwrapped(pending.pop())
        if id(function) in seen:
            continue
        seen.add(id(function))
        parts.append(_named(function))
        code = getattr(function, "__code__", None)
        if code is None or _package(function) != home:
            continue
        found = []
        names = sorted(_names(code))
        namespace = getattr(function, "__globals__", {})
        imported = [v for v in map(namespace.get, names) if isinstance(v, types.ModuleType)]
        for name in names:
            for value in (
                vars(module).get(name),
                inspect.getattr_static(type(module), name, None),
                namespace.get(name),
                *(vars(package).get(name) for package in imported),
            ):
                if _function_like(value):
                    found.append(value)
        pending.extend(reversed(found))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _unwrapped(function: Any) -> Any:
    """The function behind a decorator, a bound method, a static or class method."""
    while True:
        if isinstance(function, (staticmethod, classmethod, types.MethodType)):
            function = function.__func__
            continue
        with contextlib.suppress(ValueError):  # a cycle of __wrapped__
            unwrapped = inspect.unwrap(function)
            if unwrapped is not function:
                function = unwrapped
                continue
        return function


def _named(function: Any) -> str:
    """A function's module, name and code (a partial's function and plain arguments)."""
    if isinstance(function, functools.partial):
        arguments = [_plain_or_type(a) for a in function.args]
        keywords = sorted((k, _plain_or_type(v)) for k, v in function.keywords.items())
        return f"partial({_named(_unwrapped(function.func))}, {arguments!r}, {keywords!r})"
    name = getattr(function, "__qualname__", type(function).__qualname__)
    return f"{getattr(function, '__module__', None)}.{name}:{_code(function)}"


def _function_like(value: Any) -> bool:
    if value is None or isinstance(value, (type, nn.Module)):
        return False
    return callable(value) or isinstance(value, (staticmethod, classmethod))


def _plain_or_type(value: Any) -> Any:
    return value if _is_simple(value) else type(value).__qualname__


def _package(value: Any) -> str | None:
    module = getattr(value, "__module__", None)
    return module.split(".")[0] if isinstance(module, str) else None


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names a code object and the code nested in it use."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _names(constant)
    return names


_SIMPLE = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _plain_settings(value: Any) -> tuple[tuple[str, Any], ...]:
    """The attributes of ``value`` that hold plain values (numbers, strings, flags), private
    ones included, by name."""
    try:
        attributes = vars(value)
    except TypeError:  # no __dict__
        return ()
    return tuple(
        sorted((k, v) for k, v in attributes.items() if _is_simple(v) and k not in _PER_PROCESS)
    )


# A Hugging Face GenerationConfig keeps hash(self) to tell whether it was changed: Python's
# hash of a string differs between processes, so the key would never match a later run's.
_PER_PROCESS = frozenset({"_original_object_hash"})


def _settings(module: nn.Module) -> str:
    """The module's public attributes of plain values (numbers, strings, tuples of them) and
    configs (dataclasses, dicts, objects with ``to_dict``, other objects by their attributes),
    as text; tensors and submodules are described elsewhere, functions by their code."""
    found = []
    for name, value in sorted(vars(module).items()):
        if name.startswith("_") or name == "training":
            continue
        if _is_simple(value):
            found.append(f"{name}={value!r}")
            continue
        if callable(getattr(value, "to_dict", None)):
            # A Hugging Face config keeps its attention implementation out of to_dict.
            found.append(f"{name}.private={_plain_settings(value)!r}")
            value = value.to_dict()
        elif not (isinstance(value, dict) or _is_dataclass_object(value) or _is_object(value)):
            continue
        try:
            found.append(f"{name}={json.dumps(value, sort_keys=True, default=_described)}")
        except (TypeError, ValueError, RecursionError):  # keys that are no strings, a cycle
            found.append(f"{name}={type(value).__qualname__}")
    return ",".join(found)


def _code(function: Any) -> str:
    """A digest of a function's code, the same in every process (no addresses); a decorated
    function's own (Hugging Face wraps every ``forward``)."""
    with contextlib.suppress(ValueError):  # a cycle of __wrapped__
        function = inspect.unwrap(function)
    code = getattr(function, "__code__", None)
    if code is None:
        call = inspect.getattr_static(type(function), "__call__", None)
        code = getattr(call, "__code__", None)  # a callable object: its class's __call__
    if code is None:  # a builtin or a wrapper without one
        return type(function).__qualname__
    return hashlib.sha256(_code_text(code).encode()).hexdigest()[:16]


def _code_text(code: types.CodeType) -> str:
    constants = []
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):  # a nested function or comprehension
            constants.append(_code_text(constant))
        elif isinstance(constant, frozenset):  # its order varies with the hash seed
            constants.append(repr(sorted(map(repr, constant))))
        else:
            constants.append(repr(constant))
    return f"{code.co_code.hex()}|{constants}|{code.co_names}"


def _is_dataclass_object(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _is_object(value: Any) -> bool:
    """An object of a plain class (a config without ``to_dict``): described by its attributes.
    Not a function, class, module or tensor, which have attributes of another kind."""
    return (
        hasattr(value, "__dict__")
        and not callable(value)
        and not isinstance(value, (type, types.ModuleType, nn.Module, torch.Tensor))
    )


def _described(value: Any) -> Any:
    """What the key keeps of a value JSON cannot write: a dataclass's fields, a dtype's name,
    another object's attributes, else its type (never an address, so that the key is the same
    in every process)."""
    if _is_dataclass_object(value):
        return {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if _is_object(value):
        # Its public settings: private state may be per process (a thread's name), and a
        # large collection is data, not a setting (reading a dataset's would take seconds).
        settings = {
            k: v if _is_setting(v) else type(v).__qualname__
            for k, v in vars(value).items()
            if not k.startswith("_")
        }
        return {"class": type(value).__qualname__, "settings": settings}
    return type(value).__qualname__


MOST_ENTRIES = 64
"""A list, tuple or dict with more entries than this, inside a module's object, is data."""


def _is_setting(value: Any) -> bool:
    if isinstance(value, (list, tuple, dict)):
        return len(value) <= MOST_ENTRIES
    return True


def _is_simple(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_is_simple(item) for item in value)
    return isinstance(value, _SIMPLE)
