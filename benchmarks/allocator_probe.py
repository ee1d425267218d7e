"""Does the product's allocator setting take effect, and does the budget cap still hold under it?

Run on a GPU (device tool) before a calibration: `resolve_device` asks for expandable segments after
`torch.cuda.is_available()` has run, so this checks that the setting is read when the allocator starts,
that the segments are expandable, and that `set_per_process_memory_fraction` (how `guard.gpu_memory_fraction`
stands in for a smaller card) still refuses an allocation over the cap. Prints one JSON line; exits 1 if not.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from slimtune.core.device import resolve_device

GiB = 1024**3


def main() -> int:
    dev = resolve_device("auto")
    if dev.type != "cuda":
        print(json.dumps({"device": str(dev), "skipped": "no GPU"}))
        return 0
    total = torch.cuda.mem_get_info(dev)[1]
    torch.cuda.set_per_process_memory_fraction(2 * GiB / total, dev)
    blocks = [torch.empty(256 << 20, dtype=torch.uint8, device=dev) for _ in range(7)]  # 1.75 GiB
    expandable = any(s.get("is_expandable") for s in torch.cuda.memory._snapshot()["segments"])
    try:
        blocks.append(torch.empty(512 << 20, dtype=torch.uint8, device=dev))
        capped = False
    except torch.OutOfMemoryError:
        capped = True
    # Free every other block and ask for one larger than any hole: a fragmenting pool would need new memory.
    del blocks[1::2]
    torch.cuda.empty_cache()
    reserved_before = torch.cuda.memory_reserved(dev)
    big = torch.empty(768 << 20, dtype=torch.uint8, device=dev)
    row = {
        "setting": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "expandable": expandable,
        "cap_enforced": capped,
        "reserved_before_gib": round(reserved_before / GiB, 3),
        "reserved_after_gib": round(torch.cuda.memory_reserved(dev) / GiB, 3),
        "allocated_gib": round(torch.cuda.memory_allocated(dev) / GiB, 3),
    }
    del big
    print(json.dumps(row))
    return 0 if expandable and capped else 1


if __name__ == "__main__":
    raise SystemExit(main())
