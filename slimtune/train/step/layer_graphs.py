"""CUDA graphs of the backward of "unsloth"-checkpointed decoder layers: one graph launch per layer and step,
where the host issued ~150 kernel launches and the Python around them.

Why: at 1B, and at batch 1, a training step is bound by the host, not the GPU. On an H100 a 1B step at batch 1
kept the GPU busy 0.046 s of ~0.2 s, and a layer's recompute plus backward took 10 ms of host time against 2 ms
for its forward without grad (benchmarks/results/profiles/host-costs-1b-seq2048-h100-2026-11-23e.json). That
backward is the same ops on tensors of the same shapes at every step, so it is captured once per layer and
input shape, and replayed with its inputs in static buffers.

What keeps a replay right:
- A graph reads the storage it was captured with. The hidden state and its gradient are in the buffers below
  (the offloader brings the input back there; else it is copied in); the layer's other tensor arguments are
  copied into buffers kept per input key (shapes, dtypes, non-tensor arguments); parameters and NF4 weights
  keep their storage; the kernels' scratch buffers are referenced by each graph that used them, so a release
  cannot free them under it. The LoRA kernel casts its adapters inside a capture
  (`torch.cuda.is_current_stream_capturing`) instead of taking the casts its forward made, which are new
  tensors every step.
- The first backward of a layer at its shapes runs eagerly: Triton compiles and the scratch buffers grow outside
  any capture. The second captures, then replays; so does the first at a new key of shapes already run (another
  count of example boundaries).
- Only for layers without randomness: `graphs_refusal` says why a model cannot use them (dropout), and the
  caller does not create them then.
- Whatever a capture refuses (a host sync, a copy from pageable memory) turns graphs off for the run with the
  reason logged, and that backward runs eagerly. The result never depends on whether a graph ran.

Memory: three buffers of the hidden state's shape, which stand in for what the eager backward allocates, so
that they cost memory only outside the backward:
- two for the layers' inputs (even and odd layers), which the offloader brings the inputs back into
  (`reload_target`): one layer's input arrives while the layer before it in the backward reads the other;
- one for the gradient, which each graph reads the output gradient from and, as its last kernel, overwrites
  with the input gradient: the next layer's graph reads it in place. An eager layer's input gradient is moved
  there too (`settle_grad`), so a layer's output gradient never takes memory of its own.
Each is a view of one flat buffer grown to the largest shape seen, so batches of many shapes (padded rows) cost
three of the largest, not three per shape; growing drops the graphs that read the smaller one. Besides: one set
of LoRA-gradient buffers for all layers of the same adapter shapes, and one private pool for what the layers'
backward allocates inside the graphs, shared by all graphs (they never run concurrently). Measured where the
memory peaks: benchmarks/peak_breakdown.py.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from slimtune.kernels import scratch

log = logging.getLogger(__name__)

MAX_KEYS = 8  # input shapes captured per run; a batch shape beyond them runs eagerly
_MAX_SEEN = 4096  # (layer, key) pairs remembered as run once

# (hidden, rest, kwargs) -> the layer's output, recomputed with grad
LayerCall = Callable[[torch.Tensor, tuple[Any, ...], dict[str, Any]], torch.Tensor]


class _Unkeyable(Exception):
    """An argument a graph cannot be keyed on (neither a tensor, a container nor a plain constant)."""


def _flatten(value: Any, tensors: list[torch.Tensor], spec: list[Any]) -> None:
    """Append `value`'s tensors to `tensors` and its structure and constants to `spec` (the key)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        spec.append(("tensor", tuple(value.shape), value.dtype, value.device))
    elif type(value) in (tuple, list):
        spec.append((type(value).__name__, len(value)))
        for item in value:
            _flatten(item, tensors, spec)
    elif type(value) is dict:
        spec.append(("dict", tuple(value)))
        for item in value.values():
            _flatten(item, tensors, spec)
    elif value is None or type(value) in (bool, int, float, str, torch.dtype):
        spec.append((type(value).__name__, value))
    else:
        raise _Unkeyable(type(value).__name__)


def _rebuild(value: Any, statics: Any) -> Any:
    """`value` with each tensor replaced, in order, by the next of the iterator `statics`."""
    if isinstance(value, torch.Tensor):
        return next(statics)
    if type(value) in (tuple, list):
        return type(value)(_rebuild(item, statics) for item in value)
    if type(value) is dict:
        return {name: _rebuild(item, statics) for name, item in value.items()}
    return value


def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


class _Inputs:
    """The static buffers of one key, shared by every layer's graph of that key: the two input buffers (even,
    odd layer) and the gradient buffer (shared with every key of the same shapes), and the layer's other tensor
    arguments."""

    def __init__(
        self, hidden: tuple[torch.Tensor, torch.Tensor], grad: torch.Tensor, tensors: list[torch.Tensor]
    ) -> None:
        self.hidden, self.grad = hidden, grad
        unique: dict[int, int] = {}
        self.slots = [unique.setdefault(id(t), len(unique)) for t in tensors]  # one buffer per distinct tensor
        firsts = {slot: t for slot, t in zip(self.slots, tensors, strict=True)}
        self.tensors = [torch.empty_like(firsts[slot]) for slot in range(len(unique))]
        self.sources: list[torch.Tensor] = []  # the tensors last copied in: the same ones serve every layer of a step

    def load(self, tensors: list[torch.Tensor]) -> None:
        """Copy the layer's tensor arguments in, unless they are the ones already there (held, so ids stay valid)."""
        firsts = list({slot: t for slot, t in zip(self.slots, tensors, strict=True)}.values())
        if len(firsts) == len(self.sources) and all(a is b for a, b in zip(firsts, self.sources, strict=True)):
            return
        for buffer, source in zip(self.tensors, firsts, strict=True):
            buffer.copy_(source)
        self.sources = firsts

    def statics(self) -> list[torch.Tensor]:
        return [self.tensors[slot] for slot in self.slots]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    params: tuple[torch.Tensor, ...]
    hidden_grad: torch.Tensor | None
    param_grads: list[torch.Tensor | None]
    keep: list[torch.Tensor]  # storage the graph reads that no one else is bound to keep (scratch buffers)


class LayerGraphs:
    """Captures and replays the backward of checkpointed decoder layers on one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.enabled = True
        self.reason: str | None = None  # why graphs were turned off, if they were
        self.captured = 0  # graphs captured, and replays run, in all (they stay after `release`)
        self.replays = 0
        self._pool = torch.cuda.graph_pool_handle()
        # The stream the layers run on, and the graphs are captured on: `graphed_backward` makes it the current one
        # (a capture needs a stream other than the default one, and a second stream would cost a second cuBLAS
        # workspace: 32 MiB on an H100)
        self.stream = torch.cuda.Stream(device)
        self._inputs: dict[tuple, _Inputs] = {}
        # (role, dtype) -> flat buffer; role 0, 1: the even, odd layers' input, 2: the gradient
        self._flat: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._views: dict[tuple, torch.Tensor] = {}  # (role, shape, dtype) -> one view each, so `is` finds it
        self._graphs: dict[tuple, _Captured] = {}
        self._seen: set[tuple] = set()
        # Where the graphs write parameter gradients, per list of parameter shapes: shared by layers of equal shapes.
        # Autograd accumulates a layer's gradients (its highest-priority nodes) before it runs the next layer.
        self._grads: dict[tuple, list[torch.Tensor]] = {}

    def backward(
        self,
        idx: int,
        call: LayerCall,
        rest: tuple[Any, ...],
        kwargs: dict[str, Any],
        hidden: torch.Tensor,
        grad_out: torch.Tensor,
        params: tuple[torch.Tensor, ...],
        hidden_grad: bool,
        context: tuple,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]] | None:
        """Layer `idx`'s (input gradient, parameter gradients) from its graph, or None: run it eagerly.

        `call(hidden, rest, kwargs)` recomputes the layer with grad; `context` is whatever else decides what
        it computes (autocast), part of the key.
        """
        if not self.enabled:
            return None
        tensors: list[torch.Tensor] = []
        shapes = (hidden.shape, hidden.dtype, grad_out.shape, grad_out.dtype, hidden_grad, context)
        spec: list[Any] = list(shapes)
        try:
            _flatten((rest, kwargs), tensors, spec)
        except _Unkeyable:
            return None
        key = tuple(spec)
        inputs = self._inputs.get(key)
        if inputs is None and len(self._inputs) >= MAX_KEYS:
            return None
        entry = self._graphs.get((idx, key))
        if entry is not None and not _same(entry.params, params):
            return None  # the layer trains other parameters than when captured
        if entry is None:
            # The layer's own shapes, not its other arguments: once it has run eagerly at them, its kernels are
            # compiled and the scratch buffers grown, so a new key of those shapes (another count of example
            # boundaries) is captured at once, where it used to run one more eager backward first.
            if (idx, shapes) not in self._seen:
                if len(self._seen) >= _MAX_SEEN:  # shapes that change every step (padding-free batches)
                    self._seen.clear()
                self._seen.add((idx, shapes))
                return None  # eager first: compiles kernels and grows scratch buffers outside a capture
            if inputs is None:
                pair = (self._buffer(0, hidden.shape, hidden.dtype), self._buffer(1, hidden.shape, hidden.dtype))
                inputs = self._inputs[key] = _Inputs(pair, self._buffer(2, grad_out.shape, grad_out.dtype), tensors)
            inputs.load(tensors)
            entry = self._capture(idx, inputs, call, rest, kwargs, params, hidden_grad)
            if entry is None:
                return None
            self._graphs[(idx, key)] = entry
            self.captured += 1
        inputs.load(tensors)
        if hidden is not inputs.hidden[idx % 2]:  # else the offloader brought it back there
            inputs.hidden[idx % 2].copy_(hidden)
        if grad_out is not inputs.grad:  # else it is the previous layer's graph output, already in place
            inputs.grad.copy_(grad_out)
        entry.graph.replay()
        self.replays += 1
        return entry.hidden_grad, entry.param_grads

    def reload_target(self, idx: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
        """Where the offloader brings layer `idx`'s input back: the buffer its graph reads (None once graphs are off).

        Safe to write when the offloader does, one layer ahead: the buffer of that parity was last read by the
        layer two after it, whose backward the main stream has queued, and the offloader's copy waits for that.
        """
        return self._buffer(idx % 2, shape, dtype) if self.enabled else None

    def settle_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """An eagerly computed input gradient, moved into the gradient buffer: the next layer's graph reads it there,
        and the memory of the one computed is freed now, not a layer later."""
        if not self.enabled:
            return grad
        buffer = self._buffer(2, grad.shape, grad.dtype)
        if buffer is not grad:
            buffer.copy_(grad)  # after every read of the output gradient it may hold: queued on the same stream
        return buffer

    def _buffer(self, role: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Buffer `role` (0, 1: the even, odd layers' input; 2: the gradient) in `shape`."""
        view = self._views.get((role, tuple(shape), dtype))
        if view is not None:
            return view
        numel = math.prod(shape)
        flat = self._flat.get((role, dtype))
        if flat is None or flat.numel() < numel:
            if flat is not None:  # the graphs read the smaller one: the next backward of their key captures again
                self._drop_graphs()
                self._views = {k: v for k, v in self._views.items() if (k[0], k[2]) != (role, dtype)}
                del self._flat[(role, dtype)], flat  # freed before the larger one is allocated
            flat = self._flat[(role, dtype)] = torch.empty(numel, dtype=dtype, device=self.device)
        view = self._views[(role, tuple(shape), dtype)] = flat[:numel].view(shape)
        return view

    def _drop_graphs(self) -> None:
        """Reset every graph; a new pool for the graphs captured from now on (the old one goes with its graphs)."""
        for entry in self._graphs.values():
            entry.graph.reset()  # now, not when the last reference goes (a traceback may hold one)
        self._graphs.clear()
        self._inputs.clear()
        self._pool = torch.cuda.graph_pool_handle()

    def _capture(
        self,
        idx: int,
        inputs: _Inputs,
        call: LayerCall,
        rest: tuple[Any, ...],
        kwargs: dict[str, Any],
        params: tuple[torch.Tensor, ...],
        hidden_grad: bool,
    ) -> _Captured | None:
        shapes = tuple((p.shape, p.dtype) for p in params)
        grads = self._grads.get(shapes)
        if grads is None:
            grads = self._grads[shapes] = [torch.empty_like(p, memory_format=torch.contiguous_format) for p in params]
        statics = iter(inputs.statics())
        static_rest, static_kwargs = _rebuild(rest, statics), _rebuild(kwargs, statics)
        graph = torch.cuda.CUDAGraph()
        began = ended = False
        try:
            if torch.cuda.current_stream(self.device) != self.stream:
                raise RuntimeError("the layers run on a stream other than the graphs': run them in graphed_backward")
            # cuBLAS gives each (thread, stream) a workspace at its first call and keeps it: made in a capture, it
            # would sit in the graphs' pool, which could then never be freed. The eager backward before made it,
            # unless a backward ran on another thread (reentrant): this makes sure.
            eye = torch.eye(8, device=self.device, dtype=torch.bfloat16)
            eye @ eye
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            began = True
            try:
                hidden = inputs.hidden[idx % 2].detach().requires_grad_(hidden_grad)
                out = call(hidden, static_rest, static_kwargs)
                wrt = ([hidden] if hidden_grad else []) + list(params)
                made = list(torch.autograd.grad(out, wrt, inputs.grad, allow_unused=True))
                del out
                written = None
                if hidden_grad:
                    # Overwrites the output gradient it was computed from: every kernel that reads that is queued
                    # before this copy on the one stream
                    written = inputs.grad
                    written.copy_(made.pop(0))
                used = [m is not None for m in made]
                pairs = [(g, m) for g, m in zip(grads, made, strict=True) if m is not None]
                if pairs:
                    torch._foreach_copy_([g for g, _ in pairs], [m for _, m in pairs])
                del made, pairs
            finally:
                graph.capture_end()
                ended = True
        except Exception as err:  # any refusal: the step goes on eagerly, and so does the run
            first = err
            while first.__context__ is not None:  # the first error: what ended the capture, not its aftermath
                first = first.__context__
            self.enabled = False
            text = str(first).strip()
            self.reason = f"{type(first).__name__}: {text.splitlines()[0] if text else ''}"
            log.warning("CUDA graphs of the layers' backward are off for this run: a capture failed (%s)", self.reason)
            self._end_failed_capture(graph, began, ended)
            if isinstance(first, torch.OutOfMemoryError):
                raise first from None  # the memory guard's to handle: its retry runs without graphs
            return None
        param_grads = [g if u else None for g, u in zip(grads, used, strict=True)]
        keep = list(scratch.BUFFERS.values())
        return _Captured(graph, tuple(params), written, param_grads, keep)

    def _end_failed_capture(self, graph: torch.cuda.CUDAGraph, began: bool, ended: bool) -> None:
        """Undo what a failed capture leaves behind: the pool's claim, and the random generator's capture mode.

        A capture that began tells the allocator to record into the graphs' pool and claims that pool; a capture
        that fails to end does neither undo. While the allocator believes a capture is under way it frees no cached
        block, so after a refused capture ~19 GiB stayed reserved through an out-of-memory error, and the pool could
        never be freed. The random generator is registered by every capture and released only by one that ends
        well: after a failed one every random op of the process raised "Offset increment outside graph capture"
        (all seen on an H100, torch 2.11). An empty capture, in a pool of its own, begins and ends it again.
        """
        if ended:  # an error inside a capture that still ended (an allocation refused): a graph, unused
            graph.reset()
        elif began:
            index = torch.cuda.current_device() if self.device.index is None else self.device.index
            # torch 2.11 stops the recording only after the capture ended well; should a torch stop it earlier, the
            # allocator refuses to stop a recording it no longer has
            with contextlib.suppress(RuntimeError):
                torch.cuda.memory._cuda_endAllocateToPool(index, self._pool)
            torch.cuda.memory._cuda_releasePool(index, self._pool)
        try:
            with torch.cuda.stream(self.stream):
                empty = torch.cuda.CUDAGraph()
                empty.capture_begin()
                empty.capture_end()
        except Exception as err:
            log.warning("the CUDA random generator may be left in capture mode: %s", err)

    def release(self) -> None:
        """Drop every graph and buffer; the pool's memory goes back with the last graph reset."""
        self.enabled = False
        self._drop_graphs()
        self._views.clear()
        self._flat.clear()
        self._grads.clear()
        self._seen.clear()
