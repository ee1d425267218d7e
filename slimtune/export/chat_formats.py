"""The chat formats an Ollama Modelfile can reproduce: ChatML, Llama-3, Gemma, Mistral and Phi-3.

Each format is written twice: as a Python reference (what the model's Hugging Face chat template must
render for it to be recognised) and as the Go template Ollama evaluates. A model's template is
recognised by rendering a probe chat through transformers' own renderer and comparing the text with the
reference, so a TEMPLATE is only written where it reproduces the training format exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

Messages = Sequence[Mapping[str, str]]


@dataclass(frozen=True)
class ChatFormat:
    """One chat format: its reference renderer (with the generation prompt), Ollama template and stops.

    `EOS` in `ollama_template` and `stops` stands for the tokenizer's end-of-sequence token.
    """

    name: str
    render: Callable[[Messages, str], str]
    ollama_template: str
    stops: tuple[str, ...]
    system: bool  # whether the format has a system turn (Gemma and Mistral templates reject one)

    def template_for(self, eos: str) -> str:
        return self.ollama_template.replace("EOS", eos)

    def stops_for(self, eos: str) -> list[str]:
        return [s.replace("EOS", eos) for s in self.stops if s != "EOS" or eos]


def _chatml(messages: Messages, eos: str) -> str:
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return body + "<|im_start|>assistant\n"


def _llama3(messages: Messages, eos: str) -> str:
    body = "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>" for m in messages)
    return body + "<|start_header_id|>assistant<|end_header_id|>\n\n"


def _gemma(messages: Messages, eos: str) -> str:
    role = {"assistant": "model"}
    body = "".join(f"<start_of_turn>{role.get(m['role'], m['role'])}\n{m['content']}<end_of_turn>\n" for m in messages)
    return body + "<start_of_turn>model\n"


def _mistral(messages: Messages, eos: str) -> str:
    return "".join(
        f"[INST] {m['content']} [/INST]" if m["role"] == "user" else f"{m['content']}{eos}" for m in messages
    )


def _phi3(messages: Messages, eos: str) -> str:
    body = "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages)
    return body + "<|assistant|>\n"


FORMATS = (
    ChatFormat(
        "ChatML",
        _chatml,
        "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n",
        ("EOS", "<|im_end|>"),
        system=True,
    ),
    ChatFormat(
        "Llama-3",
        _llama3,
        "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>"
        "{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n",
        ("EOS", "<|eot_id|>"),
        system=True,
    ),
    ChatFormat(
        "Gemma",
        _gemma,
        '{{- range .Messages }}<start_of_turn>{{ if eq .Role "assistant" }}model{{ else }}{{ .Role }}{{ end }}\n'
        "{{ .Content }}<end_of_turn>\n{{ end }}<start_of_turn>model\n",
        ("EOS", "<end_of_turn>"),
        system=False,
    ),
    ChatFormat(
        "Mistral",
        _mistral,
        '{{- range .Messages }}{{ if eq .Role "user" }}[INST] {{ .Content }} [/INST]'
        '{{ else if eq .Role "assistant" }}{{ .Content }}EOS{{ end }}{{ end }}',
        ("EOS", "[INST]"),
        system=False,
    ),
    ChatFormat(
        "Phi-3",
        _phi3,
        "{{- range .Messages }}<|{{ .Role }}|>\n{{ .Content }}<|end|>\n{{ end }}<|assistant|>\n",
        ("EOS", "<|end|>"),
        system=True,
    ),
)
# A probe with a system turn, two user turns and one assistant turn covers every branch these templates have.
PROBE = (
    {"role": "system", "content": "SYS-0"},
    {"role": "user", "content": "USER-1"},
    {"role": "assistant", "content": "ASSISTANT-2"},
    {"role": "user", "content": "USER-3"},
)


def recognise(
    chat_template: str | None, bos_token: str | None, eos_token: str | None
) -> tuple[ChatFormat | None, str | None]:
    """(the format the template renders, the default system prompt it adds when a chat has none)."""
    if not chat_template:
        return None, None
    eos = eos_token or ""
    for fmt in FORMATS:
        probe = list(PROBE if fmt.system else PROBE[1:])
        if render_hf(chat_template, probe, bos_token, eos_token) != fmt.render(probe, eos):
            continue
        if not fmt.system:
            return fmt, None
        without = list(PROBE[1:])
        rendered = render_hf(chat_template, without, bos_token, eos_token)
        if rendered == fmt.render(without, eos):
            return fmt, None
        # Qwen-style templates insert a default system turn: accept it if the rest is exactly the format.
        head, tail = fmt.render([{"role": "system", "content": "\0"}, *without], eos).split("\0")
        if rendered is not None and rendered.startswith(head) and rendered.endswith(tail):
            default = rendered[len(head) : len(rendered) - len(tail)]
            if rendered == fmt.render([{"role": "system", "content": default}, *without], eos):
                return fmt, default
        return None, None
    return None, None


def render_hf(chat_template: str, messages: Messages, bos_token: str | None, eos_token: str | None) -> str | None:
    """Render with transformers' renderer (what the tokenizer uses), without the leading BOS that llama.cpp
    adds itself; None if the template rejects the chat."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, _ = render_jinja_template(
            [list(messages)],
            chat_template=chat_template,
            add_generation_prompt=True,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
        )
    except Exception:
        return None
    text = rendered[0]
    return text[len(bos_token) :] if bos_token and text.startswith(bos_token) else text
