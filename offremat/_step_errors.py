"""The errors a step's stages raise where they do what a plan cannot run: a recomputation
that returns other tensors, a graph shared across stages, DistributedDataParallel's hooks run
once per stage."""

from __future__ import annotations

from offremat._deferred import recomputed_otherwise
from offremat._stage import escaped_tensor_error
from offremat._tensors import TensorKind


def refuse_other_outputs(stage: str, first: list[TensorKind], now: list[TensorKind]) -> None:
    """Refuse a recomputation whose outputs differ from the first forward's in kind."""
    if len(first) != len(now):
        raise RuntimeError(
            f"stage {stage!r} returned {len(now)} tensors when recomputed where its first "
            f"forward returned {len(first)}: it does not compute the same thing twice, so it "
            "cannot be recomputed. Use a plan that keeps this stage"
        )
    k = next(k for k, (a, b) in enumerate(zip(first, now, strict=True)) if a != b)
    raise recomputed_otherwise(stage, f"output {k + 1} of {len(first)}", first[k], now[k])


def shared_weight_graph(stage: str) -> RuntimeError:
    return RuntimeError(
        f"stage {stage!r} computes with weights that are not leaves and whose graph other "
        "stages share (torch.func.functional_call with weights from an inner gradient step, "
        "as in MAML): each stage's backward is its own engine call, so that graph would run "
        "once per stage. Train such a step with plain autograd (a budget at or above the "
        "keep-all peak runs it so)"
    )


def reducer_saw_shared(stage: str) -> RuntimeError:
    """The error for DistributedDataParallel's reducer marking a parameter ready twice."""
    return RuntimeError(
        f"DistributedDataParallel saw a gradient of one parameter twice in one backward, at "
        f"stage {stage!r}: a parameter that several stages use (a block used twice, weights "
        "tied between stages) has its gradient accumulated once, but the hooks DDP puts on its "
        "accumulation node run in each of those stages' backwards, where plain DDP runs them "
        "once. Train such a model with plain DDP, or give each stage its own parameters"
    )


def reducer_found_unused(stage: str) -> RuntimeError:
    """The error for DistributedDataParallel with ``find_unused_parameters=True``."""
    return RuntimeError(
        f"DistributedDataParallel saw the gradient of a parameter of stage {stage!r} that it "
        "had marked unused: with find_unused_parameters=True it looks for the parameters in "
        "the forward's graph, which does not reach them (each stage's backward is an engine "
        "call of its own), so it marks them all unused. Wrap the optimized model with "
        "find_unused_parameters=False (Hugging Face's Trainer: "
        "ddp_find_unused_parameters=False)"
    )


def graph_run_before(stage: str) -> RuntimeError:
    """The error for a stage's graph that autograd had run backward before the step's B(i)."""
    return RuntimeError(
        f"part of stage {stage!r}'s graph had run backward before the step's backward of "
        "the stage. Either the stage reads a tensor kept from an earlier step's graph (a "
        "cache filled with gradients on: detach it), or " + str(escaped_tensor_error(stage))
    )
