"""Example chains shipped with offremat, derived from formulas by
``experiments/make_example_chains.py`` (the formulas are in each chain's metadata)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from solvers.chain import Chain


def names() -> tuple[str, ...]:
    """The names of the shipped example chains, such as ``transformer``."""
    folder = resources.files(__name__)
    return tuple(
        sorted(
            entry.name[: -len(".json")]
            for entry in folder.iterdir()
            if entry.name.endswith(".json")
        )
    )


def path(name: str) -> Path:
    """The file of example chain ``name``; ``ValueError`` lists the examples if it is unknown."""
    if name not in names():
        raise ValueError(f"no example chain {name!r}; the examples are: {', '.join(names())}")
    return Path(str(resources.files(__name__) / f"{name}.json"))


def load(name: str) -> Chain:
    """The example chain ``name``."""
    return Chain.load(path(name))
