"""The signature of an optimized model's ``forward``: the wrapped model's.

Tools read a model's ``forward`` signature to decide what to pass it: Hugging Face's
``Trainer`` keeps only the dataset columns that ``inspect.signature(model.forward)`` names (so
``(*args, **kwargs)`` left every batch empty) and passes ``num_items_in_batch`` only where it
finds ``**kwargs``. :class:`ModelSignatureForward` hands out the optimized model's forward
bound with the wrapped model's signature.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch


class ModelSignatureForward:
    """A descriptor: ``instance.forward`` is ``function`` bound to the instance, with the
    signature of ``instance.model.forward`` (looked up again when the model's forward
    changes)."""

    def __init__(self, function: Callable[..., Any]):
        self.function = function
        functools.update_wrapper(self, function)  # the docstring, for help()

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self.function
        if torch.compiler.is_compiling():  # torch.compile of the optimized model: refused
            return types.MethodType(self.function, instance)
        return BoundForward(self.function, instance, _model_signature(instance))


class BoundForward:
    """A bound method with a signature of its own: ``__func__`` and ``__self__`` as a bound
    method has them, for tools that take a forward apart and bind it again (accelerate's
    mixed-precision wrapper, and its unwrapping)."""

    __slots__ = ("__func__", "__self__", "__signature__")

    def __init__(
        self, function: Callable[..., Any], instance: Any, signature: inspect.Signature | None
    ):
        self.__func__ = function
        self.__self__ = instance
        self.__signature__ = signature

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *args, **kwargs)


def _model_signature(instance: Any) -> inspect.Signature | None:
    """The signature of the wrapped model's forward, cached on ``instance`` by its function."""
    forward = instance.__dict__["_model"].forward
    function = getattr(forward, "__func__", forward)
    cached = instance.__dict__.get("_forward_signature")
    if cached is None or cached[0] != id(function):
        try:
            signature = inspect.signature(forward)
        except (TypeError, ValueError):  # a builtin or an extension's callable
            signature = None
        cached = (id(function), signature)
        instance.__dict__["_forward_signature"] = cached
    return cached[1]
