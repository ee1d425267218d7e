"""GGUF export methods, and k-quants through llama.cpp's own quantizer.

The PyPI `gguf` package quantizes to f32/f16/bf16/q8_0/q4_0/q5_0 with bytes that match ggml's, so
those need nothing beyond our converter. K-quants and i-quants (q4_k_m, iq4_xs, ...) choose a type
per tensor and search per-block scales; only llama.cpp implements them, so they go through
`llama_cpp.llama_model_quantize` (the optional `slimtune[llama-cpp]` extra) from an f16/f32 GGUF.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

from slimtune.core import atomic
from slimtune.core.gguf_types import GGUF_ALIASES, GGUF_NATIVE, GGUF_TYPES

# Methods our numpy converter writes directly (`convert_hf_to_gguf(out_type=...)`); llama.cpp can write
# every type too (the q8_0 byte-equality test compares against it).
CONVERTER_TYPES = GGUF_NATIVE
_LLAMA_FTYPES = {name: t.llama_ftype for name, t in GGUF_TYPES.items()}

# User-facing names (spec values) -> canonical method.
GGUF_METHODS: dict[str, str] = {**{name: name for name in GGUF_TYPES}, **GGUF_ALIASES}

_INSTALL_HINT = "install slimtune[llama-cpp] (pip install 'slimtune[llama-cpp]')"


def resolve_method(name: str) -> str:
    """Map a user's method name (case-insensitive, aliases included) to its canonical lower-case name.

    Raises:
        ValueError: for an unknown name, listing every accepted one.
    """
    key = name.strip().lower()
    if key not in GGUF_METHODS:
        raise ValueError(f"unknown GGUF method {name!r}; choose one of {', '.join(GGUF_METHODS)}")
    return GGUF_METHODS[key]


def needs_llama_cpp(method: str) -> bool:
    """True when `method` can only be produced by llama.cpp's quantizer (k-quants, i-quants)."""
    return resolve_method(method) not in CONVERTER_TYPES


@functools.cache
def llama_cpp_available() -> bool:
    """True when `llama_cpp` imports (its shared library loads), so k-quants and verification can run."""
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError):  # OSError: the wheel is installed but libllama failed to load
        return False
    return True


def require_llama_cpp(purpose: str):
    """Import and return `llama_cpp`, or raise an ImportError that says how to install it."""
    if not llama_cpp_available():
        raise ImportError(f"{purpose} needs llama-cpp-python; {_INSTALL_HINT}")
    import llama_cpp

    return llama_cpp


def quantize_gguf(src: Path, out: Path, method: str) -> Path:
    """Quantize the GGUF `src` (f16 or f32; the first shard of a split file) to `out` with llama.cpp.

    llama.cpp picks per-tensor types for the mixed methods (q4_k_m keeps half of attn_v/ffn_down at
    q6_k) and falls back to a legacy type where a row is not a multiple of 256. The output is written
    to a temporary name beside `out` and renamed when llama.cpp reports success.

    Raises:
        ImportError: when the llama-cpp extra is missing.
        ValueError: for a method llama.cpp cannot produce.
        RuntimeError: when llama.cpp's quantizer fails.
    """
    canonical = resolve_method(method)
    llama_cpp = require_llama_cpp(f"GGUF method {canonical!r}")
    src, out = Path(src), Path(out)
    if not src.is_file():
        raise FileNotFoundError(f"GGUF to quantize not found: {src}; convert the model first")
    out.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, _LLAMA_FTYPES[canonical])
    fd, tmp_name = atomic.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(
                f"llama.cpp failed to quantize {src} to {canonical} (return code {rc}); see llama.cpp's log above"
            )
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
