"""Verify a GGUF against its source checkpoint by running both: llama.cpp on the GGUF, transformers on HF.

What "the GGUF is right" means here: llama.cpp's tokenizer gives the same ids as the HF tokenizer, and
on those ids llama.cpp's logits are close to the HF model's (max abs diff) and pick the same next token
(argmax agreement). The KV cache is kept in f32 so that an f32 GGUF can be held to ~1e-4; the default
f16 cache alone would add ~1e-3 of noise.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from slimtune.export.gguf_header import GGUFHeaderError, read_header
from slimtune.export.gguf_quantize import require_llama_cpp
from slimtune.models.multimodal import text_model_load_kwargs

# llama.cpp's threads spin while waiting; beyond ~8 the verification prompts (a few hundred tokens) gain
# nothing, and on a shared machine more spinning threads only slow everyone down.
_THREADS = max(1, min(8, os.cpu_count() or 1))
_SHARD = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFVerifyError(RuntimeError):
    """The GGUF is incomplete, unreadable, or llama.cpp cannot load it."""


def check_complete(gguf_path: Path) -> list[Path]:
    """Check that `gguf_path` (and every shard of a split file) is a whole GGUF; return the files checked.

    llama.cpp reports a cut-short file as a bare "failed to load model"; this names the file and what to do.

    Raises:
        GGUFVerifyError: a file is missing, truncated or has a corrupt header.
    """
    gguf_path = Path(gguf_path)
    match = _SHARD.match(gguf_path.name)
    files = (
        [
            gguf_path.with_name(f"{match['stem']}-{i:05d}-of-{match['count']}.gguf")
            for i in range(1, int(match["count"]) + 1)
        ]
        if match
        else [gguf_path]
    )
    for file in files:
        if not file.is_file():
            raise GGUFVerifyError(f"GGUF file {file} is missing; re-run the conversion")
        size = file.stat().st_size
        try:
            end = read_header(file).data_end
            problem = f"its tensors end at byte {end}" if size < end else None
        except GGUFHeaderError as exc:
            problem = str(exc)
        if problem:
            raise GGUFVerifyError(
                f"GGUF file {file} ({size} bytes) is truncated or corrupt: {problem}; re-run the conversion"
            )
    return files


def load_llama(gguf_path: Path, n_ctx: int = 512, lora_path: Path | None = None):
    """Load a GGUF in llama.cpp with every position's logits kept and an f32 KV cache (and a LoRA GGUF on it).

    Raises:
        GGUFVerifyError: when llama.cpp refuses the file (after `check_complete` passed).
    """
    llama_cpp = require_llama_cpp("verifying a GGUF in llama.cpp")
    check_complete(gguf_path)
    try:
        return llama_cpp.Llama(
            str(gguf_path),
            logits_all=True,
            n_ctx=n_ctx,
            n_batch=n_ctx,
            type_k=llama_cpp.GGML_TYPE_F32,
            type_v=llama_cpp.GGML_TYPE_F32,
            n_threads=_THREADS,
            verbose=False,
            **({"lora_path": str(lora_path)} if lora_path is not None else {}),
        )
    except ValueError as exc:
        raise GGUFVerifyError(
            f"llama.cpp could not load {gguf_path}: {exc}; load it with verbose=True to see llama.cpp's reason"
        ) from exc


def llama_cpp_logits(llm, ids: list[int]) -> np.ndarray:
    """Logits (len(ids), n_vocab) float32 of llama.cpp for one sequence, from a fresh cache."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def llama_cpp_tokenize(llm, text: str) -> list[int]:
    """llama.cpp's ids for `text` with special tokens parsed, adding BOS/EOS as the GGUF says HF does."""
    return llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)


def compare_logits(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """Max abs difference and argmax agreement fraction of two (positions, vocab) logit arrays."""
    if a.shape != b.shape:
        raise ValueError(f"logit shapes differ: {a.shape} vs {b.shape}")
    return {
        "max_abs_logit_diff": float(np.abs(a - b).max()),
        "argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).mean()),
    }


def verify_gguf(gguf_path: Path, model_dir: Path, prompts: list[str]) -> dict[str, Any]:
    """Compare the GGUF in llama.cpp with the HF model in `model_dir` on `prompts`.

    Logits are compared on the HF tokenizer's ids, so a tokenizer mismatch is reported on its own
    (`token_ids_equal`) rather than showing up as a logit difference.

    Returns:
        A JSON-able dict: gguf, prompts, positions, token_ids_equal, token_mismatches (prompt indices),
        max_abs_logit_diff, argmax_agreement (over all positions).

    Raises:
        GGUFVerifyError: the file is incomplete or llama.cpp cannot load it.
        ImportError: the llama-cpp extra is missing.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    require_llama_cpp("verifying a GGUF in llama.cpp")  # before the slow HF loads
    if not prompts:
        raise ValueError("verify_gguf needs at least one prompt")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf_ids = [tokenizer(p)["input_ids"] for p in prompts]
    if not all(hf_ids):
        raise ValueError(
            f"prompts {[k for k, ids in enumerate(hf_ids) if not ids]} tokenize to no tokens; give non-empty prompts"
        )
    llm = load_llama(gguf_path, n_ctx=max(64, max(len(i) for i in hf_ids)))
    mismatches = [k for k, (p, ids) in enumerate(zip(prompts, hf_ids)) if llama_cpp_tokenize(llm, p) != ids]
    # a multimodal checkpoint: its language model, which the GGUF holds (on text it computes what the whole does)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **text_model_load_kwargs(model_dir))
    model.eval()
    worst, agree, positions = 0.0, 0.0, 0
    with torch.no_grad():
        for ids in hf_ids:
            hf = model(torch.tensor([ids])).logits[0].numpy()
            stats = compare_logits(llama_cpp_logits(llm, ids), hf)
            worst = max(worst, stats["max_abs_logit_diff"])
            agree += stats["argmax_agreement"] * len(ids)
            positions += len(ids)
    llm.close()
    return {
        "gguf": str(gguf_path),
        "prompts": len(prompts),
        "positions": positions,
        "token_ids_equal": not mismatches,
        "token_mismatches": mismatches,
        "max_abs_logit_diff": worst,
        "argmax_agreement": agree / positions,
    }
