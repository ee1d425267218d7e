"""Ollama Modelfile TEMPLATEs for the real chat templates of the supported families (llama.cpp's templates/).

For every template that gets a TEMPLATE, chats are rendered through the Go TEMPLATE (as Ollama runs it, with
the Modelfile's SYSTEM standing in for a missing system message) and through the Hugging Face template, and
the strings must be equal. Templates no Go TEMPLATE reproduces must get none, and a Modelfile that says so.
"""

from __future__ import annotations

import json
import re

import pytest
from go_template import render_go
from llama_cpp_assets import template

from slimtune.export.chat_formats import render_hf
from slimtune.export.model_card import render_modelfile

_DS_BOS, _DS_EOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"
# stem -> (bos, eos, format, the stop that ends a turn)
TEMPLATED = {
    "meta-llama-Llama-3.1-8B-Instruct": ("<|begin_of_text|>", "<|eot_id|>", "Llama-3.1", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct": ("<|begin_of_text|>", "<|eot_id|>", "Llama-3.1", "<|eot_id|>"),
    "meta-llama-Llama-3.3-70B-Instruct": ("<|begin_of_text|>", "<|eot_id|>", "Llama-3.1", "<|eot_id|>"),
    "Qwen-Qwen2.5-7B-Instruct": (None, "<|im_end|>", "ChatML", "<|im_end|>"),
    "Qwen-Qwen3-0.6B": (None, "<|im_end|>", "ChatML", "<|im_end|>"),
    "Qwen3.5-4B": (None, "<|im_end|>", "ChatML-thinking", "<|im_end|>"),
    "google-gemma-2-2b-it": ("<bos>", "<eos>", "Gemma", "<end_of_turn>"),
    "google-gemma-4-31B-it": ("<bos>", "<eos>", "Gemma-4", "<turn|>"),
    "google-gemma-4-31B-it-interleaved": ("<bos>", "<eos>", "Gemma-4", "<turn|>"),
    "microsoft-Phi-3.5-mini-instruct": ("<s>", "<|endoftext|>", "Phi-3", "<|end|>"),
    "Mistral-Small-3.2-24B-Instruct-2506": ("<s>", "</s>", "Mistral-Tekken", "</s>"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("<s>", "</s>", "Mistral-Nemo", "</s>"),
    "unsloth-mistral-Devstral-Small-2507": ("<s>", "</s>", "Mistral-Tekken", "</s>"),
    "mistralai-Ministral-3-14B-Reasoning-2512": ("<s>", "</s>", "Mistral-Tekken", "</s>"),
    "ibm-granite-granite-3.3-2B-Instruct": (None, "<|end_of_text|>", "Granite", "<|end_of_text|>"),
    "ibm-granite-granite-4.0": (None, "<|end_of_text|>", "Granite", "<|end_of_text|>"),
    "ibm-granite-granite-4.1": (None, "<|end_of_text|>", "Granite", "<|end_of_text|>"),
    "Bielik-11B-v3.0-Instruct": ("<s>", "<|im_end|>", "ChatML", "<|im_end|>"),
    "HuggingFaceTB-SmolLM3-3B": (None, "<|im_end|>", "SmolLM3", "<|im_end|>"),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": (_DS_BOS, _DS_EOS, "DeepSeek-R1", _DS_EOS),
}
# Templates of supported families that no Go TEMPLATE of slimtune reproduces, and why.
UNTEMPLATED = {
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": (_DS_BOS, _DS_EOS),  # llama.cpp's copy closes <think> at once
    "Qwen-QwQ-32B": (None, "<|im_end|>"),  # likewise
    "meetkai-functionary-medium-v3.1": ("<|begin_of_text|>", "<|eot_id|>"),  # a tools preamble in every prompt
}
SYSTEM = {"role": "system", "content": "You are a terse geography tutor."}
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris — la Ville Lumière."},
        {"role": "user", "content": "And of Italy?\nOne word."},
    ],
]


def _modelfile(stem: str, bos: str | None, eos: str) -> tuple[str, str | None, str | None]:
    text = render_modelfile("m.gguf", template(stem), eos_token=eos, bos_token=bos)
    go = re.search(r'^TEMPLATE """(.*?)"""$', text, re.S | re.M)
    system = re.search(r'^SYSTEM """(.*?)"""$', text, re.S | re.M)
    return text, go and go.group(1), system and system.group(1)


@pytest.mark.parametrize("stem", sorted(TEMPLATED))
def test_go_template_renders_chats_like_the_hf_template(stem):
    bos, eos, name, stop = TEMPLATED[stem]
    text, go, default_system = _modelfile(stem, bos, eos)
    assert f"# Chat format: {name}\n" in text and go is not None
    with_system = [[SYSTEM, *chat] for chat in CHATS]
    accepts_system = render_hf(template(stem), with_system[0], bos, eos) is not None
    for chat in [*CHATS, *(with_system if accepts_system else [])]:
        # Ollama sends the Modelfile's SYSTEM as a system message when the chat has none.
        sent = (
            chat
            if chat[0]["role"] == "system" or not default_system
            else [
                {"role": "system", "content": default_system},
                *chat,
            ]
        )
        expected = render_hf(template(stem), chat, bos, eos)
        assert expected is not None
        assert render_go(go, sent) == expected, chat
    stops = re.findall(r"^PARAMETER stop (.*)$", text, re.M)
    assert json.dumps(stop, ensure_ascii=False) in stops


@pytest.mark.parametrize("stem", sorted(UNTEMPLATED))
def test_a_template_no_go_template_reproduces_gets_none_and_says_how_to_run_it(stem):
    bos, eos = UNTEMPLATED[stem]
    text, go, _ = _modelfile(stem, bos, eos)
    assert go is None and "no Go template reproduces it" in text and "no TEMPLATE is written" in text
    assert "llama-cli -m m.gguf --jinja" in text and "ollama show" in text
    assert f"PARAMETER stop {json.dumps(eos, ensure_ascii=False)}" in text


def test_go_evaluator_reads_system_indexes_and_merges_like_ollama():
    go = '{{- if .System }}S:{{ .System }}|{{ end }}{{ range .Messages }}{{ if ne .Role "system" }}{{ .Content }};'
    go += "{{ end }}{{ end }}"
    chat = [SYSTEM, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert render_go(go, chat) == f"S:{SYSTEM['content']}|a\n\nb;"  # consecutive user turns merged
    last = "{{ range $i, $_ := .Messages }}{{ $last := eq (len (slice $.Messages $i)) 1 }}{{ if and $last .Role }}"
    last += "{{ $i }}{{ .Role }}{{ else }}-{{ end }}{{ end }}"
    assert render_go(last, [SYSTEM, {"role": "user", "content": "a"}]) == "-1user"
    with pytest.raises(AssertionError, match="unsupported"):
        render_go("{{ .Prompt }}", chat)
