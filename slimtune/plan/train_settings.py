"""The packed_sft settings of one training attempt, decided in one place: `resolve_train`.

The flow's packed_sft task, `slimtune plan`, attach_lora and every torchrun rank read their micro-batch,
accumulation, checkpointing, kernels, varlen attention, CUDA graphs, stored layers and memory estimate from here, so the
micro-batch the planner reports, the checkpointing attach_lora sets up and the kernels the guard's estimate
assumes cannot drift apart. A root module beside `slimtune.plan.fit` (whose estimates it uses, and which calls
it): inside train/ the two would make an import cycle through that folder (tests/test_import_graph.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from slimtune.kernels.apply import expected_kernels
from slimtune.memory.downshift import DownshiftExhausted, TrainShift, downshift_train
from slimtune.memory.model_shape import model_shape
from slimtune.memory.stage_estimate import Estimate
from slimtune.models.families import FAMILIES
from slimtune.models.graph_replay import replay_refusal
from slimtune.plan.fit import train_estimate
from slimtune.plan.micro_batch import Graphs, auto_micro_batch
from slimtune.plan.step_speed import graphs_speedup
from slimtune.spec.schema import PipelineSpec, TrainSpec
from slimtune.train.step.attention import varlen_expected

# DDP and FSDP want every parameter on the rank's GPU (they check device types and broadcast or shard them
# at wrap time); the guard's estimate for a multi-GPU run leaves these kernels out too.
_ON_RANK_GPU = "several ranks: DDP/FSDP keep every parameter on the rank's GPU"
MULTI_GPU_EXCLUDED_KERNELS = {"host_embedding": _ON_RANK_GPU, "host_lm_head": _ON_RANK_GPU}
HEAD_ON_GPU = "micro-batch 1 fits the card with the head on the GPU, where no bus transfer slows the loss"
# FSDP1 (flat parameters) replaces each weight by a plain view of its unit's flat parameter, valid only while
# that unit computes: lora_nf4 reads `base_layer.weight.quant_state` (gone from the view; bitsandbytes' own
# forward restores it from the module) and the LoRA weights, which are FSDP units of their own, from the
# outer layer's forward (sharded there).
FSDP_EXCLUDED_KERNELS = {
    **MULTI_GPU_EXCLUDED_KERNELS,
    "lora_nf4": "train.parallelism fsdp: FSDP1 flattens the NF4 weight (its quant_state is gone) and shards "
    "the LoRA weights the kernel reads",
}


def excluded_kernels(train: TrainSpec, head_on_host: bool = False) -> dict[str, str]:
    """Kernels this run leaves out, with why (attach_lora applies, the estimate assumes the same)."""
    if train.sharded:
        return FSDP_EXCLUDED_KERNELS
    excluded = MULTI_GPU_EXCLUDED_KERNELS if train.world_size > 1 else {}
    return excluded if head_on_host else {**excluded, "host_lm_head": HEAD_ON_GPU}


def run_kernels(train: TrainSpec, device_type: str, model_type: str | None, head_on_host: bool = False) -> list[str]:
    """The kernels a run of this family on `device_type` is expected to apply, less those it leaves out."""
    excluded = excluded_kernels(train, head_on_host)
    return [k for k in expected_kernels(train.kernels, device_type, model_type) if k not in excluded]


def card_bytes(spec: PipelineSpec, device: torch.device) -> int | None:
    """The card this run may use (`guard.gpu_memory_fraction` of `device`, all of it without one); None off a GPU.
    What decides where the lm_head lives (`head_on_host`): a fact of the card, not of the moment."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(device).total_memory * (spec.guard.gpu_memory_fraction or 1.0))


def head_on_host(spec: PipelineSpec, cfg: dict, device_type: str, card: int | None) -> bool:
    """Whether the frozen lm_head lives in pinned host memory, streamed by the loss (`host_lm_head`): the planner's
    last trade, taken only where micro-batch 1 does not fit `card` with the head on the GPU and needs less with it
    on the host (a small head saves less than the loss's chunks and accumulator cost): every micro-batch then reads
    the head over the bus (0.98 GiB at 8B). Decided from the spec, the config and the card alone, so load_4bit
    (which then reads the tables into host memory), attach_lora, packed_sft and the planner all decide the same."""
    return _head_note(spec, cfg, device_type, card) is not None


def _head_note(spec: PipelineSpec, cfg: dict, device_type: str, card: int | None) -> str | None:
    """`head_on_host`'s decision as the sentence the plan and the run log print; None where the head stays."""
    lora_head = isinstance(spec.lora.target_modules, list) and "lm_head" in spec.lora.target_modules
    if card is None or model_shape(cfg).tied or spec.lora.train_embeddings or lora_head:
        return None  # a head that is trained, tied or wrapped by peft stays where peft and the input table want it
    # both tables go to the host (load_4bit reads them there), and only the fused loss reads the head there
    streams = {"host_lm_head", "host_embedding", "fused_linear_ce"}
    if not streams <= set(run_kernels(spec.train, device_type, cfg.get("model_type"), head_on_host=True)):
        return None
    ckpt = spec.lora.gradient_checkpointing
    on_gpu = train_estimate(spec, cfg, 1, ckpt, device_type).gpu_bytes
    if on_gpu <= card or train_estimate(spec, cfg, 1, ckpt, device_type, head_on_host=True).gpu_bytes >= on_gpu:
        return None
    return (
        f"lm_head in pinned host memory, streamed to the loss once per micro-batch: micro-batch 1 needs "
        f"{on_gpu / 2**30:.2f} GiB with it on the GPU, more than the {card / 2**30:.2f} GiB card"
    )


def reads_tables_to_host(head_on_host: bool, family: str, multimodal: bool) -> bool:
    """Whether load_4bit reads the input table and lm_head into pinned host memory (`slimtune.tasks.load_tables`):
    where the run keeps the head there (`head_on_host`), unless the load builds its model otherwise (a multimodal
    checkpoint's language model, an MoE built without its experts): those load the tables onto the GPU, and
    attach_lora moves them."""
    return head_on_host and not multimodal and not FAMILIES[family].experts


def rank_checkpointing(train: TrainSpec, mode: bool | str) -> bool | str:
    """The checkpointing a rank runs: under FSDP "unsloth" becomes standard (non-reentrant) checkpointing.

    "unsloth" runs each layer under no_grad and hands `layer.parameters()` to an autograd Function that
    re-runs the layer in its backward; under FSDP1 those are the nested LoRA units' sharded flat parameters,
    gathered and reduced by FSDP's hooks around a recompute they were not written for: not verified, so
    offloaded checkpointing is not offered under FSDP yet. Standard checkpointing recomputes through the
    module calls inside the layer's FSDP unit, as Answer.AI's fsdp_qlora does.
    """
    if train.sharded and mode == "unsloth":
        return True
    return mode


@dataclass(frozen=True)
class TrainSettings:
    """What one packed_sft attempt runs with.

    Attributes:
        micro_batch: rows per forward pass (`micro_batch_size: auto` chooses it; each retry halves it).
        grad_accum: micro-batches per optimizer step (the effective batch stays the same).
        checkpointing: the gradient checkpointing every process runs (`rank_checkpointing` of the downshifted mode).
        kernels: the kernels the estimate assumes applied (`run_kernels`).
        kernels_excluded: kernels this run leaves out, with why (attach_lora passes them to `apply_kernels`).
        varlen: whether attention is expected to run varlen flash on packed rows (what the estimate assumes).
        cuda_graphs: whether to capture the layers' backward as CUDA graphs.
        stored_layers: under checkpointing, how many of the last decoder layers keep their activations instead of
            being recomputed (`train.stored_layers`); 0 without checkpointing, where every layer keeps them.
        estimate: the packed_sft memory estimate at these settings, graphs included where they are on (the guard's).
        base_estimate: the estimate without the graphs' extra: what fitting is decided on (the planner's).
        auto_note: how `auto` chose the micro-batch (None for a fixed one).
        downshift_notes: what each retry changed (empty on the first attempt).
        graphs_off: why CUDA graphs are off although `train.cuda_graphs` asks for them (None otherwise).
        stored_note: how `stored_layers: auto` chose (None for a count the spec gives, or without checkpointing).
        head_note: why the lm_head lives in host memory (`head_on_host`; None where it stays on the GPU).
    """

    micro_batch: int
    grad_accum: int
    checkpointing: bool | str
    kernels: tuple[str, ...]
    kernels_excluded: dict[str, str]
    varlen: bool
    cuda_graphs: bool
    stored_layers: int
    estimate: Estimate
    base_estimate: Estimate
    auto_note: str | None = None
    downshift_notes: tuple[str, ...] = ()
    graphs_off: str | None = None
    stored_note: str | None = None
    head_note: str | None = None


def resolve_train(
    spec: PipelineSpec,
    cfg: dict,
    device_type: str,
    *,
    attempt: int = 1,
    fits: Callable[[Estimate], bool] | None = None,
    card: int | None = None,
) -> TrainSettings:
    """The settings of packed_sft attempt `attempt` of `spec` on a model of config.json `cfg`.

    Args:
        device_type: "cuda" or "cpu"; may be one this machine lacks (the planner's "cuda").
        attempt: 1 as configured; each retry after running out of memory downshifts (`downshift_train`).
        fits: whether an estimate fits the GPU budget now; None: no budget to hold it to (everything fits).
        card: the card the run may use (`card_bytes`), which decides where the lm_head lives (`head_on_host`).

    Raises:
        DownshiftExhausted: `attempt` is past the last downshift.
    """
    fits = fits or (lambda est: True)

    def runs(est: Estimate) -> bool:
        """A tight fit runs (`guard.preflight`): the micro-batch and the graphs, each worth far more than the
        fragmentation allowance costs, are chosen on it; stored layers, worth about 1% of a step each, keep it."""
        return fits(est.tensors())

    train, ckpt = spec.train, spec.lora.gradient_checkpointing
    head_note = _head_note(spec, cfg, device_type, card)
    host_head = head_note is not None
    refusal = replay_refusal(cfg)  # layers the runtime never captures: their pool is not planned for
    micro_batch, grad_accum, auto_note = train.micro_batch_size, train.gradient_accumulation_steps, None
    if micro_batch == "auto":
        # memory beyond a GPU-bound micro-batch goes to stored layers where they can take it
        to_stored = (
            device_type == "cuda" and train.stored_layers == "auto" and train.world_size == 1 and ckpt is not False
        )
        at = functools.partial(
            train_estimate, spec, cfg, checkpointing=ckpt, device_type=device_type, head_on_host=host_head
        )
        graphable = train.cuda_graphs and device_type == "cuda" and ckpt is not False and refusal is None
        seq = spec.data.max_seq_length  # packed rows are full
        graphs = Graphs(
            lambda mb: runs(at(micro_batch=mb, cuda_graphs=True)),
            lambda graphed, eager: graphs_speedup(cfg, seq, graphed, eager),
        )
        micro_batch, grad_accum, auto_note = auto_micro_batch(
            train, lambda mb: runs(at(micro_batch=mb)), seq if to_stored else None, graphs if graphable else None
        )
    try:
        shift = downshift_train(micro_batch, grad_accum, ckpt, attempt)
    except DownshiftExhausted:
        # Already at the ladder's last settings, attempt 1 may still have spent memory on speed (stored layers, CUDA
        # graphs), which every retry gives up: the first retry is that alone before the ladder is exhausted.
        first = resolve_train(spec, cfg, device_type, fits=fits, card=card) if attempt == 2 else None
        if first is None or not (first.stored_layers or first.cuda_graphs):
            raise
        note = f"attempt 2: micro-batch {first.micro_batch} again, every layer recomputed, no CUDA graphs"
        shift = TrainShift(first.micro_batch, first.grad_accum, ckpt, (note,))
    estimate = functools.partial(
        train_estimate, spec, cfg, shift.micro_batch, shift.checkpointing, device_type, head_on_host=host_head
    )
    # CUDA graphs of the layers' backward hold a recomputed layer in a pool of their own: an extra, used only on
    # the first attempt and where the estimate with them runs (a tight fit included)
    graphs = train.cuda_graphs and attempt == 1 and refusal is None and runs(estimate(cuda_graphs=True))
    graphs_off = None
    if train.cuda_graphs and not graphs:
        if attempt > 1:
            graphs_off = "a retry after running out of memory"
        elif refusal is not None:
            graphs_off = refusal
        else:
            graphs_off = "the estimate with them exceeds the budget"
    stored, stored_note = _stored_layers(spec, cfg, device_type, attempt, shift.checkpointing, graphs, fits, estimate)
    if stored and stored == model_shape(cfg).layers:
        graphs = False  # no layer is recomputed: there is no backward to capture
    return TrainSettings(
        micro_batch=shift.micro_batch,
        grad_accum=shift.grad_accum,
        checkpointing=rank_checkpointing(train, shift.checkpointing),
        kernels=tuple(run_kernels(train, device_type, cfg.get("model_type"), host_head)),
        kernels_excluded=excluded_kernels(train, host_head),
        varlen=varlen_expected(cfg, device_type, spec.data.packing),
        cuda_graphs=graphs,
        stored_layers=stored,
        estimate=estimate(cuda_graphs=graphs, stored_layers=stored),
        base_estimate=estimate(),
        auto_note=auto_note,
        downshift_notes=shift.notes,
        graphs_off=graphs_off,
        stored_note=stored_note,
        head_note=head_note,
    )


def _stored_layers(
    spec: PipelineSpec,
    cfg: dict,
    device_type: str,
    attempt: int,
    checkpointing: bool | str,
    graphs: bool,
    fits: Callable[[Estimate], bool],
    estimate: Callable[..., Estimate],
) -> tuple[int, str | None]:
    """How many of the last decoder layers skip the recompute (`train.stored_layers`), and how auto chose.

    After the micro-batch and the CUDA graphs, which buy more speed per GiB (the graphs hold about one recomputed
    layer and speed every layer's backward), auto spends what the budget has left on layers that keep their
    activations, each saving one layer's recompute per micro-batch: the largest count whose estimate fits.
    """
    if checkpointing is False:  # every layer keeps its activations already
        return 0, None
    if attempt > 1:  # the downshifts trade speed for memory: the recompute comes back first
        return 0, "0 on a retry after running out of memory" if spec.train.stored_layers != 0 else None
    if spec.train.stored_layers != "auto":
        return spec.train.stored_layers, None
    if device_type != "cuda":
        return 0, "auto: 0 on the CPU, where activations take host memory that no budget holds"
    if spec.train.world_size > 1:
        return 0, "auto: 0 on several GPUs (every rank recomputes each layer)"
    layers = model_shape(cfg).layers
    if fits(estimate(stored_layers=layers)):  # no layer recomputed: no graphs either
        return layers, f"auto: all {layers} layers keep their activations (nothing is recomputed)"
    lo, hi = 0, layers - 1
    while lo < hi:  # the largest count that fits; the estimate grows with it
        mid = (lo + hi + 1) // 2
        if fits(estimate(cuda_graphs=graphs, stored_layers=mid)):
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        return 0, f"auto: none of the {layers} layers keeps its activations (one more does not fit the budget)"
    return lo, f"auto: the last {lo} of {layers} layers keep their activations, the others are recomputed"
