"""Text that ships next to the weights: Hub model cards (GGUF repo and adapter) and an Ollama Modelfile.

Cards are built with huggingface_hub's ModelCard/ModelCardData, so their YAML is what the Hub parses
(`base_model` only for a Hub id, which the Hub links and validates). Both take plain values, not the
pipeline spec, so they can be rendered and tested on their own. The Modelfile's TEMPLATE is written only
when the model's chat template is recognised (see `chat_formats`); a wrong template silently degrades
every answer, so an unrecognised one gets a comment instead of a guess.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from slimtune.core import atomic
from slimtune.export.chat_formats import FORMAT_NAMES, recognise

_HUB_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_BASE_TAGS = ("gguf", "llama.cpp", "ollama", "lora", "qlora", "slimtune")
_ADAPTER_TAGS = ("lora", "qlora", "peft", "slimtune")
_MODELFILE_DOCS = "https://github.com/ollama/ollama/blob/main/docs/modelfile.md#template"


def is_hub_id(value: str) -> bool:
    """A Hub repo id, not a local path that happens to contain one slash (nor builtin:tiny-*)."""
    return bool(_HUB_ID_RE.fullmatch(value)) and not Path(value).exists()


def base_license(model_dir: Path) -> str | None:
    """The license in the base model's own card (README.md YAML), if it has one."""
    readme = Path(model_dir) / "README.md"
    if not readme.is_file():
        return None
    try:
        return ModelCard.load(readme).data.license
    except Exception:  # a README without (valid) YAML metadata: no license known
        return None


def _card(data: ModelCardData, body: list[str]) -> str:
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n" + "\n".join(body)))


def _dataset_text(datasets: Sequence[str]) -> str:
    """Hub ids as links; a local file by its name only (its absolute path means nothing to a reader)."""
    if not datasets:
        return "Not recorded."
    return "\n".join(
        f"- [`{d}`](https://huggingface.co/datasets/{d})" if is_hub_id(d) else f"- A local file, `{Path(d).name}`."
        for d in datasets
    )


def _hub_datasets(datasets: Sequence[str]) -> list[str] | None:
    return [d for d in datasets if is_hub_id(d)] or None


def _training_sections(
    datasets: Sequence[str],
    lora: Mapping[str, object] | None,
    metrics: Mapping[str, object] | None,
    hyperparameters: Mapping[str, object] | None,
) -> list[str]:
    """The dataset, LoRA, hyperparameter and metrics sections both cards carry. The hyperparameters are a
    "- name: value" list under the names Trainer's and Axolotl's cards use, so readers (and scripts) that know
    those cards find learning_rate, train_batch_size, ... where they expect them."""
    return [
        "## Dataset",
        "",
        _dataset_text(datasets),
        "",
        "## LoRA configuration",
        "",
        *_table(("Setting", "Value"), (lora or {}).items()),
        "",
        "## Training hyperparameters",
        "",
        *([f"- {key}: {_cell(value)}" for key, value in (hyperparameters or {}).items()] or ["Not recorded."]),
        "",
        "## Training metrics",
        "",
        *_table(("Metric", "Value"), (metrics or {}).items()),
        "",
    ]


def _base_text(base_model: str) -> str:
    return f"[`{base_model}`](https://huggingface.co/{base_model})" if is_hub_id(base_model) else f"`{base_model}`"


def render_model_card(
    *,
    repo_id: str | None,
    base_model: str,
    quants: Sequence[Mapping[str, object]],
    datasets: Sequence[str] = (),
    lora: Mapping[str, object] | None = None,
    metrics: Mapping[str, object] | None = None,
    license_id: str | None = None,
    ollama_name: str | None = None,
    modelfile_name: str = "Modelfile",
    tags: Sequence[str] = (),
    name: str | None = None,
    hyperparameters: Mapping[str, object] | None = None,
) -> str:
    """The README.md for a folder (or Hub repo) of GGUF files: metadata, what was trained, how to run it.

    Args:
        repo_id: "namespace/name" the card is pushed to (the usage section downloads from it), or None
            for files kept local (the usage section then runs them from the folder).
        base_model: Hub id or local path of the model that was fine-tuned; only a Hub id goes into the
            metadata, since the Hub links (and validates) `base_model`.
        quants: One mapping per GGUF file with keys "file", "method" (e.g. "q4_k_m") and "size_bytes";
            the first is the one the usage section recommends.
        datasets: Hub ids or paths of the training data (a path appears by file name only).
        lora: LoRA settings to list (r, alpha, dropout, target modules, ...).
        metrics: Training results to list (final loss, tokens/s, peak memory, ...).
        license_id: license id as the Hub knows it (e.g. "apache-2.0"), if known.
        hyperparameters: Training settings as run (learning_rate, train_batch_size, ...), in list order.
        ollama_name: Model name in the Ollama commands; defaults to the repo (or run) name in lower case.
        modelfile_name: Name of the Modelfile next to the card.
        tags: Extra Hub tags.
        name: Title when there is no repo_id (the run name).
    """
    rows = [_quant_row(q, i) for i, q in enumerate(quants)]
    if not rows:
        raise ValueError("quants is empty; pass at least one GGUF file ({'file', 'method', 'size_bytes'})")
    title = repo_id.rsplit("/", 1)[-1] if repo_id else (name or "model")
    ollama_name = ollama_name or title.lower()
    data = ModelCardData(
        base_model=base_model if is_hub_id(base_model) else None,
        license=license_id,
        library_name="gguf",
        datasets=_hub_datasets(datasets),
        tags=list(dict.fromkeys([*_BASE_TAGS, *tags])),
        pipeline_tag="text-generation",
    )
    recommended = rows[0][0]
    fetch = [f"hf download {repo_id} {recommended} --local-dir ."] if repo_id else []
    fetch_ollama = [f"hf download {repo_id} {recommended} {modelfile_name} --local-dir ."] if repo_id else []
    body = [
        f"# {title}",
        "",
        f"GGUF export of a QLoRA fine-tune of {_base_text(base_model)}, trained and converted with slimtune.",
        "",
        "## Base model",
        "",
        _base_text(base_model),
        "",
        *_training_sections(datasets, lora, metrics, hyperparameters),
        "## Files",
        "",
        *_table(("File", "Quantization", "Size", "Bytes"), rows),
        "",
        "## Usage",
        "",
        "### llama.cpp",
        "",
        "```sh",
        *fetch,
        f"llama-cli -m {recommended}",
        "```",
        "",
        "### Ollama",
        "",
        "```sh",
        *fetch_ollama,
        f"ollama create {ollama_name} -f {modelfile_name}",
        f"ollama run {ollama_name}",
        "```",
        "",
    ]
    return _card(data, body)


def render_adapter_card(
    *,
    base_model: str,
    datasets: Sequence[str] = (),
    lora: Mapping[str, object] | None = None,
    metrics: Mapping[str, object] | None = None,
    license_id: str | None = None,
    name: str = "adapter",
    tags: Sequence[str] = (),
    hyperparameters: Mapping[str, object] | None = None,
) -> str:
    """The README.md of the LoRA adapter folder (instead of peft's empty template): a peft card whose
    `base_model` is the Hub id, so the Hub lists the adapter under its base."""
    data = ModelCardData(
        base_model=base_model if is_hub_id(base_model) else None,
        license=license_id,
        library_name="peft",
        datasets=_hub_datasets(datasets),
        tags=list(dict.fromkeys([*_ADAPTER_TAGS, *tags])),
        pipeline_tag="text-generation",
    )
    load = base_model if is_hub_id(base_model) else "BASE_MODEL_DIR"
    body = [
        f"# {name} (LoRA adapter)",
        "",
        f"A QLoRA adapter for {_base_text(base_model)}, trained with slimtune.",
        "",
        *_training_sections(datasets, lora, metrics, hyperparameters),
        "## Usage",
        "",
        "```python",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM",
        "",
        f'base = AutoModelForCausalLM.from_pretrained("{load}")',
        'model = PeftModel.from_pretrained(base, "path/to/this/adapter")',
        "```",
        "",
    ]
    return _card(data, body)


def write_adapter_card(adapter_dir: Path, *, base_model: str, **card: object) -> None:
    """Replace peft's empty README in `adapter_dir` with `render_adapter_card(...)`, and name a Hub base by
    its id in adapter_config.json (peft records the local snapshot path it loaded, useless elsewhere)."""
    config_path = adapter_dir / "adapter_config.json"
    if is_hub_id(base_model) and config_path.is_file():
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = base_model
        atomic.write_json(config_path, config)
    atomic.write_text(adapter_dir / "README.md", render_adapter_card(base_model=base_model, **card))  # type: ignore[arg-type]


def chat_template_outcome(
    gguf_filename: str, chat_template: str | None, *, eos_token: str | None = None, bos_token: str | None = None
) -> dict[str, str]:
    """What the Modelfile does with the chat template, for the run report: the format its TEMPLATE renders, or
    "none" with the reason and how to chat with the model anyway (the report must say so, not only the
    Modelfile: a GGUF without a TEMPLATE chats as gibberish in Ollama)."""
    fmt, _ = recognise(chat_template, bos_token, eos_token)
    if fmt is not None:
        return {"format": fmt.name}
    if not chat_template:
        return {"format": "none", "reason": "the tokenizer has no chat template: the model is prompted with raw text"}
    return {
        "format": "none",
        "reason": f"the chat template matches none of {', '.join(FORMAT_NAMES)}; no Go template reproduces it, "
        "so the Modelfile has no TEMPLATE",
        "run_with": f"llama-cli -m {gguf_filename} --jinja (the GGUF carries the template as "
        "tokenizer.chat_template), or Ollama's own template where it recognises the model "
        f"(ollama show NAME --template), or a TEMPLATE written by hand: {_MODELFILE_DOCS}",
    }


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
    fmt, default_system = recognise(chat_template, bos_token, eos_token)
    lines = [
        "# Ollama Modelfile generated by slimtune.",
        "# Build: ollama create NAME -f Modelfile",
        f"FROM ./{gguf_filename}",
        "",
    ]
    if fmt is not None:
        lines += [f"# Chat format: {fmt.name}", f'TEMPLATE """{fmt.template_for(eos_token or "")}"""', ""]
    elif chat_template:
        lines += [
            f"# The chat template matches none of {', '.join(FORMAT_NAMES)}: no Go template reproduces it,",
            "# so no TEMPLATE is written rather than a wrong one. The GGUF carries it as tokenizer.chat_template,",
            f"# which llama.cpp applies as is: llama-cli -m {gguf_filename} --jinja (or llama-server ... --jinja).",
            "# Ollama uses its own template where it recognises that one (see: ollama show NAME --template);",
            f"# otherwise write one by hand: {_MODELFILE_DOCS}",
            "",
        ]
    else:
        lines += ["# The tokenizer has no chat template: the model is prompted with raw text.", ""]
    system = system_prompt if system_prompt is not None else default_system
    if system:
        if '"""' in system:
            raise ValueError('system_prompt contains """, which a Modelfile cannot quote; remove it')
        lines += [f'SYSTEM """{system}"""', ""]
    stops = fmt.stops_for(eos_token or "") if fmt is not None else [eos_token] if eos_token else []
    lines += [f"PARAMETER stop {_quote(t)}" for t in dict.fromkeys(stops)]
    lines += [f"PARAMETER {key} {_format_value(value)}" for key, value in (parameters or {}).items()]
    return "\n".join(lines) + "\n"


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
