"""Training: the report and adapter, atomic checkpoints, exact resume (also after a micro-batch downshift)."""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from expert_lora import with_expert_lora
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, TrainerControl, TrainerState

from slimtune.data import load_examples
from slimtune.models.lora_targets import lora_target_modules
from slimtune.models.tiny import DATA_FILE, save_tiny
from slimtune.spec.schema import DataSpec, TrainSpec
from slimtune.train import latest_checkpoint
from slimtune.train.callbacks import PrefectProgressCallback
from slimtune.train.checkpoints import COMPLETE
from slimtune.train.step import enable_checkpointing
from slimtune.train.trainer import train_adapter

CRASH_AT, SAVE_EVERY = 5, 3  # the crash comes after checkpoint-3 and before checkpoint-6


class _Crash(RuntimeError):
    pass


class _CrashAt(TrainerCallback):
    """Raises at the end of optimizer step `step`, like a process dying mid-run."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise _Crash(f"interrupted at step {self.step}")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    # A smaller llama than the builtin (hidden 64, 2 layers) keeps each step to milliseconds.
    return save_tiny(
        tmp_path_factory.mktemp("base"),
        "llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


@pytest.fixture(scope="module")
def tokenizer(base_dir):
    return AutoTokenizer.from_pretrained(base_dir)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> DataSpec:
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    lines = DATA_FILE.read_text(encoding="utf-8").splitlines()[:44]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return DataSpec(path=str(path), max_seq_length=96, eval_fraction=0.1)


@pytest.fixture(scope="module")
def examples(data, tokenizer):
    return load_examples(data, tokenizer)


def _model(base_dir: Path, **load_kw):
    torch.manual_seed(0)  # the LoRA A matrices are random: every run must start from the same ones
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="sdpa", **load_kw)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=targets)
    )


def _train(
    base_dir,
    tokenizer,
    examples,
    data,
    run_dir,
    *,
    mb=2,
    accum=1,
    callbacks=None,
    model=None,
    trackers=None,
    stored_layers=0,
    **spec,
):
    train = TrainSpec(
        **{
            "learning_rate": 5e-3,
            "epochs": 1,
            "warmup_steps": 2,
            "save_steps": SAVE_EVERY,
            "save_total_limit": 2,
            "seed": 0,
            **spec,
        }
    )
    return train_adapter(
        model or _model(base_dir),
        tokenizer,
        examples,
        train,
        data,
        run_dir,
        micro_batch_size=mb,
        gradient_accumulation_steps=accum,
        callbacks=callbacks,
        stored_layers=stored_layers,
        **(trackers or {}),
    )


@pytest.fixture(scope="module")
def full_run(base_dir, tokenizer, examples, data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("full")
    return run_dir, _train(base_dir, tokenizer, examples, data, run_dir)


@pytest.fixture(scope="module")
def crashed_run(base_dir, tokenizer, examples, data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("crashed")
    with pytest.raises(_Crash):
        _train(base_dir, tokenizer, examples, data, run_dir, callbacks=[_CrashAt(CRASH_AT)])
    return run_dir


def _losses(report, after: int) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in report.losses if e["step"] > after]


def test_training_lowers_eval_loss_and_writes_adapter_and_report(full_run, base_dir, examples):
    run_dir, report = full_run
    assert report.steps >= CRASH_AT + 2
    assert [e["step"] for e in report.losses] == list(range(1, report.steps + 1))
    assert report.eval_loss_after < report.eval_loss_before
    assert report.tokens_seen == examples.counts.train_tokens  # one epoch: every train token once
    assert report.packing_efficiency > 0.5 and 0 <= report.padding_waste < 0.5 and report.tokens_per_s > 0
    saved = json.loads((run_dir / "train_report.json").read_text())
    assert saved["eval_loss_after"] == report.eval_loss_after and saved["resumed_from"] is None
    # The adapter loads with peft over the base and changes its output.
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    ids = torch.tensor([examples.eval[0].input_ids])
    with torch.no_grad():
        before = base(ids).logits
        after = PeftModel.from_pretrained(base, run_dir / "adapter")(ids).logits
    assert (after - before).abs().max() > 1e-3
    assert (run_dir / "adapter" / "tokenizer.json").is_file()
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] != []
    assert all((p / COMPLETE).is_file() for p in (run_dir / "checkpoints").iterdir())


def test_resume_after_crash_gives_the_same_losses(full_run, crashed_run, base_dir, tokenizer, examples, data, tmp_path):
    _, full = full_run
    run_dir = tmp_path / "resumed"  # a copy: finishing the crashed run in place would change it for other tests
    shutil.copytree(crashed_run, run_dir)
    assert latest_checkpoint(run_dir / "checkpoints").name == f"checkpoint-{SAVE_EVERY}"
    # Leftovers of a crash during a save: an unmarked checkpoint and a staging folder; both must be ignored.
    (run_dir / "checkpoints" / "checkpoint-6").mkdir()
    (run_dir / "checkpoints" / ".staging" / "checkpoint-6").mkdir(parents=True)
    resumed = _train(base_dir, tokenizer, examples, data, run_dir)
    assert resumed.resumed_from.endswith(f"checkpoint-{SAVE_EVERY}")
    assert not (run_dir / "checkpoints" / ".staging").exists()
    # Same process, same thread count, fp32: the resumed steps are bit-identical to the uninterrupted run.
    assert _losses(resumed, SAVE_EVERY) == _losses(full, SAVE_EVERY)
    assert resumed.eval_loss_before == full.eval_loss_before
    assert resumed.eval_loss_after == full.eval_loss_after
    assert resumed.tokens_seen == full.tokens_seen


def test_stored_layers_train_as_without_checkpointing_and_are_reported(
    full_run, base_dir, tokenizer, examples, data, tmp_path
):
    """Offloaded checkpointing with the last of the 2 layers stored trains the losses of the run without
    checkpointing (full_run), and the report says how many layers kept their activations."""
    _, full = full_run
    model = _model(base_dir)
    with enable_checkpointing(model, "unsloth"):
        report = _train(base_dir, tokenizer, examples, data, tmp_path, model=model, stored_layers=1)
    assert report.stored_layers == 1
    assert json.loads((tmp_path / "train_report.json").read_text())["stored_layers"] == 1
    assert [s for s, _ in _losses(report, 0)] == [s for s, _ in _losses(full, 0)]
    assert [v for _, v in _losses(report, 0)] == pytest.approx([v for _, v in _losses(full, 0)], rel=1e-5)
    assert full.stored_layers == 0


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    moe = dict(num_experts=4, moe_intermediate_size=64)  # the rest as base_dir's llama: milliseconds a step
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    return save_tiny(tmp_path_factory.mktemp("moe"), "qwen3_moe", **shape, **moe)


def _moe_model(moe_dir: Path):
    """What load_4bit and attach_lora make of an MoE: peft on attention, NF4Experts with their own LoRA."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32, attn_implementation="sdpa")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_targets = lora_target_modules("qwen3_moe", targets)
    peft_model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM", target_modules=peft_targets)
    )
    with_expert_lora(model, "qwen3_moe", targets, r=8, alpha=16)
    return peft_model


def test_moe_resume_restores_the_expert_lora(moe_dir, data, tmp_path):
    """Trainer's resume loads peft's layers only; the experts' LoRA comes back from the checkpoint too (without it
    the resumed steps would start from fresh expert LoRA and their losses would differ)."""
    tokenizer = AutoTokenizer.from_pretrained(moe_dir)
    examples = load_examples(data, tokenizer)
    full = _train(moe_dir, tokenizer, examples, data, tmp_path / "full", model=_moe_model(moe_dir))
    run_dir = tmp_path / "crashed"
    with pytest.raises(_Crash):
        _train(moe_dir, tokenizer, examples, data, run_dir, callbacks=[_CrashAt(CRASH_AT)], model=_moe_model(moe_dir))
    resumed = _train(moe_dir, tokenizer, examples, data, run_dir, model=_moe_model(moe_dir))
    assert resumed.resumed_from.endswith(f"checkpoint-{SAVE_EVERY}")
    assert _losses(resumed, SAVE_EVERY) == _losses(full, SAVE_EVERY)
    saved = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    experts = [k for k in saved if ".mlp.experts." in k]
    assert len(experts) == 2 * 4 * 3 * 2  # layers x experts x (gate, up, down) x (A, B)
    assert all(saved[k].abs().max() > 0 for k in experts if ".lora_B." in k)  # trained, not the zero init


def test_resume_with_smaller_micro_batch_after_downshift(
    full_run, crashed_run, base_dir, tokenizer, examples, data, tmp_path
):
    _, full = full_run
    run_dir = tmp_path / "downshift"
    shutil.copytree(crashed_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / f"checkpoint-{SAVE_EVERY * 2}", ignore_errors=True)
    resumed = _train(base_dir, tokenizer, examples, data, run_dir, mb=1, accum=2)
    assert resumed.resumed_from is not None and resumed.micro_batch_size == 1
    got, want = _losses(resumed, SAVE_EVERY), _losses(full, SAVE_EVERY)
    assert [s for s, _ in got] == [s for s, _ in want]
    # Same rows per step, loss normalised over the whole window; only summation order differs (~1e-7).
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in want], abs=1e-5)


def test_changed_settings_do_not_resume_old_checkpoints(full_run, base_dir, tokenizer, examples, data, tmp_path):
    run_dir = tmp_path / "changed"
    shutil.copytree(full_run[0], run_dir)
    report = _train(base_dir, tokenizer, examples, data, run_dir, learning_rate=1e-3, max_steps=2)
    assert report.resumed_from is None and report.steps == 2
    assert (run_dir / "checkpoints.previous").is_dir()


def test_nf4_base_on_cpu_trains(base_dir, tokenizer, examples, data, tmp_path):
    from transformers import BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    model = _model(base_dir, quantization_config=quant)
    assert any(type(m).__name__ == "Linear4bit" for m in model.modules())
    report = _train(base_dir, tokenizer, examples, data, tmp_path / "nf4", model=model, max_steps=3)
    assert report.steps == 3 and all(torch.isfinite(torch.tensor(e["loss"])) for e in report.losses)
    assert (tmp_path / "nf4" / "adapter" / "adapter_model.safetensors").is_file()


def test_prefect_progress_callback_is_a_no_op_outside_prefect():
    callback = PrefectProgressCallback(key="Tiny Run_1")
    state = TrainerState(global_step=1, max_steps=10)
    callback.on_train_begin(None, state, TrainerControl())
    callback.on_step_end(None, state, TrainerControl())
    assert callback.artifact_id is None and callback.key == "tiny-run-1"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "optimizer, expected", [("adamw_torch", "adamw_torch_fused"), ("paged_adamw_8bit", "paged_adamw_8bit")]
)
def test_gpu_training_uses_bf16_and_the_gpu_optimizers(
    base_dir, tokenizer, examples, data, tmp_path, optimizer, expected
):
    model = _model(base_dir).to("cuda")
    report = _train(
        base_dir, tokenizer, examples, data, tmp_path / "gpu", model=model, optimizer=optimizer, learning_rate=1e-2
    )
    precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    assert report.precision == precision and report.optimizer == expected
    assert report.eval_loss_after < report.eval_loss_before


def _recording_progress(monkeypatch, calls: list) -> None:
    """Run the callback as inside a Prefect run, recording what it publishes instead of calling the API."""
    import slimtune.train.callbacks as callbacks

    def publish(key, percent, description, artifact_id=None):
        calls.append((artifact_id, percent, description))
        return "id"

    monkeypatch.setattr(callbacks, "in_run", lambda: True)
    monkeypatch.setattr(callbacks, "publish_progress", publish)


def test_prefect_progress_callback_updates_artifact_in_a_run(monkeypatch):
    calls = []
    _recording_progress(monkeypatch, calls)
    callback = PrefectProgressCallback(key="run", updates=4)
    state = TrainerState(global_step=0, max_steps=8)
    callback.on_train_begin(None, state, TrainerControl())
    for step in range(1, 9):
        state.global_step = step
        callback.on_step_end(None, state, TrainerControl())
    # At most 4 updates: every 25% of the 8 steps, each of the one artifact the first call created.
    assert [(i, p) for i, p, _ in calls] == [(None, 0.0), ("id", 25.0), ("id", 50.0), ("id", 75.0), ("id", 100.0)]


def test_prefect_progress_fills_its_stage_share_and_names_the_stage(monkeypatch):
    """In the flow training is stage 3 of 6: its bar runs from 33.3% to 50% of the run's, and every text says
    so in short lines (the flow-run page's card cuts each line at its width)."""
    calls = []
    _recording_progress(monkeypatch, calls)
    callback = PrefectProgressCallback(key="run", updates=2, title="stage 3 of 6: packed_sft", span=(100 / 3, 50.0))
    state = TrainerState(global_step=0, max_steps=4)
    callback.on_train_begin(None, state, TrainerControl())
    for step in range(1, 5):
        state.global_step = step
        control = TrainerControl(should_log=True)
        callback.on_step_end(None, state, control)
        callback.on_log(None, state, control, logs={"loss": 2.5, "tokens_per_s": 4210.0})
    assert [round(p, 2) for _, p, _ in calls] == [33.33, 41.67, 50.0]
    lines = calls[-1][2].split("\n\n")
    assert lines[0] == "stage 3 of 6: packed_sft" and re.fullmatch(r"step 4/4 · ETA 0s", lines[1]), lines
    assert lines[2] == "loss 2.5000 · 4,210 tok/s"
    assert max(len(line) for _, _, text in calls for line in text.split("\n\n")) <= 40


def test_prefect_progress_updates_stay_within_their_count_when_every_step_logs(monkeypatch):
    """With `logging_steps: 1` Trainer logs after every step's end; the progress artifact still gets at most
    `updates` API calls (evaluations aside), each carrying the figures of the step that made it due."""
    import slimtune.train.callbacks as callbacks

    calls = []
    _recording_progress(monkeypatch, calls)
    monkeypatch.setattr(callbacks.PrefectProgressCallback, "publish_curve", lambda self: None)
    callback = PrefectProgressCallback(key="run", updates=4)
    state = TrainerState(global_step=0, max_steps=8)
    callback.on_train_begin(None, state, TrainerControl())
    calls.clear()
    for step in range(1, 9):
        state.global_step = step
        control = TrainerControl(should_log=True)  # as DefaultFlowCallback sets it, before our on_step_end
        callback.on_step_end(None, state, control)
        callback.on_log(None, state, control, logs={"loss": 10.0 - step, "tokens_per_s": 1000.0 * step})
    assert [p for _, p, _ in calls] == [25.0, 50.0, 75.0, 100.0]
    assert "loss 8.0000" in calls[0][2] and "2,000 tok/s" in calls[0][2]  # step 2's own figures
    assert "loss 2.0000" in calls[-1][2]
    callback.on_log(None, state, TrainerControl(), logs={"eval_loss": 1.5})
    assert len(calls) == 5  # an evaluation updates at once


def test_one_process_trains_on_one_device_even_when_more_gpus_are_visible(base_dir, tmp_path):
    """On a 2-GPU host outside torchrun transformers sets n_gpu=2: that doubled the micro-batch and the loss."""
    from transformers import Trainer

    from slimtune.train.arguments import training_arguments

    args = training_arguments(
        TrainSpec(),
        tmp_path,
        micro_batch_size=3,
        accumulation=1,
        precision="fp32",
        optim="adamw_torch",
        device=torch.device("cpu"),
        has_eval=False,
        bucket_cap_mb=25,
    )
    assert args.device.type == "cpu"
    args._n_gpu = 2  # what TrainingArguments' device setup stores on a host with two visible GPUs
    assert args.n_gpu == 1
    assert args.train_batch_size == 3

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    ids = torch.randint(0, model.config.vocab_size, (3, 16))
    items = torch.tensor(45)  # tokens of the whole accumulation window, as Trainer counts them
    loss = Trainer(model=model, args=args).compute_loss(
        model, {"input_ids": ids, "labels": ids}, num_items_in_batch=items
    )
    expected = model(input_ids=ids, labels=ids, num_items_in_batch=items).loss
    torch.testing.assert_close(loss, expected)  # not 2x: no DataParallel scaling for a one-device run


def test_model_device_is_where_the_trainable_weights_are():
    """host_embedding leaves the first parameter (the embedding table) in host memory: not the run's device."""
    from slimtune.train.options import model_device

    model = torch.nn.Sequential(torch.nn.Embedding(4, 2, device="meta"), torch.nn.Linear(2, 2))
    model[0].weight.requires_grad_(False)
    assert model_device(model).type == "cpu"


def test_a_finished_run_rerun_reuses_its_results_and_says_so(base_dir, tokenizer, examples, data, tmp_path):
    first = _train(base_dir, tokenizer, examples, data, tmp_path, max_steps=4, save_steps=2)
    again = _train(base_dir, tokenizer, examples, data, tmp_path, max_steps=4, save_steps=2)
    assert first.tokens_per_s > 0 and first.reused_from is None and first.finished_at
    assert again.steps == first.steps == 4 and again.resumed_from is not None
    # Nothing was trained the second time: the figures are the first run's, and the report says whose.
    assert again.reused_from == first.finished_at  # outside Prefect there is no flow run id
    assert (again.tokens_per_s, again.padding_waste, again.losses) == (
        first.tokens_per_s,
        first.padding_waste,
        first.losses,
    )
    assert json.loads((tmp_path / "train_report.json").read_text())["reused_from"] == first.finished_at


def test_report_to_writes_tensorboard_events_a_local_mlflow_store_and_an_offline_wandb_run(
    base_dir, tokenizer, examples, data, tmp_path
):
    """The trackers get every step and the final evaluation (MLflow's run used to end before it, leaving the
    base model's step-0 eval loss as the result); MLflow and W&B also get the spec as params and the report and
    the adapter card as artifacts. W&B runs offline: no login, no network."""
    import os

    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from slimtune.spec.schema import PipelineSpec
    from slimtune.train.trackers import tracker_params

    spec = PipelineSpec.model_validate(
        {"name": "run", "lora": {"r": 8, "alpha": 16}, "data": data.model_dump(), "train": {"learning_rate": 5e-3}}
    )
    card = tmp_path / "README.md"

    def describe(report) -> list[Path]:
        card.write_text(f"# adapter\n\n{report.steps} steps\n")
        return [card]

    env_before = dict(os.environ)
    report = _train(
        base_dir,
        tokenizer,
        examples,
        data,
        tmp_path,
        max_steps=3,
        logging_steps=1,
        report_to=["tensorboard", "mlflow", "wandb"],
        trackers={"tracker_params": tracker_params(spec, "float32"), "describe": describe},
    )
    assert dict(os.environ) == env_before  # the tracker settings were scoped to the training call
    final = (3, round(report.eval_loss_after, 5))
    assert report.eval_loss_after != report.eval_loss_before  # the two evaluations are told apart below
    (events,) = {p.parent for p in (tmp_path / "tensorboard").rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert steps == [e["step"] for e in report.losses] == [1, 2, 3]
    assert (acc.Scalars("eval/loss")[-1].step, round(acc.Scalars("eval/loss")[-1].value, 5)) == final
    client = MlflowClient(tracking_uri=f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}")
    (run,) = [r for exp in client.search_experiments() for r in client.search_runs([exp.experiment_id])]
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, round(m.value, 5)) for m in history) == [
        (e["step"], round(e["loss"], 5)) for e in report.losses
    ]
    evals = sorted((m.step, round(m.value, 5)) for m in client.get_metric_history(run.info.run_id, "eval_loss"))
    assert evals == [(0, round(report.eval_loss_before, 5)), final]
    assert round(run.data.metrics["eval_loss"], 5) == final[1]  # the run's eval_loss is the trained model's
    params = run.data.params
    assert (params["lora.r"], params["lora.alpha"], params["data.max_seq_length"]) == ("8", "16.0", "96")
    assert (params["quantization.quant_type"], params["quantization.compute_dtype"]) == ("nf4", "float32")
    assert params["train.learning_rate"] == "0.005"
    assert run.info.status == "FINISHED"
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == ["README.md", "train_report.json"]
    assert {p.name for p in (tmp_path / "mlflow-artifacts").rglob("*.*")} == {"README.md", "train_report.json"}
    assert not Path("mlruns").exists() and not Path("mlflow.db").exists()  # nothing in the working directory
    assert not Path("wandb").exists()

    (wandb_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(_wandb_records(wandb_file))
    kinds = [r.WhichOneof("record_type") for r in records]
    (run_record,) = [r.run for r in records if r.HasField("run")]
    assert run_record.project == "slimtune" and kinds[-1] == "exit"  # finished by `close`, not at exit
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item} for r in records]
    losses = [(h["train/global_step"], round(h["train/loss"], 5)) for h in history if "train/loss" in h]
    assert losses == [(e["step"], round(e["loss"], 5)) for e in report.losses]
    evals = [(h["train/global_step"], round(h["eval/loss"], 5)) for h in history if "eval/loss" in h]
    assert evals == [(0, round(report.eval_loss_before, 5)), final]
    summary = {u.key or "/".join(u.nested_key): json.loads(u.value_json) for r in records for u in r.summary.update}
    assert round(summary["eval/loss"], 5) == final[1]  # the run's result is the trained model's
    config = {u.key: json.loads(u.value_json) for r in records if r.HasField("config") for u in r.config.update}
    assert (config["lora.r"], config["train.learning_rate"], config["quantization.quant_type"]) == ("8", "0.005", "nf4")
    (artifact,) = [r.artifact for r in records if r.HasField("artifact")]
    assert (artifact.type, artifact.name) == ("results", f"results-{run_record.run_id}")
    logged = {entry.path: entry.local_path for entry in artifact.manifest.contents}
    assert logged == {"README.md": str(card), "train_report.json": str(tmp_path / "train_report.json")}


def _wandb_records(path: Path):
    """The records of an offline W&B run file (wandb 0.31 ships no reader of its own): a 7-byte header (":W&B",
    magic, version), then LevelDB's log format (32 KiB blocks of chunks: CRC-32C, length, type; a block's last
    < 7 bytes are padding), each record a serialized `wandb_internal_pb2.Record`."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block, pos, chunks = path.read_bytes(), 32768, 7, []
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the padding at the end of a block
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL, or the LAST of FIRST/MIDDLE/LAST
            record = Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def test_step_lines_progress_and_loss_curve_reach_prefect(
    prefect_harness, base_dir, tokenizer, examples, data, tmp_path
):
    import base64

    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    @task
    def train_task() -> dict:
        report = _train(base_dir, tokenizer, examples, data, tmp_path / "run", max_steps=4, logging_steps=2)
        return {"steps": report.steps}

    @flow
    def train_flow() -> str:
        train_task()
        from prefect.runtime import flow_run

        return flow_run.id

    run_id = train_flow()
    APILogWorker.drain_all(timeout=30)  # the run logger sends its lines in the background
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
        artifacts = [a for a in client.read_artifacts() if str(a.flow_run_id) == run_id]
    steps = [m for m in (log.message for log in logs) if m.startswith("step ")]
    train_lines = [s for s in steps if "eval loss" not in s]
    assert [s.split(" loss")[0] for s in train_lines] == ["step 2/4", "step 4/4"], steps
    assert all("tok/s" in s and "lr " in s and "host RSS" in s for s in train_lines), steps
    assert [s.split(" eval")[0] for s in steps if "eval loss" in s] == ["step 0/4", "step 4/4"], steps
    (progress,) = [a for a in artifacts if a.type == "progress"]
    assert progress.key == "run-progress" and progress.data == 50.0  # training is stage 3 of 6: up to 50%
    description = r"stage 3 of 6: packed_sft\n\nstep 4/4 · ETA 0s\n\nloss \d+\.\d{4} · [\d,]+ tok/s"
    assert re.fullmatch(description, progress.description), progress.description
    # The curve was drawn at least three times (eval before, eval after, train end), always into one artifact.
    (curve,) = [a for a in artifacts if a.key == "run-loss-curve"]
    png = base64.b64decode(re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)\)", curve.data).group(1))
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


class _PlacementProbe(torch.nn.Module):
    """A weightless submodule that counts `.to()` / `.cuda()` calls reaching the model it sits in."""

    def __init__(self) -> None:
        super().__init__()
        self.moves = 0

    def _apply(self, fn, recurse=True):
        self.moves += 1
        return super()._apply(fn, recurse)


def test_training_never_moves_the_model(base_dir, tokenizer, examples, data, tmp_path):
    """The loader placed every weight, `host_embedding` the input table in pinned host memory on purpose.

    accelerate's `prepare` used to call `model.to(device)`, which on a GPU pulled that 0.98 GiB (8B) table
    back onto the device for the whole run. On the CPU the move is a no-op, so a probe counts the calls.
    """
    model = _model(base_dir)
    probe = _PlacementProbe()
    model.base_model.model.model.add_module("placement_probe", probe)
    report = _train(base_dir, tokenizer, examples, data, tmp_path / "run", model=model, max_steps=2)
    assert report.steps == 2
    assert probe.moves == 0


def test_adapter_carries_the_base_tokenizer_byte_for_byte(tmp_path):
    """transformers 5.23's save_pretrained drops `legacy: true` from a Llama-2-style tokenizer_config.json; the
    adapter's tokenizer must still tokenize as the base's (text right after a special token differed)."""
    from slimtune.models.tiny import build_model, build_spm_tokenizer
    from slimtune.train.adapter_io import save_adapter

    base_dir = tmp_path / "base"
    build_spm_tokenizer("llama2").save_pretrained(base_dir)
    base = AutoTokenizer.from_pretrained(base_dir)
    lora = LoraConfig(r=2, target_modules=["q_proj"])
    model = get_peft_model(build_model("llama", len(base), num_hidden_layers=1), lora)
    adapter = save_adapter(model, base, tmp_path / "adapter")
    for p in base_dir.iterdir():
        assert (adapter / p.name).read_bytes() == p.read_bytes(), p.name
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "adapter_config.json").is_file()
    reloaded = AutoTokenizer.from_pretrained(adapter)
    texts = [
        "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>",
        "a<|im_end|>b <|im_start|> c",
        "  two leading spaces\n\n\ttab",
        "café naïve 日本語 🙂",
    ]
    for text in texts:
        assert reloaded(text)["input_ids"] == base(text)["input_ids"], text
