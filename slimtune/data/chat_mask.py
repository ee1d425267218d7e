"""Which tokens of a rendered chat the model learns: each assistant message's text and its end-of-turn marker.

The conversation is rendered once by the chat template; each assistant message's text is found in that
rendering by character offsets, in message order, and characters map to tokens through the fast
tokenizer's offset mapping. Rendering conversation prefixes and comparing token ids (what this replaced)
fails where a template rewrites earlier turns as more follow (Qwen3 and Qwen3.5 drop the reasoning of
turns before the last user message) and where BPE merges across the end of a prefix; finding text in one
rendering works for any template that writes the assistant's text verbatim.

What one assistant message trains:
- its text: every token that overlaps its characters (a token straddling the edge of the text is trained,
  since the model has to produce it to produce the reply). A template that trims the text (Llama 3,
  Gemma) is matched on the trimmed text;
- its reasoning block, when `train_reasoning` is on and the template renders it: from the `<think>` tag
  that opens it through the answer. The reasoning is the message's `reasoning_content`, or a leading
  `<think>...</think>` block of its content (split the way Qwen3's template splits it);
- its end-of-turn tokens: the special token that follows the text with at most whitespace between
  (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, `<turn|>`, `</s>`, `<|end|>`, `<|end_of_text|>`), with that
  whitespace. Nothing after that token is trained (ChatML's "\\n", the next turn's header, Phi-3's final
  `<|endoftext|>`): generation stops at the marker. "Special" is what the tokenizer marks special.
An assistant message whose answer is empty (a tool call the template writes from `tool_calls`) trains nothing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from itertools import accumulate
from weakref import WeakKeyDictionary

_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"
_SPACE = re.compile(r"\s*")
_SPECIAL_IDS: WeakKeyDictionary = WeakKeyDictionary()  # tokenizer -> the ids it marks special


class ChatMaskError(ValueError):
    """The assistant tokens of a conversation cannot be found; the message says which and what to do."""


def assistant_mask(messages: Sequence[dict], tokenizer, train_reasoning: bool) -> tuple[list[int], list[bool]]:
    """Token ids of the whole rendered conversation and, per token, whether it is an assistant target.

    Raises:
        ChatMaskError: the tokenizer gives no character offsets, or an assistant text is not in the rendering.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ChatMaskError(
            f"the {type(tokenizer).__name__} tokenizer gives no character offsets, so assistant tokens cannot be "
            "found; use a fast (tokenizer.json) tokenizer or set data.completion_only_loss: false"
        )
    text = tokenizer.apply_chat_template(list(messages), tokenize=False)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]
    special = _special_ids(tokenizer)
    special_ends = {start: end for (start, end), t in zip(offsets, ids) if t in special and end > start}
    spans = _assistant_spans(text, messages, special_ends, train_reasoning)
    return ids, _tokens_in(spans, offsets, len(text))


def _special_ids(tokenizer) -> frozenset[int]:
    """The ids the tokenizer marks special, listed once per tokenizer object: listing a tokenizer's added
    tokens takes 30 ms with 6,000 of them (Gemma's `<unused*>`), which per record would dominate loading."""
    cached = _SPECIAL_IDS.get(tokenizer)
    if cached is None:
        added = {i for i, token in tokenizer.added_tokens_decoder.items() if getattr(token, "special", False)}
        cached = _SPECIAL_IDS[tokenizer] = frozenset(added | set(tokenizer.all_special_ids))
    return cached


def _split_reasoning(message: dict) -> tuple[str, str]:
    """(answer, reasoning) of an assistant message, as Qwen3's template splits them."""
    content = message["content"]
    reasoning = message.get("reasoning_content")
    if reasoning is None and _THINK_CLOSE in content:
        reasoning = content.split(_THINK_CLOSE)[0].split(_THINK_OPEN)[-1]
        content = content.split(_THINK_CLOSE)[-1].lstrip("\n")
    return content, reasoning or ""


def _assistant_spans(
    text: str, messages: Sequence[dict], special_ends: dict[int, int], train_reasoning: bool
) -> list[tuple[int, int]]:
    """Character spans to train, one per assistant message with text, searched forward in message order."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        answer, reasoning = _split_reasoning(message)
        if not answer.strip():
            continue  # no text of its own to find (an empty reply, a tool call the template writes itself)
        # Search after the user turn first: an answer quoted in the question is not the reply.
        previous = _end_of(text, messages[i - 1], cursor) if i else None
        anchor = cursor if previous is None else previous
        located = _locate(text, answer, reasoning, anchor, special_ends) or _locate(
            text, answer, reasoning, cursor, special_ends
        )
        if located is None:
            raise ChatMaskError(
                f"assistant message {i} does not appear verbatim in the chat template's rendering, so its tokens "
                "cannot be found; set data.completion_only_loss: false to train on every token"
            )
        block, start, end = located
        end = _end_of_turn(text, end, special_ends)
        spans.append((block if train_reasoning and block is not None else start, end))
        cursor = end
    return spans


def _end_of(text: str, message: dict, cursor: int) -> int | None:
    """Where a user/system/tool message's text ends in the rendering after `cursor`, if found; None for
    assistant messages and texts the template does not write verbatim."""
    if message["role"] == "assistant" or not message["content"].strip():
        return None
    found = _find(text, message["content"], cursor)
    return None if found is None else found[1]


def _locate(
    text: str, answer: str, reasoning: str, start: int, special_ends: dict[int, int]
) -> tuple[int | None, int, int] | None:
    """(start of the rendered reasoning block or None, answer start, answer end), searching from `start`."""
    thought = _find(text, reasoning, start) if reasoning.strip() else None
    if thought is not None:
        found = _find_answer(text, answer, thought[1], special_ends)
        # A reasoning block and its answer share a turn: no special token (a turn marker) lies between them.
        if found is not None and not any(thought[1] <= s < found[0] for s in special_ends):
            opening = text.rfind(_THINK_OPEN, start, thought[0])
            return (opening if opening >= 0 else thought[0]), *found
    found = _find_answer(text, answer, start, special_ends)
    return None if found is None else (None, *found)


def _find_answer(text: str, answer: str, start: int, special_ends: dict[int, int]) -> tuple[int, int] | None:
    """The answer's first occurrence that ends a turn (only whitespace before a special token or the end of
    the text), else its first occurrence: a short reply such as "assistant" also occurs in role headers."""
    for needle in _variants(answer):
        first = at = text.find(needle, start)
        while at >= 0:
            after = _SPACE.match(text, at + len(needle)).end()
            if after == len(text) or after in special_ends:
                return at, at + len(needle)
            at = text.find(needle, at + 1)
        if first >= 0:
            return first, first + len(needle)
    return None


def _find(text: str, needle: str, start: int) -> tuple[int, int] | None:
    for variant in _variants(needle):
        at = text.find(variant, start)
        if at >= 0:
            return at, at + len(variant)
    return None


def _variants(needle: str) -> list[str]:
    """The text as written, then as templates that trim it render it (Qwen strips newlines, Llama 3 `| trim`)."""
    return [v for v in dict.fromkeys((needle, needle.strip("\n"), needle.strip())) if v]


def _end_of_turn(text: str, end: int, special_ends: dict[int, int]) -> int:
    """The end of the special token that follows `end` across whitespace only, else `end` itself."""
    after = _SPACE.match(text, end).end()
    return special_ends.get(after, end)


def _tokens_in(spans: list[tuple[int, int]], offsets: list[tuple[int, int]], length: int) -> list[bool]:
    """Per token, whether it overlaps a span (prefix sums over a per-character flag)."""
    flags = [0] * (length + 1)
    for start, end in spans:
        flags[start] += 1
        flags[end] -= 1
    depth = list(accumulate(flags))[:length]  # spans covering each character
    before = [0, *accumulate(1 if d > 0 else 0 for d in depth)]  # trained characters before each position

    def hit(start: int, end: int) -> bool:
        end = max(end, start + 1)  # a zero-width token counts where it sits
        return before[min(end, length)] - before[min(start, length)] > 0

    return [hit(s, e) for s, e in offsets]
