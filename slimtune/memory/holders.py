"""Who still references an object that should be gone: the referrer chains cleanup reports.

"GPU memory is above its baseline after cleanup" says that something still references a model, not what.
This walks `gc.get_referrers` upward from the survivor to what keeps it alive (a module's globals, a frame,
or an object nothing Python-visible refers to, e.g. one held from C or by another thread) and names each hop,
so a failed cleanup (seen on an H100 after an out-of-memory retry) says where to look. It scans the whole
heap per lookup (0.07 s with transformers, peft and prefect imported: 570k objects), so the walk is bounded by
lookups and cleanup runs it only for an object that should have died.
"""

from __future__ import annotations

import gc
import sys
import types
import weakref
from collections import deque

import torch

# How far up to walk and how many objects to look up: enough to get from a model to a module global through
# a Trainer, its callbacks and a traceback; 100 lookups bound the walk to seconds (~7 s at 0.07 s each).
_MAX_HOPS = 14
_MAX_LOOKUPS = 100


def _describe(obj: object) -> str:
    if isinstance(obj, types.FrameType):
        return f"frame {obj.f_code.co_qualname} ({obj.f_code.co_filename}:{obj.f_lineno})"
    if isinstance(obj, types.TracebackType):
        return f"traceback of {obj.tb_frame.f_code.co_qualname}"
    if isinstance(obj, types.FunctionType):
        return f"function {obj.__qualname__}"
    if isinstance(obj, types.MethodType):
        return f"bound method {obj.__func__.__qualname__}"
    if isinstance(obj, types.CellType):
        return "closure cell"
    if isinstance(obj, types.ModuleType):
        return f"module {obj.__name__}"
    if isinstance(obj, dict):
        return f"dict with keys {[str(k)[:40] for k in list(obj)[:6]]}"
    if isinstance(obj, BaseException):
        return f"{type(obj).__qualname__}: {str(obj)[:80]}"
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _module_of(namespace: object) -> str | None:
    """The module whose globals `namespace` is, if any (a root: it lives as long as the module)."""
    if isinstance(namespace, dict):
        name = namespace.get("__name__")
        module = sys.modules.get(name) if isinstance(name, str) else None
        if module is not None and vars(module) is namespace:
            return name
    return None


def _running_frames() -> set[int]:
    """Ids of the frames on every thread's stack now (a finished frame is kept by someone: walk on)."""
    running = set()
    for frame in sys._current_frames().values():
        while frame is not None:
            running.add(id(frame))
            frame = frame.f_back
    return running


def holder_chains(target: object, limit: int = 3) -> list[str]:
    """Up to `limit` chains "root -> ... -> target" of what keeps `target` alive, nearest roots first.

    A root is a module's globals, a running frame (any thread's), or an object with no Python-visible
    referrer (held from C code); a finished frame is walked on (to the traceback and exception keeping it).
    When the lookups run out first, the farthest holders reached are given, starting with "...".
    """
    gc.collect()
    running = _running_frames()
    mine: set[int] = set()  # this walk's own containers, never reported as holders
    parent: dict[int, int | None] = {id(target): None}
    objects: dict[int, object] = {id(target): target}
    queue: deque[tuple[int, int]] = deque([(id(target), 0)])  # ids: a tuple holding the object would refer to it
    roots: list[int] = []
    mine.update({id(parent), id(objects), id(sys._getframe()), id(sys._getframe(1))})
    lookups = 0
    while queue and len(roots) < limit and lookups < _MAX_LOOKUPS:
        key, hops = queue.popleft()
        lookups += 1
        obj = objects[key]
        referrers = [r for r in gc.get_referrers(obj) if id(r) not in mine]
        mine.add(id(referrers))
        if not referrers and obj is not target:
            roots.append(id(obj))
            continue
        for ref in referrers:
            if id(ref) in objects:
                continue
            parent[id(ref)], objects[id(ref)] = id(obj), ref
            if id(ref) in running or _module_of(ref) is not None or hops + 1 >= _MAX_HOPS:
                roots.append(id(ref))
            else:
                queue.append((id(ref), hops + 1))
    # Out of lookups before a root: the farthest holders reached still say where to look.
    partial = [] if roots else [key for key, _ in list(queue)[-limit:]]
    chains = []
    for root in roots[:limit] + partial:
        links, node = ["..."] if root in partial else [], root
        while node is not None:
            module = _module_of(objects[node])
            links.append(f"globals of {module}" if module else _describe(objects[node]))
            node = parent[node]
        chains.append(" -> ".join(links))
    return chains


def live_tensors(device_type: str, limit: int = 3) -> tuple[int, list[str]]:
    """Bytes of the tensors on `device_type` that Python can still reach (each storage once), and the
    `limit` largest with what holds each. Memory above that total is held outside Python (C++, allocator)."""
    gc.collect()
    # storage address -> (bytes, weak reference: a strong one here would be the first holder found)
    storages: dict[int, tuple[int, weakref.ref]] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type == device_type:  # type(): no lazy proxies
            try:
                storage = obj.untyped_storage()
                if storage.device.type != device_type:  # a fake tensor (torch.compile's tracing) lives on meta
                    continue
                address, nbytes = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # sparse, functional (traced) or meta
                continue
            if nbytes > storages.get(address, (-1, None))[0]:
                storages[address] = (nbytes, weakref.ref(obj))
    obj = storage = None
    total = sum(n for n, _ in storages.values())
    lines = []
    for nbytes, ref in sorted(storages.values(), key=lambda entry: entry[0], reverse=True)[:limit]:
        tensor = ref()
        if tensor is not None:
            held = (holder_chains(tensor, limit=1) or ["?"])[0]
            lines.append(f"{tuple(tensor.shape)} {tensor.dtype} {nbytes / 2**20:.1f} MiB, held by: {held}")
        tensor = None
    return total, lines
