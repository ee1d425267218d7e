"""Which llama.cpp tokenizer settings reproduce a Hugging Face tokenizer.json exactly, or why none does.

llama.cpp does not run a tokenizer's pre-tokenizer from `tokenizer.json`; it picks a hard-coded regex
by the name in `tokenizer.ggml.pre`, and rejects names it does not know. So the converter must name a
pre-tokenizer whose regex and merge rule are *identical* to the HF tokenizer's, or the GGUF tokenizes
differently with no error anywhere (llama.cpp as vendored by llama-cpp-python 0.3.36, read in its
convert_hf_to_gguf and llama-vocab.cpp).

- Byte-level BPE (`pre_tokenizer_name`): one of these exact tokenizer.json shapes, else the pre-tokenizer is
  identified as llama.cpp's converter does, by hashing the ids of a probe text (`gguf_pre_hashes`):
  - `ByteLevel(use_regex=True)` alone (GPT-2 style, our tiny tokenizer) -> "gpt-2": llama.cpp's GPT2 pre-type
    uses the GPT-2 regex `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)`
    and applies merges (no ignore_merges); "default" would add three extra splits (punctuation, digits,
    3-digit groups), so it is NOT equivalent.
  - `Split(<Llama-3 regex>) + ByteLevel(use_regex=False)` -> "llama-bpe" with ignore_merges, else "smaug-bpe".
  - `Split(<Qwen2 regex>) + ByteLevel(use_regex=False)` -> "qwen2"; with Qwen3.5's regex -> "qwen35".
- SentencePiece-style BPE (`byte_fallback` over "▁"-marked text): whether llama.cpp's SPM tokenizer must prefix
  "▁" (`spm_space_prefix`), and one score per token derived from the merge ranks (`spm_scores`).
"""

from __future__ import annotations

import json
from typing import Any

import gguf

from slimtune.export.gguf_pre_hashes import PROBE_TEXT, known_pre_tokenizer

_GPT2 = "gpt-2"
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
_QWEN35_REGEX = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}"
    "| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
# regex -> {ignore_merges: the llama.cpp pre-tokenizer with that regex and that hard-coded ignore_merges}
_SPLIT_PRE = {
    _LLAMA3_REGEX: {True: "llama-bpe", False: "smaug-bpe"},
    _QWEN2_REGEX: {False: "qwen2"},
    _QWEN35_REGEX: {False: "qwen35"},
}
# pre-tokenizers for which llama.cpp (llama-vocab.cpp) hard-codes ignore_merges: a whole word in the vocab is one
# token even where the merges would spell it differently
_IGNORES_MERGES = {"llama-bpe", "falcon3", "falcon-h1", "pixtral", "tekken", "lfm2", "jais", "glm4", "chatglm-bpe"}
# the same regex with and without ignore_merges in llama.cpp
_IGNORE_MERGES_TWINS = {"smaug-bpe": "llama-bpe", "llama-bpe": "smaug-bpe"}
# Texts whose ids llama.cpp and HF must agree on (besides llama.cpp's probe text): prose, digits, code, bytes.
# None starts with a space: that one SentencePiece difference is documented in `spm_space_prefix`.
CHECK_TEXTS = [
    PROBE_TEXT,
    "The capital of France is Paris.",
    "Spell the word 'garden' backwards: nedrag!",
    "What is 12 plus 30? It is 42, or 0x2A; 3.14159 and 1,000,000.",
    "def f(x):\n    return x ** 2  # squared\n\n\nprint(f(7))",
    "\n\nstarts with newlines,   runs of   spaces\tand tabs",
    "naïve café, Ünïcödé, 中文字符, 日本語のテキスト, 한국어, Ελληνικά, עברית, العربية",
    "emoji🙂inside 🚀🦙 and a zero\u200bwidth space",
]


class UnsupportedTokenizerError(ValueError):
    """The tokenizer cannot be written so that llama.cpp tokenizes exactly like Hugging Face."""


def pre_tokenizer_name(tokenizer_json: dict[str, Any], source: str = "tokenizer.json", hf_tokenizer=None) -> str:
    """Return the llama.cpp `tokenizer.ggml.pre` name equivalent to this HF tokenizer, or raise.

    A tokenizer.json of one of the exact shapes in this module's docstring gets its name: the same regex and merge
    rule, whatever text comes. Any other is identified as llama.cpp's converter does, by hashing `hf_tokenizer`'s
    ids for llama.cpp's probe text (`gguf_pre_hashes`). The shape goes first because the probe text cannot tell
    every pair apart: Qwen2's regex and Qwen3.5's (which adds combining marks to words) give the same ids there.

    Raises:
        UnsupportedTokenizerError: naming what differs, when no llama.cpp pre-tokenizer is identical.
    """
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE":
        raise UnsupportedTokenizerError(
            f"{source}: model type {model.get('type')!r} is not supported; the GGUF converter writes "
            "byte-level BPE tokenizers only (SentencePiece/Unigram/WordPiece are not converted)"
        )
    try:
        return _shape_pre_tokenizer(tokenizer_json, source)
    except UnsupportedTokenizerError:
        known = _hashed_pre_tokenizer(model, hf_tokenizer, source) if hf_tokenizer is not None else None
        if known is None:
            raise
        return known


def _hashed_pre_tokenizer(model: dict[str, Any], hf_tokenizer, source: str) -> str | None:
    known = known_pre_tokenizer(hf_tokenizer)
    if known is not None:
        # The probe text has no word whose merges spell it differently from its vocab entry, so the hash cannot
        # see ignore_merges: today's Llama 3 tokenizer.json (BOS added, ignore_merges true) hashes as llama.cpp's
        # "smaug-bpe", the same regex without ignore_merges. The flag picks between such twins.
        ignores = bool(model.get("ignore_merges"))
        if (known in _IGNORES_MERGES) != ignores:
            twin = _IGNORE_MERGES_TWINS.get(known)
            if twin is None:
                raise UnsupportedTokenizerError(
                    f"{source}: the probe text identifies llama.cpp's {known!r} pre-tokenizer, which "
                    f"{'ignores' if known in _IGNORES_MERGES else 'applies'} merges for words in the vocab, but this "
                    f"tokenizer.json has model.ignore_merges={ignores}; llama.cpp knows no such variant"
                )
            known = twin
    return known


def _shape_pre_tokenizer(tokenizer_json: dict[str, Any], source: str) -> str:
    model = tokenizer_json.get("model") or {}
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
            "regex, Llama-3, Qwen2 or Qwen3.5 split regex); refusing to write a GGUF that would tokenize differently"
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
        return _SPLIT_PRE[regex].get(ignore_merges)
    return None


def spm_space_prefix(tokenizer_json: dict[str, Any], source: str = "tokenizer.json") -> bool:
    """Whether llama.cpp must prefix "▁" to this SentencePiece-style tokenizer's text (`add_space_prefix`), or raise.

    llama.cpp's SPM tokenizer replaces every space with "▁", adds one "▁" in front of the text and after
    every special token when `add_space_prefix` is set, and never splits the text into words. These HF
    shapes do the same: Llama 2's tokenizer.json normalizers `Prepend("▁") + Replace(" ", "▁")` (prefix),
    Gemma's `Replace(" ", "▁")` (no prefix; its `Split(" ")` pre-tokenizer then finds no space), and
    `Metaspace(split=False)` with prepend_scheme "never", "always" (what transformers 5 builds for Llama 2,
    Mistral and Phi-3 with legacy=True) or "first" (legacy=False, and what it rebuilds from a SentencePiece
    GGUF). Two documented differences remain, both where sentencepiece itself (and so llama.cpp, and the
    `tokenizer.model` route) differs from transformers' Metaspace: where a text already starts with a space,
    Metaspace adds no second "▁" while llama.cpp does (" hi" -> HF "▁hi", llama.cpp "▁", "▁hi"); and with
    "first", text right after a special token gets no "▁" from HF but one from llama.cpp. Refusing them would
    refuse every Llama 2 style model; both are tested.

    Raises:
        UnsupportedTokenizerError: naming what differs (a normalizer or word splitting llama.cpp does not do).
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
        if not pre.get("split") and scheme in ("always", "first", "never"):
            return scheme != "never"
    raise UnsupportedTokenizerError(
        f"{source}: normalizer {json.dumps(normalizer)} with pre-tokenizer {json.dumps(pre)} is not how llama.cpp's "
        "SPM tokenizer prepares text (spaces to '▁', one '▁' in front and after each special token or none, no "
        "word splitting); save the model's tokenizer.model beside it (written as it is), or keep the model in "
        "safetensors"
    )


def spm_scores(tj: dict[str, Any], tokens: list[str], types: list[int], source: str) -> list[float]:
    """Scores under which llama.cpp's SPM merging picks the same pairs as HF's BPE merges, or raise.

    HF merges the adjacent pair of lowest merge rank; llama.cpp merges the adjacent pair whose joined text is
    the token of highest score, the leftmost among equal scores (as sentencepiece does). transformers builds a
    SentencePiece model's merges (`generate_merges`) by sorting every split of every token by the token's score,
    then by the pieces' lengths, so a token's merges are adjacent in rank order unless tokens share a score;
    there they interleave. `rank_scores` inverts that: score = -(first rank of the token's merges), one score
    for each group of tokens whose merges interleave (equal scores in the source). What must hold besides is that
    every way to split a normal token into two tokens is a merge: llama.cpp can join any two pieces that form a
    token. Scores of tokens no merge produces (characters, bytes, specials) are never read by llama.cpp's merging.
    """
    merges = merge_pairs(tj)
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
    return rank_scores(merges, tokens)


def merge_pairs(tj: dict[str, Any]) -> list[tuple[str, str]]:
    """tokenizer.json's merges as pairs, whether stored as "a b" strings or as two-item lists."""
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in tj["model"]["merges"]]


def rank_scores(merges: list[tuple[str, str]], tokens: list[str]) -> list[float]:
    """-(first merge rank) per token, shared by tokens whose merge rank ranges overlap (see `spm_scores`)."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for rank, (left, right) in enumerate(merges):
        first.setdefault(left + right, rank)
        last[left + right] = rank
    score: dict[str, float] = {}
    group_start, group_end = 0, -1
    for token in sorted(first, key=first.__getitem__):
        if first[token] > group_end:  # no earlier token's merges reach past here: a new score
            group_start = first[token]
        group_end = max(group_end, last[token])
        score[token] = -float(group_start)
    return [score.get(t, 0.0) for t in tokens]
