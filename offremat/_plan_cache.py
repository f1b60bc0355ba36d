"""Plans kept on disk between runs, keyed by everything a plan depends on.

A file holds one chain and its plan, under a key made of the model's structure (module types,
the code of their ``forward`` methods and of the functions those reach, parameter and buffer
shapes, dtypes and ``requires_grad``), the versions of torch and of offremat's own code, the
device, the budget as given, the solver and its options, the example batch's signature and
the signature of the input shape planned. A file
that cannot be read, is truncated, has another format or another key, or holds a plan that
does not validate against its chain or does not fit its budget there, or whose chain the
caller cannot use, is logged and ignored: never fatal, never trusted. A plan read is scored on
its chain again, so its predictions are the simulator's, not the file's. Files are written to
a temporary name in the same folder and renamed over the target, so two processes writing the
same entry leave one whole file. The folder keeps the :data:`KEPT_FILES` entries used last
(read or written; a number that sizes tensors and changes at every step writes one at every
step), as the plans in memory are bounded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import inspect
import json
import logging
import os
import re
import tempfile
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offremat._blocks import output_capture_hooks
from offremat._stage_state import global_hooks
from solvers.chain import Chain
from solvers.json_text import parse_json
from solvers.plan import Plan, validate
from solvers.simulator import score

logger = logging.getLogger(__name__)

# 2: buffer copies counted, module settings in the key; 3: changed buffers counted, code in it;
# 4: the code forward reaches and the library's versions in it; 5: the kind and bytes of the
# chain input a model's chain was profiled on, in its metadata; 6: a forward set on the
# instance in the key, and a digest of the chain and plan
FORMAT = "offremat.plan-cache/6"

# How every entry begins, whatever its format's version (json.dump writes "format" first).
_HEADER = b'{"format": "offremat.plan-cache/'

KEPT_FILES = 1024
"""How many entries a cache folder keeps: those read or written last."""


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


class PlanCache:
    """A folder of cached ``(chain, plan)`` pairs, one JSON file per key."""

    def __init__(self, directory: str | Path, key: dict[str, Any]):
        self.directory = Path(directory)
        self.loaded = 0  # entries read and trusted
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise ValueError(
                f"cache_dir={str(directory)!r} is a file, or inside one: give a folder"
            ) from None
        self.key = key

    def _entry(self, signature: str) -> tuple[dict[str, Any], Path]:
        key = {**self.key, "signature": signature}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        return key, self.directory / f"{digest[:32]}.json"

    def load(
        self, signature: str, check: Callable[[Chain, Plan], object] | None = None
    ) -> tuple[Chain, Plan] | None:
        """The cached chain and plan for ``signature``, or None (a bad file is logged).
        ``check`` raises ValueError, KeyError or TypeError where the caller cannot use them."""
        key, path = self._entry(signature)
        if not path.exists():
            return None
        try:
            data = parse_json(path.read_text(), "plan cache file")
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError(f"not an {FORMAT} file")
            if data.get("key") != key:
                raise ValueError("its key is another model's, device's, budget's or shape's")
            if data.get("digest") != _digest(data.get("chain"), data.get("plan")):
                # An edited chain can make a plan fit it, and a budget given as a fraction is
                # a fraction of the file's own chain: neither would be seen.
                raise ValueError("its chain or plan was changed after it was written")
            chain = Chain.from_dict(data["chain"])
            plan = Plan.from_dict(data["plan"])
            problems = validate(plan, chain)
            if problems:
                raise ValueError("; ".join(problems))
            if plan.budget_bytes is None and key.get("budget") != repr(None):
                raise ValueError("its plan has no budget, but one was asked for")
            plan = score(plan, chain, plan.budget_bytes)
            if not plan.feasible:
                raise ValueError(
                    f"its plan peaks at {plan.predicted_peak_bytes} B on its chain, over its "
                    f"budget of {plan.budget_bytes} B"
                )
            if check is not None:
                check(chain, plan)
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.warning("ignoring plan cache file %s: %s", path, error)
            return None
        logger.info("plan for input %s read from %s", signature, path)
        self.loaded += 1
        with contextlib.suppress(OSError):
            os.utime(path)  # used last: kept (see _evict)
        return chain, plan

    def store(self, signature: str, chain: Chain, plan: Plan) -> None:
        """Write the entry atomically (a temporary file renamed over it); log a failure."""
        key, path = self._entry(signature)
        chain_data, plan_data = chain.to_dict(), plan.to_dict()
        data = {
            "format": FORMAT,
            "key": key,
            "chain": chain_data,
            "plan": plan_data,
            "digest": _digest(chain_data, plan_data),
        }
        temporary: Path | None = None
        try:
            with tempfile.NamedTemporaryFile(
                "w", dir=self.directory, prefix=".tmp-", suffix=".json", delete=False
            ) as handle:
                temporary = Path(handle.name)
                json.dump(data, handle)
            os.replace(temporary, path)
        except OSError as error:
            logger.warning("could not write plan cache file %s: %s", path, error)
            if temporary is not None:
                temporary.unlink(missing_ok=True)
            return
        self._evict(path)

    def _evict(self, written: Path) -> None:
        """Remove all but the :data:`KEPT_FILES` entries used last (by modification time),
        ``written`` kept whatever the clock's resolution."""
        entries = []
        for entry in self.directory.glob("*.json"):
            # Entries alone, named as _entry names them and written as store writes them: the
            # folder may hold the user's files.
            if entry == written or not re.fullmatch(r"[0-9a-f]{32}\.json", entry.name):
                continue
            with contextlib.suppress(OSError), entry.open("rb") as handle:
                if handle.read(len(_HEADER)) == _HEADER:
                    entries.append((entry.stat().st_mtime_ns, entry))
        entries.sort()
        for _, entry in entries[: max(len(entries) + 1 - KEPT_FILES, 0)]:
            with contextlib.suppress(OSError):
                entry.unlink()


def _digest(chain: Any, plan: Any) -> str:
    """A digest of an entry's chain and plan as written (as JSON reads them back)."""
    written = json.loads(json.dumps([chain, plan]))
    return hashlib.sha256(json.dumps(written, sort_keys=True).encode()).hexdigest()
