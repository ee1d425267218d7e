"""The pipeline spec: one YAML file, validated by pydantic before any model is loaded.

`PipelineSpec` is also the flow's parameter, so the Prefect UI renders it as a form; every field's
description becomes that form's help. Problems are collected and reported together, one line per
problem naming the field, the bad value and what is allowed (`SpecError`).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from slimtune.core.bounded import NestingError, load_yaml, short_repr
from slimtune.core.gguf_types import GGUF_ALIASES, GGUF_LLAMA_CPP, GGUF_NATIVE
from slimtune.models.families import FAMILIES
from slimtune.models.tiny import BUILTIN_PREFIX, is_builtin

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The flow's six tasks in pipeline order (task names, memory records, report rows).
STAGES = ("load_4bit", "attach_lora", "packed_sft", "cleanup", "dequant_merge", "gguf_convert_and_push")

MAX_CRASH_RESUBMITS = 10
# merge.maximum_memory_usage is in (0, this]: the rest is headroom for the CUDA context, allocator
# fragmentation and other processes. Read by the merge budgets and the merge retry ladder too.
MERGE_MEMORY_USAGE_MAX = 0.95


def _form_schema(schema: dict[str, Any]) -> None:
    """Make a section's JSON schema one that Prefect's run form (3.8) submits unchanged.

    A one-value Literal becomes an enum (a `const` shows as "cannot be changed"). An optional field loses its
    null branch ("Property is type None") and its `default: null`: the form fills every field that has a
    default, and a null then fails the form's own check ("None is not of type 'string'"); a field without
    one is left out of what the form sends, and the server's check admits null for it anyway. An optional
    section (export.push) keeps both, titled "Off": the form shows a choice that starts at Off, instead of a
    half-filled section whose required fields fail ("'repo_id' is a required property").
    """

    def fix(prop: dict[str, Any]) -> dict[str, Any]:
        if "const" in prop:
            prop["enum"] = [prop.pop("const")]
        if "anyOf" not in prop:
            return prop
        branches = [fix(b) for b in prop["anyOf"] if b.get("type") != "null"]
        optional = len(branches) < len(prop["anyOf"])
        if optional and len(branches) == 1 and "$ref" in branches[0]:
            prop["anyOf"] = [branches[0], {"type": "null", "title": "Off"}]
            return prop
        if optional and "default" in prop and prop["default"] is None:
            del prop["default"]
        if len(branches) == 1:
            del prop["anyOf"]
            prop = {**branches[0], **prop}
        else:
            prop["anyOf"] = branches
        return prop

    for name, prop in schema.get("properties", {}).items():
        schema["properties"][name] = fix(prop)


def _pipeline_form_schema(schema: dict[str, Any]) -> None:
    """The run form's schema of the whole spec: `resubmits` is the crash hook's counter, not a setting, so it
    is off the form (which lists `properties` only) but still admitted where the server checks a re-submitted
    run's parameters (`patternProperties` is exempt from `additionalProperties: false`)."""
    _form_schema(schema)
    schema["patternProperties"] = {"^resubmits$": schema["properties"].pop("resubmits")}


class _Section(BaseModel):
    # allow_inf_nan=False: `alpha: .inf` or `max_grad_norm: .nan` passed every bound and trained to NaN
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, allow_inf_nan=False, json_schema_extra=_form_schema
    )

    @field_validator("*", mode="before")
    @classmethod
    def _strict_scalars(cls, v: Any, info: ValidationInfo) -> Any:
        """No silent coercion between booleans and numbers: `lora.r: true` is not rank 1, `resume: 1` is not
        true. (Pydantic's lax mode converts both; strict mode would also refuse the dicts a deployment sends.)"""
        kinds = _kinds(cls.model_fields[info.field_name].annotation)
        if isinstance(v, bool) and bool not in kinds and kinds & {int, float}:
            raise ValueError("must be a number, not true/false")
        if kinds <= {bool, type(None)} and v is not None and not isinstance(v, bool):
            raise ValueError("must be true or false")
        return v


def _kinds(annotation: Any) -> set:
    """The alternatives a field's annotation admits, through Optional and unions (a Literal counts as one)."""
    if get_origin(annotation) is Literal or not get_args(annotation):
        return {annotation}
    return set().union(*(_kinds(a) for a in get_args(annotation)))


class ModelSpec(_Section):
    """The base model and how it is loaded."""

    name_or_path: str = Field(
        f"{BUILTIN_PREFIX}llama",
        description="Hub id (org/name), a local model directory, or one of the locally built test models: "
        + ", ".join(BUILTIN_PREFIX + f for f in FAMILIES)
        + ".",
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) to load.")
    trust_remote_code: bool = Field(
        False,
        description="Run Python code shipped with the model. Off by default: it executes "
        "arbitrary code from the model repository.",
    )
    allow_pickle: bool = Field(
        False,
        description="Allow .bin/.pt (pickle) weights when no safetensors exist; they are then "
        "loaded with weights_only=True.",
    )
    compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="Dtype of the 4-bit layers' matmuls: auto = bf16 where the GPU supports it, "
        "fp16 otherwise, fp32 on CPU.",
    )
    device: str = Field("auto", description="auto (cuda:0 if present, else cpu), cpu, cuda or cuda:N.")
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2", "flex_attention"] = Field(
        "auto", description="Attention kernel; auto = flash_attention_2 when installed, else sdpa."
    )

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()):
            return v
        raise ValueError("must be auto, cpu, cuda or cuda:N (e.g. cuda:0)")

    @field_validator("name_or_path")
    @classmethod
    def _name(cls, v: str) -> str:
        if is_builtin(v):
            if v[len(BUILTIN_PREFIX) :] not in FAMILIES:
                raise ValueError(f"unknown builtin model; use one of {', '.join(BUILTIN_PREFIX + f for f in FAMILIES)}")
            return v
        if Path(v).expanduser().is_dir():
            return v
        if v.startswith((".", "/", "~")) or v.count("/") > 1:
            raise ValueError(
                "local model directory not found; give an existing directory or a Hub id "
                "such as meta-llama/Llama-3.1-8B"
            )
        return v


class LoraSpec(_Section):
    """The LoRA adapter and gradient checkpointing."""

    r: int = Field(16, gt=0, le=1024, description="LoRA rank (> 0).")
    alpha: float = Field(
        16, gt=0, description="LoRA alpha; the update is scaled by alpha / r (alpha / sqrt(r) with rslora)."
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input, in [0, 1).")
    target_modules: Literal["all-linear"] | list[str] = Field(
        default_factory=lambda: list(DEFAULT_TARGETS),
        description="Module names to adapt, or all-linear for every linear layer except the output head.",
        json_schema_extra={"default": DEFAULT_TARGETS},  # the run form starts from the list, not an empty str
    )
    use_rslora: bool = Field(False, description="Rank-stabilised LoRA scaling (alpha / sqrt(r)).")
    bias: Literal["none", "all", "lora_only"] = Field("none", description="Which biases to train.")
    train_embeddings: bool = Field(
        False,
        description="Also train embed_tokens and lm_head (full copies; the frozen originals are offloaded to the CPU).",
    )
    gradient_checkpointing: bool | Literal["unsloth"] = Field(
        "unsloth",
        description="false = none, true = standard recomputation, unsloth = recomputation with "
        "layer inputs offloaded to pinned host memory (least GPU memory).",
    )

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v):
        if isinstance(v, list) and (not v or any(not t.strip() for t in v)):
            raise ValueError("must be a non-empty list of module names (e.g. [q_proj, v_proj]) or all-linear")
        return v


class DataSource(_Section):
    """One file of a data mix (data.sources); unset fields take data's values."""

    path: str = Field(..., description="A local .jsonl/.json/.parquet file or a Hub dataset id, as data.path.")
    weight: float = Field(
        1.0,
        gt=0,
        le=100,
        description="Times each training example of this source is used: 2 = twice, 0.5 = a seeded random half.",
    )
    format: Literal["auto", "messages", "prompt_completion", "text"] | None = Field(
        None, description="Record format of this source (default: data.format)."
    )
    split: str | None = Field(None, description="Split of a Hub dataset (default: data.split).")
    messages_field: str | None = Field(None, description="Default: data.messages_field.")
    prompt_field: str | None = Field(None, description="Default: data.prompt_field.")
    completion_field: str | None = Field(None, description="Default: data.completion_field.")
    text_field: str | None = Field(None, description="Default: data.text_field.")


class DataSpec(_Section):
    """Training data: where it is, its format, and how it is packed."""

    path: str = Field(
        "deployments/data/tiny_chat.jsonl",
        description="A local .jsonl/.json/.parquet file (relative paths are resolved against the spec "
        "file's folder, then the working directory) or a Hub dataset id (needs slimtune[datasets]).",
    )
    split: str = Field("train", description="Split to read from a Hub dataset.")
    format: Literal["auto", "messages", "prompt_completion", "text"] = Field(
        "auto", description="Record format; auto detects it from the first record's fields."
    )
    messages_field: str = Field("messages", description="Field holding chat messages (role/content).")
    prompt_field: str = Field("prompt", description="Field holding the prompt.")
    completion_field: str = Field("completion", description="Field holding the completion.")
    text_field: str = Field("text", description="Field holding plain text.")
    completion_only_loss: bool = Field(
        True,
        description="Train only on assistant/completion tokens (prompt, system and user tokens get "
        "label -100). Plain text always trains on every token.",
    )
    train_reasoning: bool = Field(
        True,
        description="With completion_only_loss, also train an assistant message's reasoning block (its "
        "reasoning_content, or a leading think block in its content) where the chat template renders it "
        "(Qwen3 renders it only after the last user message); false trains the answer alone. Templates "
        "with generation markers train what they mark.",
    )
    max_seq_length: int = Field(512, ge=16, le=262144, description="Tokens per packed row.")
    packing: Literal["packed", "padding_free", "padded"] = Field(
        "packed",
        description="packed = best-fit rows of max_seq_length with per-example positions; "
        "padding_free = one example per row, no padding; padded = classic padded batches.",
    )
    overlong: Literal["truncate", "drop"] = Field(
        "truncate", description="What to do with examples longer than max_seq_length."
    )
    eval_fraction: float = Field(
        0.1, ge=0, lt=0.5, description="Share of examples held out for eval loss, in [0, 0.5)."
    )
    on_bad_record: Literal["error", "skip"] = Field(
        "error", description="error = stop at the first malformed record (file:line:field); skip = skip and count them."
    )
    sources: list[DataSource] | None = Field(
        None,
        min_length=1,
        description="Several data files mixed by weight, used instead of data.path; each is split for eval on "
        "its own and its counts are in the report. The other data settings apply to every source.",
    )

    def files(self) -> list[str]:
        """The data files (or Hub ids) this spec trains on: the sources' paths, else data.path."""
        return [s.path for s in self.sources] if self.sources else [self.path]


class ClusterSpec(_Section):
    """Training on a Ray cluster (several machines): Ray Train's TorchTrainer runs the ranks (`slimtune[ray]`)."""

    model_config = ConfigDict(title="Ray cluster")  # the run form's name for the choice beside "Off"

    engine: Literal["ray"] = Field("ray", description="The distributed engine that gangs the workers: Ray Train.")
    address: str = Field(
        "auto",
        description="The Ray cluster: auto (RAY_ADDRESS, else the cluster started on this machine with "
        "`ray start`), host:port of its head (GCS), or ray://host:port (Ray Client).",
    )
    num_workers: int = Field(2, ge=1, le=1024, description="Training processes (ranks), one per GPU, on any nodes.")
    gpus_per_worker: int = Field(
        1,
        ge=0,
        le=1,
        description="GPUs each worker reserves: 1 (one rank per GPU; 2 nodes of 8 GPUs are num_workers: 16), or "
        "0 for CPU workers (model.device: cpu, gloo; tests).",
    )
    storage_path: str | None = Field(
        None,
        description="Where Ray keeps the run's checkpoints and result (a folder every node and this machine "
        "reach, e.g. NFS, or s3://...); default: the run directory's ray/ folder.",
    )
    max_failures: int = Field(
        2,
        ge=0,
        le=100,
        description="Worker-group restarts after a worker or node dies; each resumes from the last checkpoint.",
    )

    @model_validator(mode="after")
    def _installed(self) -> ClusterSpec:
        if importlib.util.find_spec("ray") is None:
            raise ValueError("train.cluster needs Ray Train: pip install 'slimtune[ray]'")
        return self

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        if v != "auto" and not re.fullmatch(r"(ray://)?[A-Za-z0-9.\-\[\]:]+:\d{1,5}", v):
            raise ValueError(f"{v!r} is not auto, host:port or ray://host:port")
        return v


class TrainSpec(_Section):
    """The training loop."""

    micro_batch_size: int | Literal["auto"] = Field(
        4,
        description="Packed rows per forward pass (1-4096), or auto: the largest divisor of "
        "effective_batch_size whose calibrated estimate fits the GPU budget, the rest as accumulation; with "
        "stored_layers auto on one GPU, at most the first divisor of 8192 tokens or more (the GPU is busy from "
        "there), the rest of the budget going to stored layers.",
    )
    effective_batch_size: int = Field(
        16, gt=0, le=65536, description="Rows per optimizer step when micro_batch_size is auto (else unused)."
    )
    gradient_accumulation_steps: int = Field(1, gt=0, le=65536, description="Micro-batches per optimizer step (> 0).")
    learning_rate: float = Field(2e-4, gt=0, le=1, description="Peak learning rate, in (0, 1].")
    lr_scheduler: Literal["linear", "cosine", "constant"] = Field("cosine", description="Decay after warmup.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    max_steps: int | None = Field(None, gt=0, description="Optimizer steps; overrides epochs when set.")
    epochs: float = Field(1.0, gt=0, le=1000, description="Passes over the training data.")
    optimizer: Literal["adamw_torch", "adamw_torch_fused", "paged_adamw_8bit"] = Field(
        "adamw_torch",
        description="adamw_torch_fused is faster on GPU; paged_adamw_8bit uses least memory (bitsandbytes).",
    )
    weight_decay: float = Field(0.0, ge=0, lt=1, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping norm; 0 disables.")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="Autocast dtype: auto = bf16 where supported, fp16 otherwise, fp32 on CPU."
    )
    seed: int = Field(
        0, ge=0, le=2**32 - 1, description="Seed for init, dropout and data order, in [0, 2^32) (numpy's range)."
    )
    logging_steps: int = Field(1, gt=0, description="Log every N steps.")
    eval_steps: int | None = Field(None, gt=0, description="Eval loss every N steps (None: at the end).")
    save_steps: int = Field(50, gt=0, description="Checkpoint every N steps.")
    save_total_limit: int = Field(2, gt=0, description="Checkpoints to keep.")
    empty_cache_steps: int | None = Field(None, gt=0, description="Clear the device cache every N steps.")
    resume: bool = Field(True, description="Resume from the latest complete checkpoint of this run.")
    kernels: Literal["auto", "off"] | list[str] = Field(
        "auto", description="Triton kernels: auto (what the GPU and family support), off, or a list of kernel names."
    )
    cuda_graphs: bool = Field(
        True,
        description='Replay each decoder layer\'s backward as a CUDA graph (one CUDA GPU, "unsloth" checkpointing, '
        "no dropout): one launch per layer where the host issued ~150; 1B at batch 1 on an H100 trains ~2x faster. "
        "Used only where the memory estimate with them fits the budget, and off on a retry after out-of-memory.",
    )
    stored_layers: int | Literal["auto"] = Field(
        "auto",
        description="Under gradient checkpointing, how many decoder layers (the last ones) keep their activations "
        "for the backward instead of recomputing them: each one saves a layer's recompute per step and costs its "
        "activations in GPU memory. auto: as many as the GPU budget holds after the micro-batch and CUDA graphs "
        "(one CUDA GPU; 0 on the CPU, on several GPUs and on a retry after out-of-memory); 0: every layer "
        "recomputes (least memory).",
    )
    num_gpus: int = Field(1, ge=1, le=64, description="Data-parallel GPUs on this host (torchrun).")
    cluster: ClusterSpec | None = Field(
        None,
        description="Train on a Ray cluster instead of this host (several machines): the ranks are Ray workers. "
        "Load, merge and GGUF stay on this machine.",
    )
    parallelism: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="How num_gpus > 1 share the model: ddp = a whole NF4 copy per GPU, only LoRA gradients "
        "exchanged (fastest when the model fits one GPU); fsdp = FSDP-QLoRA, each GPU holds 1/num_gpus of "
        "the NF4 weights (stored in the compute dtype so FSDP can shard them), for models one GPU cannot hold.",
    )
    report_to: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=list,
        description="Experiment trackers, offline: tensorboard (events in the run directory), mlflow (a SQLite "
        "store, mlflow.db in the run directory, unless MLFLOW_TRACKING_URI is set), wandb (offline unless "
        "WANDB_MODE is set).",
    )

    @property
    def world_size(self) -> int:
        """How many ranks train: the Ray workers of `cluster`, else `num_gpus` torchrun ranks on this host."""
        return self.cluster.num_workers if self.cluster else self.num_gpus

    @property
    def sharded(self) -> bool:
        """FSDP-QLoRA: `parallelism: fsdp` on more than one rank (one rank trains unsharded whatever it says)."""
        return self.world_size > 1 and self.parallelism == "fsdp"

    @model_validator(mode="after")
    def _cluster(self) -> TrainSpec:
        if self.cluster and self.num_gpus > 1:
            raise ValueError(
                f"train.num_gpus is {self.num_gpus} with train.cluster: on a cluster the ranks are "
                f"train.cluster.num_workers ({self.cluster.num_workers}); remove train.num_gpus"
            )
        if self.cluster and self.micro_batch_size == "auto":
            raise ValueError(
                "train.micro_batch_size auto with train.cluster: auto measures this machine's GPU, not the "
                "cluster's; set a number (slimtune plan on a machine with the workers' GPU shows what fits)"
            )
        return self

    @model_validator(mode="after")
    def _fsdp(self) -> TrainSpec:
        if self.parallelism == "fsdp" and self.optimizer == "paged_adamw_8bit":
            # peft's FSDP guide: with FSDP+QLoRA, paged_adamw_8bit fails when a checkpoint is saved.
            raise ValueError(
                "train.parallelism fsdp with train.optimizer paged_adamw_8bit fails at the first checkpoint "
                "(bitsandbytes' paged state under FSDP); use adamw_torch or adamw_torch_fused"
            )
        return self

    @field_validator("micro_batch_size")
    @classmethod
    def _micro_batch(cls, v: int | str) -> int | str:
        if v != "auto" and not 0 < v <= 4096:
            raise ValueError(f"micro_batch_size is {v}: it must be greater than 0 and at most 4096, or auto")
        return v

    @model_validator(mode="after")
    def _stored_layers(self) -> TrainSpec:
        v = self.stored_layers
        if v != "auto" and v < 0:
            raise ValueError(f"train.stored_layers is {v}: it must be 0 or more (at most the model's layers), or auto")
        if v not in ("auto", 0) and self.world_size > 1:
            raise ValueError(
                f"train.stored_layers is {v} with {self.world_size} ranks: layers keep their activations "
                "on one GPU only (every rank recomputes each layer); use auto or 0"
            )
        return self

    @field_validator("kernels")
    @classmethod
    def _kernels(cls, v: str | list[str]) -> str | list[str]:
        from slimtune.models.families import KERNEL_NAMES

        unknown = [] if isinstance(v, str) else [k for k in v if k not in KERNEL_NAMES]
        if unknown:
            raise ValueError(f"unknown kernel(s) {unknown}; use auto, off or names from {list(KERNEL_NAMES)}")
        return v


class MergeSpec(_Section):
    """Merging the adapter into 16-bit weights."""

    enabled: bool = Field(True, description="Write a merged 16-bit model (needed for GGUF).")
    source: Literal["auto", "dequantized", "original"] = Field(
        "auto",
        description="original = add the delta to the base's 16-bit shards; dequantized = to the "
        "NF4 weights training saw; auto = original when 16-bit shards exist.",
    )
    maximum_memory_usage: float = Field(
        0.9,
        gt=0,
        le=MERGE_MEMORY_USAGE_MAX,
        description="Fraction of free GPU (and available host) memory the merge may "
        "use, in (0, 0.95]. Lower it if the merge runs out of memory.",
    )
    temporary_location: str | None = Field(
        None,
        description="Folder for tensors spilled to disk when host memory runs short (default: "
        "inside the run directory).",
    )
    output_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Dtype of the merged weights; auto = the base checkpoint's dtype."
    )
    max_shard_size_gb: float = Field(
        2.0,
        ge=0.001,
        description="Largest safetensors shard, in GB; at least 0.001 (1 MB): below a byte the merge had no size "
        "to fill (it rounded to 0), and below 1 MB every tensor is a file of its own.",
    )


class PushSpec(_Section):
    """Where the GGUF files go on the Hugging Face Hub (token from HF_TOKEN or a Prefect Secret)."""

    model_config = ConfigDict(title="Push to the Hub")  # the run form's name for the choice beside "Off"

    repo_id: str = Field(..., description="Target repository, org/name.")
    private: bool = Field(True, description="Create the repository private.")
    revision: str | None = Field(None, description="Branch to commit to (default: main).")
    include_adapter: bool = Field(False, description="Also upload the LoRA adapter.")
    include_merged: bool = Field(False, description="Also upload the merged 16-bit model.")

    @field_validator("repo_id")
    @classmethod
    def _repo(cls, v: str) -> str:
        parts = v.split("/")
        if len(parts) != 2 or not all(parts):
            raise ValueError("must be of the form org/name")
        return v


class ExportSpec(_Section):
    """GGUF conversion, verification and publishing."""

    gguf: list[str] = Field(
        default_factory=lambda: ["f16"],
        description="GGUF types to write: "
        + ", ".join(GGUF_NATIVE + GGUF_LLAMA_CPP)
        + ", or the aliases "
        + ", ".join(GGUF_ALIASES)
        + ". Empty: no GGUF.",
    )
    verify: bool = Field(True, description="Load every GGUF and compare it with the merged model.")
    split_max_size_gb: float | None = Field(None, gt=0, description="Split GGUF files larger than this.")
    push: PushSpec | None = Field(
        None, description="Push to the Hub; leave it unset (Off on the run form) to keep the files local."
    )
    gguf_tokenizer: Literal["exact", "as_is"] = Field(
        "exact",
        description="exact: validate and run refuse, before the model loads, a tokenizer that llama.cpp would "
        "tokenize differently from Hugging Face (so no run trains for a GGUF it cannot write). as_is: write the "
        "closest llama.cpp vocabulary anyway; the report records the mismatch rate measured in llama.cpp.",
    )
    adapter_gguf: bool = Field(
        False,
        # {name}, not <name>: the run form renders help as Markdown, where <name> is an HTML tag and vanishes
        description="Also write the LoRA adapter as a llama.cpp LoRA GGUF (gguf/{name}-lora.gguf, {name} = the run "
        "name), to load on the base model's GGUF (llama.cpp --lora); verified against the merged GGUF when "
        "export.verify.",
    )
    license: str | None = Field(
        None,
        description="License id for the model cards (e.g. apache-2.0) when the base model's own card names none.",
    )

    @field_validator("gguf")
    @classmethod
    def _types(cls, v: list[str]) -> list[str]:
        out, bad = [], []
        for name in v:
            canon = GGUF_ALIASES.get(name.lower(), name.lower())
            (out if canon in GGUF_NATIVE + GGUF_LLAMA_CPP else bad).append(canon)
        if bad:
            raise ValueError(
                f"unknown GGUF type(s) {bad}; use {', '.join(GGUF_NATIVE + GGUF_LLAMA_CPP)} "
                f"or {', '.join(GGUF_ALIASES)}"
            )
        missing = [m for m in out if m in GGUF_LLAMA_CPP]
        if missing and importlib.util.find_spec("llama_cpp") is None:
            raise ValueError(
                f"{missing} need llama.cpp's quantizer; install it with "
                "pip install 'slimtune[llama-cpp]' or choose f16/bf16/q8_0/q4_0/q5_0"
            )
        return list(dict.fromkeys(out))


class EvalSpec(_Section):
    """Evaluation beyond the eval loss: the base and the fine-tuned model's answers side by side."""

    prompts: list[str] = Field(
        default_factory=list,
        description="Prompts both models answer greedily after the merge (a user turn when the tokenizer has "
        "a chat template); the run report shows the answers side by side.",
    )
    max_new_tokens: int = Field(64, gt=0, le=4096, description="Tokens generated per answer.")


class GuardSpec(_Section):
    """The memory guard around every task."""

    enabled: bool = Field(True, description="Check estimates, watch peaks and turn OOM into retries.")
    max_retries: int = Field(3, ge=0, le=10, description="Retries after out-of-memory, each downshifted.")
    gpu_memory_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Hold this run to this fraction of the GPU, device-wide (CUDA context and "
        "libraries included, so a budget is a card size): it fails inside its budget instead of "
        "starving other processes.",
    )
    preflight: bool = Field(True, description="Fail before allocating when the estimate exceeds what is free.")
    max_crash_resubmits: int = Field(
        2,
        ge=0,
        le=MAX_CRASH_RESUBMITS,
        description="Times a run killed by the host (e.g. the OOM killer) is re-submitted, downshifted.",
    )


class PoolsSpec(_Section):
    """Which work pool runs which stages, for a flow run started from a deployment (docs/deployments.md)."""

    export: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$",
        description="Work pool for dequant_merge and gguf_convert_and_push (e.g. cpu-hosts: host memory and "
        "disk as `slimtune plan` shows): the run hands them to the deployment finetune-export/ + this name; the "
        "run directory must be on a filesystem both pools mount. None: in the training process.",
    )


class PipelineSpec(_Section):
    """One fine-tuning run: base model -> LoRA training -> merged model -> GGUF."""

    model_config = ConfigDict(json_schema_extra=_pipeline_form_schema)

    name: str = Field(
        "tiny",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="Run name: letters, digits, '.', '_' or '-'; names the run directory.",
    )
    output_dir: str = Field("runs", description="Folder that holds the run directory.")
    model: ModelSpec = Field(default_factory=ModelSpec)
    lora: LoraSpec = Field(default_factory=LoraSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    merge: MergeSpec = Field(default_factory=MergeSpec)
    export: ExportSpec = Field(default_factory=ExportSpec)
    guard: GuardSpec = Field(default_factory=GuardSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    pools: PoolsSpec = Field(default_factory=PoolsSpec)
    resubmits: int = Field(0, ge=0, description="Set by the crash hook: how often this run was re-submitted.")

    @model_validator(mode="after")
    def _combinations(self) -> PipelineSpec:
        if self.export.gguf and not self.merge.enabled:
            raise ValueError(
                "export.gguf needs merge.enabled: true (GGUF is converted from the merged "
                "model); set export.gguf: [] to skip GGUF"
            )
        if (self.eval.prompts or self.export.adapter_gguf) and not self.merge.enabled:
            raise ValueError(
                "eval.prompts and export.adapter_gguf need merge.enabled: true (they compare with the merged "
                "model); enable the merge or remove them"
            )
        cluster = self.train.cluster
        if cluster and (self.model.device == "cpu") != (cluster.gpus_per_worker == 0):
            raise ValueError(
                f"train.cluster.gpus_per_worker {cluster.gpus_per_worker} with model.device {self.model.device}: "
                "CPU workers (gpus_per_worker: 0) go with model.device: cpu, GPU workers (1) with auto"
            )
        if cluster and self.model.device.startswith("cuda:"):
            raise ValueError(
                f"model.device {self.model.device} with train.cluster: Ray gives each worker its GPU; "
                "set model.device: auto"
            )
        if self.train.precision == "fp16" and self.model.compute_dtype == "bfloat16":
            raise ValueError(
                "train.precision fp16 with model.compute_dtype bfloat16 mixes dtypes; use "
                "bf16 for both or fp16 for both"
            )
        return self

    def run_dir(self) -> Path:
        """The folder that holds this run's adapter, checkpoints, merged model, GGUF and report."""
        return Path(self.output_dir).expanduser() / self.name


class SpecError(ValueError):
    """A spec that cannot run: one line per problem, each naming the field and the fix."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        head = f"invalid spec{f' {source}' if source else ''}: {len(problems)} problem(s)"
        shown = [f"  - {p}" for p in problems[:_SHOWN_PROBLEMS]]  # a 5,000-item list gives 5,000 problems
        more = [f"  - … and {len(problems) - _SHOWN_PROBLEMS} more"] if len(problems) > _SHOWN_PROBLEMS else []
        super().__init__("\n".join([head, *shown, *more]))


_SHOWN_PROBLEMS = 20


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The spec section behind a field's annotation (also through Optional), else None."""
    candidates = [annotation, *getattr(annotation, "__args__", ())]
    found = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    if found is None:  # the items of a list of sections (data.sources), also inside Optional
        found = next((m for c in candidates[1:] if getattr(c, "__args__", None) and (m := _submodel(c))), None)
    return found


def _field_path(loc: tuple) -> str:
    """The user-facing field path of an error location, without pydantic's union-branch tags."""
    parts, model = [], PipelineSpec
    for part in loc:
        if isinstance(part, int):  # a list index: the items are of the same section
            parts.append(str(part))
        elif model is not None and part in model.model_fields:
            parts.append(part)
            model = _submodel(model.model_fields[part].annotation)
        elif model is not None:  # a key the section does not have (extra="forbid")
            parts.append(str(part))
            model = None
        # anything else is a union-branch tag such as "literal['unsloth']"
    return ".".join(parts) or "(top level)"


def _describe(errors: list[dict[str, Any]]) -> list[str]:
    """One line per field: union fields report every alternative in one line."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for err in errors:
        grouped.setdefault(_field_path(err["loc"]), []).append(err)
    lines = []
    for loc, errs in grouped.items():
        kinds = {e["type"] for e in errs}
        if "extra_forbidden" in kinds:
            lines.append(f"{loc}: unknown key; remove it or check its spelling")
            continue
        if "missing" in kinds:
            lines.append(f"{loc}: required field is missing")
            continue
        value = errs[0].get("input")
        shown = short_repr(value)  # bounded: a value can be an expanded alias bomb or a 1 MB string
        shown = shown if len(shown) < 60 else type(value).__name__
        msgs = list(dict.fromkeys(e["msg"].removeprefix("Value error, ") for e in errs))
        lines.append(f"{loc}: got {shown}; " + " or ".join(msgs))
    return lines


def parse_spec(data: dict[str, Any], *, base_dir: Path | None = None, source: str | None = None) -> PipelineSpec:
    """Validate a spec dict; relative data/output paths are resolved against `base_dir` when they exist there."""
    if not isinstance(data, dict):
        raise SpecError([f"the spec must be a mapping of sections, got {type(data).__name__}"], source)
    try:
        spec = PipelineSpec.model_validate(data)
    except ValidationError as e:
        problems = _describe(e.errors())
        raw_path = (data.get("data") or {}).get("path") if isinstance(data.get("data"), dict) else None
        if isinstance(raw_path, str) and not any(p.startswith("data.path") for p in problems):
            problems += _check_paths(PipelineSpec(data=DataSpec(path=raw_path)), base_dir)
        raise SpecError(problems, source) from None
    problems = _check_paths(spec, base_dir)
    if problems:
        raise SpecError(problems, source)
    return spec


def _check_paths(spec: PipelineSpec, base_dir: Path | None) -> list[str]:
    """Resolve and check local paths; relative paths are relative to the spec file's folder.

    They cannot be checked field by field: where they point depends on the folder of the spec file.
    """
    problems = []
    if spec.data.sources:  # data.path is not read when sources are given
        for i, source in enumerate(spec.data.sources):
            source.path = _resolve_data_path(f"data.sources.{i}.path", source.path, base_dir, problems)
    else:
        spec.data.path = _resolve_data_path("data.path", spec.data.path, base_dir, problems)
    if base_dir is not None and not Path(spec.output_dir).expanduser().is_absolute():
        spec.output_dir = str((base_dir / spec.output_dir).resolve())
    if spec.merge.temporary_location is not None:
        tmp = Path(spec.merge.temporary_location).expanduser()
        if tmp.exists() and not tmp.is_dir():
            problems.append(f"merge.temporary_location: got {short_repr(str(tmp))}; exists and is not a directory")
    return problems


def _resolve_data_path(field: str, value: str, base_dir: Path | None, problems: list[str]) -> str:
    """A data file's absolute path (relative to the spec's folder first), or `value` with a problem added."""
    try:
        return _resolve_existing(field, value, base_dir, problems)
    except OSError as e:  # a name longer than the file system allows (ENAMETOOLONG), a path through a file
        problems.append(f"{field}: got {short_repr(value)}; not a usable path ({e.strerror}); give a data file")
        return value


def _resolve_existing(field: str, value: str, base_dir: Path | None, problems: list[str]) -> str:
    data_path = Path(value).expanduser()
    local_suffix = data_path.suffix.lower() in (".jsonl", ".json", ".parquet")
    if not data_path.is_absolute() and base_dir is not None and (base_dir / data_path).exists():
        value = str((base_dir / data_path).resolve())
    elif data_path.exists():
        value = str(data_path.resolve())
    elif local_suffix or value.startswith((".", "/", "~")):
        problems.append(
            f"{field}: got {short_repr(value)}; file not found (looked in "
            f"{base_dir or Path.cwd()} and {Path.cwd()}); give an existing .jsonl/.json/.parquet file"
        )
    elif importlib.util.find_spec("datasets") is None:
        problems.append(
            f"{field}: got {short_repr(value)}; not a local file, and Hub datasets need the "
            "datasets extra: pip install 'slimtune[datasets]'"
        )
    if Path(value).is_dir():
        problems.append(f"{field}: got {short_repr(value)}; is a directory; give a data file")
    return value


def recheck_paths(spec: PipelineSpec) -> PipelineSpec:
    """Check the paths of a spec that arrived without a file (a deployment, the UI form) from the cwd."""
    spec = spec.model_copy(deep=True)
    problems = _check_paths(spec, None)
    if problems:
        raise SpecError(problems)
    return spec


def load_spec(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> PipelineSpec:
    """Read and validate a YAML spec file, with `--set a.b=value` overrides applied (slimtune.spec.overrides)."""
    path = Path(path)
    if not path.is_file():
        raise SpecError([f"spec file {str(path)!r} not found"])
    try:
        data = load_yaml(path.read_text(encoding="utf-8"), _UniqueKeyLoader)
    except NestingError as e:  # an alias bomb is refused before it expands (slimtune.core.bounded)
        raise SpecError([f"{path.name}: {e}"], str(path)) from None
    except UnicodeDecodeError as e:
        raise SpecError(
            [f"not UTF-8 text (byte {e.start}: {e.object[e.start : e.start + 1]!r}); save it as UTF-8"], str(path)
        ) from None
    except yaml.YAMLError as e:
        where = " ".join(str(e).split()).replace('"<unicode string>"', path.name)
        raise SpecError([f"not valid YAML: {where}"], str(path)) from None
    if data is None:
        # An empty spec is refused rather than run with every default: the defaults name a tiny test model and
        # data, and a blank file is far more often a mistake (wrong file, unsaved editor) than a request for that.
        raise SpecError(
            ["the spec is empty; give at least model.name_or_path and data.path (see deployments/tiny.yaml)"], str(path)
        )
    if overrides and isinstance(data, dict):  # a non-mapping is reported by parse_spec
        from slimtune.spec.overrides import apply_overrides

        data = apply_overrides(data, list(overrides))
    return parse_spec(data, base_dir=path.resolve().parent, source=str(path))


class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last one silently, so a
    second `lora:` section replaced the first whole)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges are allowed to repeat keys
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {short_repr(key)} appears twice (lines {seen[key]} and {line}); keep one",
                    key_node.start_mark,
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)
