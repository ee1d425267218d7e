"""Export: HF checkpoint -> GGUF (our converter, llama.cpp k-quants), verification, and the Hub push."""

from slimtune.export.gguf_convert import convert_hf_to_gguf
from slimtune.export.gguf_quantize import (
    GGUF_METHODS,
    llama_cpp_available,
    needs_llama_cpp,
    quantize_gguf,
    resolve_method,
)
from slimtune.export.gguf_verify import GGUFVerifyError, verify_gguf
from slimtune.export.model_card import render_model_card, render_modelfile
from slimtune.export.push import PushError, PushResult, push_folder, resolve_token

__all__ = [
    "GGUF_METHODS",
    "GGUFVerifyError",
    "PushError",
    "PushResult",
    "convert_hf_to_gguf",
    "llama_cpp_available",
    "needs_llama_cpp",
    "push_folder",
    "quantize_gguf",
    "render_model_card",
    "render_modelfile",
    "resolve_method",
    "resolve_token",
    "verify_gguf",
]
