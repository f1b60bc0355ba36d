"""A model seen as a chain of blocks, and blocks grouped into stages.

offremat plans a chain in the sense of Herrmann, Beaumont et al. (2019): each stage takes the
previous stage's output and nothing else. An ``nn.Sequential`` (or a list of modules) is such a
chain by construction; any other module is refused with advice on how to make it one.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


class NotAChainError(TypeError):
    """The model is not a chain of blocks; the message names it and says how to make it one."""


def chain_blocks(model: nn.Module | Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    """The (name, block) pairs of an ``nn.Sequential``, an ``nn.ModuleList`` or a list.

    A list holds modules (named by position) or (name, module) pairs.
    """
    if isinstance(model, (nn.Sequential, nn.ModuleList)):
        # What the model runs, not named_children(), which lists a block used twice once.
        blocks = [(name, block) for name, block in model._modules.items() if block is not None]
    elif isinstance(model, (list, tuple)):
        blocks = []
        for index, block in enumerate(model):
            if (
                isinstance(block, tuple)
                and len(block) == 2
                and isinstance(block[0], str)
                and isinstance(block[1], nn.Module)
            ):
                blocks.append(block)
                continue
            if not isinstance(block, nn.Module):
                raise NotAChainError(
                    f"block {index} of the list is a {type(block).__name__}, not an nn.Module: "
                    "pass a list of nn.Module blocks, each taking the previous block's output"
                )
            blocks.append((str(index), block))
    else:
        name = type(model).__name__
        raise NotAChainError(
            f"{name} is not a chain of blocks: offremat runs a model as a sequence of stages, "
            f"each taking the previous one's output. Wrap your model as an nn.Sequential of its "
            f"blocks (for example nn.Sequential(model.embed, *model.blocks, model.head)), or pass "
            f"a list of blocks instead of the {name}"
        )
    if not blocks:
        raise NotAChainError(f"the {type(model).__name__} has no blocks to run as stages")
    return blocks


def group_evenly(weights: Sequence[float], count: int) -> list[range]:
    """Split consecutive blocks into ``count`` groups so that the heaviest group is lightest.

    The classic linear-partition DP; ties go to the earliest cut, so the result is
    deterministic for given weights.
    """
    total = len(weights)
    if not 1 <= count <= total:
        raise ValueError(f"cannot group {total} blocks into {count} stages; pick 1..{total}")
    prefix = [0.0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    infinity = float("inf")
    # best[k][n]: least possible heaviest group when the first n blocks form k groups.
    best = [[infinity] * (total + 1) for _ in range(count + 1)]
    cut = [[0] * (total + 1) for _ in range(count + 1)]
    best[0][0] = 0.0
    for groups in range(1, count + 1):
        for end in range(groups, total - (count - groups) + 1):
            for start in range(groups - 1, end):
                heaviest = max(best[groups - 1][start], prefix[end] - prefix[start])
                if heaviest < best[groups][end]:
                    best[groups][end] = heaviest
                    cut[groups][end] = start
    ranges: list[range] = []
    end = total
    for groups in range(count, 0, -1):
        start = cut[groups][end]
        ranges.append(range(start, end))
        end = start
    return ranges[::-1]


def group_name(names: Sequence[str]) -> str:
    """A stage's name from the names of its blocks: ``block3`` or ``block0..block3``."""
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


def stage_module(blocks: Sequence[tuple[str, nn.Module]]) -> nn.Module:
    """One module running ``blocks`` in order (the block itself when there is one)."""
    if len(blocks) == 1:
        return blocks[0][1]
    # Positional: block names are module paths, and a child's name cannot hold a dot.
    return nn.Sequential(*[block for _, block in blocks])
