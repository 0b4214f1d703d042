"""Bounded caches for the per-call work that FSDP repeats every step."""

from __future__ import annotations

from typing import Any, Callable, Optional


class CallCache:
    """Calls already validated, and what their issue needed, keyed by what was checked.

    FSDP repeats the same collectives with the same buffers every step. A key
    holds everything local validation looked at (shapes, dtypes, addresses,
    sizes, contiguity, slot), so a hit skips the per-parameter checks and
    reuses the issue program; the cross-rank digest check still runs.
    Oldest entries go first; ``evict`` is called with each value that goes.
    """

    def __init__(self, size: int = 256, evict: Optional[Callable[[Any], None]] = None) -> None:
        self._size = size
        self._evict = evict
        self._entries: dict = {}

    def get(self, key: Any) -> Any:
        return self._entries.get(key)

    def put(self, key: Any, value: Any) -> Any:
        if len(self._entries) >= self._size:
            old = self._entries.pop(next(iter(self._entries)))  # oldest first
            if self._evict is not None:
                self._evict(old)
        self._entries[key] = value
        return value

    def clear(self) -> None:
        """Drop every entry (``evict`` sees each)."""
        while self._entries:
            old = self._entries.pop(next(iter(self._entries)))
            if self._evict is not None:
                self._evict(old)


class IdentityCache:
    """Values derived from immutable tuples, kept by the tuple's identity.

    A collective's cached program holds its tuples (copy batches, accumulate
    pieces) call after call, so the identity lookup is O(1) however long the
    tuple. Each entry holds its tuple, so the id cannot be reused while the
    entry lives. Anything but a tuple may change, so it is never cached.
    """

    def __init__(self, size: int = 4096, evict: Optional[Callable[[Any], None]] = None) -> None:
        self._calls = CallCache(size, None if evict is None else lambda e: evict(e[1]))

    def get(self, key: Any, make: Callable[[Any], Any]) -> Any:
        entry = self._calls.get(id(key))
        if entry is not None and entry[0] is key:
            return entry[1]
        value = make(key)
        if type(key) is tuple:
            self._calls.put(id(key), (key, value))
        return value

    def clear(self) -> None:
        self._calls.clear()
