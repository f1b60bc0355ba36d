"""What ends the search for a chain in a model's recorded calls: the refusals of a run of
blocks that a chain would not run as the model does (see :mod:`offremat._discover`), and the
positions of calls in the record."""

from __future__ import annotations

import torch
from torch import nn

from offremat._blocks import NotAChainError
from offremat._record import RecordedCall


def refuse_random_runs(
    model: nn.Module,
    run: list[RecordedCall],
    records: list[RecordedCall],
    again: list[RecordedCall],
) -> None:
    """Refuse blocks that another call on the same batch runs otherwise: a model that skips
    blocks at random (LayerDrop) would be planned as a chain of one draw's blocks. The calls
    compared are those of the modules beside the run's blocks in their containers; calls
    inside a block may differ (the experts a router picks)."""
    containers = {_parent(r.path) for r in run}
    first = [r.path for r in records if _parent(r.path) in containers]
    second = [r.path for r in again if _parent(r.path) in containers]
    if first != second:
        differ = next(
            (a for a, b in zip(first, second, strict=False) if a != b), (first + second)[-1]
        )
        raise NotAChainError(
            f"{type(model).__name__} ran another sequence of blocks when called again on the "
            f"same batch (the two runs part at {differ}): a model whose run of blocks depends "
            "on random draws (LayerDrop, stochastic depth that skips a block) is no fixed "
            "chain and cannot be planned; turn that off for training under offremat "
            "(config.layerdrop = 0.0, say)"
        )


def refuse_skipping_blocks(run: list[RecordedCall], again: list[RecordedCall]) -> None:
    """Refuse blocks of which a recorded call returned its input unchanged: a block that skips
    itself (stochastic depth drawn inside it, ``if torch.rand(()) < p: return x``) is called
    at every step, so the sequence of calls is the same, but what it saves is another at
    every step, and a profile of a skipping draw measures nothing for it. The profile refuses
    one it sees skip too (:func:`offremat._block_skips.skips_refused`)."""
    paths = {r.path for r in run}
    for record in (*run, *(r for r in again if r.path in paths)):
        if record.in_place and record.output == record.hidden:
            raise NotAChainError(skip_message(record.path))


def skip_message(path: str) -> str:
    """The refusal of a block that returned its input unchanged."""
    return (
        f"block {path} returned its input unchanged in a training call: a block that skips "
        "itself at random (stochastic depth inside the block: `if self.training and "
        "torch.rand(()) < p: return x`) or by its input's values computes and saves another "
        "amount at every step, so it is no fixed chain and cannot be planned. Turn the skip "
        "off for training under offremat, or drop the branch by multiplying it with a mask "
        "(torchvision's StochasticDepth(mode='row')), which computes every block"
    )


def refuse_layer_drop(model: nn.Module, run: list[RecordedCall]) -> None:
    """Refuse blocks that the module holding their container skips at random in training,
    told by a ``layerdrop`` setting above zero (Hugging Face's LayerDrop, Fan et al. 2020) on
    that module or its ``config``. :func:`refuse_random_runs` tells such a model only when its
    two recorded calls draw differently; with this setting, every draw is refused alike. Only
    that module: a config is shared by the whole model, and the other stacks it holds (a
    feature encoder's convolutions) skip nothing."""
    where = ".".join(run[0].path.split(".")[:-2])
    module = model.get_submodule(where)
    rate = _layer_drop(module)
    if module.training and rate:
        raise NotAChainError(
            f"{where or type(model).__name__} skips each of the blocks {run[0].path} .. at "
            f"random in training (layerdrop={rate}): its run of blocks is another at every "
            "call, no fixed chain, so it cannot be planned; set layerdrop to 0.0 in the "
            "model's config (config.layerdrop = 0.0, say) for training under offremat"
        )


def _layer_drop(module: nn.Module) -> float:
    """The rate at which ``module`` skips its blocks, by its own or its config's setting."""
    for holder in (module, module.__dict__.get("config")):
        rate = getattr(holder, "__dict__", {}).get("layerdrop")
        if isinstance(rate, (int, float)) and rate > 0:
            return float(rate)
    return 0.0


def refuse_callers_checkpoint(members: list[RecordedCall]) -> None:
    """Refuse blocks that the model's own code calls under ``torch.utils.checkpoint``: the
    chain calls them itself, without it, so that checkpointing would be silently gone (and
    a fraction of the keep-all peak would not be one of the model's own peak), while the
    model's call of the checkpoint would wrap the planned step."""
    checkpointed = [r.path for r in members if r.checkpointed]
    if checkpointed:
        where = checkpointed[0]
        if len(checkpointed) > 1:
            where += f" .. {checkpointed[-1]}"
        raise NotAChainError(
            f"the model calls {where} under torch.utils.checkpoint itself (a gradient "
            "checkpointing flag of its own); offremat's plan decides what is recomputed, "
            "and calls the blocks itself: turn the model's checkpointing off before "
            "offremat.optimize (an older Hugging Face model: "
            "model.gradient_checkpointing_disable())"
        )


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def refuse_other_readers(records: list[RecordedCall], members: list[RecordedCall]) -> None:
    """Refuse a run whose intermediate states other calls read: the chain never hands them on.

    Inside a training step the model sees each block return the chain's final state, so a
    call outside the blocks that reads an intermediate one (a U-Net's skip) would read
    another tensor.
    """
    produced = {r.output: r for r in members[:-1] if r.output is not None}
    for member in members:  # a block taking an earlier one's output beside its state
        taken = next((produced[t] for t in member.side[0] if t in produced), None)
        if taken is not None and taken.output == member.hidden:
            raise NotAChainError(
                f"{member.path} takes its hidden state ({taken.path}'s output) again among its "
                "other arguments (as attention's key and value, say); a chain hands each block "
                "its hidden state once. Wrap the blocks so that each takes it once, or train "
                "the model with plain autograd"
            )
        if taken is not None:
            raise NotAChainError(
                f"{member.path} takes {taken.path}'s output beside its hidden state (a skip "
                "connection), which a chain does not keep for anything but the next block; "
                "name a run of blocks whose outputs only feed each other with blocks="
            )
    for reader, member in read_elsewhere(records, members):
        raise NotAChainError(
            f"{reader.path} reads {member.path}'s output, which a chain does not keep for "
            "anything but the next block; name a run of blocks whose outputs only feed each "
            "other with blocks="
        )


def read_elsewhere(
    records: list[RecordedCall], members: list[RecordedCall]
) -> list[tuple[RecordedCall, RecordedCall]]:
    """The calls outside ``members`` (and the containers that hand the state on to them)
    that read the output of a member but the last, in the order called, each with the first
    member it reads."""
    produced = {r.output: r for r in members[:-1] if r.output is not None}
    positions = {position_of(records, member) for member in members}
    inside: set[int] = set()
    for start in positions:
        inside.update(range(start, end_of(records, records[start])))
    found: list[tuple[RecordedCall, RecordedCall]] = []
    for index, record in enumerate(records):
        if index in inside or any(index < k < end_of(records, record) for k in positions):
            continue
        read = next((produced[t] for t in (record.hidden, *record.side[0]) if t in produced), None)
        if read is not None:
            found.append((record, read))
    return found


def cut_at_reads(records: list[RecordedCall], run: list[RecordedCall]) -> list[list[RecordedCall]]:
    """``run`` cut after each block whose output a call outside it reads (an auxiliary head's
    deep supervision): each piece can be a chain, whose last output the model keeps."""
    read = {id(member) for _, member in read_elsewhere(records, run)}
    pieces: list[list[RecordedCall]] = [[]]
    for member in run:
        pieces[-1].append(member)
        if id(member) in read:
            pieces.append([])
    return [piece for piece in pieces if piece]


def unread_ends(
    records: list[RecordedCall],
    stem: list[RecordedCall],
    run: list[RecordedCall],
    tail: list[RecordedCall],
) -> tuple[list[RecordedCall], list[RecordedCall]]:
    """The ``stem`` before a ``run`` of blocks and the ``tail`` after it, cut where a call
    outside reads their outputs (two heads reading the final norm): such an output ends the
    chain, or comes before it, and the run's blocks stay a chain."""
    while True:
        read = {id(m) for _, m in read_elsewhere(records, [*stem, *run, *tail])}
        after = [k for k, r in enumerate((run[-1], *tail)) if id(r) in read]
        before = [k for k, r in enumerate(stem) if id(r) in read]
        if after:
            tail = tail[: after[0]]
        elif before:
            stem = stem[before[-1] + 1 :]
        else:
            return stem, tail


def position_of(records: list[RecordedCall], record: RecordedCall) -> int:
    return next(k for k, r in enumerate(records) if r is record)


def end_of(records: list[RecordedCall], record: RecordedCall) -> int:
    """The index just past ``record`` and the calls made inside it."""
    k = position_of(records, record) + 1
    while k < len(records) and records[k].depth > record.depth:
        k += 1
    return k


def is_scripted(module: nn.Module) -> bool:
    """Whether ``module`` is TorchScript's: it takes no hooks, and its calls are opaque."""
    return isinstance(module, torch.jit.ScriptModule)


def scripted_note(paths: list[str]) -> str:
    """Why the TorchScript modules at ``paths`` cannot be blocks, and what to do."""
    shown = ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")
    return (
        f"{shown} {'is a TorchScript module' if len(paths) == 1 else 'are TorchScript modules'} "
        "(torch.jit.script), which offremat runs as one opaque call: it cannot watch or "
        "recompute one as a block. Keep the blocks as Python modules (torch.compile compiles "
        "them under a plan; script the layers inside them instead)"
    )


def no_run_message(model: nn.Module, containers: list[str]) -> str:
    """The refusal of a model with no run of repeated blocks, with the call to make."""
    hint = (
        f"offremat.optimize(model, batch, blocks={containers[0]!r}, ...)"
        if containers
        else "blocks='path.to.container' (a ModuleList or Sequential of two or more blocks), or "
        "pass offremat.optimize(nn.Sequential(block0, block1, ...), x, ...)"
    )
    scripted = [
        path
        for path, module in model.named_modules()
        if is_scripted(module) and not is_scripted(model.get_submodule(path.rpartition(".")[0]))
    ]
    return (
        f"found no run of repeated blocks in {type(model).__name__}: no two calls of one module "
        f"type take each other's output as their hidden state. If some do, name them "
        f"with {hint} (offremat profile: --blocks PATH); the error then says what breaks the "
        "chain"
        + (f". {scripted_note(scripted)}" if scripted else "")
        + (_OWN_FORWARD if isinstance(model, nn.Sequential) else "")
    )


# An nn.Sequential with a forward of its own is no chain of its children (offremat._building).
_OWN_FORWARD = (
    ". This nn.Sequential has a forward of its own, so it was searched as any model; if that "
    "forward only calls its children in order, pass nn.Sequential(*model)"
)
