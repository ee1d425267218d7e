"""The finetune flow end to end on CPU: six task runs in order, real outputs that real consumers load."""

import collections
import contextlib
import gc
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from slimtune.core import registry
from slimtune.spec.schema import load_spec

ROOT = Path(__file__).resolve().parent.parent
STAGES = ["load_4bit", "attach_lora", "packed_sft", "cleanup", "dequant_merge", "gguf_convert_and_push"]


def _tiny_spec(tmp_path, **train):
    spec = load_spec(ROOT / "deployments" / "tiny.yaml")
    spec.output_dir = str(tmp_path)
    spec.train.max_steps = train.get("max_steps", 6)
    spec.train.save_steps = 3
    spec.export.gguf = ["f16"]
    return spec


_RESOLVERS = ("local_model_dir", "check_model_dir", "read_config")


@pytest.fixture(scope="module")
def finished_run(prefect_harness, tmp_path_factory):
    from slimtune.flows.finetune import finetune

    spec = _tiny_spec(tmp_path_factory.mktemp("run"))
    with _counting_resolvers() as calls:
        state = finetune(spec, return_state=True)
    return spec, state, dict(calls)


@contextlib.contextmanager
def _counting_resolvers():
    """Count calls of the model-folder resolvers wherever slimtune imported them (by name or through the module)."""
    from slimtune.models import source as model_source

    calls: collections.Counter = collections.Counter()
    originals = {name: getattr(model_source, name) for name in _RESOLVERS}

    def counted(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    with pytest.MonkeyPatch.context() as mp:
        for module in [m for n, m in sys.modules.items() if n.startswith("slimtune") and m is not None]:
            for attr, value in list(vars(module).items()):
                for name, original in originals.items():
                    if value is original:
                        mp.setattr(module, attr, counted(name))
        yield calls


def test_flow_completes_with_six_task_runs_in_order(finished_run):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    spec, state, _ = finished_run
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

    from slimtune.models.source import local_model_dir

    spec, state, _ = finished_run
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


def test_the_model_folder_is_resolved_once_per_run(finished_run):
    """The flow resolves the run plan (folder, config, family, device, dtype) once; no task re-derives it."""
    _, state, calls = finished_run
    assert state.is_completed(), state
    assert calls == {"local_model_dir": 1, "check_model_dir": 1, "read_config": 1}, calls


def test_no_jax_after_a_full_run(finished_run):
    assert "jax" not in sys.modules


def test_cleanup_frees_the_live_model_inside_a_running_flow(prefect_harness, tmp_path):
    from prefect import flow

    from slimtune.flows.stages import attach_lora_task, cleanup_task, load_4bit_task
    from slimtune.plan.run_plan import resolve_plan
    from slimtune.tasks.cleanup import MemorySnapshot

    spec = _tiny_spec(tmp_path)
    plan = resolve_plan(spec)

    @flow
    def load_then_cleanup() -> tuple[bool, bool]:
        baseline = MemorySnapshot.take().to_dict()
        loaded = load_4bit_task(spec, plan)
        lora = attach_lora_task(spec, plan, loaded["handle"])
        ref = weakref.ref(registry.get(lora["handle"]))
        alive_before = ref() is not None
        cleanup_task(spec, plan, baseline)
        gc.collect()
        return alive_before, ref() is None

    alive_before, dead_after = load_then_cleanup()
    assert alive_before and dead_after
    assert registry.handles() == []


def test_cli_validate_and_bad_spec_exit_codes(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "slimtune.cli.main", "validate", str(ROOT / "deployments" / "tiny.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("lora:\n  r: 0\n")
    res = subprocess.run(
        [sys.executable, "-m", "slimtune.cli.main", "run", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 2
    assert "lora.r: got 0" in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("slimtune: error:")


@pytest.mark.parametrize("fault", [None, "forward", "backward"], ids=["no-oom", "oom-in-forward", "oom-in-backward"])
def test_cleanup_frees_the_model_after_an_oom_retry(prefect_harness, tmp_path, monkeypatch, fault):
    """Out of memory in packed_sft's first attempt (inside the model's forward, or in backward) is retried with a
    downshift; cleanup must still free the model. An H100 run kept the whole model (846 MiB) after such a retry;
    this is the CPU check of the same path, and cleanup's `survivors` name what holds a model that stays."""
    from transformers.models.llama import modeling_llama

    import slimtune.tasks.load_4bit as load_4bit_mod
    from slimtune.flows.finetune import finetune

    spec = _tiny_spec(tmp_path, max_steps=2)
    spec.train.precision = "bf16"  # as on a GPU: accelerate wraps the model's forward in autocast
    spec.merge.enabled, spec.export.gguf, spec.data.eval_fraction = False, [], 0.0
    # 64-token rows: nothing here depends on the row length, and a CPU bf16 step of 4 rows of 256 tokens took
    # 6-14 s on 2 loaded cores (autocast, NF4 dequantized to bf16 per matmul)
    spec.data.max_seq_length = 64
    models: list[weakref.ref] = []
    keep_layout = load_4bit_mod.keep_training_layout

    def track(model):
        models.append(weakref.ref(model))
        return keep_layout(model)

    fired: list[bool] = []
    layer_forward = modeling_llama.LlamaDecoderLayer.forward

    def oom(*_):
        fired.append(True)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    def forward(self, *args, **kwargs):
        # layer 1, so that layer 0's activations (and their autograd graph) exist when it fails
        first = self.training and not fired and self.self_attn.layer_idx == 1
        if fault == "forward" and first:
            oom()
        out = layer_forward(self, *args, **kwargs)
        if fault == "backward" and first and not getattr(forward, "hooked", False):
            forward.hooked = True
            (out[0] if isinstance(out, tuple) else out).register_hook(oom)
        return out

    monkeypatch.setattr(load_4bit_mod, "keep_training_layout", track)
    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", forward)
    summary = finetune(spec)
    assert bool(fired) == bool(fault)
    assert summary["packed_sft"]["micro_batch_size"] == (2 if fault else 4)
    assert summary["cleanup"]["survivors"] == {}, summary["cleanup"]["survivors"]
    gc.collect()
    assert len(models) == 1 and models[0]() is None
