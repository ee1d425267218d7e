"""Model cards parse as Hub cards and carry their fields; Modelfile TEMPLATEs reproduce five chat formats."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from go_template import render_go
from huggingface_hub import ModelCard

from slimtune.export.chat_formats import FORMATS
from slimtune.export.model_card import base_license, render_adapter_card, render_model_card, render_modelfile
from slimtune.models.tiny import CHAT_TEMPLATE

# The families' Hugging Face chat templates as their tokenizer_config.json ships them (Meta-Llama-3-8B-Instruct,
# gemma-2-2b-it, Mistral-7B-Instruct-v0.2, Phi-3-mini-4k-instruct; ChatML is the tiny models' own).
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] + "
    "'<|end|>\\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
# name -> (template, bos, eos, turn-end stop)
FAMILIES = {
    "ChatML": (CHAT_TEMPLATE, None, "<|endoftext|>", "<|im_end|>"),
    "Llama-3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
    "Gemma": (GEMMA, "<bos>", "<eos>", "<end_of_turn>"),
    "Mistral": (MISTRAL, "<s>", "</s>", "[INST]"),
    "Phi-3": (PHI3, None, "<|endoftext|>", "<|end|>"),
}
SYSTEM = {"role": "system", "content": "Answer in one word."}
CHATS = [
    [{"role": "user", "content": "Name a colour."}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Teal."},
        {"role": "user", "content": "Another one?\nPlease."},
    ],
]


def _hf(template: str, chat: list[dict], bos: str | None, eos: str) -> str:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, unk_token="x")),
        chat_template=template,
        eos_token=eos,
        **({"bos_token": bos} if bos else {}),
    )
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return text.removeprefix(bos) if bos else text  # llama.cpp adds BOS itself


def test_go_evaluator_understands_what_it_is_given():
    assert render_go('{{ range .Messages }}{{ if eq .Role "user" }}U{{ else }}A{{ end }}{{ end }}', CHATS[1]) == "UAU"
    with pytest.raises(AssertionError, match="unsupported"):
        render_go("{{ .Tools }}", CHATS[0])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_modelfile_template_renders_chats_like_the_hf_template(family):
    template, bos, eos, stop = FAMILIES[family]
    text = render_modelfile("m.gguf", template, eos_token=eos, bos_token=bos)
    assert f"# Chat format: {family}" in text
    go = re.search(r'TEMPLATE """(.*?)"""', text, re.S).group(1)
    (fmt,) = [f for f in FORMATS if f.name == family]
    chats = [*CHATS, *([[SYSTEM, *c] for c in CHATS] if fmt.system else [])]
    for chat in chats:
        expected = _hf(template, chat, bos, eos)
        assert render_go(go, chat) == expected, chat
    stops = re.findall(r"^PARAMETER stop (.*)$", text, re.M)
    assert json.dumps(stop) in stops and json.dumps(eos) in stops


def test_a_template_of_another_format_is_not_given_a_wrong_template():
    # Llama-3.1 writes a knowledge-cutoff header into the system turn: not the Llama-3 format.
    llama31 = LLAMA3.replace(
        "message['content'] | trim",
        "('Cutting Knowledge Date: December 2023\\n\\n' if "
        "message['role'] == 'system' else '') + message['content'] | trim",
    )
    text = render_modelfile("m.gguf", llama31, eos_token="<|eot_id|>", bos_token="<|begin_of_text|>")
    assert "TEMPLATE" not in text.replace("no TEMPLATE", "") and "matches none of" in text
    assert 'PARAMETER stop "<|eot_id|>"' in text


# ------------------------------------------------------------------ model cards


def _load(tmp_path: Path, text: str) -> ModelCard:
    path = tmp_path / "README.md"
    path.write_text(text, encoding="utf-8")
    return ModelCard.load(path)


def test_gguf_card_is_a_hub_card_with_its_fields(tmp_path):
    data_file = tmp_path / "secret-place" / "chats.jsonl"
    data_file.parent.mkdir()
    data_file.write_text("{}\n")
    card = _load(
        tmp_path,
        render_model_card(
            repo_id=None,
            name="my-run",
            base_model="Qwen/Qwen2.5-0.5B",
            quants=[{"file": "my-run-q8_0.gguf", "method": "q8_0", "size_bytes": 2**20}],
            datasets=[str(data_file)],
            lora={"r": 8},
            metrics={"eval_loss_after": 1.5},
            license_id="apache-2.0",
        ),
    )
    assert card.data.base_model == "Qwen/Qwen2.5-0.5B" and card.data.license == "apache-2.0"
    assert card.data.library_name == "gguf" and "gguf" in card.data.tags
    assert card.data.datasets is None  # a local file is not a Hub dataset
    assert str(data_file.parent) not in card.text and "`chats.jsonl`" in card.text
    assert "hf download" not in card.text and "llama-cli -m my-run-q8_0.gguf" in card.text
    assert "| eval_loss_after | 1.5 |" in card.text

    hub = _load(
        tmp_path,
        render_model_card(
            repo_id="someone/x",
            base_model="builtin:tiny-llama",
            quants=[{"file": "x.gguf", "method": "f16", "size_bytes": 1}],
            datasets=["someone/chats"],
        ),
    )
    assert hub.data.base_model is None and hub.data.datasets == ["someone/chats"]
    assert "hf download someone/x x.gguf" in hub.text


def test_adapter_card_is_a_peft_card(tmp_path):
    card = _load(
        tmp_path,
        render_adapter_card(base_model="meta-llama/Llama-3.2-1B", datasets=["org/data"], lora={"r": 16}, name="run"),
    )
    assert card.data.library_name == "peft" and card.data.base_model == "meta-llama/Llama-3.2-1B"
    assert card.data.datasets == ["org/data"] and "lora" in card.data.tags
    assert 'AutoModelForCausalLM.from_pretrained("meta-llama/Llama-3.2-1B")' in card.text


def test_license_comes_from_the_base_models_card(tmp_path):
    assert base_license(tmp_path) is None
    (tmp_path / "README.md").write_text("---\nlicense: llama3.2\n---\n# base\n")
    assert base_license(tmp_path) == "llama3.2"


def test_adapter_folder_gets_its_card_and_the_hub_id_of_its_base(tmp_path):
    from slimtune.export.model_card import write_adapter_card

    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": "/root/.cache/huggingface/hub/models--org--base/snapshots/abc", "r": 8})
    )
    (tmp_path / "README.md").write_text("---\nlibrary_name: peft\n---\n## Model Details\n[More Information Needed]\n")
    write_adapter_card(tmp_path, base_model="org/base", license_id="mit", name="run")
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config == {"base_model_name_or_path": "org/base", "r": 8}
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.base_model == "org/base" and card.data.license == "mit" and "More Information" not in card.text


def test_cards_carry_the_training_hyperparameters_as_trained(tmp_path):
    """As Trainer's and Axolotl's cards do: the batch figures are the ones training ran with (an out-of-memory
    retry halved the micro-batch and doubled accumulation here), not the spec's."""
    from slimtune.spec.schema import PipelineSpec
    from slimtune.tasks.gguf_convert_and_push import card_hyperparameters

    spec = PipelineSpec.model_validate(
        {
            "name": "run",
            "lora": {"r": 8, "alpha": 16, "dropout": 0.05},
            "data": {"path": "data.jsonl", "max_seq_length": 1024},
            "train": {"learning_rate": 1e-4, "max_steps": 30, "micro_batch_size": 4, "gradient_accumulation_steps": 2},
        }
    )
    trained = {"steps": 30, "micro_batch_size": 2, "gradient_accumulation_steps": 4, "optimizer": "adamw_torch_fused"}
    hyper = card_hyperparameters(spec, trained, "bfloat16")
    lora = {"r": 8, "alpha": 16.0, "dropout": 0.05, "target_modules": "all-linear"}
    for render in (
        lambda: render_model_card(
            repo_id=None,
            base_model="org/base",
            quants=[{"file": "f.gguf", "method": "f16", "size_bytes": 1}],
            lora=lora,
            hyperparameters=hyper,
        ),
        lambda: render_adapter_card(base_model="org/base", lora=lora, hyperparameters=hyper),
    ):
        text = _load(tmp_path, render()).text
        section = text.split("## Training hyperparameters")[1].split("##")[0]
        listed = dict(line[2:].split(": ", 1) for line in section.strip().splitlines())
        assert listed["learning_rate"] == "0.0001" and listed["training_steps"] == "30"
        assert (listed["train_batch_size"], listed["gradient_accumulation_steps"]) == ("2", "4")
        assert listed["total_train_batch_size"] == "8" and listed["optimizer"] == "adamw_torch_fused"
        assert listed["sequence_len"] == "1024" and listed["quantization"].startswith("4-bit nf4, double quant")
        assert listed["quantization"].endswith("compute bfloat16")
        assert "| r | 8 |" in text and "| dropout | 0.05 |" in text and "| target_modules | all-linear |" in text
