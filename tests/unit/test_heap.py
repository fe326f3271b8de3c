"""freeze_heap: what lives when the server has started is left out of later collections."""

from __future__ import annotations

import gc
import weakref

from quiver.heap import freeze_heap


class _Thing:
    pass


def test_what_is_alive_is_frozen_and_garbage_is_collected_first() -> None:
    alive = _Thing()
    garbage = _Thing()
    garbage.me = garbage  # type: ignore[attr-defined]  # a cycle: only a collection frees it
    gone = weakref.ref(garbage)
    del garbage
    try:
        freeze_heap("test")
        assert gc.get_freeze_count() > 0
        tracked = gc.get_objects()
        assert not any(o is alive for o in tracked)  # frozen: collections skip it
        assert gone() is None  # collected first, not frozen
        later = _Thing()
        assert any(o is later for o in gc.get_objects())  # made since: collected as usual
    finally:
        gc.unfreeze()
    assert any(o is alive for o in gc.get_objects())
