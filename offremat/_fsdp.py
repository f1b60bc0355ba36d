"""What offremat needs to know of FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 gathers a sharded module's parameters in a forward pre-hook and registers the gathered
tensors on its modules in place of the sharded ones; with ``reshard_after_forward=False`` they
stay registered until the module's backward (or for good, after a forward cut short, as
offremat's recording and refills cut theirs). Its hooks, not offremat, decide which tensors a
sharded module's parameter tables hold, and the gradients it reduces go to the sharded
parameters. A torch built without distributed support has no FSDP2: nothing is sharded.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

try:
    from torch.distributed.fsdp import FSDPModule, fully_shard
except ImportError:  # a torch built without distributed support
    FSDPModule = fully_shard = None


def sharding_hooks(module: nn.Module) -> set[int]:
    """The keys of the forward hooks that FSDP2's ``fully_shard`` put on ``module``."""
    if FSDPModule is None or not isinstance(module, FSDPModule):
        return set()
    state = fully_shard.state(module)
    return {
        key
        for hooks in (module._forward_pre_hooks, module._forward_hooks)
        for key, hook in hooks.items()
        if getattr(hook, "__self__", None) is state
    }


def sharded_parameters(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The sharded parameters of every FSDP2 module under ``modules``: those FSDP2 reduces
    gradients into and an optimizer holds, whichever tensors ``parameters()`` lists now
    (after a forward with ``reshard_after_forward=False``, the gathered ones)."""
    if FSDPModule is None:
        return []
    found = []
    for module in modules:
        for owner in module.modules():
            if isinstance(owner, FSDPModule):
                group = fully_shard.state(owner)._fsdp_param_group
                if group is not None:
                    found += [p.sharded_param for p in group.fsdp_params]
    return found


def sharded_parameter_tables(modules: Iterable[nn.Module]) -> set[int]:
    """The ids of the ``_parameters`` tables that FSDP2 fills, of the FSDP2 modules among
    ``modules`` (a stage's modules, each of which it lists)."""
    if FSDPModule is None:
        return set()
    tables: set[int] = set()
    for module in modules:
        if isinstance(module, FSDPModule):
            group = fully_shard.state(module)._fsdp_param_group
            if group is not None:
                tables.update(id(p._module_info.module._parameters) for p in group.fsdp_params)
    return tables
