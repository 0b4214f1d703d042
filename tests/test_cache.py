"""Bounded caches (one process)."""

from __future__ import annotations

from tidearray._cache import CallCache, IdentityCache


def test_identity_cache_keeps_tuples_by_identity_only():
    cache = IdentityCache(size=2)
    a, b = (1, 2), [1, 2]
    assert cache.get(a, lambda k: ("v", k)) == ("v", a)
    assert cache.get(a, lambda k: 1 / 0) == ("v", a)  # a hit: not made again
    assert cache.get(tuple([1, 2]), lambda k: "equal, not identical") == "equal, not identical"
    assert cache.get(b, lambda k: "list") == "list"
    assert cache.get(b, lambda k: "list again") == "list again"  # lists are never kept


def test_caches_evict_oldest_first_and_on_clear():
    gone = []
    cache = CallCache(size=2, evict=gone.append)
    for k in "abc":
        cache.put(k, k.upper())
    assert gone == ["A"] and cache.get("a") is None and cache.get("c") == "C"
    cache.clear()
    assert gone == ["A", "B", "C"] and cache.get("b") is None
