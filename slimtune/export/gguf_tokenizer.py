"""The tokenizer half of a GGUF, written the way llama.cpp's own converter does, and checked before training.

The GGUF must tokenize exactly as the HF tokenizer does, and llama.cpp reads only a few settings of it
(`slimtune.export.llama_cpp_tokenizer` finds them, or says why none match). Three ways in, in this order
(llama.cpp as vendored by llama-cpp-python 0.3.36, read in its convert_hf_to_gguf and llama-vocab.cpp):

- SentencePiece: `tokenizer.model` when the folder has one (Llama 2, Mistral v0.x, Phi-3, the Gemmas ship it):
  its pieces, scores and types as they are, which is exactly llama.cpp's "llama" (SPM) vocabulary
  (`slimtune.export.sentencepiece_model` reads the proto without protobuf).
- SentencePiece-style tokenizer.json only (a BPE model with `byte_fallback` over "▁"-marked text): the same SPM
  vocabulary, with one score per token derived from the merge ranks (`spm_scores`); Gemma 4's is llama.cpp's
  "gemma4" BPE vocabulary, which keeps the merges.
- Byte-level BPE: llama.cpp's "gpt2" vocabulary with the merges, under the pre-tokenizer whose regex and merge
  rule are identical (`pre_tokenizer_name`).

`gguf_tokenizer_check` runs the same code on the tokenizer files alone, before any model loads, and (with
llama-cpp-python installed) compares llama.cpp's ids on the written vocabulary with the HF tokenizer's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf

from slimtune.export.gguf_pre_hashes import known_pre_tokenizer
from slimtune.export.llama_cpp_tokenizer import (
    UnsupportedTokenizerError,
    merge_pairs,
    pre_tokenizer_name,
    rank_scores,
    spm_scores,
    spm_space_prefix,
)
from slimtune.export.sentencepiece_model import read_sentencepiece_model

_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")


def add_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, n_vocab: int, *, strict: bool = True) -> list[str]:
    """Write the tokenizer of `model_dir` into `writer`, padded to the model's `n_vocab` embedding rows.

    The tokenizer is read as `AutoTokenizer` loads it, not from tokenizer.json on disk: transformers 5
    may rebuild the pipeline per model type (a Qwen2 checkpoint gets Qwen2Tokenizer's split regex and
    NFC even when tokenizer.json says plain ByteLevel), and the GGUF must match what training used.

    Args:
        strict: refuse anything llama.cpp would tokenize differently; False (`export.gguf_tokenizer: as_is`)
            writes the closest llama.cpp vocabulary instead and returns why it may differ.

    Returns:
        The reasons llama.cpp may tokenize differently (empty when the conversion is exact).

    Raises:
        UnsupportedTokenizerError: when the tokenizer cannot be reproduced by llama.cpp (with strict), or cannot be
            written at all (a vocab larger than the embedding, holes in the ids, missing byte tokens).
    """
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    source = f"{model_dir} ({type(hf_tok).__name__})"
    backend = getattr(hf_tok, "backend_tokenizer", None)
    if backend is None:
        raise UnsupportedTokenizerError(
            f"{source}: not a fast (tokenizers) tokenizer; SentencePiece-only "
            "tokenizers are not converted, save a tokenizer.json"
        )
    tj = json.loads(backend.to_str())
    inexact: list[str] = []

    def differs(error: UnsupportedTokenizerError) -> None:
        if strict:
            raise error
        inexact.append(str(error))

    if (tj.get("model") or {}).get("byte_fallback") and (model_dir / "tokenizer.model").is_file():
        _add_sentencepiece(writer, model_dir / "tokenizer.model", tj, n_vocab, source, differs)
    elif (tj.get("model") or {}).get("byte_fallback") and _is_gemma4(model_dir, hf_tok):
        # llama.cpp's "gemma4" vocabulary is HF's BPE itself: merges by rank over raw UTF-8 with "▁" for spaces,
        # split at newline runs only, byte fallback; its pre-tokenizer is implied by the model name
        tokens, types = _tokens_and_types(tj, n_vocab, source)
        writer.add_tokenizer_model("gemma4")
        writer.add_token_list(tokens)
        writer.add_token_scores([-1000.0] * len(tokens))  # unread by BPE merging; llama.cpp's converter writes these
        writer.add_token_types(types)
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
        writer.add_add_space_prefix(False)
    elif (tj.get("model") or {}).get("byte_fallback"):
        try:
            add_space_prefix = spm_space_prefix(tj, source)
        except UnsupportedTokenizerError as e:
            differs(e)
            add_space_prefix = True
        tokens, types = _tokens_and_types(tj, n_vocab, source)
        try:
            scores = spm_scores(tj, tokens, types, source)
        except UnsupportedTokenizerError as e:
            differs(e)
            scores = rank_scores(merge_pairs(tj), tokens)
        writer.add_tokenizer_model("llama")  # llama.cpp's name for SentencePiece-style vocabularies
        writer.add_tokenizer_pre("default")  # read by no SPM code path; written as llama.cpp's converter does
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_add_space_prefix(add_space_prefix)  # llama.cpp's SPM default is True: always explicit
    else:
        try:
            pre = pre_tokenizer_name(tj, source, hf_tok)
        except UnsupportedTokenizerError as e:
            differs(e)
            pre = "default"
        tokens, types = _tokens_and_types(tj, n_vocab, source)
        writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    for name, add in (
        ("bos", writer.add_bos_token_id),
        ("eos", writer.add_eos_token_id),
        ("pad", writer.add_pad_token_id),
        ("unk", writer.add_unk_token_id),
    ):
        token_id = getattr(hf_tok, f"{name}_token_id", None)
        if token_id is not None:
            add(token_id)
    add_bos, add_eos = _adds_special(hf_tok)
    writer.add_add_bos_token(add_bos)  # always explicit: llama.cpp's default differs per pre-tokenizer
    writer.add_add_eos_token(add_eos)
    if isinstance(hf_tok.chat_template, str):
        writer.add_chat_template(hf_tok.chat_template)
    return inexact


def _is_gemma4(model_dir: Path, hf_tok) -> bool:
    """Gemma 4's tokenizer: by config.json's model_type, or by llama.cpp's probe-text hash."""
    config = model_dir / "config.json"
    model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type", "") if config.is_file() else ""
    return model_type.startswith("gemma4") or known_pre_tokenizer(hf_tok) == "gemma4"


def _add_sentencepiece(
    writer: gguf.GGUFWriter, spm_file: Path, tj: dict[str, Any], n_vocab: int, source: str, differs
) -> None:
    """llama.cpp's SPM vocabulary from `tokenizer.model` as it is, with tokenizer.json's added tokens after it
    (the ids training used); what llama.cpp's converter does with the same files."""
    try:
        spm = read_sentencepiece_model(spm_file)
    except ValueError as e:
        raise UnsupportedTokenizerError(str(e)) from e
    if spm.model_type != "bpe":
        raise UnsupportedTokenizerError(
            f"{spm_file}: a SentencePiece {spm.model_type} model; llama.cpp's SPM vocabulary merges by score like "
            "SentencePiece BPE, a unigram model would need its UGM vocabulary, which is not written"
        )
    if spm.normalizer != "identity" or spm.remove_extra_whitespaces or spm.treat_whitespace_as_suffix:
        differs(
            UnsupportedTokenizerError(
                f"{spm_file}: normalizer {spm.normalizer!r} (remove_extra_whitespaces={spm.remove_extra_whitespaces}, "
                f"treat_whitespace_as_suffix={spm.treat_whitespace_as_suffix}); llama.cpp's SPM tokenizer applies no "
                "normalization and keeps every space"
            )
        )
    vocab = tj["model"]["vocab"]
    added_ids = {a["id"] for a in tj.get("added_tokens", [])}
    moved = [(i, p) for i, p in enumerate(spm.pieces) if vocab.get(p, i) != i]
    moved += [(i, p) for p, i in vocab.items() if i >= len(spm.pieces) and i not in added_ids][:1]
    if moved:
        i, piece = moved[0]
        differs(
            UnsupportedTokenizerError(
                f"{spm_file} and tokenizer.json disagree on the id of {piece!r} (or one lacks it: id {i}); the "
                "model was trained on tokenizer.json's ids"
            )
        )
    tokens, scores, types = list(spm.pieces), list(spm.scores), list(spm.types)
    for added in tj.get("added_tokens", []):
        token_id, content = added["id"], added["content"]
        if token_id < len(tokens) and tokens[token_id] == content:
            continue  # sentencepiece's own <unk>/<s>/</s>: its type stands
        if added.get("lstrip") or added.get("rstrip") or added.get("single_word"):
            differs(
                UnsupportedTokenizerError(
                    f"{source}: added token {content!r} strips spaces or matches single words; llama.cpp does not"
                )
            )
        tokens += [f"[PAD{i}]" for i in range(len(tokens), token_id + 1)]
        scores += [-1000.0] * (len(tokens) - len(scores))
        types += [int(gguf.TokenType.UNUSED)] * (len(tokens) - len(types))
        tokens[token_id], scores[token_id] = content, -1000.0
        types[token_id] = int(gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED)
    if len(tokens) > n_vocab:
        raise UnsupportedTokenizerError(
            f"{source}: the tokenizer has {len(tokens)} tokens but the model's embedding only {n_vocab} rows; "
            "resize_token_embeddings first"
        )
    pad = n_vocab - len(tokens)  # embedding rows past the tokenizer: unused placeholders, one per row
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens + [f"[PAD{i}]" for i in range(len(tokens), n_vocab)])
    writer.add_token_scores(scores + [-1000.0] * pad)
    writer.add_token_types(types + [int(gguf.TokenType.UNUSED)] * pad)
    writer.add_add_space_prefix(spm.add_dummy_prefix)


def _tokens_and_types(tj: dict[str, Any], n_vocab: int, source: str) -> tuple[list[str], list[int]]:
    by_id: dict[int, str] = {i: t for t, i in tj["model"]["vocab"].items()}
    types = {i: gguf.TokenType.NORMAL for i in by_id}
    if tj["model"].get("byte_fallback"):  # SPM: llama.cpp spells unknown characters with the BYTE tokens
        for i, t in by_id.items():
            if _BYTE_TOKEN.fullmatch(t):
                types[i] = gguf.TokenType.BYTE
        missing = sorted(set(range(256)) - {int(t[3:5], 16) for t in by_id.values() if _BYTE_TOKEN.fullmatch(t)})
        if missing:
            raise UnsupportedTokenizerError(
                f"{source}: byte_fallback without the byte tokens {', '.join(f'<0x{b:02X}>' for b in missing[:4])}"
                f"{'...' if len(missing) > 4 else ''}; llama.cpp needs all 256 <0xNN> tokens to spell unknown text"
            )
    for added in tj.get("added_tokens", []):
        if added.get("lstrip") or added.get("rstrip") or added.get("single_word"):
            raise UnsupportedTokenizerError(
                f"{source}: added token {added['content']!r} strips spaces or "
                "matches single words; llama.cpp does not reproduce that"
            )
        by_id[added["id"]] = added["content"]
        types[added["id"]] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    unk = tj["model"].get("unk_token")
    if tj["model"].get("byte_fallback") and unk in tj["model"]["vocab"]:
        types[tj["model"]["vocab"][unk]] = gguf.TokenType.UNKNOWN  # as sentencepiece marks it
    size = max(by_id) + 1
    if size > n_vocab:
        raise UnsupportedTokenizerError(
            f"{source}: the tokenizer has {size} tokens but the model's "
            f"embedding only {n_vocab} rows; resize_token_embeddings first"
        )
    missing = [i for i in range(size) if i not in by_id]
    if missing:
        raise UnsupportedTokenizerError(
            f"{source}: token ids {missing[:5]} have no token; the vocab has holes llama.cpp cannot represent"
        )
    # Rows past the tokenizer (embeddings padded to a multiple of 64/128) get unused placeholder tokens,
    # because llama.cpp requires one token per embedding row.
    tokens = [by_id[i] for i in range(size)] + [f"[PAD{i}]" for i in range(size, n_vocab)]
    token_types = [int(types[i]) for i in range(size)] + [int(gguf.TokenType.UNUSED)] * (n_vocab - size)
    return tokens, token_types


def _adds_special(hf_tok) -> tuple[bool, bool]:
    """Whether encoding adds a BOS in front / an EOS at the end, observed rather than read from config."""
    plain = hf_tok("a", add_special_tokens=False)["input_ids"]
    full = hf_tok("a", add_special_tokens=True)["input_ids"]
    bos, eos = hf_tok.bos_token_id, hf_tok.eos_token_id
    add_bos = bos is not None and len(full) > len(plain) and full[0] == bos
    add_eos = eos is not None and len(full) > len(plain) and full[-1] == eos
    if len(full) - len(plain) != int(add_bos) + int(add_eos):
        raise UnsupportedTokenizerError(
            "the tokenizer's post-processor adds tokens other than BOS/EOS "
            f"({plain} -> {full}); llama.cpp cannot reproduce that"
        )
    return add_bos, add_eos
