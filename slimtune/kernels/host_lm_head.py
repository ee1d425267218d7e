"""A frozen lm_head kept in pinned host memory, streamed to the GPU in chunks of vocabulary rows for each pass.

Why: vocab 128256 x hidden 4096 in bf16 is 0.98 GiB for Llama-3.1-8B, a sixth of what an 8B step holds on a 6 GiB
card. A frozen head is only read, so it can live on the host and cross the bus once per micro-batch (1 GiB at 8B),
copied on a side stream while the previous chunk's GEMMs run; that time was not measured apart. It is the planner's
last trade (`slimtune.plan.train_settings.head_on_host`): used only where the run does not fit with the head on the
GPU.

The loss reads the head once. Each chunk's logits go through an online softmax (a running max and sum per token, as
flash attention keeps them) and leave, in place, exp(logit - running max), 0 at the label; their product with the
chunk's rows adds into a float32 d(hidden) accumulator rescaled whenever the max moves. At the end d(hidden) =
(acc / sum + (p_label - 1) W[label]) / n: the softmax minus the one-hot, times the head, without a second pass. The
label's term is computed apart in float32 (p_label - 1 = expm1(logit - logsumexp)): a confident prediction's p_label
rounded to bf16 and then less 1 would keep little of it (4.7% error in d(hidden) at p_label ~0.97 on the CPU, against
the fused loss's 1.35%). Gradients are computed during the forward, as in `fused_linear_ce` (the loss is a scalar):
backward only rescales them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from ._launch import check_device
from .host_embedding import gather_rows

# Vocabulary rows copied per chunk: 32 MiB of head at a time, two buffers (one computing, one arriving). The logits
# of a chunk are capped as `fused_linear_ce`'s are (CHUNK_BYTES_CAP), which shrinks the chunk at long sequences.
HEAD_CHUNK_BYTES = 32 << 20
_LOGITS_CHUNK_CAP = 128 << 20


@triton.jit
def _online_softmax_chunk_kernel(
    logits_ptr, labels_ptr, max_ptr, sum_ptr, scale_ptr, target_ptr, n_cols, stride, first_col, BLOCK: tl.constexpr
):
    """Per row of one vocabulary chunk: fold the chunk into the running max and sum, keep the label's logit when
    it falls in the chunk, and overwrite the chunk with exp(x - new max), 0 at the label (its term of d(hidden) is
    added apart, in float32); `scale` = exp(old max - new max)."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    offs = tl.arange(0, BLOCK)
    label = tl.load(labels_ptr + row).to(tl.int64) - first_col
    if (label >= 0) & (label < n_cols):
        tl.store(target_ptr + row, tl.load(base + label).to(tl.float32))
    m_old = tl.load(max_ptr + row)
    m_chunk = tl.full([], -float("inf"), tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m_chunk = tl.maximum(m_chunk, tl.max(x, axis=0))
    m_new = tl.maximum(m_old, m_chunk)
    s = tl.full([], 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        mask = cols < n_cols
        p = tl.exp(tl.load(base + cols, mask=mask, other=-float("inf")).to(tl.float32) - m_new)
        s += tl.sum(p, axis=0)
        tl.store(base + cols, tl.where(cols == label, 0.0, p).to(logits_ptr.dtype.element_ty), mask=mask)
    scale = tl.exp(m_old - m_new)
    tl.store(sum_ptr + row, tl.load(sum_ptr + row) * scale + s)
    tl.store(max_ptr + row, m_new)
    tl.store(scale_ptr + row, scale)


def head_chunk_rows(n_tokens: int, vocab: int, hidden: int, itemsize: int) -> int:
    """Vocabulary rows per chunk: at most `HEAD_CHUNK_BYTES` of head and `_LOGITS_CHUNK_CAP` of logits."""
    rows = min(HEAD_CHUNK_BYTES // (hidden * itemsize), _LOGITS_CHUNK_CAP // (max(n_tokens, 1) * itemsize))
    rows = rows // 128 * 128 if rows >= 256 else max(rows, 16)  # multiples of 128 keep GEMM tiles full
    return min(vocab, rows)


def stream_rows(table: torch.Tensor, device: torch.device, rows: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, the rows on `device`) for each chunk of `rows` rows of `table`, two chunks in flight: the next
    is copied on a side stream while the caller computes with this one. Each yielded chunk is valid until the next
    is requested (its buffer is then refilled). On the table's own device (tests on the CPU) the chunks are views."""
    vocab = table.shape[0]
    if table.device == device:
        for first in range(0, vocab, rows):
            yield first, table[first : first + rows]
        return
    compute, copies = torch.cuda.current_stream(device), torch.cuda.Stream(device)
    # allocated on the compute stream: it waits for every copy before the buffers go back (`finally` below)
    buffers = [torch.empty(min(rows, vocab), table.shape[1], dtype=table.dtype, device=device) for _ in range(2)]
    ready = [torch.cuda.Event() for _ in buffers]
    free = [torch.cuda.Event() for _ in buffers]
    for event in free:
        event.record(compute)

    def issue(i: int) -> None:
        first, buf = i * rows, buffers[i % 2]
        n = min(rows, vocab - first)
        with torch.cuda.stream(copies):
            copies.wait_event(free[i % 2])  # the compute stream is done with this buffer's last chunk
            buf[:n].copy_(table[first : first + n], non_blocking=True)
            ready[i % 2].record(copies)

    chunks = -(-vocab // rows)
    issue(0)
    try:
        for i in range(chunks):
            if i + 1 < chunks:
                issue(i + 1)
            compute.wait_event(ready[i % 2])
            yield i * rows, buffers[i % 2][: min(rows, vocab - i * rows)]
            free[i % 2].record(compute)
    finally:
        # left early too (the caller ran out of memory): a copy still queued must not write into a freed buffer
        compute.wait_stream(copies)


class _HostHeadCEFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, table, labels, ignore_index, num_items, grad_enabled, chunk_rows):
        check_device(hidden)
        h2 = hidden.reshape(-1, hidden.shape[-1])
        lab = labels.reshape(-1).to(h2.device)
        if lab.shape[0] != h2.shape[0]:
            raise ValueError(f"labels have {lab.shape[0]} tokens but hidden states have {h2.shape[0]}")
        n_tok, vocab = h2.shape[0], table.shape[0]
        need_dh = grad_enabled and ctx.needs_input_grad[0]
        f32 = dict(dtype=torch.float32, device=h2.device)
        running_max = torch.full((n_tok,), -float("inf"), **f32)
        running_sum, scale, target = torch.zeros(n_tok, **f32), torch.empty(n_tok, **f32), torch.zeros(n_tok, **f32)
        acc = torch.zeros(n_tok, h2.shape[1], **f32) if need_dh else None
        rows = chunk_rows or head_chunk_rows(n_tok, vocab, h2.shape[1], h2.element_size())
        logits_buf = torch.empty(n_tok * min(rows, vocab), dtype=h2.dtype, device=h2.device)
        block = min(4096 if h2.device.type == "cuda" else 1024, triton.next_power_of_2(min(rows, vocab)))
        for first, w in stream_rows(table, h2.device, rows):
            w = w.to(h2.dtype)  # as the fused loss casts its head
            logits = logits_buf[: n_tok * w.shape[0]].view(n_tok, w.shape[0])  # contiguous for the last chunk too
            torch.matmul(h2, w.t(), out=logits)
            if n_tok:
                _online_softmax_chunk_kernel[(n_tok,)](
                    logits,
                    lab,
                    running_max,
                    running_sum,
                    scale,
                    target,
                    w.shape[0],
                    logits.stride(0),
                    first,
                    BLOCK=block,
                    num_warps=8,
                )
            if need_dh:
                acc.mul_(scale[:, None]).add_(logits @ w)
        del logits_buf
        supervised = lab != ignore_index
        n = supervised.sum() if num_items is None else torch.as_tensor(num_items, device=h2.device)
        inv_n = 1.0 / n.clamp(min=1).to(torch.float32)
        lse = running_max + running_sum.log()
        losses = torch.where(supervised, lse - target, 0.0)
        dh = None
        if need_dh:
            # d(hidden) = sum_j (p_j - [j = label]) W_j: the label's coefficient p - 1 = expm1(target - lse) in float32,
            # since a bf16 p near 1 would leave little of it (acc holds every other row's p_j W_j)
            label_rows = gather_rows(table, torch.where(supervised, lab, 0))
            coef = torch.where(supervised, torch.expm1(target - lse), 0.0)  # not inf x 0 on an ignored row
            acc.div_(running_sum[:, None]).addcmul_(label_rows, coef[:, None])
            dh = acc.mul_(torch.where(supervised, inv_n, 0.0)[:, None]).to(h2.dtype)
        ctx.save_for_backward(dh)
        ctx.hidden_shape = hidden.shape
        return losses.sum() * inv_n

    @staticmethod
    def backward(ctx, grad_out):
        (dh,) = ctx.saved_tensors
        dhidden = (dh * grad_out.to(dh.dtype)).view(ctx.hidden_shape) if dh is not None else None
        return dhidden, None, None, None, None, None, None


def host_head_cross_entropy(
    hidden: torch.Tensor,
    table: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ table^T` against `labels`, the frozen head `table` [V, H] read once from
    (pinned) host memory in chunks of `chunk_rows` vocabulary rows (default `head_chunk_rows`). Same contract as
    `fused_linear_ce.fused_linear_cross_entropy`; no gradient for the table (it is frozen)."""
    return _HostHeadCEFn.apply(
        hidden, table, labels, ignore_index, num_items_in_batch, torch.is_grad_enabled(), chunk_rows
    )


def host_head_logits(hidden: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`hidden @ table^T` with the (pinned host) head streamed in chunks: the plain forward (generation, a
    caller that wants logits). Not for training: its chunks are refilled as it goes, so autograd could not keep them
    (training reads the head through the fused loss, `host_head_cross_entropy`).

    Raises:
        RuntimeError: `hidden` needs a gradient.
    """
    if hidden.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            "the host lm_head gives logits without gradients; training reads it through the fused loss "
            "(fused_linear_ce), which this model did not apply"
        )
    h2 = hidden.reshape(-1, hidden.shape[-1])
    out = torch.empty(h2.shape[0], table.shape[0], dtype=hidden.dtype, device=hidden.device)
    rows = head_chunk_rows(h2.shape[0], table.shape[0], table.shape[1], table.element_size())
    for first, w in stream_rows(table, hidden.device, rows):
        out[:, first : first + w.shape[0]] = h2 @ w.t()
    return out.view(*hidden.shape[:-1], table.shape[0])
