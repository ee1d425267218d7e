"""Which llama.cpp BPE pre-tokenizer a Hugging Face tokenizer is, by the ids it gives for one probe text.

llama.cpp does not read a pre-tokenizer from tokenizer.json; it runs a hard-coded regex per name in
`tokenizer.ggml.pre`. Its converter (`get_vocab_base_pre` in convert_hf_to_gguf, llama.cpp as vendored by
llama-cpp-python 0.3.36) tells them apart by encoding a fixed text that exercises newlines, runs of spaces
and tabs, emojis with joiners, digit groups, Khmer, CJK, Cyrillic, repeated punctuation and English
contractions in mixed case, and hashing the ids (SHA-256 of `str(ids)`, BOS included where the tokenizer
adds one). Two tokenizers with the same hash split that text identically, so they share a pre-tokenizer.

The table below holds the hashes of that llama.cpp for the families slimtune trains and those of 2025-26
that people fine-tune (each with the Hub checkpoint llama.cpp hashed); a tokenizer whose hash is not here
falls back to `llama_cpp_tokenizer`'s exact tokenizer.json shapes.
"""

from __future__ import annotations

import hashlib

# llama.cpp's probe text, character for character: any change changes every hash.
PROBE_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ "
    "🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you "
    "sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)

# SHA-256 of str(ids of PROBE_TEXT) -> (tokenizer.ggml.pre, the Hub checkpoint it was measured on)
KNOWN_PRE_TOKENIZERS: dict[str, tuple[str, str]] = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": ("llama-bpe", "meta-llama/Meta-Llama-3-8B"),
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d": (
        "smaug-bpe",
        "abacusai/Smaug-Llama-3-70B-Instruct",
    ),
    "d353350c764d8c3b39c763113960e4fb4919bea5fbf208a0e3b22e8469dc7406": (
        "llama4",
        "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    ),
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": ("qwen2", "Qwen/Qwen1.5-7B"),
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": ("qwen2", "Qwen/Qwen3-Embedding-0.6B"),
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": (
        "deepseek-r1-qwen",
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
    ),
    "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4": ("qwen35", "Qwen/Qwen3.5-9B-Instruct"),
    "1444df51289cfa8063b96f0e62b1125440111bc79a52003ea14b6eac7016fd5f": ("qwen35", "openbmb/MiniCPM-V-4_6"),
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": (
        "tekken",
        "mistralai/Mistral-Nemo-Base-2407",
    ),
    "0e9433cbbb161f89e264eb32e8e64bfe69e834973ffca5d41d3948a604a3e2a3": ("pixtral", "mistral-community/pixtral-12b"),
    "ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e": ("gpt-4o", "Xenova/gpt-4o (Phi-4)"),
    "fcace8b9cac38ce847670c970cd5892031a753a1ef381abd1d9af00f713da085": ("phi-2", "microsoft/phi-2"),
    "6221ad2852e85ce96f791f476e0b390cf9b474c9e3d1362f53a24a06dc8220ff": (
        "refact",
        "smallcloudai/Refact-1_6-base (Granite 3)",
    ),
    "53e325976a6e142379c19b09afcae354f2f496f147afa8f9e189a33fe4e3024e": (
        "granite-docling",
        "ibm-granite/granite-docling-258M",
    ),
    "a8594e3edff7c29c003940395316294b2c623e09894deebbc65f33f1515df79e": ("dbrx", "databricks/dbrx-base (OLMo 2)"),
    "b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166": ("olmo", "allenai/OLMo-1.7-7B-hf"),
    "7dec86086fcc38b66b7bc1575a160ae21cf705be7718b9d5598190d7c12db76f": (
        "superbpe",
        "UW/OLMo2-8B-SuperBPE-t180k",
    ),
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": ("smollm", "HuggingFaceTB/SmolLM-135M"),
    "846deafc5b0fa786186fa4ae6c7b49903cf2f1d1895bdb80b9120d60be135252": (
        "gemma4",
        "danish-foundation-models/DFM-Mimir",
    ),
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": ("gpt-2", "openai-community/gpt2"),
    "2085e1638f6c377a0aa4ead21b27bb4cb941bf800df86ed391011769c1758dfb": ("exaone4", "LGAI-EXAONE/EXAONE-4.0-32B"),
    "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754": (
        "deepseek-llm",
        "deepseek-ai/deepseek-llm-7b-base",
    ),
    "877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5": ("deepseek-v3", "deepseek-ai/DeepSeek-V3"),
}


def probe_hash(hf_tokenizer) -> str:
    """llama.cpp's `chkhsh` of a Hugging Face tokenizer: SHA-256 of the text of the id list for PROBE_TEXT."""
    ids = hf_tokenizer.encode(PROBE_TEXT)
    return hashlib.sha256(str(list(ids)).encode()).hexdigest()


def known_pre_tokenizer(hf_tokenizer) -> str | None:
    """The `tokenizer.ggml.pre` name llama.cpp's converter gives this tokenizer, or None when it is not hashed here."""
    found = KNOWN_PRE_TOKENIZERS.get(probe_hash(hf_tokenizer))
    return found[0] if found else None
