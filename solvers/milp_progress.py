"""What a running MILP search has reached, reported while it runs.

A search can take its whole time limit; a person at a terminal should see it move. The
search reports its state through :class:`ProgressReport` (at most a few times a second) to a
callback that the command line draws as one line: elapsed time, the best plan's predicted
step time, the best proven bound and the gap between them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class SearchProgress:
    """The search's state: seconds since the solve began, the best plan's predicted step time
    and the best proven bound on it (seconds; None while unknown)."""

    elapsed_s: float
    incumbent_s: float | None
    bound_s: float | None

    @property
    def gap(self) -> float | None:
        """(incumbent - bound) / incumbent, as the MILP backends define their relative gap."""
        if self.incumbent_s is None or self.bound_s is None or self.incumbent_s <= 0:
            return None
        return max(0.0, (self.incumbent_s - self.bound_s) / self.incumbent_s)


ProgressCallback = Callable[[SearchProgress], None]


class ProgressReport:
    """Forwards a search's state to ``callback``, at most once every ``period_s`` seconds.

    It keeps the best incumbent (least) and bound (greatest) it was told of, so a report that
    knows only one of them still shows both.
    """

    def __init__(self, callback: ProgressCallback | None, started: float, period_s: float = 0.25):
        self.callback = callback
        self.started = started
        self.period_s = period_s
        self.last = -math.inf
        self.incumbent_s = math.inf
        self.bound_s = -math.inf

    @property
    def active(self) -> bool:
        """Whether anyone listens."""
        return self.callback is not None

    def __call__(
        self, incumbent_s: float | None, bound_s: float | None = None, force: bool = False
    ) -> None:
        """Report, unless the last report was under ``period_s`` ago and ``force`` is False."""
        if incumbent_s is not None and math.isfinite(incumbent_s):
            self.incumbent_s = min(self.incumbent_s, incumbent_s)
        if bound_s is not None and math.isfinite(bound_s):
            self.bound_s = max(self.bound_s, bound_s)
        now = time.monotonic()
        if self.callback is None or (not force and now - self.last < self.period_s):
            return
        self.last = now
        incumbent = self.incumbent_s if math.isfinite(self.incumbent_s) else None
        bound = self.bound_s if math.isfinite(self.bound_s) else None
        self.callback(SearchProgress(now - self.started, incumbent, bound))
