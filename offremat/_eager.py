"""Python dispatch modes that run compiled code eagerly while they are active.

Dynamo cannot compile a frame under a Python dispatch mode, and when it meets one it marks the
frame's code as skipped for good: a compiled block run once under offremat's memory tracker,
mutation watch or generator watch would never run compiled again. Under these modes the
compiler's stance is ``force_eager`` instead, which runs compiled frames eagerly and leaves
their compiled code for later calls.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class EagerDispatchMode(TorchDispatchMode):
    """A dispatch mode under which compiled code runs eagerly (see the module's notes)."""

    def __enter__(self) -> Any:
        self._stances = [*getattr(self, "_stances", []), torch.compiler.set_stance("force_eager")]
        self._stances[-1].__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._stances.pop().__exit__(*exc)


def eager() -> Any:
    """A context in which compiled code runs eagerly (and keeps its compiled code for later)."""
    return torch.compiler.set_stance("force_eager")
