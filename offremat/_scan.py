"""What a step needs to know about a stage's modules, found in one walk.

Which parameters train, which storages are parameters or buffers (never part of a saved set),
which normalisation layers a training-mode forward moves the running statistics of (without
reading them), and which
``torch.Generator`` objects the modules keep as attributes: all of these can change between
steps (a layer frozen or unfrozen, FSDP2's gathered parameters, ``model.eval()``, a generator
set), so every step looks again. It looks once per stage: a walk of the module tree per
question cost about 0.6 ms a step on a ten-stage model, a sixth of the executor's own cost
there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from offremat._tensors import storage_key

# The buffers of a moving normalisation layer that offremat._stage.frozen_running_stats covers.
NORM_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


@dataclass(frozen=True)
class ModuleScan:
    """The facts about a module tree that a step reads (see the module's docstring)."""

    trainable: tuple[nn.Parameter, ...]
    fixed_storages: frozenset[int]
    norms: tuple[nn.Module, ...]
    generators: tuple[torch.Generator, ...]
    # Every other buffer, as (module, name): those a forward may change (offremat._buffers).
    buffers: tuple[tuple[nn.Module, str], ...] = ()
    # Every parameter, trainable or not: a forward must not change one (offremat._buffers).
    parameters: tuple[nn.Parameter, ...] = ()
    # The modules of the tree, root first: what a recomputation replays the attributes of.
    modules: tuple[nn.Module, ...] = ()


def scan_modules(root: nn.Module) -> ModuleScan:
    """The trainable parameters, fixed storages, moving norms and generators under ``root``."""
    trainable: dict[int, nn.Parameter] = {}
    parameters: dict[int, nn.Parameter] = {}
    fixed: set[int] = set()
    norms: list[nn.Module] = []
    generators: dict[int, torch.Generator] = {}
    buffers: list[tuple[nn.Module, str]] = []
    modules = tuple(root.modules())
    for module in modules:
        for parameter in module._parameters.values():
            if parameter is not None:
                fixed.add(storage_key(parameter))
                parameters.setdefault(id(parameter), parameter)
                if parameter.requires_grad:
                    trainable.setdefault(id(parameter), parameter)
        moving = _moving_norm(module)
        if moving:
            norms.append(module)
        if isinstance(module, torch.jit.ScriptModule) and len(module._buffers):
            raise RuntimeError(
                f"a TorchScript module with buffers ({module.original_name}, a scripted "
                "BatchNorm say) is inside a stage: offremat cannot put back what a "
                "recomputation of it changes in them. Keep that layer a Python module "
                "(torch.compile compiles it under a plan), or leave it out of the chain"
            )
        for name, buffer in module._buffers.items():
            if buffer is not None:
                fixed.add(storage_key(buffer))
                if not (moving and name in NORM_STATISTICS):
                    buffers.append((module, name))
        for generator in _own_generators(module):
            generators.setdefault(id(generator), generator)
    return ModuleScan(
        tuple(trainable.values()),
        frozenset(fixed),
        tuple(norms),
        tuple(generators.values()),
        tuple(buffers),
        tuple(parameters.values()),
        modules,
    )


def _moving_norm(module: nn.Module) -> bool:
    """A training-mode norm layer that runs torch's own forward, which moves its running
    statistics without reading them; a subclass's forward may read them (batch
    renormalisation), so its statistics are replayed like any other buffer."""
    return (
        isinstance(module, _NormBase)
        and module.training
        and module.track_running_stats
        and type(module).forward.__module__.startswith("torch.nn.modules.")
    )


def module_generators(root: nn.Module) -> tuple[torch.Generator, ...]:
    """The generators that ``root`` and its submodules keep as attributes (no other walk)."""
    found = {id(g): g for module in root.modules() for g in _own_generators(module)}
    return tuple(found.values())


# The types of most of a module's attributes (its hook and parameter dicts, flags, sizes),
# which no generator has.
_PLAIN_TYPES = frozenset({dict, OrderedDict, set, bool, int, float, str, type(None), tuple, list})


def _own_generators(module: nn.Module) -> list[torch.Generator]:
    # Not isinstance: torch.Generator's metaclass checks instances in Python, slowly, and
    # this looks at every attribute of every module at every step.
    return [
        value
        for value in vars(module).values()
        if type(value) not in _PLAIN_TYPES and issubclass(type(value), torch.Generator)
    ]


def fixed_storages(scans: Iterable[ModuleScan]) -> frozenset[int]:
    """Storage keys of every parameter and buffer of the scanned modules."""
    return frozenset().union(*(scan.fixed_storages for scan in scans))
