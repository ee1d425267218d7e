"""Layer-wise LoRA merge within a memory budget, with disk spillover (the `dequant_merge` stage's core).

Sources: `original` adds the delta to the base's 16-bit shards; `dequantized` first reproduces the NF4 weights
the adapter was trained against (bitsandbytes' quantize + dequantize, bit-identical to what `from_pretrained`
holds); `auto` picks `original` when the base has 16-bit shards, else (a bitsandbytes 4-bit checkpoint)
`dequantized` from its stored NF4 weights. The report's `source_used` says which.
Tensors stream one at a time (never the whole model in GPU or host memory); finished tensors wait in RAM for
their shard up to the host budget and spill to `temporary_location` beyond it. Output is written to a
temporary directory with a manifest of hashes and renamed when complete; a verified identical merge is reused.
"""

from .errors import AdapterMismatchError, AlreadyMergedError, DiskSpaceError, MergeError
from .run import MergeReport, merge_adapter

__all__ = ["AdapterMismatchError", "AlreadyMergedError", "DiskSpaceError", "MergeError", "MergeReport", "merge_adapter"]
