"""Walking an exception's chain once, the same way everywhere (memory classification, retries, Hub errors)."""

from __future__ import annotations

from collections.abc import Iterator


def exception_chain(exc: BaseException, *, implicit: bool = True) -> Iterator[BaseException]:
    """`exc`, then what it was raised from (`__cause__`), and with `implicit` what it was raised while
    handling (`__context__`); each exception once, so a cycle ends the walk."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or (current.__context__ if implicit else None)
