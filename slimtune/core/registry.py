"""The one process-local home of live models.

Prefect keeps every task's return value referenced until the flow ends, so a model returned from a task
could never be freed. Tasks return handles (short strings) instead; the live objects sit here, and
`cleanup` empties the registry so that the last strong references go away.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_objects: dict[str, Any] = {}
_counter = itertools.count(1)


def put(kind: str, obj: Any) -> str:
    """Store `obj` and return its handle, e.g. ``model-3``."""
    with _lock:
        handle = f"{kind}-{next(_counter)}"
        _objects[handle] = obj
        return handle


def get(handle: str) -> Any:
    """The live object behind `handle`; a clear error if it was already released."""
    with _lock:
        if handle not in _objects:
            raise KeyError(
                f"no live object {handle!r}: it was released by cleanup or belongs to another "
                "process (live models never cross process boundaries; re-run load_4bit)"
            )
        return _objects[handle]


def setdefault(key: str, make: Callable[[], Any]) -> Any:
    """The object stored under `key`, storing `make()` there first if there is none."""
    with _lock:
        if key not in _objects:
            _objects[key] = make()
        return _objects[key]


def replace(handle: str, obj: Any) -> None:
    """Point `handle` at a new object (e.g. the base model after LoRA was attached to it)."""
    with _lock:
        _objects[handle] = obj


def handles() -> list[str]:
    """Handles currently held."""
    with _lock:
        return list(_objects)


def release_all() -> list[str]:
    """Drop every live object; returns the handles that were released."""
    with _lock:
        released = list(_objects)
        _objects.clear()
        return released
