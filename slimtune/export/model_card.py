"""Text that ships next to the GGUF files: the Hub model card (README.md) and an Ollama Modelfile.

Both take plain values, not the pipeline spec, so they can be rendered and tested on their own. The
Modelfile's TEMPLATE is written only when the model's chat template is recognised as ChatML by
rendering it (through transformers' own renderer) and comparing with ChatML; a wrong template silently
degrades every answer, so an unrecognised one gets a comment instead of a guess.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import yaml

_HUB_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_BASE_TAGS = ("gguf", "llama.cpp", "ollama", "lora", "qlora", "slimtune")

# Ollama's Go template for ChatML: every message as <|im_start|>role\ncontent<|im_end|>\n, then the
# assistant header that asks for the reply (what add_generation_prompt=True renders).
_CHATML_OLLAMA = (
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
)
_CHATML_END = "<|im_end|>"
# A probe with a system turn, two user turns and one assistant turn covers every branch a ChatML template has.
_PROBE = (
    {"role": "system", "content": "SYS-0"},
    {"role": "user", "content": "USER-1"},
    {"role": "assistant", "content": "ASSISTANT-2"},
    {"role": "user", "content": "USER-3"},
)
_MODELFILE_DOCS = "https://github.com/ollama/ollama/blob/main/docs/modelfile.md#template"


def render_model_card(
    *,
    repo_id: str,
    base_model: str,
    quants: Sequence[Mapping[str, object]],
    dataset: str | None = None,
    lora: Mapping[str, object] | None = None,
    metrics: Mapping[str, object] | None = None,
    license_id: str | None = None,
    ollama_name: str | None = None,
    modelfile_name: str = "Modelfile",
    tags: Sequence[str] = (),
) -> str:
    """The README.md for a repo of GGUF files: YAML metadata, then what was trained and how to run it.

    Args:
        repo_id: "namespace/name" the card is pushed to (used in download commands).
        base_model: Hub id or local path of the model that was fine-tuned; only a Hub id goes into the
            metadata, since the Hub links (and validates) `base_model`.
        quants: One mapping per GGUF file with keys "file", "method" (e.g. "q4_k_m") and "size_bytes";
            the first is the one the usage section recommends.
        dataset: Hub id or path of the training data.
        lora: LoRA settings to list (r, alpha, dropout, target modules, ...).
        metrics: Training results to list (final loss, tokens/s, peak memory, ...).
        license_id: SPDX-like license id as the Hub knows it (e.g. "apache-2.0"), if known.
        ollama_name: Model name in the Ollama commands; defaults to the repo name in lower case.
        modelfile_name: Name of the Modelfile pushed next to the card.
        tags: Extra Hub tags.
    """
    rows = [_quant_row(q, i) for i, q in enumerate(quants)]
    if not rows:
        raise ValueError("quants is empty; pass at least one GGUF file ({'file', 'method', 'size_bytes'})")
    name = repo_id.rsplit("/", 1)[-1]
    ollama_name = ollama_name or name.lower()
    metadata: dict[str, object] = {}
    if _is_hub_id(base_model):
        metadata["base_model"] = base_model
    if dataset and _is_hub_id(dataset):
        metadata["datasets"] = [dataset]
    if license_id:
        metadata["license"] = license_id
    metadata["tags"] = list(dict.fromkeys([*_BASE_TAGS, *tags]))
    front = yaml.safe_dump(metadata, sort_keys=False, allow_unicode=True)
    recommended = rows[0][0]

    lines = [
        f"---\n{front}---",
        "",
        f"# {name}",
        "",
        f"GGUF export of a QLoRA fine-tune of `{base_model}`, trained and converted with slimtune.",
        "",
        "## Base model",
        "",
        f"`{base_model}`" + (f" (https://huggingface.co/{base_model})" if _is_hub_id(base_model) else ""),
        "",
        "## Dataset",
        "",
        f"`{dataset}`" if dataset else "Not recorded.",
        "",
        "## LoRA configuration",
        "",
        *_table(("Setting", "Value"), (lora or {}).items()),
        "",
        "## Training metrics",
        "",
        *_table(("Metric", "Value"), (metrics or {}).items()),
        "",
        "## Files",
        "",
        *_table(("File", "Quantization", "Size", "Bytes"), rows),
        "",
        "## Usage",
        "",
        "### llama.cpp",
        "",
        "```sh",
        f"hf download {repo_id} {recommended} --local-dir .",
        f"llama-cli -m {recommended}",
        "```",
        "",
        "### Ollama",
        "",
        "```sh",
        f"hf download {repo_id} {recommended} {modelfile_name} --local-dir .",
        f"ollama create {ollama_name} -f {modelfile_name}",
        f"ollama run {ollama_name}",
        "```",
        "",
    ]
    return "\n".join(lines)


def render_modelfile(
    gguf_filename: str,
    chat_template: str | None,
    *,
    eos_token: str | None = None,
    bos_token: str | None = None,
    system_prompt: str | None = None,
    parameters: Mapping[str, object] | None = None,
) -> str:
    """An Ollama Modelfile for one GGUF file that sits next to it.

    Args:
        gguf_filename: File name of the GGUF, relative to the Modelfile.
        chat_template: The tokenizer's Jinja chat template, or None.
        eos_token: End-of-sequence token; becomes a stop sequence so replies end where training ended them.
        bos_token: Beginning-of-sequence token the template may print first (llama.cpp adds it itself).
        system_prompt: Default system prompt; if None, the template's own default (if any) is used.
        parameters: Extra `PARAMETER` lines, e.g. {"temperature": 0.7, "num_ctx": 4096}.
    """
    if not gguf_filename or "/" in gguf_filename or "\\" in gguf_filename:
        raise ValueError(f"gguf_filename {gguf_filename!r} must be a bare file name next to the Modelfile")
    recognised, default_system = _match_chatml(chat_template, bos_token, eos_token)
    lines = [
        "# Ollama Modelfile generated by slimtune.",
        "# Build: ollama create NAME -f Modelfile",
        f"FROM ./{gguf_filename}",
        "",
    ]
    if recognised:
        lines += [f'TEMPLATE """{_CHATML_OLLAMA}"""', ""]
    elif chat_template:
        lines += [
            "# The chat template is not ChatML, so no TEMPLATE was derived; Ollama falls back to the",
            f"# template it reads from the GGUF, if any. Write one by hand: {_MODELFILE_DOCS}",
            "",
        ]
    else:
        lines += ["# The tokenizer has no chat template: the model is prompted with raw text.", ""]
    system = system_prompt if system_prompt is not None else default_system
    if system:
        if '"""' in system:
            raise ValueError('system_prompt contains """, which a Modelfile cannot quote; remove it')
        lines += [f'SYSTEM """{system}"""', ""]
    stops = [t for t in (eos_token, _CHATML_END if recognised else None) if t]
    lines += [f"PARAMETER stop {_quote(t)}" for t in dict.fromkeys(stops)]
    lines += [f"PARAMETER {key} {_format_value(value)}" for key, value in (parameters or {}).items()]
    return "\n".join(lines) + "\n"


def _match_chatml(chat_template: str | None, bos_token: str | None, eos_token: str | None) -> tuple[bool, str | None]:
    """(whether the template renders ChatML, the system prompt it adds when the chat has none)."""
    if not chat_template:
        return False, None
    full = _render(chat_template, list(_PROBE), bos_token, eos_token)
    if full != _chatml(_PROBE):
        return False, None
    without_system = list(_PROBE[1:])
    rendered = _render(chat_template, without_system, bos_token, eos_token)
    if rendered == _chatml(without_system):
        return True, None
    # Qwen-style templates insert a default system turn: accept it if the rest is exactly ChatML.
    head = "<|im_start|>system\n"
    if rendered is not None and rendered.startswith(head):
        default = rendered[len(head) :].split(_CHATML_END, 1)[0]
        if rendered == _chatml([{"role": "system", "content": default}, *without_system]):
            return True, default
    return False, None


def _render(
    chat_template: str, messages: list[dict[str, str]], bos_token: str | None, eos_token: str | None
) -> str | None:
    """Render with transformers' renderer (what the tokenizer uses); None if the template rejects the chat."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, _ = render_jinja_template(
            [messages],
            chat_template=chat_template,
            add_generation_prompt=True,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
        )
    except Exception:
        return None
    text = rendered[0]
    return text[len(bos_token) :] if bos_token and text.startswith(bos_token) else text


def _chatml(messages: Sequence[Mapping[str, str]]) -> str:
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return body + "<|im_start|>assistant\n"


def _is_hub_id(value: str) -> bool:
    """A Hub repo id, not a local path that happens to contain one slash."""
    return bool(_HUB_ID_RE.fullmatch(value)) and not Path(value).exists()


def _quant_row(quant: Mapping[str, object], index: int) -> tuple[str, str, str, str]:
    missing = [key for key in ("file", "method", "size_bytes") if key not in quant]
    if missing:
        raise ValueError(
            f"quants[{index}] lacks {', '.join(missing)}; "
            "give each GGUF file as {'file': ..., 'method': ..., 'size_bytes': ...}"
        )
    size = int(quant["size_bytes"])  # type: ignore[call-overload]
    return str(quant["file"]), str(quant["method"]), _human_size(size), str(size)


def _human_size(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size} B"


def _table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    cells = [[_cell(value) for value in row] for row in rows]
    if not cells:
        return ["Not recorded."]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in cells]


def _cell(value: object) -> str:
    if isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, (list, tuple, set, frozenset)):
        text = ", ".join(str(v) for v in (sorted(value) if isinstance(value, (set, frozenset)) else value))
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _quote(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _format_value(value: object) -> str:
    return _quote(value) if isinstance(value, str) else str(value)
