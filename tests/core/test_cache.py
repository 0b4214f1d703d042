"""The bounded cache a group keeps its eager plans in (one process)."""

from __future__ import annotations

from tidearray._cache import BoundedCache


def test_bounded_cache_evicts_oldest_first_and_on_clear():
    gone = []
    cache = BoundedCache(size=2, evict=gone.append)
    for k in "abc":
        cache.put(k, k.upper())
    assert gone == ["A"] and cache.get("a") is None and cache.get("c") == "C"
    assert len(cache) == 2
    cache.clear()
    assert gone == ["A", "B", "C"] and cache.get("b") is None and len(cache) == 0
