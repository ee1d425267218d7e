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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from slimtune.models.families import FAMILIES

if TYPE_CHECKING:
    import torch

BUILTIN_PREFIX = "builtin:tiny-"
DATA_FILE = Path(__file__).resolve().parents[2] / "deployments" / "data" / "tiny_chat.jsonl"
_VERSION = 2  # bump when the recipe changes, so cached builds are not reused

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


# SentencePiece-style tokenizers as released checkpoints load in transformers 5: the tokenizer class (which
# rebuilds the normalizer/pre-tokenizer pipeline itself) and its specials, in id order.
_SPM_STYLES = {
    "llama2": ("LlamaTokenizer", ["<unk>", "<s>", "</s>"]),  # Llama 2, Mistral v0.1, Phi-3-mini
    "gemma": ("GemmaTokenizer", ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]),  # Gemma 1/2/3
}
SPM_STYLES = tuple(_SPM_STYLES)


def build_spm_tokenizer(style: str = "llama2", vocab_size: int = 1024):
    """A SentencePiece-style tokenizer (BPE with byte fallback over "▁"-marked text) trained on the shipped data.

    Built the way transformers converts a SentencePiece model: specials first, the 256 `<0xNN>` byte tokens,
    then the pieces, with every split of a piece into two pieces as a merge, ranked by the piece's id
    (`generate_merges`), handed to the family's own tokenizer class (Llama's with legacy=True, the
    sentencepiece behaviour llama.cpp reproduces). Characters outside the 100 most frequent ones (accents,
    CJK, emoji) are not pieces, so they take the byte fallback.
    """
    import transformers
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.tokenization_utils_base import generate_merges

    class_name, specials = _SPM_STYLES[style]
    fixed = [*specials, *(f"<0x{b:02X}>" for b in range(256))]
    # Training splits words before each "▁" (SentencePiece's split_by_whitespace); encoding does not split.
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Replace(" ", "\u2581")
    trained.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(fixed), limit_alphabet=100, show_progress=False)
    trained.train_from_iterator(_corpus(), trainer=trainer)
    vocab = {t: i for i, t in enumerate(fixed)}
    for piece, _ in sorted(trained.get_vocab().items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    tok = getattr(transformers, class_name)(
        vocab=vocab,
        merges=generate_merges(vocab, skip_tokens=fixed),
        chat_template=CHAT_TEMPLATE,
        model_max_length=_COMMON["max_position_embeddings"],
        add_bos_token=True,  # both families' tokenizer_config.json say so
        **({"legacy": True, "pad_token": "<unk>"} if style == "llama2" else {}),
    )
    if style == "llama2":
        # transformers 5.23 does not keep `legacy` in init_kwargs, so save_pretrained would drop it and the
        # saved tokenizer would load as legacy=False; a real checkpoint's tokenizer_config.json carries it.
        tok.init_kwargs["legacy"] = True
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})  # CHAT_TEMPLATE's turn markers
    return tok


def build_model(family: str, vocab_size: int, seed: int = 0, **overrides) -> torch.nn.Module:
    """A randomly initialised causal LM of `family` with the tiny dimensions (seeded, float32)."""
    import torch  # here, not at the top: the spec reads this module's names, and validating a YAML needs no torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; choose one of {', '.join(FAMILIES)}")
    row = FAMILIES[family]
    # Gemma 4's per-layer embeddings have one row per token, as in the released checkpoints
    per_token = {"vocab_size_per_layer_input": vocab_size} if "hidden_size_per_layer_input" in row.tiny else {}
    cfg = getattr(transformers, row.config_class)(
        **{**_COMMON, **row.tiny, **per_token, **overrides},
        vocab_size=vocab_size,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return getattr(transformers, row.architecture)(cfg).eval()


def pretrain(model: torch.nn.Module, tokenizer, steps: int = 150, seed: int = 0) -> torch.nn.Module:
    """A few AdamW steps of next-token prediction on the shipped data, in place; returns the model in eval mode.

    Why: a random init predicts nearly uniform logits (median gap between the best two logits 0.07-0.09 for
    the tiny models), so a q8_0 file's logit error (up to ~0.05) flips the next token at a few percent of
    positions by chance alone, and "argmax agrees" says little about the conversion. After these steps the
    model predicts from context like a real one (peaked logits), and q8_0 can be held to >= 98% everywhere.
    Measured over the ~180 positions of the verification prompts (q8_0 against fp32 HF): 15 steps at lr 1e-2
    left the predictions nearly unigram (2-3 distinct next tokens); 80 and 150 steps at 1e-2 gave 95.6-100%;
    150 steps at 3e-3 gave 98.3-100% for every family (flips at top-2 gaps of 0.002-0.31); 300 steps at
    3e-3 gave 97.2-98.9% again, with logits q8_0 misses by up to 5 (weights grown outliers).
    """
    import torch

    ids = tokenizer("\n".join(_corpus()), add_special_tokens=False, verbose=False)["input_ids"]
    seq, batch = 64, 4
    rows = torch.tensor(ids[: len(ids) // seq * seq]).view(-1, seq)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch_rows = rows[torch.randint(len(rows), (batch,), generator=generator)]
        model(input_ids=batch_rows, labels=batch_rows).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.eval()


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
    return _cached(family, family, lambda out: save_tiny(out, family))


def save_tiny_multimodal(out_dir: Path, text_dir: Path, model_type: str = "gemma3", seed: int = 0) -> Path:
    """A multimodal checkpoint around the tiny text model in `text_dir`: its weights as the language model and a
    seeded random vision tower of the layout's tiny sizes, saved as transformers saves the layout (safetensors)."""
    import torch
    import transformers

    from slimtune.models.multimodal import LAYOUTS

    layout = LAYOUTS[model_type]
    text = transformers.AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(text_dir)
    # the pad id in text_config, as the released checkpoints have it (Gemma 4's whole model masks with it)
    text_config = {**text.config.to_dict(), "pad_token_id": tokenizer.pad_token_id}
    config = transformers.AutoConfig.for_model(model_type, text_config=text_config, **layout.tiny)
    config.architectures = [layout.architecture]
    config.tie_word_embeddings = text.config.tie_word_embeddings  # the layouts' default is tied, Mistral's is not
    torch.manual_seed(seed)
    model = getattr(transformers, layout.architecture)(config)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def ensure_pretrained(family: str, tokenizer_style: str = "bpe", steps: int = 150) -> Path:
    """A tiny `family` model after `pretrain(steps)` with the byte-level BPE tokenizer ("bpe") or a
    SentencePiece-style one (`SPM_STYLES`), built once and cached like the builtins (for GGUF tests)."""

    def build(out: Path) -> None:
        tokenizer = build_tokenizer() if tokenizer_style == "bpe" else build_spm_tokenizer(tokenizer_style)
        pretrain(build_model(family, len(tokenizer)), tokenizer, steps).save_pretrained(out)
        tokenizer.save_pretrained(out)

    return _cached(family, f"{family}-{tokenizer_style}-{steps}", build, "pretrained")


def _cached(family: str, key: str, build: Callable[[Path], object], folder: str = "tiny") -> Path:
    """The cache directory for `key` and this module's recipe, built by `build(tmp)` and renamed into place."""
    recipe = f"{_VERSION}:{key}:{json.dumps(FAMILIES[family].tiny, sort_keys=True)}:{DATA_FILE.read_bytes().hex()}"
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:12]
    final = cache_root() / folder / f"{key}-{digest}"
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=final.parent))
    try:
        build(tmp)
        os.replace(tmp, final)
    except OSError:
        if not (final / "config.json").exists():  # a concurrent build that won the rename is fine
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
