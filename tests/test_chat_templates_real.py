"""Assistant-only loss on the real chat templates of the supported families (llama.cpp's `models/templates/`).

Each template gets a byte-level BPE tokenizer that carries its special tokens (marked special, as the Hub
tokenizers mark them), and a two-turn chat with a system prompt (left out where the template rejects one).
The trained tokens must be exactly each assistant text followed by its end-of-turn token, found in one
rendering of the whole conversation.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from llama_cpp_assets import template
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from slimtune.data import IGNORE_INDEX, FieldError, render
from slimtune.models.tiny import build_spm_tokenizer
from slimtune.spec.schema import DataSpec

SYSTEM = "You are a terse geography tutor."
TURNS = (
    ("What is the capital of France?", "Paris — la Ville Lumière, since 987."),
    ("And of Italy?", "Rome (since 1871)."),
)
_CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_LLAMA3 = tuple("<|begin_of_text|> <|start_header_id|> <|end_header_id|> <|eot_id|> <|eom_id|> <|python_tag|>".split())
_GEMMA4 = tuple("<bos> <eos> <|turn> <turn|> <|channel> <channel|> <|think|> <|tool_call> <tool_call|>".split())
_MISTRAL = tuple("<s> </s> [INST] [/INST] [SYSTEM_PROMPT] [/SYSTEM_PROMPT] [TOOL_CALLS] [AVAILABLE_TOOLS]".split())
_GRANITE = ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>")


@dataclass(frozen=True)
class Vocab:
    """The special tokens of a template's Hub tokenizer, and the token that ends an assistant turn."""

    specials: tuple[str, ...]
    end_of_turn: str
    bos: str | None = None
    eos: str | None = None
    added: tuple[str, ...] = ()  # added tokens the Hub tokenizer does not mark special (Qwen's <think>)
    system: bool = True  # the template accepts a system message


_QWEN = Vocab(_CHATML, "<|im_end|>", eos="<|im_end|>", added=("<think>", "</think>", "<tool_call>", "</tool_call>"))
_LLAMA = Vocab(_LLAMA3, "<|eot_id|>", bos="<|begin_of_text|>", eos="<|eot_id|>")
_DEEPSEEK_END = "<\uff5cend\u2581of\u2581sentence\uff5c>"
_DEEPSEEK = Vocab(
    ("<\uff5cbegin\u2581of\u2581sentence\uff5c>", _DEEPSEEK_END, "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>"),
    _DEEPSEEK_END,
    "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
    _DEEPSEEK_END,
    added=("<think>", "</think>"),
)
# Every template of llama.cpp's models/templates/ whose model is of a supported family (Llama 3.x and its
# fine-tunes, Mistral/Mistral 3, Qwen2/2.5/3/3.5, Gemma 2/4, Phi-3.5, SmolLM3, Granite). Left out: the
# tool-use-only templates (Hermes 2 Pro/3 "tool_use", firefunction-v2), which cannot render a chat without tools.
TEMPLATES = {
    "meta-llama-Llama-3.1-8B-Instruct": _LLAMA,
    "meta-llama-Llama-3.2-3B-Instruct": _LLAMA,
    "meta-llama-Llama-3.3-70B-Instruct": _LLAMA,
    "Qwen-Qwen2.5-7B-Instruct": _QWEN,
    "Qwen-Qwen3-0.6B": _QWEN,
    "Qwen3.5-4B": _QWEN,
    "google-gemma-2-2b-it": Vocab(
        ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), "<end_of_turn>", "<bos>", "<eos>", system=False
    ),
    "google-gemma-4-31B-it": Vocab(_GEMMA4, "<turn|>", "<bos>", "<eos>"),
    "google-gemma-4-31B-it-interleaved": Vocab(_GEMMA4, "<turn|>", "<bos>", "<eos>"),
    "microsoft-Phi-3.5-mini-instruct": Vocab(
        ("<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
        "<|end|>",
        "<s>",
        "<|endoftext|>",
    ),
    "Mistral-Small-3.2-24B-Instruct-2506": Vocab(_MISTRAL, "</s>", "<s>", "</s>"),
    "mistralai-Mistral-Nemo-Instruct-2407": Vocab(_MISTRAL, "</s>", "<s>", "</s>"),
    "HuggingFaceTB-SmolLM3-3B": Vocab(_CHATML, "<|im_end|>", eos="<|im_end|>", added=("<think>", "</think>")),
    "ibm-granite-granite-3.3-2B-Instruct": Vocab(_GRANITE, "<|end_of_text|>", "<|end_of_text|>", "<|end_of_text|>"),
    "ibm-granite-granite-4.0": Vocab(_GRANITE, "<|end_of_text|>", "<|end_of_text|>", "<|end_of_text|>"),
    "ibm-granite-granite-4.1": Vocab(_GRANITE, "<|end_of_text|>", "<|end_of_text|>", "<|end_of_text|>"),
    "Qwen-QwQ-32B": _QWEN,
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": _DEEPSEEK,
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": _DEEPSEEK,
    "meetkai-functionary-medium-v3.1": _LLAMA,
    "meetkai-functionary-medium-v3.2": _LLAMA,
    "unsloth-mistral-Devstral-Small-2507": Vocab(_MISTRAL, "</s>", "<s>", "</s>"),
    "mistralai-Ministral-3-14B-Reasoning-2512": Vocab(_MISTRAL + ("[THINK]", "[/THINK]"), "</s>", "<s>", "</s>"),
    "Bielik-11B-v3.0-Instruct": Vocab(("<s>", "</s>", *_CHATML), "<|im_end|>", "<s>", "<|im_end|>"),
}


@pytest.fixture(scope="module")
def bpe() -> str:
    """A byte-level BPE (the pre-tokenizer of Llama 3, Qwen and GPT-2 style vocabularies) as tokenizer.json text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    corpus = [SYSTEM, *(text for turn in TURNS for text in turn), "reasoning: the capital is the seat of government"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus * 4, trainer=trainer)
    return tok.to_str()


def _tokenizer(bpe: str, stem: str) -> PreTrainedTokenizerFast:
    vocab = TEMPLATES[stem]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(bpe),
        bos_token=vocab.bos,
        eos_token=vocab.eos,
        chat_template=template(stem),
        clean_up_tokenization_spaces=False,
    )
    tok.add_special_tokens({"additional_special_tokens": list(vocab.specials)})
    tok.add_tokens(list(vocab.added))
    return tok


def _chat(system: bool = True, **assistant_fields: dict) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    for i, (user, assistant) in enumerate(TURNS):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        messages[-1].update(assistant_fields.get(str(i), {}))
    return messages


def _trained_runs(tok, messages: list[dict], **spec) -> list[str]:
    """The trained tokens, decoded run by run (a run = consecutive trained tokens)."""
    ids, labels = render({"messages": messages}, "messages", DataSpec(format="messages", **spec), tok)
    assert len(ids) == len(labels)
    runs: list[list[int]] = []
    for i, label in enumerate(labels):
        if label == IGNORE_INDEX:
            continue
        assert label == ids[i]
        if i and labels[i - 1] != IGNORE_INDEX:
            runs[-1].append(label)
        else:
            runs.append([label])
    return [tok.decode(run, skip_special_tokens=False) for run in runs]


@pytest.mark.parametrize("stem", sorted(TEMPLATES))
def test_trained_tokens_are_the_assistant_texts_and_end_of_turn(bpe, stem, monkeypatch):
    tok = _tokenizer(bpe, stem)
    vocab = TEMPLATES[stem]
    messages = _chat(system=vocab.system)
    # One rendering of the whole conversation, never of prefixes: count the template's calls on this instance.
    calls: list[int] = []
    apply = tok.apply_chat_template

    def counted(conversation, *args, **kwargs):
        calls.append(len(conversation))
        return apply(conversation, *args, **kwargs)

    monkeypatch.setattr(tok, "apply_chat_template", counted)
    runs = _trained_runs(tok, messages)
    assert runs == [answer + vocab.end_of_turn for _, answer in TURNS]
    assert calls == [len(messages)]
    # The masked ids are the template's own tokenization of the conversation.
    ids, _ = render({"messages": messages}, "messages", DataSpec(format="messages", completion_only_loss=False), tok)
    assert render({"messages": messages}, "messages", DataSpec(format="messages"), tok)[0] == ids


@pytest.mark.parametrize(
    ("style", "stem"),
    [
        ("llama2", "microsoft-Phi-3.5-mini-instruct"),
        ("llama2", "mistralai-Mistral-Nemo-Instruct-2407"),
        ("gemma", "google-gemma-2-2b-it"),
    ],
)
def test_sentencepiece_tokenizers_of_the_families_that_ship_them(style, stem):
    # Offsets of "\u2581"-marked pieces and byte-fallback tokens map back to the text as well as byte-level ones.
    vocab = TEMPLATES[stem]
    tok = build_spm_tokenizer(style, vocab_size=400)
    tok.chat_template = template(stem)
    tok.add_special_tokens(
        {"additional_special_tokens": [t for t in vocab.specials if t not in tok.all_special_tokens]}
    )
    assert _trained_runs(tok, _chat(system=vocab.system)) == [answer + vocab.end_of_turn for _, answer in TURNS]


@pytest.mark.parametrize("stem", ["Qwen-Qwen3-0.6B", "Qwen3.5-4B"])
@pytest.mark.parametrize("form", ["reasoning_content", "think_in_content"])
def test_qwen_reasoning_is_trained_where_the_template_renders_it(bpe, stem, form):
    tok = _tokenizer(bpe, stem)
    thoughts = ("France: seat of government.", "Italy: the capital is Rome.")
    fields = {}
    for i, thought in enumerate(thoughts):
        if form == "reasoning_content":
            fields[str(i)] = {"reasoning_content": thought}
        else:
            fields[str(i)] = {"content": f"<think>\n{thought}\n</think>\n\n{TURNS[i][1]}"}
    messages = _chat(**fields)
    # Both templates drop the reasoning of turns before the last user message: only the last turn shows it.
    last = f"<think>\n{thoughts[1]}\n</think>\n\n{TURNS[1][1]}<|im_end|>"
    assert _trained_runs(tok, messages) == [TURNS[0][1] + "<|im_end|>", last]
    assert _trained_runs(tok, messages, train_reasoning=False) == [answer + "<|im_end|>" for _, answer in TURNS]


def test_empty_think_block_of_an_answer_without_reasoning_is_not_trained(bpe):
    tok = _tokenizer(bpe, "Qwen-Qwen3-0.6B")
    text = tok.apply_chat_template(_chat(), tokenize=False)
    assert f"<think>\n\n</think>\n\n{TURNS[1][1]}" in text  # Qwen3 writes an empty block on the last turn
    assert _trained_runs(tok, _chat()) == [answer + "<|im_end|>" for _, answer in TURNS]


def test_trimmed_text_and_a_reply_that_repeats_the_role_header(bpe):
    llama = _tokenizer(bpe, "meta-llama-Llama-3.1-8B-Instruct")
    messages = _chat(**{"0": {"content": f"  {TURNS[0][1]}\n"}})
    assert _trained_runs(llama, messages)[0] == TURNS[0][1] + "<|eot_id|>"  # Llama 3 renders content | trim
    qwen = _tokenizer(bpe, "Qwen-Qwen2.5-7B-Instruct")
    messages = [{"role": "user", "content": "Say assistant."}, {"role": "assistant", "content": "assistant"}]
    assert _trained_runs(qwen, messages) == ["assistant<|im_end|>"]


def test_answer_quoted_in_the_prompt_is_not_taken_for_the_reply(bpe):
    tok = _tokenizer(bpe, "Qwen-Qwen2.5-7B-Instruct")
    messages = [
        {"role": "system", "content": "Reply Rome (since 1871). when asked."},
        {"role": "user", "content": "Quote: Rome (since 1871)."},
        {"role": "assistant", "content": "Rome (since 1871)."},
    ]
    ids, labels = render({"messages": messages}, "messages", DataSpec(format="messages"), tok)
    trained = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
    assert tok.decode([ids[i] for i in trained]) == "Rome (since 1871).<|im_end|>"
    assert trained == list(range(trained[0], trained[-1] + 1)) and trained[-1] == len(ids) - 2  # before the "\n"


def test_a_template_that_rewrites_the_reply_is_refused_in_one_line(bpe):
    tok = _tokenizer(bpe, "Qwen-Qwen2.5-7B-Instruct")
    tok.chat_template = tok.chat_template.replace("message.content", "message.content | upper")
    with pytest.raises(
        FieldError, match=r"assistant message 2 does not appear verbatim.*completion_only_loss: false"
    ) as e:
        render({"messages": _chat()}, "messages", DataSpec(format="messages"), tok)
    assert e.value.field == "messages" and "\n" not in str(e.value)
    ids, labels = render(
        {"messages": _chat()}, "messages", DataSpec(format="messages", completion_only_loss=False), tok
    )
    assert labels[1:] == ids[1:]  # the fix the message names works
