"""Reading raw records from JSONL, JSON, Parquet files or a Hub dataset, each with its location.

Every record carries a `file:line` location (a row number for Parquet and Hub datasets) so that a bad
record is reported where the user can fix it. Problems found while reading (invalid JSON, bytes that
are not UTF-8) are yielded with the record instead of raised, so the caller decides between stopping
and skipping (`DataSpec.on_bad_record`).
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slimtune.core.bounded import MAX_DEPTH, NestingError, json_depth_problem, loads_json

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_BOM = "\ufeff"  # Windows editors start UTF-8 files with it; JSON parsers refuse it, so it is dropped


class DataError(ValueError):
    """Training data that cannot be used; the message names the file, line and field and the fix."""


@dataclass(frozen=True)
class RawRecord:
    """One record as read: where it is, its parsed value, and a reading problem if there was one."""

    where: str
    value: Any = None
    problem: str | None = None


def iter_records(path: str, split: str = "train") -> Iterator[RawRecord]:
    """Yield the records of a local data file or a Hub dataset, in file order.

    Raises:
        DataError: the file is missing, empty, of an unknown type, or not a list of records.
    """
    local = Path(path).expanduser()
    if local.is_file():
        suffix = local.suffix.lower()
        if suffix == ".jsonl":
            return _iter_jsonl(local)
        if suffix == ".json":
            return _iter_json(local)
        if suffix == ".parquet":
            return _iter_parquet(local)
        raise DataError(f"{local}: unknown data file type {suffix!r}; use one of {', '.join(LOCAL_SUFFIXES)}")
    if local.suffix.lower() in LOCAL_SUFFIXES or path.startswith((".", "/", "~")):
        raise DataError(f"{local}: file not found; set data.path to an existing .jsonl/.json/.parquet file")
    return _iter_hub(path, split)


def _iter_jsonl(path: Path) -> Iterator[RawRecord]:
    raw = path.read_bytes()
    if not raw.strip():
        raise DataError(f"{path}:1: field (record): the file is empty; add one JSON object per line")
    for number, line in enumerate(raw.split(b"\n"), start=1):
        where = f"{path}:{number}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            yield RawRecord(
                where,
                problem=f"field (record): byte {e.start + 1} of the line is not UTF-8 "
                f"({line[e.start : e.start + 1]!r}); re-save the file as UTF-8",
            )
            continue
        text = text.removeprefix(_BOM) if number == 1 else text
        if not text.strip():
            continue  # blank lines (a trailing newline, spacing) are not records
        try:
            value = loads_json(text)
        except NestingError as e:
            yield RawRecord(where, problem=f"field (record): {e}")
            continue
        except json.JSONDecodeError as e:
            yield RawRecord(
                where,
                problem=f"field (record): not valid JSON ({e.msg} at column {e.colno}); "
                "each line must be one JSON object",
            )
            continue
        yield RawRecord(where, value, _surrogate_problem(text, value))


def _surrogate_problem(text: str, value: Any) -> str | None:
    """Why a record holds a lone surrogate (a `\\ud800` escape without its pair), or None.

    JSON allows such escapes but they are not characters: the tokenizer cannot encode them and failed with
    its own error deep in the run. Only escaped text can hold them (strict UTF-8 decoding refuses encoded
    ones), so a regex over the line finds the candidates and only those records are encoded to check.
    """
    if not _SURROGATE_ESCAPE.search(text):
        return None
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return (
            f"field (record): holds a lone surrogate escape (\\u{ord(e.object[e.start]):04x}), which is not a "
            "character; fix or remove the text"
        )
    return None


def _iter_json(path: Path) -> Iterator[RawRecord]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8").removeprefix(_BOM)
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(
            f"{path}:{line}: field (record): byte {e.start + 1} is not UTF-8; re-save the file as UTF-8"
        ) from None
    if not text.strip():
        raise DataError(f"{path}:1: field (record): the file is empty; give a JSON list of records")
    # Decode the top-level list element by element so every record knows its starting line.
    decoder = json.JSONDecoder()
    pos = _skip_space(text, 0)
    if text[pos] != "[":
        raise DataError(
            f"{path}:{text.count(chr(10), 0, pos) + 1}: field (record): expected a JSON list of "
            "records ([{...}, ...]); convert the file to such a list or to JSONL"
        )
    pos = _skip_space(text, pos + 1)
    line, counted = 1, 0  # counted incrementally: counting from 0 for each record is quadratic in the file
    while pos < len(text) and text[pos] != "]":
        line, counted = line + text.count("\n", counted, pos), pos
        try:
            start = pos
            value, pos = decoder.raw_decode(text, pos)
        except RecursionError:  # the C scanner counts levels against the recursion limit (~1,000)
            raise DataError(
                f"{path}:{line}: field (record): nested deeper than {MAX_DEPTH} levels; flatten it"
            ) from None
        except json.JSONDecodeError as e:
            # Past a syntax error the rest of the list cannot be split into records: stop here.
            raise DataError(
                f"{path}:{e.lineno}: field (record): not valid JSON ({e.msg} at column {e.colno}); fix the file"
            ) from None
        too_deep = json_depth_problem(value)
        problem = f"field (record): {too_deep}" if too_deep else _surrogate_problem(text[start:pos], value)
        yield RawRecord(f"{path}:{line}", value, problem)
        pos = _skip_space(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_space(text, pos + 1)
        elif pos < len(text) and text[pos] != "]":
            raise DataError(
                f"{path}:{text.count(chr(10), 0, pos) + 1}: field (record): expected ',' or ']' "
                "between records; fix the file"
            )


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _iter_parquet(path: Path) -> Iterator[RawRecord]:
    if importlib.util.find_spec("pyarrow") is None:
        raise DataError(f"{path}: reading Parquet needs pyarrow; pip install pyarrow, or convert the file to JSONL")
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if table.num_rows == 0:
        raise DataError(f"{path}:row 1: field (record): the file has no rows; add records")
    for number, row in enumerate(table.to_pylist(), start=1):
        yield RawRecord(f"{path}:row {number}", row)


def _iter_hub(dataset_id: str, split: str) -> Iterator[RawRecord]:
    if importlib.util.find_spec("datasets") is None:
        raise DataError(
            f"{dataset_id}: not a local file, and Hub datasets need the datasets extra: "
            "pip install 'slimtune[datasets]'"
        )
    import datasets

    try:
        rows = datasets.load_dataset(dataset_id, split=split)
    except Exception as e:  # the library raises many types (network, missing split, auth)
        raise DataError(
            f"{dataset_id}[{split}]: could not load the Hub dataset ({type(e).__name__}: {e}); "
            "check data.path, data.split and your network/token"
        ) from e
    if len(rows) == 0:
        raise DataError(f"{dataset_id}[{split}]:row 1: field (record): the split is empty; choose another data.split")
    for number, row in enumerate(rows, start=1):
        yield RawRecord(f"{dataset_id}[{split}]:row {number}", row)
