"""The chat formats an Ollama Modelfile can reproduce: ChatML (and Qwen3.5's thinking variant), Llama-3,
Llama-3.1 (its knowledge-cutoff system block), Gemma, Gemma-4, Mistral, Mistral-Tekken (v7), Mistral-Nemo, Phi-3,
Granite, SmolLM3 and DeepSeek-R1 (the distills).

Each format is written twice: as a Python reference (what the model's Hugging Face chat template must
render for it to be recognised) and as the Go template Ollama evaluates. A model's template is
recognised by rendering a probe chat through transformers' own renderer and comparing the text with the
reference, so a TEMPLATE is only written where it reproduces the training format exactly. Go templates
cannot trim text or search it, so what a HF template does with surrounding whitespace (Llama 3 `| trim`)
or with flags in the text (SmolLM3's /no_think, reasoning split off at `</think>`) is not reproduced;
the probes and tests use text those steps leave unchanged.
"""

from __future__ import annotations

import re
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


def _chatml_think(messages: Messages, eos: str) -> str:
    return _chatml(messages, eos) + "<think>\n"


def _gemma4(messages: Messages, eos: str) -> str:
    role = {"assistant": "model"}
    body = "".join(f"<|turn>{role.get(m['role'], m['role'])}\n{m['content']}<turn|>\n" for m in messages)
    return body + "<|turn>model\n<|channel>thought\n<channel|>"


def _tekken(messages: Messages, eos: str) -> str:
    wrap = {"system": "[SYSTEM_PROMPT]{}[/SYSTEM_PROMPT]", "user": "[INST]{}[/INST]", "assistant": "{}" + eos}
    return "".join(wrap[m["role"]].format(m["content"]) for m in messages)


def _split_system(messages: Messages) -> tuple[str | None, Messages]:
    """(the leading system message's text or None, the other messages)."""
    if messages and messages[0]["role"] == "system":
        return messages[0]["content"], messages[1:]
    return None, messages


def _mistral_nemo(messages: Messages, eos: str) -> str:
    """Mistral-Nemo (v3 Tekken): no system turn; the system prompt opens the last user message."""
    system, rest = _split_system(messages)
    out = []
    for i, m in enumerate(rest):
        if m["role"] == "user":
            last = system is not None and i == len(rest) - 1
            out.append(f"[INST]{system}\n\n{m['content']}[/INST]" if last else f"[INST]{m['content']}[/INST]")
        else:
            out.append(m["content"] + eos)
    return "".join(out)


def _granite(messages: Messages, eos: str) -> str:
    body = "".join(f"<|start_of_role|>{m['role']}<|end_of_role|>{m['content']}<|end_of_text|>\n" for m in messages)
    return body + "<|start_of_role|>assistant<|end_of_role|>"


_SMOLLM3_HEAD = (
    "<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\nReasoning Mode: /think\n\n"
    "## Custom Instructions\n\n"
)


def _smollm3(messages: Messages, eos: str) -> str:
    """SmolLM3 in its default /think mode; a system prompt that says /think or /no_think (which the HF
    template strips and obeys) is beyond a Go template, so such prompts render differently in Ollama."""
    system, rest = _split_system(messages)
    return _SMOLLM3_HEAD + (system or "") + "\n\n<|im_end|>\n" + _chatml(rest, eos)


def _deepseek_r1(messages: Messages, eos: str) -> str:
    turn = {"system": "{}", "user": "<\uff5cUser\uff5c>{}", "assistant": "<\uff5cAssistant\uff5c>{}" + eos}
    return "".join(turn[m["role"]].format(m["content"]) for m in messages) + "<\uff5cAssistant\uff5c><think>\n"


_LLAMA31_DATE = re.compile(r"Cutting Knowledge Date: December 2023\nToday Date: ([^\n{}]*)\n\n")


def _llama31(date: str) -> ChatFormat:
    """Llama 3.1/3.2/3.3: every prompt opens with a system block that carries the knowledge cutoff and a date
    (3.1 and 3.3 write 26 Jul 2024; 3.2 writes the day it renders, so the TEMPLATE keeps the export's date)."""
    head = (
        f"<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: {date}\n\n"
    )

    def render(messages: Messages, eos: str) -> str:
        system, rest = _split_system(messages)
        return head + (system or "") + "<|eot_id|>" + _llama3(rest, eos)

    return ChatFormat(
        "Llama-3.1",
        render,
        head + "{{ .System }}<|eot_id|>"
        '{{- range .Messages }}{{ if ne .Role "system" }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n'
        "{{ .Content }}<|eot_id|>{{ end }}{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n",
        ("EOS", "<|eot_id|>"),
        system=True,
    )


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
    ChatFormat(
        "ChatML-thinking",
        _chatml_think,
        "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
        "<think>\n",
        ("EOS", "<|im_end|>"),
        system=True,
    ),
    ChatFormat(
        "Gemma-4",
        _gemma4,
        '{{- range .Messages }}<|turn>{{ if eq .Role "assistant" }}model{{ else }}{{ .Role }}{{ end }}\n'
        "{{ .Content }}<turn|>\n{{ end }}<|turn>model\n<|channel>thought\n<channel|>",
        ("EOS", "<turn|>"),
        system=True,
    ),
    ChatFormat(
        "Mistral-Tekken",
        _tekken,
        '{{- range .Messages }}{{ if eq .Role "system" }}[SYSTEM_PROMPT]{{ .Content }}[/SYSTEM_PROMPT]'
        '{{ else if eq .Role "user" }}[INST]{{ .Content }}[/INST]'
        '{{ else if eq .Role "assistant" }}{{ .Content }}EOS{{ end }}{{ end }}',
        ("EOS", "[INST]"),
        system=True,
    ),
    ChatFormat(
        "Mistral-Nemo",
        _mistral_nemo,
        "{{- range $i, $_ := .Messages }}{{ $last := eq (len (slice $.Messages $i)) 1 }}"
        '{{ if eq .Role "user" }}[INST]{{ if and $.System $last }}{{ $.System }}\n\n{{ end }}{{ .Content }}[/INST]'
        '{{ else if eq .Role "assistant" }}{{ .Content }}EOS{{ end }}{{ end }}',
        ("EOS", "[INST]"),
        system=True,
    ),
    ChatFormat(
        "Granite",
        _granite,
        "{{- range .Messages }}<|start_of_role|>{{ .Role }}<|end_of_role|>{{ .Content }}<|end_of_text|>\n{{ end }}"
        "<|start_of_role|>assistant<|end_of_role|>",
        ("EOS", "<|end_of_text|>"),
        system=True,
    ),
    ChatFormat(
        "SmolLM3",
        _smollm3,
        _SMOLLM3_HEAD + "{{ .System }}\n\n<|im_end|>\n"
        '{{ range .Messages }}{{ if ne .Role "system" }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}'
        "{{ end }}<|im_start|>assistant\n",
        ("EOS", "<|im_end|>"),
        system=True,
    ),
    ChatFormat(
        "DeepSeek-R1",
        _deepseek_r1,
        '{{ .System }}{{ range .Messages }}{{ if eq .Role "user" }}<\uff5cUser\uff5c>{{ .Content }}'
        '{{ else if eq .Role "assistant" }}<\uff5cAssistant\uff5c>{{ .Content }}EOS{{ end }}{{ end }}'
        "<\uff5cAssistant\uff5c><think>\n",
        ("EOS",),
        system=True,
    ),
)
# Formats that depend on what the template renders (Llama 3.x's date), named here for messages.
FORMAT_NAMES = (*(f.name for f in FORMATS), "Llama-3.1")
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
    dated = _LLAMA31_DATE.search(render_hf(chat_template, list(PROBE), bos_token, eos_token) or "")
    for fmt in (*FORMATS, *([_llama31(dated.group(1))] if dated else [])):
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
