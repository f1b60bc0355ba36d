"""What ``offremat.optimize`` refuses in a model before it profiles anything: lazy modules,
models optimized already, and ``DistributedDataParallel``."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parameter import is_lazy


def refuse_lazy(model: nn.Module | Sequence[nn.Module]) -> None:
    """Refuse lazy modules whose parameters have no shape yet: nothing can be profiled."""
    roots = [model] if isinstance(model, nn.Module) else list(model)
    modules = [m for m in roots if isinstance(m, nn.Module)]  # the rest is refused later
    tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    if any(is_lazy(tensor) for tensor in tensors):
        raise ValueError(
            "the model has lazy modules whose parameters are not initialized yet (nn.LazyLinear "
            "and the like): run it once on a batch, model(example_batch), before "
            "offremat.optimize, so that their shapes are known"
        )


def refuse_wrappers(model: nn.Module | Sequence[nn.Module], optimized: type) -> None:
    """Refuse a model that holds a model offremat already optimized (of type ``optimized``:
    the inner one's steps would run inside the outer one's recording, profile and stages) or
    a ``DistributedDataParallel`` (its reducer takes one backward per forward, where
    profiling runs several and a step's backward is one engine call per stage)."""
    roots = [model] if isinstance(model, nn.Module) else list(model)
    for root in roots:
        if not isinstance(root, nn.Module):
            continue
        for path, module in root.named_modules():
            where = f" (at {path!r})" if path else ""
            if isinstance(module, optimized):
                raise TypeError(
                    f"this model is, or holds, a model offremat already optimized{where}: "
                    "offremat.optimize the plain model (OptimizedModule.model) as one, with "
                    "everything it holds, or keep the optimized one and do not optimize "
                    "around it"
                )
            if isinstance(module, DistributedDataParallel):
                raise TypeError(
                    f"this model is, or holds, a DistributedDataParallel module{where}: its "
                    "gradient reducer expects one backward per forward, which offremat's "
                    "profiling and per-stage backwards are not. Optimize the model it wraps "
                    "and wrap the result: DistributedDataParallel(offremat.optimize(model, "
                    "batch, ...))"
                )
