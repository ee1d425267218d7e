"""Launch helpers shared by the kernels: where a kernel may run and how many programs to start.

Triton compiles for CUDA only; on a CPU tensor a kernel runs only in the interpreter, which Triton
decides when `@triton.jit` decorates a function (verified with triton 3.9: `jit()` reads
`knobs.runtime.interpret` at decoration time). That includes Triton's own `tl.sum`, `tl.max`, ...,
decorated when `triton` is first imported, and bitsandbytes, peft and transformers' model modules
all import triton. So on CPU, `TRITON_INTERPRET=1` must be set before any of those imports (at the
top of conftest.py); the check below names that fix instead of failing inside the interpreter.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def interpreter_on() -> bool:
    """True when Triton was asked to interpret kernels (CPU tensors become launchable)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _stdlib_interpreted() -> bool:
    import triton.language as tl  # not at module level: `slimtune.kernels` must not import triton early

    return type(tl.sum).__name__ == "InterpretedFunction"


def check_device(*tensors: torch.Tensor) -> None:
    """Raise a clear error instead of Triton's when a kernel cannot run on these tensors."""
    for t in tensors:
        if t.device.type != "cpu":
            continue
        if not interpreter_on():
            raise RuntimeError(
                "slimtune Triton kernels got a CPU tensor; set TRITON_INTERPRET=1 before triton is first "
                "imported to run them in the interpreter, or move the model to CUDA"
            )
        if not _stdlib_interpreted():
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after triton had been imported (bitsandbytes, peft and "
                "transformers model modules import it), so Triton's own functions are not interpreted; "
                "set it before those imports, e.g. at the top of tests/conftest.py"
            )


def row_block(n: int) -> tuple[int, int]:
    """Block size and warp count for a kernel that holds one row of `n` elements in registers."""
    block = 1 << (n - 1).bit_length()  # next power of two
    # hidden 4096: 8 warps = 256 threads hold 16 fp32 values each, few enough to stay in registers
    warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    return block, warps


def program_count(device: torch.device, rows: int) -> int:
    """Programs for row-parallel reductions with partial sums: a few per SM, never more than rows."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(rows, sms * 4))
    return max(1, min(rows, 4))  # interpreter: fewer launches of bigger loops is faster


class _NoGraph:
    """The `ctx` of a Function's forward run outside autograd: what it saves for backward is dropped with it."""

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        pass

    def mark_dirty(self, *tensors: torch.Tensor) -> None:
        for t in tensors:  # as autograd does: a graph that saved `t` before it changed in place must notice
            torch.autograd.graph.increment_version(t)


def apply_or_forward(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """`fn.apply(*args)`, or with grad mode off its forward called directly.

    Without grad nothing is recorded, yet `Function.apply` still builds a context and unwraps every
    argument (functorch): "unsloth" checkpointing runs each decoder layer's first pass without grad, and
    there the calls of a layer's dozen Functions were host time spent on nothing.
    """
    if torch.is_grad_enabled():
        return fn.apply(*args)
    return fn.forward(_NoGraph(), *args)


def compute_device(model: torch.nn.Module) -> torch.device:
    """The device `model` computes on: its first parameter's that is off the host, else the first's. The tables that
    `host_embedding` and `host_lm_head` keep (or load_4bit loads) in pinned host memory are not where it computes."""
    params = list(model.parameters())
    return next((p.device for p in params if p.device.type != "cpu"), params[0].device)
