"""The tokenizer half of a GGUF: byte-level BPE vocab, merges, token types, special ids, chat template.

llama.cpp does not run a tokenizer's pre-tokenizer from `tokenizer.json`; it picks a hard-coded regex
by the name in `tokenizer.ggml.pre`, and rejects names it does not know. So the converter must name a
pre-tokenizer whose regex and merge rule are *identical* to the HF tokenizer's, or the GGUF tokenizes
differently with no error anywhere. We recognise three shapes exactly and refuse everything else:

- `ByteLevel(use_regex=True)` alone (GPT-2 style, our tiny tokenizer) -> "gpt-2": llama.cpp's GPT2
  pre-type uses the GPT-2 regex
  `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)`
  and applies merges (no ignore_merges); "default" would add three extra splits (punctuation,
  digits, 3-digit groups), so it is NOT equivalent. Both were read in llama.cpp's llama-vocab.cpp
  (as vendored by llama-cpp-python 0.3.36) and the ids are checked against HF in the tests.
- `Split(<Llama-3 regex>) + ByteLevel(use_regex=False)` with ignore_merges -> "llama-bpe".
- `Split(<Qwen2 regex>) + ByteLevel(use_regex=False)` -> "qwen2".

SentencePiece-style tokenizers (Llama 2, Mistral v0.1, Phi-3-mini, the Gemmas) reach us as a BPE model
with `byte_fallback` over "▁"-marked text; llama.cpp runs them as its "llama" (SPM) vocabulary, which
has no merges list: it merges the adjacent pair whose joined text is the vocab token of highest score,
and spells leftover characters as `<0xNN>` byte tokens. `spm_space_prefix` and `_spm_scores` say when
that tokenizes exactly like HF's BPE, and refuse the rest.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf

_GPT2 = "gpt-2"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")
_SPACE = "▁"  # SentencePiece's visible space (U+2581)
_LLAMA3_REGEX = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_QWEN2_REGEX = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
# regex -> (llama.cpp pre-tokenizer name, the ignore_merges value llama.cpp hard-codes for it)
_SPLIT_PRE = {_LLAMA3_REGEX: ("llama-bpe", True), _QWEN2_REGEX: ("qwen2", False)}


class UnsupportedTokenizerError(ValueError):
    """The tokenizer cannot be written so that llama.cpp tokenizes exactly like Hugging Face."""


def pre_tokenizer_name(tokenizer_json: dict[str, Any], source: str = "tokenizer.json") -> str:
    """Return the llama.cpp `tokenizer.ggml.pre` name equivalent to this HF tokenizer, or raise.

    Raises:
        UnsupportedTokenizerError: naming what differs, when no llama.cpp pre-tokenizer is identical.
    """
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE":
        raise UnsupportedTokenizerError(
            f"{source}: model type {model.get('type')!r} is not supported; the GGUF converter writes "
            "byte-level BPE tokenizers only (SentencePiece/Unigram/WordPiece are not converted)"
        )
    for field in ("byte_fallback", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(field):
            raise UnsupportedTokenizerError(
                f"{source}: model.{field}={model.get(field)!r} has no llama.cpp equivalent for byte-level BPE"
            )
    normalizer = tokenizer_json.get("normalizer")
    # NFC is what Qwen2 ships; llama.cpp does not apply it, which only matters for text that is not
    # already NFC (decomposed accents). Any other normalizer changes ordinary text, so it is refused.
    if normalizer is not None and normalizer.get("type") != "NFC":
        raise UnsupportedTokenizerError(
            f"{source}: normalizer {normalizer.get('type')!r} is not applied "
            "by llama.cpp; the GGUF would tokenize differently"
        )
    decoder = tokenizer_json.get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        raise UnsupportedTokenizerError(
            f"{source}: decoder {decoder.get('type')!r} is not ByteLevel; "
            "only byte-level BPE tokenizers can be converted"
        )
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    ignore_merges = bool(model.get("ignore_merges", False))
    name = _match_pre(steps, ignore_merges, normalizer)
    if name is None:
        raise UnsupportedTokenizerError(
            f"{source}: pre-tokenizer {json.dumps(pre)} (ignore_merges={ignore_merges}, normalizer="
            f"{json.dumps(normalizer)}) matches none that llama.cpp implements identically (GPT-2 ByteLevel "
            "regex, Llama-3 or Qwen2 split regex); refusing to write a GGUF that would tokenize differently"
        )
    return name


def _match_pre(steps: list[dict[str, Any]], ignore_merges: bool, normalizer: dict | None) -> str | None:
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel":
        step = steps[0]
        if (
            step.get("use_regex", True)
            and not step.get("add_prefix_space")
            and not ignore_merges
            and normalizer is None
        ):
            return _GPT2
        return None
    if len(steps) == 2 and [s.get("type") for s in steps] == ["Split", "ByteLevel"]:
        split, byte_level = steps
        regex = (split.get("pattern") or {}).get("Regex")
        if (
            regex not in _SPLIT_PRE
            or split.get("behavior") != "Isolated"
            or split.get("invert")
            or byte_level.get("use_regex")
            or byte_level.get("add_prefix_space")
        ):
            return None
        name, llama_ignores_merges = _SPLIT_PRE[regex]
        return name if ignore_merges == llama_ignores_merges else None
    return None


def spm_space_prefix(tokenizer_json: dict[str, Any], source: str = "tokenizer.json") -> bool:
    """Whether llama.cpp must prefix "▁" to this SentencePiece-style tokenizer's text (`add_space_prefix`), or raise.

    llama.cpp's SPM tokenizer replaces every space with "▁", adds one "▁" in front of the text and after
    every special token when `add_space_prefix` is set, and never splits the text into words. These HF
    shapes do the same: Llama 2's tokenizer.json normalizers `Prepend("▁") + Replace(" ", "▁")` (prefix),
    Gemma's `Replace(" ", "▁")` (no prefix; its `Split(" ")` pre-tokenizer then finds no space), and
    `Metaspace(split=False)` with prepend_scheme "never", or "always" (what transformers 5 builds for Llama 2,
    Mistral and Phi-3 with legacy=True). One documented difference remains with "always": where a text (or
    the text after a special token) already starts with a space, Metaspace adds no second "▁" while
    llama.cpp, like sentencepiece itself, does (" hi" -> HF "▁hi", llama.cpp "▁", "▁hi"); as with NFC above,
    it is accepted because refusing would refuse every Llama 2 style model, and it is tested.

    Raises:
        UnsupportedTokenizerError: naming what differs, e.g. prepend_scheme "first" (transformers' legacy=False),
            which prefixes the start of the text only, where llama.cpp prefixes after every special token too.
    """
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        raise UnsupportedTokenizerError(
            f"{source}: model type {model.get('type')!r} (byte_fallback={model.get('byte_fallback')!r}) is not a "
            "SentencePiece-style BPE; Unigram models would need llama.cpp's UGM vocabulary, which is not written"
        )
    for field in ("continuing_subword_prefix", "end_of_word_suffix", "dropout", "ignore_merges"):
        if model.get(field):
            raise UnsupportedTokenizerError(f"{source}: model.{field}={model[field]!r} has no llama.cpp SPM equivalent")
    normalizer, pre = tokenizer_json.get("normalizer"), tokenizer_json.get("pre_tokenizer")
    steps = normalizer.get("normalizers", []) if normalizer and normalizer.get("type") == "Sequence" else [normalizer]
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": _SPACE}
    space_split = {"type": "Split", "pattern": {"String": " "}}
    if steps == [{"type": "Prepend", "prepend": _SPACE}, replace] and pre is None:
        return True
    if steps == [replace] and (pre is None or {k: pre.get(k) for k in space_split} == space_split):
        return False
    if normalizer is None and pre and pre.get("type") == "Metaspace" and pre.get("replacement") == _SPACE:
        scheme = pre.get("prepend_scheme", "always")
        if not pre.get("split") and scheme in ("always", "never"):
            return scheme == "always"
    raise UnsupportedTokenizerError(
        f"{source}: normalizer {json.dumps(normalizer)} with pre-tokenizer {json.dumps(pre)} is not how llama.cpp's "
        "SPM tokenizer prepares text (spaces to '▁', one '▁' in front and after each special token or none, no "
        "word splitting); a Metaspace with prepend_scheme 'first' (transformers' legacy=False) differs after "
        'special tokens: set "legacy": true in tokenizer_config.json (sentencepiece\'s own behaviour; '
        "transformers 5.23's save_pretrained drops it), or keep the model in safetensors"
    )


def _spm_scores(tj: dict[str, Any], tokens: list[str], types: list[int], source: str) -> list[float]:
    """Scores under which llama.cpp's SPM merging picks the same pairs as HF's BPE merges, or raise.

    HF merges the adjacent pair of lowest merge rank; llama.cpp merges the adjacent pair whose joined text is
    the token of highest score. They agree when (1) every way to split a normal token into two tokens is a
    merge (llama.cpp can join any two pieces that form a token), and (2) each token's merges are adjacent in
    rank order, so that score = -(rank of the token's first merge) orders all merges as the ranks do. That is
    how transformers builds the merges of a SentencePiece model (`generate_merges`), and what this checks.
    Scores of tokens no merge produces (characters, bytes, specials) are never read by llama.cpp's merging.
    """
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in tj["model"]["merges"]]
    score: dict[str, float] = {}
    previous = None
    for rank, (left, right) in enumerate(merges):
        target = left + right
        if target in score and target != previous:
            raise UnsupportedTokenizerError(
                f"{source}: the merges of {target!r} are not adjacent in rank order (merge {rank}: {left!r} + "
                f"{right!r}); llama.cpp's SPM vocabulary orders merges by one score per token"
            )
        score.setdefault(target, -float(rank))
        previous = target
    merge_set = set(merges)
    normal = {t for t, ty in zip(tokens, types) if ty == gguf.TokenType.NORMAL}
    for token in normal:
        for k in range(1, len(token)):
            pair = (token[:k], token[k:])
            if pair[0] in normal and pair[1] in normal and pair not in merge_set:
                raise UnsupportedTokenizerError(
                    f"{source}: {pair[0]!r} + {pair[1]!r} forms the token {token!r} but is not a merge; llama.cpp's "
                    "SPM tokenizer would join them where HF does not (the merges were not built from the vocab)"
                )
    return [score.get(t, 0.0) for t in tokens]


def add_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, n_vocab: int) -> None:
    """Write the tokenizer of `model_dir` into `writer`, padded to the model's `n_vocab` embedding rows.

    The tokenizer is read as `AutoTokenizer` loads it, not from tokenizer.json on disk: transformers 5
    may rebuild the pipeline per model type (a Qwen2 checkpoint gets Qwen2Tokenizer's split regex and
    NFC even when tokenizer.json says plain ByteLevel), and the GGUF must match what training used.

    Raises:
        UnsupportedTokenizerError: when the tokenizer cannot be reproduced by llama.cpp.
    """
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    source = f"{Path(model_dir)} ({type(hf_tok).__name__})"
    backend = getattr(hf_tok, "backend_tokenizer", None)
    if backend is None:
        raise UnsupportedTokenizerError(
            f"{source}: not a fast (tokenizers) tokenizer; SentencePiece-only "
            "tokenizers are not converted, save a tokenizer.json"
        )
    tj = json.loads(backend.to_str())
    if (tj.get("model") or {}).get("byte_fallback"):
        add_space_prefix = spm_space_prefix(tj, source)
        tokens, types = _tokens_and_types(tj, n_vocab, source)
        writer.add_tokenizer_model("llama")  # llama.cpp's name for SentencePiece-style vocabularies
        writer.add_tokenizer_pre("default")  # read by no SPM code path; written as llama.cpp's converter does
        writer.add_token_list(tokens)
        writer.add_token_scores(_spm_scores(tj, tokens, types, source))
        writer.add_token_types(types)
        writer.add_add_space_prefix(add_space_prefix)  # llama.cpp's SPM default is True: always explicit
    else:
        pre = pre_tokenizer_name(tj, source)
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
