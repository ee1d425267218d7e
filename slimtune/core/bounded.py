"""Parsing whose cost is bounded by the input's size, and error messages bounded whatever the input.

A 700-byte YAML file of nested aliases (`a: &a [x, x, ...]`, `b: &b [*a, *a, ...]`, ...) composes into a
few dozen nodes but expands to billions of values; the spec validator then formatted the expanded value
into its message (seen: 388 s and 3.1 GB to reject one file, one level more passed 4 GB). Here the
composed node graph is measured before anything is constructed, JSON nesting is limited, and every
message shows a clipped view of what it quotes.
"""

from __future__ import annotations

import json
import reprlib
from typing import Any

import yaml

# A spec holds ~100 values, a data.sources mix of 1,000 files ~6,000: 100k is far above any real spec and
# far below what costs time (constructing 100k values takes ~0.1 s).
MAX_YAML_VALUES = 100_000
# A spec nests 4 levels, a chat record with tool schemas ~10; Python's parsers give up near 1,000 (the
# recursion limit) with a RecursionError, and code that walks a value recursively can fail far below that.
MAX_DEPTH = 64
_CLIP = 200  # characters of a quoted input kept in a message


class NestingError(ValueError):
    """Input nested or aliased beyond what any real spec or record needs; the message says which limit."""


def clip(text: str, limit: int = _CLIP) -> str:
    """`text` cut to about `limit` characters, the middle replaced by how much was left out."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}…({len(text) - 2 * half:,} characters)…{text[-half:]}"


_REPR = reprlib.Repr()  # keyword arguments need Python 3.12
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, _CLIP, _CLIP
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6


def short_repr(value: Any, limit: int = _CLIP) -> str:
    """A repr that costs and shows at most a few levels and items of `value` (never the whole of it)."""
    return clip(_REPR.repr(value), limit)


def _yaml_children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def check_yaml_node(root: yaml.Node, max_values: int = MAX_YAML_VALUES, max_depth: int = MAX_DEPTH) -> None:
    """Refuse a composed YAML document that would expand past `max_values` values or `max_depth` levels.

    An alias is the same node object as its anchor, so the composed document is a graph: each node's
    expanded size is computed once (memoized by identity), which makes this linear in the file's size.
    Iterative, so a deep document cannot exhaust the stack here.

    Raises:
        NestingError: the limit passed (or an alias that contains itself), with the line it starts on.
    """
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    open_nodes: set[int] = set()  # the current path from the root: an alias back into it is a cycle
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        where = f"line {node.start_mark.line + 1}"
        if finished:
            open_nodes.discard(key)
            children = _yaml_children(node)
            size[key] = 1 + sum(size[id(c)] for c in children)
            depth[key] = 1 + max((depth[id(c)] for c in children), default=0)
            if size[key] > max_values:
                raise NestingError(
                    f"the value at {where} expands to more than {max_values:,} values through aliases "
                    "(*name); write the values out or use fewer nested aliases"
                )
            if depth[key] > max_depth:
                raise NestingError(f"the value at {where} nests deeper than {max_depth} levels; flatten it")
            continue
        if key in size:
            continue
        if key in open_nodes:
            raise NestingError(f"the alias at {where} refers to a value that contains it; remove the cycle")
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _yaml_children(node) if id(c) not in size)


def load_yaml(text: str, loader: type[yaml.SafeLoader] = yaml.SafeLoader) -> Any:
    """`yaml.load(text, loader)` with the document checked by `check_yaml_node` before it is constructed.

    Raises:
        NestingError: too many values after alias expansion, too deep, or an alias cycle.
        yaml.YAMLError: not valid YAML (as `yaml.load`).
    """
    parser = loader(text)
    try:
        try:
            node = parser.get_single_node()
        except RecursionError:  # the composer recurses once per level
            raise NestingError(f"the document nests deeper than {MAX_DEPTH} levels; flatten it") from None
        if node is None:
            return None
        check_yaml_node(node)
        return parser.construct_document(node)
    finally:
        parser.dispose()


def json_depth_problem(value: Any, max_depth: int = MAX_DEPTH) -> str | None:
    """Why a parsed JSON value is nested too deeply, or None. Iterative; stops at the first offence."""
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            if level > max_depth:
                return f"nested deeper than {max_depth} levels; flatten it"
            stack.extend((v, level + 1) for v in item if isinstance(v, (dict, list)))
    return None


def loads_json(text: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """`json.loads` that refuses values nested deeper than `max_depth` (instead of a RecursionError).

    Raises:
        NestingError: too deep.
        json.JSONDecodeError: not valid JSON.
    """
    try:
        value = json.loads(text)
    except RecursionError:  # the C scanner counts levels against the recursion limit (~1,000)
        raise NestingError(f"nested deeper than {max_depth} levels; flatten it") from None
    problem = json_depth_problem(value, max_depth)
    if problem:
        raise NestingError(problem)
    return value
