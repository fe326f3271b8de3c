"""The eviction policies by the names ``--model-eviction-policy`` takes."""

from __future__ import annotations

from collections.abc import Callable

from quiver.lifecycle.eviction import EvictionPolicy, GreedyDualSizePolicy, LRUPolicy
from quiver.lifecycle.tinylfu import WTinyLFUPolicy

__all__ = ["DEFAULT_POLICY", "POLICIES", "make_policy"]

#: name -> what makes a fresh policy
POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "tinylfu": WTinyLFUPolicy,
    "lru": LRUPolicy,
    "gds": GreedyDualSizePolicy,
}
#: The default: W-TinyLFU beats LRU and GreedyDual-Size on every trace of benchmarks.eviction.
DEFAULT_POLICY = "tinylfu"


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy named ``name``; ``greedy-dual-size`` is accepted for ``gds``."""
    if name == "greedy-dual-size":
        name = "gds"
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy '{name}' (one of: {', '.join(POLICIES)})"
        ) from None
