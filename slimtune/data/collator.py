"""Batching rows for the model: packed rows, padding-free flattened examples, or classic padding.

Packed examples are kept apart without an attention mask: position ids restart at 0 for each example,
and with `attention_mask=None` and no KV cache transformers builds a block-diagonal causal mask from
them (sdpa, eager, flex). Flash-attention varlen gets the same boundaries as `cu_seq_lens`, and then
the whole micro-batch is one flattened row with no padding at all.

Each batch also carries `TOKEN_COUNTS_KEY` = (real tokens, token slots), which the trainer removes
before the forward pass and uses for tokens/s and padding waste.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch.utils.data import Dataset

from slimtune.data.formats import IGNORE_INDEX
from slimtune.data.packing import Row

BatchMode = Literal["packed", "padding_free", "padded"]
TOKEN_COUNTS_KEY = "_slimtune_token_counts"


class RowDataset(Dataset):
    """A list of rows as a map-style dataset (what Trainer's samplers and resume skipping expect)."""

    def __init__(self, rows: Sequence[Row]):
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Row:
        return self.rows[index]


class RowCollator:
    """Builds model inputs from rows.

    Args:
        mode: packed / padding_free keep examples apart by position ids; padded uses an attention mask.
        pad_token_id: id written into padding slots (never a target: their labels are -100).
        flash_varlen: flatten the batch to one row and pass `cu_seq_lens` (flash_attention_2 only).
        pad_to_multiple_of: round padded lengths up (8 suits GPU tensor cores); None = no rounding.
    """

    def __init__(
        self, mode: BatchMode, pad_token_id: int, *, flash_varlen: bool = False, pad_to_multiple_of: int | None = None
    ):
        self.mode = mode
        self.pad_token_id = pad_token_id
        self.flash_varlen = flash_varlen
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, rows: list[Row]) -> dict:
        if self.mode == "padded":
            batch = self._padded(rows)
        elif self.mode == "padding_free" or self.flash_varlen:
            batch = self._flattened(rows)
        else:
            batch = self._packed(rows)
        real = sum(len(r.input_ids) for r in rows)
        batch[TOKEN_COUNTS_KEY] = (real, batch["input_ids"].numel())
        return batch

    def _length(self, rows: list[Row]) -> int:
        n = max(len(r.input_ids) for r in rows)
        m = self.pad_to_multiple_of
        return -(-n // m) * m if m else n

    def _flattened(self, rows: list[Row]) -> dict:
        seq_lens = [n for r in rows for n in r.seq_lens]
        batch = {
            "input_ids": torch.tensor([[t for r in rows for t in r.input_ids]]),
            "labels": torch.tensor([[t for r in rows for t in r.labels]]),
            "position_ids": torch.tensor([[p for n in seq_lens for p in range(n)]]),
            "use_cache": False,
        }
        if self.flash_varlen:
            cu = torch.tensor([0] + seq_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(seq_lens), max_length_k=max(seq_lens))
        return batch

    def _packed(self, rows: list[Row]) -> dict:
        length = self._length(rows)
        ids, labels, positions = [], [], []
        for r in rows:
            pad = length - len(r.input_ids)
            ids.append(r.input_ids + [self.pad_token_id] * pad)
            labels.append(r.labels + [IGNORE_INDEX] * pad)
            # The padding tail restarts at 0 too, so it is a segment of its own that no example sees.
            positions.append([p for n in r.seq_lens for p in range(n)] + list(range(pad)))
        return {
            "input_ids": torch.tensor(ids),
            "labels": torch.tensor(labels),
            "position_ids": torch.tensor(positions),
            "use_cache": False,
        }

    def _padded(self, rows: list[Row]) -> dict:
        if any(len(r.seq_lens) > 1 for r in rows):
            raise ValueError("padded batches take one example per row; build them with one_per_row()")
        length = self._length(rows)
        ids, labels, mask = [], [], []
        for r in rows:
            pad = length - len(r.input_ids)
            ids.append(r.input_ids + [self.pad_token_id] * pad)
            labels.append(r.labels + [IGNORE_INDEX] * pad)
            mask.append([1] * len(r.input_ids) + [0] * pad)
        return {
            "input_ids": torch.tensor(ids),
            "labels": torch.tensor(labels),
            "attention_mask": torch.tensor(mask),
            "use_cache": False,
        }
