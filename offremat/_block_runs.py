"""Runs of block calls: consecutive calls where each takes the previous one's output as its
hidden state, the candidates for a model's chain (see :mod:`offremat._discover`), and which
run a model's chain is."""

from __future__ import annotations

from torch import nn
from torch.nn.utils import parametrize

from offremat._record import RecordedCall


def runs_of(group: list[RecordedCall]) -> list[list[RecordedCall]]:
    """The maximal runs of consecutive calls in ``group`` that form a chain."""
    runs: list[list[RecordedCall]] = []
    for record in group:
        if runs and follows(runs[-1][-1], record):
            runs[-1].append(record)
        else:
            runs.append([record])
    return runs


def hybrid_runs(
    model: nn.Module, records: list[RecordedCall], blocks_of_runs: set[str]
) -> list[list[RecordedCall]]:
    """Runs of blocks of two or more types that a model calls from one ``ModuleList``: the
    layers of a hybrid model (Jamba's attention and Mamba layers), which runs of one type
    break into pieces. Only blocks count, modules with modules or parameters of their own,
    not the activations an MLP's ``ModuleList`` may hold between its linear layers, nor a run
    of torch's own layers alone; and not the sublayers inside a block of a run of one type
    (``blocks_of_runs``), which that run plans whole."""
    lists = {id(m) for m in model.modules() if isinstance(m, nn.ModuleList)}
    by_list: dict[str, list[RecordedCall]] = {}
    for record in records:
        parent = record.path.rpartition(".")[0]
        if not record.path or not _holds_weights(record.module):
            continue
        if not any(parent == p or parent.startswith(p + ".") for p in blocks_of_runs):
            by_list.setdefault(parent, []).append(record)
    runs = [
        run
        for parent, group in by_list.items()
        if id(model.get_submodule(parent)) in lists
        for run in runs_of(group)
    ]
    return [
        run
        for run in runs
        if len({block_type(r.module) for r in run}) > 1
        and not all(_torch_layer(r.module) for r in run)
    ]


def block_type(module: nn.Module) -> type:
    """A block's type, as its class was before ``torch.nn.utils.parametrize`` gave the
    instance a class of its own (blocks with a parametrized weight are of one type)."""
    return parametrize.type_before_parametrizations(module)


def _holds_weights(module: nn.Module) -> bool:
    """A block: modules of its own (an attention layer) or parameters (``w1``, ``w2``, a
    ``GRU``'s)."""
    if next(module.children(), None) is not None:
        return True
    return next(module.parameters(recurse=False), None) is not None


def _torch_layer(module: nn.Module) -> bool:
    """One of torch's own layers without modules of its own (a ``Linear``, a ``GRU``): a run
    of these alone is a head's parts (``Linear``, ``LayerNorm``, ``Linear``), not a model's
    layers."""
    torchs = block_type(module).__module__.startswith("torch.nn.")
    return torchs and next(module.children(), None) is None


def follows(previous: RecordedCall, record: RecordedCall) -> bool:
    """Whether ``record`` continues a chain after ``previous``."""
    return chain_break(previous, record) is None


def chain_break(previous: RecordedCall, record: RecordedCall) -> str | None:
    """Why ``record`` does not continue a chain after ``previous``, or None if it does."""
    if previous.depth != record.depth:
        return f"{record.path} is called at another depth of the model than {previous.path}"
    if previous.extras_read:
        return (
            f"{previous.path} returns {previous.output_tensors} tensors, and the model reads "
            "the others; a block must return its hidden state alone, or others the model "
            "drops (blocks that also return an auxiliary loss or a position bias for the next "
            "block cannot be a chain)"
        )
    if record.hidden is None or record.hidden != previous.output:
        rule = (
            "offremat reads a block's hidden state from its first positional argument or its "
            "hidden_states= keyword"
        )
        if previous.output in record.side[0]:
            return (
                f"{record.path} takes {previous.path}'s output, but not as its hidden state: "
                f"{rule}, so call the blocks with the state there"
            )
        return (
            f"{record.path} does not take {previous.path}'s output as its hidden state ({rule}); "
            "where the model changes that output between the two calls (a pooling, an "
            "interpolation, a projection), move that code into the blocks' forward"
        )
    return None


def preference(run: list[RecordedCall]) -> tuple[bool, int, int, int]:
    """The key the chosen run maximises: Hugging Face's mark on every block, the run's
    length, the activations its blocks saved, their parameters."""
    marked = all(
        any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(r.module).__mro__)
        for r in run
    )
    saved = sum(r.saved_bytes for r in run)
    parameters = sum(p.numel() for r in run for p in r.module.parameters())
    return marked, len(run), saved, parameters
