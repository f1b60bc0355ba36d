"""offremat's mathematics: chains, plans, the simulator and the solvers. Never imports torch."""

from solvers.chain import Chain, Link, Stage
from solvers.chain_limits import ChainFormatError
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
