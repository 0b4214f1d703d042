"""A bounded cache, for what a group keeps of the work it repeats."""

from __future__ import annotations

from typing import Any, Callable, Optional


class BoundedCache:
    """At most ``size`` entries by an explicit key; the oldest go first, and ``evict``
    is called with each value that goes."""

    def __init__(self, size: int = 256, evict: Optional[Callable[[Any], None]] = None) -> None:
        self._size = size
        self._evict = evict
        self._entries: dict = {}

    def __len__(self) -> int:
        return len(self._entries)

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
