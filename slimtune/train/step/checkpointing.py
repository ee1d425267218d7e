"""Gradient checkpointing of decoder layers: off, standard, or "unsloth" (recompute with the layer input
parked in host memory).

`lora.gradient_checkpointing` takes `false | true | "unsloth"`. All modes patch the `forward` of each
decoder layer *instance* (never a class), so the module tree and state-dict keys are unchanged, peft
saves the same adapter, and `undo()` puts back exactly what was there.

Why an autograd.Function for "unsloth" and not `saved_tensors_hooks`: a Function that runs the layer
under `no_grad` saves nothing but its input, so there is exactly one tensor to offload per layer and no
hook runs per saved activation (a Llama layer with LoRA saves ~60 tensors). Gradients are exact: the
backward replays the same ops on the same input with the same RNG and autocast state, and hands the
gradients to the outer autograd engine. The layer's trainable parameters are passed as Function inputs,
so the output requires grad even when the embeddings are frozen (no `enable_input_require_grads` hook,
no extra gradient for the embedding output) and `torch.autograd.grad` on LoRA weights works.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from slimtune.memory.clean import drop_cublas_workspaces
from slimtune.models.graph_replay import replay_refusal
from slimtune.train.step.layer_graphs import LayerGraphs
from slimtune.train.step.offload import ActivationOffloader, OffloadStats

Mode = bool | Literal["unsloth"]
_MISSING = object()
_SUPPORTED = "Llama, Mistral, Qwen2, Qwen3, Gemma (decoder layers at `model.model.layers`)"
log = logging.getLogger(__name__)


CheckpointPass = Literal["first", "recompute"] | None


class LayerPass:
    """Which pass of an "unsloth"-checkpointed decoder layer runs now (`kind`; calling it returns it), for kernels
    that act on it: one per model, shared by its checkpointed layers (`enable_checkpointing`'s `layer_pass`) and
    the kernels patched into it (`kernels.apply_kernels`'s `checkpoint_pass`).

    - "recompute": the backward re-runs the layer for the autograd graph it builds, and throws its output away;
      a kernel may skip work that only produces that output (`kernels.lora_linear`, `compute_output`).
    - "first": the layer's first pass, whose backward recomputes eagerly: what a kernel keeps then for the
      recompute (the adapters' casts) is taken there.
    - None: anything else, including the first pass of a layer whose backward a CUDA graph replays: a replay
      reads what its capture made, so a kept tensor would live unread through the whole backward (the 8B model's
      casts: 77 MiB at the peak, benchmarks/peak_breakdown.py). A layer whose backward still runs eagerly then (a
      new input shape) makes them again.

    A plain attribute, not a thread-local: the backward recomputes on autograd's thread while the main thread waits
    in `backward()`, and the forward runs on the main thread while no backward runs, so the two passes of one
    model never overlap; a model trained on another thread has its own object.
    """

    def __init__(self) -> None:
        self.kind: CheckpointPass = None

    def __call__(self) -> CheckpointPass:
        return self.kind


class CheckpointingHandle(AbstractContextManager["CheckpointingHandle"]):
    """The result of `enable_checkpointing`: what is active, what it did, and how to take it off.

    Attributes:
        mode: the mode it was enabled with.
        offloading: True only for "unsloth" on a CUDA model, where layer inputs really go to the host.
        layer_pass: which pass of a layer runs, for the kernels (`LayerPass`); hand it to the next
            `enable_checkpointing` of the same model, so kernels patched before keep reading it.
    """

    def __init__(
        self,
        mode: Mode,
        offloading: bool,
        offloader: ActivationOffloader | None,
        undo_steps: list[Callable[[], None]],
        layer_pass: LayerPass,
    ) -> None:
        self.mode = mode
        self.offloading = offloading
        self.layer_pass = layer_pass
        self._offloader = offloader
        self._undo_steps = undo_steps

    def stats(self) -> OffloadStats:
        """Bytes offloaded in the last forward pass, host buffer bytes, and whether pinning failed."""
        if self._offloader is None:
            return OffloadStats(0, 0, False)
        return self._offloader.stats()

    def undo(self) -> None:
        """Restore the layers, the model config and any flags exactly as they were; idempotent.

        A step that refuses (a later patch sits on top of ours) stays queued, so undo() can be retried.
        """
        while self._undo_steps:
            self._undo_steps[-1]()
            self._undo_steps.pop()
        if self._offloader is not None:
            self._offloader.release()

    def __exit__(self, *exc: object) -> None:
        self.undo()


def enable_checkpointing(model: nn.Module, mode: Mode, layer_pass: LayerPass | None = None) -> CheckpointingHandle:
    """Apply `lora.gradient_checkpointing` to a PeftModel or a plain HF causal LM, in place.

    Args:
        model: the model to train; its decoder layers are found through a peft wrapper.
        mode: False (no checkpointing), True (standard non-reentrant checkpointing of each decoder
            layer) or "unsloth" (recompute each layer in backward, with its input kept in pinned host
            memory on CUDA; on CPU the same recompute runs without the offload).
        layer_pass: where the layers say which pass runs, for the kernels; a new one when None.

    Returns:
        A handle whose `undo()` restores the model; it is also a context manager.

    Raises:
        ValueError: for an unknown mode, a model whose decoder layers cannot be found, or a model
            where checkpointing is already enabled by this function.
    """
    return _enable(model, mode, layer_pass)


def _enable(
    model: nn.Module,
    mode: Mode,
    layer_pass: LayerPass | None = None,
    offload_min_bytes: int | None = None,
    offload_on_cpu: bool = False,
) -> CheckpointingHandle:
    """`enable_checkpointing`, with the offload threshold and a CPU offload switch open to tests."""
    if not (mode is False or mode is True or mode == "unsloth"):
        raise ValueError(f'lora.gradient_checkpointing must be false, true or "unsloth"; got {mode!r}')
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = _decoder_layers(base)
    if any(isinstance(layer.__dict__.get("forward"), _CheckpointedForward) for layer in layers):
        raise ValueError(
            "gradient checkpointing is already enabled on this model; "
            "call undo() on the first handle before enabling it again"
        )
    layer_pass = layer_pass if layer_pass is not None else LayerPass()
    undo: list[Callable[[], None]] = []
    config = getattr(base, "config", None)
    if config is not None and getattr(config, "use_cache", None):
        # A KV cache built during training is pure waste, and a checkpointed layer would write it twice.
        config.use_cache = False
        undo.append(functools.partial(setattr, config, "use_cache", True))
    if mode is False:
        return CheckpointingHandle(mode, False, None, undo, layer_pass)

    device = next((p.device for p in layers.parameters()), torch.device("cpu"))
    offloader = None
    if mode == "unsloth":
        offloader = ActivationOffloader(device)
        if offload_min_bytes is not None:
            offloader.min_bytes = offload_min_bytes
    offload = mode == "unsloth" and (device.type == "cuda" or offload_on_cpu)
    for idx, layer in enumerate(layers):
        forward = _CheckpointedForward(
            layer, idx, idx == len(layers) - 1, mode, offloader if offload else None, layer_pass
        )
        undo.append(_patch_layer(layer, idx, forward))
    return CheckpointingHandle(mode, offload and device.type == "cuda", offloader, undo, layer_pass)


def _decoder_layers(base: nn.Module) -> nn.ModuleList:
    inner = getattr(base, "model", base)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"gradient checkpointing: cannot find the decoder layers of {type(base).__name__}; "
            f"supported: {_SUPPORTED}. Set lora.gradient_checkpointing: false for this model."
        )
    return layers


class _CheckpointedForward:
    """A decoder layer's forward under checkpointing, set on the layer instance in place of its own.

    Attributes:
        mode: the checkpointing mode it runs.
        listed: the layer's trainable parameters while `parameters_from_lists` holds them; None: found per call.
        graphs: the CUDA graphs of the layers' backward while `graphed_backward` runs; None: an eager backward.
        stored: the layer runs as it is, keeping its activations for the backward (`stored_layers`).
    """

    def __init__(
        self,
        layer: nn.Module,
        idx: int,
        is_last: bool,
        mode: Mode,
        offloader: ActivationOffloader | None,
        layer_pass: LayerPass,
    ) -> None:
        self.layer, self.idx, self.is_last = layer, idx, is_last
        self.inner = layer.forward  # the class forward, or an instance hook (accelerate) that we then wrap
        self.mode = mode
        self.offloader = offloader
        self.layer_pass = layer_pass
        self.listed: list[torch.Tensor] | None = None
        self.graphs: LayerGraphs | None = None
        self.stored = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        layer, inner = self.layer, self.inner
        if self.stored or not (layer.training and torch.is_grad_enabled()):
            return inner(*args, **kwargs)
        if args:
            hidden, rest = args[0], args[1:]
        else:
            hidden, rest = kwargs.pop("hidden_states"), ()
        for name, off in (("use_cache", False), ("past_key_values", None), ("layer_past", None)):
            if name in kwargs:
                kwargs[name] = off  # a recomputed layer would append to a cache twice
        if self.mode is True:
            return checkpoint(functools.partial(_call, inner, rest, kwargs), hidden, use_reentrant=False)
        _check_frozen_extras(rest, kwargs, type(layer).__name__)
        params = self.listed if self.listed is not None else _trainable(layer)
        call = (inner, rest, kwargs, self.layer_pass)
        # The last layer's input is kept for its backward, which follows at once; under graphs it goes to the host
        # too, and comes back into the graph's buffer (`LayerGraphs.reload_target`) instead of staying beside it
        offload = not self.is_last or self.graphs is not None
        return _RecomputedLayer.apply(call, self.offloader, self.graphs, self.idx, offload, hidden, *params)


def _patch_layer(layer: nn.Module, idx: int, forward: _CheckpointedForward) -> Callable[[], None]:
    """Replace `layer.forward` on the instance by `forward`; return the function that puts it back."""
    previous = layer.__dict__.get("forward", _MISSING)
    # transformers' own per-layer checkpointing would nest inside ours; switch it off while we are on.
    hf_flag = layer.__dict__.get("gradient_checkpointing", _MISSING)
    if hf_flag is not _MISSING:
        layer.gradient_checkpointing = False
    layer.forward = forward

    def restore() -> None:
        if layer.__dict__.get("forward") is not forward:
            raise RuntimeError(
                f"decoder layer {idx}'s forward was replaced after enable_checkpointing; "
                "undo that patch first (patches come off in reverse order)"
            )
        if previous is _MISSING:
            del layer.forward
        else:
            layer.forward = previous
        if hf_flag is not _MISSING:
            layer.gradient_checkpointing = hf_flag

    return restore


def _trainable(layer: nn.Module) -> list[torch.Tensor]:
    return [p for p in layer.parameters() if p.requires_grad]


@contextlib.contextmanager
def parameters_from_lists(model: nn.Module) -> Iterator[int]:
    """Within the block, each checkpointed decoder layer has its trainable parameters in a list made on entry,
    which the "unsloth" recompute takes; yields how many layers got one.

    Otherwise every forward of every layer walks its modules for them (83 in a Llama layer with peft LoRA on
    seven projections). Same contract as `slimtune.train.step.walks.walks_from_lists`: use it around one
    single-process `Trainer.train` call, within which no module or parameter is added, removed or frozen.
    """
    patched = _patched(model)
    for forward, layer in patched:
        forward.listed = _trainable(layer)
    try:
        yield len(patched)
    finally:
        for forward, _ in patched:
            forward.listed = None


@contextlib.contextmanager
def stored_layers(model: nn.Module, count: int) -> Iterator[int]:
    """Within the block, the last `count` checkpointed decoder layers run as they are, keeping their activations
    for the backward instead of recomputing them (`train.stored_layers`); yields how many do.

    The last ones, because their backward runs first: their activations are freed before any layer is recomputed,
    and the recompute reuses most of that memory (`estimate_train`). A stored layer's backward is autograd's own;
    the graphs capture the recomputed layers' only.
    """
    patched = _patched(model)
    chosen = patched[len(patched) - min(count, len(patched)) :]
    for forward, _ in chosen:
        forward.stored = True
    try:
        yield len(chosen)
    finally:
        for forward, _ in chosen:
            forward.stored = False


def _patched(model: nn.Module) -> list[tuple[_CheckpointedForward, nn.Module]]:
    """(patched forward, layer) of each decoder layer `enable_checkpointing` patched."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        layers = _decoder_layers(base)
    except ValueError:
        return []
    patched = [(layer.__dict__.get("forward"), layer) for layer in layers]
    return [(f, layer) for f, layer in patched if isinstance(f, _CheckpointedForward)]


def graphs_refusal(model: nn.Module) -> str | None:
    """Why `graphed_backward` would leave `model`'s layers eager, or None when it graphs them."""
    patched = _patched(model)
    if not patched or any(f.mode != "unsloth" for f, _ in patched):
        return 'only layers under "unsloth" checkpointing are captured'
    layers = [layer for _, layer in patched]
    config = getattr(model, "config", None)
    refusal = replay_refusal(config.to_dict()) if config is not None else None
    if refusal is not None:
        return refusal
    device = next((p.device for layer in layers for p in layer.parameters()), torch.device("cpu"))
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, not {device.type}"
    dropouts = [m.p for layer in layers for m in layer.modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if dropouts or getattr(config, "attention_dropout", 0.0):
        return "dropout draws new masks each step, which a replayed graph would not"
    return None


@contextlib.contextmanager
def graphed_backward(model: nn.Module) -> Iterator[LayerGraphs | None]:
    """Within the block, the backward of each "unsloth"-checkpointed decoder layer runs as a CUDA graph, captured
    at its second backward of each input shape (see `slimtune.train.step.layer_graphs`); yields the graphs, or None
    where `graphs_refusal` refuses (the reason is logged).

    The graphs read the layers' parameters and the kernels' buffers where they were at capture: use it around one
    single-process `Trainer.train` call, within which no module or parameter is added, removed or frozen (the
    contract of `parameters_from_lists`). The graphs and their memory go when the block ends.

    Everything in the block runs on the graphs' stream (`LayerGraphs.stream`), so that the captures use the
    stream, and the cuBLAS workspaces, that the eager layers use: the block waits for the work queued before it,
    and the work after it waits for the block's. The workspaces cuBLAS made for the other stream are freed as the
    block begins, and those of the graphs' stream as it ends: each would sit unused beside the others.
    """
    reason = graphs_refusal(model)
    if reason is not None:
        log.info("decoder layers' backward stays eager: %s", reason)
        yield None
        return
    patched = _patched(model)
    device = next(p.device for _, layer in patched for p in layer.parameters())
    graphs = LayerGraphs(device)
    for forward, _ in patched:
        forward.graphs = graphs
    outer = torch.cuda.current_stream(device)
    graphs.stream.wait_stream(outer)
    drop_cublas_workspaces()
    try:
        with torch.cuda.stream(graphs.stream):
            yield graphs
    finally:
        outer.wait_stream(graphs.stream)
        for forward, _ in patched:
            forward.graphs = None
        graphs.release()
        drop_cublas_workspaces()


def _call(inner: Callable[..., Any], rest: tuple[Any, ...], kwargs: dict[str, Any], hidden: torch.Tensor) -> Any:
    return inner(hidden, *rest, **kwargs)


def _check_frozen_extras(rest: tuple[Any, ...], kwargs: dict[str, Any], layer_name: str) -> None:
    """Only the hidden states and parameters get gradients from the Function; refuse anything else."""
    items = [(f"argument {i + 1}", v) for i, v in enumerate(rest)] + list(kwargs.items())
    for name, value in items:
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise ValueError(
                    f'gradient_checkpointing "unsloth": {layer_name} input {name} requires '
                    "grad, which the recompute cannot propagate; "
                    "use gradient_checkpointing: true"
                )


def _recompute(
    inner: Callable[..., Any],
    layer_pass: LayerPass,
    autocast: tuple,
    hidden: torch.Tensor,
    rest: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run the layer again with grad, under the forward's autocast state, flagged as a recompute."""
    device_type, enabled, dtype, cache = autocast
    with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache):
        layer_pass.kind = "recompute"
        try:
            return inner(hidden, *rest, **kwargs)
        finally:
            layer_pass.kind = None


class _RecomputedLayer(torch.autograd.Function):
    """Run a decoder layer without saving activations; recompute it from its (offloaded) input in backward."""

    @staticmethod
    def forward(
        ctx: Any,
        call: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], LayerPass],
        offloader: ActivationOffloader | None,
        graphs: LayerGraphs | None,
        idx: int,
        offload: bool,
        hidden: torch.Tensor,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        device = hidden.device
        ctx.call = call
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        # Autocast is thread-local and the backward runs on autograd's thread: carry it over by hand.
        ctx.autocast = (
            device.type,
            torch.is_autocast_enabled(device.type),
            torch.get_autocast_dtype(device.type),
            torch.is_autocast_cache_enabled(),
        )
        ctx.offloader, ctx.graphs, ctx.idx = offloader, graphs, idx
        if offloader is not None:
            ctx.slot = offloader.save(hidden, idx, offload)
        else:
            ctx.hidden = hidden
        ctx.save_for_backward(*params)
        inner, rest, kwargs, layer_pass = call
        layer_pass.kind = "first" if graphs is None or not graphs.enabled else None
        try:
            out = inner(hidden, *rest, **kwargs)
        finally:
            layer_pass.kind = None
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f'gradient_checkpointing "unsloth" expects decoder layers to return a tensor, '
                f"got {type(out).__name__}; use gradient_checkpointing: true for this model"
            )
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        params = ctx.saved_tensors
        if ctx.offloader is not None:
            saved = ctx.offloader.load(ctx.slot, ctx.graphs.reload_target if ctx.graphs is not None else None)
        else:
            saved, ctx.hidden = ctx.hidden, None
        wants_hidden = ctx.needs_input_grad[5]
        inner, rest, kwargs, layer_pass = ctx.call
        if ctx.graphs is not None:
            done = ctx.graphs.backward(
                ctx.idx,
                functools.partial(_recompute, inner, layer_pass, ctx.autocast),
                rest,
                kwargs,
                saved,
                grad_out,
                params,
                wants_hidden,
                ctx.autocast,
            )
            if done is not None:
                return (None, None, None, None, None, done[0], *done[1])
        hidden = saved.detach().requires_grad_(wants_hidden)
        cuda = [hidden.device] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=cuda, device_type="cuda"):
            # Same RNG as the forward, so dropout draws the same masks; fork_rng puts the outer state back.
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, hidden.device)
            out = _recompute(inner, layer_pass, ctx.autocast, hidden, rest, kwargs)
        inputs = ([hidden] if hidden.requires_grad else []) + list(params)
        grads = list(torch.autograd.grad(out, inputs, grad_out, allow_unused=True))
        hidden_grad = grads.pop(0) if hidden.requires_grad else None
        if hidden_grad is not None and ctx.graphs is not None:
            hidden_grad = ctx.graphs.settle_grad(hidden_grad)
        return (None, None, None, None, None, hidden_grad, *grads)
