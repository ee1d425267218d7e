"""Training data: reading records, rendering them to ids and labels, packing rows, and batching them."""

from slimtune.data.collator import TOKEN_COUNTS_KEY, BatchMode, RowCollator, RowDataset
from slimtune.data.formats import IGNORE_INDEX, FieldError, detect_format, render
from slimtune.data.loader import DataCounts, Examples, load_examples
from slimtune.data.packing import (
    Example,
    Row,
    best_fit_decreasing,
    one_per_row,
    pack,
    packing_efficiency,
    padded_efficiency,
)
from slimtune.data.records import DataError, RawRecord, iter_records

__all__ = [
    "BatchMode",
    "DataCounts",
    "DataError",
    "Example",
    "Examples",
    "FieldError",
    "IGNORE_INDEX",
    "RawRecord",
    "Row",
    "RowCollator",
    "RowDataset",
    "TOKEN_COUNTS_KEY",
    "best_fit_decreasing",
    "detect_format",
    "iter_records",
    "load_examples",
    "one_per_row",
    "pack",
    "packing_efficiency",
    "padded_efficiency",
    "render",
]
