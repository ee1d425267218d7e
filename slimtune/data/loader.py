"""Loading, validating, tokenizing and splitting the training data — before any model is loaded.

Only the tokenizer is needed, so a bad record fails the run in seconds with `file:line: field ...`
instead of after minutes of model loading.
"""

from __future__ import annotations

import logging
import random
from dataclasses import asdict, dataclass, field, fields
from typing import Literal

from slimtune.core.bounded import clip
from slimtune.data.formats import IGNORE_INDEX, FieldError, Format, detect_format, render
from slimtune.data.packing import Example
from slimtune.data.records import DataError, iter_records
from slimtune.spec.schema import DataSpec

log = logging.getLogger(__name__)
# The split must be identical on every retry and resume of a run, so it is not tied to the train seed.
_SPLIT_SEED = 0
_KEPT_PROBLEMS = 5  # skipped-record messages kept for the report; the rest are only counted


@dataclass
class DataCounts:
    """What happened to the records on the way to examples."""

    records: int = 0
    skipped_malformed: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    dropped_no_targets: int = 0
    longest: int = 0  # tokens of the longest example, before truncation
    train_examples: int = 0
    eval_examples: int = 0
    train_tokens: int = 0
    target_tokens: int = 0
    skipped_problems: list[str] = field(default_factory=list)


@dataclass
class Examples:
    """Tokenized train and eval examples plus the counts and detected format."""

    train: list[Example]
    eval: list[Example]
    format: Format | Literal["mixed"]
    source: str
    counts: DataCounts
    sources: list[dict] = field(default_factory=list)  # per-source counts of a data.sources mix

    def summary(self) -> dict:
        """A JSON-ready record of the data (for reports and Prefect artifacts)."""
        mix = {"sources": self.sources} if self.sources else {}
        return {"format": self.format, "source": self.source, **asdict(self.counts), **mix}


def load_examples(data: DataSpec, tokenizer) -> Examples:
    """Read, check, tokenize, truncate/drop and split the data of `data`.

    Raises:
        DataError: a malformed record (with `on_bad_record: error`), an empty file, or no usable example;
            the message names file:line, the field and the fix.
    """
    if data.sources:
        return _load_mix(data, tokenizer)
    counts = DataCounts()
    fmt: Format | None = None
    examples: list[Example] = []
    for raw in iter_records(data.path, data.split):
        counts.records += 1
        try:
            if raw.problem is not None:
                raise _Malformed(raw.problem)
            if fmt is None:
                fmt = detect_format(raw.value, data)
            ids, labels = render(raw.value, fmt, data, tokenizer)
        except (FieldError, _Malformed) as e:
            message = f"{raw.where}: {clip(str(e), 500)}"  # a field error can quote a record of any size
            if data.on_bad_record == "error":
                raise DataError(f"{message} (or set data.on_bad_record: skip to skip and count such records)") from None
            counts.skipped_malformed += 1
            if len(counts.skipped_problems) < _KEPT_PROBLEMS:
                counts.skipped_problems.append(message)
            continue
        example = _fit(ids, labels, data, counts)
        if example is not None:
            examples.append(example)
    if counts.records == 0:
        raise DataError(f"{data.path}:1: field (record): no records; the data is empty")
    if not examples:
        raise DataError(
            f"{data.path}: none of the {counts.records} records gave a usable example "
            f"({counts.skipped_malformed} malformed, {counts.dropped_overlong} dropped as longer than "
            f"data.max_seq_length {data.max_seq_length}, {counts.truncated} truncated to it, "
            f"{counts.dropped_no_targets} without target tokens left; the longest has {counts.longest} tokens); "
            + (
                f"raise data.max_seq_length to {counts.longest} or more"
                if counts.dropped_overlong + counts.truncated
                else "check data.format and the field names"
            )
        )
    if counts.skipped_malformed:
        log.warning(
            "skipped %d malformed record(s) of %d; first: %s",
            counts.skipped_malformed,
            counts.records,
            counts.skipped_problems[0],
        )
    train, held_out = _split(examples, data.eval_fraction)
    counts.train_examples, counts.eval_examples = len(train), len(held_out)
    counts.train_tokens = sum(len(e.input_ids) for e in train)
    counts.target_tokens = sum(sum(t != IGNORE_INDEX for t in e.labels) for e in train)
    return Examples(train, held_out, fmt, data.path, counts)


class _Malformed(ValueError):
    """A record that could not even be read (bad JSON, not UTF-8)."""


def _fit(ids: list[int], labels: list[int], data: DataSpec, counts: DataCounts) -> Example | None:
    counts.longest = max(counts.longest, len(ids))
    if len(ids) > data.max_seq_length:
        if data.overlong == "drop":
            counts.dropped_overlong += 1
            return None
        counts.truncated += 1
        ids, labels = ids[: data.max_seq_length], labels[: data.max_seq_length]
    if all(t == IGNORE_INDEX for t in labels):
        # Nothing to learn (e.g. the assistant turn was truncated away); it would only cost compute.
        counts.dropped_no_targets += 1
        return None
    return Example(ids, labels)


def _split(examples: list[Example], fraction: float) -> tuple[list[Example], list[Example]]:
    if fraction == 0 or len(examples) < 2:
        return examples, []
    order = list(range(len(examples)))
    random.Random(_SPLIT_SEED).shuffle(order)
    n_eval = min(len(examples) - 1, max(1, round(len(examples) * fraction)))
    held = set(order[:n_eval])
    return ([e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held])


def _load_mix(data: DataSpec, tokenizer) -> Examples:
    """Load each of data.sources with data's settings (overridden per source), split each, weight the train parts.

    Each source is split on its own, before weighting, so an up-weighted example is never also held out
    and every source is represented in the eval loss.
    """
    train: list[Example] = []
    held_out: list[Example] = []
    total = DataCounts()
    per_source = []
    for i, source in enumerate(data.sources):
        overrides = {k: v for k, v in source.model_dump(exclude={"weight"}).items() if v is not None}
        one = load_examples(data.model_copy(update={**overrides, "sources": None}), tokenizer)
        used = _weighted(one.train, source.weight, seed=_SPLIT_SEED + i)
        train += used
        held_out += one.eval
        for f in fields(DataCounts):
            if f.name != "skipped_problems":
                setattr(total, f.name, getattr(total, f.name) + getattr(one.counts, f.name))
        total.skipped_problems += one.counts.skipped_problems[: _KEPT_PROBLEMS - len(total.skipped_problems)]
        per_source.append(
            {
                "path": source.path,
                "weight": source.weight,
                "format": one.format,
                "records": one.counts.records,
                "train_examples": len(one.train),
                "train_examples_used": len(used),
                "eval_examples": len(one.eval),
                "train_tokens_used": sum(len(e.input_ids) for e in used),
            }
        )
    if not train:  # each weight below 1 rounded its share to 0 examples
        shares = ", ".join(f"{s['path']}: {s['train_examples']} x {s['weight']}" for s in per_source)
        raise DataError(
            f"data.sources: the weights leave no training example ({shares}, each rounded to 0); raise a "
            "source's weight to at least 0.5 / its examples, or add data"
        )
    total.train_examples, total.eval_examples = len(train), len(held_out)
    total.train_tokens = sum(len(e.input_ids) for e in train)
    total.target_tokens = sum(sum(t != IGNORE_INDEX for t in e.labels) for e in train)
    formats = {s["format"] for s in per_source}
    fmt = formats.pop() if len(formats) == 1 else "mixed"
    return Examples(train, held_out, fmt, ", ".join(s["path"] for s in per_source), total, per_source)


def _weighted(examples: list[Example], weight: float, seed: int) -> list[Example]:
    """Each example int(weight) times, plus a seeded random share (weight's fraction) of them once more."""
    whole, fraction = int(weight), weight - int(weight)
    extra = random.Random(seed).sample(examples, round(len(examples) * fraction))
    return examples * whole + extra
