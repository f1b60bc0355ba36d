"""The process-wide settings that choose which kernel, or what precision, an op computes with.

Design note. A recomputation must run the kernels the stage's first forward ran, or it
rebuilds other activations than plain autograd saved (a CPU convolution with oneDNN off
differs in the last bits from one with it on). ``torch.utils.checkpoint`` replays autocast and
the RNG, not these settings, and a backward may run outside the region that set them for the
forward (``torch.backends.mkldnn.flags(enabled=False)`` around the forward alone). So each
step's forward takes a :class:`BackendFlags` snapshot, and every recomputation runs under it.

The settings are one table, :data:`_SETTINGS`, each read and written through the getter and
setter this torch has (a CPU-only build has the CUDA ones too); a setting a torch version lacks
is left out. The float32 precisions (``allow_tf32`` of cuBLAS and cuDNN,
``torch.set_float32_matmul_precision``) are, from torch 2.9, views of one tree of per-backend,
per-op precisions whose legacy getters raise after a mix of the two APIs: there the tree is
read and written itself, parents before children, as setting a parent overwrites its children,
with the matmul precision torch keeps beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class _Setting:
    name: str
    get: Callable[[], Any]
    set: Callable[[Any], None]


def _flag(name: str, getter: str, setter: str) -> list[_Setting]:
    """A boolean that ``torch._C`` reads and writes, where this torch has it."""
    get, set_ = getattr(torch._C, getter, None), getattr(torch._C, setter, None)
    return [] if get is None or set_ is None else [_Setting(name, get, set_)]


def _attention_kernels() -> list[_Setting]:
    """Which kernels ``scaled_dot_product_attention`` may pick (``sdpa_kernel`` sets them)."""
    backends = torch.backends.cuda
    settings = []
    for kind in ("flash", "mem_efficient", "math", "cudnn"):
        get = getattr(backends, f"{kind}_sdp_enabled", None)
        set_ = getattr(backends, f"enable_{kind}_sdp", None)
        if get is not None and set_ is not None:
            settings.append(_Setting(f"{kind}_sdp", get, set_))
    return settings


# Parents first: setting one overwrites its children.
_PRECISIONS = (
    ("generic", "all"),
    *((backend, op) for backend in ("cuda", "mkldnn") for op in ("all", "matmul", "conv", "rnn")),
)


def _get_precisions() -> tuple[str | None, tuple[str, ...]]:
    """``torch.get_float32_matmul_precision()``, kept beside the tree and checked against it
    (None where a mix of the two APIs makes that check raise), and the tree."""
    try:
        matmul = torch.get_float32_matmul_precision()
    except RuntimeError:
        matmul = None
    return matmul, tuple(torch._C._get_fp32_precision_getter(*key) for key in _PRECISIONS)


def _set_precisions(value: tuple[str | None, tuple[str, ...]]) -> None:
    matmul, tree = value
    if matmul is not None:  # first: it also sets the tree's matmul precisions
        torch.set_float32_matmul_precision(matmul)
    for key, precision in zip(_PRECISIONS, tree, strict=True):
        torch._C._set_fp32_precision_setter(*key, precision)


def _precisions() -> list[_Setting]:
    """The float32 precisions: the tree where this torch has one, else the legacy settings."""
    if hasattr(torch._C, "_get_fp32_precision_getter"):
        return [_Setting("fp32_precision", _get_precisions, _set_precisions)]
    return [
        *_flag("cublas_allow_tf32", "_get_cublas_allow_tf32", "_set_cublas_allow_tf32"),
        *_flag("cudnn_allow_tf32", "_get_cudnn_allow_tf32", "_set_cudnn_allow_tf32"),
        _Setting(
            "float32_matmul_precision",
            torch.get_float32_matmul_precision,
            torch.set_float32_matmul_precision,
        ),
    ]


def _set_deterministic(value: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(value[0], warn_only=value[1])


_SETTINGS: tuple[_Setting, ...] = (
    *_flag("mkldnn", "_get_mkldnn_enabled", "_set_mkldnn_enabled"),
    *_flag("mkldnn_deterministic", "_get_mkldnn_deterministic", "_set_mkldnn_deterministic"),
    *_flag("cudnn", "_get_cudnn_enabled", "_set_cudnn_enabled"),
    *_flag("cudnn_benchmark", "_get_cudnn_benchmark", "_set_cudnn_benchmark"),
    *_flag("cudnn_deterministic", "_get_cudnn_deterministic", "_set_cudnn_deterministic"),
    *_precisions(),
    _Setting(
        "deterministic_algorithms",
        lambda: (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        _set_deterministic,
    ),
    *_attention_kernels(),
)


@dataclass(frozen=True)
class BackendFlags:
    """The values of :data:`_SETTINGS` at one moment, in its order."""

    values: tuple[Any, ...]

    @classmethod
    def now(cls) -> BackendFlags:
        """The settings in force now."""
        return cls(tuple(setting.get() for setting in _SETTINGS))

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Run under these settings; the caller's come back afterwards, an error included.

        Only the settings that differ are written, so that a recomputation under the
        forward's own settings, the common case, writes none.
        """
        callers = BackendFlags.now()
        changed = [
            (setting, mine, theirs)
            for setting, mine, theirs in zip(_SETTINGS, self.values, callers.values, strict=True)
            if mine != theirs
        ]
        try:
            for setting, mine, _ in changed:
                setting.set(mine)
            yield
        finally:
            for setting, _, theirs in reversed(changed):
                setting.set(theirs)
