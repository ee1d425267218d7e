"""Tiny models and tokenizers built locally and deterministically, for the embedded default and tests.

Nothing here touches the network: the tokenizer is a byte-level BPE trained with `tokenizers` on the
instruction data we ship, and the weights are a seeded random init. Dimensions are the smallest that
still exercise every path of the real pipeline: hidden 256 so that GGUF k-quants (rows divisible by
256) really apply, grouped-query attention (4 query heads, 2 KV heads) so that the Q/K permutation and
KV repetition are tested.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from slimtune.families import FAMILIES as _TABLE

if TYPE_CHECKING:
    import torch

BUILTIN_PREFIX = "builtin:tiny-"
FAMILIES = tuple(_TABLE)  # one tiny model per supported family, named by its model_type
DATA_FILE = Path(__file__).resolve().parent.parent / "deployments" / "data" / "tiny_chat.jsonl"
_VERSION = 1  # bump when the recipe changes, so cached builds are not reused

# ChatML-style template; {% generation %} marks assistant tokens so completion-only masks come from the
# tokenizer itself (return_assistant_tokens_mask) rather than from string matching.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_COMMON = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    initializer_range=0.02,
)


def is_builtin(name: str) -> bool:
    """True for `builtin:tiny-<family>` model names."""
    return name.startswith(BUILTIN_PREFIX)


def cache_root() -> Path:
    """Where built tiny models live; `SLIMTUNE_CACHE` overrides the default under the user cache."""
    return Path(os.environ.get("SLIMTUNE_CACHE", Path.home() / ".cache" / "slimtune"))


def _corpus() -> list[str]:
    texts = []
    for line in DATA_FILE.read_text(encoding="utf-8").splitlines():
        for m in json.loads(line)["messages"]:
            texts.append(m["content"])
    return texts


def build_tokenizer(vocab_size: int = 1024):
    """Train a byte-level BPE tokenizer on the shipped data; deterministic for a given corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=_COMMON["max_position_embeddings"],
    )


def build_model(family: str, vocab_size: int, seed: int = 0, **overrides) -> torch.nn.Module:
    """A randomly initialised causal LM of `family` with the tiny dimensions (seeded, float32)."""
    import torch  # here, not at the top: the spec reads this module's names, and validating a YAML needs no torch
    import transformers

    if family not in _TABLE:
        raise ValueError(f"unknown tiny family {family!r}; choose one of {', '.join(FAMILIES)}")
    row = _TABLE[family]
    cfg = getattr(transformers, row.config_class)(
        **{**_COMMON, **row.tiny, **overrides},
        vocab_size=vocab_size,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return getattr(transformers, row.architecture)(cfg).eval()


def save_tiny(out_dir: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a tiny model and its tokenizer to `out_dir` (safetensors), as `from_pretrained` expects."""
    tok = build_tokenizer()
    model = build_model(family, len(tok), seed=seed, **overrides)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    model.config.eos_token_id, model.config.pad_token_id = eos, pad
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, pad
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir


def ensure_builtin(name: str) -> Path:
    """Return the directory of builtin model `name`, building it once (atomically) if missing."""
    family = name[len(BUILTIN_PREFIX) :]
    if family not in FAMILIES:
        raise ValueError(
            f"unknown builtin model {name!r}; use one of " + ", ".join(BUILTIN_PREFIX + f for f in FAMILIES)
        )
    recipe = f"{_VERSION}:{family}:{json.dumps(_TABLE[family].tiny, sort_keys=True)}:{DATA_FILE.read_bytes().hex()}"
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:12]
    final = cache_root() / "tiny" / f"{family}-{digest}"
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{family}-", dir=final.parent))
    try:
        save_tiny(tmp, family)
        os.replace(tmp, final)
    except OSError:
        if not (final / "config.json").exists():  # a concurrent build that won the rename is fine
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
