"""The plans of each state of a model's stages (:class:`StatePlans`), and the swap from one
state's to another's as the stages change (:func:`swapped`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from offremat._signatures import Signature, VariantKey
from offremat._stage_state import StageState
from offremat._value_checks import ValueChecks
from offremat.executor import PlanExecutor
from solvers.chain import Chain

logger = logging.getLogger(__name__)

KEPT_STATES = 8
"""How many other states of the stages keep their plans
(:meth:`offremat._shapes.ShapePlans.executor`)."""


@dataclass
class StatePlans:
    """The plans of one state of the stages, as :class:`ShapePlans` holds them, and what
    their steps measured (``checks``)."""

    executors: dict[Signature, PlanExecutor] = field(default_factory=dict)
    profiled: dict[Signature, Chain] = field(default_factory=dict)
    provisional: set[Signature] = field(default_factory=set)
    variants: dict[VariantKey, PlanExecutor] = field(default_factory=dict)
    unprofiled: set[Signature] = field(default_factory=set)
    checks: ValueChecks = field(default_factory=ValueChecks)


def swapped(
    by_state: dict[StageState, StatePlans],
    current_state: StageState,
    current: StatePlans,
    state: StageState,
    change: str,
) -> StatePlans:
    """Put ``current`` (the plans of ``current_state``) aside in ``by_state`` and take out
    those of ``state``: new and empty, said aloud with ``change`` (what changed, in words),
    where none are kept. The last :data:`KEPT_STATES` are kept."""
    by_state[current_state] = current
    kept = by_state.pop(state, None)
    if isinstance(kept, tuple):  # kept by a version before StatePlans (5: before checks)
        kept = StatePlans(*kept)
    while len(by_state) > KEPT_STATES:
        by_state.pop(next(iter(by_state)))
    if kept is not None:
        return kept
    if state[0] != current_state[0]:
        logger.warning(
            "the model's stages changed (%s): planning each shape again for them", change
        )
    else:
        logger.warning(
            "the model's training or eval mode changed: planning each shape again for this "
            "mode (a step with gradients enabled follows a plan in eval mode too; evaluate "
            "under torch.no_grad(), which runs the model as it is)"
        )
    return StatePlans()
