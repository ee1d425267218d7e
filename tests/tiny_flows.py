"""The spec of a short run of the whole flow on a builtin tiny family, as the family tests run it."""

from __future__ import annotations

from pathlib import Path

from slimtune.models.tiny import DATA_FILE
from slimtune.spec.schema import PipelineSpec, load_spec


def tiny_flow_spec(family: str, tmp_path: Path) -> PipelineSpec:
    """deployments/tiny.yaml on `builtin:tiny-<family>`: 80 of the shipped records (8 held out for eval), 4 steps,
    a checkpoint every 2, f16 and q8_0 GGUF, everything under `tmp_path`."""
    spec = load_spec(DATA_FILE.parent.parent / "tiny.yaml")
    spec.model.name_or_path = f"builtin:tiny-{family}"
    spec.output_dir = str(tmp_path)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(DATA_FILE.read_text(encoding="utf-8").splitlines(keepends=True)[:80]))
    spec.data.path = str(data)
    spec.train.max_steps, spec.train.save_steps, spec.train.warmup_steps = 4, 2, 1
    assert spec.data.eval_fraction > 0 and spec.export.gguf == ["f16", "q8_0"]
    return spec
