"""A bounded least-recently-used map whose pinned keys are never evicted: the bookkeeping of the adapters loaded on
the host (``max_cpu_loras`` of them) and of the device slots (``max_loras``). Pure Python, no tensors."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, Iterable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class PinnedLRU(Generic[K, V]):
    """At most ``capacity`` entries. :meth:`get` and :meth:`put` make a key the most recently used; when a put
    finds the map full, the least recently used key that is not pinned goes. :meth:`pin` replaces the pinned set
    (the adapters of the batch being run)."""

    def __init__(self, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity
        self._entries: OrderedDict[K, V] = OrderedDict()   # least recently used first
        self._pinned: frozenset[K] = frozenset()

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> V:
        """The value of ``key`` (KeyError if absent), now the most recently used."""
        self._entries.move_to_end(key)
        return self._entries[key]

    def peek(self, key: K, default: V | None = None) -> V | None:
        """The value of ``key`` without touching the order."""
        return self._entries.get(key, default)

    def has_room(self) -> bool:
        """Whether a new key can go in: the map is not full, or one of its keys is not pinned."""
        return len(self._entries) < self.capacity or any(k not in self._pinned for k in self._entries)

    def put(self, key: K, value: V) -> list[tuple[K, V]]:
        """Insert or replace ``key`` as the most recently used; returns the entries evicted to make room (least
        recently used unpinned first). ValueError when the map is full of pinned keys."""
        evicted: list[tuple[K, V]] = []
        if key not in self._entries:
            while len(self._entries) >= self.capacity:
                victim = next((k for k in self._entries if k not in self._pinned), None)
                if victim is None:
                    raise ValueError(f"all {self.capacity} entries are pinned (in use by the running batch): "
                                     f"nothing can make room for {key!r}")
                evicted.append((victim, self._entries.pop(victim)))
        self._entries[key] = value
        self._entries.move_to_end(key)
        return evicted

    def pop(self, key: K) -> V:
        """Remove ``key`` (KeyError if absent; ValueError if pinned) and return its value."""
        if key in self._pinned:
            raise ValueError(f"{key!r} is pinned (in use by the running batch) and cannot be removed")
        return self._entries.pop(key)

    def pin(self, keys: Iterable[K]) -> None:
        """Pin exactly ``keys`` (each must be present), unpinning the others."""
        keys = frozenset(keys)
        missing = [k for k in keys if k not in self._entries]
        if missing:
            raise KeyError(f"cannot pin absent keys {missing}")
        self._pinned = keys

    @property
    def pinned(self) -> frozenset[K]:
        return self._pinned

    def keys(self) -> list[K]:
        """The keys, least recently used first."""
        return list(self._entries)

    def items(self) -> list[tuple[K, V]]:
        return list(self._entries.items())
