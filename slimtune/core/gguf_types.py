"""The GGUF output types: one table that the spec, the estimates and the exporters all read.

`writer` says who writes the type: "native" is our converter (the `gguf` package's numpy quantizers,
byte-identical to ggml), "llama.cpp" is llama.cpp's own quantizer (k-quants and i-quants choose a type
per tensor), which starts from an f16 GGUF, so those types need that intermediate file on disk.
Bytes per weight: exact block sizes for the fixed types (block bytes / block weights); for the
llama.cpp mixes, the file sizes llama.cpp's quantize tool lists for Llama-3-8B (8.03e9 weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class GgufType:
    """One GGUF output type."""

    name: str
    writer: Literal["native", "llama.cpp"]
    bytes_per_weight: float
    llama_ftype: str  # llama.cpp's LLAMA_FTYPE_* constant (llama.cpp can write every type)

    @property
    def needs_f16_intermediate(self) -> bool:
        """llama.cpp quantizes from an f16 GGUF that must be written first."""
        return self.writer == "llama.cpp"


_GIB_8B = 1024**3 / 8.03e9  # GiB of a Llama-3-8B file -> bytes per weight
GGUF_TYPES: dict[str, GgufType] = {
    t.name: t
    for t in (
        GgufType("f32", "native", 4.0, "LLAMA_FTYPE_ALL_F32"),
        GgufType("f16", "native", 2.0, "LLAMA_FTYPE_MOSTLY_F16"),
        GgufType("bf16", "native", 2.0, "LLAMA_FTYPE_MOSTLY_BF16"),
        GgufType("q8_0", "native", 34 / 32, "LLAMA_FTYPE_MOSTLY_Q8_0"),
        GgufType("q4_0", "native", 18 / 32, "LLAMA_FTYPE_MOSTLY_Q4_0"),
        GgufType("q5_0", "native", 22 / 32, "LLAMA_FTYPE_MOSTLY_Q5_0"),
        GgufType("q2_k", "llama.cpp", 2.63 / 8, "LLAMA_FTYPE_MOSTLY_Q2_K"),
        GgufType("q3_k_s", "llama.cpp", 3.41 * _GIB_8B, "LLAMA_FTYPE_MOSTLY_Q3_K_S"),
        GgufType("q3_k_m", "llama.cpp", 3.91 / 8, "LLAMA_FTYPE_MOSTLY_Q3_K_M"),
        GgufType("q3_k_l", "llama.cpp", 4.03 * _GIB_8B, "LLAMA_FTYPE_MOSTLY_Q3_K_L"),
        GgufType("q4_k_s", "llama.cpp", 4.37 * _GIB_8B, "LLAMA_FTYPE_MOSTLY_Q4_K_S"),
        GgufType("q4_k_m", "llama.cpp", 4.85 / 8, "LLAMA_FTYPE_MOSTLY_Q4_K_M"),
        GgufType("q5_k_s", "llama.cpp", 5.21 * _GIB_8B, "LLAMA_FTYPE_MOSTLY_Q5_K_S"),
        GgufType("q5_k_m", "llama.cpp", 5.69 / 8, "LLAMA_FTYPE_MOSTLY_Q5_K_M"),
        GgufType("q6_k", "llama.cpp", 210 / 256, "LLAMA_FTYPE_MOSTLY_Q6_K"),
        GgufType("iq4_xs", "llama.cpp", 4.25 / 8, "LLAMA_FTYPE_MOSTLY_IQ4_XS"),
        GgufType("iq4_nl", "llama.cpp", 4.50 / 8, "LLAMA_FTYPE_MOSTLY_IQ4_NL"),
    )
}
GGUF_NATIVE: tuple[str, ...] = tuple(n for n, t in GGUF_TYPES.items() if t.writer == "native")
GGUF_LLAMA_CPP: tuple[str, ...] = tuple(n for n, t in GGUF_TYPES.items() if t.writer == "llama.cpp")
# User-facing aliases (Unsloth's `save_pretrained_gguf` names) -> canonical type.
GGUF_ALIASES: dict[str, str] = {"not_quantized": "f16", "fast_quantized": "q8_0", "quantized": "q4_k_m"}
