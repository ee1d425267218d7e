"""Turning one record into token ids and labels: chat messages, prompt/completion, or plain text.

Labels are the input ids with -100 wherever no loss is wanted. With completion-only loss, only the
assistant turns (chat) or the completion (prompt/completion) are targets; the assistant spans come
from the chat template's `{% generation %}` markers when it has them (the template decides what is
trained, reasoning included), and otherwise from finding each assistant text in one rendering of the
whole conversation (`chat_mask`: the text, its end-of-turn token, and its reasoning block if asked).

The first token of every example is never a target: alone it has nothing to be predicted from, and in
a packed row it would be predicted from the previous example's last token.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from slimtune.data.chat_mask import ChatMaskError, assistant_mask
from slimtune.spec.schema import DataSpec

IGNORE_INDEX = -100
Format = Literal["messages", "prompt_completion", "text"]
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


# Chat roles the loss masking and the chat templates understand; anything else is a mapping mistake.
ROLES = ("system", "user", "assistant", "tool")


class FieldError(ValueError):
    """A record whose field is missing or of the wrong type; `field` names it for the message."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"field {field!r}: {message}")


def detect_format(record: Any, data: DataSpec) -> Format:
    """The format named in the spec, or the one the record's fields show when it is `auto`."""
    if data.format != "auto":
        return data.format
    if not isinstance(record, dict):
        raise FieldError("(record)", f"expected a JSON object, got {type(record).__name__}")
    if data.messages_field in record:
        return "messages"
    if data.prompt_field in record and data.completion_field in record:
        return "prompt_completion"
    if data.text_field in record:
        return "text"
    raise FieldError(
        "(record)",
        f"cannot detect the format from fields {sorted(record)}; expected "
        f"{data.messages_field!r}, {data.prompt_field!r}+{data.completion_field!r} or "
        f"{data.text_field!r}; set data.format and data.messages_field/prompt_field/"
        "completion_field/text_field to your field names",
    )


def render(record: Any, fmt: Format, data: DataSpec, tokenizer) -> tuple[list[int], list[int]]:
    """Token ids and labels (same length, -100 = no loss) of one record, before truncation.

    Raises:
        FieldError: a field is missing, of the wrong type, or the chat template cannot mark it.
    """
    if not isinstance(record, dict):
        raise FieldError("(record)", f"expected a JSON object, got {type(record).__name__}")
    if fmt == "messages":
        ids, mask = _render_messages(_messages(record, data.messages_field), tokenizer, data)
    elif fmt == "prompt_completion":
        prompt = _string(record, data.prompt_field, "prompt_field")
        completion = _string(record, data.completion_field, "completion_field")
        prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        completion_ids = _with_eos(tokenizer(completion, add_special_tokens=False)["input_ids"], tokenizer)
        ids = prompt_ids + completion_ids
        mask = [not data.completion_only_loss] * len(prompt_ids) + [True] * len(completion_ids)
    else:
        text = _string(record, data.text_field, "text_field")
        ids = _with_eos(tokenizer(text, add_special_tokens=True)["input_ids"], tokenizer)
        mask = [True] * len(ids)
    labels = [t if keep else IGNORE_INDEX for t, keep in zip(ids, mask)]
    if labels:
        labels[0] = IGNORE_INDEX
    return list(ids), labels


def _string(record: dict, field: str, spec_field: str) -> str:
    if field not in record:
        raise FieldError(
            field, f"missing; the record has {sorted(record)}; set data.{spec_field} to the field that holds it"
        )
    value = record[field]
    if not isinstance(value, str):
        raise FieldError(field, f"expected a string, got {type(value).__name__}")
    return value


def _messages(record: dict, field: str) -> list[dict[str, str]]:
    if field not in record:
        raise FieldError(
            field,
            f"missing; the record has {sorted(record)}; set data.messages_field to the "
            "field that holds the chat messages",
        )
    value = record[field]
    if not isinstance(value, list) or not value:
        raise FieldError(
            field,
            f"expected a non-empty list of {{role, content}} objects, got "
            f"{type(value).__name__ if value != [] else 'an empty list'}",
        )
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise FieldError(f"{field}[{i}]", f"expected an object with role and content, got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise FieldError(f"{field}[{i}].{key}", "missing; every message needs role and content")
            if not isinstance(message[key], str):
                raise FieldError(f"{field}[{i}].{key}", f"expected a string, got {type(message[key]).__name__}")
        reasoning = message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise FieldError(
                f"{field}[{i}].reasoning_content", f"expected a string or null, got {type(reasoning).__name__}"
            )
        if message["role"] not in ROLES:
            raise FieldError(
                f"{field}[{i}].role",
                f"unknown role {message['role']!r}; use one of {', '.join(ROLES)} (ShareGPT's human/gpt are "
                "user/assistant: map them when writing the file)",
            )
    return value


def _with_eos(ids: list[int], tokenizer) -> list[int]:
    # Ending on EOS teaches the model to stop; tokenizers that add it themselves are left alone.
    eos = tokenizer.eos_token_id
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def _render_messages(messages: list[dict], tokenizer, data: DataSpec) -> tuple[list[int], list[bool]]:
    template = tokenizer.chat_template
    if not template:
        raise FieldError(
            data.messages_field,
            "the tokenizer has no chat template; use a chat model's "
            "tokenizer, or convert the data to prompt/completion or text",
        )
    if not data.completion_only_loss:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        return list(ids), [True] * len(ids)
    if isinstance(template, str) and _GENERATION_TAG.search(template):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
    try:
        return assistant_mask(messages, tokenizer, data.train_reasoning)
    except ChatMaskError as e:
        raise FieldError(data.messages_field, str(e)) from None
