"""``offremat.optimize``: profile, plan and wrap a model so its training step fits a budget.

The module is not called ``optimize``: importing a submodule binds its name on the package,
which would hide the function ``offremat.optimize``.

Design note: the returned :class:`OptimizedModule` *is* the model as far as ``nn.Module`` can
tell. It shares the model's parameter, buffer and child dictionaries, so ``state_dict()`` has
the model's keys (a checkpoint saved from either loads into the other), ``parameters()`` yields
the same tensors, and ``to()``, ``train()`` and ``eval()`` act on the model itself. Only
``forward`` differs, and only when a gradient is wanted: under ``no_grad`` it runs the model
as it is (in eval mode too a step with gradients follows a plan).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offremat._blocks import (
    NotAChainError,
    block_places,
    check_device,
    refuse_own_hooks,
    refuse_replaced_blocks,
)
from offremat._building import build
from offremat._call_checks import (
    attention_kernels,
    plain_autograd_only,
    recorded_output_flags,
    refuse_autocast,
    refuse_compile,
    refuse_compiled_model,
    refuse_kv_cache,
    refuse_other_attention,
    refuse_other_default_dtype,
    refuse_outer_autocast,
    refuse_recorded_outputs,
    transforms_in_blocks_refused,
)
from offremat._call_numbers import call_numbers, with_other_numbers
from offremat._discover import BlockRun, Call, as_call
from offremat._fingerprint import library_versions, model_fingerprint
from offremat._forward_signature import ModelSignatureForward
from offremat._further_blocks import further_blocks_refused
from offremat._handed_on import HandedOnError
from offremat._model_refusals import refuse_lazy, refuse_wrappers
from offremat._plan_cache import PlanCache
from offremat._planning import Request, in_training_mode
from offremat._run import RunInterception
from offremat._shapes import ShapePlans
from offremat._signatures import input_signature
from offremat._stage import AutocastState
from offremat._step_reports import report_grown_outputs, report_loss_left_to_caller
from offremat._tensors import flatten, refuse_hidden_tensors, sparse_parts
from offremat.executor import PlanExecutor, StepStats
from offremat.measure import cuda_blocks_split_exactly
from solvers.budget import format_bytes
from solvers.chain import Chain
from solvers.plan import Plan
from solvers.registry import check_count

logger = logging.getLogger(__name__)


class OptimizedModule(nn.Module):
    """A model whose training step follows a plan; otherwise the model itself."""

    def __init__(self, model: nn.Module, plans: ShapePlans, run: BlockRun | None = None):
        super().__init__()
        for name in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
            object.__setattr__(self, name, getattr(model, name))
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_run", run)
        # Where each block was when planned (refuse_replaced_blocks).
        placed = model._modules.items() if run is None else [(c.path, c.module) for c in run.calls]
        object.__setattr__(self, "_places", block_places(model, list(placed)))
        object.__setattr__(self, "_plans", plans)
        # The output_* flags that record every block's result (a walk of the model, once).
        object.__setattr__(self, "_recorded_flags", recorded_output_flags(model))
        object.__setattr__(self, "_autocast", None)
        object.__setattr__(self, "_forced_autocast", False)
        object.__setattr__(self, "_attention", attention_kernels())
        object.__setattr__(self, "_default_dtype", torch.get_default_dtype())

    @property
    def model(self) -> nn.Module:
        """The wrapped model, run as it is under ``no_grad``."""
        return self._model

    @property
    def plan(self) -> Plan:
        """The plan of the last training step's input shape (before one: the example's)."""
        return self._executor.plan

    @property
    def chain(self) -> Chain:
        """The chain that :attr:`plan` was made for."""
        return self._executor.chain

    @property
    def stats(self) -> StepStats | None:
        """What the last training step's chain measured (None before the first one, while a
        step runs, and after one that failed)."""
        return self._executor.stats

    @property
    def _executor(self) -> PlanExecutor:
        executor = self._plans.last
        assert executor is not None
        return executor

    def cache_info(self) -> dict[str, Any]:
        """Plans by input shape, as ``functools.lru_cache`` counts: ``hits``, ``misses``,
        ``plans``, ``from_disk``, ``predicted``, ``improved``, ``variants`` and ``planning_s``
        (:meth:`offremat._shapes.ShapePlans.info` says what each counts)."""
        return self._plans.info()

    def release_host_memory(self) -> None:
        """Give back the host buffers kept for offloads between steps."""
        self._plans.resources.release()

    @property  # type: ignore[override]
    def training(self) -> bool:
        """The model's own training flag: one flag, whichever of the two was switched."""
        model = self.__dict__.get("_model")
        return True if model is None else model.training

    @training.setter
    def training(self, mode: bool) -> None:
        model = self.__dict__.get("_model")
        if model is not None:  # nn.Module.__init__ sets it before the model is bound
            model.training = mode

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_forward_signature", None)  # found again (defaults need not pickle)
        return state

    def __getattr__(self, name: str) -> Any:
        # The model's own attributes and methods (config, generate, save_pretrained) too.
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_model")
            if model is None:
                raise
            return getattr(model, name)

    @ModelSignatureForward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's output; with a gradient wanted, the step follows :attr:`plan`.

        In eval mode too: training with dropout off is training, and its backward needs the
        budget as much (each mixture of modes gets plans of its own, see ``_shapes``).
        """
        if not torch.is_grad_enabled():
            return self._model(*args, **kwargs)
        if torch.compiler.is_compiling():
            refuse_compile()
        return self._training_step(*args, **kwargs)

    @torch.compiler.disable
    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        """A training step that follows the plan; dynamo never traces offremat's bookkeeping."""
        if self._plans.last is not None:
            self._plans.last.clear_stats()  # a refusal below leaves no old figures behind
        planned: AutocastState | None = self._autocast
        with ExitStack() as stack:
            now = None if planned is None else AutocastState.capture(planned.device_type)
            if planned is not None and now is not None and self._forced_autocast:
                if now.enabled and not planned.runs_as(now):
                    refuse_outer_autocast(planned, now)
                planned.enter(stack)
            elif planned is not None and now is not None and not planned.runs_as(now):
                refuse_autocast(planned, now)
            # A model pickled before the kernels were recorded has no record: not checked.
            planned_kernels = self.__dict__.get("_attention")
            if planned_kernels is not None and (kernels := attention_kernels()) != planned_kernels:
                refuse_other_attention(planned_kernels, kernels)
            planned_dtype = self.__dict__.get("_default_dtype")
            if planned_dtype is not None and (dtype := torch.get_default_dtype()) != planned_dtype:
                refuse_other_default_dtype(planned_dtype, dtype)
            return self._planned_step(args, kwargs)

    def _planned_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._run is None:
            if len(args) != 1 or kwargs:
                raise TypeError(
                    "this model is a chain of blocks and takes one input (a tensor or a tuple), "
                    f"got {len(args)} positional and {len(kwargs)} keyword arguments"
                )
            refuse_own_hooks(self._model)
            refuse_replaced_blocks(self._model, self._places)
            tensors, _ = flatten(args[0])
            if tensors:
                check_device(list(self._model), tensors[0].device)
            self._refuse_plain_autograd_only(args[0])
            executor = self._plans.executor(args[0])
            output = executor(args[0])
            report_loss_left_to_caller(executor, output)
            return output
        refuse_recorded_outputs(self._model, self._recorded_flags, kwargs)
        refuse_kv_cache(args, kwargs)
        refuse_replaced_blocks(self._model, self._places)
        call = Call(args, kwargs)
        self._refuse_plain_autograd_only(call)
        try:
            executor, output = self._run_blocks(call)
        except (NotAChainError, HandedOnError) as error:
            first = self.__dict__.get("_example_numbers")
            raise with_other_numbers(error, call_numbers(self._model, call), first) from None
        self._plans.check_output(call, output)  # a number learnt to size nothing may size it
        report_grown_outputs(executor, output)
        report_loss_left_to_caller(executor, output)
        return output

    def _run_blocks(self, call: Call) -> tuple[PlanExecutor, Any]:
        """The model's output for ``call``, its blocks run by their plan, and that plan's."""
        executor = self._plans.executor(call)
        chain_run = functools.partial(_run_chain, self._plans, call, executor)
        with (
            RunInterception(self._run, chain_run) as interception,
            further_blocks_refused(self._model, self._run, interception),
        ):
            output = self._model(*call.args, **call.kwargs)
        if not interception.ran:
            raise NotAChainError(
                f"{type(self._model).__name__} did not call its blocks "
                f"({self._run.calls[0].path} ..) in this training step, so no plan ran: "
                "optimize it with a batch of the kind it trains on"
            )
        return executor, output

    def _refuse_plain_autograd_only(self, batch: Any) -> None:
        """Refuse a step that only plain autograd's schedule runs, unless its plan is that."""
        reason = plain_autograd_only(self._plans.stages, batch)
        if reason is not None and not self._plans.runs_plainly(batch):
            raise RuntimeError(reason)

    def _get_name(self) -> str:
        # The wrapped model's, which tools key on: Hugging Face's Trainer shifts a causal LM's
        # labels for label smoothing by it, and trained "OptimizedModule" on unshifted ones.
        return self._model._get_name()

    def __repr__(self) -> str:
        # What prints is the wrapper, under its own name.
        return type(self).__name__ + super().__repr__()[len(self._get_name()) :]

    def extra_repr(self) -> str:
        plan = self.plan
        budget = "none" if plan.budget_bytes is None else format_bytes(plan.budget_bytes)
        return f"plan={plan.solver}, budget={budget}, stages={plan.length}"


def optimize(
    model: nn.Module | Sequence[nn.Module],
    example_batch: Any,
    budget: int | float | str | None = None,
    solver: str = "dp",
    bandwidth: Any = None,
    stages: int | None = None,
    chain: Chain | str | Path | None = None,
    plan: Plan | str | Path | None = None,
    measure_memory: bool = False,
    blocks: str | None = None,
    cache_dir: str | Path | None = None,
    autocast: torch.dtype | None = None,
    **solver_options: Any,
) -> OptimizedModule:
    """Wrap ``model`` so that its training step keeps, offloads or recomputes activations.

    ``model`` is any ``nn.Module`` as the user has it (a Hugging Face model, a CNN, a module
    looping over an ``nn.ModuleList``), or an ``nn.Sequential`` or a list of blocks.
    ``example_batch`` is what the model is called with, on the device it trains on: a tensor,
    a tuple of positional arguments or a dict of keyword arguments (for an ``nn.Sequential``
    or a list of blocks, one input, a tuple included). The chain is the model's
    run of repeated blocks (:mod:`offremat._discover`), or the container ``blocks`` names
    (``blocks="model.layers"``); an ``nn.Sequential``'s children are its chain. ``budget`` is
    bytes, a size (``"6GiB"``) or a fraction in (0, 1] of the keep-all peak. ``solver`` is any
    of :data:`solvers.registry.SOLVERS`, with ``solver_options`` passed on (``slots``,
    ``time_limit_s``, dp's ``tolerance``...). ``bandwidth`` (bytes/s, ``"25GB/s"`` or a
    (d2h, h2d) pair) replaces the link, so offloading plans can be made on a machine without
    one. A ``chain`` skips
    profiling (``stages`` groups blocks when profiling); a ``plan`` skips solving and is
    scored at ``budget`` (default: its own). The chain must give the model's own output on
    ``example_batch``. With ``measure_memory``, every step's chain is measured independently
    (``stats.measured_peak_bytes``; on CUDA this resets the process-wide peak statistics, on
    CPU it slows the step). Each new input shape gets its own plan (:mod:`offremat._shapes`);
    with ``cache_dir``, plans are kept on disk and read back by a later run
    (:mod:`offremat._plan_cache`). The profile is taken under the autocast the training steps
    run under: ``autocast`` (a dtype such as ``torch.bfloat16``), under which the optimized
    model then runs its training steps, or else the autocast active around this call (for the
    batch's device type). Raises :class:`solvers.budget.InfeasibleBudgetError` when no plan
    fits.
    """
    refuse_compiled_model(model)
    if stages is not None:
        check_count("stages", stages)
    refuse_lazy(model)
    refuse_wrappers(model, OptimizedModule)
    tensors, structure = flatten(example_batch)
    if any(t.is_nested for t in tensors):
        sparse_parts(next(t for t in tensors if t.is_nested))  # says what to do instead
    if not tensors:
        refuse_hidden_tensors(structure)  # tensors inside a dataclass: say so
        raise TypeError("the example batch holds no tensor; pass what the model's forward takes")
    device_type = tensors[0].device.type
    if device_type == "cuda" and not cuda_blocks_split_exactly():
        _warn_allocator_slack()
    if autocast is None:
        planned = AutocastState.capture(device_type)
    elif isinstance(autocast, torch.dtype):
        planned = AutocastState(device_type, True, autocast)
    else:
        raise TypeError(f"autocast= takes a dtype such as torch.bfloat16, got {autocast!r}")
    with ExitStack() as stack:
        planned.enter(stack)  # weight cache off, as the executor runs its stages
        stack.enter_context(in_training_mode(model))
        stack.enter_context(transforms_in_blocks_refused())
        optimized = OptimizedModule(
            *build(
                model,
                example_batch,
                Request(
                    budget,
                    solver,
                    bandwidth,
                    stages,
                    chain if not isinstance(chain, (str, Path)) else Chain.load(chain),
                    plan,
                    measure_memory,
                    solver_options,
                    _disk(
                        cache_dir,
                        model,
                        chain is not None or plan is not None,
                        {
                            "example": repr(input_signature(example_batch)),
                            "budget": repr(budget),
                            "solver": solver,
                            "options": repr(sorted(solver_options.items())),
                            "bandwidth": repr(bandwidth),
                            "stages": stages,
                            "blocks": blocks,
                            "autocast": repr(planned) if planned.enabled else None,
                            "attention": repr(attention_kernels()),
                            "default_dtype": str(torch.get_default_dtype()),
                        },
                    ),
                ),
                blocks,
            )
        )
    object.__setattr__(optimized, "_autocast", planned)
    # Its numbers only: the example's tensors are not kept alive by the module.
    numbers = call_numbers(optimized._model, as_call(example_batch))
    object.__setattr__(optimized, "_example_numbers", numbers)
    object.__setattr__(optimized, "_forced_autocast", autocast is not None)
    return optimized


@functools.cache
def _warn_allocator_slack() -> None:
    """Once a process: the budget counts tensors, the default CUDA allocator may hold more."""
    logger.warning(
        "the budget counts the bytes of the step's tensors; in its default mode the CUDA "
        "caching allocator can hold up to 1 MiB more per block (2.7% of a bf16 GPT's peak "
        "on an H100), so max_memory_allocated may pass the budget. Set "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before CUDA starts to make the "
        "two agree"
    )


def _disk(
    cache_dir: str | Path | None,
    model: nn.Module | Sequence[nn.Module],
    given_chain_or_plan: bool,
    key: dict[str, Any],
) -> PlanCache | None:
    """The disk cache of plans, keyed by the model and everything else a plan depends on."""
    if cache_dir is None:
        return None
    if given_chain_or_plan:
        logger.warning("chain= or plan= is given, so cache_dir= is not used")
        return None
    modules_of = model if isinstance(model, nn.Module) else nn.ModuleList(model)
    # A dropout switched off or a frozen batch norm changes what the stages save.
    modes = "".join("1" if module.training else "0" for module in modules_of.modules())
    fingerprint = model_fingerprint(modules_of)
    return PlanCache(
        cache_dir, {"model": fingerprint, "modes": modes, "library": library_versions(), **key}
    )


def _run_chain(plans: ShapePlans, call: Call, executor: PlanExecutor, value: Any) -> Any:
    """Run the blocks on ``value`` with the plan for its kind (ShapePlans.for_chain_input)."""
    return plans.for_chain_input(call, executor, value)(value)
