"""The LoRA adapter as a llama.cpp LoRA GGUF: load it on the base model's GGUF instead of a merged copy.

The format is what llama.cpp's loader (src/llama-adapter.cpp) reads: `general.type = adapter`,
`general.architecture` equal to the base GGUF's, `adapter.type = lora`, `adapter.lora.alpha`, and for
each adapted weight `W` (by its GGUF name) two tensors `W.lora_a` = A (r x in) and `W.lora_b` = B
(out x r), stored as in peft (GGUF dims are the numpy shape reversed, which is what llama.cpp's shape
check expects). llama.cpp adds `scale * B @ A @ x` with `scale = alpha / r`. Differences from peft:
- rsLoRA scales by alpha / sqrt(r); llama.cpp always divides by r, so alpha * sqrt(r) is written.
- Llama/Mistral q/k rows are permuted for llama.cpp's rope layout (as the converter does for W);
  the rows of W + B @ A are the rows of B, so the same permutation is applied to B alone.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import gguf
import numpy as np

from slimtune.export.gguf_convert import _transform_for
from slimtune.models.families import SUPPORTED_MODEL_TYPES, family_of

ADAPTER_GGUF_SUFFIX = "-lora.gguf"  # <run name>-lora.gguf beside the model GGUFs; not a model itself
_A, _B = ".lora_A.weight", ".lora_B.weight"
_PEFT_PREFIX = "base_model.model."


def adapter_alpha(adapter_config: dict) -> float:
    """The alpha that gives llama.cpp's alpha / r the scale peft used (alpha / r, or alpha / sqrt(r))."""
    r, alpha = adapter_config["r"], float(adapter_config["lora_alpha"])
    return alpha * math.sqrt(r) if adapter_config.get("use_rslora") else alpha


def convert_adapter_to_gguf(adapter_dir: Path, base_config: dict, out_path: Path) -> Path:
    """Write the peft adapter in `adapter_dir` as a llama.cpp LoRA GGUF (float32 tensors) at `out_path`.

    Raises:
        ValueError: the adapter holds what llama.cpp's LoRA format cannot carry (trained embeddings or
            biases, per-module ranks), or the architecture is not one the converter supports; the
            message names the spec field to change.
    """
    from safetensors.numpy import load_file

    adapter_dir, out_path = Path(adapter_dir), Path(out_path)
    config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    family = family_of(base_config)
    if family is None:
        raise ValueError(
            f"export.adapter_gguf: model_type {base_config.get('model_type')!r} is not supported; use one of "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError("export.adapter_gguf: per-module ranks or alphas cannot be expressed; set it to false")
    n_head = base_config["num_attention_heads"]
    n_kv = base_config.get("num_key_value_heads", n_head)
    name_map = gguf.get_tensor_name_map(family.gguf_arch, base_config["num_hidden_layers"])
    weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
    other = sorted(k for k in weights if not k.endswith((_A, _B)))
    if other:
        raise ValueError(
            f"export.adapter_gguf: the adapter also holds {other[:3]} (trained embeddings or biases), which "
            "llama.cpp's LoRA format cannot carry; set lora.train_embeddings: false and lora.bias: none, or "
            "use the merged GGUF"
        )

    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=out_path.parent)
    os.close(fd)  # the writer opens the file itself
    writer_tmp = Path(tmp_name)
    try:
        writer = gguf.GGUFWriter(writer_tmp, family.gguf_name)
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, adapter_alpha(config))
        for key in sorted(k for k in weights if k.endswith(_A)):
            hf_weight = key.removeprefix(_PEFT_PREFIX).removesuffix(_A) + ".weight"
            name = name_map.get_name(hf_weight, try_suffixes=(".weight",))
            if name is None:
                raise ValueError(
                    f"export.adapter_gguf: {hf_weight} has no GGUF name; remove it from lora.target_modules"
                )
            a = weights[key].astype(np.float32)
            b = _transform_for(hf_weight, family, n_head, n_kv)(weights[key.removesuffix(_A) + _B].astype(np.float32))
            writer.add_tensor(f"{name}.lora_a", np.ascontiguousarray(a))
            writer.add_tensor(f"{name}.lora_b", np.ascontiguousarray(b))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(writer_tmp, out_path)
    finally:
        writer_tmp.unlink(missing_ok=True)
    return out_path


def verify_adapter_gguf(base_gguf: Path, adapter_gguf: Path, merged_gguf: Path, prompts: list[str], tokenizer) -> dict:
    """Logits of llama.cpp on base GGUF + adapter vs on the merged GGUF, over `prompts` (HF token ids).

    Returns max_abs_logit_diff and argmax_agreement over every position, as `verify_gguf` reports them.
    """
    from slimtune.export.gguf_verify import compare_logits, llama_cpp_logits, load_llama

    ids = [tokenizer(p)["input_ids"] for p in prompts]
    n_ctx = max(64, max(len(i) for i in ids))
    with_adapter = load_llama(base_gguf, n_ctx=n_ctx, lora_path=adapter_gguf)
    merged = load_llama(merged_gguf, n_ctx=n_ctx)
    worst, agree, positions = 0.0, 0.0, 0
    for seq in ids:
        stats = compare_logits(llama_cpp_logits(with_adapter, seq), llama_cpp_logits(merged, seq))
        worst = max(worst, stats["max_abs_logit_diff"])
        agree += stats["argmax_agreement"] * len(seq)
        positions += len(seq)
    with_adapter.close()
    merged.close()
    return {
        "adapter": adapter_gguf.name,
        "against": merged_gguf.name,  # may be a temporary f16 conversion of the merged model
        "prompts": len(prompts),
        "positions": positions,
        "max_abs_logit_diff": worst,
        "argmax_agreement": agree / positions,
    }
