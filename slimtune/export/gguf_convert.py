"""Hugging Face safetensors -> GGUF for every family of `slimtune.models.families`, on the PyPI `gguf` package.

Tensors are streamed: every tensor's GGUF name, type and byte size is planned from the safetensors
headers alone, the header is written, and then each tensor is read, transformed, quantized and written
before the next is read, so memory is bounded by the largest tensor (about 3x it: the source, its f32
copy and the quantized bytes), never by the model.

Nothing here is per architecture: tensor names come from `gguf`'s own tables (`TensorNameMap` for the
HF name, `MODEL_TENSORS[arch]` for what llama.cpp's architecture has), and the family row says the rest.
Layout differences from HF that llama.cpp expects:
- LLAMA-style rope (Llama, Mistral, Granite): q_proj/k_proj rows are permuted from HF's "rotate half"
  order to llama.cpp's interleaved rope pairs (per head, rows [0..d/2) and [d/2..d) are interleaved).
- Gemma RMSNorms multiply by (1 + w); llama.cpp multiplies by w, so 1 is added to every norm weight.
- Llama-3 rope scaling becomes a `rope_freqs` tensor of per-frequency divisors.
- Phi-3 longrope becomes `rope_factors_long` / `rope_factors_short` tensors and a cos/sin attn_factor.
- Architectures without an output tensor in llama.cpp (the Gemmas) read the embeddings instead.
- Qwen3.5's Gated DeltaNet tensors: `slimtune.export.gguf_deltanet`.
- Mixture-of-experts checkpoints store each expert's projections apart; llama.cpp reads one 3-D tensor per layer
  and projection (`slimtune.export.gguf_experts`), so memory is bounded by one layer's stacked projection.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from slimtune.core import atomic
from slimtune.export.gguf_deltanet import deltanet_tensor
from slimtune.export.gguf_experts import FusedPart, expert_stacks, fused_expert_parts, stack_loader, stack_shape
from slimtune.export.gguf_quantize import CONVERTER_TYPES
from slimtune.export.gguf_tokenizer import add_tokenizer
from slimtune.export.gguf_write import Q, write_tensors
from slimtune.models.families import BY_ARCHITECTURE, Family
from slimtune.models.family_configs import full_attention_head_dim
from slimtune.models.multimodal import layout_of, text_key, trained_config

_FT = gguf.LlamaFileType
_OUT_TYPES = {
    "f32": (Q.F32, _FT.ALL_F32),
    "f16": (Q.F16, _FT.MOSTLY_F16),
    "bf16": (Q.BF16, _FT.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, _FT.MOSTLY_Q8_0),
    "q4_0": (Q.Q4_0, _FT.MOSTLY_Q4_0),
    "q5_0": (Q.Q5_0, _FT.MOSTLY_Q5_0),
}
assert set(_OUT_TYPES) == set(CONVERTER_TYPES)


@dataclass
class _Planned:
    name: str
    source: Callable[[], np.ndarray]  # loads and transforms the f32 data when it is its turn
    shape: tuple[int, ...]
    qtype: Q


def convert_hf_to_gguf(
    model_dir: Path,
    out_path: Path,
    out_type: str = "f16",
    *,
    split_max_bytes: int | None = None,
    name: str | None = None,
    tokenizer_as_is: bool = False,
) -> list[Path]:
    """Convert the HF checkpoint in `model_dir` to GGUF at `out_path` and return the written file(s).

    Args:
        model_dir: a `save_pretrained` directory (config.json, *.safetensors, tokenizer.json).
        out_path: the GGUF file; with splitting, shards are named `<stem>-00001-of-0000N.gguf` beside it
            (llama.cpp's gguf-split naming, which llama.cpp needs to find the other shards).
        out_type: f32, f16, bf16, q8_0, q4_0 or q5_0; k-quants come from `quantize_gguf` on an f16 file.
        split_max_bytes: start a new shard before tensor data would exceed this many bytes.
        name: `general.name`, which llama.cpp and Ollama display (the flow passes the run's name; the merged
            folder is always called "merged"); default: the folder name.
        tokenizer_as_is: write the closest llama.cpp tokenizer where no exact one exists
            (`export.gguf_tokenizer: as_is`) instead of raising UnsupportedTokenizerError.

    Raises:
        ValueError: unknown out_type, unsupported architecture, rope type or tensor name.
        UnsupportedTokenizerError: when llama.cpp could not tokenize exactly like the HF tokenizer.
    """
    model_dir, out_path = Path(model_dir), Path(out_path)
    if out_type not in _OUT_TYPES:
        raise ValueError(
            f"out_type {out_type!r} is not written by the converter; use one of "
            f"{', '.join(_OUT_TYPES)} (k-quants: convert to f16, then quantize_gguf)"
        )
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    multimodal = layout_of(config) is not None
    config = trained_config(config)  # a multimodal checkpoint: its language model, written as the text family
    arch_name = (config.get("architectures") or ["?"])[0]
    if arch_name not in BY_ARCHITECTURE:
        raise ValueError(
            f"{model_dir / 'config.json'}: architecture {arch_name!r} is not supported by the "
            f"GGUF converter; supported: {', '.join(BY_ARCHITECTURE)}"
        )
    family = BY_ARCHITECTURE[arch_name]
    problem = family.check_config(config) if family.check_config else None
    if problem:
        raise ValueError(f"{model_dir / 'config.json'}: {problem}")
    default_qtype, file_type = _OUT_TYPES[out_type]

    out_path.parent.mkdir(parents=True, exist_ok=True)
    atomic.sweep_leftovers(out_path.parent, out_path.stem)  # a conversion killed earlier left these
    tmp_dir = atomic.mkdtemp(prefix=f".{out_path.stem}.", suffix=".tmp", dir=out_path.parent)
    writer = gguf.GGUFWriter(
        tmp_dir / out_path.name, family.gguf_name, split_max_size=split_max_bytes or 0
    )  # opens nothing until the header
    try:
        plan = list(_plan_tensors(model_dir, config, family, default_qtype, multimodal))
        n_vocab = next(p.shape[0] for p in plan if p.name == "token_embd.weight")
        _add_hparams(writer, config, family, _model_name(name or model_dir.name), file_type, n_vocab)
        add_tokenizer(writer, model_dir, n_vocab, strict=not tokenizer_as_is)
        return write_tensors(writer, [(p.name, p.shape, p.qtype, p.source) for p in plan], out_path, tmp_dir)
    finally:
        writer.close()
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _plan_tensors(
    model_dir: Path, config: dict[str, Any], family: Family, default_qtype: Q, multimodal: bool
) -> Iterator[_Planned]:
    from safetensors import safe_open

    n_layers = config["num_hidden_layers"]
    n_head = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads", n_head)
    known = gguf.MODEL_TENSORS[family.gguf_arch]  # the tensors llama.cpp's architecture loads
    # no output tensor in the architecture (the Gemmas): llama.cpp always reads the embeddings there
    tied = bool(config.get("tie_word_embeddings", family.tied_default)) or gguf.MODEL_TENSOR.OUTPUT not in known
    name_map = gguf.get_tensor_name_map(family.gguf_arch, n_layers)

    rope_freqs = _llama3_rope_factors(config)
    if rope_freqs is None:
        rope_freqs = _proportional_rope_factors(config)
    if rope_freqs is not None:
        yield _Planned(
            gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", lambda: rope_freqs, rope_freqs.shape, Q.F32
        )
    for name, factors in _longrope_factors(config, family):
        yield _Planned(name, lambda f=factors: f, factors.shape, Q.F32)
    tensors = []
    for file, stored in _safetensors_keys(model_dir):
        key = text_key(stored) if multimodal else stored
        if key is not None:  # None: a vision tower or projector weight, which llama.cpp reads from an mmproj file
            tensors.append((file, stored, key))
    hparams = family.gguf_hparams(config) if family.gguf_hparams else {}
    stacks = expert_stacks(tensors, hparams.get(gguf.Keys.LLM.EXPERT_COUNT))
    for file, stored, key in tensors:
        if key.endswith("rotary_emb.inv_freq") or (tied and key == "lm_head.weight"):
            continue  # recomputed by llama.cpp / shared with token_embd
        stack = stacks.get(stored)
        if stack and stack.members[0][1] != stored:
            continue  # an expert's tensor: its layer's stack is planned once, at expert 0
        if stack:
            shape = stack_shape(stack)
        else:
            with safe_open(file, framework="pt") as f:
                shape = tuple(f.get_slice(stored).get_shape())
        if family.fused_experts and (parts := fused_expert_parts(key, shape)) is not None:
            yield from _fused_expert_plans(parts, file, stored, name_map, known, family, default_qtype)
            continue
        # Qwen3.5's Gated DeltaNet tensors have their own layout (slimtune.export.gguf_deltanet)
        deltanet = deltanet_tensor(key, shape, config) if ".linear_attn." in key else None
        lookup = deltanet.key if deltanet else stack.key if stack else key
        name = name_map.get_name(lookup, try_suffixes=(".weight", ".bias"))
        kind = name_map.get_type(lookup, try_suffixes=(".weight", ".bias"))
        if name is None or kind not in known:
            raise ValueError(
                f"{file.name}: tensor {key!r} has no GGUF name for {family.gguf_name}; "
                "the checkpoint has modules the converter does not know"
            )
        if not name.endswith((".weight", ".bias")) and not (deltanet and deltanet.bare):
            name += ".weight"  # a bare parameter or buffer (Gemma 4's layer_scalar): llama.cpp names it .weight
        if deltanet:
            qtype = _tensor_qtype(name, deltanet.shape, default_qtype, tied)
            yield _Planned(name, _loader(file, stored, deltanet.transform), deltanet.shape, qtype)
            continue
        transform = _transform_for(lookup, family, n_head, n_kv)
        load = stack_loader(stack, shape, transform) if stack else _loader(file, stored, transform)
        yield _Planned(name, load, shape, _tensor_qtype(name, shape, default_qtype, tied))


def _fused_expert_plans(
    parts: list[FusedPart],
    file: Path,
    stored: str,
    name_map: gguf.TensorNameMap,
    known: list[gguf.MODEL_TENSOR],
    family: Family,
    default_qtype: Q,
) -> Iterator[_Planned]:
    """gpt-oss's fused expert tensor as llama.cpp's gate/up/down expert tensors (`fused_expert_parts`)."""
    for part in parts:
        name = name_map.get_name(part.key, try_suffixes=(".weight", ".bias"))
        if name is None or name_map.get_type(part.key, try_suffixes=(".weight", ".bias")) not in known:
            raise ValueError(f"{file.name}: tensor {stored!r} has no GGUF name for {family.gguf_name}")
        qtype = _tensor_qtype(name, part.shape, default_qtype, False)  # the 2-D expert biases: f32
        yield _Planned(name, _loader(file, stored, part.transform), part.shape, qtype)


def _safetensors_keys(model_dir: Path) -> Iterator[tuple[Path, str]]:
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {model_dir}; save the model with save_pretrained(dir, safe_serialization=True)"
        )
    for file in files:
        with safe_open(file, framework="pt") as f:
            keys = list(f.keys())
        for key in keys:
            yield file, key


def _loader(file: Path, key: str, transform: Callable[[np.ndarray], np.ndarray]) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        from safetensors import safe_open

        with safe_open(file, framework="pt") as f:
            data = f.get_tensor(key).float().numpy()
        return transform(data)

    return load


def _transform_for(key: str, family: Family, n_head: int, n_kv: int) -> Callable[[np.ndarray], np.ndarray]:
    if family.permute_qk and key.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return lambda w: permute_rope_rows(w, n_head)
    if family.permute_qk and key.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
        return lambda w: permute_rope_rows(w, n_kv)
    if family.norm_offset and key.endswith("norm.weight"):
        return lambda w: w + family.norm_offset
    return lambda w: w


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder each head's rows from HF's halves (x0..x{d/2-1}, y0..) to pairs (x0, y0, x1, y1, ...)."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Kept f32 whatever the output type, as llama.cpp's converter forces them (conversion/base.py, prepare_tensors)
# and its quantizer never requantizes them (src/llama-quant.cpp): an 8-bit MoE router flips near-tied expert
# choices, and ggml's ssm_conv reads only f32.
_F32_KINDS = frozenset(
    gguf.TENSOR_NAMES[kind].removeprefix("blk.{bid}.")
    for kind in (
        gguf.MODEL_TENSOR.FFN_GATE_INP,
        gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP,
        gguf.MODEL_TENSOR.POS_EMBD,
        gguf.MODEL_TENSOR.TOKEN_TYPES,
        gguf.MODEL_TENSOR.SSM_CONV1D,
    )
)


def _tensor_qtype(name: str, shape: tuple[int, ...], default: Q, tied: bool) -> Q:
    """The GGUF type of tensor `name` in a file of type `default`, by llama.cpp's converter's rules: 1-D tensors,
    norms, anything not a `.weight` (biases, Qwen3.5's bare `ssm_a`) and `_F32_KINDS` stay f32."""
    kind = re.sub(r"^blk\.\d+\.", "", name).removesuffix(".weight")
    if len(shape) < 2 or not name.endswith(".weight") or name.endswith("_norm.weight") or kind in _F32_KINDS:
        return Q.F32
    if default in (Q.F32, Q.F16, Q.BF16):
        return default
    block = gguf.GGML_QUANT_SIZES[default][0]
    if shape[-1] % block:
        return Q.F16  # a row that is not a whole number of 32-value blocks cannot be block-quantized
    output = name == "output.weight" or (tied and name == "token_embd.weight")
    # The output projection sets every logit directly; 4/5-bit there costs far more quality than
    # anywhere else, so it stays at 8 bits (llama.cpp's quantizer keeps it at q6_k for the same reason).
    if output and default in (Q.Q4_0, Q.Q5_0):
        return Q.Q8_0
    return default


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from transformers 5 `rope_parameters` or older `rope_scaling`."""
    params = config.get("rope_parameters") or {}
    params = params.get("full_attention", params)  # Gemma 3: per layer type; global layers carry the scaling
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    scaling = params if params.get("rope_type", "default") != "default" else config.get("rope_scaling")
    if scaling and (scaling.get("rope_type") or scaling.get("type")) == "default":
        scaling = None
    return theta, scaling


def _llama3_rope_factors(config: dict[str, Any]) -> np.ndarray | None:
    theta, scaling = _rope(config)
    if not scaling or (scaling.get("rope_type") or scaling.get("type")) != "llama3":
        return None
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = (old_ctx / wavelen - low) / (high - low)
    # llama.cpp divides each rope frequency by its factor: 1 for short wavelengths, `factor` for long
    # ones, and the same smooth blend in between that transformers applies to inv_freq.
    factors = np.where(
        wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, 1.0 / ((1 - smooth) / factor + smooth))
    )
    return factors.astype(np.float32)


def _proportional_rope_factors(config: dict[str, Any]) -> np.ndarray | None:
    """Gemma 4's global layers rotate the first `partial_rotary_factor` of each half-head with frequencies of the
    whole head ("proportional" rope). ggml's NEOX rope rotates the first n_rot dimensions, so llama.cpp rotates the
    whole head and divides the frequencies of the unrotated pairs by 1e30 (its converter's rope_freqs tensor)."""
    params = (config.get("rope_parameters") or {}).get("full_attention") or {}
    if params.get("rope_type") != "proportional":
        return None
    head_dim = full_attention_head_dim(config)
    rotated = int(head_dim * float(params.get("partial_rotary_factor", 1.0)) / 2)
    return np.array([1.0] * rotated + [1e30] * (head_dim // 2 - rotated), dtype=np.float32)


def _longrope_factors(config: dict[str, Any], family: Family) -> list[tuple[str, np.ndarray]]:
    """Longrope's per-frequency divisors as llama.cpp's rope_factors_long/short tensors (empty without longrope).

    transformers divides each rotary frequency by short_factor while the sequence fits in
    original_max_position_embeddings and by long_factor beyond it; llama.cpp picks the tensor once, by the
    context it was loaded with (long when n_ctx exceeds the original length). The two agree wherever the
    sequence and the context are on the same side of that length.
    """
    _, scaling = _rope(config)
    if not scaling or (scaling.get("rope_type") or scaling.get("type")) not in ("longrope", "su"):
        return []
    if gguf.MODEL_TENSOR.ROPE_FACTORS_LONG not in gguf.MODEL_TENSORS[family.gguf_arch]:
        raise ValueError(
            f"config.json: longrope scaling on {family.gguf_name}, whose llama.cpp architecture has no rope factor "
            "tensors; the GGUF converter supports longrope for phi3 only"
        )
    return [
        (gguf.TENSOR_NAMES[tensor] + ".weight", np.asarray(scaling[key], dtype=np.float32))
        for tensor, key in (
            (gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, "long_factor"),
            (gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT, "short_factor"),
        )
    ]


def _longrope_attention_factor(scaling: dict[str, Any], config: dict[str, Any]) -> float:
    """transformers' longrope cos/sin scale: attention_factor, else sqrt(1 + ln(factor) / ln(original length))
    with factor = max_position_embeddings / original_max_position_embeddings unless given."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    orig = float(
        scaling.get("original_max_position_embeddings")
        or config.get("original_max_position_embeddings")
        or config["max_position_embeddings"]
    )
    factor = float(scaling.get("factor") or config["max_position_embeddings"] / orig)
    return math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1.0 else 1.0


def _model_name(name: str) -> str:
    """`general.name`: `name` without "phi3"/"phi-3". llama.cpp (0.3.36, llama-vocab.cpp) applies its
    Phi-3 rules to any model whose name contains them: every special token strips the whitespace after it
    (RSTRIP), and loading fails ("unordered_map::at") unless <unk>, <s>, </s> and <|endoftext|> all exist.
    The converter only writes tokenizers whose added tokens strip nothing (`_tokens_and_types` refuses the
    others), so with those rules llama.cpp would tokenize differently after every special token."""
    return re.sub(r"(phi)-?3", r"\1", name, flags=re.IGNORECASE)  # llama.cpp lower-cases the name


def _add_hparams(
    writer: gguf.GGUFWriter, config: dict[str, Any], family: Family, name: str, file_type: int, n_vocab: int
) -> None:
    n_head = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    writer.add_name(name)
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(n_vocab)
    theta, scaling = _rope(config)
    keys = {
        gguf.Keys.LLM.CONTEXT_LENGTH: config["max_position_embeddings"],
        gguf.Keys.LLM.EMBEDDING_LENGTH: config["hidden_size"],
        gguf.Keys.LLM.BLOCK_COUNT: config["num_hidden_layers"],
        gguf.Keys.LLM.FEED_FORWARD_LENGTH: config["intermediate_size"],
        gguf.Keys.Attention.HEAD_COUNT: n_head,
        gguf.Keys.Attention.HEAD_COUNT_KV: config.get("num_key_value_heads", n_head),
        gguf.Keys.Attention.KEY_LENGTH: head_dim,
        gguf.Keys.Attention.VALUE_LENGTH: head_dim,
        gguf.Keys.Rope.DIMENSION_COUNT: head_dim,
        gguf.Keys.Attention.LAYERNORM_RMS_EPS: float(config["rms_norm_eps"]),
        gguf.Keys.Rope.FREQ_BASE: theta,
        **(family.gguf_hparams(config) if family.gguf_hparams else {}),  # the family's own keys win
    }
    for key, value in keys.items():
        if value is not None:
            _add_value(writer, key.format(arch=family.gguf_name), value)
    if scaling:
        _add_rope_scaling(writer, scaling, config)


def _add_value(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    """Write one hyper-parameter with the GGUF type llama.cpp reads it as (counts u32, scales f32)."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    else:
        raise TypeError(f"GGUF key {key}: cannot write {type(value).__name__} {value!r}")


_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0}


def _add_rope_scaling(writer: gguf.GGUFWriter, scaling: dict[str, Any], config: dict[str, Any]) -> None:
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in ("llama3", "proportional"):
        return  # carried by the rope_freqs tensor
    if kind in ("longrope", "su"):  # the factors are tensors; llama.cpp scales cos/sin by attn_factor
        writer.add_rope_scaling_attn_factors(_longrope_attention_factor(scaling, config))
        return
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    elif kind == "yarn":
        # Checked against transformers to 1e-6 with the default ramp (beta_fast 32, beta_slow 1) and
        # attention factor; with other betas llama.cpp's logits differ (8e-3 measured), so refuse them.
        # `truncate: false` (gpt-oss's released config) has no GGUF key: llama.cpp rounds the ramp's ends as
        # truncate does, which moved the tiny gpt_oss's f32 logits (factor 32 from 4096) by 2.9e-4, every next token
        # the same (2026-11-27); llama.cpp's own converter writes gpt-oss the same way, so it is accepted.
        custom = {
            k: scaling[k]
            for k in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")
            if scaling.get(k) is not None and scaling[k] != _YARN_DEFAULTS.get(k)
        }
        if custom:
            raise ValueError(
                f"config.json: yarn rope scaling with {custom} is not supported by the GGUF "
                "converter (only factor and original_max_position_embeddings)"
            )
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
        writer.add_rope_scaling_orig_ctx_len(
            int(scaling.get("original_max_position_embeddings") or config["max_position_embeddings"])
        )
    else:
        raise ValueError(
            f"config.json: rope scaling type {kind!r} is not supported by the GGUF converter "
            "(supported: linear, yarn, llama3, and longrope for phi3)"
        )
