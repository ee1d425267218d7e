"""lm_head matmul and cross-entropy in chunks of tokens, so full logits never exist.

For vocab 128256 and 8192 tokens the fp32 logits Hugging Face builds in its loss are 4 GiB (2 GiB
more for the bf16 logits the model returns, plus their gradient). Here one chunk of tokens at a time
goes through `hidden @ W^T`; a Triton kernel turns that chunk's logits into its loss and, in place,
into d(loss)/d(logits); two matmuls fold that into d(hidden) (and d(W) when the head is trained),
and the chunk buffer is reused. Gradients are computed during the forward pass (the loss is a
scalar, so backward only rescales them): peak extra memory is one chunk of logits plus d(hidden).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import check_device
from .host_lm_head import host_head_cross_entropy

# 512 tokens x 128256 vocab in bf16. At 1B batch 1 the chunk is the step's memory peak: half the earlier 256 MiB
# took it from 1.51 to 1.45 GiB (Unsloth: 1.47). Smaller chunks cost time: forward + backward at 8B's hidden size
# took +0.49 ms for 2048 tokens and +0.37 ms for 8192, in steps of 0.23 and 0.71 s (H100,
# benchmarks/kernels_bench.py --kernels fused_linear_ce; the performance table of docs/performance.md)
CHUNK_BYTES_CAP = 128 << 20
_CHUNK_BYTES_FLOOR = 32 << 20


@triton.jit
def _ce_rows_kernel(logits_ptr, labels_ptr, loss_ptr, inv_n_ptr, n_vocab, stride, ignore_index, BLOCK: tl.constexpr):
    """Per row: loss = logsumexp(x) - x[label]; row overwritten with (softmax(x) - onehot(label)) / n."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    label = tl.load(labels_ptr + row).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if label == ignore_index:
        for start in range(0, n_vocab, BLOCK):
            cols = start + offs
            tl.store(
                base + cols, tl.zeros([BLOCK], dtype=tl.float32).to(logits_ptr.dtype.element_ty), mask=cols < n_vocab
            )
        tl.store(loss_ptr + row, 0.0)
    else:
        m = tl.full([], -float("inf"), tl.float32)  # typed scalars: loop-carried values keep one type
        s = tl.full([], 0.0, tl.float32)
        for start in range(0, n_vocab, BLOCK):  # online logsumexp: one read of the row
            cols = start + offs
            x = tl.load(base + cols, mask=cols < n_vocab, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        lse = m + tl.log(s)
        target = tl.load(base + label).to(tl.float32)
        tl.store(loss_ptr + row, lse - target)
        # 1/n applied in fp32 before the gradient is rounded to the logits dtype: scaling bf16 gradients
        # afterwards would round 1/n itself to 8 bits, a bias of up to 0.4% on every gradient
        inv_n = tl.load(inv_n_ptr)
        for start in range(0, n_vocab, BLOCK):
            cols = start + offs
            mask = cols < n_vocab
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            g = (tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)) * inv_n
            tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)


def chunk_tokens_for(n_tokens: int, vocab: int, dtype: torch.dtype, device: torch.device) -> int:
    """Tokens per chunk: logits of one chunk fit in 1/8 of free memory, capped at `CHUNK_BYTES_CAP`."""
    budget = CHUNK_BYTES_CAP
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = max(_CHUNK_BYTES_FLOOR, min(CHUNK_BYTES_CAP, free // 8))
    rows = budget // (vocab * dtype.itemsize)
    rows = max(16, rows // 128 * 128 if rows >= 128 else rows)  # multiples of 128 keep GEMM tiles full
    return min(n_tokens, rows)


class _FusedLinearCEFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk_tokens, num_items, grad_enabled):
        check_device(hidden)
        h2 = hidden.reshape(-1, hidden.shape[-1])
        lab = labels.reshape(-1)
        if lab.shape[0] != h2.shape[0]:
            raise ValueError(f"labels have {lab.shape[0]} tokens but hidden states have {h2.shape[0]}")
        n_tok, vocab = h2.shape[0], weight.shape[0]
        w = weight if weight.dtype == h2.dtype else weight.to(h2.dtype)
        chunk = chunk_tokens or chunk_tokens_for(n_tok, vocab, h2.dtype, h2.device)
        # needs_input_grad stays True under no_grad (evaluation): skip the gradient matmuls there
        need_dh, need_dw = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        dh = torch.empty_like(h2) if need_dh else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=h2.device) if need_dw else None
        losses = torch.empty(n_tok, dtype=torch.float32, device=h2.device)
        # n counts supervised tokens; HF's loss divides by num_items_in_batch under accumulation instead.
        # It stays on the device: no host sync per step
        n = (lab != ignore_index).sum() if num_items is None else torch.as_tensor(num_items, device=h2.device)
        n = n.clamp(min=1).to(torch.float32).reshape(1)  # no supervised token: loss 0, not nan
        inv_n = 1.0 / n
        buf = torch.empty(min(chunk, n_tok), vocab, dtype=h2.dtype, device=h2.device)
        block = min(4096 if h2.device.type == "cuda" else 1024, triton.next_power_of_2(vocab))
        for start in range(0, n_tok, chunk):
            hc = h2[start : start + chunk]
            logits = buf[: hc.shape[0]]
            torch.matmul(hc, w.t(), out=logits)
            _ce_rows_kernel[(hc.shape[0],)](
                logits,
                lab[start : start + chunk].contiguous(),
                losses[start : start + chunk],
                inv_n,
                vocab,
                logits.stride(0),
                ignore_index,
                BLOCK=block,
                num_warps=8,
            )
            if need_dh:
                torch.matmul(logits, w, out=dh[start : start + chunk])
            if need_dw:
                dw += (logits.t() @ hc).float()
        del buf
        ctx.save_for_backward(dh, dw)
        ctx.hidden_shape, ctx.weight_dtype = hidden.shape, weight.dtype
        return losses.sum() * inv_n[0]

    @staticmethod
    def backward(ctx, grad_out):
        dh, dw = ctx.saved_tensors
        # grad_out is 1 in plain training (exact in bf16); 1/n already sits in the saved gradients
        dhidden = (dh * grad_out.to(dh.dtype)).view(ctx.hidden_shape) if dh is not None else None
        dweight = (dw * grad_out.float()).to(ctx.weight_dtype) if dw is not None else None
        return dhidden, dweight, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight^T` against `labels`, without materialising the logits.

    Args:
        hidden: [..., H] final hidden states, aligned with `labels` (position i predicts labels[i]).
        weight: [V, H] lm_head weight; a frozen one in host memory (the `host_lm_head` kernel) is streamed to the
            hidden states' GPU in vocabulary chunks (`host_lm_head.host_head_cross_entropy`).
        labels: [...] target ids; `ignore_index` marks prompt/padding tokens (completion-only masks).
        chunk_tokens: tokens per chunk; default from free GPU memory (see `chunk_tokens_for`). A host head is
            chunked by vocabulary rows instead (`host_lm_head.head_chunk_rows`).
        num_items_in_batch: divisor for the summed loss (gradient accumulation); default the number
            of supervised tokens.
    """
    if weight.device != hidden.device:
        return host_head_cross_entropy(hidden, weight, labels, ignore_index, num_items_in_batch)
    return _FusedLinearCEFn.apply(
        hidden, weight, labels, ignore_index, chunk_tokens, num_items_in_batch, torch.is_grad_enabled()
    )


def causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal-LM loss from unshifted `labels` [B, T], shifting as transformers' `ForCausalLMLoss` does."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return fused_linear_cross_entropy(
        hidden, weight, shifted.to(hidden.device), ignore_index, num_items_in_batch=num_items_in_batch
    )


def reference_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Full-logits version (fp32 upcast, as transformers' loss does), for tests and benchmarks."""
    logits = (hidden @ weight.to(hidden.dtype).t()).float().reshape(-1, weight.shape[0])
    loss = torch.nn.functional.cross_entropy(logits, labels.reshape(-1), ignore_index=ignore_index, reduction="sum")
    n = (labels != ignore_index).sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
    return loss / n.clamp(min=1).to(loss.device, torch.float32)
