"""A re-run with a changed spec that fails: the run directory still describes one run.

Seen before: `spec.effective.yaml` was written when the run started, so a re-run that failed anywhere left it
describing settings that produced none of the outputs beside it; and a re-run that trained a new adapter, then
failed in the merge, left the earlier run's `merged/` and `gguf/` beside it, which `slimtune generate`/`chat`
then loaded. Now the effective spec is written with the run's first output (the adapter), and a new adapter
sets the earlier merge and GGUFs aside (`slimtune.flows.earlier_outputs`).
"""

from __future__ import annotations

import importlib
import shutil

import pytest
import yaml
from faultlib import sha256, spec_dict, tree


def _earlier_run(reference_run, tmp_path):
    """A copy of the clean reference run under `tmp_path` (its spec, adapter, merged/ and gguf/ f16)."""
    run_dir = tmp_path / "faults"
    shutil.copytree(reference_run["run_dir"], run_dir)
    return run_dir


def _failing_task(name: str):
    from prefect import task
    from prefect.cache_policies import NO_CACHE

    @task(name=name, cache_policy=NO_CACHE)
    def fail(*args, **kwargs):
        raise RuntimeError(f"injected failure in {name}")

    return fail


@pytest.mark.fault(
    "Re-run with a changed spec fails in training",
    stage="packed_sft",
    expect="spec.effective.yaml and every output still describe the earlier run",
)
def test_a_rerun_failing_before_its_adapter_changes_nothing(reference_run, tmp_path, monkeypatch, observe):
    from slimtune.flows.finetune import finetune
    from slimtune.spec.schema import parse_spec

    run_dir = _earlier_run(reference_run, tmp_path)
    before = (run_dir / "spec.effective.yaml").read_text()
    outputs = {k: sha256(run_dir / k) for k in tree(run_dir) if k.split("/")[0] in ("adapter", "merged", "gguf")}
    monkeypatch.setattr(importlib.import_module("slimtune.flows.finetune"), "packed_sft_task", _failing_task("t"))
    with pytest.raises(RuntimeError, match="injected failure"):
        finetune(parse_spec(spec_dict(tmp_path, lora={"alpha": 8})))
    assert (run_dir / "spec.effective.yaml").read_text() == before
    after = {k: sha256(run_dir / k) for k in tree(run_dir) if k.split("/")[0] in ("adapter", "merged", "gguf")}
    assert after == outputs
    observe(f"spec.effective.yaml unchanged, {len(after)} output files unchanged")


@pytest.mark.fault(
    "Re-run with a changed spec fails in the merge",
    stage="dequant_merge",
    expect="the new adapter's spec is the effective one; the earlier merge is gone and its GGUFs are in "
    "gguf.previous/, so generate/chat load no GGUF of another adapter",
)
def test_a_rerun_failing_after_its_adapter_leaves_no_output_of_the_earlier_one(
    reference_run, tmp_path, monkeypatch, observe
):
    from slimtune.flows.finetune import finetune
    from slimtune.inference.generate import RunDirError, pick_gguf
    from slimtune.spec.schema import parse_spec

    run_dir = _earlier_run(reference_run, tmp_path)
    earlier_ggufs = sorted(p.name for p in (run_dir / "gguf").glob("*.gguf"))
    assert earlier_ggufs and (run_dir / "merged").is_dir()
    monkeypatch.setattr(importlib.import_module("slimtune.flows.export"), "dequant_merge_task", _failing_task("m"))
    with pytest.raises(RuntimeError, match="injected failure"):
        finetune(parse_spec(spec_dict(tmp_path, lora={"alpha": 8})))
    assert yaml.safe_load((run_dir / "spec.effective.yaml").read_text())["lora"]["alpha"] == 8
    assert not (run_dir / "merged").exists() and not (run_dir / "gguf").exists()
    assert sorted(p.name for p in (run_dir / "gguf.previous").glob("*.gguf")) == earlier_ggufs
    with pytest.raises(RunDirError) as err:
        pick_gguf(run_dir)
    observe(f"merged/ gone, gguf.previous/ {earlier_ggufs}; generate: {str(err.value).replace(str(tmp_path), '…')}")
