"""The random number generators a stage draws from: their states, replay, and refusal.

A recomputation must draw the numbers the first forward drew. That holds for the global CPU
and CUDA generators, for every ``torch.Generator`` a module keeps as an attribute, and for
the global generators of Python's ``random`` and NumPy (a block that draws a layer-drop or a
scale from them): their states are captured before a recomputed stage's first forward and
replayed around each recomputation (the host ones where the first forward moved them), as
``torch.utils.checkpoint`` does for torch's global ones. A generator kept anywhere else (a
closure, a list, a global variable) cannot be found, so :class:`GeneratorWatch` refuses the
model up front rather than let a recomputation draw other numbers.
"""

from __future__ import annotations

import ctypes
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
    """The states of the generators a stage may draw from (``host`` None: not those).

    The CPU generator, those of the CUDA devices the stage runs on, every
    ``torch.Generator`` its modules keep as an attribute (a module that draws noise from a
    generator of its own would otherwise recompute other numbers), and the host generators.
    """

    cpu: torch.Tensor
    cuda: tuple[tuple[int, torch.Tensor], ...]
    owned: tuple[tuple[torch.Generator, torch.Tensor], ...] = ()
    host: tuple[Any, Any] | None = None  # Python's random and NumPy's global generators

    @classmethod
    def capture(
        cls,
        cuda_devices: Sequence[int],
        generators: Sequence[torch.Generator] = (),
        host: HostRandomReader | None = None,
    ) -> RngState:
        """The current states (the host ones through ``host``, a step's reader)."""
        return cls(
            torch.get_rng_state(),
            tuple((index, torch.cuda.get_rng_state(index)) for index in cuda_devices),
            tuple((generator, generator.get_state()) for generator in generators),
            host_random_state() if host is None else host.read(),
        )

    def for_replay(self, host: HostRandomReader) -> RngState:
        """These states, as a recomputation replays them: torch's generators always (a block
        that draws inside ``torch.random.fork_rng`` leaves them as they were, yet drew from
        them), the host generators only where they moved since (reading them is dear).
        """
        moved = self.host is not None and not same_host_state(host.read(), self.host)
        return RngState(self.cpu, self.cuda, self.owned, self.host if moved else None)

    def current(self) -> RngState:
        """The current states of the generators this one holds."""
        return RngState(
            torch.get_rng_state(),
            tuple((index, torch.cuda.get_rng_state(index)) for index, _ in self.cuda),
            tuple((generator, generator.get_state()) for generator, _ in self.owned),
            None if self.host is None else host_random_state(),
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
    # The legacy tuple only exists for a Mersenne Twister; NumPy warns for any other.
    twister = type(np.random.get_bit_generator()) is np.random.MT19937
    return random.getstate(), np.random.get_state(legacy=twister)


def restore_host_random(state: tuple[Any, Any]) -> None:
    """Make ``state`` (from :func:`host_random_state`) the host generators' states."""
    random.setstate(state[0])
    np.random.set_state(state[1])


def same_host_state(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    """Whether two host states (from :func:`host_random_state`) are the same."""
    return a is b or (a[0] == b[0] and _same_numpy_state(a[1], b[1]))


def _same_numpy_state(a: Any, b: Any) -> bool:
    # A tuple holding an array for NumPy's Mersenne Twister, a dict for other bit generators.
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_numpy_state(a[k], b[k]) for k in a)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(map(_same_numpy_state, a, b))
    return type(a) is type(b) and a == b


class HostRandomReader:
    """Reads the host generators' states (Python's ``random``, NumPy's global) during a step.

    A full read of NumPy's legacy state copies its 624 words one at a time, about 35 µs: more
    than a small stage's own cost, twice per recomputed stage. The reader keeps its last full
    read and hands it out again while a cheap fingerprint is the same: Python's state (read in
    full, 8 µs) and the raw bytes of NumPy's Mersenne Twister. One change escapes that
    fingerprint: NumPy's legacy ``gauss`` handing out the normal deviate it keeps cached,
    which moves no Twister word, so while one is cached every read is full; so is every read
    when NumPy's global bit generator is not a Mersenne Twister. A reader serves one step:
    between steps the caller may set any state, the cached normal included. Within a step, a
    block that sets NumPy's state back to one with a cached normal and the same Twister words
    would go unseen; no block is known to.
    """

    def __init__(self) -> None:
        self._last: tuple[tuple[Any, Any], Any] | None = None
        self._fingerprints = True  # until a full read disagrees with its fingerprint

    def read(self) -> tuple[Any, Any]:
        """The host generators' states now, as :func:`host_random_state` gives them."""
        fingerprint = _host_fingerprint() if self._fingerprints else None
        if self._last is not None and fingerprint is not None:
            state, seen = self._last
            if seen == fingerprint and not _gauss_cached(state[1]):
                return state
        state = host_random_state()
        # The Twister's bytes are read where NumPy's state struct lies; should its layout
        # ever differ, the reader reads in full rather than trust stale bytes.
        if fingerprint is not None and fingerprint[1] != _twister_bytes(state[1]):
            self._fingerprints = False
            fingerprint = None
        self._last = (state, fingerprint)
        return state


_TWISTER_STATE_BYTES = 624 * 4 + 4  # mt19937_state: uint32_t key[624]; int pos


def _host_fingerprint() -> tuple[Any, bytes] | None:
    generator = np.random.get_bit_generator()
    if type(generator) is not np.random.MT19937:  # a subclass may keep its state elsewhere
        return None
    twister = ctypes.string_at(generator.ctypes.state_address, _TWISTER_STATE_BYTES)
    return random.getstate(), twister


def _twister_bytes(numpy_state: Any) -> bytes | None:
    if not isinstance(numpy_state, tuple):
        return None
    _, key, position = numpy_state[:3]
    return key.astype(np.uint32).tobytes() + int(position).to_bytes(4, "little", signed=True)


def _gauss_cached(numpy_state: Any) -> bool:
    # The legacy tuple: ("MT19937", key, pos, has_gauss, cached_gaussian).
    return not isinstance(numpy_state, tuple) or bool(numpy_state[3])


@contextmanager
def replayed_rng(state: RngState) -> Iterator[None]:
    """Run with the generators as they were in ``state``, then restore the current states."""
    current = state.current()
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
