"""Walking a module's plain attributes, whose containers may hold themselves.

A block may keep ``self.cache = []; self.cache.append(self.cache)`` (a dict or list that holds
itself): ``torch.utils._pytree``'s walks recurse into it until ``RecursionError``. These walk
each container as pytree does (lists, tuples, dicts, named tuples and every registered node),
but not into a container already being walked around them: that one's leaves are listed
once, and a copy keeps the cycle (a list or dict met again inside itself is its copy; another
kind of container is kept as it is).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils._pytree import TreeSpec, tree_flatten, tree_is_leaf, tree_unflatten


def _split(node: Any) -> tuple[list[Any], TreeSpec] | None:
    """``node``'s children and its one-level spec, or None for a leaf."""
    if tree_is_leaf(node):
        return None
    root = [node]

    def below_root(value: Any) -> bool:  # the root is walked, its children are leaves
        if root:
            root.clear()
            return False
        return True

    return tree_flatten(node, is_leaf=below_root)


def leaves(value: Any) -> list[Any]:
    """``tree_leaves(value)``, walking no container again inside itself."""
    found: list[Any] = []
    _leaves(value, found, set())
    return found


def _leaves(value: Any, found: list[Any], walking: set[int]) -> None:
    split = _split(value)
    if split is None:
        found.append(value)
        return
    if id(value) in walking:
        return  # met again inside itself: its leaves are listed already
    walking.add(id(value))
    for child in split[0]:
        _leaves(child, found, walking)
    walking.discard(id(value))


def map_leaves(function: Callable[[Any], Any], value: Any) -> Any:
    """``tree_map(function, value)``, where a list or dict that holds itself is copied with
    the cycle (its copy holds its copy), and another kind of container inside itself is kept."""
    return _map(function, value, {}, set())


def _map(
    function: Callable[[Any], Any], value: Any, made: dict[int, Any], walking: set[int]
) -> Any:
    split = _split(value)
    if split is None:
        return function(value)
    if id(value) in made:
        return made[id(value)]
    if type(value) is list:
        copy: Any = made.setdefault(id(value), [])
        copy.extend(_map(function, child, made, walking) for child in value)
        return copy
    if type(value) is dict:
        copy = made.setdefault(id(value), {})
        for key, child in value.items():
            copy[key] = _map(function, child, made, walking)
        return copy
    if id(value) in walking:
        return value  # a container of another kind inside itself: kept, as it cannot be rebuilt
    walking.add(id(value))
    children = [_map(function, child, made, walking) for child in split[0]]
    walking.discard(id(value))
    return tree_unflatten(children, split[1])
