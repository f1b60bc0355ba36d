"""What a call of an optimized model is checked for before its training step runs.

A step that would not be the planned one is refused with what to do instead: another
autocast or other attention kernels than the profile's (its activations are not the planned
sizes), ``torch.compile`` of the whole step (or of the model given to ``optimize``), a
request for every block's hidden states or for a key-value cache, saved-tensor hooks of the
caller's around the step (or saved-tensor hooks disabled there), and transforms that only
plain autograd's schedule runs (``torch.func``, forward-mode AD, ``parametrize.cached``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from offremat._block_values import cache_in
from offremat._blocks import NotAChainError
from offremat._call_state import innermost_saved_tensor_hooks
from offremat._stage import AutocastState
from offremat._tensors import flatten


def _describe(state: AutocastState) -> str:
    return f"autocast {state.dtype}" if state.enabled else "no autocast"


def refuse_autocast(planned: AutocastState, now: AutocastState) -> None:
    """A step under another autocast than the profile's does not hold the planned activations:
    planned under autocast, fp32 activations would not fit (measured: 1.67 times the budget on
    a GPT-2); planned without it, autocast saves a low-precision copy of every weight it casts
    for the backward, which no plan counted."""
    raise RuntimeError(
        f"the plan was profiled under {_describe(planned)} but this step runs under "
        f"{_describe(now)}, so its activations would not be the planned ones and could break the "
        "budget: run the step inside the same autocast as offremat.optimize, or pass "
        "autocast=dtype to offremat.optimize to have the optimized model enter it"
    )


def refuse_outer_autocast(planned: AutocastState, now: AutocastState) -> None:
    """A model given ``autocast=`` enters it for its steps, and inside another the inner one
    wins: a step the caller ran under float16 ran in the plan's bfloat16, unsaid (a review)."""
    raise RuntimeError(
        f"this optimized model runs its steps under {_describe(planned)} (autocast= given to "
        f"offremat.optimize), but this step is called inside {_describe(now)}, which it would "
        "override: call it outside that autocast, or optimize with "
        f"autocast={now.dtype} to train under that one"
    )


ATTENTION_KERNELS = ("flash", "memory-efficient", "math", "cuDNN")


def attention_kernels() -> tuple[bool, ...]:
    """Which of :data:`ATTENTION_KERNELS` ``scaled_dot_product_attention`` may pick now
    (``torch.nn.attention.sdpa_kernel`` sets them)."""
    backends = torch.backends.cuda
    return (
        backends.flash_sdp_enabled(),
        backends.mem_efficient_sdp_enabled(),
        backends.math_sdp_enabled(),
        backends.cudnn_sdp_enabled(),
    )


def refuse_other_attention(planned: tuple[bool, ...], now: tuple[bool, ...]) -> None:
    """A step that may pick other attention kernels than the profile's does not hold the
    planned activations: the math kernel saves the attention probabilities, which the flash
    kernels recompute (measured: 4.3 times the budget on a GPT planned on the CPU's flash
    kernel and stepped under ``sdpa_kernel(SDPBackend.MATH)``)."""

    def named(kernels: tuple[bool, ...]) -> str:
        return ", ".join(k for k, on in zip(ATTENTION_KERNELS, kernels, strict=True) if on)

    raise RuntimeError(
        f"the plan was profiled with the attention kernels {named(planned) or 'none'} allowed, "
        f"but this step allows {named(now) or 'none'}, so its activations would not be the "
        "planned ones and could break the budget: run the step under the same "
        "torch.nn.attention.sdpa_kernel as offremat.optimize"
    )


def refuse_other_default_dtype(planned: torch.dtype, now: torch.dtype) -> None:
    """A step under another default dtype than the profile's makes the tensors a block
    creates without a dtype (``torch.ones(n)``, ``torch.arange(n, dtype=None)``) in it
    (measured: 1.43 times the budget, float64 set after a float32 plan)."""
    raise RuntimeError(
        f"the plan was profiled with torch's default dtype {planned}, but this step runs "
        f"under {now}: tensors the blocks make without a dtype would be of another size than "
        "planned and could break the budget. Set the default dtype back, or call "
        "offremat.optimize again after torch.set_default_dtype"
    )


def refuse_compiled_model(model: Any) -> None:
    """Refuse ``optimize(torch.compile(model))``: the step calls the model's blocks itself,
    so the whole-model graph would never run, and the compile would be silently lost."""
    compiled_in_place = getattr(model, "_compiled_call_impl", None) is not None  # .compile()
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) or compiled_in_place:
        raise TypeError(
            "offremat.optimize was given a torch.compile'd model; its training step runs the "
            "model's blocks itself, so that compiled graph would never run. Pass the model "
            "uncompiled (compiled._orig_mod, or without model.compile()) and compile its "
            "blocks instead: `for block in blocks: block.compile()`"
        )


def holds_compiled_code(module: nn.Module) -> bool:
    """Whether ``module`` or a module inside it was compiled (``block.compile()``, a
    ``torch.compile``'d module, or TorchScript, whose interpreter turns an exception a pack
    hook raises into one of its own)."""
    return any(
        isinstance(m, (torch._dynamo.eval_frame.OptimizedModule, torch.jit.ScriptModule))
        or getattr(m, "_compiled_call_impl", None) is not None
        for m in module.modules()
    )


@torch.compiler.disable
def refuse_compile() -> None:
    # Called where dynamo traces the forward: not traced itself, it raises when the compiled
    # code runs.
    raise RuntimeError(
        "torch.compile of an offremat-optimized model cannot compile its training step: "
        "offremat runs the blocks itself, keeping, offloading and recomputing their "
        "activations. Compile the blocks instead, before offremat.optimize: "
        "`for block in blocks: block.compile()`"
    )


def recorded_output_flags(model: nn.Module) -> set[str]:
    """The ``output_*`` flags that ask a model for what each block computed: hidden states,
    attentions, and whatever else a Hugging Face model records with hooks (router logits)."""
    flags = {"output_hidden_states", "output_attentions"}
    for module in model.modules():
        flags |= {f"output_{key}" for key in getattr(module, "_can_record_outputs", None) or {}}
    return flags


def refuse_recorded_outputs(model: nn.Module, flags: set[str], kwargs: dict[str, Any]) -> None:
    """Refuse to return what every block computed (``flags``, from
    :func:`recorded_output_flags`): the chain hands one hidden state on, and a recomputation
    would record a block twice."""
    config = getattr(model, "config", None)
    for flag in sorted(flags):
        wanted = kwargs.get(flag)
        if wanted is None:
            wanted = getattr(config, flag, False)
        if wanted is True:
            raise NotAChainError(
                f"{flag}=True asks for every block's result, which an offremat training step "
                f"does not keep; call with {flag}=False (and set model.config.{flag} = False), "
                "or take them from a run under torch.no_grad()"
            )


def refuse_kv_cache(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a key-value cache in a training step: the blocks run without one, as under
    Hugging Face's gradient checkpointing (a recomputed block would fill it twice), so the
    step could neither attend to a cache given nor fill one to return."""
    given = any(cache_in(value) for value in (*args, *kwargs.values()))
    if given or kwargs.get("use_cache") is True:
        what = "past_key_values" if given else "use_cache=True"
        raise NotAChainError(
            f"this training step asks for a key-value cache ({what}); offremat runs the "
            "blocks without one, as Hugging Face's gradient checkpointing does, so the step "
            "could not attend to the cached keys and values, nor fill a cache to return. "
            "Train without it (no past_key_values, use_cache=False), or make this call under "
            "torch.no_grad()"
        )


def refuse_mutation_of_saved_tensors(doing: str) -> None:
    """Refuse to run (``doing`` says what) inside
    ``torch.autograd.graph.allow_mutation_on_saved_tensors``, whose cloning of a saved tensor
    changed in place works through saved-tensor hooks, which the executor's own replace."""
    if torch.autograd.graph._allow_mutation_on_saved_tensors_enabled:
        raise RuntimeError(
            f"{doing} inside torch.autograd.graph.allow_mutation_on_saved_tensors(); offremat "
            "packs the saved tensors of its stages with saved_tensors_hooks of its own, so the "
            "context's copies of saved tensors changed in place would not be made. Make the "
            "in-place change out of place (x = x + 1 for x += 1) and leave the context out, or "
            "train under it with the model itself (om.model)"
        )


def refuse_outer_saved_tensor_hooks() -> None:
    """The executor packs its stages' saved tensors with hooks of its own, innermost, so a
    ``saved_tensors_hooks`` around the step (activation compression, ``save_on_cpu``) would
    not see them: plain autograd's step under those hooks computes something else."""
    refuse_mutation_of_saved_tensors("this training step runs")
    if innermost_saved_tensor_hooks() is not None:
        raise RuntimeError(
            "this training step runs inside torch.autograd.graph.saved_tensors_hooks (or "
            "save_on_cpu); offremat packs the saved tensors of its stages itself, so those "
            "hooks would not see them. Leave the hooks out and let the plan offload (give "
            "optimize a bandwidth)"
        )


# Private, but the one way to read this state: torch's own disable_saved_tensors_hooks saves
# and restores it with this call (absent from an older torch: nothing is checked there).
_DISABLED_MESSAGE = getattr(
    torch._C._autograd, "_saved_tensors_hooks_get_disabled_error_message", None
)


def saved_tensor_hooks_disabled() -> str | None:
    """The message of the ``torch.autograd.graph.disable_saved_tensors_hooks`` in force, or
    None where saved-tensor hooks may be used."""
    return None if _DISABLED_MESSAGE is None else _DISABLED_MESSAGE()


def _hooks_disabled_advice(doing: str, message: str) -> str:
    return (
        f"{doing} inside torch.autograd.graph.disable_saved_tensors_hooks({message!r}); "
        "offremat packs the saved tensors of its stages with saved_tensors_hooks of its own (to "
        "measure, offload and recompute them), which that forbids"
    )


def refuse_disabled_saved_tensor_hooks(doing: str) -> None:
    """Refuse to profile (``doing`` says what) where saved-tensor hooks are disabled: torch
    would raise the disabling code's message from inside the profile."""
    message = saved_tensor_hooks_disabled()
    if message is not None:
        raise RuntimeError(
            _hooks_disabled_advice(doing, message)
            + ". Call it outside that context (the optimized model's steps with a keep-all "
            "plan run as plain autograd there)"
        )


def in_functorch_transform() -> bool:
    """Whether a ``torch.func`` transform (grad, vmap) is running."""
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def plain_autograd_only(stages: Sequence[nn.Module], batch: Any) -> str | None:
    """Why this step can run only as plain autograd's schedule, or None: a ``torch.func``
    transform, forward-mode AD's dual tensors, or ``parametrize.cached()`` around a step
    whose stages hold a parametrized weight; or saved-tensor hooks disabled around it
    (``torch.autograd.graph.disable_saved_tensors_hooks``), where a plan's own hooks raise."""
    if in_functorch_transform():
        return _FUNCTORCH
    message = saved_tensor_hooks_disabled()
    if message is not None:
        return (
            _hooks_disabled_advice("a training step of an offremat-optimized model runs", message)
            + ". Run the step outside that context, or train there with the model itself "
            "(om.model), or with a keep-all plan (budget=1.0), which runs as plain autograd"
        )
    if torch.autograd.forward_ad._current_level >= 0 and any(
        torch.autograd.forward_ad.unpack_dual(t).tangent is not None
        for t in (*flatten(batch)[0], *(p for stage in stages for p in stage.parameters()))
    ):
        return (
            "a training step of an offremat-optimized model is given dual tensors (forward-mode "
            "AD): its plan holds and recomputes tensors with autograd functions of its own, "
            "which have no forward-mode derivative. Compute the tangents with the model "
            "itself (om.model), or use loss.backward()"
        )
    if torch.nn.utils.parametrize._cache_enabled and any(
        torch.nn.utils.parametrize.is_parametrized(module)
        for stage in stages
        for module in stage.modules()
    ):
        return (
            "a training step of an offremat-optimized model runs inside "
            "torch.nn.utils.parametrize.cached(): each parametrized weight is then computed "
            "once, outside the stages that use it, so its gradient would reach the "
            "parametrization one stage at a time (equal to plain autograd's up to rounding "
            "only), and a recomputed stage would not compute it again. Run the step outside "
            "cached(): each stage then computes the weight itself, as the plan recomputes it"
        )
    return None


_FUNCTORCH = (
    "a training step of an offremat-optimized model runs inside a torch.func transform "
    "(grad, vmap, jacrev, vjp): its plan holds, moves and recomputes tensors itself, which the "
    "transform's wrapped tensors do not allow. Use loss.backward() (per-example gradients: "
    "one step per example, or the model without offremat)"
)


def refuse_functorch_transforms() -> None:
    """A ``torch.func`` transform wraps tensors whose storage the plan cannot hold, move or
    recompute."""
    if in_functorch_transform():
        raise RuntimeError(_FUNCTORCH)


@contextmanager
def transforms_in_blocks_refused() -> Iterator[None]:
    """Say what to do where the model's forward calls ``torch.func.grad`` (or ``vjp``,
    ``jacrev``, ``hessian``): torch refuses those under saved-tensor hooks, with which
    offremat packs every stage's saved tensors, and with which it records the whole model's
    forward to find its blocks."""
    try:
        yield
    except RuntimeError as error:
        if "don't yet support saved tensor hooks" not in str(error):
            raise
        raise RuntimeError(
            "the model's forward calls a torch.func transform (grad, vjp, jacrev, hessian), "
            "which torch refuses under saved-tensor hooks, and offremat packs the saved "
            "tensors of every stage, and of the forward it records to find the blocks, with "
            "hooks of its own. Optimize a part that does not call it (an nn.Sequential of "
            "the blocks, which your forward then calls), or train this model without offremat"
        ) from error
