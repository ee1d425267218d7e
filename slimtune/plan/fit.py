"""`slimtune plan SPEC`: will this run fit my card? Estimates per stage before anything is loaded.

Reads only the model's config.json (a local folder, a built-in tiny model, or that one file from the Hub)
and counts the data records; imports no model code. The estimates are the calibrated ones the guard's
preflight uses (`slimtune.memory.estimate`, held to GPU measurements by tests/test_memory_calibration.py),
so the verdicts here are the preflight's verdicts.

GPU budget: `gpu_total` is the card's whole memory (device-wide: the CUDA context counts). With
`guard.gpu_memory_fraction` the run holds that share of the card, context included, as the guard
enforces it: a budget is a card size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slimtune.memory.estimate import estimate_export, estimate_load_4bit, estimate_merge, estimate_train
from slimtune.memory.stage_estimate import Estimate
from slimtune.models.multimodal import copied_bytes, layout_of, trained_config
from slimtune.models.source import config_dtype
from slimtune.plan.micro_batch import largest_micro_batch, micro_batch_candidates
from slimtune.spec.schema import PipelineSpec

_GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Optimizer state per trainable parameter: AdamW's two float32 moments, or two 8-bit ones.
_OPTIMIZER_BYTES = {"adamw_torch": 8, "adamw_torch_fused": 8, "paged_adamw_8bit": 2}
_SEQ_STEP = 256  # sequence lengths the planner tries are multiples of this


@dataclass(frozen=True)
class Budget:
    """What the run may use: the card's memory, the run's device-wide share of it, host memory (bytes)."""

    gpu_total: int | None
    gpu_fraction: float | None
    host: int | None

    def card_bytes(self) -> int | None:
        """The run's share of the card (all of it without a fraction); None without a GPU budget."""
        return None if self.gpu_total is None else int(self.gpu_total * (self.gpu_fraction or 1.0))

    def gpu_fits(self, est: Estimate) -> bool | None:
        """None when there is no GPU budget to compare with."""
        card = self.card_bytes()
        return None if card is None else est.gpu_bytes <= card

    def gpu_runs(self, est: Estimate) -> bool | None:
        """Whether the guard lets `est` run on the card, a tight fit included (`Estimate.runs_in`); None when there is
        no GPU budget."""
        card = self.card_bytes()
        return None if card is None else est.runs_in(card)

    def host_fits(self, est: Estimate) -> bool | None:
        return None if self.host is None else est.host_bytes <= self.host


@dataclass(frozen=True)
class StagePlan:
    stage: str
    estimate: Estimate
    gpu_fits: bool | None
    host_fits: bool | None
    gpu_runs: bool | None = None  # fits, or a tight fit the guard lets run (`Budget.gpu_runs`)


def model_config(spec: PipelineSpec) -> dict:
    """config.json of the spec's model, without downloading weights."""
    from slimtune.models.source import local_model_dir, read_config
    from slimtune.models.tiny import is_builtin

    path = Path(spec.model.name_or_path).expanduser()
    if path.is_dir():
        return read_config(path)
    if is_builtin(spec.model.name_or_path):
        return read_config(local_model_dir(spec.model))
    from huggingface_hub import hf_hub_download

    from slimtune.models.source import ModelSourceError

    try:
        config_file = hf_hub_download(spec.model.name_or_path, "config.json", revision=spec.model.revision)
    except Exception as e:  # offline, gated, missing: one line, not huggingface_hub's traceback
        raise ModelSourceError(
            f"model.name_or_path: cannot read config.json of {spec.model.name_or_path!r} from the Hub "
            f"({type(e).__name__}); give a local model directory, or plan where the Hub can be reached"
        ) from None
    return json.loads(Path(config_file).read_text())


def stored_tensor_bytes(spec: PipelineSpec) -> dict[str, int]:
    """Each tensor the spec's model stores -> its bytes, from the safetensors headers alone (a Hub model's are read
    remotely by range requests, ~100 KB, never its weights): what the merge's copied weights are counted from."""
    from slimtune.models.source import ModelSourceError, local_model_dir
    from slimtune.models.tiny import is_builtin

    path = Path(spec.model.name_or_path).expanduser()
    if path.is_dir() or is_builtin(spec.model.name_or_path):
        from slimtune.merge.safetensors_io import checkpoint_shards, read_entries

        folder = path if path.is_dir() else local_model_dir(spec.model)
        return {e.name: e.nbytes for shard in checkpoint_shards(folder) for e in read_entries(shard)}
    from huggingface_hub import get_safetensors_metadata

    try:
        meta = get_safetensors_metadata(spec.model.name_or_path, revision=spec.model.revision)
    except Exception as e:  # offline, gated, no safetensors: one line, as for config.json
        raise ModelSourceError(
            f"model.name_or_path: cannot read the safetensors headers of {spec.model.name_or_path!r} from the Hub "
            f"({type(e).__name__}); give a local model directory, or plan where the Hub can be reached"
        ) from None
    return {
        name: info.data_offsets[1] - info.data_offsets[0]
        for file in meta.files_metadata.values()
        for name, info in file.tensors.items()
    }


def detected_gpu_total(gpu_total: int | None) -> int | None:
    """The given card memory, else this machine's GPU (device 0), else None (no GPU: no GPU budget)."""
    if gpu_total is None:
        import torch

        if torch.cuda.is_available():
            gpu_total = torch.cuda.mem_get_info()[1]
    return gpu_total


def detected_budget(spec: PipelineSpec, gpu_total: int | None, host: int | None) -> Budget:
    """The given budgets, else this machine's GPU (device 0) and available host memory; no GPU for a CPU spec."""
    if spec.model.device == "cpu":
        gpu_total = None
    elif gpu_total is None:
        gpu_total = detected_gpu_total(None)
    if host is None:
        import psutil

        host = psutil.virtual_memory().available
    return Budget(gpu_total, spec.guard.gpu_memory_fraction, host)


def train_estimate(
    spec: PipelineSpec,
    cfg: dict,
    micro_batch: int,
    checkpointing: bool | str,
    device_type: str,
    cuda_graphs: bool = False,
    stored_layers: int = 0,
    head_on_host: bool = False,
) -> Estimate:
    """The packed_sft estimate for `spec` at `micro_batch`: with the kernels the run will apply and the
    optimizer it uses (`resolve_train`'s estimate, and the planner's searches). `device_type`
    may be one this machine lacks (the planner's "cuda": 16-bit compute unless the spec says float32).
    `cuda_graphs` adds what graphs of the layers' backward hold, `stored_layers` the activations of the layers
    that are not recomputed; both are extras that packed_sft uses only where they fit, so what fits is decided
    without them. `head_on_host`: the lm_head streamed from host memory (`train_settings.head_on_host`)."""
    # Imported here: the planner reads configs without loading torch's model code until it estimates.
    from slimtune.plan.train_settings import rank_checkpointing, run_kernels
    from slimtune.train.step.attention import varlen_expected

    # "auto" compute dtype: bf16 or fp16 on a GPU, fp32 on the CPU (`slimtune.core.device.resolve_compute_dtype`)
    dtype_bytes = DTYPE_BYTES.get(spec.model.compute_dtype, 2 if device_type == "cuda" else 4)
    return estimate_train(
        cfg,
        micro_batch=micro_batch,
        seq_len=spec.data.max_seq_length,
        lora_r=spec.lora.r,
        target_modules=spec.lora.target_modules,
        checkpointing=rank_checkpointing(spec.train, checkpointing),
        optimizer_bytes_per_param=_OPTIMIZER_BYTES.get(spec.train.optimizer, 8),
        kernels=run_kernels(spec.train, device_type, cfg.get("model_type"), head_on_host),
        compute_dtype_bytes=dtype_bytes,
        on_gpu=device_type == "cuda",
        shard_ranks=spec.train.world_size if spec.train.sharded else 1,  # per rank
        varlen_attention=varlen_expected(cfg, device_type, spec.data.packing),
        cuda_graphs=cuda_graphs,
        stored_layers=stored_layers,
    )


def _device_type(spec: PipelineSpec, budget: Budget) -> str:
    """With a GPU budget the plan is for a GPU, whether or not this machine has one."""
    return "cuda" if budget.gpu_total is not None and spec.model.device != "cpu" else "cpu"


def largest_running_micro_batch(spec: PipelineSpec, cfg: dict, budget: Budget) -> int | None:
    """The largest of `micro_batch_candidates(spec.train)` whose packed_sft estimate runs on the GPU budget, a tight
    fit included (as `auto` chooses); None without a GPU budget or when none runs. `slimtune plan` reports it and
    `slimtune init` proposes it."""
    if budget.gpu_total is None:
        return None
    device_type, ckpt = _device_type(spec, budget), spec.lora.gradient_checkpointing
    host = _head_on_host(spec, cfg, device_type, budget)
    return largest_micro_batch(
        lambda mb: budget.gpu_runs(train_estimate(spec, cfg, mb, ckpt, device_type, head_on_host=host)),
        micro_batch_candidates(spec.train),
    )


def _head_on_host(spec: PipelineSpec, cfg: dict, device_type: str, budget: Budget) -> bool:
    from slimtune.plan.train_settings import head_on_host  # a cycle at import time: train_settings imports this module

    return head_on_host(spec, cfg, device_type, budget.card_bytes() if device_type == "cuda" else None)


def _largest_seq(spec: PipelineSpec, cfg: dict, budget: Budget, micro_batch: int, device_type: str) -> int | None:
    limit = int(cfg.get("max_position_embeddings") or 131072)
    lo, hi = 0, limit // _SEQ_STEP
    while lo < hi:  # largest k with seq = k * step fitting; the estimate grows with seq
        mid = (lo + hi + 1) // 2
        s = spec.model_copy(update={"data": spec.data.model_copy(update={"max_seq_length": mid * _SEQ_STEP})})
        host = _head_on_host(s, cfg, device_type, budget)
        if budget.gpu_runs(
            train_estimate(s, cfg, micro_batch, spec.lora.gradient_checkpointing, device_type, head_on_host=host)
        ):
            lo = mid
        else:
            hi = mid - 1
    return lo * _SEQ_STEP or None


def plan(spec: PipelineSpec, cfg: dict, budget: Budget) -> tuple[list[StagePlan], dict]:
    """Per-stage estimates with verdicts, and the largest micro-batch and sequence length that run."""
    # here: it loads torch, which reading configs does not need
    from slimtune.plan.train_settings import reads_tables_to_host, resolve_train

    # a multimodal checkpoint's other weights, which the merge copies: counted by the merge's own rule, on its tensors
    multimodal = layout_of(cfg) is not None
    copied = copied_bytes(cfg, stored_tensor_bytes(spec)) if multimodal and spec.merge.enabled else 0
    cfg = trained_config(cfg)  # a multimodal checkpoint: its language model is what is loaded and trained
    device_type = _device_type(spec, budget)
    dtype_bytes = DTYPE_BYTES.get(spec.model.compute_dtype, 2 if device_type == "cuda" else 4)
    fits = budget.gpu_fits
    card = budget.card_bytes() if device_type == "cuda" else None
    # no GPU budget: nothing fits
    train = resolve_train(spec, cfg, device_type, fits=lambda est: bool(fits(est)), card=card)
    micro_batch = train.micro_batch
    best_mb = largest_running_micro_batch(spec, cfg, budget)
    stages = {
        "load_4bit": estimate_load_4bit(
            cfg,
            compute_dtype_bytes=dtype_bytes,
            host_tables=reads_tables_to_host(train.head_note is not None, cfg["model_type"], multimodal),
        ),
        "packed_sft": train.base_estimate,
    }
    if spec.merge.enabled:
        stages["dequant_merge"] = estimate_merge(
            cfg,
            max_shard_bytes=int(spec.merge.max_shard_size_gb * 1e9),
            output_dtype_bytes=_merge_output_bytes(spec, cfg),
            copied_bytes=copied,
        )
        if spec.export.gguf:
            stages["gguf_convert_and_push"] = estimate_export(cfg, out_types=spec.export.gguf)
    rows = [
        StagePlan(name, est, fits(est), budget.host_fits(est), budget.gpu_runs(est)) for name, est in stages.items()
    ]
    limits = {
        "micro_batch": micro_batch,
        "largest_micro_batch": best_mb,
        "largest_seq_len": _largest_seq(spec, cfg, budget, micro_batch, device_type) if budget.gpu_total else None,
        "extras": train,  # CUDA graphs and stored layers: what packed_sft adds where the budget holds them
    }
    return rows, limits


def _merge_output_bytes(spec: PipelineSpec, cfg: dict) -> int:
    """Bytes per weight the merge writes: merge.output_dtype, or with `auto` the checkpoint's own dtype as config.json
    names it (the merge's rule); 2 where it names none (16-bit, as the released checkpoints)."""
    named = spec.merge.output_dtype if spec.merge.output_dtype != "auto" else config_dtype(cfg)
    return DTYPE_BYTES.get(named or "bfloat16", 2)


# GPU memory of the cards a pool is likely made of, GiB (T4 16, A10 24, L40S 48, A100/H100 80, H200 141,
# B200 180): a stage's class is the smallest that holds its estimate, the card a fleet must route it to.
GPU_MEMORY_CLASSES_GIB = (8, 12, 16, 24, 32, 40, 48, 80, 96, 141, 180)
# The stages each pool runs: training holds the NF4 model on its GPUs until cleanup; merge and GGUF read
# only files from the run directory, so they can run on another host (`pools.export`).
POOL_STAGES = {
    "train": ("load_4bit", "attach_lora", "packed_sft", "cleanup"),
    "export": ("dequant_merge", "gguf_convert_and_push"),
}


@dataclass(frozen=True)
class PoolNeeds:
    """What one work pool's host must offer for its stages: the figures the job templates take as variables.

    Attributes:
        pool: the work pool (`pools.export` for the export stages; None: the deployment's own pool).
        stages: the stages it runs, in pipeline order.
        gpus: GPUs (0: a CPU host).
        gpu_memory_gib: GPU memory each GPU needs, rounded up to a whole GiB (0 without GPUs).
        gpu_memory_class_gib: the smallest of `GPU_MEMORY_CLASSES_GIB` that holds it (0 without GPUs).
        host_memory_gib: host memory, rounded up to a whole GiB.
        disk_gib: free disk in the run directory, rounded up to a whole GiB.
    """

    pool: str | None
    stages: tuple[str, ...]
    gpus: int
    gpu_memory_gib: int
    gpu_memory_class_gib: int
    host_memory_gib: int
    disk_gib: int


def _ceil_gib(n: int) -> int:
    return -(-n // _GIB)


def pool_needs(spec: PipelineSpec, rows: list[StagePlan]) -> list[PoolNeeds]:
    """The pools a run uses and what each needs, from the plan's per-stage estimates.

    One pool runs every stage unless `pools.export` names another for merge and GGUF; there those stages run
    on the CPU, so the merge's device working set (less the CUDA context) is counted in host memory. Disk is
    the largest stage's: each stage's estimate is what it adds to the run directory.
    """
    gpu_run = spec.model.device != "cpu"
    groups = [(None, POOL_STAGES["train"] + POOL_STAGES["export"])]
    if spec.pools.export:
        groups = [(None, POOL_STAGES["train"]), (spec.pools.export, POOL_STAGES["export"])]
    needs = []
    for pool, stages in groups:
        ests = [r.estimate for r in rows if r.stage in stages]
        on_gpu = gpu_run and pool is None
        host = max((e.host_bytes + (0 if on_gpu else e.gpu_bytes - e.context_gpu_bytes) for e in ests), default=0)
        gpu_gib = _ceil_gib(max((e.gpu_bytes for e in ests), default=0)) if on_gpu else 0
        gpu_class = next((c for c in GPU_MEMORY_CLASSES_GIB if c >= gpu_gib), gpu_gib) if on_gpu else 0
        needs.append(
            PoolNeeds(
                pool=pool,
                stages=stages,
                gpus=spec.train.num_gpus if on_gpu else 0,
                gpu_memory_gib=gpu_gib,
                gpu_memory_class_gib=gpu_class,
                host_memory_gib=_ceil_gib(host),
                disk_gib=_ceil_gib(max((e.disk_bytes for e in ests), default=0)),
            )
        )
    return needs


# GPU feature discovery labels each GPU node with its cards' memory in MiB (an 80 GB H100 reads 81559).
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"


def job_variables(needs: PoolNeeds, pool_type: str) -> dict[str, Any]:
    """The job variables that place a flow run of a `pool_type` pool ("process", "kubernetes") as `needs` says.

    Both base job templates take the four figures as variables (deployments/process/gpu-hosts.json passes them
    to the flow run as SLIMTUNE_* environment variables: a process worker reserves nothing;
    deployments/kubernetes/gpu-job-template.json turns them into requests and limits). On Kubernetes a GPU
    stage also gets a node affinity on the GPU memory label, and a CPU stage drops the GPU node selector.
    """
    variables: dict[str, Any] = {
        "gpus": needs.gpus,
        "gpu_memory_gib": needs.gpu_memory_gib,
        "host_memory_gib": max(needs.host_memory_gib, 1),
        "disk_gib": max(needs.disk_gib, 1),
    }
    if pool_type != "kubernetes":
        return variables
    del variables["gpu_memory_gib"]  # Kubernetes schedules on it through the affinity below
    if not needs.gpus:  # the template's GPU node selector would keep a CPU stage off CPU nodes
        return {**variables, "node_selector": {}, "affinity": {}}
    term = {"key": GPU_MEMORY_LABEL, "operator": "Gt", "values": [str(needs.gpu_memory_gib * 1024 - 1)]}
    selector = {"nodeSelectorTerms": [{"matchExpressions": [term]}]}
    return {**variables, "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": selector}}}


def _render_needs(needs: PoolNeeds) -> str:
    """One pool's line; a CPU pool's names no GPU figure at all."""
    gpu = (
        f"{needs.gpus} GPU x {needs.gpu_memory_gib} GiB (class {needs.gpu_memory_class_gib} GiB), "
        if needs.gpus
        else ""
    )
    where = f"pool {needs.pool}" if needs.pool else "the deployment's pool"
    return f"- {where}: {', '.join(needs.stages)}: {gpu}host {needs.host_memory_gib} GiB, disk {needs.disk_gib} GiB"


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / _GIB:.2f} GiB"


def _verdict(ok: bool | None, runs: bool | None = None) -> str:
    return "no budget" if ok is None else ("fits" if ok else "tight: runs" if runs else "DOES NOT FIT")


def _render_extras(train) -> str:
    """What packed_sft adds for speed within the budget (`TrainSettings`), and its GPU estimate with them."""
    graphs = "on" if train.cuda_graphs else f"off ({train.graphs_off})" if train.graphs_off else "off"
    stored = train.stored_note or f"{train.stored_layers} stored layers"
    with_them = _gib(train.estimate.gpu_bytes)
    return f"speed within the budget: CUDA graphs {graphs}; {stored}; packed_sft with them {with_them}"


def render(spec: PipelineSpec, rows: list[StagePlan], limits: dict, budget: Budget) -> str:
    """The plan as text: budgets, each stage's estimate with its main terms and verdicts, the limits."""
    cap = f", run held to {budget.gpu_fraction:g} of it" if budget.gpu_fraction else ""
    cpu = spec.model.device == "cpu"  # a CPU run uses no GPU memory: no GPU figures at all
    lines = [
        f"plan for {spec.name}: {spec.model.name_or_path}, micro-batch {limits['micro_batch']} x "
        f"{spec.data.max_seq_length} tokens, checkpointing {spec.lora.gradient_checkpointing}, "
        f"kernels {spec.train.kernels}",
        f"budget: host {_gib(budget.host)} (model.device is cpu)"
        if cpu
        else f"budget: GPU {_gib(budget.gpu_total)}{cap}; host {_gib(budget.host)}",
    ]
    for row in rows:
        est = row.estimate
        lines.append(f"- {row.stage}:")
        if est.gpu_bytes and not cpu:
            lines.append(
                f"    GPU  {_gib(est.gpu_bytes):>11}  {_verdict(row.gpu_fits, row.gpu_runs):12}  "
                f"{est.top_terms('gpu: ', 4)}"
            )
            if row.gpu_fits is False and est.fields.get("gpu"):
                lines.append(f"    {'':11}        to fit: {est.fields['gpu']}")
        lines.append(f"    host {_gib(est.host_bytes):>11}  {_verdict(row.host_fits):12}  {est.top_terms('host: ', 3)}")
        if est.disk_bytes:
            lines.append(f"    disk {_gib(est.disk_bytes):>11}  {'':12}  {est.top_terms('disk: ', 2)}")
    if budget.gpu_total is not None and not cpu:
        best = limits["largest_micro_batch"]
        lines.append(
            f"largest micro-batch that runs at {spec.data.max_seq_length} tokens: {best or 'none'}; "
            f"largest sequence length at micro-batch {limits['micro_batch']}: {limits['largest_seq_len'] or 'none'}"
        )
        if limits["extras"].auto_note:
            lines.append(limits["extras"].auto_note)
        lines.append(_render_extras(limits["extras"]))
        if limits["extras"].head_note:
            lines.append(limits["extras"].head_note)
    lines.append("pools (the job variables a deployment's run fills, docs/deployments.md):")
    lines += [_render_needs(n) for n in pool_needs(spec, rows)]
    return "\n".join(lines)
