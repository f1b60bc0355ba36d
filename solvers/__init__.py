"""offremat's mathematics: chains, plans, the simulator and the solvers. Never imports torch."""

from solvers.chain import Chain, ChainFormatError, Link, Stage
from solvers.plan import Op, Plan, PlanError, validate
from solvers.simulator import Simulation, score, simulate

__all__ = [
    "Chain",
    "ChainFormatError",
    "Link",
    "Op",
    "Plan",
    "PlanError",
    "Simulation",
    "Stage",
    "score",
    "simulate",
    "validate",
]
