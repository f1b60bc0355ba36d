"""The random number generators a stage draws from: their states, replay, and refusal.

A recomputation must draw the numbers the first forward drew. That holds for the global CPU
and CUDA generators, for every ``torch.Generator`` a module keeps as an attribute, and for
the global generators of Python's ``random`` and NumPy (a block that draws a layer-drop or a
scale from them): their states are captured before a recomputed stage's first forward and
replayed around each recomputation, as ``torch.utils.checkpoint`` does for torch's global
ones. A generator kept anywhere else (a
closure, a list, a global variable) cannot be found, so :class:`GeneratorWatch` refuses the
model up front rather than let a recomputation draw other numbers.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from offremat._eager import EagerDispatchMode


class UnreplayableRandomnessError(RuntimeError):
    """The model draws from a generator that offremat cannot replay on recomputation."""


def cuda_device_indices(device: torch.device) -> list[int]:
    """The CUDA device whose generator a computation on ``device`` draws from (none on CPU)."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


@dataclass(frozen=True)
class RngState:
    """The states of the generators a stage may draw from.

    The CPU generator, those of the CUDA devices the stage runs on, and every
    ``torch.Generator`` its modules keep as an attribute (a module that draws noise from a
    generator of its own would otherwise recompute other numbers).
    """

    cpu: torch.Tensor
    cuda: tuple[tuple[int, torch.Tensor], ...]
    owned: tuple[tuple[torch.Generator, torch.Tensor], ...] = ()
    host: tuple[Any, Any] | None = None  # Python's random and NumPy's global generators

    @classmethod
    def capture(
        cls, cuda_devices: Sequence[int], generators: Sequence[torch.Generator] = ()
    ) -> RngState:
        """The current states."""
        return cls(
            torch.get_rng_state(),
            tuple((index, torch.cuda.get_rng_state(index)) for index in cuda_devices),
            tuple((generator, generator.get_state()) for generator in generators),
            host_random_state(),
        )

    def unchanged(self) -> bool:
        """Whether the states are still these: nothing drew random numbers since."""
        return (
            torch.equal(torch.get_rng_state(), self.cpu)
            and all(
                torch.equal(torch.cuda.get_rng_state(index), state) for index, state in self.cuda
            )
            and all(torch.equal(g.get_state(), state) for g, state in self.owned)
            and (self.host is None or _same_host_state(host_random_state(), self.host))
        )

    def restore(self) -> None:
        """Make these the generators' states."""
        torch.set_rng_state(self.cpu)
        for index, state in self.cuda:
            torch.cuda.set_rng_state(state, index)
        for generator, state in self.owned:
            generator.set_state(state)
        if self.host is not None:
            restore_host_random(self.host)


def host_random_state() -> tuple[Any, Any]:
    """The states of Python's ``random`` and NumPy's global generators."""
    return random.getstate(), np.random.get_state()


def restore_host_random(state: tuple[Any, Any]) -> None:
    """Make ``state`` (from :func:`host_random_state`) the host generators' states."""
    random.setstate(state[0])
    np.random.set_state(state[1])


def _same_host_state(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    (python_a, numpy_a), (python_b, numpy_b) = a, b
    return (
        python_a == python_b
        and numpy_a[2:] == numpy_b[2:]
        and numpy_a[0] == numpy_b[0]
        and np.array_equal(numpy_a[1], numpy_b[1])
    )


@contextmanager
def replayed_rng(state: RngState) -> Iterator[None]:
    """Run with the generators as they were in ``state``, then restore the current states."""
    current = RngState.capture(
        [index for index, _ in state.cuda], [generator for generator, _ in state.owned]
    )
    state.restore()
    try:
        yield
    finally:
        current.restore()


class GeneratorWatch(EagerDispatchMode):
    """Raises on a random draw from a generator that is not global and not a module's.

    Aten ops take their generator as a keyword (``generator=``), so every draw is seen here.
    Generators are told apart by ``_cdata``, the address of the C++ generator: dispatch hands
    over a new Python wrapper of it at every op.
    """

    def __init__(self, known: Sequence[torch.Generator]) -> None:
        super().__init__()
        defaults = [torch.default_generator]
        if torch.cuda.is_available():
            defaults += list(torch.cuda.default_generators)
        self.known = {generator._cdata for generator in [*defaults, *known]}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        generator = kwargs.get("generator")
        if generator is not None and generator._cdata not in self.known:
            raise UnreplayableRandomnessError(
                f"the model draws random numbers ({func}) from a torch.Generator that is "
                "neither the global one nor an attribute of one of its modules, so a "
                "recomputation could not draw the same numbers again: keep the generator as an "
                "attribute of the module that uses it (self.generator = torch.Generator())"
            )
        return func(*args, **kwargs)
