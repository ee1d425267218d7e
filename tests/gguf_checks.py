"""What the GGUF tests run through llama.cpp: the verification prompts, and next-token agreement with a reference."""

from __future__ import annotations

import torch

from slimtune.export.gguf_verify import compare_logits, llama_cpp_logits

PROMPTS = [
    "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog, then counts 1, 2, 3 and 45678 sheep.",
    "Explain gradient descent to a beginner in two sentences, with an example.",
    "def add(a, b):\n    return a + b  # numbers: 3.14, 2.71 — ünïcode too",
]


def argmax_agreement(llm, reference: torch.nn.Module, tokenizer) -> float:
    """The share of PROMPTS' positions where llama.cpp's next token is `reference`'s (a transformers model)."""
    agree, n = 0.0, 0
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt)["input_ids"]
            ref = reference(torch.tensor([ids])).logits[0].numpy()
            agree += compare_logits(llama_cpp_logits(llm, ids), ref)["argmax_agreement"] * len(ids)
            n += len(ids)
    return agree / n
