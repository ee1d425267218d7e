"""The finetune flow end to end on CPU: six task runs in order, real outputs that real consumers load."""

import gc
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from slimtune import registry
from slimtune.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
STAGES = ["load_4bit", "attach_lora", "packed_sft", "cleanup", "dequant_merge", "gguf_convert_and_push"]


def _tiny_spec(tmp_path, **train):
    spec = load_spec(ROOT / "deployments" / "tiny.yaml")
    spec.output_dir = str(tmp_path)
    spec.train.max_steps = train.get("max_steps", 6)
    spec.train.save_steps = 3
    spec.export.gguf = ["f16"]
    return spec


@pytest.fixture(scope="module")
def finished_run(prefect_harness, tmp_path_factory):
    from slimtune.flows import finetune

    spec = _tiny_spec(tmp_path_factory.mktemp("run"))
    state = finetune(spec, return_state=True)
    return spec, state


def test_flow_completes_with_six_task_runs_in_order(finished_run):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    spec, state = finished_run
    assert state.is_completed(), state
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])),
            sort=TaskRunSort.EXPECTED_START_TIME_ASC,
        )
    names = [r.name.split(" ")[0] for r in runs]
    assert names == STAGES
    assert all(r.state.is_completed() for r in runs)


def test_outputs_load_in_real_consumers(finished_run):
    import gguf
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from slimtune.model_source import local_model_dir

    spec, state = finished_run
    run = spec.run_dir()
    base = AutoModelForCausalLM.from_pretrained(local_model_dir(spec.model))
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        base_logits = base(ids).logits
        peft_model = PeftModel.from_pretrained(base, run / "adapter")
        adapted = peft_model(ids).logits
    assert not torch.allclose(adapted, base_logits, atol=1e-4), "the adapter must change the model"
    merged = AutoModelForCausalLM.from_pretrained(run / "merged")
    with torch.no_grad():
        merged_logits = merged(ids).logits
    assert torch.isfinite(merged_logits).all()
    reader = gguf.GGUFReader(run / "gguf" / f"{spec.name}-f16.gguf")
    names = {t.name for t in reader.tensors}
    assert "token_embd.weight" in names and "blk.0.attn_q.weight" in names
    assert (run / "report.json").is_file() and (run / "report.md").is_file()
    assert sorted(p.stem for p in (run / "memory").glob("*.json")) == sorted(STAGES)


def test_no_jax_after_a_full_run(finished_run):
    assert "jax" not in sys.modules


def test_cleanup_frees_the_live_model_inside_a_running_flow(prefect_harness, tmp_path):
    from prefect import flow

    from slimtune.flows.stages import attach_lora_task, cleanup_task, load_4bit_task
    from slimtune.tasks.cleanup import MemorySnapshot

    spec = _tiny_spec(tmp_path)

    @flow
    def load_then_cleanup() -> tuple[bool, bool]:
        baseline = MemorySnapshot.take().to_dict()
        loaded = load_4bit_task(spec)
        lora = attach_lora_task(spec, loaded["handle"])
        ref = weakref.ref(registry.get(lora["handle"]))
        alive_before = ref() is not None
        cleanup_task(spec, baseline)
        gc.collect()
        return alive_before, ref() is None

    alive_before, dead_after = load_then_cleanup()
    assert alive_before and dead_after
    assert registry.handles() == []


def test_cli_validate_and_bad_spec_exit_codes(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "slimtune.cli", "validate", str(ROOT / "deployments" / "tiny.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("lora:\n  r: 0\n")
    res = subprocess.run(
        [sys.executable, "-m", "slimtune.cli", "run", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 2
    assert "lora.r: got 0" in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("slimtune: error:")
