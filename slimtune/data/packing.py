"""Best-fit-decreasing packing of tokenized examples into rows of at most `max_seq_length` tokens.

Best-fit decreasing places each example, longest first, into the open row with the least room that
still fits it. It uses at most 11/9 OPT + 4 rows (Johnson 1973); on lengths skewed towards short
examples it fills rows to well over 95%. A row remembers its examples' lengths, from which the collator
builds position ids that restart at 0 for each example (what keeps packed examples apart).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    """One tokenized example: ids and labels of equal length (-100 = no loss)."""

    input_ids: list[int]
    labels: list[int]


@dataclass(frozen=True)
class Row:
    """A training row: one or more examples back to back, and each one's length."""

    input_ids: list[int]
    labels: list[int]
    seq_lens: list[int]


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group item indices into bins whose summed lengths are at most `capacity`.

    Bins are returned in the order they were opened, items in each bin longest first; ties keep input
    order, so the result is deterministic.

    Raises:
        ValueError: an item is longer than `capacity` or not positive (truncate or drop it first).
    """
    bad = [i for i, n in enumerate(lengths) if not 0 < n <= capacity]
    if bad:
        raise ValueError(f"items {bad[:5]} have lengths outside 1..{capacity}; truncate or drop them first")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    # Open bins sorted by remaining room; `bisect` finds the tightest one that fits in O(log n).
    rooms: list[tuple[int, int]] = []  # (room left, bin index)
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(rooms, (n, -1))
        if at == len(rooms):
            bins.append([i])
            room, b = capacity - n, len(bins) - 1
        else:
            room, b = rooms.pop(at)
            bins[b].append(i)
            room -= n
        if room > 0:
            bisect.insort(rooms, (room, b))
    return bins


def pack(examples: Sequence[Example], max_seq_length: int) -> list[Row]:
    """Pack examples into rows of at most `max_seq_length` tokens (best-fit decreasing)."""
    bins = best_fit_decreasing([len(e.input_ids) for e in examples], max_seq_length)
    rows = []
    for members in bins:
        ids: list[int] = []
        labels: list[int] = []
        for i in members:
            ids += examples[i].input_ids
            labels += examples[i].labels
        rows.append(Row(ids, labels, [len(examples[i].input_ids) for i in members]))
    return rows


def one_per_row(examples: Sequence[Example]) -> list[Row]:
    """Each example as its own row (padding-free and padded batching)."""
    return [Row(list(e.input_ids), list(e.labels), [len(e.input_ids)]) for e in examples]


def packing_efficiency(rows: Sequence[Row], max_seq_length: int) -> float:
    """Share of the rows' token slots (rows x max_seq_length) that hold real tokens."""
    return sum(len(r.input_ids) for r in rows) / max(1, len(rows) * max_seq_length)


def padded_efficiency(lengths: Sequence[int], batch_size: int) -> float:
    """Share of real tokens when examples are batched in order and padded to each batch's longest."""
    slots = sum(
        max(lengths[i : i + batch_size]) * len(lengths[i : i + batch_size]) for i in range(0, len(lengths), batch_size)
    )
    return sum(lengths) / max(1, slots)
