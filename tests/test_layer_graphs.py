"""CUDA graphs of checkpointed layers' backward (slimtune.train.step.layer_graphs): when they are used, and that
training through them computes what the eager backward computes."""

from __future__ import annotations

import functools
import gc
import random

import pytest
import torch
from expert_lora import with_expert_lora
from peft import LoraConfig, get_peft_model

from slimtune.data import Example, RowCollator, pack
from slimtune.models.families import FAMILIES
from slimtune.models.lora_targets import lora_target_modules
from slimtune.models.tiny import build_model
from slimtune.train.step.checkpointing import (
    LayerPass,
    _enable,
    enable_checkpointing,
    graphed_backward,
    graphs_refusal,
    stored_layers,
)
from slimtune.train.step.layer_graphs import LayerGraphs

_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_VOCAB = 128


def _lora(dropout: float = 0.0, device: str = "cpu", quantize: bool = False, family: str = "llama", **overrides):
    base = build_model(family, _VOCAB, **overrides).to(device)
    if quantize:
        base = base.to(torch.bfloat16)
        _quantize_nf4(base)
    cfg = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=dropout,
        target_modules=lora_target_modules(family, _TARGETS),
        init_lora_weights=False,  # B random too: every adapter gets a gradient from the first step
    )
    model = get_peft_model(base, cfg).train()
    with_expert_lora(base, family, _TARGETS, r=8, alpha=16, dropout=dropout)  # an MoE's experts, as attach_lora
    return model


def _quantize_nf4(model: torch.nn.Module) -> None:
    import bitsandbytes as bnb

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and name != "lm_head":
                q = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    compute_dtype=torch.bfloat16,
                    device="meta",
                )
                q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4", module=q)
                q.weight._quantize(child.weight.device)
                q.quant_state = q.weight.quant_state
                if child.bias is not None:  # Qwen2's q/k/v
                    q.bias = child.bias
                setattr(module, name, q)
    model.is_loaded_in_4bit = True


def test_refusals_name_the_reason() -> None:
    model = _lora()
    assert "unsloth" in graphs_refusal(model)  # not checkpointed
    with enable_checkpointing(model, True):
        assert "unsloth" in graphs_refusal(model)
    with enable_checkpointing(model, "unsloth"):
        assert "CUDA" in graphs_refusal(model)
        with graphed_backward(model) as graphs:
            assert graphs is None
    dropping = _lora(dropout=0.1, device="cuda" if torch.cuda.is_available() else "cpu")
    with enable_checkpointing(dropping, "unsloth"):
        reason = graphs_refusal(dropping)
        assert reason is not None and ("dropout" in reason or "CUDA" in reason)


@pytest.mark.parametrize(
    "family, named",
    [
        # Gemma 4 layers write keys and values into a dict later layers read (`shared_kv_states`): a replay would not
        ("gemma4_text", "Gemma 4"),
        # an MoE layer runs the experts its batch routes to, chosen on the host: a replay would run the captured ones
        ("qwen3_moe", "mixture of experts"),
        # Qwen3.5's Gated DeltaNet layers restart at each document of a packed row, from position ids they keep aside
        ("qwen3_5_text", "document starts"),
    ],
)
def test_layers_a_replay_cannot_reproduce_stay_eager(family: str, named: str) -> None:
    """Refused by name, on any device, before any capture; a plain Llama is not refused for that reason."""
    model = _lora(family=family, num_hidden_layers=3)
    with enable_checkpointing(model, "unsloth"):
        reason = graphs_refusal(model)
        assert reason is not None and named in reason
        with graphed_backward(model) as graphs:
            assert graphs is None
    llama = _lora(num_hidden_layers=3)
    with enable_checkpointing(llama, "unsloth"):
        assert named not in (graphs_refusal(llama) or "")


def test_varlen_batches_of_one_row_count_share_their_shapes() -> None:
    rng = random.Random(0)
    examples = [Example([1] * n, [1] * n) for n in (rng.randint(2, 60) for _ in range(80))]
    rows = pack(examples, 64)
    collate = RowCollator("packed", 0, flash_varlen=True, packed_length=64)
    shapes, counts = set(), set()
    for i in range(0, len(rows) - 3, 4):
        batch = collate(rows[i : i + 4])
        cu = batch["cu_seq_lens_q"].tolist()
        real = sum(len(r.input_ids) for r in rows[i : i + 4])
        counts.add(sum(len(r.seq_lens) for r in rows[i : i + 4]))
        shapes.add((tuple(batch["input_ids"].shape), len(cu), batch["max_length_q"]))
        assert cu[0] == 0 and cu[-1] == 256 and all(b >= a for a, b in zip(cu, cu[1:], strict=False))
        assert max(b - a for a, b in zip(cu, cu[1:], strict=False)) <= 64 == batch["max_length_q"]
        assert batch["_slimtune_token_counts"] == (real, 256)
    assert len(counts) > 1 and shapes == {((1, 256), 16, 64)}  # example counts differ, shapes do not


def test_padding_longer_than_a_row_is_split_into_row_sized_segments() -> None:
    rows = pack([Example([1] * 3, [1] * 3), Example([2] * 4, [2] * 4), Example([3] * 4, [3] * 4)], 6)
    assert len(rows) == 3  # 11 tokens in 18 slots: 7 of padding, more than a row
    batch = RowCollator("packed", 0, flash_varlen=True, packed_length=6)(rows)
    cu = batch["cu_seq_lens_q"].tolist()
    assert cu[:6] == [0, *[sum(len(r.input_ids) for r in rows[: i + 1]) for i in range(3)], 17, 18]
    assert set(cu[6:]) == {18} and len(cu) == 16 and batch["max_length_q"] == 6
    assert batch["position_ids"][0, 11:].tolist() == [*range(6), 0]


def test_a_key_is_captured_at_its_second_backward_only_on_cuda() -> None:
    # The keying itself, without a GPU: an argument that is no tensor, container or constant is refused.
    from slimtune.train.step.layer_graphs import _flatten, _rebuild, _Unkeyable

    tensors, spec = [], []
    cos = torch.zeros(2)
    _flatten(((cos,), {"cu": cos, "n": 3, "flag": True}), tensors, spec)
    assert len(tensors) == 2 and ("int", 3) in spec and ("bool", True) in spec
    rebuilt = _rebuild(((cos,), {"cu": cos, "n": 3, "flag": True}), iter(["a", "b"]))
    assert rebuilt == (("a",), {"cu": "b", "n": 3, "flag": True})
    with pytest.raises(_Unkeyable):
        _flatten(object(), [], [])


def _train(model, batches, steps_grads: list, graphs_on: bool) -> LayerGraphs | None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    with graphed_backward(model) if graphs_on else _nothing() as graphs:
        for batch in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            params = dict(model.named_parameters())
            steps_grads.append((float(loss), {n: params[n].grad.detach().clone() for n in names}))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return graphs


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _batches(docs: list[int], seed: int = 0, varlen: bool = True, length: int = 256) -> list[dict]:
    """Batches of two `length`-token rows: `docs` examples of 100-200 tokens each per 256 (2-4 in the two rows, 16
    boundaries) or, for a 0, forty of 8-12 tokens (64 boundaries: another input key under varlen attention)."""
    rng = random.Random(seed)
    collate = RowCollator("packed", 0, flash_varlen=varlen, packed_length=length)
    out = []
    for n in docs:
        if n:
            lengths = [rng.randint(100, 200) * length // 256 for _ in range(n)]
        else:
            lengths = [rng.randint(8, 12) for _ in range(40)]
        examples = [
            Example([rng.randrange(_VOCAB) for _ in range(k)], [rng.randrange(_VOCAB) for _ in range(k)])
            for k in lengths
        ]
        rows = pack(examples, length)
        assert len(rows) >= 2
        batch = collate(rows[:2])
        assert not varlen or len(batch["cu_seq_lens_q"]) == (16 if n else 64)
        out.append({k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items() if not k.startswith("_")})
    return out


@pytest.mark.gpu
@pytest.mark.parametrize(
    "family", [f for f in FAMILIES if f not in ("gemma4_text", "qwen3_moe", "gpt_oss", "qwen3_5_text")]
)  # refused: above (gpt_oss is a mixture of experts, as qwen3_moe)
def test_graphed_backward_trains_as_the_eager_backward_does(family: str, monkeypatch) -> None:
    from slimtune.kernels import apply_kernels
    from slimtune.train.step.attention import prefer_varlen

    torch.manual_seed(0)
    layers = 3
    runs = []
    targets: list[bool] = []  # did the offloader bring a layer input back into a graph's buffer?
    reload_target = LayerGraphs.reload_target

    def spy(self, *args):
        target = reload_target(self, *args)
        targets.append(target is not None)
        return target

    monkeypatch.setattr(LayerGraphs, "reload_target", spy)
    for graphs_on in (False, True):
        model = _lora(device="cuda", quantize=True, family=family, num_hidden_layers=layers)
        layer_pass = LayerPass()
        patch = apply_kernels(model, "auto", checkpoint_pass=layer_pass)
        assert "lora_nf4" in patch.applied
        # five batches of one key (16 boundaries), then one of another (64 boundaries under varlen attention; under
        # a block mask, the same shapes: replayed too)
        varlen = prefer_varlen(model, torch.device("cuda"))
        batches = _batches([6, 8, 7, 6, 8, 0], varlen=varlen)
        grads: list = []
        kept: list[bool] = []  # in each first pass: does lora_nf4 keep the adapters' casts for the recompute?
        mlp = model.get_base_model().model.layers[0].mlp
        hook = mlp.register_forward_pre_hook(functools.partial(_record_keeping, kept, layer_pass))
        streams: set[torch.cuda.Stream] = set()  # where the layer ran: first pass, recompute, capture
        spot = mlp.register_forward_pre_hook(functools.partial(_record_stream, streams))
        # every layer's input to the host (the last's: graphed)
        with _enable(model, "unsloth", layer_pass, offload_min_bytes=0):
            graphs = _train(model, batches, grads, graphs_on)
        hook.remove()
        spot.remove()
        runs.append(grads)
        # graphed, the layers ran on the graphs' stream only, captures too: no second cuBLAS workspace
        assert streams == {graphs.stream if graphs_on else torch.cuda.default_stream()}
        # eager, the recompute takes them; graphed, nothing is kept for a replay that would never read it
        assert kept == [not graphs_on] * len(batches)
    assert graphs is not None and graphs.reason is None
    # step 0 eager, step 1 captures each layer and replays, steps 2-4 replay; step 5, a new key of the same shapes
    # under varlen attention, captures at once: no eager backward once the layers' shapes have run
    assert graphs.captured == (2 if varlen else 1) * layers and graphs.replays == 5 * layers
    # under graphs every layer's input went to the host, the last's too, and came back into a graph's buffer: in
    # the eager steps too
    assert targets == [True] * len(batches) * layers
    for step, ((loss_e, eager), (loss_g, graphed)) in enumerate(zip(*runs, strict=True)):
        assert loss_g == pytest.approx(loss_e, rel=1e-3), step
        for name, g in graphed.items():
            ref = eager[name]
            assert ref.abs().sum() > 0, name
            # the same kernels on the same values; flash attention's backward adds in a varying order
            assert float((g - ref).norm() / ref.norm()) < 1e-2, (step, name)


@pytest.mark.gpu
def test_stored_layers_run_their_own_backward_beside_the_graphed_ones() -> None:
    """With the last of three layers stored (`stored_layers`), the graphs capture and replay the two recomputed
    layers only, and the gradients stay those of every layer recomputed eagerly."""
    from slimtune.kernels import apply_kernels
    from slimtune.train.step.attention import prefer_varlen

    runs = []
    for stored in (0, 1):
        torch.manual_seed(0)
        model = _lora(device="cuda", quantize=True, num_hidden_layers=3)
        layer_pass = LayerPass()
        apply_kernels(model, "auto", checkpoint_pass=layer_pass)
        batches = _batches([6, 8, 7, 6], varlen=prefer_varlen(model, torch.device("cuda")))
        grads: list = []
        with _enable(model, "unsloth", layer_pass, offload_min_bytes=0), stored_layers(model, stored) as n:
            assert n == stored
            graphs = _train(model, batches, grads, graphs_on=bool(stored))
        runs.append(grads)
    # step 0 eager, step 1 captures the two recomputed layers and replays them, steps 2-3 replay
    assert graphs is not None and graphs.reason is None
    assert (graphs.captured, graphs.replays) == (2, 3 * 2)
    for step, ((loss_e, eager), (loss_g, graphed)) in enumerate(zip(*runs, strict=True)):
        assert loss_g == pytest.approx(loss_e, rel=1e-3), step
        for name, g in graphed.items():
            assert float((g - eager[name]).norm() / eager[name].norm()) < 1e-2, (step, name)


@pytest.mark.gpu
def test_a_larger_batch_shape_grows_the_buffers_and_captures_again(monkeypatch) -> None:
    """Rows of 128 tokens, then of 256: the graphs captured for the smaller shape are dropped when the buffers
    grow, those of the larger are captured, three buffers of the larger shape remain, and the gradients stay the
    eager backward's."""
    from slimtune.kernels import apply_kernels
    from slimtune.train.step.attention import prefer_varlen

    torch.manual_seed(0)
    layers = 2
    batches = _batches([3, 4, 3], length=128) + _batches([6, 8, 7])
    runs = []
    flats: list[list[int]] = []  # the buffers' sizes when the graphs are released
    release = LayerGraphs.release

    def spy(self):
        flats.append(sorted(flat.numel() for flat in self._flat.values()))
        release(self)

    monkeypatch.setattr(LayerGraphs, "release", spy)
    for graphs_on in (False, True):
        model = _lora(device="cuda", quantize=True, num_hidden_layers=layers)
        layer_pass = LayerPass()
        apply_kernels(model, "auto", checkpoint_pass=layer_pass)
        prefer_varlen(model, torch.device("cuda"))
        grads: list = []
        with _enable(model, "unsloth", layer_pass, offload_min_bytes=0):
            graphs = _train(model, batches, grads, graphs_on)
        runs.append(grads)
    assert graphs is not None and graphs.reason is None
    # each shape: seen, captured, replayed (the last step); the 256 shape captured on grown buffers
    assert graphs.captured == 2 * layers and graphs.replays == 2 * 2 * layers
    hidden = model.get_base_model().config.hidden_size
    assert flats == [[2 * 256 * hidden] * 3]
    for step, ((loss_e, eager), (loss_g, graphed)) in enumerate(zip(*runs, strict=True)):
        assert loss_g == pytest.approx(loss_e, rel=1e-3), step
        for name, g in graphed.items():
            assert float((g - eager[name]).norm() / eager[name].norm()) < 1e-2, (step, name)


def _record_stream(streams: set[torch.cuda.Stream], *_: object) -> None:
    streams.add(torch.cuda.current_stream())


def _record_keeping(kept: list[bool], layer_pass: LayerPass, *_: object) -> None:
    phase = layer_pass()
    if phase != "recompute":
        kept.append(phase == "first")


def _syncing(forward):
    def run(x):
        float(x.sum())  # reads a value on the host: a sync
        return forward(x)

    return run


@pytest.mark.gpu
def test_a_capture_the_graph_refuses_turns_graphs_off_and_the_step_stays_right() -> None:
    from slimtune.kernels import apply_kernels
    from slimtune.train.step.attention import prefer_varlen

    torch.manual_seed(0)
    batches = _batches([6, 7, 8])
    runs = []
    for syncing in (False, True):
        model = _lora(device="cuda", quantize=True, num_hidden_layers=2, hidden_size=256, intermediate_size=512)
        layer_pass = LayerPass()
        apply_kernels(model, "auto", checkpoint_pass=layer_pass)
        prefer_varlen(model, torch.device("cuda"))
        if syncing:  # a host sync in the layer's forward, as code outside slimtune might have: capture refuses it
            mlp = model.get_base_model().model.layers[1].mlp
            mlp.forward = _syncing(mlp.forward)
        grads: list = []
        with enable_checkpointing(model, "unsloth", layer_pass):
            graphs = _train(model, batches, grads, True)
        runs.append((graphs, grads))
    (clean, eager), (refused, fallback) = runs
    assert clean.reason is None and clean.captured == 2
    assert refused.reason is not None and refused.captured == 0 and refused.replays == 0
    torch.randn(4, device="cuda")  # the random generator left capture mode with the failed capture
    torch.nn.functional.dropout(torch.ones(8, device="cuda"), 0.5)
    for (loss_e, ref), (loss_f, got) in zip(eager, fallback, strict=True):
        assert loss_f == pytest.approx(loss_e, rel=1e-3)
        for name, g in got.items():
            assert float((g - ref[name]).norm() / ref[name].norm()) < 1e-2, name
    # released, the graphs' pool keeps no memory; the failed capture gave its claim on the pool back too
    pools = clean._pool, refused._pool
    del runs, clean, refused, eager, fallback, model, mlp, graphs
    assert [_pool_bytes(pool) for pool in pools] == [0, 0]
    # and the allocator knows no capture is under way: it frees cached blocks again
    block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    del block
    cached = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= cached - (1 << 30)


def _pool_bytes(pool: tuple[int, int]) -> int:
    """Bytes the allocator still holds in `pool` after everything freeable was freed."""
    from slimtune.kernels.scratch import release_scratch

    release_scratch()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot() if seg["segment_pool_id"] == pool)


@pytest.mark.gpu
def test_out_of_memory_in_a_capture_reaches_the_caller_and_the_next_run_captures() -> None:
    from slimtune.kernels import apply_kernels

    torch.manual_seed(0)
    batches = _batches([6, 7, 8])
    model = _lora(device="cuda", quantize=True, num_hidden_layers=2, hidden_size=256, intermediate_size=512)
    layer_pass = LayerPass()
    apply_kernels(model, "auto", checkpoint_pass=layer_pass)
    mlp = model.get_base_model().model.layers[1].mlp
    forward = mlp.forward

    def exhausting(x):  # the capture's allocations exceed the device: what a too-large batch meets
        if torch.cuda.is_current_stream_capturing():
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        return forward(x)

    mlp.forward = exhausting
    with enable_checkpointing(model, "unsloth", layer_pass):
        with pytest.raises(torch.OutOfMemoryError):
            _train(model, batches, [], True)
        mlp.forward = forward
        graphs = _train(model, batches, [], True)  # the retry: graphs of its own, captured as usual
    assert graphs is not None and graphs.reason is None and graphs.captured == 2
    torch.randn(4, device="cuda")  # the random generator left the failed capture's mode


@pytest.mark.gpu
def test_consecutive_graphed_runs_do_not_pile_up_memory() -> None:
    """cuBLAS keeps a workspace per (thread, stream) that ran a matmul, and every block runs on a stream of its
    own: the workspaces go as each block begins and ends, so a second run (a benchmark's next batch size, a retry)
    peaks where the first did and leaves as much behind."""
    from slimtune.kernels import apply_kernels

    torch.manual_seed(0)
    batches = _batches([6, 7, 8])
    model = _lora(device="cuda", quantize=True, num_hidden_layers=2, hidden_size=256, intermediate_size=512)
    layer_pass = LayerPass()
    apply_kernels(model, "auto", checkpoint_pass=layer_pass)
    peaks, after = [], []
    with enable_checkpointing(model, "unsloth", layer_pass):
        for _ in range(3):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            graphs = _train(model, batches, [], True)
            assert graphs is not None and graphs.reason is None and graphs.captured == 2
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
            after.append(torch.cuda.memory_allocated())
    # the first run grows the kernels' scratch buffers, which stay; the runs after it start where it ended
    assert peaks[2] <= peaks[1] <= peaks[0] and after[2] == after[1] <= after[0]
