"""A table of values by storage that outlives the storages it names.

Storages are told apart by address (``storage._cdata``), but a freed storage's address is
given to the next one at once: a table that kept only addresses would take the new storage
for the old (a saved tensor counted once for two, a gradient's bytes left out of another
storage's). So each entry keeps a weak reference, and an entry whose storage is gone, or is
another now, counts as absent. PyTorch keeps a storage's Python object exactly as long as the
storage, so a dead reference means freed memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Generic, TypeVar

import torch

Value = TypeVar("Value")


class StorageTable(Generic[Value]):
    """Values by storage, for the storages alive (module notes)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[torch.UntypedStorage], Value]] = {}

    def get(self, storage: torch.UntypedStorage) -> Value | None:
        """``storage``'s value, or None if it has none (another storage's at its address)."""
        entry = self._entries.get(storage._cdata)
        if entry is None or entry[0]() is not storage:
            return None
        return entry[1]

    def __contains__(self, storage: torch.UntypedStorage) -> bool:
        entry = self._entries.get(storage._cdata)
        return entry is not None and entry[0]() is storage

    def set(self, storage: torch.UntypedStorage, value: Value) -> None:
        """Give ``storage`` ``value``, in place of what it or a freed one at its address had."""
        self._entries[storage._cdata] = (weakref.ref(storage), value)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def items(self) -> Iterator[tuple[int, torch.UntypedStorage, Value]]:
        """The storages alive, by key, with their values; forgets the dead ones."""
        dead = []
        for key, (ref, value) in self._entries.items():
            storage = ref()
            if storage is None:
                dead.append(key)
            else:
                yield key, storage, value
        for key in dead:
            del self._entries[key]
